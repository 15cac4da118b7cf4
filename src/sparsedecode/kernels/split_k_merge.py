"""The split geometry and the log-sum-exp merge of split-K decode attention (ByteCross §4.1, App. A).

`kernels.decode_attention` cuts a read range of `length` keys into splits of `chunk` keys each
(BLOCK_N-aligned equal shares of a static split count) and merges the normalised partial
outputs of the active splits by their LSEs. This module holds what the split kernel, the
two-launch merge kernel and the PyTorch reference share: the chunking rule (in PyTorch and in
Triton), the merge in PyTorch (`merge_lse`, also how a window joins its two in-place calls), the
fused merge a split kernel runs on its tail, and the second launch of the two-launch path.

The rule: chunk = BLOCK_N * ceil(ceil(length / NUM_SPLITS) / BLOCK_N); the first
n_active = ceil(length / chunk) splits are active, one fewer when the last would hold fewer
than BLOCK_N keys (folded into the one before it, which then reads to the end; decision log
docs/kernels/decode_attention.md#fold-the-tail); an empty range has no active split.
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

# Elements of one (heads, splits, D) tile of partials in the fused merge (64 fp32 per thread
# at 4 warps): the merge runs on the tail of the kernel, so it reads a 33-split group in few
# serial steps. An sm_90 compile at the Llama shape (G=4, D=128, bf16) takes 128 registers
# with the merge against 80 without, within the 170 that three resident programs allow, and
# shared memory (~70 KB each) already caps an SM at three.
MERGE_TILE = 8192


def _chunk_len(length, num_splits: int, block_n: int):
    """Keys per split for a valid length (int or tensor): BLOCK_N-aligned equal shares, 0 if empty."""
    per = (length + num_splits - 1) // num_splits
    return (per + block_n - 1) // block_n * block_n


def _active_splits(length: Tensor, chunk: Tensor, block_n: int) -> Tensor:
    """Splits that read keys for a valid length (tensors): ceil(length / chunk), one fewer when a
    last split of fewer than block_n keys is folded into the one before it."""
    c = chunk.clamp_min(1)
    n = (length + c - 1) // c
    return n - ((n > 1) & (length - (n - 1) * chunk < block_n)).to(n.dtype)


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


def _merge_blocks(G: int, D: int, num_splits: int) -> tuple[int, int, int]:
    """(BLOCK_GM, BLOCK_S, TILE_S) of the fused merge: a tile of partials is <= MERGE_TILE floats."""
    block_gm = triton.next_power_of_2(G)
    block_s = max(16, triton.next_power_of_2(num_splits))
    tile_s = max(1, min(block_s, MERGE_TILE // (block_gm * max(16, triton.next_power_of_2(D)))))
    return block_gm, block_s, tile_s


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
    def _splits_of(length, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
        """(chunk, n_active) of a valid length, as `_chunk_len` and `_active_splits` derive them:
        split s < n_active reads [s * chunk, (s + 1) * chunk), the last one to the end."""
        chunk = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
        n_active = tl.cdiv(length, tl.maximum(chunk, 1))
        n_active = tl.where((n_active > 1) & (length - (n_active - 1) * chunk < BLOCK_N), n_active - 1, n_active)
        return chunk, n_active

    @triton.jit
    def _store_out(Out, Lse, b64, heads, offs_d, out, lse, mask_g, mask_d, stride_ob, stride_oh,
                   HQ: tl.constexpr):
        """Final output rows (BLOCK, BLOCK_D) and LSEs (BLOCK,) of query heads `heads` of row b."""
        ptrs = Out + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(ptrs, out.to(Out.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
        tl.store(Lse + b64 * HQ + heads, lse, mask=mask_g)

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

    @triton.jit(do_not_specialize=["start_int", "end_int"])
    def _merge_kernel(
        O_part, L_part, Out, Lse, Start, End,
        start_int, end_int, T, stride_ob, stride_oh,
        stride_start, stride_end,
        HQ: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
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
        chunk, n_active = _splits_of(length, NUM_SPLITS, BLOCK_N)  # splits past n_active never wrote
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
