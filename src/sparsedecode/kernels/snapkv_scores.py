"""SnapKV's observation scores in two Triton launches (ByteCross App. A 'Scored selection').

The score of cache position j for KV head h is the attention the W observation queries of the
G query heads of h's GQA group pay to j, summed: sum over (g, w) of softmax_j(q_gw . k_j / sqrt(D))
with query w (position n - W + w) blind to keys after it. The PyTorch path (`scores_ref`, the
reference) materialises the (G, W, n) float32 logits of every KV head and reads and writes them
four times (logits, causal mask, softmax, sum): at 128K on Llama-3.1-8B dims about 1 GiB per
layer per pass, 160 ms for the 32 layers on an H200 (records h200/kv_select/). Here:

1. `_lse_kernel`: the log-sum-exp of each of the G x W rows over the n keys, as flash
   attention's forward keeps it, in splits of the keys so that the few rows fill the GPU
   (grid: KV heads x row blocks x splits); the splits' (max, sum) pairs are merged after it.
2. `_colsum_kernel`: for a block of keys, exp(logit - lse) summed over all G x W rows
   (grid: KV heads x key blocks): the scores, written once as (B, Hkv, n) float32.

The logits are bf16/fp16 dot products accumulated in float32 (float32 operands: exact IEEE
products), in base 2 (exp2 with the scale folded into log2 e), so the scores match the
reference to float32 rounding; nothing of size G x W x n is ever stored.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sparsedecode.errors import InputError
from sparsedecode.kernels.common import device_index, interpreting, pow2, sm_count

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

LOG2E = 1.4426950408889634
BLOCK_M = 64  # observation rows (g, w) per tile
BLOCK_N = 64  # keys per tile


DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def usable(q_obs: Tensor, k_cache: Tensor) -> bool:
    """Whether the kernels take these operands: Triton, CUDA tensors (or the CPU interpreter)
    on one device, of one dtype among DTYPES."""
    return (triton is not None and (k_cache.is_cuda or interpreting()) and q_obs.device == k_cache.device
            and q_obs.dtype == k_cache.dtype and k_cache.dtype in DTYPES)


def scores_ref(q_obs: Tensor, k_cache: Tensor, n: int, max_elements: int = 2**28) -> Tensor:
    """(B, Hkv, n) float32 summed attention of q_obs (B, Hq, W, D) over the first n keys of
    k_cache (B, Hkv, T, D), in float32 PyTorch, at most `max_elements` logits at a time."""
    B, Hq, W, D = q_obs.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D)
    qpos = torch.arange(n - W, n, device=k_cache.device)[:, None]  # (W, 1)
    future = torch.arange(n, device=k_cache.device)[None, :] > qpos  # (W, n)
    out = torch.empty(B, Hkv, n, dtype=torch.float32, device=k_cache.device)  # (B, Hkv, n)
    # As many GQA groups at a time as keep the float32 logits (B, heads, G, W, n) under max_elements.
    step = max(1, min(Hkv, max_elements // max(1, B * G * W * n)))
    for h0 in range(0, Hkv, step):
        h1 = min(h0 + step, Hkv)
        q = q_obs[:, h0 * G : h1 * G].to(k_cache.device, torch.float32)  # (B, h*G, W, D)
        q = q.reshape(B, h1 - h0, G, W, D)  # (B, h, G, W, D), repeat_kv order
        k = k_cache[:, h0:h1, :n].float()  # (B, h, n, D)
        logits = torch.einsum("bhgwd,bhnd->bhgwn", q, k) * scale  # (B, h, G, W, n)
        attn = logits.masked_fill_(future, -math.inf).softmax(dim=-1)  # (B, h, G, W, n)
        out[:, h0:h1] = attn.sum(dim=(2, 3))  # (B, h, n): summed over the group and queries
    return out


def snapkv_scores(q_obs: Tensor, k_cache: Tensor, n: int) -> Tensor:
    """The kernels' (B, Hkv, n) float32 scores; the same contract as `scores_ref`.

    q_obs and k_cache share a dtype (bf16, fp16 or fp32) and a device (`usable`); any head dim."""
    if q_obs.dtype != k_cache.dtype or q_obs.dtype not in DTYPES:
        raise InputError(f"the snapkv score kernels want q_obs and k_cache of one dtype among bf16, fp16, "
                         f"fp32; got {q_obs.dtype} and {k_cache.dtype} (scores_ref takes any)")
    if not usable(q_obs, k_cache):
        raise InputError("the snapkv score kernels need triton and CUDA tensors on one device "
                         "(or TRITON_INTERPRET=1); scores_ref runs anywhere")
    B, Hq, W, D = q_obs.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    rows = G * W
    q = q_obs.contiguous()
    k = k_cache
    block_d = max(16, pow2(D))
    row_blocks = -(-rows // BLOCK_M)
    key_blocks = -(-n // BLOCK_N)
    target = 4 * (sm_count(device_index(k.device)) if k.is_cuda else 4)  # programs to fill the GPU
    splits = max(1, min(key_blocks, -(-target // (B * Hkv * row_blocks))))
    per_split = -(-key_blocks // splits) * BLOCK_N  # keys per split, whole tiles
    splits = -(-n // per_split)
    m = torch.empty(B * Hkv, splits, rows, dtype=torch.float32, device=k.device)
    s = torch.empty_like(m)
    scale2 = LOG2E / math.sqrt(D)
    ieee = q.dtype == torch.float32
    _lse_kernel[(B * Hkv, row_blocks, splits)](
        q, k, m, s, n, W, G, Hkv, rows, per_split, scale2, *q.stride(), *k.stride(),
        D=D, BLOCK_D=block_d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, IEEE=ieee, num_warps=4)
    top = m.amax(1, keepdim=True)  # (BH, 1, rows), finite: every row sees key 0
    lse2 = (top + torch.log2((s * torch.exp2(m - top)).sum(1, keepdim=True)))[:, 0]  # (BH, rows)
    out = torch.empty(B, Hkv, n, dtype=torch.float32, device=k.device)
    _colsum_kernel[(B * Hkv, key_blocks)](
        q, k, lse2, out, n, W, G, Hkv, rows, scale2, *q.stride(), *k.stride(),
        D=D, BLOCK_D=block_d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, IEEE=ieee, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _q_tile(Q, b, h, r0, W, G, rows, sqb, sqh, sqw, sqd,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
        """The (BLOCK_M, BLOCK_D) tile of observation rows r0.. (row g * W + w: query head
        h * G + g, window query w) of KV head h, its rows and their positions n - W + w, less n."""
        r = r0 + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        g = r // W
        w = r - g * W
        qp = Q + b * sqb + (h * G + g)[:, None] * sqh + w[:, None] * sqw + d[None, :] * sqd
        return tl.load(qp, mask=(r[:, None] < rows) & (d[None, :] < D), other=0.0), r, w - W

    @triton.jit
    def _k_tile(K, b, h, c0, n, skb, skh, skt, skd,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
        """The (BLOCK_N, BLOCK_D) tile of keys c0.. of KV head h, and their positions."""
        c = c0 + tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        kp = K + b * skb + h * skh + c[:, None] * skt + d[None, :] * skd
        return tl.load(kp, mask=(c[:, None] < n) & (d[None, :] < D), other=0.0), c

    @triton.jit
    def _logits(q, k, scale2, IEEE: tl.constexpr):
        """(BLOCK_M, BLOCK_N) float32 logits in log2 units."""
        if IEEE:
            return tl.dot(q, tl.trans(k), input_precision="ieee") * scale2
        return tl.dot(q, tl.trans(k)) * scale2

    @triton.jit
    def _lse_kernel(Q, K, M, S, n, W, G, Hkv, rows, per_split, scale2,
                    sqb, sqh, sqw, sqd, skb, skh, skt, skd,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    IEEE: tl.constexpr):
        """Per row of one row block: the running max and sum of exp2 over one split of the keys."""
        bh = tl.program_id(0)
        split = tl.program_id(2)
        b = bh // Hkv
        h = bh - b * Hkv
        q, r, rel = _q_tile(Q, b, h, tl.program_id(1) * BLOCK_M, W, G, rows, sqb, sqh, sqw, sqd,
                            D, BLOCK_D, BLOCK_M)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        s_i = tl.zeros((BLOCK_M,), tl.float32)
        lo = split * per_split
        for c0 in range(lo, tl.minimum(lo + per_split, n), BLOCK_N):
            k, c = _k_tile(K, b, h, c0, n, skb, skh, skt, skd, D, BLOCK_D, BLOCK_N)
            seen = (c[None, :] <= (n + rel)[:, None]) & (c[None, :] < n)
            x = tl.where(seen, _logits(q, k, scale2, IEEE), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
            s_i = s_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(x - m_safe[:, None]), 1)
            m_i = m_new
        out = (bh * tl.num_programs(2) + split) * rows + r
        tl.store(M + out, m_i, mask=r < rows)
        tl.store(S + out, s_i, mask=r < rows)

    @triton.jit
    def _colsum_kernel(Q, K, LSE, OUT, n, W, G, Hkv, rows, scale2,
                       sqb, sqh, sqw, sqd, skb, skh, skt, skd,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       IEEE: tl.constexpr):
        """Per key of one key block: exp2(logit - lse) summed over every row of the KV head."""
        bh = tl.program_id(0)
        b = bh // Hkv
        h = bh - b * Hkv
        k, c = _k_tile(K, b, h, tl.program_id(1) * BLOCK_N, n, skb, skh, skt, skd, D, BLOCK_D, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for r0 in range(0, rows, BLOCK_M):
            q, r, rel = _q_tile(Q, b, h, r0, W, G, rows, sqb, sqh, sqw, sqd, D, BLOCK_D, BLOCK_M)
            lse = tl.load(LSE + bh * rows + r, mask=r < rows, other=0.0)
            seen = (c[None, :] <= (n + rel)[:, None]) & (c[None, :] < n) & (r[:, None] < rows)
            acc += tl.sum(tl.where(seen, tl.exp2(_logits(q, k, scale2, IEEE) - lse[:, None]), 0.0), 0)
        tl.store(OUT + bh * n + c, acc, mask=c < n)


__all__ = ["scores_ref", "snapkv_scores", "usable"]
