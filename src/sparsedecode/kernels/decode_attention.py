"""Split-K (flash-decoding) attention for one decode query per sequence (ByteCross §4.1, §4.4, App. A).

At batch 1 a decode step has one query per head, so a kernel that gives each
(sequence, head) one program leaves most SMs idle while it streams a long
cache. Split-K cuts the read range [start, end) of every (sequence, KV head)
into NUM_SPLITS chunks handled by separate programs; each program returns a
normalised partial output and the log-sum-exp (LSE) of its scores, and the
splits are combined by LSE. The paper reads every mode's cache through such a
kernel (flash_attn_with_kvcache wrapped as an opaque custom operator, App. A):
§4.4 shows that a masked or fused dense baseline inflates the apparent KV
speedup about fivefold at 128K.

Design points:
- One program handles all G query heads of a GQA group against its KV chunk,
  so each K/V byte crosses the memory bus once (heads g*G..(g+1)*G-1 share KV
  head g, Hugging Face's repeat_kv order).
- NUM_SPLITS is static (T_alloc, batch*heads, SM count), so the launch grid
  never depends on the runtime length and the call can be captured in a CUDA
  graph. The chunk length is derived on the device from the runtime length,
  chunk = BLOCK_N * ceil(ceil(len / NUM_SPLITS) / BLOCK_N), so every active
  program gets an equal share however short the valid range is within a large
  allocation; the first n_active = ceil(len / chunk) splits are active (one
  fewer when the last would hold less than one block of keys: the split before
  it takes those) and the rest exit at once (n_active is 0 for an empty range).
  The split count comes from the `AttentionOptions` the caller passes (the
  attention layer's `kernel_options`), unpacked into the custom op's plain
  ints, so a compiled or captured step bakes in the options it was given.
- The merge is fused into the split kernel, one launch per call: a second
  merge launch costs ~4 us per layer on an H200 (0.13 ms per decode step at
  2K). Each active program writes its partial and LSE to a workspace,
  then bumps an int32 arrival counter of its (sequence, KV head); the one that
  arrives last (counter n_active - 1) merges the splits of all G heads, writes
  the output and resets the counter with an atomic exchange. The counters are
  a persistent zeroed buffer (`arrival_counters`) that every call leaves at
  zero, so there is no memset per call and a captured graph replays as is.
  Inactive programs never arrive; a call with one active split writes its
  output directly, and an empty range is written (0, -inf) by split 0. The
  two-launch path (split kernel, then `split_k_merge._merge_kernel`) stays
  behind `fused_merge=False` for comparison.
- `rope_attention` (kernels/rope_attention.py) runs the same kernel with RoPE
  and the cache write of the step's token in it (the ROPE constexpr).
- `start` lets a window read its recent entries in place from an offset and its
  sinks in a second call, the two merged by `merge_lse` (App. A) with no copy.
- An empty range gives output 0 and LSE -inf, never NaN.

`split_k_ref` is the same chunking and merge in plain PyTorch: the CPU path of
the engine and the oracle of the tests. Choices measured and their records:
docs/kernels/decode_attention.md.
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch import Tensor

from sparsedecode.errors import InputError
from sparsedecode.kernels.options import DEFAULT, AttentionOptions
from sparsedecode.kernels.split_k_merge import (
    _active_splits,
    _chunk_len,
    _merge,
    _merge_blocks,
    merge_lse,
)

try:
    import triton
    import triton.language as tl

    from sparsedecode.kernels.split_k_merge import (
        _merge_group,
        _merge_kernel,
        _splits_of,
        _store_out,
        _valid_range,
    )
except ImportError:
    triton = None

BLOCK_N = 64  # keys per inner iteration: 16 KB of K and of V per tile at D=128 in bf16
MAX_SPLITS = 128  # the merge holds all split LSEs of a head in one vector
CPU_SPLITS = 1  # eager PyTorch gains no parallelism from splits; tests ask for more
MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634


def check_inputs(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> tuple[int, int, int, int, int, int]:
    """Validate decode-attention operands; returns (B, Hq, Hkv, G, T, D)."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise InputError(
            f"decode attention wants q (B, Hq, D) and caches (B, Hkv, T, D); "
            f"got q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape:
        raise InputError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    B, Hq, D = q.shape
    Bk, Hkv, T, Dk = k_cache.shape
    if Bk != B or Dk != D:
        raise InputError(
            f"q {tuple(q.shape)} does not match caches {tuple(k_cache.shape)} in batch or head dim"
        )
    if Hkv == 0 or Hq % Hkv:
        raise InputError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in DTYPES:
        raise InputError(
            f"decode attention runs in float16, bfloat16 or float32 with one dtype for q, k, v; "
            f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if not (q.device == k_cache.device == v_cache.device):
        raise InputError(f"q, k_cache, v_cache live on {q.device}, {k_cache.device}, {v_cache.device}")
    return B, Hq, Hkv, Hq // Hkv, T, D


def default_num_splits(T: int, batch_heads: int, device: torch.device, block_n: int = BLOCK_N,
                       options: AttentionOptions = DEFAULT.attention) -> int:
    """Static split count: options.programs_per_sm programs per SM at full length (on CUDA;
    CPU_SPLITS elsewhere), each split covering at least options.min_split_keys of the T keys.

    Depends only on the allocation T, batch*KV heads, the SM count and the options, never on
    the runtime length, so the grid of a captured call is fixed. Why these defaults:
    docs/kernels/decode_attention.md#split-count and #min-split-keys.
    """
    return _num_splits(T, batch_heads, _device_sms(device), block_n, options.programs_per_sm,
                       options.min_split_keys or 0)


def _num_splits(T: int, batch_heads: int, sms: int | None, block_n: int, programs_per_sm: int,
                min_split_keys: int) -> int:
    """`default_num_splits` on plain ints (what the custom ops receive; min_split_keys 0: none)."""
    splits = CPU_SPLITS if sms is None else -(-programs_per_sm * sms // batch_heads)
    return max(1, min(splits, -(-T // max(block_n, min_split_keys)), MAX_SPLITS))


def _device_sms(device: torch.device) -> int | None:
    """The SM count of a CUDA device; None elsewhere."""
    if device.type != "cuda":
        return None
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _bound(x, B: int, device: torch.device, name: str, dtype: torch.dtype | None = torch.int64) -> Tensor:
    """An int or 0-d/(1,)/(B,) integer tensor as a (B|1,) tensor on `device` (no host sync).

    dtype=None keeps a tensor's integer dtype (the kernel loads any), saving a cast kernel.
    """
    if isinstance(x, Tensor):
        integer = not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)
        if not integer or x.numel() not in (1, B):
            raise InputError(
                f"{name} must be an int or an integer tensor of 1 or B={B} elements; "
                f"got {x.dtype} {tuple(x.shape)}"
            )
        return x.reshape(-1).to(device=device, dtype=dtype or x.dtype)
    return torch.tensor([int(x)], device=device, dtype=dtype or torch.int64)


def split_k_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, end, start=0, scale: float | None = None,
    num_splits: int | None = None, block_n: int = BLOCK_N, *, end_offset: int = 0,
    options: AttentionOptions = DEFAULT.attention,
) -> tuple[Tensor, Tensor]:
    """Split-K attention in plain PyTorch: the kernel's chunking and LSE merge, in float32.

    q (B, Hq, D); caches (B, Hkv, T, D); reads [start, end + end_offset) per row, bounds
    being ints or 0-d/(B,) integer tensors (clamped to [0, T]; no host sync). Returns
    (out (B, Hq, D) in q's dtype, lse (B, Hq) float32, natural log of the scaled scores).
    The split count is num_splits, or `default_num_splits` under `options`.
    """
    B, Hq, Hkv, G, T, D = check_inputs(q, k_cache, v_cache)
    _check_options(options)
    S = num_splits or default_num_splits(T, B * Hkv, q.device, block_n, options)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    dev = q.device
    lo = _bound(start, B, dev, "start").clamp(0, T).view(-1, 1, 1)  # (B|1, 1, 1)
    hi = (_bound(end, B, dev, "end") + end_offset).clamp(0, T).view(-1, 1, 1)
    pos = torch.arange(T, device=dev).view(1, 1, T)
    if S == 1:
        member = (pos >= lo) & (pos < hi)  # (B|1, 1, T): one split covers the range
    else:
        length = (hi - lo).clamp_min(0)
        chunk = _chunk_len(length, S, block_n)  # (B|1, 1, 1), as the kernel derives it
        n_active = _active_splits(length, chunk, block_n)  # (B|1, 1, 1)
        split = torch.arange(S, device=dev).view(1, S, 1)
        first = lo + split * chunk  # (B|1, S, 1)
        last = torch.where(split == n_active - 1, hi, torch.minimum(first + chunk, hi))  # the last reads to hi
        member = (split < n_active) & (pos >= first) & (pos < last)  # (B|1, S, T)

    qg = q.view(B, Hkv, G, D).float()
    scores = torch.matmul(qg, k_cache.float().transpose(-1, -2)) * scale  # (B, Hkv, G, T)
    sc = scores.unsqueeze(3).masked_fill(~member.view(-1, 1, 1, S, T), -math.inf)  # (B, Hkv, G, S, T)
    m = sc.amax(-1, keepdim=True)  # (B, Hkv, G, S, 1), -inf for empty splits
    e = torch.exp(sc - m.masked_fill(torch.isinf(m), 0.0))  # 0 off the split
    l_sum = e.sum(-1, keepdim=True)  # (B, Hkv, G, S, 1), >= 1 unless the split is empty
    lse_s = (m + torch.log(l_sum)).squeeze(-1)  # (B, Hkv, G, S)
    p = (e / l_sum.clamp_min(1.0)).view(B, Hkv, G * S, T)
    o_s = torch.matmul(p, v_cache.float()).view(B, Hkv, G, S, D)  # normalised partial outputs
    if S == 1:
        out, lse = o_s[..., 0, :], lse_s[..., 0]  # merging one split is the identity
    else:
        out, lse = _merge(o_s, lse_s)  # (B, Hkv, G, D), (B, Hkv, G)
    return out.reshape(B, Hq, D).to(q.dtype), lse.reshape(B, Hq)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def arrival_counters(batch_kv_heads: int, device) -> Tensor:
    """Zeroed int32 arrival counters of the fused merge, one per (sequence, KV head): (B*Hkv,).

    Every call leaves them at zero again, so one buffer serves any number of calls in
    sequence on a stream (and in a CUDA graph); calls that may run at the same time on
    different streams need a buffer each.
    """
    return torch.zeros(batch_kv_heads, device=device, dtype=torch.int32)


# Counters for calls that bring none, one buffer per (device, B*Hkv). Never freed or
# replaced: a captured graph keeps the address it was captured with.
_COUNTERS: dict[tuple[torch.device, int], Tensor] = {}


def _cached_counters(n: int, device: torch.device) -> Tensor:
    buf = _COUNTERS.get((device, n))
    if buf is not None:
        return buf
    buf = arrival_counters(n, device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # Zeroed by a memset node that runs only on replay, so an eager call must not see
        # it: used by this call alone (a node more per replay; warm up before capturing).
        return buf
    _COUNTERS[(device, n)] = buf
    return buf


if triton is not None:

    @triton.jit
    def _rope(x, x_p, c, sn, sign, one):
        """RoPE of the rows x (their rotate_half partners x_p) by the table tiles c, sn (sign: -1 on
        the first half), each times `one` (1.0): float32, rounded once to x's dtype, as `rope_cache`
        rotates."""
        return (x.to(tl.float32) * (c.to(tl.float32) * one)
                + x_p.to(tl.float32) * (sn.to(tl.float32) * sign * one)).to(x.dtype)

    @triton.jit(do_not_specialize=["start_int", "end_int", "zero"])
    def _split_kernel(
        Q, K, V, O_part, L_part, Out, Lse, Count, Start, End,
        start_int, end_int, T, qk_scale,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_ob, stride_oh, stride_start, stride_end,
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        FUSED: tl.constexpr, BLOCK_GM: tl.constexpr, TILE_S: tl.constexpr,
        START_T: tl.constexpr, END_T: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
        Knew, Vnew, Cos, Sin, stride_knb, stride_vnb, zero, ROPE: tl.constexpr, HALF: tl.constexpr,
        Shift, KF, VF, stride_fb, stride_fh, stride_ft, COMPACT: tl.constexpr,
    ):
        # Scores use tl.dot with the G query heads padded to BLOCK_G >= 16 rows. The
        # alternative, a broadcast multiply + sum, materialises G*BLOCK_N*D products in
        # registers and forces tiny tiles or spills; the tensor-core dot wastes only
        # arithmetic on the padding rows, and the tensor cores idle in memory-bound
        # decode anyway, so the loads (16-byte vectors along D) set the pace. Launched plainly,
        # never as a programmatic dependent (docs/kernels/decode_attention.md#pdl).
        pid_bh = tl.program_id(0)
        split = tl.program_id(1)
        b = pid_bh // HKV
        h = pid_bh % HKV
        if COMPACT:  # `rope_attention` on a compact buffer: End holds the token's position, Shift the
            # buffer's offset; the token goes to slot End - Shift, and the range ends after it
            angle = tl.load(End).to(tl.int32)
            lo_all = 0
            hi_all = tl.minimum(angle - tl.load(Shift).to(tl.int32) + 1, T)
        else:
            lo_all, hi_all = _valid_range(Start, End, b, stride_start, stride_end, start_int, end_int,
                                          T, START_T, END_T)
            angle = hi_all - 1
        length = tl.maximum(hi_all - lo_all, 0)
        chunk, n_active = _splits_of(length, NUM_SPLITS, BLOCK_N)  # split s is active iff s < n_active
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        heads = h * G + offs_g  # (BLOCK_G,)
        mask_g = offs_g < G
        mask_d = offs_d < D
        b64 = b.to(tl.int64)
        if split < n_active:
            lo = lo_all + split * chunk
            hi = tl.where(split == n_active - 1, hi_all, tl.minimum(lo + chunk, hi_all))  # the last reads to the end
            offs_n = tl.arange(0, BLOCK_N)
            q = tl.load(
                Q + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0,
            )  # (BLOCK_G, BLOCK_D)
            if ROPE:  # `rope_attention`: q, and the new k, v at pos = end - 1, as the projection left them
                pos = hi_all - 1
                # rotate_half([lo, hi]) = [-hi, lo]: each element's partner and sign
                offs_p = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
                sign = tl.where(offs_d < HALF, -1.0, 1.0)[None, :]
                # Loads only, and each a (BLOCK_G, BLOCK_D) tile like q's (the table rows and the new
                # entry repeated down the rows): nothing waits for them before the loop, so the warp
                # issues the pipelined K, V loads first. With 1-D rows, converting them to q's layout
                # before the loop made it wait (sm_90 PTX: bar.sync before the first cp.async).
                rows = angle.to(tl.int64) * D + 0 * offs_g[:, None]  # (BLOCK_G, 1): the token's angles
                in_d = (offs_g[:, None] >= 0) & mask_d[None, :]
                c_t = tl.load(Cos + rows + offs_d[None, :], mask=in_d, other=0.0)
                s_t = tl.load(Sin + rows + offs_d[None, :], mask=in_d, other=0.0)
                q_p = tl.load(Q + b64 * stride_qb + heads[:, None] * stride_qh + offs_p[None, :],
                              mask=mask_g[:, None] & mask_d[None, :], other=0.0)
                new = 0 * offs_g[:, None] + h.to(tl.int64) * D  # (BLOCK_G, 1): the head's new entry
                kn_t = tl.load(Knew + b64 * stride_knb + new + offs_d[None, :], mask=in_d, other=0.0)
                kn_p = tl.load(Knew + b64 * stride_knb + new + offs_p[None, :], mask=in_d, other=0.0)
                vn_t = tl.load(Vnew + b64 * stride_vnb + new + offs_d[None, :], mask=in_d, other=0.0)
            elif DOT_F32:
                q = q.to(tl.float32)
            k_base = K + b64 * stride_kb + h.to(tl.int64) * stride_kh
            v_base = V + b64 * stride_vb + h.to(tl.int64) * stride_vh
            m = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_sum = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            for t0 in range(lo, hi, BLOCK_N):
                t = t0 + offs_n  # (BLOCK_N,)
                mask_n = t < hi
                mask_kv = mask_n[:, None] & mask_d[None, :]
                k = tl.load(k_base + t[:, None] * stride_kt + offs_d[None, :], mask=mask_kv, other=0.0)
                if ROPE:
                    # The queries rotated in the loop: above it, the rotation made the warp wait for
                    # the tables before it issued the first K, V loads (sm_90 PTX). `one` is 1 but
                    # varies with t0 for the compiler (zero is a runtime 0), so it is not hoisted.
                    q_r = _rope(q, q_p, c_t, s_t, sign, (t0 * zero + 1).to(tl.float32))
                    # Row pos of the cache holds the last step's entry: left out here, the new
                    # entry is added after the loop. A tile of pos alone is all -inf.
                    keep_n = mask_n & (t != pos)
                    if DOT_F32:
                        q_r = q_r.to(tl.float32)
                else:
                    q_r = q
                    keep_n = mask_n
                if DOT_F32:
                    k = k.to(tl.float32)
                s = tl.dot(q_r, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_G, BLOCK_N)
                s = tl.where(keep_n[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, 1))
                if ROPE:  # an all -inf tile leaves m at -inf: subtract 0 there, not -inf
                    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                else:
                    m_ref = m_new
                alpha = tl.exp2(m - m_ref)
                p = tl.exp2(s - m_ref[:, None])
                l_sum = l_sum * alpha + tl.sum(p, 1)
                v = tl.load(v_base + t[:, None] * stride_vt + offs_d[None, :], mask=mask_kv, other=0.0)
                p_v = p.to(v.dtype)
                if DOT_F32:
                    p_v = p_v.to(tl.float32)
                    v = v.to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=PRECISION)
                m = m_new
            if ROPE:
                if (pos >= lo) & (pos < hi):  # the one split whose chunk holds pos: the new entry
                    q_r = _rope(q, q_p, c_t, s_t, sign, 1.0).to(tl.float32)
                    k_new = _rope(kn_t, kn_p, c_t, s_t, sign, 1.0)  # (BLOCK_G, BLOCK_D), each row the key
                    s_new = tl.sum(q_r * k_new.to(tl.float32), 1) * qk_scale  # (BLOCK_G,)
                    m_new = tl.maximum(m, s_new)
                    alpha = tl.exp2(m - m_new)
                    p_new = tl.exp2(s_new - m_new)
                    l_sum = l_sum * alpha + p_new
                    # p rounded to the value dtype as the loop's P @ V rounds it
                    acc = acc * alpha[:, None] + p_new.to(vn_t.dtype).to(tl.float32)[:, None] * vn_t.to(tl.float32)
                    m = m_new
                    first = (offs_g == 0)[:, None] & mask_d[None, :]  # one row of each
                    tl.store(k_base + pos * stride_kt + 0 * offs_g[:, None] + offs_d[None, :], k_new, mask=first)
                    tl.store(v_base + pos * stride_vt + 0 * offs_g[:, None] + offs_d[None, :], vn_t, mask=first)
                    if COMPACT:  # the full cache receives every entry too, at the token's position
                        f = b64 * stride_fb + h.to(tl.int64) * stride_fh + angle.to(tl.int64) * stride_ft
                        tl.store(KF + f + 0 * offs_g[:, None] + offs_d[None, :], k_new, mask=first)
                        tl.store(VF + f + 0 * offs_g[:, None] + offs_d[None, :], vn_t, mask=first)
            lse = (m + tl.log2(l_sum)) * 0.6931471805599453  # natural log
            o = acc / l_sum[:, None]
            row = (b64 * HKV * G + heads) * NUM_SPLITS + split  # (BLOCK_G,)
            if FUSED:
                if n_active == 1:  # this program read the whole range: no merge
                    _store_out(Out, Lse, b64, heads, offs_d, o, lse, mask_g, mask_d,
                               stride_ob, stride_oh, HKV * G)
                else:
                    tl.store(O_part + row[:, None] * D + offs_d[None, :], o,
                             mask=mask_g[:, None] & mask_d[None, :])
                    tl.store(L_part + row, lse, mask=mask_g)
                    # Memory order: every thread's partial stores precede the barrier; the
                    # release half of the arrival (one thread, gpu scope) is cumulative, so
                    # it publishes them all. The last arrival's acquire, followed by the
                    # barrier Triton puts after a scalar atomic to broadcast its result,
                    # orders its threads' loads of the other partials after every release.
                    tl.debug_barrier()
                    arrived = tl.atomic_add(Count + pid_bh, 1, sem="acq_rel")
                    if arrived == n_active - 1:
                        _merge_group(O_part, L_part, Out, Lse, b64, h, n_active,
                                     stride_ob, stride_oh, HKV, G, D, NUM_SPLITS,
                                     BLOCK_GM, TILE_S, BLOCK_D)
                        # Every active program has arrived: nobody else touches the counter
                        # in this launch, and the next launch finds it at zero.
                        tl.atomic_xchg(Count + pid_bh, 0, sem="relaxed")
            else:
                tl.store(O_part + row[:, None] * D + offs_d[None, :], o,
                         mask=mask_g[:, None] & mask_d[None, :])
                tl.store(L_part + row, lse, mask=mask_g)
        elif FUSED:
            if split == 0:  # then n_active == 0: an empty range, and no program arrives
                _store_out(Out, Lse, b64, heads, offs_d, tl.zeros([BLOCK_G, BLOCK_D], tl.float32),
                           tl.full([BLOCK_G], float("-inf"), tl.float32), mask_g, mask_d,
                           stride_ob, stride_oh, HKV * G)


def _kernel_config(D: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel.

    64 keys x D per tile; with 3 stages Triton keeps two K and V tiles in flight
    (2 x 32 KB at D=128 in bf16, ~70 KB of shared memory with its scratch, per an sm_90
    compile), so three programs are resident per Hopper SM with ~190 KB of loads
    in flight, far above what 4.8 TB/s at ~1 us latency needs per SM (~36 KB).
    """
    if D > 128 or dtype == torch.float32:
        return 32, 4, 2
    return BLOCK_N, 4, 3



def _launch(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, start_t: Tensor | None, end_t: Tensor | None,
    counters: Tensor | None, start_int: int, end_int: int, scale: float, num_splits: int,
    block_n: int, num_warps: int, num_stages: int, fused_merge: bool, programs_per_sm: int,
    min_split_keys: int, rope: tuple | None = None, full: tuple | None = None,
) -> tuple[Tensor, Tensor]:
    """The split kernel (and the merge kernel unless fused_merge); rope = (k_new, v_new, cos, sin)
    for `rope_attention` (q then holds the unrotated (B, Hq * D) queries); full = (shift, k_full,
    v_full) where k_cache, v_cache are a compact buffer (end_t then holds the token's position,
    and the fused merge is required)."""
    # The host-side choices below (split count from the SM count and the unpacked
    # AttentionOptions, tile config; 0 = default) run eagerly at trace and capture time and are
    # static for a given shape.
    B, Hkv, T, D = k_cache.shape
    Hq = q.shape[1] if rope is None else q.shape[1] // D
    G = Hq // Hkv
    if not block_n:
        block_n, num_warps, num_stages = _kernel_config(D, q.dtype)
    num_splits = num_splits or _num_splits(T, B * Hkv, _device_sms(q.device), block_n, programs_per_sm,
                                           min_split_keys)
    o_part = torch.empty((B, Hq, num_splits, D), device=q.device, dtype=torch.float32)
    l_part = torch.empty((B, Hq, num_splits), device=q.device, dtype=torch.float32)
    out = torch.empty((B, Hq, D), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, Hq), device=q.device, dtype=torch.float32)
    if fused_merge and counters is None:
        counters = _cached_counters(B * Hkv, q.device)
    block_d = max(16, triton.next_power_of_2(D))
    bounds = (
        start_t if start_t is not None else l_part,
        end_t if end_t is not None else l_part,
        start_int, end_int, T,
    )
    strides = (
        0 if start_t is None or start_t.numel() == 1 else start_t.stride(0),
        0 if end_t is None or end_t.numel() == 1 else end_t.stride(0),
    )
    flags = dict(START_T=start_t is not None, END_T=end_t is not None)
    block_gm, block_s, tile_s = _merge_blocks(G, D, num_splits)
    k_new, v_new, cos, sin = rope if rope is not None else (q, q, q, q)
    shift, k_full, v_full = full if full is not None else (l_part, q, q)
    f_strides = (k_full.stride(0), k_full.stride(1), k_full.stride(2)) if full is not None else (0, 0, 0)
    _split_kernel[(B * Hkv, num_splits)](
        q, k_cache, v_cache, o_part, l_part, out, lse, counters if fused_merge else l_part,
        *bounds, scale * LOG2E,
        q.stride(0), D if rope is not None else q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), *strides,
        HKV=Hkv, G=G, D=D, NUM_SPLITS=num_splits, BLOCK_G=max(16, triton.next_power_of_2(G)),
        BLOCK_N=block_n, BLOCK_D=block_d,
        FUSED=fused_merge, BLOCK_GM=block_gm, TILE_S=tile_s,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=q.dtype == torch.bfloat16 and _interpreting(),
        Knew=k_new, Vnew=v_new, Cos=cos, Sin=sin, stride_knb=k_new.stride(0), stride_vnb=v_new.stride(0), zero=0,
        ROPE=rope is not None, HALF=D // 2, Shift=shift, KF=k_full, VF=v_full, stride_fb=f_strides[0],
        stride_fh=f_strides[1], stride_ft=f_strides[2], COMPACT=full is not None,
        num_warps=num_warps, num_stages=num_stages, **flags,
    )
    if not fused_merge:
        _merge_kernel[(B * Hq,)](
            o_part, l_part, out, lse, *bounds, out.stride(0), out.stride(1), *strides,
            HQ=Hq, D=D, NUM_SPLITS=num_splits, BLOCK_S=block_s,
            TILE_S=16, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4, **flags,
        )
    return out, lse


@torch.library.custom_op("sparsedecode::split_k_decode", mutates_args=())
def _split_k_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, start_t: Tensor | None, end_t: Tensor | None,
    counters: Tensor | None, start_int: int, end_int: int, scale: float, num_splits: int,
    block_n: int, num_warps: int, num_stages: int, fused_merge: bool, programs_per_sm: int,
    min_split_keys: int,
) -> tuple[Tensor, Tensor]:
    # Opaque to torch.compile (as the paper wraps flash_attn_with_kvcache, App. A). Declared
    # pure although the fused path writes the counters: it leaves them at zero before it
    # exits, so no caller can observe the writes (as in sparse_gemv).
    return _launch(q, k_cache, v_cache, start_t, end_t, counters, start_int, end_int, scale, num_splits,
                   block_n, num_warps, num_stages, fused_merge, programs_per_sm, min_split_keys)


@_split_k_op.register_fake
def _(q, k_cache, v_cache, start_t, end_t, counters, start_int, end_int, scale, num_splits, *config):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


def _check_options(options) -> None:
    if not isinstance(options, AttentionOptions):
        raise InputError(f"options must be a kernels.options.AttentionOptions; got {type(options).__name__}")


def _check_kernel_args(D: int, num_splits: int | None, options) -> None:
    """The head dims, split counts and options the split kernel takes (`split_k_attention`,
    `rope_attention`)."""
    _check_options(options)
    if D > MAX_HEAD_DIM or D < 8:
        raise InputError(f"head dim {D} is not supported by the split_k kernel (8..{MAX_HEAD_DIM})")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise InputError(f"num_splits must be in 1..{MAX_SPLITS}; got {num_splits}")


def split_k_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, end, start=0, scale: float | None = None,
    num_splits: int | None = None, config: tuple[int, int, int] | None = None, *,
    fused_merge: bool = True, counters: Tensor | None = None, end_offset: int = 0,
    options: AttentionOptions = DEFAULT.attention,
) -> tuple[Tensor, Tensor]:
    """Split-K decode attention with the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1).

    q (B, Hq, D); k_cache, v_cache (B, Hkv, T, D) with unit stride along D; reads
    [start, end) of each row, where bounds are ints or 0-d/(1,)/(B,) integer tensors on
    q's device (clamped to [0, T] on the device: no host sync, so the call can be
    captured). Returns (out (B, Hq, D) in q's dtype, lse (B, Hq) float32, natural log
    of the scaled scores; an empty range gives 0 and -inf). `num_splits` and `config`
    (BLOCK_N, num_warps, num_stages) override the static defaults, for tuning. Python-int
    bounds are baked into a captured graph; pass tensors for bounds that move.
    `fused_merge=False` runs the two-launch path (split kernel, then merge kernel), for
    comparison. `counters` (`arrival_counters(B*Hkv, device)`) are the fused merge's
    arrival counters; by default one cached buffer per device and B*Hkv serves every call,
    which is right for calls in sequence on one stream (pass your own for concurrent ones).
    `end_offset` moves the end to end + end_offset, added in the kernel as it loads a tensor
    end: a decode step passes its position with offset 1 rather than a tensor pos + 1, which
    torch.compile forms by a kernel of its own before every opaque attention call (one launch
    per layer; records h200/kernels/sparse_gemv/sparse_gemv_20261130T1938Z_fused_gemv/step).
    `options` sets the default split count (`default_num_splits`); the op receives it as plain ints.
    """
    if triton is None:
        raise InputError("the split_k kernel needs Triton: pip install triton (or use split_k_ref on CPU)")
    B, Hq, Hkv, G, T, D = check_inputs(q, k_cache, v_cache)
    _check_kernel_args(D, num_splits, options)
    if counters is not None and (
        counters.dtype != torch.int32 or counters.device != q.device
        or counters.dim() != 1 or counters.numel() < B * Hkv or counters.stride(0) != 1
    ):
        raise InputError(
            f"counters must be arrival_counters({B * Hkv}, {q.device}): contiguous int32 (>= B*Hkv,); "
            f"got {counters.dtype} {tuple(counters.shape)} on {counters.device}"
        )
    if not (q.is_cuda or _interpreting()):
        raise InputError(
            "the split_k Triton kernel runs on CUDA (or on CPU with TRITON_INTERPRET=1); use split_k_ref"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise InputError(
            "k_cache and v_cache need unit stride along the head dim (a copy would cost a cache read)"
        )
    if (T - 1) * max(k_cache.stride(2), v_cache.stride(2)) + D >= 2**31:
        raise InputError(f"a KV head slab of {T} entries exceeds the kernel's 32-bit in-head offsets")
    q = q.contiguous() if q.stride(-1) != 1 else q
    block_n, num_warps, num_stages = config or (0, 0, 0)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    bounds = []
    for x, name in ((start, "start"), (end, "end")):
        if isinstance(x, Tensor):
            bounds.append((_bound(x, B, q.device, name, dtype=None), 0))
        else:
            bounds.append((None, int(x)))
    (start_t, start_int), (end_t, end_int) = bounds
    end_int += int(end_offset)  # the kernel adds it to a tensor end
    return _split_k_op(q, k_cache, v_cache, start_t, end_t, counters if fused_merge else None,
                       start_int, end_int, float(scale), num_splits or 0, block_n, num_warps,
                       num_stages, bool(fused_merge), options.programs_per_sm, options.min_split_keys or 0)



__all__ = ["arrival_counters", "check_inputs", "default_num_splits", "merge_lse", "split_k_attention", "split_k_ref"]
