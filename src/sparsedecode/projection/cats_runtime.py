"""CATS in the decode step: gate GEMV -> SiLU -> row-gather up -> sparse down (SATS paper §2, CATS).

CATS thresholds the MLP activation itself: channel j of a layer is kept iff
|SiLU(gate(x))_j| > t. A dropped channel zeroes that entry of SiLU(gate)·up,
so it needs neither row j of up nor column j of down. `CatsMLP` runs the gate
projection dense and, on CUDA (or under TRITON_INTERPRET=1), feeds SiLU(gate)
to `kernels.gather_gemv.cats_up`, which reads only the up rows of kept channels
and returns the gated product h with exact zeros for dropped ones; down takes h
as a `SparseLinear` at threshold 0, whose input-sparse GEMV skips down's rows
for every dropped channel. Both halves move real bytes: about keep x (up + down).
On CPU `kernels.cpu_gemv` does the same (a C kernel built at first use: `cats_up_cpu` reads
the up rows of kept channels, down's input-sparse GEMV the down rows); where it could not be
built, the masked reference (up read whole and masked: 'masked', it saves no bytes). The realized keep it reports is over the
SiLU(gate) channels, as the calibrator targets; the mask is compared in float32
on every path, so CPU and CUDA keep the same channels. Prefill (several tokens)
runs the dense MLP, as in both papers.

Token routing (SATS paper §3.2) picks the path per decode step from the current
token id alone. A `Router` holds a (V,) bool table on the device, sparse or not
per token id, and the engine's static token tensor; `Router.step`, run inside
the decode step before the layers, looks the token up into a shared 0-d flag
(a device gather: no host sync, capturable in a CUDA graph) and counts routed
steps. Each routed `CatsMLP` reads the flag: on CUDA its effective threshold
is where(flag, t, -1), so a dense-routed step keeps every channel and reads
every row of up and down (the base path's bytes; equal to the dense MLP up to
the kernels' fp32 summation order). On CPU the flag is read on the host: a dense-routed
step runs the original MLP's ops (bitwise; its down weight restored in the original layout), a
sparse-routed one the unrouted CATS step (the masked reference, without the CPU kernel,
computes both products and selects one with torch.where).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from sparsedecode.kernels.common import interpreting as _interpreting
from sparsedecode.kernels.common import keep_mask, workspace
from sparsedecode.kernels.cpu_gemv import cats_up_cpu, has_entry
from sparsedecode.kernels.gather_gemv import cats_up
from sparsedecode.kernels.lora_gemv import lora_delta
from sparsedecode.projection.sparse_linear import FixedDtypeBuffers, SparseLinear


def _cpu_up(w: Tensor) -> bool:
    """Whether CATS's up runs `kernels.cpu_gemv.cats_up_cpu` on this CPU weight (built kernel, dtype)."""
    return w.device.type == "cpu" and not _interpreting() and has_entry("sd_gather_rows", w.dtype)


KEEP_ALL = -1.0  # an effective threshold below every |SiLU(gate)|: the dense path


