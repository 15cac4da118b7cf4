"""An adapter on one projection site of the sparse decode step (SATS paper §4.2 'Fine-tuning Methods').

`LoraSite` is the part of `SparseLinear` that holds a LoRA adapter unmerged: y = x_m W^T +
s * B (A x_m), s = alpha / r. It stores A^T (in, r) and B^T (r, out) in the weight's dtype, the
layout of `kernels.lora_gemv` (A input-sparse like W: a dropped channel's row of A^T is never read
by the one-token kernels), the scale, and the kernel's workspace. Where no one-token kernel runs
(a prefill, a decode batch) the adapter's term is added in PyTorch (`_plus_lora`). The model-level
calls are in `projection.lora_attach`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sparsedecode.errors import InputError
from sparsedecode.kernels.common import interpreting, lora_workspace
from sparsedecode.kernels.lora_gemv import lora_delta
from sparsedecode.kernels.sparse_gemv import default_config

BUFFERS = ("lora_a_t", "lora_b_t", "lora_ws_acc", "lora_ws_count")


class LoraSite:
    """Adapter state and math of a projection module with `w_t` (in, out), `in_features`,
    `out_features` and `site` (mixed into `SparseLinear`, an nn.Module)."""

    LORA_FIXED = ("lora_ws_acc",)  # float32 whatever the model's dtype (FixedDtypeBuffers)

    def _init_lora(self) -> None:
        for name in BUFFERS:
            self.register_buffer(name, None, persistent=False)  # set by attach_lora_
        self.lora_scale = 0.0

    def attach_lora_(self, a: Tensor, b: Tensor, scale: float) -> None:
        """Add an adapter's s * B (A x) to this site's output: a (r, in) and b (out, r) as a PEFT
        checkpoint holds them, scale = alpha / r. Stored once as A^T (in, r) and B^T (r, out) in
        the weight's dtype and device; a second call replaces the adapter. A decode step captured
        or compiled before this call keeps running without it: capture again."""
        if (a.dim() != 2 or b.dim() != 2 or a.shape[0] < 1 or a.shape[1] != self.in_features
                or b.shape != (self.out_features, a.shape[0])):
            raise InputError(f"the adapter of {self.site or 'a site'} must be A (r, {self.in_features}) and "
                             f"B ({self.out_features}, r); got {tuple(a.shape)} and {tuple(b.shape)}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise InputError(f"the adapter scale of {self.site or 'a site'} must be a finite number; got {scale!r}")
        r, dev, dtype = a.shape[0], self.w_t.device, self.w_t.dtype
        self.lora_a_t = a.detach().to(dev, dtype).t().contiguous()  # (in, r)
        self.lora_b_t = b.detach().to(dev, dtype).t().contiguous()  # (r, out)
        self.lora_scale = float(scale)
        self.lora_ws_acc, self.lora_ws_count = lora_workspace(self.out_features, r, dev)  # zero between calls

    def detach_lora_(self) -> None:
        """Drop the adapter: the site computes its base projection again."""
        for name in BUFFERS:
            setattr(self, name, None)
        self.lora_scale = 0.0

    @property
    def has_lora(self) -> bool:
        return self.lora_a_t is not None

    @property
    def lora(self) -> tuple[Tensor, Tensor, float] | None:
        """The kernel's adapter operands (a_t, b_t, scale), or None."""
        return None if self.lora_a_t is None else (self.lora_a_t, self.lora_b_t, self.lora_scale)

    def lora_merged(self) -> Tensor:
        """W^T + s * A^T B^T (in, out) in float32: the merged weight this site's adapter equals."""
        w = self.w_t.detach().float()
        return w if self.lora_a_t is None else w + self.lora_scale * (self.lora_a_t.float() @ self.lora_b_t.float())

    def _ws(self) -> tuple[Tensor, Tensor]:
        """The kernel's workspace: with an adapter, the one sized for its tiles' u."""
        return (self.ws_acc, self.ws_count) if self.lora_a_t is None else (self.lora_ws_acc, self.lora_ws_count)

    def _plus_lora(self, y: Tensor, x: Tensor, keep: Tensor | None = None) -> Tensor:
        """y plus the adapter's term of x's rows (each masked by `keep`; None: dense), in PyTorch."""
        if self.lora_a_t is None:
            return y
        return y + lora_delta(x, self.lora_a_t, self.lora_b_t, self.lora_scale, keep).reshape(y.shape)


