"""Token routing in the captured CUDA decode step (SATS paper §3.2): all-sparse routing
decodes as the CATS engine, all-dense as the dense engine (the kernels at keep-all, equal up
to fp32 summation order), and the device counter counts the sparse-routed steps of a
mixed table, all inside one graph replay per step."""

import pytest
import torch

import sparsedecode
from sparsedecode.projection.routing import RoutingTable, tokenizer_fingerprint
from sparsedecode.projection.thresholds import Thresholds

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("fresh_dynamo")]

CFG = dict(
    model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=3,
    num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=300,
    max_position_embeddings=4096, rope_theta=10000.0, eos_token_id=None,
)


def _decode(eng, ids):
    eng.reset()
    eng.prefill(ids[:500])
    return torch.stack([eng.decode_step(int(t)).clone() for t in ids[500:]])  # (40, V)


def _table(sparse: torch.Tensor) -> RoutingTable:
    V = sparse.numel()
    return RoutingTable(scores=torch.where(sparse, 0.0, 1.0), count=torch.ones(V, dtype=torch.long),
                        model="m", vocab=V, tokenizer=tokenizer_fingerprint(None),
                        thresholds={"method": "cats", "keep": 0.5}, text={}, tau=0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_capture_matches_the_dense_and_cats_engines(dtype):
    eng = sparsedecode.load(dict(CFG), init="random", device="cuda", dtype=dtype, max_len=600)
    ids = torch.randint(0, 300, (540,), generator=torch.Generator().manual_seed(0))
    dense = _decode(eng, ids)
    cats = Thresholds(values={f"layers.{i}.act": 0.3 for i in range(3)}, method="cats", keep=0.5,
                      model=eng.name, dims=eng.dims.to_dict(), keep_metric="act_keep")
    eng.sparsify(cats)
    sparse = _decode(eng, ids)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    scale = dense.abs().max().item()
    assert (sparse - dense).abs().max().item() > 3 * tol * scale  # CATS changes the logits
    for everything, want in ((True, sparse), (False, dense)):
        eng.route(_table(torch.full((300,), everything)))
        got = _decode(eng, ids)
        assert eng.graphs == 1
        err = (got - want).abs().max().item() / scale
        assert err <= tol, f"all {'sparse' if everything else 'dense'}: rel err {err:.2e}"
        assert eng.routed_fraction() == (1.0 if everything else 0.0)
    half = torch.arange(300) % 2 == 0
    eng.route(_table(half))
    _decode(eng, ids)
    assert eng.routed_fraction() == pytest.approx(float(half[ids[500:]].float().mean()))