class CatsMLP(FixedDtypeBuffers):
    """A SwiGLU MLP whose one-token path drops channels with |SiLU(gate)| <= threshold.

    up_proj is kept as an nn.Linear whose weight is made row-major (N, K) once where the
    row-gather kernel runs (a CPU model stores it column-major for faster CPU GEMV).
    """

    FIXED_DTYPE = ("threshold", "ws_acc", "up_ws_acc")
    UP_LORA = ("up_a_t", "up_b_t", "up_ws_acc", "up_ws_count")  # up's adapter apart (attach_up_lora_)

    def __init__(self, mlp: nn.Module, threshold: float, site: str = "", track: bool = False):
        super().__init__()
        up = mlp.up_proj.to_linear() if isinstance(mlp.up_proj, SparseLinear) else mlp.up_proj
        self.gate_proj, self.up_proj = mlp.gate_proj, up
        down = mlp.down_proj
        self.down_proj = down if isinstance(down, SparseLinear) else SparseLinear.from_linear(down, 0.0)
        # The original module, emptied of its projections (they live here now; keeping its
        # down would hold a second copy), so `uncats_` can put it back.
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(mlp, name, None)
        self._shell = [mlp]  # a list: not a submodule
        self.site = site
        self.track = track
        dev = up.weight.device
        self.up_column_major = not up.weight.is_contiguous()  # its layout before: `uncats_` restores it
        if (dev.type == "cuda" or _interpreting() or _cpu_up(up.weight)) and not up.weight.is_contiguous():
            up.weight = nn.Parameter(up.weight.detach().contiguous(), requires_grad=False)  # (N, K)
        self.register_buffer("threshold", torch.tensor(float(threshold), device=dev), persistent=False)
        # int64 counts: model.to(dtype) casts floating buffers only
        self.register_buffer("kept", torch.zeros(2, dtype=torch.int64, device=dev), persistent=False)
        acc, count = workspace(up.out_features, dev)
        self.register_buffer("ws_acc", acc, persistent=False)  # (d_ff,) fp32, zero between calls
        self.register_buffer("ws_count", count, persistent=False)
        self.router: Router | None = None  # token routing (set_router); None: always sparse
        self.down_dense = None  # CPU routing only: down as the original nn.Linear
        for name in self.UP_LORA:
            self.register_buffer(name, None, persistent=False)
        self.up_scale = 0.0

    def attach_up_lora_(self, a: Tensor, b: Tensor, scale: float) -> None:
        """Hold an adapter of up apart (SATS paper §4.2): A (r, in), B (out, r) as PEFT holds them,
        scale alpha / r; stored as A^T (in, r) and B^T (r, out) in up's dtype. One-token calls run
        `cats_up(lora=...)`: u = A x by one dense launch, then s B_j . u for the kept rows j only."""
        from sparsedecode.errors import InputError

        up = self.up_proj
        if (a.dim() != 2 or b.dim() != 2 or a.shape[0] < 1 or a.shape[1] != up.in_features
                or b.shape != (up.out_features, a.shape[0])):
            raise InputError(f"the up adapter of {self.site or 'a CATS MLP'} must be A (r, {up.in_features}) and "
                             f"B ({up.out_features}, r); got {tuple(a.shape)} and {tuple(b.shape)}")
        dev, dtype = up.weight.device, up.weight.dtype
        self.up_a_t = a.detach().to(dev, dtype).t().contiguous()
        self.up_b_t = b.detach().to(dev, dtype).t().contiguous()
        self.up_scale = float(scale)
        self.up_ws_acc, self.up_ws_count = workspace(a.shape[0], dev)  # u's launch, zero between calls

    def detach_up_lora_(self) -> None:
        for name in self.UP_LORA:
            setattr(self, name, None)
        self.up_scale = 0.0

    @property
    def has_up_lora(self) -> bool:
        return self.up_a_t is not None

    def _up(self, x: Tensor) -> Tensor:
        """up(x) of every channel (prefill, dense-routed and masked steps), with its adapter's term."""
        y = self.up_proj(x)
        return y if self.up_a_t is None else y + lora_delta(x, self.up_a_t, self.up_b_t, self.up_scale)

    def set_router(self, router: Router | None) -> None:
        """Route this MLP's decode steps by `router` (None: every step sparse, as before).

        On CPU a routed MLP keeps a second copy of down in the original nn.Linear layout,
        so its dense-routed steps compute exactly what the original MLP computes."""
        self.router = router
        kernel = self.up_proj.weight.is_cuda or _interpreting()
        if router is None or kernel:
            self.down_dense = None
        elif self.down_dense is None:
            down = self.down_proj
            self.down_dense = down.to_linear() if isinstance(down, SparseLinear) else down

    def forward(self, x: Tensor) -> Tensor:
        """x (..., d) -> (..., d)."""
        act = F.silu(self.gate_proj(x))  # (..., d_ff)
        if x.shape[:-1].numel() != 1:
            return self.down_proj(act * self._up(x))  # prefill: dense (down runs dense too)
        flag = None if self.router is None else self.router.flag  # 0-d bool: this step is sparse
        # the threshold this step applies: a dense-routed step keeps every channel
        thr = self.threshold if flag is None else torch.where(flag, self.threshold, KEEP_ALL)
        if self.track:
            keep = keep_mask(act, thr)  # (1, d_ff)
            self.kept[0] += keep.sum()
            self.kept[1] += keep.numel()
        if x.is_cuda or _interpreting():
            # reads only the up rows of kept channels; h is 0 exactly where dropped
            lora = None if self.up_a_t is None else (self.up_a_t, self.up_b_t, self.up_scale,
                                                     (self.up_ws_acc, self.up_ws_count))
            h = cats_up(x, self.up_proj.weight, act, thr, self.up_proj.bias,
                        ws=(self.ws_acc, self.ws_count), lora=lora)  # (..., d_ff)
            return self.down_proj(h)  # zeros: down skips those rows
        if _cpu_up(self.up_proj.weight):  # the CPU kernels read only kept rows of up and down
            if flag is not None and not torch.compiler.is_compiling() and not bool(flag):
                return self._down_dense(act * self._up(x))  # dense-routed: the original MLP's ops
            # (traced: a dense-routed step keeps every channel through the kernels, `thr`)
            h = cats_up_cpu(x, self.up_proj.weight, act, thr, self.up_proj.bias)
            if self.up_a_t is not None:  # the adapter's term of the kept rows, in PyTorch (reads all of B)
                delta = lora_delta(x, self.up_a_t, self.up_b_t, self.up_scale)
                h = h + torch.where(keep_mask(act, thr), act * delta, torch.zeros_like(h))
            return self.down_proj(h)  # zeros: down skips those rows (kernels.cpu_gemv)
        up = self._up(x)  # (..., d_ff)
        h = (act * keep_mask(act, self.threshold)) * up  # masked: up read whole
        sparse = self.down_proj(h)  # (..., d)
        if flag is None:
            return sparse
        return torch.where(flag, sparse, self._down_dense(act * up))  # the original MLP's ops

    def _down_dense(self, h: Tensor) -> Tensor:
        """The original MLP's down of h (CPU routing), plus down's adapter where it holds one."""
        y = self.down_dense(h)
        return self.down_proj._plus_lora(y, h) if isinstance(self.down_proj, SparseLinear) else y

    def realized_keep(self) -> float:
        """Kept SiLU(gate) channels over channels seen by tracked one-token calls (a
        dense-routed step keeps, and reads, all of them)."""
        kept, total = self.kept.tolist()
        return kept / total if total else float("nan")


