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


@pytest.mark.parametrize("num_warps", [1, 8])
def test_default_config_fills_an_h200_in_one_wave(num_warps, monkeypatch):
    """At Llama-3.1-8B MLP shapes: programs of NUM_WARPS warps over 512-byte row segments a warp,
    close to PROGRAMS_PER_SM warps per SM of 132 and never more (all resident at once), no empty
    split."""
    import sparsedecode.kernels.sparse_gemv as sg

    monkeypatch.setattr(sg, "_sm_count", lambda index: 132)
    monkeypatch.setattr(sg, "NUM_WARPS", num_warps)
    for K, N in ((4096, 14336), (14336, 4096)):
        block_n, block_k, splits, warps, stages = default_config(K, N, torch.bfloat16, torch.device("cuda", 0))
        programs = -(-N // block_n) * splits
        assert warps == num_warps and block_n * 2 == 512 * warps, (K, N, block_n)
        assert 0.75 * sg.PROGRAMS_PER_SM * 132 <= programs * warps <= sg.PROGRAMS_PER_SM * 132, (K, N, splits)
        assert (splits - 1) * sg._rows_per_split(K, block_k, splits) < K
        regs = sg.max_registers(programs, warps, torch.device("cuda", 0))
        assert regs == 128 and (65536 // (regs * 32 * warps)) * 132 >= programs, (K, N, regs)
    if num_warps > 1:
        return
    assert default_config(13, 7, torch.float16, torch.device("cpu"))[:2] == (16, 16)
    # the built-in H200 picks for o and the fused q|k|v: stages 4 at 64 splits (bf16 only; fp16 by the rule)
    for N in (4096, 6144):
        assert default_config(4096, N, torch.bfloat16, torch.device("cuda", 0)) == (256, 16, 64, 1, 4)
        rule = default_config(4096, N, torch.float16, torch.device("cuda", 0))
        assert rule[4] == sg.NUM_STAGES and rule[2] != 64, rule


def test_register_cap_keeps_the_default_grid_in_one_wave(monkeypatch):
    """The cap lets every program of the default grid be resident at once on a 132-SM GPU."""
    from sparsedecode.kernels import sparse_gemv as sg

    monkeypatch.setattr(sg, "_sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
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
        # 4: two tiles in flight; 8: a kept-row list, two tiles in flight (19 splits: splits whose
        # rows are all dropped, an empty list)
        for stages, block_k in ((1, 16), (1, 8), (4, 16), (4, 8), (8, 16), (8, 8)):
            y = sparse_gemv(x, w_t, threshold_for(x, 0.3), b, config=(64, block_k, splits, 4, stages))
            fails += check(y, x, w_t, threshold_for(x, 0.3), b,
                           f"kernel splits={splits} stages={stages} BLOCK_K={block_k}", 2.0**-7)
            n += 1
    fails += _pairs_cases()
    n += 6
    fails += _stride_const_cases()
    n += 3
    fails += _segment_cases()
    n += 15
    fails += _swiglu_cases()
    n += 16
    fails += _finish_load_cases()
    n += 12
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


def _ablate_worker() -> None:
    """The timing ablations (sparse_gemv.ABLATE) compute what they say, under TRITON_INTERPRET=1:
    without x, the sum of the even rows whatever x and the threshold; without the finish, one
    split's partial (the whole sum when there is one split); with its atomic adds alone, the sum in
    the workspace; fused calls with the x ablation only; bias and stages 8 refused."""
    fails, n = [], 0
    for dtype in (torch.float32, torch.bfloat16):
        x, w_t, _ = make(203, 70, dtype, seed=21)
        t = torch.tensor(threshold_for(x, 0.3))
        even = w_t[::2].float().sum(0, keepdim=True).to(dtype)
        masked = sparse_gemv_ref(x, w_t, t)
        slack = 2.0**-7 if dtype == torch.bfloat16 else 0.0
        for ablate, splits, want, what in ((2, 3, even, "no x"), (1, 1, masked, "no finish, one split"),
                                           (3, 1, even, "neither")):
            for stride in (False, True):
                y = _with_knobs(dict(ABLATE=ablate, ROW_STRIDE_CONST=stride), sparse_gemv, x, w_t, t,
                                config=(32, 16, splits, 1, 4))
                tol = 2 * 2.0**-7 * want.float().abs().max().item() + FLOOR[dtype] + slack
                fails += [m for m in [mismatch(y, want, tol, f"ABLATE={ablate} ({what}) {dtype} stride={stride}")]
                          if m]
                n += 1
    # The decode step's fused calls take the x ablation (their kept rows then follow no ablated input):
    # norm, up and segments on the tile grid ignored, and with the finish gone too a residual call
    # stores its partial and sums of squares of 1.0.
    x, w_t, b = make(64, 64, torch.float32, seed=22)
    t1 = torch.tensor(0.1)
    even = w_t[::2].sum(0, keepdim=True)
    res = make(64, 1, torch.float32, seed=23)[0].reshape(1, 64)
    norm = (1.0 + 0.1 * make(64, 1, torch.float32, seed=24)[0].reshape(64), sumsq(x), 1e-5)
    for ablate, kwargs, thr in ((2, dict(norm=norm), t1), (2, dict(up=x.flip(-1)), t1),
                                (2, dict(segments=[32, 32]), [t1, t1]), (3, dict(residual=res), t1)):
        got = _with_knobs(dict(ABLATE=ablate), sparse_gemv, x, w_t, thr, config=(32, 16, 1, 1, 4), **kwargs)
        y, ss = got if "residual" in kwargs else (got, None)
        what = f"ABLATE={ablate} with {list(kwargs)}"
        fails += [m for m in [mismatch(y, even, 1e-5, what)] if m]
        if ss is not None and not torch.equal(ss, torch.ones(2)):
            fails.append(f"{what}: sums of squares {ss.tolist()}, want [1.0, 1.0]")
        n += 1
    for ablate, kwargs, config in ((1, dict(bias=b), (32, 16, 2, 1, 4)), (1, {}, (32, 8, 2, 1, 8)),
                                   (1, dict(residual=res), (32, 16, 2, 1, 4)), (2, dict(bias=b), (32, 16, 2, 1, 4)),
                                   (1, dict(norm=norm), (32, 16, 2, 1, 4)), (1, dict(up=x), (32, 16, 2, 1, 4))):
        try:
            _with_knobs(dict(ABLATE=ablate), sparse_gemv, x, w_t, 0.1, config=config, **kwargs)
            fails.append(f"ABLATE={ablate} with {list(kwargs) or config} must be refused")
        except InputError as e:
            fails += [] if "timing ablation" in str(e) else [f"ABLATE refusal unclear: {e}"]
        n += 1
    # The finish's atomic adds alone: the sum (of every split) is left in the workspace, fp32
    for ablate, kwargs, want in ((4, {}, sparse_gemv_ref(x, w_t, t1)), (6, dict(residual=res), even)):
        ws = workspace(64, x.device)
        got = _with_knobs(dict(ABLATE=ablate), sparse_gemv, x, w_t, t1, ws=ws, config=(32, 16, 3, 1, 4), **kwargs)
        fails += [m for m in [mismatch(ws[0][None], want, 1e-5, f"ABLATE={ablate} workspace")] if m]
        if "residual" in kwargs and not torch.equal(got[1], torch.ones(2)):
            fails.append(f"ABLATE={ablate}: sums of squares {got[1].tolist()}, want [1.0, 1.0]")
        n += 1
    for ablate in (5, 7):
        try:
            _with_knobs(dict(ABLATE=ablate), sparse_gemv, x, w_t, t1, config=(32, 16, 3, 1, 4))
            fails.append(f"ABLATE={ablate} (bits 1 and 4) must be refused")
        except InputError as e:
            fails += [] if "not together" in str(e) else [f"ABLATE={ablate} refusal unclear: {e}"]
        n += 1
    try:  # segments off the tile grid take another loop, which has no ablation
        _with_knobs(dict(ABLATE=2), sparse_gemv, x, w_t, [t1, t1], config=(32, 16, 1, 1, 4), segments=[20, 44])
        fails.append("ABLATE with segments off the tile grid must be refused")
    except InputError as e:
        fails += [] if "timing ablation" in str(e) else [f"ABLATE refusal unclear: {e}"]
    print(json.dumps({"cases": n + 1, "fails": fails}))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_timing_ablations_under_interpreter():
    report = run_interpreted(__file__, "_ablate_worker")
    assert report["cases"] == 27 and not report["fails"], "\n".join(report["fails"])


def _compile_for_hopper(dtype, block_n, block_k, even_n, dbuf=False, pdl=False, glu=False, evict="", bits=False,
                        stride=0):
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"triton's compiler API is not available: {e}")
    from sparsedecode.kernels import sparse_gemv as sg

    fn = sg._sparse_gemv_kernel
    ty = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    consts = dict(BLOCK_N=block_n, BLOCK_K=block_k, THR_T=True, NSEG=1, SEG_ALIGNED=True, HAS_BIAS=True,
                  EVEN_N=even_n, COMPACT=False, RPS=16, DBUF=dbuf, GLU=glu,
                  EVICT=evict, PDL=pdl, PDL_TRIGGER=True, BITS=bits, COLS=block_n // 2 if bits else block_n,
                  RESID=False, NORM=False, SS_BLOCK=1, STRIDE=stride, ABLATE=0,
                  FIN=sg.finish_mode(sg.NUM_WARPS))  # the split-K finish as launched
    types = dict(X=ty, W=ty, Bias=ty, Y=ty, U=ty, Thr0="*fp32", Thr1="*fp32", Thr2="*fp32", Acc="*fp32",
                 Count="*i32", thr_f="fp32", Scratch="*i32", Res=ty, SsOut="*fp32", SsIn="*fp32", eps="fp32")
    names = fn.arg_names
    sig = {n: types.get(n, "i32") for n in names}
    sig.update({n: "constexpr" for n in consts})
    # what the launcher specialises (torch's allocations are 16-byte aligned; 4096-row splits are whole tiles)
    aligned = [(names.index(n),) for n in ("X", "W", "Y", "Acc", "N", "stride_wk", "stride_w32", "Scratch",
                                           "rows_per_split", "K")]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in consts.items()},
                    attrs={a: [["tt.divisibility", 16]] for a in aligned})
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=sg.NUM_WARPS, num_stages=1))
    except (RuntimeError, FileNotFoundError) as e:
        if "ptxas" in str(e).lower():
            pytest.skip(f"no ptxas for sm_90: {e}")
        raise


