"""The input-sparse GEMV kernel against float64 and its masked reference (ByteCross §3.2, App. A).

Tolerances are twice the error of a same-precision PyTorch product of the masked
input, plus a small floor. The Triton kernel runs on CPU under TRITON_INTERPRET=1
in a subprocess (the interpreter is chosen when @triton.jit runs, at import), is
compiled for sm_90 to check that the weight loads are predicated 16-byte vectors
(a masked row issues no load), and runs on CUDA when there is one.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F
from _compare import mismatch

from interpreted import run_interpreted
from sparsedecode.errors import InputError
from sparsedecode.kernels import common
from sparsedecode.kernels.options import GemvOptions
from sparsedecode.kernels.sparse_gemv import (
    default_config,
    keep_mask,
    sparse_gemv,
    sparse_gemv_ref,
    sparse_gemv_segments_ref,
    sumsq,
    workspace,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
KEEPS = [0.05, 0.3, 0.5, 1.0]
HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()


def make(K, N, dtype, device="cpu", seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, K, generator=gen)  # (1, K): one token
    w_t = torch.randn(K, N, generator=gen) / math.sqrt(K)  # (K, N), the weight transposed
    b = torch.randn(N, generator=gen) if bias else None  # (N,)
    return (x.to(device, dtype), w_t.to(device, dtype), None if b is None else b.to(device, dtype))


def threshold_for(x, keep: float) -> float:
    """The |x| quantile that keeps about `keep` of the channels; keep 1.0 gives 0.0."""
    return 0.0 if keep >= 1.0 else float(x.float().abs().quantile(1.0 - keep))


def exact(x, w_t, t, b):
    """(y float64 (1, N), same-precision y) of the masked product."""
    keep = keep_mask(x, t)
    y64 = torch.where(keep, x.double(), 0.0) @ w_t.double()  # (1, N)
    same = torch.where(keep, x, torch.zeros_like(x)) @ w_t  # (1, N) in x's dtype
    if b is not None:
        y64, same = y64 + b.double(), same + b
    return y64, same


def check(got, x, w_t, t, b, what, slack: float = 0.0) -> list[str]:
    """Failure messages (possibly none) of one product against float64; `slack` (relative to
    the largest output) widens the tolerance."""
    y64, same = exact(x.cpu(), w_t.cpu(), t if not isinstance(t, torch.Tensor) else t.cpu(),
                      None if b is None else b.cpu())
    tol = 2 * (same.double() - y64).abs().max().item() + FLOOR[x.dtype] + slack * y64.abs().max().item()
    fails = [] if got.dtype == x.dtype and got.shape == x.shape[:-1] + (w_t.shape[1],) else [
        f"{what}: got {got.dtype} {tuple(got.shape)}, want {x.dtype} {tuple(x.shape[:-1]) + (w_t.shape[1],)}"
    ]
    return fails + [m for m in [mismatch(got, y64, tol, what)] if m]


# ---- the masked reference on CPU --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K,N", [(13, 7), (577, 1537)])
@pytest.mark.parametrize("keep", KEEPS)
def test_reference_matches_float64(keep, K, N, dtype):
    x, w_t, b = make(K, N, dtype, seed=K + int(keep * 100))
    t = threshold_for(x, keep)
    for bias in (b, None):
        fails = check(sparse_gemv_ref(x, w_t, t, bias), x, w_t, t, bias, f"ref keep={keep} {K}x{N} {dtype}")
        assert not fails, "\n".join(fails)
    kept = keep_mask(x, t).float().mean().item()
    assert abs(kept - keep) <= 1.5 / K + 1e-9, f"quantile threshold keeps {kept}, wanted {keep}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_threshold_zero_is_dense_and_all_dropped_is_bias(dtype):
    x, w_t, b = make(577, 1537, dtype, seed=1)
    dense = F.linear(x.double(), w_t.double().t(), b.double())  # (1, N)
    fails = check(sparse_gemv_ref(x, w_t, 0.0, b), x, w_t, 0.0, b, f"threshold 0 {dtype}")
    fails += [m for m in [mismatch(exact(x, w_t, 0.0, b)[0], dense, 1e-9, "threshold 0 vs dense")] if m]
    assert not fails, "\n".join(fails)
    assert torch.equal(sparse_gemv_ref(x, w_t, math.inf, b), b.reshape(1, -1))
    assert torch.equal(sparse_gemv_ref(x, w_t, torch.tensor(1e30), None), torch.zeros_like(b).reshape(1, -1))


def test_bad_input_raises_clear_errors():
    x, w_t, b = make(16, 8, torch.float32)
    with pytest.raises(InputError, match="one token"):
        sparse_gemv_ref(torch.cat([x, x]), w_t, 0.1)
    with pytest.raises(InputError, match="does not end in K=16"):
        sparse_gemv_ref(x[:, :15], w_t, 0.1)
    with pytest.raises(InputError, match="one dtype"):
        sparse_gemv_ref(x.half(), w_t, 0.1)
    with pytest.raises(InputError, match="float16, bfloat16 or float32"):
        sparse_gemv_ref(x.double(), w_t.double(), 0.1)
    with pytest.raises(InputError, match="bias must be"):
        sparse_gemv_ref(x, w_t, 0.1, b[:3])
    with pytest.raises(InputError, match="1-element float tensor"):
        sparse_gemv_ref(x, w_t, torch.tensor([1, 2]))
    with pytest.raises(InputError, match="w_t"):
        sparse_gemv_ref(x, w_t[None], 0.1)
    if HAS_TRITON:
        with pytest.raises(InputError, match="up must match the gate"):
            sparse_gemv(x, w_t, 0.1, up=x[:, :8])
    if HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        with pytest.raises(InputError, match="masked reference"):
            sparse_gemv(x, w_t, 0.1)


def _h200(monkeypatch, name="NVIDIA H200"):
    """A mocked 132-SM GPU named `name` for default_config (no GPU needed)."""
    monkeypatch.setattr(common, "sm_count", lambda index: 132)
    monkeypatch.setattr(common, "device_name", lambda index: name)
    return torch.device("cuda", 0)


def test_default_config_fills_an_h200_in_one_wave(monkeypatch):
    """At Llama-3.1-8B MLP shapes: one-warp programs over 512-byte row segments, close to
    programs_per_sm per SM of 132 and never more (all resident at once), no empty split."""
    import sparsedecode.kernels.sparse_gemv as sg

    dev = _h200(monkeypatch)
    per_sm = GemvOptions().programs_per_sm
    for K, N in ((4096, 14336), (14336, 4096)):
        block_n, block_k, splits, warps, stages = default_config(K, N, torch.bfloat16, dev)
        programs = -(-N // block_n) * splits
        assert warps == 1 and block_n * 2 == 512 and stages == 4, (K, N, block_n)
        assert 0.75 * per_sm * 132 <= programs <= per_sm * 132, (K, N, splits)
        assert (splits - 1) * common.rows_per_split(K, block_k, splits) < K
        regs = sg.max_registers(programs, warps, dev)
        assert regs == 128 and (65536 // (regs * 32 * warps)) * 132 >= programs, (K, N, regs)
        # programs_per_sm (GemvOptions) sets the split count of the rule
        one = default_config(K, N, torch.bfloat16, dev, programs_per_sm=1)
        assert one[2] < splits and one[:2] == (block_n, block_k), (one, splits)
    assert default_config(13, 7, torch.float16, torch.device("cpu"))[:2] == (16, 16)


def test_tuned_table_is_data_per_device(monkeypatch):
    """kernels/tuned/NVIDIA_H200.json loads; a shape in it returns its config on an H200 (whatever
    programs_per_sm), the rule on another GPU, for another dtype, or another SM count."""
    import sparsedecode.kernels.sparse_gemv as sg

    path = sg.tuned_file("NVIDIA H200")
    assert path.name == "NVIDIA_H200.json" and path.exists(), path
    assert sg.tuned_file("NVIDIA A100-SXM4-80GB").name == "NVIDIA_A100_SXM4_80GB.json"
    text = json.loads(path.read_text())
    assert text["source"] and "benchmarks/records/h200/" in text["source"]
    table = sg.read_tuned(path)
    assert table == sg.tuned_configs("NVIDIA H200") and len(table) == len(text["rows"]) >= 2
    assert all(len(cfg) == 5 and cfg[4] in sg.STAGES for cfg in table.values()), table
    h200 = _h200(monkeypatch)
    for (K, N, dtype, sms), cfg in table.items():
        assert sms == 132
        dt = getattr(torch, dtype)
        assert default_config(K, N, dt, h200) == cfg
        assert default_config(K, N, dt, h200, programs_per_sm=1) == cfg
    # the built-in H200 picks for o and the fused q|k|v: stages 4 at 64 splits (bf16 only)
    for N in (4096, 6144):
        assert default_config(4096, N, torch.bfloat16, h200) == (256, 16, 64, 1, 4)
        rule = default_config(4096, N, torch.float16, h200)
        assert rule[4] == 4 and rule[2] != 64, rule
    other = _h200(monkeypatch, "NVIDIA A100-SXM4-80GB")
    assert sg.tuned_configs("NVIDIA A100-SXM4-80GB") == {}
    rule = default_config(4096, 4096, torch.bfloat16, other)
    assert rule != (256, 16, 64, 1, 4) and rule[3:] == (1, 4), rule
    h200 = _h200(monkeypatch)
    monkeypatch.setattr(common, "sm_count", lambda index: 114)  # an H200 of fewer SMs: not the table's
    assert default_config(4096, 4096, torch.bfloat16, h200) != (256, 16, 64, 1, 4)


def test_decision_log_links_resolve():
    """Every `docs/kernels/sparse_gemv.md#row` the kernels and projections cite is a row of the log."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    log = (root / "docs/kernels/sparse_gemv.md").read_text()
    rows = set(re.findall(r'<a id="([\w-]+)"></a>', log))
    cited = set()
    for path in [*(root / "src/sparsedecode/kernels").glob("*.py"), *(root / "src/sparsedecode/projection").glob("*.py")]:
        for m in re.finditer(r"docs/kernels/sparse_gemv\.md((?:#[\w-]+)(?:, #[\w-]+)*)", path.read_text()):
            cited |= {(path.name, a) for a in re.findall(r"#([\w-]+)", m.group(1))}
    assert cited and not {a for _, a in cited} - rows, sorted(c for c in cited if c[1] not in rows)


