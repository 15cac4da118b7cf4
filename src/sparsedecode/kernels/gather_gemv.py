"""Output-sparse (row-gather) up projection fused with the CATS activation (SATS paper §2, CATS).

CATS keeps MLP channel j of one decode token iff |SiLU(gate(x))_j| > t; a dropped
channel zeroes h_j = SiLU(gate(x))_j * up(x)_j, so neither row j of up nor column
j of down is needed. Down takes h as an input-sparse GEMV at threshold 0
(`kernels.sparse_gemv`); this kernel is the up side. nn.Linear stores up as
w_up (N, K), row j contiguous in K, so a kept channel is one contiguous row of
K elements and a dropped one is a row never loaded:

- The CATS test is fused: a program loads gate_act for its block of BLOCK_R
  candidate rows, forms the mask |gate_act| > t (float32) and never issues a
  load for a dropped row, so the bytes read are keep x N x K x elem (+ x).
- The kept rows of the block are compacted in registers (a prefix sum gives
  each kept row its slot) and processed BLOCK_J at a time, so every tile the
  program loads is full of kept rows whatever the keep. A masked tile (dropped
  rows as predicated-off lanes) would still hold registers for every row and
  at keep 0.3 leave 70% of the loads-in-flight budget idle; only the last group
  of a block is partial here.
- A program is one warp. Each tile is BLOCK_J rows x BLOCK_K columns with
  BLOCK_K x elem = 512 bytes, one 16-byte vector per lane and row, so a lane
  has BLOCK_J vectors in flight beside its slice of x. Each lane folds a
  vector's products into one fp32 partial per row at once (the accumulator is
  BLOCK_J registers per lane, not 8 x BLOCK_J: registers are what bound the
  loads in flight), and the lanes are reduced with shuffles once per group.
  With one warp nothing in the loop goes through shared memory or a barrier.
- Batch-1 decode has too few row blocks to fill 132 SMs (14336 rows are 448
  blocks of 32), so the grid is (row blocks, K splits) sized from the SM count,
  and the splits are reduced in the same kernel by `kernels.common`'s split-K
  finish (as in `sparse_gemv`); the last program of a block applies bias and
  gate_act and writes all BLOCK_R outputs (exact zeros for dropped rows, which
  were never added to). One launch, no host sync, threshold read on the device:
  capturable in a CUDA graph and replayable. With one split there are no atomics
  and no workspace.

`cats_up_ref` is the same math as a masked PyTorch reference: it reads every row
and zeroes the dropped channels, so it saves no bytes ('masked'). It is the
oracle of the tests and benchmark.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sparsedecode.errors import InputError
from sparsedecode.kernels import common
from sparsedecode.kernels.common import (
    DTYPES,
    MIN_BLOCK,
    check_threshold,
    finish_mode,
    interpreting,
    keep_mask,
    pow2,
    rows_per_split,
    workspace,
)

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

ROW_BYTES = 512  # bytes of one row segment per tile: one 16-byte vector per lane of the warp
BLOCK_R = 32  # candidate rows per program; the kept ones are compacted into groups of BLOCK_J
BLOCK_J = 8  # kept rows per tile: 8 x 512 B = 4 KB of weight per iteration, 8 vectors per lane
NUM_WARPS = 1
PROGRAMS_PER_SM = 24  # at the default split (docs/kernels/sparse_gemv.md#cats-up)
CPU_SPLITS = 3  # under the interpreter: several splits, so the atomic reduction is exercised


def check_inputs(x: Tensor, w_up: Tensor, gate_act: Tensor, threshold, bias: Tensor | None
                 ) -> tuple[int, int]:
    """Validate CATS up-projection operands; returns (N, K)."""
    if w_up.dim() != 2:
        raise InputError(f"cats_up wants w_up (N, K), nn.Linear's weight layout; got {tuple(w_up.shape)}")
    N, K = w_up.shape
    if x.dim() < 1 or x.shape[-1] != K:
        raise InputError(f"x {tuple(x.shape)} does not end in K={K}, the columns of w_up {tuple(w_up.shape)}")
    if x.numel() != K:
        raise InputError(
            f"cats_up multiplies one token: x {tuple(x.shape)} holds {x.numel() // max(K, 1)} rows; "
            "run several tokens (prefill) densely"
        )
    if gate_act.shape[-1:] != (N,) or gate_act.numel() != N:
        raise InputError(f"gate_act must hold the N={N} activations of one token; got {tuple(gate_act.shape)}")
    if x.dtype != w_up.dtype or x.dtype != gate_act.dtype or x.dtype not in DTYPES:
        raise InputError(
            f"cats_up runs in float16, bfloat16 or float32 with one dtype for x, w_up and gate_act; "
            f"got {x.dtype}, {w_up.dtype} and {gate_act.dtype}"
        )
    if x.device != w_up.device or x.device != gate_act.device:
        raise InputError(f"x lives on {x.device}, w_up on {w_up.device} and gate_act on {gate_act.device}")
    if bias is not None and (bias.shape != (N,) or bias.device != x.device):
        raise InputError(f"bias must be ({N},) on {x.device}; got {tuple(bias.shape)} on {bias.device}")
    check_threshold(threshold, x.device)
    return N, K


def cats_up_ref(x: Tensor, w_up: Tensor, gate_act: Tensor, threshold, bias: Tensor | None = None
                ) -> Tensor:
    """Masked reference of `cats_up`: dropped channels are zeroed, every row of w_up is read.

    x (..., K) holding one token; w_up (N, K); gate_act (..., N) = SiLU(gate(x)); threshold
    a float or 1-element float tensor; channel j is kept iff |gate_act_j| > threshold (in
    float32). Returns (..., N) in x's dtype: gate_act_j * (w_up[j] . x + bias_j) for kept j,
    exactly 0 otherwise, accumulated in float32 ('masked': it saves no bytes).
    """
    N, K = check_inputs(x, w_up, gate_act, threshold, bias)
    u = x.float() @ w_up.float().t()  # (..., N) float32
    if bias is not None:
        u = u + bias.float()
    keep = keep_mask(gate_act, threshold).reshape(u.shape)
    return torch.where(keep, gate_act.float().reshape(u.shape) * u, 0.0).to(x.dtype)


def default_config(N: int, K: int, dtype: torch.dtype, device: torch.device,
                   programs_per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int, int, int, int]:
    """(BLOCK_R, BLOCK_J, BLOCK_K, splits, num_warps) for an (N, K) weight: static per shape
    and device. The K splits bring the grid to about `programs_per_sm` one-warp programs per
    SM (MIN_BLOCK: the smallest BLOCK_R and BLOCK_K; workspace() sizes its counters for it)."""
    elem = torch.empty((), dtype=dtype).element_size()
    block_r = max(MIN_BLOCK, min(BLOCK_R, pow2(N)))
    block_j = min(BLOCK_J, block_r)
    block_k = max(MIN_BLOCK, min(ROW_BYTES // elem, pow2(K)))
    blocks = -(-N // block_r)
    if device.type == "cuda":
        want = max(1, round(programs_per_sm * common.sm_count(common.device_index(device)) / blocks))
    else:
        want = CPU_SPLITS
    return block_r, block_j, block_k, common.splits(K, block_k, want), NUM_WARPS


if triton is not None:
    from sparsedecode.kernels.common import split_arrive, split_reset, split_take

    @triton.jit
    def _adapter_rows(U, Bt, rows, mask, N, rank, lora_s, BLOCK_RK: tl.constexpr):
        """s * B_j . u for the rows j under `mask`: u (rank,) the adapter's shrink of x, B stored
        transposed, b_t (rank, N), so a rank's values of consecutive rows are contiguous; a dropped
        row's adapter values are never loaded. float32, (len(rows),)."""
        offs_k = tl.arange(0, BLOCK_RK)
        in_r = offs_k < rank
        u = tl.load(U + offs_k, mask=in_r, other=0.0).to(tl.float32)
        bt = tl.load(Bt + offs_k[:, None] * N + rows[None, :], mask=in_r[:, None] & mask[None, :], other=0.0)
        return lora_s * tl.sum(bt.to(tl.float32) * u[:, None], axis=0)

    @triton.jit
    def _cats_up_kernel(
        X, W, G, Bias, Thr, Y, Acc, Count, thr_f, K, N, cols_per_split, num_splits,
        BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
        THR_T: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
        VEC: tl.constexpr, FIN_LOAD: tl.constexpr,
        U, Bt, rank, lora_s, LORA: tl.constexpr, BLOCK_RK: tl.constexpr,
    ):
        # Program (row block, k split): BLOCK_R candidate rows, columns
        # [pid_k * cols_per_split, + cols_per_split) of each kept one.
        pid_r = tl.program_id(0)
        pid_k = tl.program_id(1)
        if THR_T:
            t = tl.load(Thr).to(tl.float32)
        else:
            t = thr_f
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
        in_n = offs_r < N
        a = tl.load(G + offs_r, mask=in_n, other=0.0).to(tl.float32)  # (BLOCK_R,)
        keep = (tl.abs(a) > t) & in_n  # the fused CATS test
        kept = keep.to(tl.int32)
        slot_of = tl.cumsum(kept, axis=0) - 1  # (BLOCK_R,) slot of each kept row
        count = tl.sum(kept, axis=0)
        k_lo = pid_k * cols_per_split
        k_len = tl.minimum(cols_per_split, K - k_lo)
        for g in range(0, count, BLOCK_J):
            # Compaction: the row of slot s is the kept row whose prefix count is s.
            slots = g + tl.arange(0, BLOCK_J)  # (BLOCK_J,)
            hit = (slot_of[None, :] == slots[:, None]) & keep[None, :]  # (BLOCK_J, BLOCK_R)
            local = tl.sum(tl.where(hit, tl.arange(0, BLOCK_R)[None, :], 0), axis=1)  # (BLOCK_J,)
            valid = slots < count
            rows = pid_r * BLOCK_R + local  # (BLOCK_J,) kept rows of this group
            acc = tl.zeros([BLOCK_J, BLOCK_K // VEC], dtype=tl.float32)
            for k0 in range(0, k_len, BLOCK_K):
                offs_k = k_lo + k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
                # Splits are whole BLOCK_K tiles, so only the last tile of K can be partial.
                if EVEN_K:
                    xk = tl.load(X + offs_k).to(tl.float32)
                    mask = valid[:, None]
                else:
                    in_k = offs_k < K
                    xk = tl.load(X + offs_k, mask=in_k, other=0.0).to(tl.float32)
                    mask = valid[:, None] & in_k[None, :]
                # Only kept rows are addressed; an empty slot of the last group issues no load.
                w = tl.load(W + rows[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
                prod = w.to(tl.float32) * xk[None, :]  # (BLOCK_J, BLOCK_K)
                # in-thread: the VEC products of one 16-byte vector fold into one partial
                acc += tl.sum(tl.reshape(prod, [BLOCK_J, BLOCK_K // VEC, VEC]), axis=2)
            part = tl.sum(acc, axis=1)  # (BLOCK_J,)
            if LORA and not SPLIT:  # the adapter's s B_j u of the group's kept rows
                part += _adapter_rows(U, Bt, rows, valid, N, rank, lora_s, BLOCK_RK)
            if SPLIT:
                tl.atomic_add(Acc + rows, part, mask=valid, sem="relaxed")
            else:
                if HAS_BIAS:
                    part += tl.load(Bias + rows, mask=valid, other=0.0).to(tl.float32)
                a_j = tl.load(G + rows, mask=valid, other=0.0).to(tl.float32)
                tl.store(Y + rows, (a_j * part).to(Y.dtype.element_ty), mask=valid)
        if SPLIT:
            if split_arrive(Count, pid_r, num_splits):
                # the sums of the kept rows (dropped rows were never added to and are left alone)
                total = split_take(Acc, offs_r, keep, FIN_LOAD)
                if LORA:  # the adapter's s B_j u of the block's kept rows
                    total += _adapter_rows(U, Bt, offs_r, keep, N, rank, lora_s, BLOCK_RK)
                if HAS_BIAS:
                    total += tl.load(Bias + offs_r, mask=keep, other=0.0).to(tl.float32)
                h = tl.where(keep, a * total, 0.0)
                tl.store(Y + offs_r, h.to(Y.dtype.element_ty), mask=in_n)
                split_reset(Count, pid_r, FIN_LOAD)
        else:
            tl.store(Y + offs_r, tl.zeros([BLOCK_R], dtype=Y.dtype.element_ty), mask=in_n & ~keep)


@torch.library.custom_op("sparsedecode::cats_up", mutates_args=())
def _cats_up_op(
    x: Tensor, w_up: Tensor, gate_act: Tensor, thr_t: Tensor | None, thr_f: float, bias: Tensor | None,
    ws_acc: Tensor | None, ws_count: Tensor | None,
    block_r: int, block_j: int, block_k: int, splits: int, num_warps: int, programs_per_sm: int,
    lora_u: Tensor | None = None, lora_b: Tensor | None = None, lora_scale: float = 0.0,
) -> Tensor:
    # Declared pure although it writes the workspace: the kernel returns it to all-zero
    # before it exits (see sparse_gemv). Host-side choices run at trace and capture time.
    N, K = w_up.shape
    if not block_r:
        block_r, block_j, block_k, splits, num_warps = default_config(N, K, x.dtype, x.device, programs_per_sm)
    else:
        splits = common.splits(K, block_k, splits)
    if splits > 1 and (ws_acc is None or ws_count is None):
        ws_acc, ws_count = workspace(N, x.device)  # a memset: capturable, but a node more
    y = torch.empty(N, device=x.device, dtype=x.dtype)
    _cats_up_kernel[(triton.cdiv(N, block_r), splits)](
        x, w_up, gate_act, bias if bias is not None else x, thr_t if thr_t is not None else gate_act, y,
        ws_acc if splits > 1 else y, ws_count if splits > 1 else y, thr_f, K, N,
        rows_per_split(K, block_k, splits), splits,
        BLOCK_R=block_r, BLOCK_J=block_j, BLOCK_K=block_k, THR_T=thr_t is not None,
        HAS_BIAS=bias is not None, EVEN_K=K % block_k == 0, SPLIT=splits > 1, VEC=16 // x.element_size(),
        FIN_LOAD=finish_mode(num_warps) == "load",
        U=lora_u if lora_u is not None else y, Bt=lora_b if lora_b is not None else y,
        rank=0 if lora_b is None else lora_b.shape[0], lora_s=float(lora_scale), LORA=lora_b is not None,
        BLOCK_RK=max(MIN_BLOCK, pow2(0 if lora_b is None else lora_b.shape[0])), num_warps=num_warps, num_stages=1,
    )
    return y


@_cats_up_op.register_fake
def _(x, w_up, gate_act, thr_t, thr_f, bias, ws_acc, ws_count, *config, lora_u=None, lora_b=None, lora_scale=0.0):
    return x.new_empty(w_up.shape[0])


def cats_up(
    x: Tensor, w_up: Tensor, gate_act: Tensor, threshold, bias: Tensor | None = None,
    ws: tuple[Tensor, Tensor] | None = None, config: tuple[int, int, int, int, int] | None = None,
    *, programs_per_sm: int = PROGRAMS_PER_SM, lora: tuple | None = None,
) -> Tensor:
    """CATS-gated up projection of one token with the Triton kernel (CUDA, or CPU under
    TRITON_INTERPRET=1): reads only the rows of w_up whose channel is kept.

    x (..., K) holding one token; w_up (N, K) contiguous (nn.Linear's weight); gate_act
    (..., N) = SiLU(gate(x)) of that token; threshold a float or a 1-element float tensor
    on x's device (read on the device, so a captured graph follows in-place updates).
    Returns h (..., N) in x's dtype: gate_act_j * (w_up[j] . x + bias_j) where
    |gate_act_j| > threshold (float32 compare), exactly 0 elsewhere; fp32 accumulation.
    `ws` is a persistent `sparse_gemv.workspace(N, device)` (without it each split call
    zeroes a fresh one); `config` (BLOCK_R, BLOCK_J, BLOCK_K, splits, num_warps) overrides
    `default_config`, for tuning; without it the splits aim at `programs_per_sm` programs per
    SM (a plain value of the custom op, so a captured graph bakes it in).

    With `lora` = (a_t (K, r), b_t (r, N), s, u_ws or None), both factors contiguous in x's
    dtype, up carries an adapter (SATS paper §4.2): u = A x is one more launch, dense (x is not
    sparse at up's input; `kernels.sparse_gemv` at threshold -inf, u rounded to x's dtype as eager
    PEFT rounds it, `u_ws` its persistent `workspace(r, device)`), and each kept row adds
    s * B_j . u before bias and gate_act: B's values of dropped rows are never read.
    """
    if triton is None:
        raise InputError("the CATS up kernel needs Triton: pip install triton (or use cats_up_ref)")
    if isinstance(programs_per_sm, bool) or not isinstance(programs_per_sm, int) or programs_per_sm < 1:
        raise InputError(f"programs_per_sm must be an integer >= 1, got {programs_per_sm!r}")
    N, K = check_inputs(x, w_up, gate_act, threshold, bias)
    if not (x.is_cuda or interpreting()):
        raise InputError(
            "the CATS up Triton kernel runs on CUDA (or on CPU with TRITON_INTERPRET=1); "
            "use cats_up_ref, the masked reference"
        )
    if w_up.stride(1) != 1 or w_up.stride(0) != K:
        raise InputError(
            "w_up must be contiguous (N, K), one row per output: the kernel gathers whole rows; "
            "store the weight row-major once (weight.contiguous())"
        )
    if N * K >= 2**31:
        raise InputError(f"an ({N}, {K}) weight exceeds the kernel's 32-bit offsets")
    if ws is not None and (ws[0].numel() < N or ws[0].dtype != torch.float32 or ws[1].dtype != torch.int32
                           or ws[1].numel() < -(-N // MIN_BLOCK)):
        raise InputError("ws must be sparse_gemv.workspace(N, device): (float32 (>= N,), int32 counters)")
    if config is not None:
        block_r, block_j, block_k, splits, num_warps = config
        if any(b & (b - 1) for b in (block_r, block_j, block_k)) or min(block_r, block_k) < MIN_BLOCK:
            raise InputError(f"BLOCK_R, BLOCK_J and BLOCK_K must be powers of two, BLOCK_R and BLOCK_K "
                             f">= {MIN_BLOCK}; got {config}")
        if block_j > block_r or splits < 1:
            raise InputError(f"BLOCK_J must be <= BLOCK_R and splits >= 1; got {config}")
    thr_t, thr_f = (threshold.reshape(()), 0.0) if isinstance(threshold, Tensor) else (None, float(threshold))
    bias = None if bias is None else bias.contiguous()
    u, b_t, scale = _adapter_shrink(lora, x, K, N)
    h = _cats_up_op(x.reshape(K).contiguous(), w_up, gate_act.reshape(N).contiguous(), thr_t, thr_f, bias,
                    *(ws or (None, None)),
                    *(config or (0, 0, 0, 0, 0)), programs_per_sm, u, b_t, scale)
    return h.reshape(*gate_act.shape[:-1], N)


def _adapter_shrink(lora, x: Tensor, K: int, N: int) -> tuple[Tensor | None, Tensor | None, float]:
    """(u (r,), b_t, s) of `cats_up(lora=...)`, u = A x by one dense launch; (None, None, 0) without."""
    if lora is None:
        return None, None, 0.0
    from sparsedecode.kernels.sparse_gemv import sparse_gemv

    if not isinstance(lora, (tuple, list)) or len(lora) != 4:
        raise InputError("lora= is (a_t (K, r), b_t (r, N), scale, u workspace or None)")
    a_t, b_t, scale, ws_u = lora
    common.check_factors(a_t, b_t, K, N, x.dtype, x.device, who="up adapter")
    u = sparse_gemv(x.reshape(K), a_t, -math.inf, ws=ws_u)  # every row of A^T: x is dense here
    return u, b_t, float(scale)


__all__ = ["cats_up", "cats_up_ref", "check_inputs", "default_config"]
