"""The LoRA-aware sparse GEMV (kernels/lora_gemv.py, the sparse GEMV's adapter path; CPU:
kernels/cpu_gemv.c's sd_gemv_lora) against float64: y = x_m W^T + s B (A x_m) (+ bias).

Odd shapes (in 77/130/333, out 45/257, rank 1/7/16), keeps 0.05-1.0 at quantiles of |x|, every
dtype; the rows of A^T of dropped channels are NaN, so a kernel that read one would return NaN;
at t = -inf the result is the dense F.linear(x, W) + s B (A x); B = 0 gives the base sparse GEMV's
output exactly. Tolerances: twice the error of the same product in the operands' precision
(masked PyTorch ops) plus a floor, as tests/kernels/test_sparse_gemv.py sets them. The Triton
kernel runs under TRITON_INTERPRET=1 in a subprocess (small shapes), and on CUDA when present.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
import torch.nn.functional as F
from _compare import mismatch
from test_cpu_gemv import threads  # noqa: F401 (the 1- and 2-thread fixture)
from test_sparse_gemv import FLOOR, _compile_for_hopper, _weight_loads, threshold_for

from interpreted import run_interpreted
from sparsedecode.errors import InputError
from sparsedecode.kernels.common import keep_mask
from sparsedecode.kernels.cpu_gemv import cpu_kernel, sparse_gemv_cpu, sparse_gemv_lora_cpu
from sparsedecode.kernels.lora_gemv import lora_delta, lora_gemv, lora_gemv_ref, lora_workspace
from sparsedecode.kernels.options import GemvOptions

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(77, 45, 1), (130, 257, 7), (333, 45, 16)]  # (in K, out N, rank r)
KEEPS = [0.05, 0.3, 0.7, 1.0]
HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
SCALE = 2.0  # alpha / r: large enough that a lost or doubled adapter term shows


def make(K, N, r, dtype, device="cpu", seed=0, bias=True):
    """x (1, K), w_t (K, N), a_t (K, r), b_t (r, N), bias (N,) in dtype: the adapter term about as
    large as the base output, as a trained adapter's would not be (so its errors show)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, K, generator=gen)
    w_t = torch.randn(K, N, generator=gen) / math.sqrt(K)
    a_t = torch.randn(K, r, generator=gen) / math.sqrt(K)
    b_t = torch.randn(r, N, generator=gen) / math.sqrt(r * SCALE)
    b = torch.randn(N, generator=gen) if bias else None
    to = lambda t: None if t is None else t.to(device, dtype)  # noqa: E731
    return to(x), to(w_t), to(a_t), to(b_t), to(b)


def poison(a_t, x, t):
    """a_t with the rows of channels dropped at threshold t set to NaN (a read one spreads NaN)."""
    return torch.where(keep_mask(x, t).reshape(-1, 1), a_t, torch.full_like(a_t, math.nan))


def check(got, x, w_t, t, a_t, b_t, b, what, slack=0.0) -> list[str]:
    """Failure messages of one adapter product against float64 (NaN rows of a_t read as 0)."""
    x, w_t, a_t, b_t = x.cpu(), w_t.cpu(), a_t.cpu().nan_to_num(0.0), b_t.cpu()
    b = None if b is None else b.cpu()
    keep = keep_mask(x, t.cpu() if isinstance(t, torch.Tensor) else t)
    xm = torch.where(keep, x.double(), 0.0)
    y64 = xm @ w_t.double() + SCALE * (xm @ a_t.double()) @ b_t.double()
    xs = torch.where(keep, x, torch.zeros_like(x))  # the same product in the operands' precision
    same = xs @ w_t + SCALE * ((xs @ a_t) @ b_t)
    if b is not None:
        y64, same = y64 + b.double(), same + b
    tol = 2 * (same.double() - y64).abs().max().item() + FLOOR[x.dtype] + slack * y64.abs().max().item()
    want = (*x.shape[:-1], w_t.shape[1])
    fails = [] if got.dtype == x.dtype and tuple(got.shape) == want else [
        f"{what}: got {got.dtype} {tuple(got.shape)}, want {x.dtype} {want}"]
    return fails + [m for m in [mismatch(got, y64, tol, what)] if m]


def thresholds(x):
    """(keep, threshold) pairs: quantiles of |x|, and -inf (every row read) for keep 1.0."""
    return [(keep, threshold_for(x, keep) if keep < 1.0 else -math.inf) for keep in KEEPS]