class LoraConcat:
    """The adapters of a fused launch's sites (q|k|v, gate|up), side by side for one segmented
    launch (mixed into `SparseConcat`): A^T (in, S r) with the sites' A^T in turn, B^T (r, sum of
    outs), one scale per site, 0 for a site without an adapter (the kernel reads none of its
    columns). Built from the sites' own adapters (a copy: the sites keep theirs, contiguous, for
    their own calls and prefill) by `refresh_lora_`, which `projection.lora_attach` calls after
    every attach and detach; an eager call rebuilds it when a site's adapter changed since.
    Where the sites' ranks differ or a segment bound is not a whole column tile of the launch,
    there is none and each site runs its own call (docs/kernels/lora_gemv.md)."""

    CONCAT_BUFFERS = ("lora_a_cat", "lora_b_cat", "lora_ws_acc", "lora_ws_count")
    LORA_FIXED = ("lora_ws_acc",)

    def _init_lora_cat(self) -> None:
        for name in self.CONCAT_BUFFERS:
            self.register_buffer(name, None, persistent=False)
        self.lora_scales: list[float] = []
        self._lora_of: list = []
        self.refresh_lora_()

    def refresh_lora_(self) -> None:
        """Build the side-by-side adapter from the sites' adapters (none where no site holds one,
        the ranks differ, the kernel does not run here or the segments are not whole tiles)."""
        for name in self.CONCAT_BUFFERS:
            setattr(self, name, None)
        self.lora_scales, self._lora_of = [], [m.lora_a_t for m in self.sites]
        held = [m for m in self.sites if m.lora_a_t is not None]
        ranks = {m.lora_a_t.shape[1] for m in held}
        if len(ranks) != 1 or not self._lora_launchable():
            return
        r, w = ranks.pop(), self.w_t
        self.lora_a_cat = torch.cat([m.lora_a_t if m.lora_a_t is not None else w.new_zeros(m.in_features, r)
                                     for m in self.sites], dim=1)
        self.lora_b_cat = torch.cat([m.lora_b_t if m.lora_b_t is not None else w.new_zeros(r, m.out_features)
                                     for m in self.sites], dim=1)
        self.lora_scales = [m.lora_scale if m.lora_a_t is not None else 0.0 for m in self.sites]
        self.lora_ws_acc, self.lora_ws_count = lora_workspace(w.shape[1], r, w.device)

    def _lora_launchable(self) -> bool:
        """Whether the segmented kernel runs here with its segment bounds on its tile grid."""
        w = self.w_t
        if not (w.is_cuda or interpreting()):
            return False
        block_n = default_config(w.shape[0], w.shape[1], w.dtype, w.device, self.options.programs_per_sm)[0]
        return all(sum(self.widths[:j + 1]) % block_n == 0 for j in range(len(self.widths) - 1))

    def lora_launch(self):
        """(lora=, ws=) of the one segmented launch: the side-by-side adapter and its workspace, or
        (None, None) where no site holds an adapter; rebuilt first in eager mode if a site's adapter
        changed. None as the first item with a site holding one: the sites run their own calls."""
        if not torch.compiler.is_compiling() and any(
                a is not b for a, b in zip(self._lora_of, (m.lora_a_t for m in self.sites), strict=True)):
            self.refresh_lora_()
        if self.lora_a_cat is None:
            return None, None
        return (self.lora_a_cat, self.lora_b_cat, self.lora_scales), (self.lora_ws_acc, self.lora_ws_count)


__all__ = ["LoraConcat", "LoraSite"]
