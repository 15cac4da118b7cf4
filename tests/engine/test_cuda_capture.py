"""On CUDA the decode step is compiled and captured; it must give the same logits as
the full-sequence forward, and replays must follow the device-side position."""

import pytest
import torch

import sparsedecode

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("fresh_dynamo")]

CFG = dict(
    model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=3,
    num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=300,
    max_position_embeddings=4096, rope_theta=10000.0, eos_token_id=None,
)


@pytest.mark.parametrize("attention", ["split_k", "sdpa_masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_decode_matches_forward(attention, dtype):
    eng = sparsedecode.load(dict(CFG), init="random", device="cuda", dtype=dtype,
                            max_len=1100, attention=attention)
    assert eng.cuda_graph
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (1040,), generator=g)
    ref = eng.forward_logits(ids).float()  # (L, V)
    eng.reset()
    eng.prefill(ids[:1000])
    got = []
    for t in ids[1000:]:
        got.append(eng.decode_step(int(t)).clone())
    got = torch.stack(got)  # (40, V)
    want = ref[1000:]
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err <= tol, f"{attention} {dtype}: max rel err {err:.2e}"
    assert eng.graphs == 1  # the step really ran as a graph replay
    assert set(eng.capture_phases) == {"first_call_s", "warmup_s", "graph_s"}
    assert 0 < sum(eng.capture_phases.values()) <= eng.compile_s
    assert set(eng.load_phases) == {"resolve_s", "build_s", "cache_s", "engine_s", "warm_kv_s"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_fused_step_matches_forward_without_a_graph(dtype):
    """sdpa_fused slices on the host: compiled with a dynamic length, never captured."""
    eng = sparsedecode.load(dict(CFG), init="random", device="cuda", dtype=dtype,
                            max_len=1100, attention="sdpa_fused")
    assert eng.compile and not eng.cuda_graph
    ids = torch.randint(0, 300, (1040,), generator=torch.Generator().manual_seed(0))
    want = eng.forward_logits(ids).float()[1000:]  # (40, V)
    eng.reset()
    eng.prefill(ids[:1000])
    got = torch.stack([eng.decode_step(int(t)).clone() for t in ids[1000:]])  # (40, V)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err <= tol, f"sdpa_fused {dtype}: max rel err {err:.2e}"
    assert eng.graphs == 0