# ---- the references on CPU --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K,N,r", SHAPES)
def test_reference_matches_float64(K, N, r, dtype):
    x, w_t, a_t, b_t, b = make(K, N, r, dtype, seed=K + r)
    fails = []
    for keep, t in thresholds(x):
        fails += check(lora_gemv_ref(x, w_t, t, a_t, b_t, SCALE, b), x, w_t, t, a_t, b_t, b, f"ref keep={keep}")
    assert not fails, "\n".join(fails)


def test_delta_is_the_adapter_term_of_several_rows():
    x, w_t, a_t, b_t, _ = make(130, 45, 7, torch.float32, seed=5)
    xs = torch.cat([x, -2 * x, x.flip(-1)])  # (3, K): a batch, each row its own mask
    t = threshold_for(x, 0.5)
    keep = keep_mask(xs, t)
    want = lora_gemv_ref(xs, w_t, t, a_t, b_t, SCALE) - lora_gemv_ref(xs, w_t, t, a_t, b_t * 0, SCALE)
    assert torch.allclose(lora_delta(xs, a_t, b_t, SCALE, keep), want, atol=1e-5)
    dense = SCALE * (xs.double() @ a_t.double()) @ b_t.double()
    assert torch.allclose(lora_delta(xs, a_t, b_t, SCALE).double(), dense, atol=1e-5)


# ---- the CPU kernel (cpu_gemv.c) ------------------------------------------------------------

cpu_built = pytest.mark.skipif(cpu_kernel().lib is None, reason=f"CPU kernel not built: {cpu_kernel().reason}")


@cpu_built
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K,N,r", [*SHAPES, (1537, 577, 16)])  # the last: several threads' shares
def test_cpu_kernel_matches_float64_and_never_reads_a_dropped_row_of_a(K, N, r, dtype, threads):  # noqa: F811
    x, w_t, a_t, b_t, b = make(K, N, r, dtype, seed=K * N + r)
    fails = []
    for keep, t in thresholds(x):
        bad = poison(a_t, x, t)
        for bias in (b, None):
            kept = [0, 0]
            got = sparse_gemv_lora_cpu(x, w_t, t, bad, b_t, SCALE, bias, kept=kept)
            fails += check(got, x, w_t, t, a_t, b_t, bias, f"cpu keep={keep} {K}x{N} r={r} threads={threads}")
            if kept != [keep_mask(x, t).sum().item(), K]:
                fails.append(f"cpu keep={keep}: kept counts {kept}")
    assert not fails, "\n".join(fails)


@cpu_built
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_kernel_dense_and_zero_b(dtype, threads):  # noqa: F811
    x, w_t, a_t, b_t, b = make(333, 257, 16, dtype, seed=9)
    dense = F.linear(x.double(), w_t.double().t(), b.double()) + SCALE * (x.double() @ a_t.double()) @ b_t.double()
    got = sparse_gemv_lora_cpu(x, w_t, -math.inf, a_t, b_t, SCALE, b)
    tol = 2 * torch.finfo(dtype).eps * dense.abs().max().item() * (64 if dtype == torch.float32 else 2)
    assert not (m := mismatch(got, dense, tol, "cpu t=-inf vs dense F.linear + s B A x")), m
    t = threshold_for(x, 0.4)
    base = sparse_gemv_cpu(x, w_t, t, b)
    assert torch.equal(sparse_gemv_lora_cpu(x, w_t, t, poison(a_t, x, t), torch.zeros_like(b_t), SCALE, b), base)


@cpu_built
def test_cpu_kernel_refuses_bad_adapters():
    x, w_t, a_t, b_t, _ = make(77, 45, 7, torch.float32)
    with pytest.raises(InputError, match="a_t must be contiguous"):
        sparse_gemv_lora_cpu(x, w_t, 0.1, a_t.half(), b_t, SCALE)
    with pytest.raises(InputError, match=r"b_t must be contiguous \(7, 45\)"):
        sparse_gemv_lora_cpu(x, w_t, 0.1, a_t, b_t.t().contiguous(), SCALE)
    with pytest.raises(InputError, match="b_t must be contiguous"):
        sparse_gemv_lora_cpu(x, w_t, 0.1, a_t, torch.zeros(14, 45)[::2], SCALE)


