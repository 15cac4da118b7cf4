"""Input-sparse matrix-vector product for one decode token (ByteCross §3.2, §4.1, App. A).

TEAL-style sparsity keeps input channel i when |x_i| > t and reads only the weights of kept
channels: y = sum over kept i of x_i * W[:, i] (+ bias), so a keep of 50% reads about half
of the projection bytes (§3.2, §4.1) if dropped weights never cross the memory bus:

- w_t (K, N) is the weight transposed: a channel's N outputs are one contiguous row, and a
  program's row segment (BLOCK_N elements, 512 bytes in bf16) is whole 128-byte lines.
- The threshold test is fused: a program loads its slice of x and issues the weight loads
  masked by |x| > t; a masked-off lane issues no transaction, so a dropped row costs no bytes.
- The grid is (N tiles, K splits), about `GemvOptions.programs_per_sm` one-warp programs per
  SM; a lane sums all BLOCK_K rows of its 8 columns in-thread, two tiles in flight per warp.
- The splits of a tile are reduced in the same launch (`kernels.common`'s split-K finish).

Choices and what they were measured against: docs/kernels/sparse_gemv.md. `sparse_gemv_ref`
is the same math masked in PyTorch (it reads every weight, so it saves no bytes): the CPU
path of `SparseLinear` and the tests' oracle.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparsedecode.errors import InputError
from sparsedecode.kernels import common
from sparsedecode.kernels.common import (  # noqa: F401 (check_threshold, keep_mask, workspace: importable here)
    DTYPES,
    MIN_BLOCK,
    check_inputs,
    check_lora,
    check_threshold,
    finish_mode,
    keep_mask,
    lora_scales,
    lora_workspace,
    workspace,
)
from sparsedecode.kernels.common import interpreting as _interpreting
from sparsedecode.kernels.common import pow2 as _pow2
from sparsedecode.kernels.options import DEFAULT, GemvOptions
from sparsedecode.kernels.tuned import read_tuned, tuned_configs, tuned_file  # noqa: F401 (importable here)

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

ROW_BYTES = 512  # bytes of one row segment per warp: 4 lines of 128 B, one 16-byte vector per lane
BLOCK_K = 16  # rows per loop iteration: 8 KB of weight per one-warp program at full keep
STAGES = (1, 4)  # the loops: 1 plain (segments off the tile grid), 4 two tiles in flight (the default)
CPU_SPLITS = 3  # under the interpreter: several splits, so the atomic reduction is exercised
MIN_BLOCK_K = 4  # smallest BLOCK_K a config may ask for (fewer rows, more programs in flight)


def sparse_gemv_ref(x: Tensor, w_t: Tensor, threshold, bias: Tensor | None = None) -> Tensor:
    """Masked reference of `sparse_gemv`: dropped channels are zeroed, every weight is read.

    x (..., K) holding one token; w_t (K, N); threshold a float or 1-element float
    tensor; channel i is kept iff |x_i| > threshold (in float32). Returns (..., N) in
    x's dtype, sum over kept i of x_i * w_t[i, :] (+ bias) accumulated in float32.
    This is the CPU path ('masked': it saves no bytes) and the tests' oracle (§3.2).
    """
    K, N = check_inputs(x, w_t, threshold, bias)
    xm = torch.where(keep_mask(x, threshold), x.float(), 0.0)  # (..., K) float32
    y = xm @ w_t.float()  # (..., N) float32; no copy when w_t is float32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def default_config(K: int, N: int, dtype: torch.dtype, device: torch.device,
                   programs_per_sm: int = GemvOptions.programs_per_sm, tuned: bool = True) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, splits, num_warps, num_stages) for a (K, N) weight, static per shape
    and device: the device's measured config (kernels/tuned/<device>.json) when it has the
    shape and `tuned`; else one-warp programs over ROW_BYTES of a row (fewer for narrow N), stages 4, and
    splits of whole BLOCK_K tiles for about `programs_per_sm` programs per SM."""
    if device.type == "cuda" and tuned:
        index = common.device_index(device)
        key = (K, N, str(dtype).removeprefix("torch."), common.sm_count(index))
        tuned = tuned_configs(common.device_name(index)).get(key)
        if tuned is not None:
            return tuned
    elem = torch.empty((), dtype=dtype).element_size()
    block_n = max(MIN_BLOCK, min(ROW_BYTES // elem, _pow2(N)))
    block_k = max(MIN_BLOCK, min(BLOCK_K, _pow2(K)))
    n_tiles = -(-N // block_n)
    if device.type == "cuda":
        want = max(1, round(programs_per_sm * common.sm_count(common.device_index(device)) / n_tiles))
    else:
        want = CPU_SPLITS
    return block_n, block_k, common.splits(K, block_k, want), 1, 4


def max_registers(programs: int, num_warps: int, device) -> int:
    """Registers per thread that let every program of the grid be resident at once: the grid is
    sized for one wave, and ptxas's register count is not stable under small source changes
    (multiples of 8, at most 255; docs/kernels/sparse_gemv.md#register-cap)."""
    per_sm = -(-programs // common.sm_count(common.device_index(device)))  # programs each SM must hold
    regs = 65536 // (per_sm * 32 * num_warps) // 8 * 8
    return max(32, min(255, regs))


if triton is not None:
    from sparsedecode.kernels.common import split_arrive, split_reset, split_take

    @triton.jit
    def _tile_threshold(Thr0, Thr1, Thr2, thr_f, b1, b2, n0, THR_T: tl.constexpr, NSEG: tl.constexpr):
        """The threshold of the column tile starting at n0: one scalar, or the one of the
        segment [0, b1), [b1, b2), [b2, N) it lies in (segment bounds on the tile grid)."""
        if THR_T:
            t = tl.load(Thr0).to(tl.float32)
        else:
            t = thr_f
        if NSEG > 1:
            t1 = tl.load(Thr1).to(tl.float32)
            t2 = t1
            if NSEG > 2:
                t2 = tl.load(Thr2).to(tl.float32)
            t = tl.where(n0 < b1, t, tl.where(n0 < b2, t1, t2))
        return t

    @triton.jit
    def _finish_splits(Acc, Count, Bias, Y, acc, offs_n, mask_n, tile, num_splits, HAS_BIAS: tl.constexpr,
                       Res, SsOut, RESID: tl.constexpr, FIN_LOAD: tl.constexpr,
                       Bt, N, rank, r_t, lora_s, acc_u, LORA: tl.constexpr, BLOCK_R: tl.constexpr):
        """Add this split's fp32 partial of a column tile (with LORA, and its partial acc_u of the
        tile's own u = A x_m at Acc[N + tile * rank], its first r_t entries: 0 where the tile's
        segment has no adapter); the last to arrive writes the sum (+ s B u, + bias) to Y
        (`kernels.common`'s split-K finish)."""
        tl.atomic_add(Acc + offs_n, acc, mask=mask_n, sem="relaxed")
        if LORA:
            offs_r = tl.arange(0, BLOCK_R)
            tl.atomic_add(Acc + N + tile * rank + offs_r, acc_u, mask=offs_r < r_t, sem="relaxed")
        if split_arrive(Count, tile, num_splits):
            _finish_tile(Acc, Count, Bias, Y, offs_n, mask_n, tile, HAS_BIAS, Res, SsOut, RESID, FIN_LOAD,
                         Bt, N, rank, r_t, lora_s, LORA, BLOCK_R)

    @triton.jit
    def _finish_tile(Acc, Count, Bias, Y, offs_n, mask_n, tile, HAS_BIAS: tl.constexpr, Res, SsOut,
                     RESID: tl.constexpr, FIN_LOAD: tl.constexpr,
                     Bt, N, rank, r_t, lora_s, LORA: tl.constexpr, BLOCK_R: tl.constexpr):
        """The sum of a tile whose partials have all arrived (+ s * B u, + bias) to Y. With RESID,
        Y is the residual stream: the sum rounded to Y's dtype plus the residual at Res, rounded
        again (as eager `x + proj(h)`), and the tile's sum of squares of it goes to SsOut[tile]
        for the next norm. With LORA the tile's columns of B^T (rank, N) and its own u (rank,)
        float32, summed by its splits at Acc[N + tile * rank], add s * B u (kernels/lora_gemv.py);
        u is taken as the sums are, leaving the workspace at zero."""
        if RESID:  # issued before the sum is taken, so the two trips to L2 overlap
            res = tl.load(Res + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if LORA:  # likewise: the tile's B^T columns
            offs_r = tl.arange(0, BLOCK_R)
            mask_r = offs_r < r_t
            bt = tl.load(Bt + offs_r[:, None] * N + offs_n[None, :], mask=mask_r[:, None] & mask_n[None, :],
                         other=0.0)
            u = split_take(Acc + N + tile * rank, offs_r, mask_r, FIN_LOAD)
        total = split_take(Acc, offs_n, mask_n, FIN_LOAD)
        if LORA:  # summed over the rank in-thread, as the weight tile's rows are
            total += lora_s * tl.sum(bt.to(tl.float32) * u[:, None], axis=0)
        if HAS_BIAS:
            total += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if RESID:
            total = total.to(Y.dtype.element_ty).to(tl.float32) + res
            sq = total.to(Y.dtype.element_ty).to(tl.float32)
            tl.store(SsOut + tile, tl.sum(tl.where(mask_n, sq * sq, 0.0), axis=0))
        tl.store(Y + offs_n, total.to(Y.dtype.element_ty), mask=mask_n)
        split_reset(Count, tile, FIN_LOAD)

    @triton.jit
    def _load_a(At, k0, ar, in_k, x, t, r_t, a_stride, BLOCK_R: tl.constexpr):
        """The (BLOCK_K, BLOCK_R) tile of A^T (rows of a_stride elements, r_t columns read) at rows
        k0 + ar whose |x| > t: the adapter's input-sparse shrink reads no row of a dropped channel
        (`_load_tile`'s test)."""
        offs_r = tl.arange(0, BLOCK_R)
        keep = (tl.abs(x) > t) & in_k
        return tl.load(At + (k0 + ar)[:, None] * a_stride + offs_r[None, :],
                       mask=keep[:, None] & (offs_r < r_t)[None, :], other=0.0)

    @triton.jit
    def _load_x(Xp, Up, mask, GLU: tl.constexpr, r, NORM: tl.constexpr):
        """The input at pointers Xp in float32; with GLU, silu(x) * u with u at Up, rounded as
        eager silu(gate) * up rounds; with NORM, RMSNorm's w * (x * r), w at Up and r from
        `_norm_scale`, rounded as `models.decoder.RMSNorm`. Pointers are scalar base + offsets."""
        x = tl.load(Xp, mask=mask, other=0.0)
        if GLU:
            g = x.to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(Xp.dtype.element_ty).to(tl.float32)
            u = tl.load(Up, mask=mask, other=0.0).to(tl.float32)
            x = (s * u).to(Xp.dtype.element_ty)
        if NORM:
            x = _norm_x(x, tl.load(Up, mask=mask, other=0.0), r)
        return x.to(tl.float32)

    @triton.jit
    def _norm_x(x, w, r):
        """RMSNorm's output of loaded x and weight w, given r (`_load_x` with NORM), in x's dtype."""
        h = (x.to(tl.float32) * r).to(x.dtype).to(tl.float32)
        return (w.to(tl.float32) * h).to(x.dtype)

    @triton.jit
    def _norm_scale(SsIn, n_ss, K, eps, NORM: tl.constexpr, SS_BLOCK: tl.constexpr):
        """RMSNorm's 1 / sqrt(mean(x^2) + eps) from the n_ss partial sums of squares the
        producing projection left (`_finish_splits` with RESID); 1.0 without NORM."""
        if NORM:
            offs = tl.arange(0, SS_BLOCK)
            ss = tl.sum(tl.load(SsIn + offs, mask=offs < n_ss, other=0.0), axis=0)
            return tl.math.rsqrt(ss * (1.0 / K) + eps)  # as torch.rsqrt, on the critical path of every program
        else:
            return 1.0

    @triton.jit
    def _load_tile(W, k0, ar, in_k, x, t, offs_n, mask_n, stride, EVEN_N: tl.constexpr):
        """The (BLOCK_K, BLOCK_N) weight tile of rows k0 + ar whose |x| > t (and in range): masked
        rows issue no load. The row stride is a constant, so the tile's pointers are one scalar
        address plus offsets that fold to constants: each row's load takes an immediate offset
        (sm_90 SASS; docs/kernels/sparse_gemv.md#row-stride-const)."""
        keep = (tl.abs(x) > t) & in_k
        ptr = (W + k0 * stride) + (ar[:, None].to(tl.int64) * stride + offs_n[None, :].to(tl.int64))
        if EVEN_N:
            w = tl.load(ptr, mask=keep[:, None], other=0.0)
        else:
            w = tl.load(ptr, mask=keep[:, None] & mask_n[None, :], other=0.0)
        return w

    @triton.jit
    def _load_view(W, offs_n, mask_n, pid_n, N, BITS: tl.constexpr, COLS: tl.constexpr, STRIDE: tl.constexpr):
        """(pointer, column offsets, column mask, row stride) the weight loads use: W's columns,
        or with BITS its bf16 columns as COLS int32 pairs (N and the row stride even)."""
        if BITS:
            offs = pid_n * COLS + tl.arange(0, COLS)
            return W.to(tl.pointer_type(tl.int32)), offs, offs < N // 2, STRIDE // 2
        else:
            return W, offs_n, mask_n, STRIDE

    @triton.jit
    def _columns(acc, acc_hi, BITS: tl.constexpr, BLOCK_N: tl.constexpr):
        """The tile's BLOCK_N column sums in order: with BITS, the even and odd columns interleaved."""
        if BITS:
            return tl.reshape(tl.join(acc, acc_hi), [BLOCK_N])
        else:
            return acc

    @triton.jit
    def _sum_tile(acc, acc_hi, w, x, BITS: tl.constexpr):
        """acc (+ acc_hi) plus the tile's sum over rows of x * w in float32. With BITS, w is bf16
        pairs in int32 words (column 2j low): a bf16 is the top half of its float32, so the even
        column (acc) is the word << 16 and the odd one (acc_hi) the word with its low half cleared
        (docs/kernels/sparse_gemv.md#bf16-pairs)."""
        if BITS:
            lo = (w << 16).to(tl.float32, bitcast=True)
            hi = (w & -65536).to(tl.float32, bitcast=True)
            return acc + tl.sum(lo * x[:, None], axis=0), acc_hi + tl.sum(hi * x[:, None], axis=0)
        else:
            return acc + tl.sum(w.to(tl.float32) * x[:, None], axis=0), acc_hi

    @triton.jit
    def _sparse_gemv_kernel(
        X, W, Bias, Thr0, Thr1, Thr2, Y, Acc, Count, thr_f, K, N, stride_wk, b1, b2,
        rows_per_split, num_splits,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, THR_T: tl.constexpr, NSEG: tl.constexpr,
        SEG_ALIGNED: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, DBUF: tl.constexpr,
        U, GLU: tl.constexpr, PDL: tl.constexpr, BITS: tl.constexpr, COLS: tl.constexpr,
        Res, SsOut, SsIn, n_ss, eps, RESID: tl.constexpr, NORM: tl.constexpr, SS_BLOCK: tl.constexpr,
        STRIDE: tl.constexpr, FIN_LOAD: tl.constexpr,
        At, Bt, rank, a_stride, lora_s, lora_s1, lora_s2, LORA: tl.constexpr, BLOCK_R: tl.constexpr, A_PF: tl.constexpr,
    ):
        if PDL:  # launched as a programmatic dependent: every memory access waits for the
            # previous kernel; the next one may launch now (docs/kernels/sparse_gemv.md#pdl-trigger)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        # Program (n tile, k split): adjacent n tiles of a split together stream whole kept rows
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        mask_n = offs_n < N
        # With NORM, x is the residual stream and the input its RMSNorm (dead code in stages 4)
        r_norm = _norm_scale(SsIn, n_ss, K, eps, NORM, SS_BLOCK)
        # One threshold, or one per column segment [0, b1), [b1, b2), [b2, N) of a concatenated
        # weight (q|k|v, gate|up): per program when the bounds are whole tiles, else per column
        if NSEG > 1 and not SEG_ALIGNED:
            t_col = _tile_threshold(Thr0, Thr1, Thr2, thr_f, b1, b2, offs_n, THR_T, NSEG)  # (BLOCK_N,)
        else:
            t0 = _tile_threshold(Thr0, Thr1, Thr2, thr_f, b1, b2, pid_n * BLOCK_N, THR_T, NSEG)
        k_lo = pid_k * rows_per_split
        k_hi = tl.minimum(k_lo + rows_per_split, K)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        # With LORA every program also sums its split's share of its tile's own u = A x_m over
        # A^T's kept rows (from L2 after the first tile reads them), so no tile waits for
        # another's u (docs/kernels/lora_gemv.md)
        acc_u = tl.zeros([BLOCK_R], dtype=tl.float32)
        if LORA:  # the tile's segment (q|k|v, gate|up: aligned, checked by the launcher): its
            # adapter's columns of A^T and its scale; scale 0, a site without one, reads nothing
            seg = (pid_n * BLOCK_N >= b1).to(tl.int32) + (pid_n * BLOCK_N >= b2).to(tl.int32)
            s_t = tl.where(seg == 0, lora_s, tl.where(seg == 1, lora_s1, lora_s2))
            r_t = tl.where(s_t != 0.0, rank, 0)
            At = At + seg * rank
        else:
            s_t = lora_s
            r_t = rank
        if DBUF and not (NSEG > 1 and not SEG_ALIGNED):
            # Two tiles in flight: an iteration issues tile i + 1's weight loads (its x already
            # loaded) and tile i + 2's x, then sums tile i (docs/kernels/sparse_gemv.md#stages)
            Wl, offs_l, mask_l, stride_l = _load_view(W, offs_n, mask_n, pid_n, N, BITS, COLS, STRIDE)
            acc_l = tl.zeros([COLS], dtype=tl.float32)
            acc_h = tl.zeros([COLS], dtype=tl.float32)
            ar = tl.arange(0, BLOCK_K)
            if NORM:  # the first two x slices and the norm's partials in flight, then r
                p_c, p_n = k_lo + ar, k_lo + BLOCK_K + ar
                xr_c, wr_c = tl.load(X + p_c, mask=p_c < k_hi, other=0.0), tl.load(U + p_c, mask=p_c < k_hi, other=0.0)
                xr_n, wr_n = tl.load(X + p_n, mask=p_n < k_hi, other=0.0), tl.load(U + p_n, mask=p_n < k_hi, other=0.0)
                r_norm = _norm_scale(SsIn, n_ss, K, eps, NORM, SS_BLOCK)
                x_c = _norm_x(xr_c, wr_c, r_norm).to(tl.float32)
                w_c = _load_tile(Wl, k_lo, ar, p_c < k_hi, x_c, t0, offs_l, mask_l, stride_l, EVEN_N)
                x_n = _norm_x(xr_n, wr_n, r_norm).to(tl.float32)
            else:
                x_c = _load_x(X + k_lo + ar, U + k_lo + ar, k_lo + ar < k_hi, GLU, r_norm, NORM)
                w_c = _load_tile(Wl, k_lo, ar, k_lo + ar < k_hi, x_c, t0, offs_l, mask_l, stride_l, EVEN_N)
                x_n = _load_x(X + k_lo + BLOCK_K + ar, U + k_lo + BLOCK_K + ar, k_lo + BLOCK_K + ar < k_hi,
                              GLU, r_norm, NORM)
            if LORA and A_PF:
                a_c = _load_a(At, k_lo, ar, k_lo + ar < k_hi, x_c, t0, r_t, a_stride, BLOCK_R)
            for k0 in range(k_lo + BLOCK_K, k_hi + BLOCK_K, BLOCK_K):  # k0: the tile loaded now
                offs_k = k0 + ar
                w_n = _load_tile(Wl, k0, ar, offs_k < k_hi, x_n, t0, offs_l, mask_l, stride_l, EVEN_N)
                if LORA and A_PF:  # the adapter's rows of tile k0 in flight beside the weight's
                    a_n = _load_a(At, k0, ar, offs_k < k_hi, x_n, t0, r_t, a_stride, BLOCK_R)
                x_nn = _load_x(X + offs_k + BLOCK_K, U + offs_k + BLOCK_K, offs_k + BLOCK_K < k_hi, GLU, r_norm, NORM)
                acc_l, acc_h = _sum_tile(acc_l, acc_h, w_c, x_c, BITS)  # tile k0 - BLOCK_K
                if LORA and A_PF:
                    acc_u += tl.sum(a_c.to(tl.float32) * x_c[:, None], axis=0)
                    a_c = a_n
                elif LORA:  # gemv.lora_prefetch=false: tile k0 - BLOCK_K's rows loaded at their sum
                    a_s = _load_a(At, k0 - BLOCK_K, ar, offs_k - BLOCK_K < k_hi, x_c, t0, r_t, a_stride, BLOCK_R)
                    acc_u += tl.sum(a_s.to(tl.float32) * x_c[:, None], axis=0)
                x_c, w_c, x_n = x_n, w_n, x_nn
            _finish_splits(Acc, Count, Bias, Y, _columns(acc_l, acc_h, BITS, BLOCK_N), offs_n,
                           mask_n, pid_n, num_splits, HAS_BIAS, Res, SsOut, RESID, FIN_LOAD,
                           Bt, N, rank, r_t, s_t, acc_u, LORA, BLOCK_R)
            return
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
            in_k = offs_k < k_hi
            x = _load_x(X + offs_k, U + offs_k, in_k, GLU, r_norm, NORM)
            if NSEG > 1 and not SEG_ALIGNED:
                row_mask = (tl.abs(x)[:, None] > t_col[None, :]) & in_k[:, None] & mask_n[None, :]
            else:
                keep = (tl.abs(x) > t0) & in_k  # the fused threshold test
                if EVEN_N:
                    row_mask = keep[:, None]
                else:
                    row_mask = keep[:, None] & mask_n[None, :]
            # Masked lanes issue no load: a dropped row moves no bytes.
            w = tl.load(W + offs_k[:, None] * stride_wk + offs_n[None, :], mask=row_mask, other=0.0)
            if LORA:  # the adapter's kept rows, issued beside the weight's
                a = _load_a(At, k0, tl.arange(0, BLOCK_K), in_k, x, t0, r_t, a_stride, BLOCK_R)
            # Summed over the tile's rows at once: each thread holds all BLOCK_K rows of its 8
            # columns, so this is in-thread adds and the accumulator costs 8 registers.
            acc += tl.sum(w.to(tl.float32) * x[:, None], axis=0)  # (BLOCK_N,)
            if LORA:
                acc_u += tl.sum(a.to(tl.float32) * x[:, None], axis=0)
        _finish_splits(Acc, Count, Bias, Y, acc, offs_n, mask_n, pid_n, num_splits, HAS_BIAS, Res, SsOut, RESID,
                       FIN_LOAD, Bt, N, rank, r_t, s_t, acc_u, LORA, BLOCK_R)


def launch_constexprs(N: int, block_n: int, block_k: int, num_warps: int, stages: int, *, bits: bool,
                      stride: int, nseg: int = 1, seg_aligned: bool = True, has_bias: bool = False,
                      thr_t: bool = True, glu: bool = False, pdl: bool = False, resid: bool = False,
                      norm: bool = False, n_ss: int = 0, lora: bool = False, rank: int = 0,
                      lora_prefetch: bool = True) -> dict:
    """Every constexpr of `_sparse_gemv_kernel` as the launcher sets it, in one place for the launch,
    the sm_90 compiles of the tests and `benchmarks/kernels/gemv_registers.py` (`kernels.sm90`)."""
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, THR_T=thr_t, NSEG=nseg, SEG_ALIGNED=seg_aligned,
                HAS_BIAS=has_bias, EVEN_N=N % block_n == 0, DBUF=stages == 4, GLU=glu, PDL=pdl, BITS=bits,
                COLS=block_n // 2 if bits else block_n, RESID=resid, NORM=norm, SS_BLOCK=_pow2(max(1, n_ss)),
                STRIDE=stride if stages == 4 else 0, FIN_LOAD=finish_mode(num_warps) == "load", LORA=lora,
                BLOCK_R=max(MIN_BLOCK, _pow2(rank)), A_PF=lora_prefetch)


@torch.library.custom_op("sparsedecode::sparse_gemv", mutates_args=())
def _sparse_gemv_op(
    x: Tensor, w_t: Tensor, thr_ts: list[Tensor], thr_f: float, bounds: list[int], bias: Tensor | None,
    ws_acc: Tensor | None, ws_count: Tensor | None,
    block_n: int, block_k: int, splits: int, num_warps: int, stages: int, up: Tensor | None,
    residual: Tensor | None, norm_w: Tensor | None, ss_in: Tensor | None, eps: float,
    pdl: bool, programs_per_sm: int, lora_a: Tensor | None = None, lora_b: Tensor | None = None,
    lora_scales: list[float] | None = None, lora_prefetch: bool = True,
) -> tuple[Tensor, Tensor]:
    # Declared pure although it writes the workspace: the kernel returns the workspace to
    # all-zero before it exits, so no caller can observe the writes, and torch.compile need
    # not functionalize (clone) a buffer that only serves as scratch. Host-side choices
    # (config from the SM count and programs_per_sm, PDL) run at trace and capture time.
    K, N = w_t.shape
    if not block_n:
        block_n, block_k, splits, num_warps, stages = default_config(K, N, x.dtype, x.device, programs_per_sm)
    if stages not in STAGES:  # from config= or a tuned file
        raise InputError(f"stages {stages} for ({K}, {N}): the kernel runs stages 1 (plain loop) and 4 (two tiles "
                         "in flight); the other loops were measured slower on the H200 and removed "
                         "(docs/kernels/sparse_gemv.md#stages; pass another config= or fix the tuned file)")
    # with a residual, each column tile's sum of squares of the new residual stream (else empty)
    ss = torch.empty(triton.cdiv(N, block_n) if residual is not None else 0, device=x.device, dtype=torch.float32)
    splits = common.splits(K, block_k, splits)
    lora, rank = lora_a is not None, 0 if lora_b is None else lora_b.shape[0]
    if lora and not all(b % block_n == 0 for b in bounds):
        raise InputError(f"an adapter on a segmented launch needs the segment bounds {bounds} on the tile grid "
                         f"(BLOCK_N {block_n}): run the sites apart")
    scales = (list(lora_scales or [0.0]) + [0.0, 0.0])[:3]
    if ws_acc is None or ws_count is None:  # a memset: capturable, but a node more
        ws_acc, ws_count = lora_workspace(N, rank, x.device) if lora else workspace(N, x.device, block_n)
    y = torch.empty(N, device=x.device, dtype=x.dtype)
    n_tiles = triton.cdiv(N, block_n)
    thr = list(thr_ts) + [ws_acc] * (3 - len(thr_ts))  # unused pointer slots
    b1, b2 = (list(bounds) + [N, N])[:2]
    args = (x, w_t, bias if bias is not None else x, *thr, y, ws_acc, ws_count, thr_f, K, N, w_t.stride(0),
            b1, b2, common.rows_per_split(K, block_k, splits), splits)
    # bf16 read as int32 pairs (stages 4): N, the row stride and the base 4-byte aligned
    bits = (x.dtype == torch.bfloat16 and stages == 4 and N % 2 == 0
            and w_t.stride(0) % 2 == 0 and w_t.data_ptr() % 4 == 0)
    on_gpu = x.is_cuda and not _interpreting()
    pdl = pdl and on_gpu
    cap = {"maxnreg": max_registers(n_tiles * splits, num_warps, x.device)} if on_gpu else {}
    _sparse_gemv_kernel[(n_tiles, splits)](
        *args, U=up if up is not None else norm_w if norm_w is not None else x,
        Res=residual if residual is not None else x, SsOut=ss if residual is not None else ws_acc,
        SsIn=ss_in if ss_in is not None else ws_acc, n_ss=0 if ss_in is None else ss_in.numel(), eps=eps,
        At=lora_a if lora else x, Bt=lora_b if lora else x, rank=rank, a_stride=lora_a.shape[1] if lora else 0,
        lora_s=scales[0], lora_s1=scales[1], lora_s2=scales[2],
        **launch_constexprs(N, block_n, block_k, num_warps, stages, bits=bits, stride=w_t.stride(0),
                            nseg=max(1, len(thr_ts)), seg_aligned=all(b % block_n == 0 for b in bounds),
                            has_bias=bias is not None, thr_t=bool(thr_ts), glu=up is not None, pdl=pdl,
                            resid=residual is not None, norm=norm_w is not None,
                            n_ss=0 if ss_in is None else ss_in.numel(), lora=lora, rank=rank,
                            lora_prefetch=lora_prefetch),
        num_warps=num_warps, num_stages=1, **cap, **({"launch_pdl": True} if pdl else {}))
    return y, ss


@_sparse_gemv_op.register_fake
def _(x, w_t, thr_ts, thr_f, bounds, bias, ws_acc, ws_count, block_n, block_k, splits, num_warps, stages,
      up, residual, norm_w, ss_in, eps, pdl, programs_per_sm, lora_a=None, lora_b=None, lora_scales=None, lora_prefetch=True):
    K, N = w_t.shape
    if not block_n:
        block_n = default_config(K, N, x.dtype, x.device, programs_per_sm)[0]
    return x.new_empty(N), x.new_empty(-(-N // block_n) if residual is not None else 0, dtype=torch.float32)


def _bounds(segments: list[int]) -> list[int]:
    """Column bounds between the blocks of a segmented weight."""
    return [sum(segments[:j + 1]) for j in range(len(segments) - 1)]


def sparse_gemv(
    x: Tensor, w_t: Tensor, threshold, bias: Tensor | None = None,
    ws: tuple[Tensor, Tensor] | None = None, config: tuple[int, int, int, int, int] | None = None,
    segments: list[int] | None = None, up: Tensor | None = None, *,
    residual: Tensor | None = None, norm: tuple[Tensor, Tensor, float] | None = None,
    options: GemvOptions = DEFAULT.gemv, lora: tuple[Tensor, Tensor, float, Tensor | None] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Input-sparse GEMV of one token with the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1).

    x (..., K) holding one token; w_t (K, N), the weight transposed (unit stride along N; the
    row stride may exceed N, so a column slice of a concatenated weight works); threshold a
    float or a 1-element float tensor on x's device (read on the device, so a captured graph
    follows in-place updates); channel i is kept iff |x_i| > threshold. Returns (..., N) in
    x's dtype: sum over kept i of x_i * w_t[i, :] (+ bias), fp32 accumulation; rows of
    dropped channels are never loaded (§3.2).

    A concatenated weight (q|k|v, or gate|up) runs as one launch with one threshold per
    site: `segments` lists the widths of its 2 or 3 column blocks and `threshold` is a list
    of as many 1-element tensors; column block j keeps row i iff |x_i| > threshold[j].

    With `up` (x's shape, dtype and device) the input is SwiGLU's silu(x) * up, formed in the
    kernel's x load (x is the gate); the threshold applies to the product (§3.2).

    `ws`: a persistent `workspace(N, device)` (else each call zeroes a fresh one); `config`
    (BLOCK_N, BLOCK_K, splits, num_warps, stages 1 or 4) overrides `default_config`, for
    tuning; `options`: the launch options, passed to the custom op as plain values (a captured
    graph bakes in the ones it was given).

    Fused RMSNorm, so a decoder layer's norms need no kernels of their own: with `residual`
    (the output's shape and dtype) the call returns (residual + y, ss), rounded as eager
    `x + proj(h)`, and ss (float32, one per column tile) the tiles' sums of squares of that new
    stream. With `norm` = (weight (K,) in x's dtype, ss, eps) x is such a stream and the input
    is RMSNorm(x), rounded as `models.decoder.RMSNorm`, formed in the x loads.

    With `lora` = (a_t (K, r), b_t (r, N), s), both in x's dtype and contiguous, the call adds an
    adapter's s * B (A x_m) in the same launch (`kernels.lora_gemv.lora_gemv` is the public call,
    with its checks and its reference); `ws` must then be `lora_workspace(N, r, device)`. On a
    segmented launch a_t is the sites' A^T side by side (K, S r), b_t their B^T (r, N) and s one
    scale per site (0 for a site without an adapter: its A^T columns are never read); the
    segment bounds must be whole column tiles (the launcher refuses others).
    """
    if triton is None:
        raise InputError("the sparse GEMV kernel needs Triton: pip install triton (or use sparse_gemv_ref)")
    if not isinstance(options, GemvOptions):
        raise InputError(f"options must be a GemvOptions; got {type(options).__name__}")
    thresholds = threshold if isinstance(threshold, (list, tuple)) else [threshold]
    if segments is not None or len(thresholds) > 1:
        if segments is None or len(segments) != len(thresholds) or not 2 <= len(segments) <= 3:
            raise InputError(
                f"a segmented call wants 2 or 3 column widths and one threshold per width; got "
                f"segments={segments} and {len(thresholds)} thresholds"
            )
        if sum(segments) != w_t.shape[-1] or min(segments) < 1:
            raise InputError(f"segments {segments} must be positive and sum to N={w_t.shape[-1]}")
        if not all(isinstance(t, Tensor) for t in thresholds):
            raise InputError("segment thresholds must be 1-element float tensors on x's device")
    for t in thresholds:
        K, N = check_inputs(x, w_t, t, bias)
    if lora is not None:
        check_lora(lora, x, K, N, segments, ws)
    if up is not None and (up.shape != x.shape or up.dtype != x.dtype or up.device != x.device):
        raise InputError(f"up must match the gate x: {tuple(x.shape)} {x.dtype} on {x.device}; got "
                         f"{tuple(up.shape)} {up.dtype} on {up.device}")
    if residual is not None and (residual.shape != (*x.shape[:-1], N) or residual.dtype != x.dtype
                                 or residual.device != x.device):
        raise InputError(f"residual must be the output's shape {(*x.shape[:-1], N)} in {x.dtype} on {x.device}; "
                         f"got {tuple(residual.shape)} {residual.dtype} on {residual.device}")
    if norm is not None:
        if up is not None:
            raise InputError("norm= and up= do not combine: the norm's input is the residual stream")
        norm_w, ss, eps = norm
        if norm_w.shape != (K,) or norm_w.dtype != x.dtype or norm_w.device != x.device:
            raise InputError(f"the norm weight must be ({K},) in {x.dtype} on {x.device}; got "
                             f"{tuple(norm_w.shape)} {norm_w.dtype} on {norm_w.device}")
        if ss.dim() != 1 or ss.dtype != torch.float32 or ss.device != x.device or not 1 <= ss.numel() <= 4096:
            raise InputError(f"the norm's sums of squares must be float32 (1 to 4096,) on {x.device}, as "
                             f"sparse_gemv(residual=...) returns them; got {tuple(ss.shape)} {ss.dtype} on {ss.device}")
    if not (x.is_cuda or _interpreting()):
        raise InputError(
            "the sparse GEMV Triton kernel runs on CUDA (or on CPU with TRITON_INTERPRET=1); "
            "use sparse_gemv_ref, the masked reference"
        )
    if w_t.stride(1) != 1 or w_t.stride(0) < N:
        raise InputError(
            f"w_t (K, N) must have unit stride along N and a row stride >= N (got strides {w_t.stride()}): "
            "the kernel skips whole rows; store the weight transposed once"
        )
    if K * w_t.stride(0) >= 2**31:
        raise InputError(f"a ({K}, {w_t.stride(0)}) weight exceeds the kernel's 32-bit offsets")
    if ws is not None and (ws[0].numel() < N or ws[0].dtype != torch.float32 or ws[1].dtype != torch.int32):
        raise InputError("ws must be workspace(N, device): (float32 (>= N,), int32 counters)")
    if config is not None:
        if len(config) != 5:
            raise InputError(f"config is (BLOCK_N, BLOCK_K, splits, num_warps, stages); got {config}")
        block_n, block_k = config[:2]  # stages: checked by the op, as a tuned file's
        if block_n & (block_n - 1) or block_k & (block_k - 1) or block_n < MIN_BLOCK or block_k < MIN_BLOCK_K:
            raise InputError(f"BLOCK_N and BLOCK_K must be powers of two, BLOCK_N >= {MIN_BLOCK} and "
                             f"BLOCK_K >= {MIN_BLOCK_K}; got {config}")
        if ws is not None and ws[1].numel() < -(-N // block_n):
            raise InputError(f"ws has {ws[1].numel()} counters; BLOCK_N={block_n} needs {-(-N // block_n)}")
    if isinstance(thresholds[0], Tensor):
        thr_ts, thr_f = [t.reshape(()) for t in thresholds], 0.0
    else:
        thr_ts, thr_f = [], float(thresholds[0])
    bounds = [] if segments is None else _bounds(segments)
    norm_w, ss_in, eps = norm if norm is not None else (None, None, 0.0)
    if lora is not None and config is None and options.lora_programs_per_sm is not None:
        config = default_config(K, N, x.dtype, x.device, options.lora_programs_per_sm, tuned=False)
    y, ss = _sparse_gemv_op(x.reshape(K), w_t, thr_ts, thr_f, bounds, bias, *(ws or (None, None)),
                            *(config or (0, 0, 0, 0, 0)), None if up is None else up.reshape(K),
                            None if residual is None else residual.reshape(N), norm_w, ss_in, float(eps),
                            options.pdl, options.programs_per_sm, *(lora[:2] if lora else (None, None)),
                            None if lora is None else lora_scales(lora[2]), options.lora_prefetch)
    y = y.reshape(*x.shape[:-1], N)
    return y if residual is None else (y, ss)


def sumsq(x: Tensor) -> Tensor:
    """The float32 sum of squares of x, as a (1,) tensor: the partials `sparse_gemv(norm=...)`
    reads, for a residual stream that no `sparse_gemv(residual=...)` produced (the
    embedding's output before the first layer)."""
    return x.float().pow(2).sum().reshape(1)


def sparse_gemv_segments_ref(x: Tensor, w_t: Tensor, thresholds: list, segments: list[int],
                             bias: Tensor | None = None) -> Tensor:
    """Masked reference of a segmented `sparse_gemv`: each column block with its own threshold."""
    outs, lo = [], 0
    for t, width in zip(thresholds, segments, strict=True):
        b = None if bias is None else bias[lo:lo + width]
        outs.append(sparse_gemv_ref(x, w_t[:, lo:lo + width], t, b))
        lo += width
    return torch.cat(outs, dim=-1)


__all__ = [
    "default_config", "keep_mask", "launch_constexprs", "read_tuned", "sparse_gemv", "sparse_gemv_ref", "sparse_gemv_segments_ref",
    "sumsq", "tuned_configs", "tuned_file", "workspace",
]
