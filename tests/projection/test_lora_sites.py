"""LoRA adapters on the sparse decode modules (projection/lora_site.py, projection/lora_attach.py; SATS
paper §4.2): a site with an unmerged adapter computes what the merged weight W + s B A computes
under the same mask, on every path (one token through the CPU kernel or the masked reference,
prefill dense, a decode batch per token), and a tiny engine decodes with adapters as it decodes
with merged weights. Under TRITON_INTERPRET=1 the same engine runs the Triton kernels' adapter
path (one launch per site with an adapter; the fused q|k|v and gate|up carry their sites'
adapters side by side in their one launch where the segments are whole tiles, else each site
runs its own call).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
from test_sparse_linear import DECODE, PROMPT, TINY, site_inputs, site_modules

import sparsedecode
from interpreted import run_interpreted
from sparsedecode.errors import InputError
from sparsedecode.kernels.common import keep_mask
from sparsedecode.kernels.cpu_gemv import cpu_kernel
from sparsedecode.kernels.lora_gemv import lora_gemv_ref
from sparsedecode.kernels.options import CpuOptions, GemvOptions, KernelOptions
from sparsedecode.projection.lora_attach import attach_lora_, detach_lora_, lora_sites, site_of
from sparsedecode.projection.sparse_linear import READ_ALL, SparseConcat, SparseLinear, sparsify_

SCALE = 2.0
CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
cpu_built = pytest.mark.skipif(cpu_kernel().lib is None, reason=f"CPU kernel not built: {cpu_kernel().reason}")


def adapter(out_f, in_f, r, seed=0, dtype=torch.float32):
    """(A (r, in), B (out, r)) with a term about as large as the base output (so it shows)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(r, in_f, generator=gen) / math.sqrt(in_f)
    b = torch.randn(out_f, r, generator=gen) / math.sqrt(r * SCALE)
    return a.to(dtype), b.to(dtype)


