"""The sdpa_fused decode step slices the cache on the host; compiled, it takes the valid
length as a dynamic size (ByteCross App. D compares the same window under three
*compiled* attention paths). It must give the logits of the eager reference in every
read mode, and compile at most twice (the first length specialized, then one dynamic
graph), not once per step."""

from __future__ import annotations

import pytest
import torch

import sparsedecode

TINY = dict(
    model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=60,
    max_position_embeddings=256, rope_theta=1e4, eos_token_id=None,
)


def _decode(attention: str, compile: bool, kv: tuple | None, ids: torch.Tensor) -> torch.Tensor:
    eng = sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=128, seed=5,
                            attention=attention, compile=compile)
    eng.prefill(ids[:70])
    if kv is not None:
        eng.select_kv(kv[0], kv[1], 20, **kv[2])
    return torch.stack([eng.decode_step(int(t)).clone() for t in ids[70:]])  # (steps, V)


@pytest.mark.parametrize("kv", [None, ("snapkv", 0.5, {"window": 8}), ("window", 0.5, {"window": 8})],
                         ids=["dense", "snapkv", "window"])
def test_compiled_fused_step_matches_eager_and_compiles_once_for_all_lengths(kv):
    torch._dynamo.reset()
    ids = torch.randint(0, 60, (82,), generator=torch.Generator().manual_seed(1))
    want = _decode("split_k", False, kv, ids)
    torch._dynamo.utils.counters.clear()
    got = _decode("sdpa_fused", True, kv, ids)
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    assert 1 <= compiles <= 2, f"{compiles} graphs for 12 lengths: the length was specialized"
