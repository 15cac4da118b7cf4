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
  fewer when the last would hold less than one block of keys: FOLD_TAIL gives
  those to the split before it) and the rest exit at once (n_active is 0 for
  an empty range).
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
  two-launch path (split kernel, then `_merge_kernel`) stays behind
  `fused_merge=False` for comparison.
- `start` lets a window read its recent entries in place from an offset and its
  sinks in a second call, the two merged by `merge_lse` (App. A) with no copy.
- An empty range gives output 0 and LSE -inf, never NaN.

`split_k_ref` is the same chunking and merge in plain PyTorch: the CPU path of
the engine and the oracle of the tests.
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch import Tensor

from sparsedecode.errors import InputError
from sparsedecode.kernels.rope_cache import _check as check_rope
from sparsedecode.kernels.rope_cache import rope_cache_ref

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK_N = 64  # keys per inner iteration: 16 KB of K and of V per tile at D=128 in bf16
MAX_SPLITS = 128  # the merge holds all split LSEs of a head in one vector
# Elements of one (heads, splits, D) tile of partials in the fused merge (64 fp32 per thread
# at 4 warps): the merge runs on the tail of the kernel, so it reads a 33-split group in few
# serial steps. An sm_90 compile at the Llama shape (G=4, D=128, bf16) takes 128 registers
# with the merge against 80 without, within the 170 that three resident programs allow, and
# shared memory (~70 KB each) already caps an SM at three.
MERGE_TILE = 8192
# Target programs per SM at full length. Measured on an H200 (benchmarks/attention_bench.py
# --sweep, Llama-3.1-8B layer shape, bf16): 2 per SM, i.e. 33 splits x 8 KV heads = 264
# programs on 132 SMs, read a 128K cache at 4.15 TB/s against 3.82 TB/s for 6 per SM (99
# splits) and 4.11 TB/s for 3 per SM; one even wave with long chunks beats more, shorter
# ones whose tail and merge cost more than the extra loads in flight gain.
PROGRAMS_PER_SM = 2
# Fewest keys a split covers at full allocation: at short contexts fewer, longer splits leave the
# fused merge fewer partials to read. On the H200 at 2K (allocation 2112, 8 KV heads) 17 splits
# took 8.4 us a call against 9.3-9.4 us for 33 and 9, and 11.9-15.5 us for 5 and 3 (records
# h200/sparse_gemv_20261130T1525Z_attn_splits/attn); long allocations keep PROGRAMS_PER_SM's
# count (33 at 128K). `proj_decode_h200.py --attn-min-split-keys` overrides it for timing.
MIN_SPLIT_KEYS: int | None = 128
# True: a last split that would hold fewer than BLOCK_N keys (less than one block) is folded into
# the one before it, which then reads to the end of the range, one partial block more. At the
# step's 2049-key range (2K prompt, one decode token) the 17 splits of a 2112-key allocation have
# 128-key chunks and the 17th holds one key, so 136 programs run on 132 SMs and the fused merge
# reads its 17 partials in two tiles of 16; folded, 128 programs and one tile, the last split
# reading 129 keys. On the H200 the split kernel took
# 322.4 and 321.7 us a step against 326.1 and 330.3 without, and the step read 91.7% and 92.0% of
# its byte bound against 91.3% and 91.8% (records h200/sparse_gemv_20261130T2334Z_attn_fold).
# `proj_decode_h200.py --no-attn-fold-tail` turns it off for timing.
FOLD_TAIL = True
# Programmatic dependent launch (Hopper and later), as `sparse_gemv.PDL`: the split kernel may
# launch while the kernel before it (the q|k|v projection in the decode step) drains, its programs
# waiting at the top (`gdc_wait`) until that kernel's writes are visible, and it lets the kernel
# after it (the o projection) launch at once. Off: in the llama-3.1-8b decode step at keep 0.5 and
# 2K it made the sparse step slower in two runs each, 2.925 and 2.926 ms against 2.912 and 2.915 with
# the sparse GEMVs launched plainly, 2.938 and 2.940 against 2.837 and 2.840 with them launched so
# too, while the dense step ran 5.203 and 5.200 ms against 5.231 and 5.229 (records
# h200/sparse_gemv_20261201T0625Z_pdl, `--attn-pdl`).
PDL = False
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