def test_register_cap_keeps_the_default_grid_in_one_wave(monkeypatch):
    """The cap lets every program of the default grid be resident at once on a 132-SM GPU."""
    from sparsedecode.kernels import sparse_gemv as sg

    dev = _h200(monkeypatch)
    for K, N in ((4096, 14336), (14336, 4096), (4096, 28672), (4096, 6144), (4096, 4096)):
        block_n, block_k, splits, warps, stages = default_config(K, N, torch.bfloat16, dev)
        programs = -(-N // block_n) * splits
        regs = sg.max_registers(programs, warps, dev)
        assert (regs % 8 == 0 or regs == 255) and 32 <= regs <= 255  # 255: the hardware's most
        assert (65536 // (regs * 32 * warps)) * 132 >= programs, (K, N, regs, programs)
    assert sg.max_registers(132 * 16, 1, dev) == 128  # 16 one-warp programs per SM
    assert sg.max_registers(132 * 6, 2, dev) == 168  # 6 two-warp programs per SM
    assert sg.max_registers(10, 1, dev) == 255  # a small grid: the hardware limit


# ---- the Triton kernel under TRITON_INTERPRET=1 (subprocess) ----------------------------------


def _interpreter_worker() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: kernel vs float64 and the masked reference.

    The interpreter casts float32 to bfloat16 by truncation where the GPU rounds to nearest,
    so bfloat16 outputs get one more unit in the last place of slack here.
    """
    fails, n = [], 0
    slack = {torch.bfloat16: 2.0**-7}
    # Odd shapes (K=577: the last split ends in a partial BLOCK_K tile; N=385: the last BLOCK_N
    # tile is partial), then gate/up-like and down-like stand-ins. N stays small: the
    # interpreter's time grows with the programs it runs (tiles x splits x rows).
    shapes = [(13, 7), (577, 385), (256, 896), (896, 256)]
    for dtype in DTYPES:
        for K, N in shapes:
            x, w_t, b = make(K, N, dtype, seed=K * 7 + N)
            ws = workspace(N, x.device)
            for i, keep in enumerate(KEEPS):
                t = threshold_for(x, keep)
                thr = torch.tensor(t) if i % 2 else t  # float and tensor thresholds
                bias = b if i != 1 else None
                what = f"kernel {dtype} {K}x{N} keep={keep} bias={bias is not None}"
                y = sparse_gemv(x, w_t, thr, bias, ws=ws if i < 2 else None)
                fails += check(y, x, w_t, t, bias, what, slack.get(dtype, 0.0))
                ref = sparse_gemv_ref(x, w_t, thr, bias)
                ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10 if dtype == torch.float16 else 20)
                tol = 2 * ulp * ref.abs().max().item() + FLOOR[dtype]
                fails += [m for m in [mismatch(y, ref, tol, what + " vs sparse_gemv_ref")] if m]
                n += 1
            if ws[0].abs().sum() != 0 or ws[1].abs().sum() != 0:
                fails.append(f"{dtype} {K}x{N}: the workspace is not back at zero after the calls")
    x, w_t, b = make(577, 139, torch.bfloat16, seed=3)  # 3 tiles of BLOCK_N=64, the last of 11 columns
    for splits in (1, 2, 19):  # a single split, two, and more splits than rows of BLOCK_K
        # 4: two tiles in flight; 4 warps: the exchange finish (19 splits: splits whose rows are all dropped)
        for stages, block_k, warps in ((1, 16, 4), (1, 8, 1), (4, 16, 4), (4, 8, 1), (4, 4, 1)):
            y = sparse_gemv(x, w_t, threshold_for(x, 0.3), b, config=(64, block_k, splits, warps, stages))
            fails += check(y, x, w_t, threshold_for(x, 0.3), b,
                           f"kernel splits={splits} stages={stages} BLOCK_K={block_k} warps={warps}", 2.0**-7)
            n += 1
    fails += _loop_cases()
    n += 3
    fails += _segment_cases()
    n += 12
    fails += _swiglu_cases()
    n += 16
    fails += _finish_cases()
    n += 12
    # PDL is a launch attribute of CUDA launches only: off and on give the same numbers here
    outs = []
    for pdl in (False, True):
        opts = GemvOptions(pdl=pdl)
        y = sparse_gemv(x, w_t, threshold_for(x, 0.5), b, options=opts)
        outs.append((y, *sparse_gemv(x, w_t, threshold_for(x, 0.5), None, residual=y, options=opts)))
    if not all(torch.equal(off, on) for off, on in zip(*outs, strict=True)):
        fails.append("pdl=False and pdl=True differ under the interpreter")
    n += 1
    dense = F.linear(x, w_t.t(), b)
    fails += [m for m in [mismatch(sparse_gemv(x, w_t, 0.0, b), dense, 0.05, "threshold 0 vs F.linear")] if m]
    y = sparse_gemv(x, w_t, math.inf, b)
    fails += [] if torch.equal(y, b.reshape(1, -1)) else ["all channels dropped must give the bias exactly"]
    traced = torch.compile(lambda x, w, t, b: sparse_gemv(x, w, t, b), backend="aot_eager", fullgraph=True)
    t = torch.tensor(threshold_for(x, 0.5))
    fails += check(traced(x, w_t, t, b), x, w_t, t, b, "kernel under torch.compile(fullgraph=True)", 2.0**-7)
    print(json.dumps({"cases": n + 3, "fails": fails}))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_under_interpreter():
    report = run_interpreted(__file__, "_interpreter_worker")
    assert report["cases"] >= 50 and not report["fails"], "\n".join(report["fails"])


def _compile_for_hopper(dtype, block_n, block_k, even_n, dbuf=False, pdl=False, glu=False, bits=False,
                        stride=0, lora=False, prefetch=True):
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        pytest.skip(f"triton's compiler API is not available: {e}")
    from sparsedecode.kernels import sparse_gemv as sg
    from sparsedecode.kernels.sm90 import compile_sparse_gemv

    n = block_n * 8 + (0 if even_n else 1)  # EVEN_N as the launcher derives it
    consts = sg.launch_constexprs(n, block_n, block_k, 1, 4 if dbuf else 1, bits=bits, stride=stride, has_bias=True,
                                  pdl=pdl, glu=glu, lora=lora, rank=16, lora_prefetch=prefetch)  # one warp
    try:
        return compile_sparse_gemv(dtype, consts)
    except (RuntimeError, FileNotFoundError) as e:
        if "ptxas" in str(e).lower():
            pytest.skip(f"no ptxas for sm_90: {e}")
        raise


def _weight_loads(ptx: str) -> list[tuple[str, str]]:
    """(predicate, qualifiers) of each 16-byte vector global load in `ptx` but the split-K
    finish's reads of the L2 workspace (`.cg`): the weight loads."""
    loads = re.findall(r"^\s*(@%p\d+ )?ld\.global((?:\.\w+)*)\.v4\.b32", ptx, re.M)
    return [m for m in loads if ".cg" not in m[1]]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weight_loads_are_predicated_vectors_on_hopper(dtype):
    """Compile for sm_90 (no GPU needed): every weight load is one predicated 16-byte vector.

    A lane whose row is dropped has its predicate off and issues no load, and a row
    segment of one warp is 512 bytes, so a dropped channel skips
    whole 128-byte lines rather than a few bytes of each.
    """
    from sparsedecode.kernels.sparse_gemv import ROW_BYTES

    elem = torch.empty((), dtype=dtype).element_size()
    block_n, block_k = ROW_BYTES // elem, 32
    ptx = _compile_for_hopper(dtype, block_n, block_k, even_n=True).asm["ptx"]
    vec = _weight_loads(ptx)
    assert vec and all(p for p, *_ in vec), "weight loads must be predicated ld.global.v4"
    per_thread = block_k * block_n * elem // 16 // 32  # 16-byte vectors per thread and tile
    assert len(vec) == per_thread, f"{len(vec)} vector loads per iteration, expected {per_thread}"
    assert "atom.global.gpu.acq_rel.add" in ptx, "the arrival count must be an acq_rel atomic"
    # one warp: the sum read by loads, no atomic exchange left
    assert re.search(r"ld\.global\.cg(\.\w+)*\.v4", ptx) and ".exch." not in ptx, "finish: loads and stores"
    # stages 4 (the weight's row stride compiled in): the prologue's tile and the loop's, each as
    # predicated vectors, and in the loop the next tile's loads come before the sum of the current one
    n_cols = 14336
    ptx4 = _compile_for_hopper(dtype, block_n, block_k, even_n=True, dbuf=True, stride=n_cols).asm["ptx"]
    vec4 = _weight_loads(ptx4)
    assert len(vec4) == 2 * per_thread and all(p for p, *_ in vec4)
    loop = ptx4[ptx4.index("$L__BB0_2:"):]
    loop = loop[:loop.index("bra")]
    assert loop.index(".v4.b32") < loop.index("fma"), "stages 4 must issue tile i + 1 before summing tile i"
    # the fp32 partial adds: red.global (Triton 3.9) or a relaxed vector atom (Triton 3.6)
    assert re.search(r"red\.global|atom\.global\.gpu\.relaxed\.add(\.v\d)?\.f32", ptx), "no fp32 atomic partial add"
    # PDL: the grid-dependency wait comes before the first global load
    pdl = _compile_for_hopper(dtype, block_n, block_k, even_n=True, dbuf=True, pdl=True, stride=n_cols).asm["ptx"]
    assert "griddepcontrol.wait" in pdl and pdl.index("griddepcontrol.wait") < pdl.index("ld.global")
    assert "griddepcontrol" not in ptx4, "without PDL the kernel must not wait on a grid dependency"
    assert "griddepcontrol.launch_dependents" in pdl, "PDL lets the next kernel launch at the start"
    if dtype == torch.bfloat16:  # bf16 pairs: the same predicated vectors, widened by shift and mask
        pairs = _compile_for_hopper(dtype, block_n, block_k, even_n=True, dbuf=True, bits=True,
                                    stride=n_cols).asm["ptx"]
        vecp = _weight_loads(pairs)
        assert len(vecp) == 2 * per_thread and all(p for p, *_ in vecp)
        # only x is converted (8 weights per lane and row in ptx4, one x)
        assert pairs.count("cvt.f32.bf16") * 4 < ptx4.count("cvt.f32.bf16"), "pairs must not convert bf16 weights"
        assert re.search(r"shl\.b32\s+%r\d+, %r\d+, 16", pairs) and "and.b32" in pairs
    # the row stride compiled in: a tile's rows at constant offsets from one address (immediate
    # offsets in sm_90 SASS)
    rows_at = [r * n_cols * elem for r in range(1, block_k)]
    offsets = {int(c) for c in re.findall(r"add\.s64\s+%rd\d+, %rd\d+, (\d+);", ptx4)}
    assert set(rows_at) <= offsets, "rows must be constant offsets of one address"



def _swiglu_cases(device="cpu", dtypes=(torch.float32, torch.float16)) -> list[str]:
    """sparse_gemv(gate, ..., up=up) against the masked reference of silu(gate) * up (the
    interpreter truncates float32 to bfloat16 where PyTorch rounds, so bfloat16 runs on CUDA)."""
    fails = []
    for dtype in dtypes:
        for K, N in ((577, 203), (301, 64)):
            gate, w_t, b = make(K, N, dtype, device=device, seed=K)
            up = make(K, 1, dtype, device=device, seed=K + 1)[0]
            h = F.silu(gate) * up  # eager: silu rounded to dtype, then the product rounded
            t = threshold_for(h, 0.4)
            want = sparse_gemv_ref(h, w_t, t, b)
            ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10 if dtype == torch.float16 else 20)
            for config in (None, (64, 16, 3, 1, 4), (64, 8, 2, 1, 1), (64, 4, 3, 1, 4)):
                got = sparse_gemv(gate, w_t, torch.tensor(t, device=device), b, config=config, up=up)
                fails += [m for m in [mismatch(got, want, 2 * ulp * want.abs().max().item() + FLOOR[dtype],
                                               f"swiglu {dtype} {K}x{N} config={config}")] if m]
            # down in the fused layer: silu(gate) * up formed in the load and the residual added
            res = make(N, 1, dtype, device=device, seed=N)[0]
            want_r = want + res  # eager rounds the projection, then the sum
            for config in ((64, 16, 3, 1, 4), (64, 8, 2, 1, 4)):
                got, ss = sparse_gemv(gate, w_t, torch.tensor(t, device=device), b, config=config, up=up,
                                      residual=res)
                what = f"swiglu+residual {dtype} {K}x{N} config={config}"
                fails += [m for m in [mismatch(got, want_r, 2 * ulp * want_r.abs().max().item() + FLOOR[dtype],
                                               what)] if m]
                sq = got.float().pow(2).sum()
                if abs(ss.sum().item() - sq.item()) > 1e-4 * sq.item():
                    fails.append(f"{what}: tile sums of squares add up to {ss.sum().item()}, not {sq.item()}")
    return fails


def _norm_cases(device="cpu", dtypes=(torch.float32, torch.float16), warps=1) -> list[str]:
    """The fused RMSNorm of a decoder layer: a producer call with residual= returns residual +
    its output (rounded as eager rounds proj, then the sum) and per-tile sums of squares that
    add up to the new stream's; a consumer call with norm= equals the masked reference on
    rms_norm of that stream, single and segmented (on and off the BLOCK_N grid), on stages 1
    and 4; the embedding's stream through `sumsq`. bfloat16 runs on CUDA (the interpreter
    truncates where PyTorch rounds). warps: every config's num_warps times this."""
    from sparsedecode.kernels.sparse_gemv import sparse_gemv as _sparse_gemv
    from sparsedecode.kernels.sparse_gemv import sparse_gemv_segments_ref, sumsq
    from sparsedecode.models.decoder import rms_norm

    def sparse_gemv(*args, config=None, **kw):
        config = config if config is None else (*config[:3], config[3] * warps, config[4])
        return _sparse_gemv(*args, config=config, **kw)

    fails = []
    for dtype in dtypes:
        ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10 if dtype == torch.float16 else 20)
        x, w_t, b = make(301, 200, dtype, device=device, seed=5)  # the producer: 4 tiles of 64, the last short
        res = make(200, 1, dtype, device=device, seed=6)[0]
        t = threshold_for(x, 0.4)
        want = sparse_gemv_ref(x, w_t, t, b) + res  # eager: the projection rounded, then the sum
        for config in ((64, 16, 3, 1, 4), (64, 8, 5, 1, 4), (64, 16, 2, 1, 1)):
            y, ss = sparse_gemv(x, w_t, torch.tensor(t, device=device), b, config=config, residual=res)
            what = f"residual {dtype} config={config}"
            fails += [m for m in [mismatch(y, want, 2 * ulp * want.abs().max().item() + FLOOR[dtype], what)] if m]
            total = y.float().pow(2).sum().item()
            if ss.numel() != 4 or abs(ss.sum().item() - total) > 1e-5 * total:
                fails.append(f"{what}: tile sums of squares {ss.tolist()} do not add up to {total}")
        nw = (1.0 + 0.3 * make(200, 1, torch.float32, seed=7)[0].reshape(200)).to(device, dtype)
        h = rms_norm(y, nw, 1e-5)
        w2, b2 = make(200, 72, dtype, device=device, seed=8)[1:]
        for keep in (0.3, 1.0):
            t2 = threshold_for(h, keep)
            want2 = sparse_gemv_ref(h, w2, t2, b2)
            tol = 2 * ulp * want2.abs().max().item() + FLOOR[dtype]
            for config in ((32, 16, 3, 1, 4), (32, 8, 4, 1, 4), (16, 16, 2, 1, 4), (32, 16, 3, 1, 1), None):
                for partials in ("tiles", "sumsq"):
                    got = sparse_gemv(y, w2, torch.tensor(t2, device=device), b2, config=config,
                                      norm=(nw, ss if partials == "tiles" else sumsq(y), 1e-5))
                    fails += [m for m in [mismatch(got, want2, tol, f"norm {dtype} keep={keep} {config} {partials}")]
                              if m]
        widths = [96, 64, 40]  # q|k|v-like: off the 64 grid at 160, on the 32 grid
        w3 = make(200, sum(widths), dtype, device=device, seed=9)[1]
        thr = [torch.tensor(threshold_for(h, k), device=device) for k in (0.2, 0.5, 1.0)]
        want3 = sparse_gemv_segments_ref(h, w3, thr, widths)
        for block_n in (32, 64):
            got = sparse_gemv(y, w3, thr, segments=widths, config=(block_n, 16, 3, 1, 4), norm=(nw, ss, 1e-5))
            fails += [m for m in [mismatch(got, want3, 2 * ulp * want3.abs().max().item() + FLOOR[dtype],
                                           f"norm segments {dtype} BLOCK_N={block_n}")] if m]
    # a layer's chain (residual, then norm) under torch.compile: the op's fake shapes its two outputs
    chain = torch.compile(lambda x, r, nw: sparse_gemv(y, w2, 0.0, norm=(nw, sparse_gemv(x, w_t, 0.0, residual=r)[1],
                                                                         1e-5)), backend="aot_eager", fullgraph=True)
    want4 = sparse_gemv(y, w2, 0.0, norm=(nw, sparse_gemv(x, w_t, 0.0, residual=res)[1], 1e-5))
    fails += [m for m in [mismatch(chain(x, res, nw), want4, 2 * ulp * want4.abs().max().item() + FLOOR[dtype],
                                   "residual then norm under torch.compile(fullgraph=True)")] if m]
    for bad, needle in (((nw.double(), ss, 1e-5), "norm weight"), ((nw, ss.double(), 1e-5), "sums of squares")):
        try:
            sparse_gemv(y, w2, 0.1, norm=bad)
            fails.append(f"a bad norm= ({needle}) must raise")
        except InputError as e:
            fails += [] if needle in str(e) else [f"bad norm= ({needle}): unclear error {e}"]
    try:
        sparse_gemv(y, w2, 0.1, config=(32, 16, 3, 1, 8), norm=(nw, ss, 1e-5))
        fails.append("stages 8 (removed) must be refused")
    except InputError as e:
        fails += [] if "removed" in str(e) else [f"stages 8: unclear error {e}"]
    return fails