@cpu_built
def test_cpu_kernel_traces_whole_under_compile():
    x, w_t, a_t, b_t, b = make(130, 45, 7, torch.float32, seed=2)
    t = torch.tensor(threshold_for(x, 0.5))
    fn = torch.compile(lambda x, t: sparse_gemv_lora_cpu(x, w_t, t, a_t, b_t, SCALE, b), backend="aot_eager",
                       fullgraph=True)
    assert not (fails := check(fn(x, t), x, w_t, t, a_t, b_t, b, "cpu lora under torch.compile")), fails


# ---- the Triton kernel: interpreter (subprocess) and CUDA --------------------------------------


def _kernel_cases(device, dtypes, shapes, slack) -> tuple[int, list[str]]:
    """lora_gemv on `device` against float64 and its properties; (cases, failures)."""
    fails, n = [], 0
    for dtype in dtypes:
        for K, N, r in shapes:
            x, w_t, a_t, b_t, b = make(K, N, r, dtype, device=device, seed=K * 3 + N + r)
            ws = lora_workspace(N, r, device)
            for i, (keep, t) in enumerate(thresholds(x)):
                thr = torch.tensor(t, device=device) if i % 2 else t  # float and tensor thresholds
                bias = b if i != 1 else None
                what = f"lora_gemv {device} {dtype} {K}x{N} r={r} keep={keep} bias={bias is not None}"
                y = lora_gemv(x, w_t, thr, poison(a_t, x, t), b_t, SCALE, bias, ws=ws if i < 2 else None)
                fails += check(y, x, w_t, t, a_t, b_t, bias, what, slack.get(dtype, 0.0))
                n += 1
            if ws[0].abs().sum() != 0 or ws[1].abs().sum() != 0:
                fails.append(f"{dtype} {K}x{N} r={r}: the workspace is not back at zero after the calls")
    return n, fails


def _finish_cases(device, slack) -> tuple[int, list[str]]:
    """Every loop and finish of the kernel with an adapter: splits 1, 2 and more splits than
    tiles of rows (splits whose rows are all dropped), stages 1 and 4, one warp (the finish by
    loads) and four (by exchanges); B = 0 equals the base kernel bit for bit with one split (the
    sum of a tile is then one partial, in any order of arrival); the fused forms."""
    from sparsedecode.kernels.sparse_gemv import sparse_gemv, sumsq

    fails, n = [], 0
    dtype = torch.float16
    x, w_t, a_t, b_t, b = make(577, 139, 16, dtype, device=device, seed=3)  # 3 tiles of 64, the last of 11
    t = threshold_for(x, 0.3)
    bad = poison(a_t, x, t)
    for splits in (1, 2, 19):
        for stages, block_k, warps in ((1, 16, 4), (1, 8, 1), (4, 16, 4), (4, 8, 1)):
            cfg = (64, block_k, splits, warps, stages)
            # stages 4: A^T's next tile in flight (the default) or each loaded at its sum
            for opts in (GemvOptions(), GemvOptions(lora_prefetch=False))[:2 if stages == 4 else 1]:
                y = lora_gemv(x, w_t, t, bad, b_t, SCALE, b, config=cfg, options=opts)
                fails += check(y, x, w_t, t, a_t, b_t, b, f"lora_gemv config={cfg} prefetch={opts.lora_prefetch}",
                               slack.get(dtype, 0.0))
                n += 1
    for cfg in ((64, 16, 1, 1, 4), (64, 16, 1, 4, 1)):
        base = sparse_gemv(x, w_t, t, b, config=cfg)
        if not torch.equal(lora_gemv(x, w_t, t, bad, torch.zeros_like(b_t), SCALE, b, config=cfg), base):
            fails.append(f"B = 0 must give the base kernel's output exactly (config {cfg})")
        n += 1
    # many column tiles (the last one short), one workspace over repeated calls: each tile sums
    # its own u from its splits, a tile reading another's u (or a u left over) fails
    xg, wg, ag, bg, biasg = make(200, 1100, 7, dtype, device=device, seed=5)
    tg = threshold_for(xg, 0.4)
    wsg = lora_workspace(1100, 7, device)
    for cfg in ((32, 16, 3, 1, 1), (32, 16, 3, 4, 4), (16, 16, 2, 1, 4)):  # 35 tiles, 35, 69
        for rep in range(2):
            y = lora_gemv(xg, wg, tg, poison(ag, xg, tg), bg, SCALE, biasg, ws=wsg, config=cfg)
            fails += check(y, xg, wg, tg, ag, bg, biasg, f"lora_gemv tiles config={cfg} call {rep}",
                           slack.get(dtype, 0.0))
            n += 1
    if wsg[0].abs().sum() != 0 or wsg[1].abs().sum() != 0:
        fails.append("tiles: the workspace is not back at zero after the calls")
    # t = -inf reads every row: the dense product plus the adapter's
    dense = F.linear(x.double(), w_t.double().t(), b.double()) + SCALE * (x.double() @ a_t.double()) @ b_t.double()
    y = lora_gemv(x, w_t, -math.inf, a_t, b_t, SCALE, b)
    fails += [m for m in [mismatch(y, dense, 4e-3 * dense.abs().max().item(), "t=-inf vs dense + s B A x")] if m]
    # fused forms: SwiGLU's product in the load, the residual add, the input norm
    up = make(577, 1, 1, dtype, device=device, seed=4)[0]
    h = F.silu(x) * up
    th = threshold_for(h, 0.4)
    y = lora_gemv(x, w_t, th, poison(a_t, h, th), b_t, SCALE, b, up=up)
    fails += check(y, h, w_t, th, a_t, b_t, b, "lora_gemv up=", slack.get(dtype, 0.0))
    res = make(139, 1, 1, dtype, device=device, seed=6)[0]
    got, ss = lora_gemv(x, w_t, t, bad, b_t, SCALE, b, residual=res)
    want = lora_gemv_ref(x, w_t, t, a_t, b_t, SCALE, b) + res
    fails += [m for m in [mismatch(got, want, 4e-3 * want.abs().max().item(), "lora_gemv residual=")] if m]
    if abs(ss.sum().item() - sumsq(got).item()) > 1e-3 * sumsq(got).item():
        fails.append(f"residual=: sums of squares {ss.sum().item()} vs {sumsq(got).item()}")
    norm_w = make(577, 1, 1, dtype, device=device, seed=7)[0].reshape(-1)
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean() + 1e-5)).to(dtype) * norm_w
    tn = threshold_for(normed, 0.5)
    y = lora_gemv(x, w_t, tn, poison(a_t, normed, tn), b_t, SCALE, b, norm=(norm_w, sumsq(x), 1e-5))
    fails += check(y, normed, w_t, tn, a_t, b_t, b, "lora_gemv norm=", 2.0**-9)
    return n + 4, fails