def _chunk_len(length, num_splits: int, block_n: int):
    """Keys per split for a valid length (int or tensor): BLOCK_N-aligned equal shares, 0 if empty."""
    per = (length + num_splits - 1) // num_splits
    return (per + block_n - 1) // block_n * block_n


def _active_splits(length: Tensor, chunk: Tensor, block_n: int, fold: bool) -> Tensor:
    """Splits that read keys for a valid length (tensors): ceil(length / chunk), one fewer when
    FOLD_TAIL folds a last split of fewer than block_n keys into the one before it."""
    c = chunk.clamp_min(1)
    n = (length + c - 1) // c
    if fold:
        n = n - ((n > 1) & (length - (n - 1) * chunk < block_n)).to(n.dtype)
    return n


def default_num_splits(T: int, batch_heads: int, device: torch.device, block_n: int = BLOCK_N) -> int:
    """Static split count: enough programs to fill the GPU a few times over at full length.

    Depends only on the allocation T, batch*KV heads and the SM count, never on the
    runtime length, so the grid of a captured call is fixed.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        target = PROGRAMS_PER_SM * _sm_count(index)
        splits = -(-target // batch_heads)
    else:
        splits = CPU_SPLITS
    return max(1, min(splits, -(-T // max(block_n, MIN_SPLIT_KEYS or 0)), MAX_SPLITS))


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


def _merge(o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Merge normalised partials o (..., S, D) with their LSEs (..., S) along S.

    Returns (..., D) float32 and (...,) float32; all -inf gives 0 and -inf, never NaN.
    """
    m = lse.amax(-1, keepdim=True)  # (..., 1)
    m = m.masked_fill(torch.isinf(m), 0.0)
    w = torch.exp(lse - m)  # (..., S), 0 for empty splits
    total = w.sum(-1, keepdim=True)  # (..., 1), >= 1 unless every split is empty
    out = torch.matmul(w.unsqueeze(-2), o).squeeze(-2) / total.clamp_min(1.0)  # (..., D)
    return out, (m + torch.log(total)).squeeze(-1)  # log(0) = -inf for an empty range