def _norm_worker() -> None:
    """`_norm_cases` under TRITON_INTERPRET=1 (a subprocess)."""
    print(json.dumps({"fails": _norm_cases()}))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_norm_and_residual_under_interpreter():
    report = run_interpreted(__file__, "_norm_worker")
    assert not report["fails"], "\n".join(report["fails"])


def _finish_cases(device="cpu") -> list[str]:
    """The split-K finish of one-warp programs (the sum read by loads, the count reset by a store)
    gives what the atomic exchanges of multi-warp programs give (bit for bit under the interpreter,
    where the warps change nothing else) and both leave the workspace at zero: the two loops, one
    split and several, with a bias, and with a residual (the fused layer's o and down)."""
    fails = []
    x, w_t, b = make(577, 139, torch.bfloat16, device=device, seed=31)
    res = torch.randn(1, 139, generator=torch.Generator().manual_seed(32)).to(device, torch.bfloat16)
    t = threshold_for(x, 0.3)
    for stages, splits in ((1, 1), (1, 5), (4, 3), (4, 19), (4, 1), (1, 4)):
        for resid in (False, True):
            kwargs = {"residual": res} if resid else {}
            bias = None if resid else b
            ws = workspace(139, x.device)
            want = sparse_gemv(x, w_t, t, bias, ws=ws, config=(64, 16, splits, 2, stages), **kwargs)
            got = sparse_gemv(x, w_t, t, bias, ws=ws, config=(64, 16, splits, 1, stages), **kwargs)
            want, got = (want[0], got[0]) if resid else (want, got)
            what = f"finish stages={stages} splits={splits} residual={resid}"
            tol = 0.0 if device == "cpu" else 2 * 2.0**-7 * want.float().abs().max().item()  # CUDA: add order
            fails += [m for m in [mismatch(got, want, tol, what)] if m]
            if ws[0].abs().sum().item() or ws[1].abs().sum().item():
                fails.append(f"{what}: the workspace is not back at zero")
    return fails