def _segment_cases(device, slack) -> tuple[int, list[str]]:
    """A segmented launch (q|k|v) with adapters side by side: segments of 64, 32 and 64 columns on
    tiles of 32, each with its own threshold and scale, the middle one without an adapter (scale 0,
    its A^T columns all NaN: a read spreads NaN), against each site's reference; the input norm
    in the launch; a bound off the tile grid refused."""
    from sparsedecode.kernels.sparse_gemv import sparse_gemv, sparse_gemv_ref, sumsq

    fails, n = [], 0
    dtype, widths, r = torch.float16, [64, 32, 64], 5
    x, w_t, a_t, b_t, b = make(203, 160, 3 * r, dtype, device=device, seed=9)  # A^T of three sites
    b_t = b_t[:r].contiguous()  # (r, 160): the sites' B^T side by side
    scales = [SCALE, 0.0, SCALE]
    ts = [torch.tensor(threshold_for(x, k), device=device) for k in (0.3, 0.6, 0.5)]
    bad = a_t.clone()
    bad[:, r:2 * r] = math.nan  # the site without an adapter: never read
    for j in (0, 2):
        bad[:, j * r:(j + 1) * r] = poison(a_t[:, j * r:(j + 1) * r], x, ts[j].item())
    for cfg in ((32, 16, 3, 1, 4), (32, 8, 2, 4, 1)):
        y = sparse_gemv(x, w_t, ts, b, config=cfg, segments=widths, lora=(bad, b_t, scales))
        lo = 0
        for j, width in enumerate(widths):
            cols = slice(lo, lo + width)
            what = f"segmented lora config={cfg} site {j}"
            if scales[j]:
                fails += check(y[..., cols], x, w_t[:, cols], ts[j].item(), a_t[:, j * r:(j + 1) * r],
                               b_t[:, cols], b[cols], what, slack.get(dtype, 0.0))
            else:
                want = sparse_gemv_ref(x, w_t[:, cols], ts[j], b[cols])
                fails += [m for m in [mismatch(y[..., cols], want, 4e-3 * want.abs().max().item(), what)] if m]
            lo += width
        n += 1
    norm_w = make(203, 1, 1, dtype, device=device, seed=10)[0].reshape(-1)
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean() + 1e-5)).to(dtype) * norm_w
    tn = [torch.tensor(threshold_for(normed, 0.5), device=device)] * 3
    for opts in (GemvOptions(), GemvOptions(lora_prefetch=False)):  # q|k|v as a step launches it
        y = sparse_gemv(x, w_t, tn, b, segments=widths, lora=(a_t, b_t, [SCALE, SCALE, SCALE]),
                        norm=(norm_w, sumsq(x), 1e-5), config=(32, 16, 2, 1, 4), options=opts)
        lo = 0
        for j, width in enumerate(widths):
            cols = slice(lo, lo + width)
            fails += check(y[..., cols], normed, w_t[:, cols], tn[0].item(), a_t[:, j * r:(j + 1) * r], b_t[:, cols],
                           b[cols], f"segmented lora norm= site {j} prefetch={opts.lora_prefetch}", 2.0**-9)
            lo += width
    try:
        sparse_gemv(x, w_t, ts, b, config=(64, 16, 2, 1, 4), segments=widths, lora=(a_t, b_t, scales))
        fails.append("a segment bound off the tile grid (96 on tiles of 64) must be refused")
    except InputError as e:
        fails += [] if "tile grid" in str(e) else [f"wrong refusal: {e}"]
    return n + 3, fails