def _weight_loads(ptx: str) -> list[tuple[str, str]]:
    """(predicate, qualifiers) of each 16-byte vector global load in `ptx` but the split-K
    finish's reads of the L2 workspace (FINISH_LOAD, `.cg`): the weight loads."""
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
    from sparsedecode.kernels.sparse_gemv import NUM_WARPS, ROW_BYTES

    elem = torch.empty((), dtype=dtype).element_size()
    block_n, block_k = ROW_BYTES * NUM_WARPS // elem, 32
    ptx = _compile_for_hopper(dtype, block_n, block_k, even_n=True).asm["ptx"]
    vec = _weight_loads(ptx)
    assert vec and all(p for p, *_ in vec), "weight loads must be predicated ld.global.v4"
    per_thread = block_k * block_n * elem // 16 // (NUM_WARPS * 32)  # 16-byte vectors per thread and tile
    assert len(vec) == per_thread, f"{len(vec)} vector loads per iteration, expected {per_thread}"
    assert "atom.global.gpu.acq_rel.add" in ptx, "the arrival count must be an acq_rel atomic"
    from sparsedecode.kernels import sparse_gemv as sg

    if sg.FINISH_LOAD and sg.RESET_STORE:  # the defaults: the sum read by loads, no atomic exchange left
        assert re.search(r"ld\.global\.cg(\.\w+)*\.v4", ptx) and ".exch." not in ptx, "finish: loads and stores"
    # stages 4: the prologue's tile and the loop's, each as predicated vectors, and in the loop
    # the next tile's loads come before the sum of the current one
    ptx4 = _compile_for_hopper(dtype, block_n, block_k, even_n=True, dbuf=True).asm["ptx"]
    vec4 = _weight_loads(ptx4)
    assert len(vec4) == 2 * per_thread and all(p for p, *_ in vec4)
    loop = ptx4[ptx4.index("$L__BB0_2:"):]
    loop = loop[:loop.index("bra")]
    assert loop.index(".v4.b32") < loop.index("fma"), "stages 4 must issue tile i + 1 before summing tile i"
    # the fp32 partial adds: red.global (Triton 3.9) or a relaxed vector atom (Triton 3.6)
    assert re.search(r"red\.global|atom\.global\.gpu\.relaxed\.add(\.v\d)?\.f32", ptx), "no fp32 atomic partial add"
    # PDL: the grid-dependency wait comes before the first global load
    pdl = _compile_for_hopper(dtype, block_n, block_k, even_n=True, dbuf=True, pdl=True).asm["ptx"]
    assert "griddepcontrol.wait" in pdl and pdl.index("griddepcontrol.wait") < pdl.index("ld.global")
    assert "griddepcontrol" not in ptx4, "without PDL the kernel must not wait on a grid dependency"
    # the evict-first hint reaches every weight load, and only with WEIGHTS_EVICT_FIRST
    ev = _compile_for_hopper(dtype, block_n, block_k, even_n=True, dbuf=True, evict="evict_first").asm["ptx"]
    hinted = re.findall(r"ld\.global[.\w:]*L1::evict_first[.\w:]*\.v4\.b32", ev)
    assert len(hinted) == 2 * per_thread, f"{len(hinted)} evict-first weight loads, expected {2 * per_thread}"
    assert "evict_first" not in ptx4
    if dtype == torch.bfloat16:  # BF16_PAIRS: the same predicated vectors, widened by shift and mask
        pairs = _compile_for_hopper(dtype, block_n, block_k, even_n=True, dbuf=True, bits=True).asm["ptx"]
        vecp = _weight_loads(pairs)
        assert len(vecp) == 2 * per_thread and all(p for p, *_ in vecp)
        # only x is converted (8 weights per lane and row in ptx4, one x)
        assert pairs.count("cvt.f32.bf16") * 4 < ptx4.count("cvt.f32.bf16"), "pairs must not convert bf16 weights"
        assert re.search(r"shl\.b32\s+%r\d+, %r\d+, 16", pairs) and "and.b32" in pairs
    # ROW_STRIDE_CONST: the same predicated vectors, a tile's rows at constant offsets from one
    # address (immediate offsets in sm_90 SASS); without it, no such offsets
    n_cols = 14336
    rows_at = [r * n_cols * elem for r in range(1, block_k)]
    const = _compile_for_hopper(dtype, block_n, block_k, even_n=True, dbuf=True, stride=n_cols).asm["ptx"]
    vecc = _weight_loads(const)
    assert len(vecc) == 2 * per_thread and all(p for p, *_ in vecc), "one predicated vector per row segment"
    offsets = {int(c) for c in re.findall(r"add\.s64\s+%rd\d+, %rd\d+, (\d+);", const)}
    assert set(rows_at) <= offsets, "rows must be constant offsets of one address"
    assert not set(rows_at) <= {int(c) for c in re.findall(r"add\.s64\s+%rd\d+, %rd\d+, (\d+);", ptx4)}



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
            for config in (None, (64, 16, 3, 1, 4), (64, 8, 2, 1, 1), (64, 16, 3, 1, 8)):
                got = sparse_gemv(gate, w_t, torch.tensor(t, device=device), b, config=config, up=up)
                fails += [m for m in [mismatch(got, want, 2 * ulp * want.abs().max().item() + FLOOR[dtype],
                                               f"swiglu {dtype} {K}x{N} config={config}")] if m]
            # down in the fused layer: silu(gate) * up formed in the load and the residual added
            res = make(N, 1, dtype, device=device, seed=N)[0]
            want_r = want + res  # eager rounds the projection, then the sum
            for config in ((64, 16, 3, 1, 4), (64, 8, 2, 1, 8)):
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
    rms_norm of that stream, single and segmented (on and off the BLOCK_N grid), on stages 1, 4
    and 8; the embedding's stream through `sumsq`. bfloat16 runs on CUDA (the interpreter
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
        for config in ((64, 16, 3, 1, 4), (64, 8, 5, 1, 8), (64, 16, 2, 1, 1)):
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
            for config in ((32, 16, 3, 1, 4), (32, 8, 4, 1, 8), (16, 16, 2, 1, 8), (32, 16, 3, 1, 1), None):
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
        sparse_gemv(y, w2, 0.1, config=(32, 16, 3, 1, 11), norm=(nw, ss, 1e-5))
        fails.append("stages 11 (removed) must be refused")
    except InputError as e:
        fails += [] if "removed" in str(e) else [f"stages 11: unclear error {e}"]
    return fails


