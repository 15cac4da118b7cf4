"""Input-sparse projections in the decode step (ByteCross §3.2, §4.1, App. A).

TEAL-style projection sparsity replaces each of the seven projections of a layer
(q, k, v, o, gate, up, down) by a `SparseLinear` with one magnitude threshold per
(layer, projection): during decode, input channel i is kept iff |x_i| > t and only
the weights of kept channels are read. Prefill stays dense, as in both papers.

`SparseLinear` stores the weight once, transposed to (in, out) so that each
input channel's outputs are contiguous and a dropped channel is a skipped row
(`kernels.sparse_gemv`). On CUDA one token runs the Triton kernel; on CPU it runs
`kernels.cpu_gemv`, a C kernel built at first use that reads only the kept rows, or, where no
C compiler could build it, `sparse_gemv_ref`, the masked reference, which computes the same
outputs but reads every weight ('masked': it saves no bytes and no time; `cpu_rows` says which).

Each sparse module holds the `GemvOptions` it launches with (`options`; `sparsify_(...,
gemv=)`, `set_gemv_options_`), passed to the kernel as plain values: a decode step captured
or compiled before the options change keeps the old ones, so capture again.

A decode batch (x of shape (B, 1, in), one token per sequence, B > 1) keeps each token's own
channels and reads the weight once, in the rows of the union of the kept channels (ByteCross
§3.3, App. F): `kernels.union_gemv` on CUDA, `sparse_gemv_union_cpu` on CPU; a dense site
(READ_ALL) runs one GEMM. The realized union (union rows over rows, summed over calls) is
counted beside the keep when `track` is on (`realized_union`).

The realized keep, the fraction of projection weight bytes actually read, is
counted on the device when `track` is on: each sparse call adds [kept channels,
channels] to a float64 buffer in place (no host sync, capturable), and
`realized_projection_keep` weights the sites by their parameter counts (§4.1:
the paper's 50% thresholds read 51% of the projection bytes).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from sparsedecode.errors import InputError
from sparsedecode.kernels.common import interpreting, keep_mask, linear, workspace
from sparsedecode.kernels.cpu_gemv import (
    has_entry,
    sparse_gemv_cpu,
    sparse_gemv_lora_cpu,
    sparse_gemv_segs_cpu,
    sparse_gemv_union_cpu,
)
from sparsedecode.kernels.lora_gemv import lora_gemv_ref
from sparsedecode.kernels.options import GemvOptions
from sparsedecode.kernels.sparse_gemv import sparse_gemv, sparse_gemv_ref
from sparsedecode.projection.lora_site import LoraConcat, LoraSite
from sparsedecode.projection.thresholds import MODULE_OF
from sparsedecode.projection.thresholds import site_key as threshold_key

SITE_KEYS = {module: short for short, module in MODULE_OF.items()}  # 'gate_proj' -> 'gate'
FF_SITES = ("gate_proj", "up_proj", "down_proj")
# The threshold of a dense site run by the GEMV (GemvOptions.dense): |x| > -inf keeps every row,
# except a NaN input channel, which the kernel's comparison drops where F.linear would spread it
READ_ALL = float("-inf")


def kernel_runs(t: Tensor) -> bool:
    """Whether the sparse GEMV kernel runs for operands on t's device (CUDA, or TRITON_INTERPRET=1):
    where it does, SwiGLU's product and the layers' norms and residual adds run inside the launches
    (docs/kernels/sparse_gemv.md#fuse-swiglu, #fuse-norms); elsewhere (CPU eager) they run apart."""
    return t.is_cuda or interpreting()


def cpu_rows(w_t: Tensor) -> bool:
    """Whether one-token calls on CPU run `kernels.cpu_gemv` (reads only kept rows) rather than the
    masked reference: the kernel was built (a C compiler) and has w_t's dtype."""
    return w_t.device.type == "cpu" and has_entry("sd_gemv_rows", w_t.dtype)


def runtime(thresholds, device: torch.device, dtype: torch.dtype) -> str:
    """What runs one-token calls of `thresholds` (a `Thresholds`) on `device`, for users and records:
    on CUDA the Triton kernels; on CPU the C kernels that read only kept rows (`kernels.cpu_gemv`),
    or the masked reference (every weight read) where they could not be built, with the reason."""
    from sparsedecode.kernels.cpu_gemv import cpu_kernel
    from sparsedecode.projection.thresholds import ACT_SITE

    cats = ACT_SITE in thresholds.sites
    if torch.device(device).type != "cpu":
        return "row-gather up + sparse down GEMV" if cats else "sparse GEMV"
    k = cpu_kernel()
    if k.supports(dtype):
        return "CPU row-gather up + sparse down (kept rows only)" if cats else "CPU sparse GEMV (kept rows only)"
    return f"masked reference (reads every weight: {k.reason or f'no {dtype} kernel'})"


def _check_options(options) -> GemvOptions:
    if options is None:
        return GemvOptions()
    if not isinstance(options, GemvOptions):
        raise InputError(f"gemv options must be a GemvOptions; got {type(options).__name__}")
    return options


class FixedDtypeBuffers(nn.Module):
    """A module whose buffers named in FIXED_DTYPE follow .to(device) but never .to(dtype):
    model.to(bf16) must not turn float32 thresholds, float64 counts or an fp32 workspace
    into bf16. They land on the device of the module's (first) parameter."""

    FIXED_DTYPE: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        fixed = {name: self._buffers.pop(name) for name in self.FIXED_DTYPE}
        super()._apply(fn, recurse)
        dev = next(self.parameters()).device
        for name, buf in fixed.items():
            self._buffers[name] = None if buf is None else buf.to(dev)
        return self


def site_key(layer: int, site: str) -> str:
    """The thresholds key of a projection site: ('layers.3.gate') for (3, 'gate_proj')."""
    if site not in SITE_KEYS:
        raise InputError(f"unknown projection site '{site}'; sites are {', '.join(SITE_KEYS)}")
    return threshold_key(layer, SITE_KEYS[site])


class SparseLinear(LoraSite, FixedDtypeBuffers):
    """A projection whose one-token calls read only the weight rows of kept input channels.

    Holds w_t (in, out), the weight transposed (the only copy), the bias as given,
    `threshold`, a 0-d float32 buffer (update it in place and a captured graph follows), and
    `options`, the GemvOptions its kernel launches with.

    An adapter (`attach_lora_`) adds s * B (A x_m) to every call, A read only in the rows of kept
    channels where one token runs a kernel (`kernels.lora_gemv`): `lora_a_t` (in, r) and
    `lora_b_t` (r, out) in the weight's dtype, `lora_scale` = s.
    """

    FIXED_DTYPE = ("threshold", "kept", "union_dev", "union_n", "ws_acc", *LoraSite.LORA_FIXED)

    def __init__(self, w_t: Tensor, bias: Tensor | None, threshold: float, site: str = "",
                 track: bool = False, column_major: bool = False, options: GemvOptions | None = None):
        super().__init__()
        if w_t.dim() != 2 or w_t.stride(1) != 1 or w_t.stride(0) < w_t.shape[1]:
            raise InputError(
                f"SparseLinear wants an (in, out) weight with unit stride along out; got {tuple(w_t.shape)} "
                f"with strides {w_t.stride()}"
            )
        t = float(threshold)
        if not (t >= 0.0 or t == READ_ALL):
            raise InputError(f"threshold of {site or 'a site'} must be >= 0; got {threshold}")
        self.site = site
        self.track = track
        self.options = _check_options(options)
        self.column_major = column_major  # the source nn.Linear's layout, restored by to_linear
        self.w_t = nn.Parameter(w_t, requires_grad=False)  # (in, out)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # (out,)
        dev = w_t.device
        self.register_buffer("threshold", torch.tensor(t, dtype=torch.float32, device=dev))
        self.threshold_host = t  # the same value on the host, for calls that take a Python float
        self.register_buffer("kept", torch.zeros(2, dtype=torch.float64, device=dev), persistent=False)
        self.register_buffer("union_dev", torch.zeros(2, dtype=torch.float64, device=dev), persistent=False)
        self.register_buffer("union_n", torch.zeros(1, dtype=torch.int32, device=dev), persistent=False)
        # the eager CPU kernels add [kept channels, channels] here: a Python add per call instead
        # of tensor ops, which cost a tracked CPU step ~15% (kept_counts sums both)
        self.kept_host = [0, 0]
        self.union_host = [0, 0]  # [union rows read, rows] of tracked batch calls (`realized_union`)
        acc, count = workspace(w_t.shape[1], dev)
        self.register_buffer("ws_acc", acc, persistent=False)  # (out,) fp32, zero between calls
        self.register_buffer("ws_count", count, persistent=False)
        self._init_lora()

    @classmethod
    def from_linear(cls, linear: nn.Linear, threshold: float, site: str = "", track: bool = False,
                    options: GemvOptions | None = None):
        """Build from an nn.Linear; its (out, in) weight is transposed once (no copy if it is
        already stored column-major) and the linear can be dropped."""
        w = linear.weight.detach()  # (out, in)
        column_major = w.t().is_contiguous()
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(w.t().contiguous(), bias, threshold, site, track, column_major, options)

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear with the same values (and the source's memory layout)."""
        w_t = self.w_t.detach()  # (in, out), possibly a column slice of a fused weight
        w = w_t.contiguous().t() if self.column_major else w_t.t().contiguous()  # (out, in)
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = nn.Parameter(w, requires_grad=False)
        if self.bias is not None:
            lin.bias = nn.Parameter(self.bias.detach(), requires_grad=False)
        return lin

    @property
    def in_features(self) -> int:
        return self.w_t.shape[0]

    @property
    def out_features(self) -> int:
        return self.w_t.shape[1]

    @property
    def weight(self) -> Tensor:
        """The (out, in) weight, a view of w_t, for code that expects an nn.Linear."""
        return self.w_t.t()

    def count_kept(self, x: Tensor, keep: Tensor | None = None) -> None:
        """Add this token's [kept channels, channels] to `kept` (on the device, no sync); for
        several tokens (a decode batch) the mean token's. `keep`: x's kept mask, where known."""
        keep = keep_mask(x, self.threshold) if keep is None else keep
        rows, kept = keep.shape[:-1].numel(), keep.sum()
        self.kept[0] += kept if rows == 1 else kept / rows
        self.kept[1] += self.in_features

    def forward(self, x: Tensor, residual: Tensor | None = None):
        """x (..., in) -> (..., out). One token: input-sparse; several tokens: dense.

        With `residual` (one token, where the kernel runs: `kernel_runs`) it returns
        (residual + out, per-tile sums of squares of that sum) from one launch."""
        if residual is None and x.dim() == 3 and x.shape[0] > 1 and x.shape[1] == 1:
            return self._forward_rows(x)  # a decode batch: one token per sequence
        if residual is None and x.shape[:-1].numel() != 1:
            # prefill stays dense (§3.2), the adapter's term too
            return self._plus_lora(linear(x, self.w_t.t(), self.bias), x)
        lora = self.lora
        if residual is None and not x.is_cuda and cpu_rows(self.w_t):
            if lora is not None:  # A's kept rows only, in the same C call
                return sparse_gemv_lora_cpu(x, self.w_t, self.threshold, *lora[:3], self.bias, kept=self.kept_buffer())
            return sparse_gemv_cpu(x, self.w_t, self.threshold, self.bias, kept=self.kept_buffer())
        if self.track:
            self.count_kept(x)
        if residual is None and not x.is_cuda:  # masked: reads every row
            if lora is not None:
                return lora_gemv_ref(x, self.w_t, self.threshold, *lora[:3], self.bias)
            return sparse_gemv_ref(x, self.w_t, self.threshold, self.bias)
        return sparse_gemv(x, self.w_t, self.threshold, self.bias, ws=self._ws(), residual=residual,
                           options=self.options, lora=lora)

    def _forward_rows(self, x: Tensor) -> Tensor:
        """x (B, 1, in), one decode token per sequence -> (B, 1, out): each token keeps its own
        channels (|x| > threshold) and the weight is read once, in the rows of their union (§3.3,
        App. F). A dense site (READ_ALL) is one GEMM: its union is every row."""
        B, _, K = x.shape
        if self.threshold_host == READ_ALL:
            return self._plus_lora(F.linear(x, self.w_t.t(), self.bias), x)
        x2 = x.reshape(B, K)  # (B, in)
        if self.lora_a_t is not None:  # the base as below, the adapter's term masked per token (reference)
            return self._plus_lora(self._rows_base(x, x2), x2, keep_mask(x2, self.threshold))
        return self._rows_base(x, x2)

    def _rows_base(self, x: Tensor, x2: Tensor) -> Tensor:
        """The base projection of a decode batch x (B, 1, in), x2 its (B, in) view."""
        B, _, K = x.shape
        if x.is_cuda:
            from sparsedecode.kernels.union_gemv import union_gemv

            if self.track:  # counted on the device (capturable): each token's keep and the union's rows
                self.count_kept(x2)
                self.union_n.zero_()
            y = union_gemv(x2, self.w_t, self.threshold_host, self.bias, union=self.union_n if self.track else None)
            if self.track:
                self.union_dev[0] += self.union_n[0]
                self.union_dev[1] += K
            return y.reshape(B, 1, -1)
        if cpu_rows(self.w_t):
            y, n, kept = sparse_gemv_union_cpu(x2, self.w_t, self.threshold_host, self.bias)
            if self.track:
                self.kept_host[0] += float(kept.sum()) / B
                self.kept_host[1] += K
                self.union_host[0] += n
                self.union_host[1] += K
            return y.reshape(B, 1, -1)
        from sparsedecode.kernels.union_gemv import union_gemv_ref

        if self.track:  # masked: every row is read, whatever the union
            keep = keep_mask(x2, self.threshold)
            self.count_kept(x2, keep)
            self.union_dev[0] += keep.any(0).sum()
            self.union_dev[1] += K
        return union_gemv_ref(x2, self.w_t, self.threshold, self.bias).reshape(B, 1, -1)

    def forward_swiglu(self, gate: Tensor, up: Tensor, residual: Tensor | None = None):
        """This projection of silu(gate) * up (SwiGLU's down input). For one token where the
        kernel runs (`kernel_runs`) the product is formed in the kernel's input load, which saves
        the decode step one silu-and-multiply launch per layer; otherwise it is
        `self(F.silu(gate) * up, residual)`. With `residual`, as `forward`."""
        if not (gate.shape[:-1].numel() == 1 and kernel_runs(gate)):
            return self(F.silu(gate) * up, residual=residual)
        if self.track:
            self.count_kept(F.silu(gate) * up)
        return sparse_gemv(gate, self.w_t, self.threshold, self.bias, ws=self._ws(), up=up,
                           residual=residual, options=self.options, lora=self.lora)

    def kept_buffer(self):
        """Where a tracked CPU call adds its [kept channels, channels] (None untracked): the host
        counters eagerly, the tensor buffer under torch.compile (traced as an op)."""
        if not self.track:
            return None
        return self.kept if torch.compiler.is_compiling() else self.kept_host

    def kept_counts(self) -> tuple[float, float]:
        """[kept channels, channels] seen by tracked one-token calls, device and host counters."""
        kept, total = self.kept.tolist()
        return kept + self.kept_host[0], total + self.kept_host[1]

    def realized_keep(self) -> float:
        """Kept channels over channels seen by tracked one-token calls (nan before any)."""
        kept, total = self.kept_counts()
        return kept / total if total else float("nan")

    def realized_union(self) -> float:
        """Union rows read over rows, pooled over tracked batch calls (B > 1): u_B (nan before any)."""
        n, total = self.union_dev.tolist()
        n, total = n + self.union_host[0], total + self.union_host[1]
        return n / total if total else float("nan")

    def reset_keep(self) -> None:
        self.kept.zero_()
        self.kept_host[:] = [0, 0]
        self.union_dev.zero_()
        self.union_host[:] = [0, 0]

    def extra_repr(self) -> str:
        return (f"site={self.site!r}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, threshold={self.threshold.item():.4g}, track={self.track}"
                + (f", lora_rank={self.lora_a_t.shape[1]}, lora_scale={self.lora_scale:g}" if self.has_lora else ""))


class SparseConcat(LoraConcat, FixedDtypeBuffers):
    """One input-sparse launch for the sites that read the same input: q|k|v or gate|up.

    Each site keeps its own threshold, but the decode step pays one kernel launch (and its
    fixed cost of a few µs on an H200, `benchmarks/kernels/sparse_gemv_bench.py`) instead of two or
    three, and the small k/v GEMVs run inside a larger grid. The weights are concatenated
    once into w_t (in, sum of outs); each site's `SparseLinear.w_t` becomes a column slice of
    it (no second copy), so the sites stay addressable (thresholds, keep tracking, prefill).
    The segmented kernel tests column block j against site j's threshold (§3.2: one
    threshold per (layer, projection)). The sites are held in a plain list: they remain
    registered where they were. Build it after the model is on its device. `options`: the
    GemvOptions of the launch (default: the first site's).
    """

    FIXED_DTYPE = ("ws_acc", *LoraConcat.LORA_FIXED)

    def __init__(self, sites: list[SparseLinear], options: GemvOptions | None = None):
        super().__init__()
        if not 2 <= len(sites) <= 3 or len({m.in_features for m in sites}) != 1:
            raise InputError("SparseConcat fuses 2 or 3 SparseLinear sites that share one input width")
        if len({m.bias is None for m in sites}) != 1:
            raise InputError("SparseConcat needs every site with a bias or none")
        w_t = torch.cat([m.w_t.detach() for m in sites], dim=1)  # (in, sum outs)
        self.w_t = nn.Parameter(w_t, requires_grad=False)
        self.bias = None if sites[0].bias is None else nn.Parameter(
            torch.cat([m.bias.detach() for m in sites]), requires_grad=False)
        self.widths = [m.out_features for m in sites]
        lo = 0
        for m in sites:  # the sites read column slices of the one fused copy
            m.w_t = nn.Parameter(w_t[:, lo:lo + m.out_features], requires_grad=False)
            if m.bias is not None:
                m.bias = nn.Parameter(self.bias[lo:lo + m.out_features], requires_grad=False)
            lo += m.out_features
        self.sites = list(sites)
        self.options = _check_options(options or sites[0].options)
        acc, count = workspace(w_t.shape[1], w_t.device)
        self.register_buffer("ws_acc", acc, persistent=False)
        self.register_buffer("ws_count", count, persistent=False)
        self._init_lora_cat()

    @property
    def fuse_norms(self) -> bool:
        """Whether the decoder runs this launch's input norm inside it: where the kernel runs
        (`kernel_runs`; docs/kernels/sparse_gemv.md#fuse-norms) and the sites' adapters, if any,
        ride in the launch (`LoraConcat`)."""
        return kernel_runs(self.w_t) and not self.sites_apart

    @property
    def has_lora(self) -> bool:
        return any(m.lora_a_t is not None for m in self.sites)

    @property
    def sites_apart(self) -> bool:
        """Whether each site runs its own call: a site holds an adapter that the segmented launch
        cannot carry (`LoraConcat`: ranks differ, segments off the tile grid, no kernel here)."""
        return self.has_lora and self.lora_launch()[0] is None

    def forward(self, x: Tensor, norm: tuple | None = None) -> list[Tensor]:
        """x (..., in) holding one token -> the sites' outputs [(..., out_j)], one launch.

        With `norm` = (an `RMSNorm`, sums of squares of x from `SparseLinear(x, residual=...)`),
        x is the residual stream and the sites read the norm of it, formed in the launch."""
        rms, ss = norm if norm is not None else (None, None)
        lora, ws = self.lora_launch()
        if lora is None and self.has_lora:  # sites apart: `fuse_norms` is off, the decoder gives no norm
            return [m(x if rms is None else rms(x)) for m in self.sites]
        if rms is None and not kernel_runs(x) and cpu_rows(self.w_t):
            return self._forward_cpu(x)
        tracked = [m for m in self.sites if m.track]
        if tracked:
            counted = x if rms is None else rms(x)  # the sites' input
            for m in tracked:
                m.count_kept(counted)
        y = sparse_gemv(x, self.w_t, [m.threshold for m in self.sites], self.bias,
                        ws=ws or (self.ws_acc, self.ws_count), segments=self.widths,
                        norm=None if rms is None else (rms.weight, ss, rms.eps), options=self.options, lora=lora)
        return list(y.split(self.widths, dim=-1))

    def _forward_cpu(self, x: Tensor) -> list[Tensor]:
        """One token on CPU (`kernels.cpu_gemv`), one call for the two or three sites: where every
        site holds the same threshold (a dense step: READ_ALL; TEAL's q|k|v often), one pass over
        each kept row of the fused weight, its kept count added to each tracked site; otherwise
        the segmented call, each site reading its column slice of the rows it keeps under its own
        threshold (§3.2), keeps counted per site.
        Under torch.compile, or where a site has forward hooks (an activation collector, a test
        reading each site's input), the sites' own calls."""
        if torch.compiler.is_compiling() or any(m._forward_hooks or m._forward_pre_hooks for m in self.sites):
            return [m(x) for m in self.sites]
        ts = [float(m.threshold) for m in self.sites]
        if all(t == ts[0] for t in ts):
            # one pass; the sites share their input and threshold, so each keeps the same channels
            acc = [0, 0] if any(m.track for m in self.sites) else None
            y = sparse_gemv_cpu(x, self.w_t, ts[0], self.bias, kept=acc)
            for buf in (m.kept_buffer() for m in self.sites) if acc is not None else ():
                if buf is not None:
                    buf[0] += acc[0]
                    buf[1] += acc[1]
        else:
            y = sparse_gemv_segs_cpu(x, self.w_t, ts, self.widths, self.bias,
                                     kept=[m.kept_buffer() for m in self.sites])
        return list(y.split(self.widths, dim=-1))

    def extra_repr(self) -> str:
        return f"sites={[m.site for m in self.sites]}, widths={self.widths}"


FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


def _fuse_(model) -> int:
    """Attach a SparseConcat as `qkv` / `gate_up` of every attention / MLP whose sites are all
    SparseLinear (the decoder uses it for one-token calls); returns how many were attached."""
    n = 0
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, sites in FUSED.items():
                mods = [getattr(parent, s, None) for s in sites]
                if hasattr(parent, name) and getattr(parent, name) is None and all(
                        isinstance(m, SparseLinear) for m in mods):
                    setattr(parent, name, SparseConcat(mods))
                    n += 1
    return n


def unfuse_(model) -> None:
    """Drop the SparseConcat modules (the sites keep their slices; `densify_` copies them out)."""
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in FUSED:
                if getattr(parent, name, None) is not None:
                    setattr(parent, name, None)


def sparsify_(model, thresholds: dict[str, float], ff_only: bool = False, track: bool = False,
              fuse: bool | None = None, gemv: GemvOptions | None = None) -> list[SparseLinear]:
    """Replace the projections of `model` (a `Transformer`) by SparseLinear modules, in place.

    thresholds maps 'layers.{i}.{q|k|v|o|gate|up|down}' to a float (values may be 0-d
    tensors); ff_only touches gate/up/down only. A site that is already sparse gets the
    new threshold. `fuse` (default: where the kernel runs, CUDA or TRITON_INTERPRET=1)
    also runs q|k|v and gate|up as one segmented launch each (`SparseConcat`). `gemv`: the
    GemvOptions every sparse module of the model launches with (None: new modules take the
    defaults, existing ones keep theirs). Returns the sparse modules in site order. A decode
    step captured or compiled before this call keeps running the old modules: capture again.
    """
    gemv = None if gemv is None else _check_options(gemv)
    plan = []
    for layer, site, parent in model.projection_sites():
        if ff_only and site not in FF_SITES:
            continue
        key = site_key(layer, site)
        if key not in thresholds:
            raise InputError(
                f"no threshold for site '{key}'; thresholds need one per site "
                f"({'gate/up/down' if ff_only else 'q/k/v/o/gate/up/down'} of every layer)"
            )
        plan.append((parent, site, key, float(thresholds[key])))
    out = []
    for parent, site, key, t in plan:
        mod = getattr(parent, site)
        if isinstance(mod, SparseLinear):
            mod.threshold.fill_(t)
            mod.threshold_host = t
            mod.track = track
        else:
            mod = SparseLinear.from_linear(mod, t, site=key, track=track, options=gemv)
            setattr(parent, site, mod)
        out.append(mod)
    if fuse is None:
        fuse = bool(out) and (kernel_runs(out[0].w_t) or cpu_rows(out[0].w_t))
    if fuse:
        _fuse_(model)
    if gemv is not None:
        set_gemv_options_(model, gemv)
    return out


def set_gemv_options_(model, options: GemvOptions) -> int:
    """Set `options` on every sparse module of `model` (each SparseLinear and SparseConcat);
    returns how many. A captured or compiled decode step keeps the options it was built with:
    capture again."""
    options = _check_options(options)
    n = 0
    for mod in model.modules():
        if isinstance(mod, (SparseLinear, SparseConcat)):
            mod.options = options
            n += 1
    return n


def densify_(model) -> int:
    """Put plain nn.Linear modules (same values and layout) back at every sparse site; returns
    how many were replaced."""
    unfuse_(model)
    n = 0
    for _, site, parent in model.projection_sites():
        mod = getattr(parent, site)
        if isinstance(mod, SparseLinear):
            setattr(parent, site, mod.to_linear())
            n += 1
    return n


def dense_projections_(model, gemv: GemvOptions) -> None:
    """Every projection site dense: a plain nn.Linear, or with `gemv.dense` a SparseLinear that
    reads every row (READ_ALL; one filled in place where the site is sparse already, so a sparse
    and a dense step share one weight layout). A threshold file's sites are set after this."""
    if not gemv.dense:
        densify_(model)
        return
    sparsify_(model, {site_key(i, s): READ_ALL for i, s, _ in model.projection_sites()}, gemv=gemv)


def check_dense_gemv(model, gemv: GemvOptions) -> None:
    """Refuse gemv.dense where no GEMV runs: CUDA (or TRITON_INTERPRET=1) runs the Triton kernel,
    a CPU the C kernel (`kernels.cpu_gemv`) where it was built for the model's dtype."""
    p = next(model.parameters())
    if gemv.dense and not (kernel_runs(p) or cpu_rows(p)):
        from sparsedecode.kernels.cpu_gemv import cpu_kernel

        raise InputError(f"gemv.dense=true runs the projections through our GEMV, and on this CPU it has no "
                         f"{p.dtype} kernel ({cpu_kernel().reason or 'not built for it'}); drop gemv.dense=true")


def sparse_modules(model) -> list[SparseLinear]:
    """The SparseLinear modules at the projection sites of `model`, in site order."""
    return [m for _, site, parent in model.projection_sites()
            if isinstance(m := getattr(parent, site), SparseLinear)]


def realized_projection_keep(model) -> float:
    """Fraction of projection weight bytes read by tracked one-token calls (§4.1).

    Per site kept/total channels, weighted by the site's parameter count (a kept channel
    reads one row of out_features weights), over the tracked sites that saw a call.
    """
    rows = []
    for mod in sparse_modules(model):
        kept, total = mod.kept_counts()
        if mod.track and total:
            rows.append((kept / total, mod.in_features * mod.out_features))
    if not rows:
        raise InputError(
            "no tracked sparse decode calls: sparsify_(..., track=True) and run decode steps first"
        )
    return sum(r * p for r, p in rows) / sum(p for _, p in rows)


# The sparse GEMV launch each site's weight rows are read in by the fused decoder layer
CALL_OF_SITE = {"q": "q|k|v", "k": "q|k|v", "v": "q|k|v", "o": "o", "gate": "gate|up", "up": "gate|up", "down": "down"}


def projection_call_bytes(model) -> dict[str, dict[str, float]]:
    """Weight bytes per one-token step of each of a layer's sparse GEMV calls, summed over layers:
    {call: {"read": kept rows' bytes, "dense": the whole weights' bytes}} for calls q|k|v, o,
    gate|up and down, from each tracked site's realized keep (`realized_projection_keep` is
    their read over dense). The decode benchmark sets them beside each call's profiled time."""
    out: dict[str, dict[str, float]] = {}
    for mod in sparse_modules(model):
        kept, total = mod.kept_counts()
        if not (mod.track and total):
            continue
        weight = mod.in_features * mod.out_features * mod.w_t.element_size()
        row = out.setdefault(CALL_OF_SITE[mod.site.rsplit(".", 1)[-1]], {"read": 0.0, "dense": 0.0})
        row["read"] += weight * kept / total
        row["dense"] += weight
    if not out:
        raise InputError("no tracked sparse decode calls: sparsify_(..., track=True) and run decode steps first")
    return out


__all__ = [
    "CALL_OF_SITE", "FUSED", "READ_ALL", "FixedDtypeBuffers", "SITE_KEYS", "SparseConcat", "SparseLinear",
    "check_dense_gemv", "dense_projections_", "densify_", "unfuse_",
    "kernel_runs", "projection_call_bytes", "realized_projection_keep", "set_gemv_options_", "site_key",
    "sparse_modules", "sparsify_",
]