def _interpreter_worker() -> None:
    """Run with TRITON_INTERPRET=1 (the interpreter truncates float32 to bfloat16 where the GPU
    rounds, so bfloat16 outputs get one more unit in the last place of slack)."""
    slack = {torch.bfloat16: 2.0**-7}
    n, fails = _kernel_cases("cpu", DTYPES, SHAPES, slack)
    m, more = _finish_cases("cpu", slack)
    k, seg = _segment_cases("cpu", slack)
    m, more = m + k, more + seg
    # under the interpreter the programs run in order: B = 0 is bit-exact at any split count
    from sparsedecode.kernels.sparse_gemv import sparse_gemv

    x, w_t, a_t, b_t, b = make(333, 257, 16, torch.bfloat16, seed=8)
    t = threshold_for(x, 0.5)
    if not torch.equal(lora_gemv(x, w_t, t, poison(a_t, x, t), b_t * 0, SCALE, b), sparse_gemv(x, w_t, t, b)):
        more.append("B = 0 must give the base kernel's output exactly")
    traced = torch.compile(lambda x, t: lora_gemv(x, w_t, t, a_t, b_t, SCALE, b), backend="aot_eager",
                           fullgraph=True)
    more += check(traced(x, torch.tensor(t)), x, w_t, t, a_t, b_t, b, "lora_gemv under torch.compile", 2.0**-7)
    print(json.dumps({"cases": n + m + 2, "fails": fails + more}))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_lora_kernel_under_interpreter():
    report = run_interpreted(__file__, "_interpreter_worker")
    assert report["cases"] >= 50 and not report["fails"], "\n".join(report["fails"])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_bad_adapters_are_refused():
    x, w_t, a_t, b_t, _ = make(77, 45, 7, torch.float32)
    with pytest.raises(InputError, match="a_t must be contiguous"):
        lora_gemv(x, w_t, 0.1, a_t[:40], b_t, SCALE)
    with pytest.raises(InputError, match="b_t must be contiguous"):
        lora_gemv(x, w_t, 0.1, a_t, b_t.half(), SCALE)
    with pytest.raises(InputError, match="one threshold"):
        lora_gemv(x, w_t, [0.1, 0.2], a_t, b_t, SCALE)
    with pytest.raises(InputError, match="lora_workspace"):
        lora_gemv(x, w_t, 0.1, a_t, b_t, SCALE, ws=lora_workspace(40, 7, "cpu"))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_adapter_loads_are_predicated_on_hopper():
    """Compiled for sm_90 (no GPU needed) with a rank-16 adapter: the kernel's 16-byte vector loads
    are the base's plus the adapter's rows of A^T (a row's 16 values as whole vectors, not 2-byte
    loads), every one predicated (the rows of dropped channels are never read); the relaxed adds of
    the tile's u; and a program still arrives once (no arrival waits on another tile's u)."""
    import re

    ptx0 = _compile_for_hopper(torch.bfloat16, 256, 16, even_n=True, dbuf=True, stride=4096).asm["ptx"]
    small = lambda p: len(re.findall(r"ld\.global\.b16", p))  # noqa: E731
    base = _weight_loads(ptx0)
    for prefetch in (True, False):  # gemv.lora_prefetch: the next tile's A^T in flight, or at its sum
        ptx = _compile_for_hopper(torch.bfloat16, 256, 16, even_n=True, dbuf=True, stride=4096, lora=True,
                                  prefetch=prefetch).asm["ptx"]
        with_a = _weight_loads(ptx)
        assert len(with_a) > len(base) and all(p for p, _ in with_a), "A^T's rows: predicated 16-byte vectors"
        # a few 2-byte loads of x in the adapter tile's layout may be re-issued; A^T's rows as 2-byte
        # loads would add 8 or more a lane (what a rank the launcher does not specialise as a multiple
        # of 16 compiles to)
        assert small(ptx) - small(ptx0) < 8, "A^T's rows must load as vectors"
        assert ptx.count("atom.global.gpu.acq_rel.add") == ptx0.count("atom.global.gpu.acq_rel.add") == 1
        assert "red.global.gpu.relaxed.add.f32" in ptx and "red.global.gpu.relaxed.add.f32" not in ptx0


