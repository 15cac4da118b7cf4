"""The least time one launch takes to read B bytes: the floor under a byte-time target.

The sparse GEMV's target (ByteCross §4.1, App. A; issue 4: time within 1.15x of bytes read /
4.15 TB/s) charges every call its bytes at the H200's streaming rate. Any kernel that reads
those bytes in one launch also pays a start (the first loads' latency before the bus is full)
and an end (the last loads and the last programs draining), which the rate does not count and
which weigh more the fewer the bytes. `stream_sum` measures that floor: it reads a contiguous
buffer of B bytes and nothing else (no data-dependent addresses, no reduction across programs:
each program stores its own partial), so no kernel that must read the same B bytes, least of
all one that picks its rows from x and reduces across programs, can take less time under the
same protocol (`benchmarks/kernels/read_floor_bench.py` times it as `sparse_gemv_bench.py` times the
GEMV: distinct copies beating the L2, back to back in one CUDA graph).

Two loop forms, each a few tile sizes (`CONFIGS`): 'chunk', each program one contiguous chunk
of ITERS tiles with all its loads issued before its first add (unrolled); 'stride', a grid of a
few programs per SM striding over the tiles in a pipelined loop (`tl.range`, NUM_STAGES).
`stream_sum_ref` is the same per-program sums in PyTorch, the tests' oracle.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparsedecode.errors import InputError

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# (form, elements per tile, tiles per program ('chunk') or programs per SM ('stride'), warps, stages)
CONFIGS = [("chunk", 1024, 4, 4, 1), ("chunk", 1024, 8, 4, 1), ("chunk", 2048, 4, 8, 1),
           ("chunk", 2048, 8, 8, 1), ("chunk", 4096, 4, 8, 1), ("chunk", 512, 8, 2, 1),
           ("stride", 1024, 8, 4, 3), ("stride", 2048, 4, 8, 3), ("stride", 4096, 2, 8, 3),
           ("stride", 1024, 16, 4, 2), ("stride", 2048, 8, 8, 4), ("chunk", 1024, 16, 4, 1),
           # after the first run (records h200/kernels/sparse_gemv/sparse_gemv_20261201T1029Z_read_floor),
           # where 4 tiles of 1024 or 2048 a program won: fewer tiles, fewer warps a tile
           ("chunk", 1024, 2, 4, 1), ("chunk", 2048, 2, 8, 1), ("chunk", 512, 4, 2, 1), ("chunk", 4096, 2, 8, 1),
           ("chunk", 2048, 4, 4, 1), ("chunk", 1024, 4, 2, 1), ("chunk", 4096, 1, 8, 1)]

if triton is not None:

    @triton.jit
    def _chunk_kernel(X, Out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)
        base = pid * (BLOCK * ITERS)  # int32: _check keeps n below 2**31
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range(ITERS):  # unrolled: every load of the chunk is issued up front
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(X + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
        tl.store(Out + pid, tl.sum(acc, axis=0))

    @triton.jit
    def _stride_kernel(X, Out, n, tiles, BLOCK: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for t in tl.range(pid, tiles, programs, num_stages=STAGES):
            offs = t * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(X + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
        tl.store(Out + pid, tl.sum(acc, axis=0))


def label(config: tuple) -> str:
    """'chunk1024x8w4s1': form, tile elements, tiles per program or programs per SM, warps, stages."""
    form, block, many, warps, stages = config
    return f"{form}{block}x{many}w{warps}s{stages}"


def programs(n: int, config: tuple, sm_count: int) -> int:
    """The grid of `config` over n elements."""
    form, block, many, _, _ = config
    tiles = -(-n // block)
    return -(-tiles // many) if form == "chunk" else max(1, min(tiles, many * sm_count))


def _check(x: Tensor, config: tuple) -> None:
    if x.dim() != 1 or not x.is_contiguous() or x.numel() == 0:
        raise InputError(f"stream_sum reads one non-empty contiguous 1-D buffer; got shape {tuple(x.shape)}"
                         f"{'' if x.is_contiguous() else ' (not contiguous)'}")
    if x.numel() >= 2**31 - 2**16:
        raise InputError(f"stream_sum indexes in int32: {x.numel()} elements is too many; read it in parts")
    form, block, many, warps, stages = config
    if form not in ("chunk", "stride") or block & (block - 1) or many < 1 or warps < 1 or stages < 1:
        raise InputError(f"read-floor config {config!r}: want ('chunk' or 'stride', a power-of-two tile, "
                         "tiles per program or programs per SM >= 1, warps >= 1, stages >= 1)")


def stream_sum_ref(x: Tensor, config: tuple, sm_count: int) -> Tensor:
    """Per-program float32 sums of `stream_sum`'s tiling, in PyTorch."""
    _check(x, config)
    form, block, many, _, _ = config
    n, grid = x.numel(), programs(x.numel(), config, sm_count)
    tiles = -(-n // block)
    padded = torch.zeros(tiles * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.float()
    per_tile = padded.view(tiles, block).sum(1)  # (tiles,)
    owner = (torch.arange(tiles, device=x.device) // many if form == "chunk"
             else torch.arange(tiles, device=x.device) % grid)
    return torch.zeros(grid, dtype=torch.float32, device=x.device).index_add_(0, owner, per_tile)


def stream_sum(x: Tensor, config: tuple, out: Tensor | None = None, *, pdl: bool = False,
               sm_count: int | None = None) -> Tensor:
    """Read every byte of x (1-D, contiguous) once in one launch; the per-program float32 sums.

    `out` (float32, at least the grid's length) is reused when given, so a CUDA graph can
    capture the call. `pdl` launches it as a programmatic dependent that waits at its top for
    the kernel before and lets the next launch at once (as the sparse GEMV does with `GemvOptions.pdl`)."""
    _check(x, config)
    if triton is None:
        raise InputError("stream_sum needs Triton: pip install triton")
    if sm_count is None:
        sm_count = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    form, block, many, warps, stages = config
    n, grid = x.numel(), programs(x.numel(), config, sm_count)
    if out is None:
        out = torch.empty(grid, dtype=torch.float32, device=x.device)
    elif out.dtype != torch.float32 or out.numel() < grid:
        raise InputError(f"stream_sum's out must be float32 with at least {grid} elements")
    pdl = pdl and x.is_cuda
    extra = {"launch_pdl": True} if pdl else {}
    if form == "chunk":
        _chunk_kernel[(grid,)](x, out, n, BLOCK=block, ITERS=many, PDL=pdl, num_warps=warps, num_stages=1, **extra)
    else:
        _stride_kernel[(grid,)](x, out, n, -(-n // block), BLOCK=block, STAGES=stages, PDL=pdl,
                                num_warps=warps, **extra)
    return out[:grid]
