"""The compact decoder: Llama 3.x, Mistral, Qwen2 and Qwen3 in one small module tree.

gpt-fast style (ByteCross App. A runs its modes 'inside the gpt-fast decoding
loop'): a static KV cache allocated once, RoPE tables indexed by a position
tensor, and two paths through each attention layer:

- prefill (`start` is a host int): a chunk of L tokens at positions
  [start, start+L) writes its keys/values into the cache and attends the whole
  cached prefix with PyTorch SDPA, causal within the chunk;
- decode (`start is None`): one token per sequence at the position held in a
  device tensor; attention reads cache entries [0, pos+1) through the named
  backend of `models.attention`, so the step has no host sync and no Python
  branch on tensor values and can be captured in a CUDA graph. A backend that
  slices on the host (sdpa_fused) gets the valid length as `host_len`, a Python
  int that torch.compile traces as a dynamic size.

Each attention layer holds the split-K kernel's `AttentionOptions` as `kernel_options`
(set on every layer by `set_attention_options_`) and passes them down to each call, so a
compiled or captured step bakes in the options its layers held when it was traced.

Module and parameter names follow Hugging Face's (`layers.N.self_attn.q_proj`
...), so a HF state dict loads after dropping its leading 'model.'. The seven
projections of a layer (q, k, v, o, gate, up, down) stay separate `nn.Linear`
modules: each is one site the projection branch (ByteCross §3.3) can replace
by a sparse module with the same call signature (see `projection_sites`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from sparsedecode.errors import InputError
from sparsedecode.kernels.common import linear
from sparsedecode.kernels.options import AttentionOptions
from sparsedecode.kernels.rope_attention import rope_attention
from sparsedecode.kernels.rope_cache import rope_cache
from sparsedecode.kernels.rope_cache import usable as rope_cache_usable
from sparsedecode.kernels.sparse_gemv import sumsq
from sparsedecode.models.args import ModelArgs
from sparsedecode.models.attention import decode_attention, rows_attention
from sparsedecode.models.rope import apply_rope, rope_tables
from sparsedecode.models.window_attention import window_attention

ATTN_SITES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_SITES = ("gate_proj", "up_proj", "down_proj")
SITES = ATTN_SITES + MLP_SITES
# Prefill queries each attention layer keeps for a KV selection's observation window: SnapKV's
# W (ByteCross App. A); a selection asking for more re-runs its window instead (kv.apply).
RECENT_QUERIES = 64


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back before the weight, as HF does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    """`rms_norm` with its weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class KVCache(nn.Module):
    """Static keys and values of one layer, (B, Hkv, T, D) each, written in place."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.compact = None  # (k, v, offset) of the selected entries, see read_compact
        self.host_offset = 0  # the offset as a host int, for backends that slice on the host
        self.window = None  # (sinks, recent), see read_window
        # A decode batch's per-sequence selections: (k_buf, v_buf (B, Hkv, T_c, D), offset (B,),
        # selected (B,) bool), see `rows_attention`; None: every sequence reads its cache rows.
        self.rows = None

    def slot(self, b: int) -> KVCache:
        """Sequence b's rows of this cache as a batch-1 cache (views: writes land here), so the
        batch-1 prefill and selection run on one sequence of a batch unchanged."""
        view = KVCache.__new__(KVCache)
        nn.Module.__init__(view)
        view.register_buffer("k", self.k[b:b + 1], persistent=False)
        view.register_buffer("v", self.v[b:b + 1], persistent=False)
        view.compact, view.host_offset, view.window, view.rows = None, 0, None, None
        return view

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (B, Hkv, L, D) at cache positions pos (L,)."""
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)

    def read_compact(self, k: torch.Tensor | None, v: torch.Tensor | None = None,
                     offset: torch.Tensor | None = None, host_offset: int = 0) -> None:
        """Decode reads this contiguous buffer of selected entries (B, Hkv, budget + new, D)
        instead of the cache; the token at position p goes to slot p - offset (ByteCross
        App. A: entries gathered once, each step appends its own). `offset` is a (1,) device
        tensor updated in place by the caller, `host_offset` its value on the host. None:
        read the cache."""
        if k is not None and (offset is None or offset.device != k.device):
            # a host offset would reach the captured step as a constant of another device
            raise ValueError(f"the compact buffer's offset must be a (1,) tensor on {k.device}, "
                             f"got {None if offset is None else offset.device}")
        self.compact = None if k is None else (k, v, offset)
        self.host_offset = int(host_offset)
        self.window = None

    def read_window(self, sinks: int | None, recent: int = 0) -> None:
        """Decode reads the first `sinks` and the last `recent` entries in place (App. A);
        None: read the cache."""
        self.window = None if sinks is None else (int(sinks), int(recent))
        self.compact = None


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        q_width, kv_width = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.q_proj = nn.Linear(args.dim, q_width, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, kv_width, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, kv_width, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_width, args.dim, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.qk_norm = args.qk_norm
        self.qkv = None  # a fused one-token projection (projection.sparse_linear.SparseConcat)
        self.observe: list | None = None  # set to a list to collect post-RoPE queries (B, Hq, L, D)
        # The last RECENT_QUERIES post-RoPE queries of the prefill, (B, Hq, <= RECENT_QUERIES, D), and
        # the position after them: the observation window of a KV selection (kv.apply), for free.
        self.recent: tuple[Tensor, int] | None = None
        self.cache: KVCache | None = None
        self.backend = "split_k"
        self.kernel_options = AttentionOptions()  # the split-K kernel's launch options (set_attention_options_)

    def forward(self, x, cos, sin, pos, start: int | None, host_len: int | None = None, tables=None, slots=None):
        """x (B, L, dim); cos, sin (L, D); pos (L,) positions; start, host_len: see module doc;
        decode only: tables, the (T, D) cos and sin tables (the one-launch RoPE reads its row on
        the device); a decode batch: slots, see `_attend_rows`."""
        B, L, _ = x.shape
        if self.qkv is not None and B * L == 1:
            q, k, v = self.qkv(x)  # one launch for the three sites
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(self.attend(q, k, v, cos, sin, pos, start, host_len, tables, slots))

    def attend(self, q, k, v, cos, sin, pos, start: int | None, host_len: int | None = None, tables=None,
               slots=None):
        """The attention output (B, L, Hq * D), before o_proj, of the projections q (B, L, Hq * D)
        and k, v (B, L, Hkv * D): RoPE, the cache update, then decode or prefill attention."""
        B, L, _ = q.shape
        q = q.view(B, L, self.n_heads, self.head_dim)  # (B, L, Hq, D)
        k = k.view(B, L, self.n_kv_heads, self.head_dim)  # (B, L, Hkv, D)
        v = v.view(B, L, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if start is None and (B > 1 or slots is not None or self.cache.k.shape[0] > B):
            return self._attend_rows(q, k, v, cos, sin, pos, slots)
        one = start is None and L == 1 and tables is not None and rope_cache_usable(q)
        if one and self.backend == "split_k" and self.cache.window is None and host_len is None and self.observe is None:
            # one launch: RoPE, the cache write (and the compact buffer's) and the attention
            # (docs/kernels/decode_attention.md#rope-in-attention)
            y, _ = rope_attention(q.reshape(B, -1), k.reshape(B, -1), v.reshape(B, -1), *tables, pos, self.cache.k,
                                  self.cache.v, options=self.kernel_options, compact=self.cache.compact)
            return y.reshape(B, 1, self.n_heads * self.head_dim)
        if one and self.cache.compact is None:
            # one launch: RoPE of q and k, k and v into the cache (kernels.rope_cache)
            q1 = rope_cache(q.reshape(B, -1), k.reshape(B, -1), v.reshape(B, -1), *tables, pos, self.cache.k,
                            self.cache.v)  # (B, Hq, D)
            if self.observe is not None:
                self.observe.append(q1[:, :, None])
            y = self._decode_attention(q1, None, None, pos, host_len)
            return y.reshape(B, 1, self.n_heads * self.head_dim)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, Hq, L, D)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, Hkv, L, D)
        if start is not None and self.observe is None:
            self._keep_recent(q, start)
        v = v.transpose(1, 2)  # (B, Hkv, L, D)
        if self.observe is None:
            self.cache.update(pos, k, v)  # the full cache receives every entry, in every mode
        else:  # an observation window (kv.apply): its queries attend to the entries as prefilled,
            self.observe.append(q)  # which stay bit for bit (rewriting them would round differently)
        if start is None:
            y = self._decode_attention(q[:, :, 0], k, v, pos, host_len)  # (B, Hq, D)
            y = y.reshape(B, 1, self.n_heads * self.head_dim)
        else:
            y = self._prefill_attention(q, start, L).transpose(1, 2)  # (B, L, Hq, D)
            y = y.reshape(B, L, self.n_heads * self.head_dim)
        return y

    def _attend_rows(self, q, k, v, cos, sin, pos, slots=None):
        """A decode batch (ByteCross §3.3, App. F): q (B, 1, Hq, D), k, v (B, 1, Hkv, D) of one
        token per sequence at its own position pos (B,), with cos, sin (B, D) its rows of the RoPE
        tables; `slots` (B,) the cache rows of the B sequences (None: rows 0..B-1 of a cache of
        B or more rows). Each entry
        goes to its sequence's cache row (and to its compact buffer where it selected) and its
        query reads its own entries (`rows_attention`). (B, 1, Hq * D)."""
        B, D = q.shape[0], self.head_dim
        c, s = cos.view(B, 1, 1, D), sin.view(B, 1, 1, D)
        q = apply_rope(q.transpose(1, 2), c, s)[:, :, 0]  # (B, Hq, D)
        k = apply_rope(k.transpose(1, 2), c, s)[:, :, 0]  # (B, Hkv, D)
        v = v[:, 0]  # (B, Hkv, D)
        rows, cache = torch.arange(B, device=q.device) if slots is None else slots, self.cache
        cache.k[rows, :, pos] = k  # entry (b, :, pos[b]) of each row
        cache.v[rows, :, pos] = v
        compact, kc, vc = cache.rows, cache.k, cache.v
        if compact is not None:
            ck, cv, offset, _ = compact
            slot = (pos - offset[rows]).clamp(0, ck.shape[2] - 1)  # a row that did not select writes a slot it never reads
            ck[rows, :, slot] = k
            cv[rows, :, slot] = v
        if slots is None and kc.shape[0] > B:  # the first B rows of a larger cache (a timing's sub-batch)
            kc, vc = kc[:B], vc[:B]
            compact = None if compact is None else tuple(t[:B] for t in compact)
        y = rows_attention(q, kc, vc, pos, compact, slots=slots, options=self.kernel_options)
        return y.reshape(B, 1, self.n_heads * self.head_dim)

    def _keep_recent(self, q: Tensor, start: int) -> None:
        """Keep the trailing RECENT_QUERIES queries of a prefill chunk (B, Hq, L, D) at positions
        [start, start + L), joined to those kept before when the chunk continues them."""
        L = q.shape[2]
        if L < RECENT_QUERIES and self.recent is not None and self.recent[1] == start:
            q = torch.cat([self.recent[0], q], dim=2)  # (B, Hq, kept + L, D)
        self.recent = (q[:, :, -RECENT_QUERIES:].clone(), start + L)

    def _decode_attention(self, q, k, v, pos, host_len=None):
        """One query per sequence (B, Hq, D) over the cache, the compact buffer of selected
        entries (the new k, v (B, Hkv, 1, D) appended at slot pos - offset) or the window.
        The valid length is pos + 1 on the device, or `host_len` where it is given. The
        position goes to the attention with `end_offset=1` rather than as a tensor pos + 1:
        compiled, that tensor is formed by a launch of its own before every layer's call."""
        cache, opts = self.cache, self.kernel_options
        if cache.compact is not None:
            ck, cv, offset = cache.compact
            slot = pos - offset  # (1,)
            ck.index_copy_(2, slot, k)
            cv.index_copy_(2, slot, v)
            if host_len is not None:
                return decode_attention(q, ck, cv, host_len - cache.host_offset, backend=self.backend, options=opts)
            return decode_attention(q, ck, cv, slot, backend=self.backend, end_offset=1, options=opts)
        if cache.window is not None:
            end = pos + 1 if host_len is None else host_len
            return window_attention(q, cache.k, cache.v, end, *cache.window, backend=self.backend, options=opts)
        if host_len is not None:
            return decode_attention(q, cache.k, cache.v, host_len, backend=self.backend, options=opts)
        return decode_attention(q, cache.k, cache.v, pos, backend=self.backend, end_offset=1, options=opts)

    def _prefill_attention(self, q, start: int, L: int):
        """SDPA of a chunk's queries (B, Hq, L, D) over cache entries [0, start+L)."""
        end = start + L
        k, v = self.cache.k[:, :, :end], self.cache.v[:, :, :end]  # (B, Hkv, end, D)
        gqa = self.n_heads != self.n_kv_heads
        if start == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        # Query i of the chunk sits at position start+i and sees keys 0..start+i.
        rows = torch.arange(start, end, device=q.device)[:, None]  # (L, 1)
        mask = torch.arange(end, device=q.device)[None, :] <= rows  # (L, end)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.d_ff, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.dim, args.d_ff, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.d_ff, args.dim, bias=args.mlp_bias)
        self.gate_up = None  # a fused one-token projection (projection.sparse_linear.SparseConcat)

    def forward(self, x):
        if self.gate_up is not None and x.shape[:-1].numel() == 1:
            gate, up = self.gate_up(x)  # one launch for both sites
            swiglu = getattr(self.down_proj, "forward_swiglu", None)  # a sparse down: silu * up in its load
            if swiglu is not None:
                return swiglu(gate, up)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = FeedForward(args)

    def forward(self, x, cos, sin, pos, start, host_len=None, tables=None, slots=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, pos, start, host_len, tables, slots)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fused(self) -> bool:
        """Whether a decode step may run `forward_fused`: q|k|v and gate|up are one sparse
        launch each that can norm its input, o and down sparse projections that can add the
        residual (docs/kernels/sparse_gemv.md#fuse-norms)."""
        a, m = self.self_attn, self.mlp
        return (getattr(a.qkv, "fuse_norms", False) and getattr(getattr(m, "gate_up", None), "fuse_norms", False)
                and getattr(a.o_proj, "threshold", None) is not None
                and getattr(m.down_proj, "threshold", None) is not None)

    def forward_fused(self, x, ss, cos, sin, pos, host_len=None, tables=None):
        """One decode token (x (1, 1, dim)) with both RMSNorms and residual adds inside the sparse
        GEMVs: ss holds x's sums of squares; returns the new x and its sums of squares. Same
        math as `forward` up to the order of the sums of squares (`kernels.sparse_gemv`)."""
        a, m = self.self_attn, self.mlp
        q, k, v = a.qkv(x, norm=(self.input_layernorm, ss))
        x, ss = a.o_proj(a.attend(q, k, v, cos, sin, pos, None, host_len, tables), residual=x)
        gate, up = m.gate_up(x, norm=(self.post_attention_layernorm, ss))
        # a SparseLinear (see `fused`): silu(gate) * up in its load where the kernel runs, else formed here
        return m.down_proj.forward_swiglu(gate, up, residual=x)