gpu = pytest.mark.skipif(not CUDA or not HAS_TRITON, reason="needs a CUDA GPU and triton")


@gpu
def test_lora_kernel_on_cuda():
    n, fails = _kernel_cases("cuda", DTYPES, [*SHAPES, (4096, 1024, 16), (14336, 4096, 16)], {})
    m, more = _finish_cases("cuda", {})
    k, seg = _segment_cases("cuda", {})
    m, more = m + k, more + seg
    assert n + m >= 50 and not fails + more, "\n".join(fails + more)


@gpu
def test_lora_kernel_in_cuda_graph_follows_threshold_updates():
    x, w_t, a_t, b_t, b = make(4096, 4096, 16, torch.bfloat16, device="cuda", seed=11)
    ws = lora_workspace(4096, 16, "cuda")
    thr = torch.tensor(threshold_for(x, 0.5), device="cuda")
    lora_gemv(x, w_t, thr, a_t, b_t, SCALE, b, ws=ws)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lora_gemv(x, w_t, thr, a_t, b_t, SCALE, b, ws=ws)
    fails = []
    for keep in (0.2, 0.7):
        thr.fill_(threshold_for(x, keep))
        graph.replay()
        fails += check(y, x, w_t, thr, a_t, b_t, b, f"graph replay keep={keep}")
    assert not fails, "\n".join(fails)


def test_an_adapter_launch_takes_its_own_programs_per_sm(monkeypatch):
    """gemv.lora_programs_per_sm: a launch carrying an adapter gets the default tiles with the splits
    for that many programs a SM, the tuned table not read (docs/kernels/lora_gemv.md 'register cap
    with an adapter'); a launch without one, or the option unset, keeps the launcher's own choice."""
    from sparsedecode.kernels import sparse_gemv as sg

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the wrapper's checks pass on CPU; no kernel runs
    asked, launched = [], []
    real = sg.default_config

    def spy_config(K, N, dtype, device, programs_per_sm=16, tuned=True):
        asked.append((programs_per_sm, tuned))
        return real(K, N, dtype, device, programs_per_sm, tuned)

    def spy_op(x, w_t, *args):
        launched.append(args[6:11])  # block_n, block_k, splits, num_warps, stages (0s: the op chooses)
        return torch.zeros(w_t.shape[1]), torch.zeros(0)

    monkeypatch.setattr(sg, "default_config", spy_config)
    monkeypatch.setattr(sg, "_sparse_gemv_op", spy_op)
    x, w_t, a_t, b_t, b = make(130, 257, 7, torch.float32)
    lora_gemv(x, w_t, 0.5, a_t, b_t, SCALE, b, options=GemvOptions(lora_programs_per_sm=3))
    assert asked == [(3, False)] and launched[-1] == real(130, 257, torch.float32, x.device, 3, False)
    asked.clear()
    lora_gemv(x, w_t, 0.5, a_t, b_t, SCALE, b)  # unset: the op picks, as without an adapter
    sg.sparse_gemv(x, w_t, 0.5, b, options=GemvOptions(lora_programs_per_sm=3))  # no adapter: unaffected
    assert asked == [] and launched[-2:] == [(0, 0, 0, 0, 0)] * 2