def _loop_cases(device="cpu") -> list[str]:
    """Stages 4 (two tiles in flight, the row stride compiled in, bf16 read as int32 pairs where
    N and the stride are even) gives what the plain loop gives (bit for bit under the interpreter;
    on CUDA, where the order of the splits' atomic adds varies, within rounding): plain, SwiGLU and
    normed inputs, a residual output, aligned segments, a strided column slice, partial last
    splits and tiles, every row dropped, and the dtypes."""
    fails = []
    shapes = ((301, 130, (64, 16, 5, 1, 4)), (100, 40, (32, 8, 7, 1, 4))) if device == "cpu" else (
        (301, 130, (64, 16, 5, 1, 4)), (577, 203, (64, 8, 19, 1, 4)), (4096, 14336, None), (14336, 4096, None))
    for dtype in DTYPES:
        for K, N, config in shapes:
            x, w_t, b = make(K, N, dtype, device=device, seed=K + 11)
            t = torch.tensor(threshold_for(x, 0.3), device=device)
            calls = [("keep=0.3", (x, w_t, t, b), {})]
            if dtype == torch.bfloat16 or device != "cpu":
                up = make(K, 1, dtype, device=device, seed=K + 12)[0].reshape(x.shape)
                res = make(N, 1, dtype, device=device, seed=K + 13)[0].reshape(1, N)
                nw = (1.0 + 0.3 * make(K, 1, torch.float32, seed=K + 14)[0].reshape(K)).to(device, dtype)
                half = 64 if N >= 128 else 16
                calls += [("keep=1", (x, w_t, torch.tensor(0.0, device=device), b), {}),
                          ("all dropped", (x, w_t, math.inf, b), {}),
                          ("swiglu", (x, w_t, t, b), dict(up=up)),
                          ("residual", (x, w_t, t, b), dict(residual=res)),
                          ("norm", (x, w_t, t, None), dict(norm=(nw, sumsq(x), 1e-5))),
                          ("segments", (x, w_t, [t, torch.tensor(threshold_for(x, 0.7), device=device)], b),
                           dict(segments=[half, N - half])),
                          ("strided slice", (x, w_t[:, 8:8 + N // 2], t, None), {})]
            for what, args, kwargs in calls:
                cfg = config or default_config(K, args[1].shape[1], dtype, x.device)
                cfg = (16, *cfg[1:]) if what == "strided slice" and config else cfg
                want = sparse_gemv(*args, config=(*cfg[:4], 1), **kwargs)
                got = sparse_gemv(*args, config=cfg, **kwargs)
                pairs = list(zip(got, want, strict=True)) if isinstance(got, tuple) else [(got, want)]
                if device == "cpu":  # the interpreter runs the splits in order: the same sums, bit for bit
                    if not all(torch.equal(g, w) for g, w in pairs):
                        fails.append(f"stages 4 {dtype} {K}x{N} {cfg} {what}: differs from the plain loop")
                else:  # the splits' fp32 atomic adds land in any order
                    ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10 if dtype == torch.float16 else 20)
                    for g, w in pairs:
                        tol = 2 * ulp * w.float().abs().max().item() + FLOOR[dtype]
                        fails += [m for m in [mismatch(g, w, tol, f"stages 4 {dtype} {K}x{N} {what}")] if m]
    return fails


def _segment_cases(device="cpu") -> list[str]:
    """Column slices of a concatenated weight (row stride > N) and segmented calls, each block
    with its own threshold: block bounds on and off the BLOCK_N grid, 2 and 3 blocks."""
    fails = []
    for dtype, widths, block_n in ((torch.bfloat16, [64, 32, 32], 32), (torch.float16, [40, 27, 30], 16),
                                   (torch.float32, [96, 160], 32)):
        K, N = 301, sum(widths)
        x, w_t, b = make(K, N, dtype, device=device, seed=N)
        thr = [torch.tensor(threshold_for(x, keep), device=device) for keep in (0.2, 0.7, 1.0)[:len(widths)]]
        slack = 2.0**-7 if dtype == torch.bfloat16 else 0.0
        want = sparse_gemv_segments_ref(x, w_t, thr, widths, b)
        ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10 if dtype == torch.float16 else 20)
        what = f"segments {widths} {dtype} BLOCK_N={block_n}"
        for stages in (1, 4):  # stages 4 falls back to the plain loop off the tile grid
            y = sparse_gemv(x, w_t, thr, b, segments=widths, config=(block_n, 16, 5, 1, stages))
            fails += [m for m in [mismatch(y, want, 2 * ulp * want.abs().max().item() + FLOOR[dtype],
                                           f"{what} stages={stages}")] if m]
        lo = widths[0]  # the middle block alone, as a strided column slice
        view = w_t[:, lo:lo + widths[1]]
        y = sparse_gemv(x, view, thr[1], None, config=(block_n, 16, 3, 1, 1))
        fails += check(y, x, view, thr[1], None, what + " strided slice", slack)
    return fails


# ---- CUDA ---------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA or not HAS_TRITON, reason="needs a CUDA GPU and triton")


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K,N", [(13, 7), (577, 1537), (4096, 14336), (14336, 4096)])
@pytest.mark.parametrize("keep", KEEPS)
def test_kernel_on_cuda(keep, K, N, dtype):
    x, w_t, b = make(K, N, dtype, device="cuda", seed=K + N)
    t = threshold_for(x, keep)
    ws = workspace(N, "cuda")
    for thr in (t, torch.tensor(t, device="cuda")):
        y = sparse_gemv(x, w_t, thr, b, ws=ws)
        fails = check(y, x, w_t, t, b, f"cuda kernel {K}x{N} keep={keep} {dtype}")
        assert not fails, "\n".join(fails)
    assert ws[0].abs().sum().item() == 0 and ws[1].abs().sum().item() == 0


@gpu
@pytest.mark.parametrize("config", [(256, 8, 37, 1, 4), (512, 4, 20, 1, 4), (256, 16, 37, 1, 4),
                                    (256, 16, 37, 1, 1), (2048, 16, 37, 8, 4), (1024, 16, 37, 4, 4)], ids=str)
def test_loop_configs_on_cuda(config):
    """Stages 4 (bf16 read as int32 pairs where it applies) and the plain loop, one warp and
    several, against float64 on the issue's shapes, and in a graph whose threshold moves."""
    fails = []
    for dtype in (torch.bfloat16, torch.float16):
        for K, N in ((577, 1537), (4096, 14336), (14336, 4096)):
            x, w_t, b = make(K, N, dtype, device="cuda", seed=K + N + 1)
            ws = workspace(N, "cuda")
            for keep in (0.05, 0.3, 0.5, 1.0):
                t = threshold_for(x, keep)
                y = sparse_gemv(x, w_t, torch.tensor(t, device="cuda"), b, ws=ws, config=config)
                fails += check(y, x, w_t, t, b, f"{config} {K}x{N} keep={keep} {dtype}")
            if ws[0].abs().sum().item() or ws[1].abs().sum().item():
                fails.append(f"{config} {K}x{N}: the workspace is not back at zero")
    x, w_t, b = make(4096, 14336, torch.bfloat16, device="cuda", seed=4)
    thr, ws = torch.tensor(0.0, device="cuda"), workspace(14336, "cuda")
    sparse_gemv(x, w_t, thr, b, ws=ws, config=config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sparse_gemv(x, w_t, thr, b, ws=ws, config=config)
    for keep in (1.0, 0.3, 0.05, 0.5):
        thr.fill_(threshold_for(x, keep))
        graph.replay()
        torch.cuda.synchronize()
        fails += check(out, x, w_t, threshold_for(x, keep), b, f"{config} graph replay keep={keep}")
    assert not fails, "\n".join(fails)


@gpu
def test_finish_on_cuda():
    fails = _finish_cases(device="cuda")
    # the shapes at the default config, replayed in a graph: the workspace is zero after each
    for K, N in ((4096, 14336), (14336, 4096)):
        x, w_t, b = make(K, N, torch.bfloat16, device="cuda", seed=K + 5)
        ws, t = workspace(N, "cuda"), torch.tensor(threshold_for(x, 0.3), device="cuda")
        sparse_gemv(x, w_t, t, b, ws=ws)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = sparse_gemv(x, w_t, t, b, ws=ws)
        for _ in range(3):
            graph.replay()
            fails += check(out, x, w_t, t.item(), b, f"finish {K}x{N} graph replay")
            if ws[0].abs().sum().item() or ws[1].abs().sum().item():
                fails.append(f"finish {K}x{N}: the workspace is not back at zero after a replay")
    assert not fails, "\n".join(fails)


def test_finish_mode_is_one_warp_only():
    """The cheaper split-K finish reaches the kernel for one-warp programs only; programs of
    several warps keep the atomic exchanges (a two-warp config returned wrong sums with it)."""
    assert common.finish_mode(1) == "load"
    assert common.finish_mode(2) == common.finish_mode(8) == "xchg"


@gpu
def test_stages_4_matches_the_plain_loop_on_cuda():
    fails = _loop_cases(device="cuda")
    assert not fails, "\n".join(fails)


@gpu
@pytest.mark.parametrize("num_warps", [1, 8])
def test_fused_norm_and_residual_on_cuda(num_warps):
    """The fused norm and residual on CUDA, also with programs of 8 warps (the residual's sum of
    squares then reduces across warps)."""
    fails = _norm_cases(device="cuda", dtypes=(torch.bfloat16, torch.float16, torch.float32), warps=num_warps)
    assert not fails, "\n".join(fails)


@gpu
def test_kernel_in_cuda_graph_follows_threshold_updates():
    x, w_t, b = make(4096, 14336, torch.bfloat16, device="cuda")
    thr = torch.tensor(0.0, device="cuda")
    ws = workspace(14336, "cuda")
    fn = torch.compile(lambda x, t: sparse_gemv(x, w_t, t, b, ws=ws), fullgraph=True)
    for call in (lambda: sparse_gemv(x, w_t, thr, b, ws=ws), lambda: fn(x, thr)):
        call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for keep in (1.0, 0.5, 0.05, 0.3):
            thr.fill_(threshold_for(x, keep))
            for _ in range(3):  # replays reuse the workspace
                graph.replay()
            torch.cuda.synchronize()
            fails = check(out, x, w_t, threshold_for(x, keep), b, f"graph replay keep={keep}")
            assert not fails, "\n".join(fails)


@gpu
def test_segments_and_strided_slices_on_cuda():
    fails = _segment_cases("cuda")
    assert not fails, "\n".join(fails)


@gpu
def test_compiled_kernel_fits_its_register_cap():
    """ptxas honours the one-wave register budget: the default grid is resident at once."""
    from sparsedecode.kernels import sparse_gemv as sg

    K, N = 4096, 14336
    x, w_t, _ = make(K, N, torch.bfloat16, device="cuda", seed=9, bias=False)
    cfg = default_config(K, N, torch.bfloat16, x.device)
    sg._sparse_gemv_kernel.device_caches.clear()  # only this call's kernel (others may have other caps)
    sparse_gemv(x, w_t, torch.tensor(0.5, device="cuda"), config=cfg)
    cap = sg.max_registers(-(-N // cfg[0]) * cfg[2], cfg[3], x.device)
    regs = [k.n_regs for cache in sg._sparse_gemv_kernel.device_caches.values() for k in cache[0].values()]
    assert regs and max(regs) <= cap, (regs, cap)


@gpu
def test_swiglu_input_and_pdl_chain_on_cuda():
    """silu(gate) * up formed in the load, in every dtype; then a chain of dependent calls
    launched with PDL and captured in a graph gives what the same chain gives without PDL."""
    fails = _swiglu_cases("cuda", DTYPES)
    assert not fails, "\n".join(fails)
    x, w1, _ = make(4096, 14336, torch.bfloat16, device="cuda", seed=5, bias=False)
    w2 = make(14336, 4096, torch.bfloat16, device="cuda", seed=6, bias=False)[1]
    t1, t2 = torch.tensor(0.5, device="cuda"), torch.tensor(0.02, device="cuda")
    ws1, ws2 = workspace(14336, "cuda"), workspace(4096, "cuda")

    def chain(x, options=GemvOptions()):
        for _ in range(3):  # each call reads what the one before wrote
            h = sparse_gemv(x, w1, t1, ws=ws1, options=options)
            x = sparse_gemv(h, w2, t2, ws=ws2, options=options) * 0.05
        return x

    want = chain(x, GemvOptions(pdl=False))  # the reference chain: plain launches (PDL is the default)
    chain(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()
