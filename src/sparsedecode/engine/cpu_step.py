"""The engine's CPU decode step as one C call (`kernels.cpu_step`; issue 46 item 2).

On CPU the eager PyTorch step spends more time around its projections than in them (about forty
operator calls per layer for norms, RoPE, the cache write, SDPA, SiLU and residual adds:
benchmarks/records/cpu/decode/cpu_step_split_*). `CpuStep` describes the model to the C step once
(pointers to every layer's fused weights, norms, thresholds and cache) and runs the whole token in
one call: the dense step and TEAL's (every site a `SparseLinear`, q|k|v and gate|up fused), with or
without a KV selection's compact buffer. What it cannot run is refused by `refusal` in words, and
the engine runs the PyTorch step there: CATS/SATS and routing (their MLP is not a GEMV chain), a
window selection, another attention backend, forward hooks on the step's modules (calibration and
tests read each site's input through them); torch.compile and a batch resolve cpu.step off.

The plan is keyed by what the step reads (`_key`: each layer's modules, the compact buffer, the
track flags, hooks) and built again when that changes; thresholds are read through pointers to the
modules' own threshold tensors, so a threshold set in place is seen by the next step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparsedecode.kernels.cpu_step import NSITES, Layer, Model, run_step, step_entry
from sparsedecode.projection.sparse_linear import SparseConcat, SparseLinear

SITES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def refusal(engine) -> str | None:
    """Why the C step cannot run `engine`'s decode step as it stands now (None: it can), in words for
    users and records. What never changes for an engine (its device, torch.compile, its batch, a
    built kernel) was settled when its cpu.step option was resolved (`Engine._resolved`)."""
    if engine.router is not None:
        return "token routing runs CATS MLPs"
    return model_refusal(engine.model)


def model_refusal(model) -> str | None:
    """Why the C step cannot run this model's step as it stands now (None: it can)."""
    for i, layer in enumerate(model.layers):
        a, m = layer.self_attn, layer.mlp
        if a.backend != "split_k":
            return f"attention backend {a.backend} (the C step is split_k's valid-prefix read)"
        if not (isinstance(a.qkv, SparseConcat) and isinstance(a.o_proj, SparseLinear)
                and isinstance(getattr(m, "gate_up", None), SparseConcat)
                and isinstance(getattr(m, "down_proj", None), SparseLinear)):
            return (f"layer {i}'s projections are not the fused GEMV sites (nn.Linear under gemv.dense=false, "
                    "or CATS/SATS)")
        if a.qkv.has_lora or m.gate_up.has_lora or a.o_proj.has_lora or m.down_proj.has_lora:
            return (f"layer {i} holds an unmerged LoRA adapter (projection.lora_attach); the C step reads "
                    "the base weights only")
        if a.cache.window is not None:
            return "a window selection reads its cache in place"
        if a.cache.k.shape[0] != 1:
            return "a cache of several rows"
    return None


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _hooked(mods) -> bool:
    """Whether any of `mods` (None skipped) holds a forward hook the C step would skip."""
    return any(x is not None and (x._forward_hooks or x._forward_pre_hooks) for x in mods)


def _adapted(mods) -> bool:
    """Whether any of `mods` (None skipped) holds an unmerged LoRA adapter (a registered buffer)."""
    return any(x is not None and x._buffers.get("lora_a_t") is not None for x in mods)


def plan(engine, previous):
    """The C step for `engine`'s decode step as it stands: (key, CpuStep or None, why not). The
    previous answer is reused while nothing the step reads changed (`previous`, its key)."""
    key = (_key(engine.model), id(engine.router))
    if previous is not None and previous[0] == key:
        return previous
    reason = refusal(engine)
    if reason is None and any(k[-1] for k in key[0]):
        reason = "a forward hook on a module of the step (calibration, a test reading a site's input)"
    if reason is None and not all(k[6] for k in key[0]):
        reason = "a KV selection is observing its window"
    return key, (None if reason else CpuStep(engine.model)), reason


def _key(model) -> tuple:
    """What a plan read: each layer's fused and site modules, track flags, compact buffer, window,
    observation list, whether a site holds an unmerged adapter and whether any module of the step
    holds a forward hook. Read per decode step,
    so through the modules' own dicts (`_modules`, `__dict__`) rather than nn.Module's attribute
    fallback, which cost the key about a millisecond a step on smollm2's 30 layers."""
    out = []
    for layer in model.layers:
        lm = layer._modules
        a, m = lm["self_attn"], lm["mlp"]
        am, mm = a._modules, m._modules  # m may be a CATS MLP: no gate_up (the plan refuses it)
        cache = am["cache"].__dict__
        c, o = cache["compact"], am["o_proj"]
        out.append((id(am.get("qkv")), id(o), id(mm.get("gate_up")), id(mm.get("down_proj")),
                    None if c is None else (id(c[0]), id(c[2])), cache["window"] is None,
                    a.__dict__["observe"] is None, o.track if isinstance(o, SparseLinear) else None,
                    _adapted((*(am.get(s) for s in SITES[:4]), *(mm.get(s) for s in SITES[4:]))),
                    _hooked((layer, a, m, lm["input_layernorm"], lm["post_attention_layernorm"], am.get("qkv"),
                             mm.get("gate_up"), *(am.get(s) for s in SITES[:4]), *(mm.get(s) for s in SITES[4:])))))
    return tuple(out)