def _norm_worker() -> None:
    """`_norm_cases` under TRITON_INTERPRET=1 (a subprocess)."""
    print(json.dumps({"fails": _norm_cases()}))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_norm_and_residual_under_interpreter():
    report = run_interpreted(__file__, "_norm_worker")
    assert not report["fails"], "\n".join(report["fails"])


def _finish_load_cases(device="cpu") -> list[str]:
    """FINISH_LOAD (the last split reads the tile's sum with loads and zeroes it with stores) and
    RESET_STORE (it zeroes the arrival count with a store), each alone and together, give what the
    atomic exchanges give and leave the workspace and counts at zero: the three loops, one split and
    several, with a bias, and with a residual (the fused layer's o and down)."""
    fails = []
    x, w_t, b = make(577, 139, torch.bfloat16, device=device, seed=31)
    res = torch.randn(1, 139, generator=torch.Generator().manual_seed(32)).to(device, torch.bfloat16)
    t = threshold_for(x, 0.3)
    for stages, splits in ((1, 1), (1, 5), (4, 3), (4, 19), (8, 1), (8, 4)):
        for resid in (False, True):
            kwargs = {"residual": res} if resid else {}
            bias = None if resid else b
            ws = workspace(139, x.device)
            cfg = (64, 16, splits, 1, stages)
            want = _with_knobs(dict(FINISH_LOAD=False, RESET_STORE=False), sparse_gemv, x, w_t, t, bias, ws=ws,
                               config=cfg, **kwargs)
            load, reset = (True, stages != 4) if splits % 2 else (stages == 4, True)  # each alone and both
            got = _with_knobs(dict(FINISH_LOAD=load, RESET_STORE=reset), sparse_gemv, x, w_t, t, bias, ws=ws,
                              config=cfg, **kwargs)
            want, got = (want[0], got[0]) if resid else (want, got)
            what = f"FINISH_LOAD={load} RESET_STORE={reset} stages={stages} splits={splits} residual={resid}"
            tol = 0.0 if device == "cpu" else 2 * 2.0**-7 * want.float().abs().max().item()  # CUDA: add order
            fails += [m for m in [mismatch(got, want, tol, what)] if m]
            if ws[0].abs().sum().item() or ws[1].abs().sum().item():
                fails.append(f"{what}: the workspace is not back at zero")
    return fails