def merge_lse(outs: list[Tensor], lses: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Combine attention over disjoint ranges into attention over their union (App. A).

    outs: list of (B, Hq, D) outputs, lses: list of (B, Hq) float32 natural-log LSEs of
    the scaled scores. Returns ((B, Hq, D) in the dtype of outs[0], (B, Hq) float32).
    A range that was empty (lse -inf) contributes nothing.
    """
    if len(outs) != len(lses) or not outs:
        raise InputError("merge_lse needs one lse per output and at least one output")
    o = torch.stack([x.float() for x in outs], dim=-2)  # (B, Hq, n, D)
    lse = torch.stack([x.float() for x in lses], dim=-1)  # (B, Hq, n)
    out, lse_out = _merge(o, lse)
    return out.to(outs[0].dtype), lse_out


def split_k_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, end, start=0, scale: float | None = None,
    num_splits: int | None = None, block_n: int = BLOCK_N, *, end_offset: int = 0,
) -> tuple[Tensor, Tensor]:
    """Split-K attention in plain PyTorch: the kernel's chunking and LSE merge, in float32.

    q (B, Hq, D); caches (B, Hkv, T, D); reads [start, end + end_offset) per row, bounds
    being ints or 0-d/(B,) integer tensors (clamped to [0, T]; no host sync). Returns
    (out (B, Hq, D) in q's dtype, lse (B, Hq) float32, natural log of the scaled scores).
    """
    B, Hq, Hkv, G, T, D = check_inputs(q, k_cache, v_cache)
    S = num_splits or default_num_splits(T, B * Hkv, q.device, block_n)
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
        n_active = _active_splits(length, chunk, block_n, FOLD_TAIL)  # (B|1, 1, 1)
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
    def _valid_range(Start, End, b, stride_start, stride_end, start_int, end_int, T,
                     START_T: tl.constexpr, END_T: tl.constexpr):
        """[lo, hi) of row b clamped to [0, T]: from the bound tensors or the ints (with a
        tensor end, end_int is added to it)."""
        if START_T:
            lo = tl.load(Start + b * stride_start).to(tl.int32)
        else:
            lo = start_int
        if END_T:  # end_int is then an offset added to the loaded bound (a position + 1)
            hi = tl.load(End + b * stride_end).to(tl.int32) + end_int
        else:
            hi = end_int
        return tl.maximum(lo, 0), tl.minimum(hi, T)

    @triton.jit
    def _store_out(Out, Lse, b64, heads, offs_d, out, lse, mask_g, mask_d, stride_ob, stride_oh,
                   HQ: tl.constexpr):
        """Final output rows (BLOCK, BLOCK_D) and LSEs (BLOCK,) of query heads `heads` of row b."""
        ptrs = Out + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(ptrs, out.to(Out.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
        tl.store(Lse + b64 * HQ + heads, lse, mask=mask_g)

    @triton.jit
    def _splits_of(length, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, FOLD: tl.constexpr):
        """(chunk, n_active) of a valid length, as `_chunk_len` and `_active_splits` derive them:
        split s < n_active reads [s * chunk, (s + 1) * chunk), the last one to the end."""
        chunk = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
        n_active = tl.cdiv(length, tl.maximum(chunk, 1))
        if FOLD:
            n_active = tl.where((n_active > 1) & (length - (n_active - 1) * chunk < BLOCK_N), n_active - 1, n_active)
        return chunk, n_active

    @triton.jit
    def _merge_group(
        O_part, L_part, Out, Lse, b64, h, n_active, stride_ob, stride_oh,
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_GM: tl.constexpr, TILE_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """LSE merge of the n_active partials of the G query heads of KV head h of row b.

        Online over tiles of TILE_S partials: a tile's LSEs and outputs are loaded together and
        the running sums rescaled to the running max, so the merge makes one trip to L2 per tile
        where a first pass over the LSEs for their max cost one more on the critical path."""
        offs_g = tl.arange(0, BLOCK_GM)
        mask_g = offs_g < G
        heads = h * G + offs_g  # (BLOCK_GM,)
        rows = (b64 * HKV * G + heads) * NUM_SPLITS  # (BLOCK_GM,) first partial of each head
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        m = tl.full([BLOCK_GM], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_GM], tl.float32)
        acc = tl.zeros([BLOCK_GM, BLOCK_D], tl.float32)
        for s0 in range(0, n_active, TILE_S):
            offs_t = s0 + tl.arange(0, TILE_S)
            mask_t = mask_g[:, None] & (offs_t < n_active)[None, :]  # (BLOCK_GM, TILE_S)
            idx = rows[:, None] + offs_t[None, :]
            # Partials of other programs are read at L2 (.cg): they were written on other SMs.
            lse_t = tl.load(L_part + idx, mask=mask_t, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(O_part + idx[:, :, None] * D + offs_d[None, None, :],
                        mask=mask_t[:, :, None] & mask_d[None, None, :], other=0.0,
                        cache_modifier=".cg")  # (BLOCK_GM, TILE_S, BLOCK_D)
            m_new = tl.maximum(m, tl.max(lse_t, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
            scale = tl.exp(m - m_ref)  # 0 on the first tile
            w = tl.exp(lse_t - m_ref[:, None])  # (BLOCK_GM, TILE_S), 0 off the active splits
            total = total * scale + tl.sum(w, 1)
            acc = acc * scale[:, None] + tl.sum(w[:, :, None] * o, 1)
            m = m_new
        m = tl.where(m == float("-inf"), 0.0, m)
        safe = tl.where(total > 0, total, 1.0)
        lse = tl.where(total > 0, m + tl.log(safe), float("-inf"))
        _store_out(Out, Lse, b64, heads, offs_d, acc / safe[:, None], lse, mask_g, mask_d,
                   stride_ob, stride_oh, HKV * G)

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
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, FOLD: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        FUSED: tl.constexpr, BLOCK_GM: tl.constexpr, TILE_S: tl.constexpr,
        START_T: tl.constexpr, END_T: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
        Knew, Vnew, Cos, Sin, stride_knb, stride_vnb, zero, ROPE: tl.constexpr, HALF: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        # Scores use tl.dot with the G query heads padded to BLOCK_G >= 16 rows. The
        # alternative, a broadcast multiply + sum, materialises G*BLOCK_N*D products in
        # registers and forces tiny tiles or spills; the tensor-core dot wastes only
        # arithmetic on the padding rows, and the tensor cores idle in memory-bound
        # decode anyway, so the loads (16-byte vectors along D) set the pace.
        if PDL:  # a programmatic dependent: every memory access waits for the kernel before; the
            # next kernel may launch now (its programs wait likewise for this one to finish)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        pid_bh = tl.program_id(0)
        split = tl.program_id(1)
        b = pid_bh // HKV
        h = pid_bh % HKV
        lo_all, hi_all = _valid_range(Start, End, b, stride_start, stride_end, start_int, end_int,
                                      T, START_T, END_T)
        length = tl.maximum(hi_all - lo_all, 0)
        chunk, n_active = _splits_of(length, NUM_SPLITS, BLOCK_N, FOLD)  # split s is active iff s < n_active
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
                rows = pos.to(tl.int64) * D + 0 * offs_g[:, None]  # (BLOCK_G, 1)
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

    @triton.jit(do_not_specialize=["start_int", "end_int"])
    def _merge_kernel(
        O_part, L_part, Out, Lse, Start, End,
        start_int, end_int, T, stride_ob, stride_oh,
        stride_start, stride_end,
        HQ: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, FOLD: tl.constexpr, BLOCK_S: tl.constexpr,
        TILE_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        START_T: tl.constexpr, END_T: tl.constexpr,
    ):
        # The second launch of the two-kernel path (fused_merge=False): one program per query head.
        pid = tl.program_id(0)  # b * HQ + query head
        b = pid // HQ
        hq = pid % HQ
        lo_all, hi_all = _valid_range(Start, End, b, stride_start, stride_end, start_int, end_int,
                                      T, START_T, END_T)
        length = tl.maximum(hi_all - lo_all, 0)
        chunk, n_active = _splits_of(length, NUM_SPLITS, BLOCK_N, FOLD)  # splits past n_active never wrote
        base = pid.to(tl.int64) * NUM_SPLITS
        offs_s = tl.arange(0, BLOCK_S)
        lse_s = tl.load(L_part + base + offs_s, mask=offs_s < n_active, other=float("-inf"))
        m = tl.max(lse_s, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.exp(lse_s - m), 0)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s0 in range(0, n_active, TILE_S):
            offs = s0 + tl.arange(0, TILE_S)
            mask_t = offs < n_active
            w = tl.exp(tl.load(L_part + base + offs, mask=mask_t, other=float("-inf")) - m)  # (TILE_S,)
            o = tl.load(O_part + (base + offs)[:, None] * D + offs_d[None, :],
                        mask=mask_t[:, None] & mask_d[None, :], other=0.0)  # (TILE_S, BLOCK_D)
            acc += tl.sum(w[:, None] * o, 0)
        out = acc / tl.where(total > 0, total, 1.0)
        lse = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        out_ptrs = Out + b.to(tl.int64) * stride_ob + hq * stride_oh + offs_d
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=mask_d)
        tl.store(Lse + pid, lse)


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


def _merge_blocks(G: int, D: int, num_splits: int) -> tuple[int, int, int]:
    """(BLOCK_GM, BLOCK_S, TILE_S) of the fused merge: a tile of partials is <= MERGE_TILE floats."""
    block_gm = triton.next_power_of_2(G)
    block_s = max(16, triton.next_power_of_2(num_splits))
    tile_s = max(1, min(block_s, MERGE_TILE // (block_gm * max(16, triton.next_power_of_2(D)))))
    return block_gm, block_s, tile_s


def _launch(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, start_t: Tensor | None, end_t: Tensor | None,
    counters: Tensor | None, start_int: int, end_int: int, scale: float, num_splits: int,
    block_n: int, num_warps: int, num_stages: int, fused_merge: bool, rope: tuple | None = None,
) -> tuple[Tensor, Tensor]:
    """The split kernel (and the merge kernel unless fused_merge); rope = (k_new, v_new, cos, sin)
    for `rope_attention` (q then holds the unrotated (B, Hq * D) queries)."""
    # The host-side choices below (split count from the SM count, tile config; 0 = default)
    # run eagerly at trace and capture time and are static for a given shape.
    B, Hkv, T, D = k_cache.shape
    Hq = q.shape[1] if rope is None else q.shape[1] // D
    G = Hq // Hkv
    if not block_n:
        block_n, num_warps, num_stages = _kernel_config(D, q.dtype)
    num_splits = num_splits or default_num_splits(T, B * Hkv, q.device, block_n)
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
    pdl = PDL and q.is_cuda and not _interpreting()
    _split_kernel[(B * Hkv, num_splits)](
        q, k_cache, v_cache, o_part, l_part, out, lse, counters if fused_merge else l_part,
        *bounds, scale * LOG2E,
        q.stride(0), D if rope is not None else q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), *strides,
        HKV=Hkv, G=G, D=D, NUM_SPLITS=num_splits, FOLD=FOLD_TAIL, BLOCK_G=max(16, triton.next_power_of_2(G)),
        BLOCK_N=block_n, BLOCK_D=block_d,
        FUSED=fused_merge, BLOCK_GM=block_gm, TILE_S=tile_s,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=q.dtype == torch.bfloat16 and _interpreting(),
        Knew=k_new, Vnew=v_new, Cos=cos, Sin=sin, stride_knb=k_new.stride(0), stride_vnb=v_new.stride(0), zero=0,
        ROPE=rope is not None, HALF=D // 2, PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, **flags, **({"launch_pdl": True} if pdl else {}),
    )
    if not fused_merge:
        _merge_kernel[(B * Hq,)](
            o_part, l_part, out, lse, *bounds, out.stride(0), out.stride(1), *strides,
            HQ=Hq, D=D, NUM_SPLITS=num_splits, FOLD=FOLD_TAIL, BLOCK_S=block_s,
            TILE_S=16, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4, **flags,
        )
    return out, lse


@torch.library.custom_op("sparsedecode::split_k_decode", mutates_args=())
def _split_k_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, start_t: Tensor | None, end_t: Tensor | None,
    counters: Tensor | None, start_int: int, end_int: int, scale: float, num_splits: int,
    block_n: int, num_warps: int, num_stages: int, fused_merge: bool,
) -> tuple[Tensor, Tensor]:
    # Opaque to torch.compile (as the paper wraps flash_attn_with_kvcache, App. A). Declared
    # pure although the fused path writes the counters: it leaves them at zero before it
    # exits, so no caller can observe the writes (as in sparse_gemv).
    return _launch(q, k_cache, v_cache, start_t, end_t, counters, start_int, end_int, scale, num_splits,
                   block_n, num_warps, num_stages, fused_merge)


@_split_k_op.register_fake
def _(q, k_cache, v_cache, start_t, end_t, counters, start_int, end_int, scale, num_splits, *config):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("sparsedecode::rope_split_k_decode", mutates_args=("k_cache", "v_cache"))
def _rope_split_k_op(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor,
    scale: float, num_splits: int, block_n: int, num_warps: int, num_stages: int,
) -> tuple[Tensor, Tensor]:
    # `rope_attention`: writes the new entry at pos into the caches (declared), reads [0, pos + 1).
    return _launch(q, k_cache, v_cache, None, pos, None, 0, 1, scale, num_splits, block_n, num_warps,
                   num_stages, True, rope=(k, v, cos, sin))


@_rope_split_k_op.register_fake
def _(q, k, v, cos, sin, pos, k_cache, v_cache, *rest):
    B, D = q.shape[0], k_cache.shape[-1]
    return q.new_empty(B, q.shape[1] // D, D), q.new_empty(B, q.shape[1] // D, dtype=torch.float32)


def _check_kernel_args(D: int, num_splits: int | None) -> None:
    """The head dims and split counts the split kernel takes (`split_k_attention`, `rope_attention`)."""
    if D > MAX_HEAD_DIM or D < 8:
        raise InputError(f"head dim {D} is not supported by the split_k kernel (8..{MAX_HEAD_DIM})")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise InputError(f"num_splits must be in 1..{MAX_SPLITS}; got {num_splits}")


def split_k_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, end, start=0, scale: float | None = None,
    num_splits: int | None = None, config: tuple[int, int, int] | None = None, *,
    fused_merge: bool = True, counters: Tensor | None = None, end_offset: int = 0,
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
    per layer; records h200/sparse_gemv_20261130T1938Z_fused_gemv/step).
    """
    if triton is None:
        raise InputError("the split_k kernel needs Triton: pip install triton (or use split_k_ref on CPU)")
    B, Hq, Hkv, G, T, D = check_inputs(q, k_cache, v_cache)
    _check_kernel_args(D, num_splits)
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
                       num_stages, bool(fused_merge))


# True: the decoder's one-token step on the plain cache with the split_k backend runs `rope_attention`
# (RoPE, the cache write and the attention in one launch) where it ran `rope_cache` and then split_k.
ROPE_IN_ATTENTION = True


def rope_attention_ref(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor,
                       v_cache: Tensor, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """`rope_attention` in plain PyTorch: `rope_cache_ref`, then `split_k_ref` over [0, pos + 1)."""
    q_rot = rope_cache_ref(q, k, v, cos, sin, pos, k_cache, v_cache)  # (B, Hq, D); the caches hold the entry
    return split_k_ref(q_rot, k_cache, v_cache, pos, scale=scale, end_offset=1)


def rope_attention(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor,
                   v_cache: Tensor, scale: float | None = None, num_splits: int | None = None,
                   config: tuple[int, int, int] | None = None) -> tuple[Tensor, Tensor]:
    """One decode token per sequence, RoPE to attention output in one launch (ByteCross §4.1: the
    step's fixed costs): q (B, Hq * D) and k (B, Hkv * D) as the projection left them are rotated
    by the angles of position pos (a 1-element integer tensor, read on the device) in the tables
    cos, sin (T, D) of `models.rope.rope_tables`; the rotated k and v (B, Hkv * D) go to position
    pos of k_cache, v_cache (B, Hkv, T, D), and the rotated queries attend over [0, pos + 1).

    Where `rope_cache` and then `split_k_attention` take two launches and a trip of the rotated
    queries through memory, here each split program rotates its query heads itself, and the one
    program whose chunk holds pos leaves that cache row (the last step's) out of its loop, adds
    the new entry to its softmax after the loop and stores the entry (no program of the launch
    reads pos from memory). The rotation is
    `rope_cache`'s: float32, rounded once to the cache dtype. Returns (out (B, Hq, D), lse (B, Hq)
    float32) as `split_k_attention` does. CUDA, or CPU under TRITON_INTERPRET=1;
    `rope_attention_ref` elsewhere.
    """
    B, Hq, Hkv, D = check_rope(q, k, v, cos, sin, pos, k_cache, v_cache)
    if Hq % Hkv:
        raise InputError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    _check_kernel_args(D, num_splits)
    if triton is None or not (q.is_cuda or _interpreting()):
        raise InputError("the rope_attention kernel runs on CUDA (or on CPU with TRITON_INTERPRET=1) with Triton; "
                         "use rope_attention_ref")
    block_n, num_warps, num_stages = config or (0, 0, 0)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    return _rope_split_k_op(q, k, v, cos, sin, pos.reshape(1), k_cache, v_cache, float(scale), num_splits or 0,
                            block_n, num_warps, num_stages)