def site(K=130, N=45, r=7, dtype=torch.float32, seed=0, keep=0.4):
    """(SparseLinear with an adapter, its twin holding the merged weight, x (1, K))."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=gen) / math.sqrt(K)).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    x = torch.randn(1, K, generator=gen).to(dtype)
    t = float(x.float().abs().quantile(1 - keep))
    a, b = adapter(N, K, r, seed + 1, dtype)
    mod = SparseLinear(w.t().contiguous(), bias, t, site="layers.0.down")
    mod.attach_lora_(a, b, SCALE)
    merged = (w.double() + SCALE * b.double() @ a.double()).to(dtype)
    return mod, SparseLinear(merged.t().contiguous(), bias, t), x


def close(got, want, dtype, what, ulps=2):
    """|got - want| within `ulps` units of dtype's last place at want's largest value (64 for
    float32: sums in other orders)."""
    tol = (64 if dtype == torch.float32 else ulps) * torch.finfo(dtype).eps * max(1.0, want.double().abs().max().item())
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol, f"{what}: off by {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("r", [1, 16])
def test_one_token_prefill_and_batch_equal_the_merged_weight(dtype, r):
    mod, merged, x = site(r=r, dtype=dtype)
    # the merged weight is rounded to dtype once, the adapter path is not: compare both to float64
    close(mod(x), lora_gemv_ref(x, mod.w_t, mod.threshold, *mod.lora, mod.bias), dtype, "one token vs ref")
    close(mod(x), merged(x), dtype, "one token vs merged", ulps=4)  # the merged weight is rounded
    xs = torch.cat([x, -x.flip(-1), 0.5 * x])  # (3, K)
    dense = F.linear(xs.double(), mod.weight.double(), mod.bias.double()) + SCALE * (
        xs.double() @ mod.lora_a_t.double()) @ mod.lora_b_t.double()
    close(mod(xs[None]), dense[None], dtype, "prefill vs dense")
    rows = mod(xs[:, None])  # a decode batch (B, 1, K): each token its own mask
    for i in range(3):
        close(rows[i], mod(xs[i:i + 1]), dtype, f"batch row {i}")  # rounded twice (base, + term) vs once
    base = SparseLinear(mod.w_t.detach().clone(), mod.bias, mod.threshold_host)
    mod.detach_lora_()
    assert not mod.has_lora and torch.equal(mod(x), base(x)) and torch.equal(mod(xs[None]), base(xs[None]))


@cpu_built
def test_zero_b_is_the_base_and_dropped_rows_of_a_are_never_read():
    mod, _, x = site(r=7)
    base = SparseLinear(mod.w_t.detach().clone(), mod.bias, mod.threshold_host)
    a = mod.lora_a_t.t().clone()
    a[:, ~keep_mask(x, mod.threshold).reshape(-1)] = math.nan  # the dropped channels' rows of A^T
    mod.attach_lora_(a, torch.zeros(mod.out_features, 7), SCALE)
    assert torch.equal(mod(x), base(x)), "B = 0 must give the base GEMV's output exactly"


def test_a_dense_site_reads_every_row():
    mod, _, x = site(r=7)
    mod.threshold.fill_(READ_ALL)
    mod.threshold_host = READ_ALL
    want = F.linear(x.double(), mod.weight.double(), mod.bias.double()) + SCALE * (
        x.double() @ mod.lora_a_t.double()) @ mod.lora_b_t.double()
    close(mod(x), want, torch.float32, "t = -inf vs dense + s B A x")


def test_fused_sites_run_apart_with_an_adapter():
    gen = torch.Generator().manual_seed(3)
    sites = [SparseLinear(torch.randn(64, n, generator=gen), None, 0.3, site=f"layers.0.{s}")
             for n, s in ((32, "q"), (16, "k"), (16, "v"))]
    cat = SparseConcat(sites)
    x = torch.randn(1, 64, generator=gen)
    plain = [y.clone() for y in cat(x)]
    sites[1].attach_lora_(*adapter(16, 64, 4, seed=4), SCALE)
    assert cat.has_lora and not cat.fuse_norms and cat.sites_apart  # on CPU: no segmented launch
    got = cat(x)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[2], plain[2])
    close(got[1], lora_gemv_ref(x, sites[1].w_t, 0.3, *sites[1].lora), torch.float32, "k with an adapter")


def test_swiglu_input_with_an_adapter():
    mod, _, _ = site(K=96, N=64, r=4, keep=0.5)
    gen = torch.Generator().manual_seed(5)
    gate, up = torch.randn(1, 96, generator=gen), torch.randn(1, 96, generator=gen)
    h = F.silu(gate) * up
    close(mod.forward_swiglu(gate, up), lora_gemv_ref(h, mod.w_t, mod.threshold, *mod.lora, mod.bias),
          torch.float32, "forward_swiglu")


def test_bad_adapters_and_keys_are_refused():
    mod, _, _ = site(K=130, N=45)
    with pytest.raises(InputError, match=r"must be A \(r, 130\) and B \(45, r\)"):
        mod.attach_lora_(torch.zeros(4, 45), torch.zeros(130, 4), 1.0)
    with pytest.raises(InputError, match="finite"):
        mod.attach_lora_(torch.zeros(4, 130), torch.zeros(45, 4), math.nan)
    assert site_of("base_model.model.model.layers.3.mlp.down_proj") == (3, "down_proj")
    assert site_of("layers.0.self_attn.q_proj") == site_of("layers.0.q") == (0, "q_proj")
    with pytest.raises(InputError, match="not a projection"):
        site_of("layers.0.mlp.act_fn")


def engine_pair(dtype="float32"):
    """Two tiny engines with the same random weights (PyTorch steps: the C step runs no adapter)."""
    kernels = KernelOptions(gemv=GemvOptions(dense=False), cpu=CpuOptions(step=False))
    one = sparsedecode.load(dict(TINY), init="random", dtype=dtype, max_len=64, kernels=kernels, device="cpu")
    two = sparsedecode.load(dict(TINY), init="random", dtype=dtype, max_len=64, kernels=kernels, device="cpu")
    two.model.load_state_dict(one.model.state_dict())
    return one, two


def run(engine):
    engine.reset()
    prefill = engine.prefill(PROMPT, all_logits=True).clone()
    return prefill, torch.stack([engine.decode_step(t).clone() for t in DECODE])


def adapters_for(model, keys, r=4):
    """Random adapters for `keys` (module paths) of `model`, and the same merged into a state dict."""
    mods = dict(model.named_modules())
    out = {}
    for n, key in enumerate(keys):
        w = mods[key].weight
        out[key] = adapter(w.shape[0], w.shape[1], r, seed=10 + n)
    return out


KEYS = ["layers.0.self_attn.q_proj", "layers.0.mlp.down_proj", "layers.1.self_attn.o_proj", "layers.1.mlp.up_proj",
        "layers.1.self_attn.v_proj"]


def merge_(model, sites):
    mods = dict(model.named_modules())
    with torch.no_grad():
        for key, (a, b) in sites.items():
            mods[key].weight += SCALE * (b @ a).to(mods[key].weight.dtype)


def engine_case(sparse: bool):
    """(adapter engine's (prefill, decode), merged engine's, the adapter engine)."""
    lora, merged = engine_pair()
    sites = adapters_for(lora.model, KEYS)
    merge_(merged.model, sites)
    if sparse:
        inputs = site_inputs(merged, site_modules(merged.model))
        thresholds = {k: float(torch.stack(v).abs().quantile(0.5)) for k, v in inputs.items()}
        sparsify_(lora.model, thresholds)
        sparsify_(merged.model, thresholds)
    attached = attach_lora_(lora.model, sites, SCALE)
    return run(lora), run(merged), lora, attached


@pytest.mark.parametrize("sparse", [False, True], ids=["dense sites", "TEAL sites"])
def test_engine_with_adapters_decodes_as_merged_weights(sparse):
    (p, d), (pm, dm), lora, attached = engine_case(sparse)
    assert all(isinstance(m, SparseLinear) and m.has_lora for m in attached)
    assert sorted(lora_sites(lora.model)) == ["layers.0.down", "layers.0.q", "layers.1.o", "layers.1.up", "layers.1.v"]
    scale = dm.abs().max().item()
    assert (d - dm).abs().max().item() <= 1e-5 * scale, "decode with adapters must equal merged weights"
    assert (p - pm).abs().max().item() <= 1e-5 * scale, "prefill with adapters must equal merged weights"
    if sparse:
        assert isinstance(lora.model.layers[1].self_attn.qkv, SparseConcat)  # still fused, run per site
    assert detach_lora_(lora.model) == 5 and not lora_sites(lora.model)
    _, d0 = run(lora)
    assert (d0 - dm).abs().max().item() > 1e-3 * scale, "without the adapters the logits must differ"


def test_cats_up_rides_on_the_cats_mlp_and_dtype_cast_keeps_fixed_buffers():
    from sparsedecode.projection.cats_runtime import cats_

    eng, _ = engine_pair()
    cats_(eng.model, {f"layers.{i}.act": 0.05 for i in range(2)})
    [mlp] = attach_lora_(eng.model, adapters_for(eng.model, ["layers.0.mlp.up_proj"]), SCALE)
    assert mlp is eng.model.layers[0].mlp and mlp.has_up_lora and lora_sites(eng.model) == ["layers.0.up"]
    with pytest.raises(InputError, match="up adapter of layers.0.act must be A"):
        mlp.attach_up_lora_(torch.zeros(4, 3), torch.zeros(96, 4), SCALE)
    [down] = attach_lora_(eng.model, adapters_for(eng.model, ["layers.0.mlp.down_proj"]), SCALE)
    eng.model.to(torch.bfloat16)
    assert down.lora_a_t.dtype == torch.bfloat16 and down.lora_ws_acc.dtype == torch.float32
    assert mlp.up_a_t.dtype == torch.bfloat16 and mlp.up_ws_acc.dtype == torch.float32
    assert detach_lora_(eng.model) == 2 and not lora_sites(eng.model) and not mlp.has_up_lora


def _interpreter_worker() -> None:
    """Under TRITON_INTERPRET=1: the engine case through the Triton kernels' adapter path."""
    import json

    from sparsedecode.projection import sparse_linear

    launches = []
    kernel = sparse_linear.sparse_gemv

    def counted(*args, **kw):
        launches.append(kw.get("lora") is not None)
        return kernel(*args, **kw)

    sparse_linear.sparse_gemv = counted
    (p, d), (pm, dm), _, _ = engine_case(True)
    mod, _, x = site(K=96, N=64, r=4)  # o's and down's residual add (the fused layer's), with an adapter
    res = torch.randn(1, 64)
    got, _ = mod(x, residual=res)
    want = lora_gemv_ref(x, mod.w_t, mod.threshold, *mod.lora, mod.bias) + res
    before = len(launches)
    concat = _concat_case()
    print(json.dumps({"decode_err": (d - dm).abs().max().item(), "prefill_err": (p - pm).abs().max().item(),
                      "scale": dm.abs().max().item(), "lora_launches": sum(launches[:before]),
                      "residual_err": (got - want).abs().max().item(), "concat_errs": concat,
                      "concat_launches": launches[before:]}))