def _with_pairs(pairs: bool, fn, *args, **kwargs):
    """fn(*args, **kwargs) with sparse_gemv.BF16_PAIRS set to `pairs`, restored after."""
    return _with_knobs(dict(BF16_PAIRS=pairs), fn, *args, **kwargs)


def _with_knobs(values: dict, fn, *args, **kwargs):
    """fn(*args, **kwargs) with the sparse_gemv module knobs set as `values` says, restored after."""
    with _knob_context(**values):
        return fn(*args, **kwargs)


def _stride_const_cases(device="cpu") -> list[str]:
    """ROW_STRIDE_CONST (stages 4 with the weight's row stride compiled in) gives what stages 4
    gives without it (bit for bit under the interpreter; on CUDA, where the order of the splits'
    atomic adds varies, within rounding): plain, SwiGLU and normed inputs, a residual output,
    aligned segments, a strided column slice, partial last splits and tiles, every row dropped,
    and the dtypes."""
    from sparsedecode.kernels.sparse_gemv import sumsq

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
                cfg = config if what != "strided slice" or config is None else (16, *config[1:])
                want = _with_knobs(dict(ROW_STRIDE_CONST=False), sparse_gemv, *args, config=cfg, **kwargs)
                got = _with_knobs(dict(ROW_STRIDE_CONST=True), sparse_gemv, *args, config=cfg, **kwargs)
                pairs = list(zip(got, want, strict=True)) if isinstance(got, tuple) else [(got, want)]
                if device == "cpu":  # the interpreter runs the splits in order: the same sums, bit for bit
                    if not all(torch.equal(g, w) for g, w in pairs):
                        fails.append(f"ROW_STRIDE_CONST {dtype} {K}x{N} {cfg} {what}: differs from stages 4 without it")
                else:  # the splits' fp32 atomic adds land in any order
                    ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10 if dtype == torch.float16 else 20)
                    for g, w in pairs:
                        tol = 2 * ulp * w.float().abs().max().item() + FLOOR[dtype]
                        fails += [m for m in [mismatch(g, w, tol, f"ROW_STRIDE_CONST {dtype} {K}x{N} {what}")] if m]
    return fails