class Router:
    """Which MLP path each decode step takes, from its token id alone (SATS paper §3.2).

    sparse_of: (V,) bool on the device, True where a token id takes the CATS path;
    tok: the engine's static (1, 1) token input. `step` (inside the decode step, before
    the layers) sets `flag`, the 0-d bool every routed CatsMLP reads, and adds to
    `counts` = [sparse-routed steps, steps] (int64, on the device: read on request).
    """

    def __init__(self, sparse_of: Tensor, tok: Tensor):
        if sparse_of.dim() != 1 or sparse_of.dtype != torch.bool:
            raise ValueError(f"sparse_of must be a (V,) bool tensor, got {sparse_of.dtype} "
                             f"{tuple(sparse_of.shape)}")
        self.sparse_of = sparse_of.to(tok.device)  # (V,)
        self.tok = tok  # (1, 1)
        self.flag = torch.zeros((), dtype=torch.bool, device=tok.device)
        self.counts = torch.zeros(2, dtype=torch.int64, device=tok.device)

    def step(self) -> None:
        # index_select with a (1,) index: a device gather (x[t] with a 0-d t would call .item())
        sparse = self.sparse_of.index_select(0, self.tok.reshape(1)).reshape(())  # 0-d bool
        self.flag.copy_(sparse)
        self.counts[0] += sparse.long()
        self.counts[1] += 1

    def fraction(self) -> float:
        """Sparse-routed decode steps over decode steps since the last reset (nan before any)."""
        sparse, total = self.counts.tolist()
        return sparse / total if total else float("nan")

    def reset(self) -> None:
        self.counts.zero_()


def uncats_(model) -> int:
    """Put the original dense MLP back in every layer that runs a `CatsMLP` (same weights, up and
    down in their original layouts); returns how many were replaced."""
    n = 0
    for layer in model.layers:
        mlp = layer.mlp
        if isinstance(mlp, CatsMLP):
            shell = mlp._shell[0]
            down = mlp.down_proj
            shell.gate_proj, shell.up_proj = mlp.gate_proj, mlp.up_proj
            w = shell.up_proj.weight
            if mlp.up_column_major and w.is_contiguous():  # made row-major for the row-gather
                shell.up_proj.weight = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=False)
            shell.down_proj = down.to_linear() if isinstance(down, SparseLinear) else down
            layer.mlp = shell
            n += 1
    return n


def cats_(model, thresholds: dict[str, float], track: bool = False) -> list[CatsMLP]:
    """Replace the MLP of every layer by a `CatsMLP` with its 'layers.{i}.act' threshold."""
    from sparsedecode.errors import InputError

    out = []
    for i, layer in enumerate(model.layers):
        key = f"layers.{i}.act"
        if key not in thresholds:
            raise InputError(f"no CATS threshold for '{key}'; a CATS file has one per layer")
        mlp = layer.mlp
        if isinstance(mlp, CatsMLP):
            mlp.threshold.fill_(float(thresholds[key]))
            mlp.track = track
        else:
            mlp = CatsMLP(layer.mlp, thresholds[key], site=key, track=track)
            layer.mlp = mlp
        out.append(mlp)
    return out
