"""The union of kept channels a batched sparse projection reads, on real text (ByteCross §3.3, App. F).

A batch of B sequences shares each weight read, so a sparse projection must read the rows of every
input channel that any sequence of the batch keeps: a union fraction u_B >= r_P, which sets the
batched crossover n*_B = P (1 - u_B) / (2 B h_kv d_h (1 - r_KV)) (`account --batch --union`).
App. F measures it: 64 WikiText-2 sequences decoded at 4K context for 16 steps with the thresholds
on, split into groups of B consecutive sequences, and at every step the byte-weighted fraction of
the projection weights that at least one sequence of a group activates, averaged over steps and
groups (Table 14).

Here each sequence decodes alone: a sequence's masks do not depend on its batch-mates, so the
groups are formed afterwards from the recorded masks. The thresholds are applied as TEAL's masked
product by forward pre-hooks on the seven dense projections (channel i of a one-token call kept
iff |x_i| > t, the others zeroed; the prefill stays dense, §3.2), which record each step's mask.
Decoding is greedy from the window's prompt.
"""

from __future__ import annotations

import torch
from torch import nn

from sparsedecode.errors import InputError
from sparsedecode.kernels.common import keep_mask
from sparsedecode.projection.sparse_linear import site_key

# the input each site reads, as Table 14's columns group them
INPUT_OF = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "ffn_in", "up": "ffn_in", "down": "ffn_hidden"}


def window_starts(n_tokens: int, sequences: int, span: int) -> list[int]:
    """Starts of `sequences` non-overlapping windows of `span` tokens spread evenly over a stream of
    `n_tokens`, the first at 0 (App. F's 64 windows of the WikiText-2 test stream)."""
    if sequences < 1 or span < 1:
        raise InputError(f"need at least one sequence of at least one token; got {sequences} of {span}")
    if sequences * span > n_tokens:
        raise InputError(f"{sequences} windows of {span:,} tokens need {sequences * span:,} tokens; the text has "
                         f"{n_tokens:,}: give fewer sequences, a shorter context or fewer steps, or a longer text")
    gap = (n_tokens - span) // (sequences - 1) if sequences > 1 else 0
    return [i * gap for i in range(sequences)]


def record_masks(engine, thresholds: dict[str, float], windows: list[list[int]], steps: int,
                 progress=None) -> dict[str, torch.Tensor]:
    """Decode each window (a prompt of token ids) greedily for `steps` steps with `thresholds`
    ('layers.{i}.{site}' -> t) applied to the one-token calls of the engine's dense projections;
    returns, per site key, the kept-channel masks (sequences, steps, in_features) bool on the CPU.
    The engine's projections must be nn.Linear (load it with gemv.dense=false and no thresholds);
    `progress` is called once per window."""
    sites = {site_key(i, s): getattr(parent, s) for i, s, parent in engine.model.projection_sites()}
    if any(type(m) is not nn.Linear for m in sites.values()):
        raise InputError("record_masks needs the dense nn.Linear projections: load the engine with "
                         "kernels gemv.dense=false and no sparsity installed")
    missing = sorted(set(sites) - set(thresholds))
    if missing:
        raise InputError(f"no threshold for {missing[0]} (and {len(missing) - 1} more sites): the union needs all "
                         "seven projections' thresholds (TEAL)")
    if steps < 1:
        raise InputError(f"steps must be at least 1; got {steps}")
    seen: dict[str, list[torch.Tensor]] = {k: [] for k in sites}

    def pre(key: str, t: float):
        def hook(mod, args):
            x = args[0]
            if x.shape[:-1].numel() != 1:
                return None  # the prefill stays dense
            keep = keep_mask(x, torch.tensor(t, device=x.device))
            seen[key].append(keep.reshape(-1).cpu())
            return (x * keep,)
        return hook

    handles = [m.register_forward_pre_hook(pre(k, float(thresholds[k]))) for k, m in sites.items()]
    out = {k: torch.zeros(len(windows), steps, m.in_features, dtype=torch.bool) for k, m in sites.items()}
    try:
        for w, ids in enumerate(windows):
            for v in seen.values():
                v.clear()
            engine.reset()
            logits = engine.prefill(torch.as_tensor(ids))
            tok = int(logits.argmax())
            for s in range(steps):
                engine.seek(len(ids) + s, tok)
                tok = int(engine.eager_step().reshape(-1).argmax())  # logits (1, 1, V)
            for k, v in seen.items():
                if len(v) != steps:
                    raise RuntimeError(f"{k} saw {len(v)} one-token calls in {steps} decode steps")
                out[k][w] = torch.stack(v)
            if progress is not None:
                progress()
    finally:
        for h in handles:
            h.remove()
    return out


def union_table(masks: dict[str, torch.Tensor], params: dict[str, int], batches: list[int]) -> list[dict]:
    """Table 14 from recorded masks: for each B of `batches`, the sequences split into groups of B
    consecutive ones (the rest left out), and at each step the fraction of the projection weights
    (`params`: site key -> its weight's element count) that at least one sequence of a group keeps,
    averaged over steps and groups ('union'), the extremes of the groups' step averages, and the same
    union per input (`INPUT_OF`: qkv, o, ffn_in, ffn_hidden)."""
    S = next(iter(masks.values())).shape[0]
    rows = []
    for B in batches:
        if not 1 <= B <= S:
            raise InputError(f"a batch of {B} needs 1 to {S} recorded sequences")
        groups = S // B
        by_input: dict[str, list[float]] = {}
        per_group = torch.zeros(groups, dtype=torch.float64)
        total = 0.0
        for key, m in masks.items():
            g = m[: groups * B].reshape(groups, B, *m.shape[1:]).any(1)  # (groups, steps, K)
            frac = g.double().mean(-1).mean(-1)  # (groups,): this site's union averaged over steps
            per_group += frac * params[key]
            total += params[key]
            name = INPUT_OF[key.rsplit(".", 1)[-1]]
            acc = by_input.setdefault(name, [0.0, 0.0])
            acc[0] += frac.mean().item() * params[key]
            acc[1] += params[key]
        per_group /= total
        rows.append({"batch": B, "groups": groups, "union": per_group.mean().item(),
                     "group_min": per_group.min().item(), "group_max": per_group.max().item(),
                     "by_input": {k: a / p for k, (a, p) in by_input.items()}})
    return rows


__all__ = ["INPUT_OF", "record_masks", "union_table", "window_starts"]