class CpuStep:
    """The C description of one model's decode step, and the call (`plan` builds it where
    `refusal` says None); `__call__(token, pos)` returns the float32 logits (V,)."""

    def __init__(self, model):
        args = model.args
        self.model = model
        w = model.embed_tokens.weight
        self.dtype = w.dtype
        self.fn = step_entry(self.dtype)
        f32 = lambda t: None if t is None else t.detach().float().contiguous()  # noqa: E731
        self.hold: list = []  # every tensor a pointer below reads: alive as long as the plan

        def keep(t):
            self.hold.append(t)
            return _ptr(t)

        self.layers = (Layer * len(model.layers))()
        self.sites: list[list[SparseLinear]] = []
        for i, layer in enumerate(model.layers):
            a, m = layer.self_attn, layer.mlp
            sites = [*a.qkv.sites, a.o_proj, *m.gate_up.sites, m.down_proj]
            self.sites.append(sites)
            L = self.layers[i]
            for name, mod in (("qkv", a.qkv), ("o", a.o_proj), ("gu", m.gate_up), ("down", m.down_proj)):
                wt = mod.w_t.detach()
                setattr(L, f"w_{name}", keep(wt))
                setattr(L, f"ld_{name}", wt.stride(0))
                setattr(L, f"b_{name}", keep(f32(mod.bias)))
            L.norm_attn, L.norm_mlp = keep(f32(layer.input_layernorm.weight)), keep(f32(layer.post_attention_layernorm.weight))
            L.q_norm = keep(f32(a.q_norm.weight)) if a.qk_norm else None
            L.k_norm = keep(f32(a.k_norm.weight)) if a.qk_norm else None
            for j, s in enumerate(sites):
                L.thr[j] = keep(s.threshold)  # read by the step: a threshold set in place is seen
            cache = a.cache
            L.k_cache, L.v_cache, L.t_cache = keep(cache.k), keep(cache.v), cache.k.shape[2]
            if cache.compact is not None:
                ck, cv, off = cache.compact
                L.k_comp, L.v_comp, L.t_comp, L.comp_offset = keep(ck), keep(cv), ck.shape[2], keep(off)
        head = model.lm_head
        w_t = head.weight.detach().t()  # (dim, vocab): contiguous rows where column_major_ laid it out
        on = w_t.stride(1) == 1 and w_t.dtype == self.dtype
        self.head = None if on else head  # otherwise the head runs here on the normed state
        cos, sin = f32(model.rope_cos), f32(model.rope_sin)
        self.md = Model(n_layers=len(model.layers), dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                        head_dim=args.head_dim, d_ff=args.d_ff, vocab=args.vocab, eps=args.norm_eps,
                        scale=args.head_dim ** -0.5, rope_cos=keep(cos), rope_sin=keep(sin),
                        rope_len=cos.shape[0], embed=keep(w.detach()), embed_row=w.stride(0), embed_col=w.stride(1),
                        norm_final=keep(f32(model.norm.weight)), w_head=keep(w_t) if on else None,
                        ld_head=w_t.stride(0) if on else 0, b_head=keep(f32(head.bias)) if on else None)
        self.out = torch.empty(args.vocab if on else args.dim, dtype=torch.float32)
        self.kept = torch.zeros(len(model.layers) * NSITES, dtype=torch.int64)
        self.tracked = [(li, j, s) for li, sites in enumerate(self.sites) for j, s in enumerate(sites) if s.track]

    def __call__(self, token: int, pos: int) -> Tensor:
        with torch.profiler.record_function("sparsedecode::cpu_step"):  # a profiled step names its one call
            run_step(self.fn, self.md, self.layers, token, pos, self.out, self.kept if self.tracked else None)
        if self.tracked:
            counts = self.kept.tolist()
            for li, j, s in self.tracked:
                s.kept_host[0] += counts[li * NSITES + j]
                s.kept_host[1] += s.in_features
        if self.head is not None:
            return self.head(self.out.to(self.dtype)).float()
        return self.out


__all__ = ["CpuStep", "model_refusal", "plan", "refusal"]