def _pairs_cases() -> list[str]:
    """BF16_PAIRS (stages 4 and 8 widen bf16 read as int32 pairs) gives bit for bit what Triton's
    conversion gives, on even N (pairs) and odd N (no pairs)."""
    fails = []
    for K, N in ((301, 130), (301, 203)):
        x, w_t, b = make(K, N, torch.bfloat16, seed=K + N)
        t = threshold_for(x, 0.4)
        for config in ((64, 16, 5, 1, 4), (16, 4, 7, 1, 8), (128, 8, 2, 1, 8)):
            want = _with_pairs(False, sparse_gemv, x, w_t, t, b, config=config)
            got = _with_pairs(True, sparse_gemv, x, w_t, t, b, config=config)
            if not torch.equal(got, want):
                fails.append(f"BF16_PAIRS {K}x{N} {config}: differs from the bf16 conversion")
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
        for stages in (1, 4, 8):  # stages 4 and 8 fall back to the plain loop off the tile grid
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
@pytest.mark.parametrize("pairs", [False, True], ids=["bf16", "pairs"])
@pytest.mark.parametrize("config", [(256, 8, 37, 1, 8), (512, 4, 20, 1, 8), (256, 4, 50, 1, 8), (256, 16, 37, 1, 4),
                                    (256, 16, 37, 1, 1), (2048, 16, 37, 8, 4), (1024, 16, 37, 4, 4)], ids=str)