def _concat_case() -> list[float]:
    """q|k|v of 128 columns each (whole tiles of the launch) with adapters on q and v, then one on
    k attached to the site alone (the concat rebuilds its side-by-side copy on the next eager call):
    each call one launch, each site's output against its own reference; errors over scale."""
    from sparsedecode.kernels.sparse_gemv import sparse_gemv_ref

    gen = torch.Generator().manual_seed(7)
    sites = [SparseLinear(torch.randn(64, 128, generator=gen) / 8, torch.randn(128, generator=gen), t,
                          site=f"layers.0.{s}") for s, t in (("q", 0.3), ("k", 0.8), ("v", 0.5))]
    cat = SparseConcat(sites)
    x = torch.randn(1, 64, generator=gen)
    for j in (0, 2):
        sites[j].attach_lora_(*adapter(128, 64, 4, seed=j), SCALE)
    cat.refresh_lora_()
    errs = []
    for step in range(2):
        got = cat(x)
        for m, y in zip(sites, got, strict=True):
            want = (lora_gemv_ref(x, m.w_t, m.threshold, *m.lora, m.bias) if m.has_lora
                    else sparse_gemv_ref(x, m.w_t, m.threshold, m.bias))
            errs.append((y - want).abs().max().item() / want.abs().max().item())
        if step == 0:
            sites[1].attach_lora_(*adapter(128, 64, 4, seed=1), SCALE)
    return errs


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_engine_adapters_under_interpreter():
    r = run_interpreted(__file__, "_interpreter_worker")
    # on CPU a plain one-token call runs the C kernel even here; down's silu(gate) * up input
    # runs the Triton kernel: one launch with its adapter per step (layer 0's down), and the
    # residual call below
    assert r["lora_launches"] == len(DECODE) + 1, r
    assert r["decode_err"] <= 1e-5 * r["scale"] and r["prefill_err"] <= 1e-5 * r["scale"], r
    assert r["residual_err"] <= 1e-5, r
    # q|k|v with adapters in one segmented launch a call (two calls), every site at its reference
    assert r["concat_launches"] == [True, True] and max(r["concat_errs"]) <= 1e-5, r


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and triton")
def test_sites_with_adapters_on_cuda():
    for dtype in (torch.float32, torch.bfloat16):
        mod, merged, x = site(K=4096, N=1024, r=16, dtype=dtype)
        mod, merged, x = mod.cuda(), merged.cuda(), x.cuda()
        close(mod(x).cpu(), lora_gemv_ref(x, mod.w_t, mod.threshold, *mod.lora, mod.bias).cpu(), dtype,
              f"cuda {dtype}")
        xs = torch.cat([x, -x.flip(-1)])
        rows = mod(xs[:, None])
        for i in range(2):
            close(rows[i].cpu(), mod(xs[i:i + 1]).cpu(), dtype, "rows")