class Transformer(nn.Module):
    """Embedding, `n_layers` blocks, final norm and LM head (tied or not)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab, bias=False)
        self.tie_weights()
        self.max_len = 0

    def tie_weights(self) -> None:
        if self.args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def setup_cache(self, max_len: int, batch: int = 1, attention: str = "split_k") -> None:
        """Allocate the static KV caches and RoPE tables on the model's device and dtype."""
        w = self.embed_tokens.weight
        a = self.args
        for layer in self.layers:
            layer.self_attn.cache = KVCache(batch, a.n_kv_heads, max_len, a.head_dim, w.dtype, w.device)
            layer.self_attn.backend = attention
        cos, sin = rope_tables(a, max_len, device=w.device, dtype=w.dtype)  # (T, D) each
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.max_len = max_len

    def forward(self, idx: torch.Tensor, pos: torch.Tensor, start: int | None = None,
                host_len: int | None = None, slots: torch.Tensor | None = None, last: bool = False):
        """Logits (B, L, vocab) in the model dtype for tokens idx (B, L) at positions pos (L,).

        `start` (host int) selects the prefill path and must equal pos[0]; None is
        the decode path (L == 1, position only on the device); a decode batch (idx (B, 1), B > 1,
        or `slots` given) gives each sequence's own position, pos (B,), and `slots` (B,) the cache
        rows its sequences live in (None: rows 0..B-1). `host_len`, decode only,
        is the valid length pos + 1 as a host int, for backends that slice on the host. `last`
        (prefill): the logits of the chunk's last position only (B, 1, vocab), the LM head run on
        that row alone (a 1K prompt's full logits are 29 GFLOP of head on smollm2).
        """
        x = self.embed_tokens(idx)  # (B, L, dim)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # (L, D); a decode batch's (B, D)
        one = start is None and idx.numel() == 1 and slots is None
        tables = (self.rope_cos, self.rope_sin) if start is None else None  # decode: for the one-launch RoPE
        ss = None  # x's sums of squares, while layers run forward_fused
        for layer in self.layers:
            if one and layer.fused():
                x, ss = layer.forward_fused(x, sumsq(x) if ss is None else ss, cos, sin, pos, host_len, tables)
            else:
                x, ss = layer(x, cos, sin, pos, start, host_len, tables, slots), None
        if start is None and x.shape[0] > 1:
            return self._head_rows(self.norm(x))
        if start is not None:  # prefill: a half head in float32 on a CPU without half GEMMs
            h = self.norm(x[:, -1:] if last else x)
            return linear(h, self.lm_head.weight, self.lm_head.bias)  # (B, L or 1, vocab)
        return self.lm_head(self.norm(x))  # (B, L, vocab)

    def _head_rows(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head of a decode batch (h (B, 1, dim)): on CPU the C kernel reads the weight once
        for the B rows (`sparse_gemv_union_cpu`, every row kept), where F.linear's GEMM ran a wide
        head with few rows slower on two threads (a microbenchmark while building this, not a
        record: `benchmarks/batch_decode.py` times the whole step); elsewhere the head as it is."""
        from sparsedecode.kernels.cpu_gemv import has_entry, sparse_gemv_union_cpu

        w_t = self.lm_head.weight.t()  # (dim, vocab): a contiguous view where column_major_ laid it out
        if h.is_cuda or w_t.stride(1) != 1 or not has_entry("sd_gemv_union", w_t.dtype) \
                or torch.compiler.is_compiling():
            return self.lm_head(h)
        y, _, _ = sparse_gemv_union_cpu(h.reshape(h.shape[0], -1), w_t, float("-inf"), self.lm_head.bias)
        return y.view(h.shape[0], 1, -1)

    def column_major_(self) -> None:
        """Store each linear whose output is at least as wide as its input (q, gate, up,
        the LM head) transposed in memory, exposed as the same (out, in) view.

        For one token, CPU GEMV kernels stream an (in, out) matrix about 1.5-2x
        faster than an (out, in) one of that shape (measured on the 2-core CI
        machine; down_proj, wider in than out, is faster as it is). Values,
        shapes and names are unchanged; only the strides differ.
        """
        for mod in self.modules():
            if isinstance(mod, nn.Linear) and mod.out_features >= mod.in_features:
                w = mod.weight.detach()
                mod.weight = nn.Parameter(w.t().contiguous().t(), requires_grad=False)
        if self.args.tie_embeddings:
            self.embed_tokens.weight = self.lm_head.weight

    def projection_sites(self):
        """(layer index, site name, parent module) of each of the seven projections per layer.

        A projection-sparsity mode replaces `getattr(parent, site)` by a module
        with the same call signature; nothing else in the decoder changes.
        """
        for i, layer in enumerate(self.layers):
            for site in ATTN_SITES:
                yield i, site, layer.self_attn
            for site in MLP_SITES:
                yield i, site, layer.mlp


def forward_uncached(model: Transformer, idx: torch.Tensor) -> torch.Tensor:
    """Logits (B, L, vocab) of tokens idx (B, L) at positions 0..L-1 without the KV cache: causal
    SDPA over the sequence itself, every op differentiable, for fine-tuning (`quality.finetune`).
    It calls the same modules as `forward` (the projections, norms and MLP), so hooks on them
    (the masks of `projection.calibrate.masks`) and wrappers around them (LoRA) apply as in
    prefill; the cache is neither read nor written."""
    B, L = idx.shape
    cos, sin = model.rope_cos[:L], model.rope_sin[:L]  # (L, D)
    x = model.embed_tokens(idx)  # (B, L, dim)
    for layer in model.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.q_proj(h).view(B, L, a.n_heads, a.head_dim)  # (B, L, Hq, D)
        k = a.k_proj(h).view(B, L, a.n_kv_heads, a.head_dim)  # (B, L, Hkv, D)
        v = a.v_proj(h).view(B, L, a.n_kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = a.q_norm(q), a.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, Hq, L, D)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, Hkv, L, D)
        y = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True,
                                           enable_gqa=a.n_heads != a.n_kv_heads)  # (B, Hq, L, D)
        x = x + a.o_proj(y.transpose(1, 2).reshape(B, L, a.n_heads * a.head_dim))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.norm(x))  # (B, L, vocab)


def set_attention_options_(model: nn.Module, opts: AttentionOptions) -> int:
    """Set the split-K kernel's launch options on every attention layer of `model`; returns how
    many layers were set. A step compiled or captured before keeps the options it was traced
    with: whoever holds it (the engine's `set_kernels`) drops it."""
    if not isinstance(opts, AttentionOptions):
        raise InputError(f"set_attention_options_ takes a kernels.options.AttentionOptions; got {type(opts).__name__}")
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for layer in layers:
        layer.kernel_options = opts
    return len(layers)


def init_random_(model: Transformer, std: float = 0.02, seed: int | None = 0) -> None:
    """Fill weights in place, on their device: N(0, std) matrices, unit norms, zero biases."""
    gen = None
    if seed is not None:
        gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)


__all__ = ["SITES", "KVCache", "ModelArgs", "Transformer", "forward_uncached", "init_random_", "set_attention_options_"]