def test_loop_configs_on_cuda(config, pairs, monkeypatch):
    """Stages 8 (each program lists its split's kept rows, then streams them two tiles at a
    time) and 4, with and without BF16_PAIRS, and the plain loop, against float64 on the
    issue's shapes, and in a graph whose threshold moves."""
    from sparsedecode.kernels import sparse_gemv as sg

    if pairs and config[4] not in (4, 8):
        pytest.skip("BF16_PAIRS applies to stages 4 and 8")
    monkeypatch.setattr(sg, "BF16_PAIRS", pairs)
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
def test_finish_load_on_cuda():
    fails = _finish_load_cases(device="cuda")
    # the shapes at the default config, replayed in a graph: the workspace is zero after each
    for K, N in ((4096, 14336), (14336, 4096)):
        x, w_t, b = make(K, N, torch.bfloat16, device="cuda", seed=K + 5)
        ws, t = workspace(N, "cuda"), torch.tensor(threshold_for(x, 0.3), device="cuda")
        with _knob_context(FINISH_LOAD=True, RESET_STORE=True):
            sparse_gemv(x, w_t, t, b, ws=ws)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = sparse_gemv(x, w_t, t, b, ws=ws)
        for _ in range(3):
            graph.replay()
            fails += check(out, x, w_t, t.item(), b, f"FINISH_LOAD {K}x{N} graph replay")
            if ws[0].abs().sum().item() or ws[1].abs().sum().item():
                fails.append(f"FINISH_LOAD {K}x{N}: the workspace is not back at zero after a replay")
    assert not fails, "\n".join(fails)


