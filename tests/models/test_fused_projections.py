"""Fusing q/k/v and gate/up into one GEMV each changes no logit, keeps the seven sites
addressable (their weights are views of the fused blocks) and adds no state-dict keys."""

import torch
from torch import nn

import sparsedecode

CFG = dict(
    model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
    max_position_embeddings=256, rope_theta=10000.0, eos_token_id=None,
)


def test_fused_projections_match_separate_ones():
    eng = sparsedecode.load(dict(CFG), init="random", device="cpu", max_len=64)
    with torch.no_grad():
        for name, p in eng.model.named_parameters():
            if name.endswith("bias"):  # random init zeroes biases; make them count
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    ids = torch.randint(0, 100, (20,), generator=torch.Generator().manual_seed(0))
    want = eng.forward_logits(ids)
    keys = set(eng.model.state_dict())
    eng.model.fuse_projections_()
    got = eng.forward_logits(ids)
    assert torch.equal(got, want)
    assert set(eng.model.state_dict()) == keys
    attn = eng.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv.weight.data_ptr()
    # a site swapped for another module (a sparse one, say) is honoured: the fused path is skipped
    class Swapped(nn.Linear):
        pass

    attn.k_proj = Swapped(64, 32, bias=True)
    assert not torch.equal(eng.forward_logits(ids), want)