def test_finish_mode_is_one_warp_only():
    """FINISH_LOAD and RESET_STORE reach the kernel for one-warp programs only; programs of
    several warps keep the atomic exchanges (a two-warp config returned wrong sums with them)."""
    from sparsedecode.kernels import sparse_gemv as sg

    with _knob_context(FINISH_LOAD=True, RESET_STORE=True):
        assert sg.finish_mode(1) == 3 and sg.finish_mode(2) == 0 and sg.finish_mode(8) == 0
    with _knob_context(FINISH_LOAD=False, RESET_STORE=True):
        assert sg.finish_mode(1) == 2
    with _knob_context(FINISH_LOAD=True, RESET_STORE=False):
        assert sg.finish_mode(1) == 1


def _knob_context(**values):
    """The sparse_gemv module knobs set as `values` says for a with block (`kernels.knobs`)."""
    from sparsedecode.kernels import knobs
    from sparsedecode.kernels import sparse_gemv as sg

    return knobs(sg, **values)


@gpu
def test_constant_stride_on_cuda():
    fails = _stride_const_cases(device="cuda")
    assert not fails, "\n".join(fails)


@gpu
@pytest.mark.parametrize("num_warps", [1, 8])
def test_fused_norm_and_residual_on_cuda(num_warps, monkeypatch):
    """The fused norm and residual on CUDA, also with programs of 8 warps (the residual's sum of
    squares then reduces across warps)."""
    from sparsedecode.kernels import sparse_gemv as sg

    monkeypatch.setattr(sg, "NUM_WARPS", num_warps)
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
def test_swiglu_input_and_pdl_chain_on_cuda(monkeypatch):
    """silu(gate) * up formed in the load, in every dtype; then a chain of dependent calls
    launched with PDL and captured in a graph gives what the same chain gives without PDL."""
    from sparsedecode.kernels import sparse_gemv as sg

    fails = _swiglu_cases("cuda", DTYPES)
    assert not fails, "\n".join(fails)
    x, w1, _ = make(4096, 14336, torch.bfloat16, device="cuda", seed=5, bias=False)
    w2 = make(14336, 4096, torch.bfloat16, device="cuda", seed=6, bias=False)[1]
    t1, t2 = torch.tensor(0.5, device="cuda"), torch.tensor(0.02, device="cuda")
    ws1, ws2 = workspace(14336, "cuda"), workspace(4096, "cuda")

    def chain(x):
        for _ in range(3):  # each call reads what the one before wrote
            h = sparse_gemv(x, w1, t1, ws=ws1)
            x = sparse_gemv(h, w2, t2, ws=ws2) * 0.05
        return x

    monkeypatch.setattr(sg, "PDL", False)  # the reference chain: plain launches (PDL is the default)
    want = chain(x)
    monkeypatch.setattr(sg, "PDL", True)
    chain(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()
