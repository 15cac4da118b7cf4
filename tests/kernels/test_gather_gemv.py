"""The CATS row-gather up kernel against float64 and its masked reference (SATS paper §2, CATS).

h_j = SiLU(gate)_j * (w_up[j] . x + b_j) where |SiLU(gate)_j| > t, exactly 0 elsewhere.
Tolerances are twice the error of a same-precision PyTorch product, plus a small floor.
The Triton kernel runs on CPU under TRITON_INTERPRET=1 in a subprocess (the interpreter
is chosen when @triton.jit runs, at import), is compiled for sm_90 to check that the
weight loads are predicated 16-byte vectors with no barrier in the loop, and runs on CUDA
when there is one. `CatsMLP` through the kernel must equal its masked reference path.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _compare import mismatch

from sparsedecode.errors import InputError
from sparsedecode.kernels.gather_gemv import cats_up, cats_up_ref, default_config
from sparsedecode.kernels.sparse_gemv import keep_mask, workspace

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
KEEPS = [0.05, 0.3, 0.5, 1.0]
SHAPES = [(37, 129), (300, 1000)]  # (N out, K in): odd, and not multiples of any tile
HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()


def make(N, K, dtype, device="cpu", seed=0, bias=True):
    """x (1, K), w_up (N, K), gate_act (1, N) = SiLU of a random gate, bias (N,) or None."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, K, generator=gen)  # (1, K): one token
    w = torch.randn(N, K, generator=gen) / math.sqrt(K)  # (N, K): nn.Linear's layout
    g = F.silu(2 * torch.randn(1, N, generator=gen))  # (1, N)
    b = torch.randn(N, generator=gen) if bias else None  # (N,)
    return tuple(None if v is None else v.to(device, dtype) for v in (x, w, g, b))


def threshold_for(g, keep: float) -> float:
    """The |gate_act| quantile that keeps about `keep` of the channels; keep 1.0 gives 0.0."""
    return 0.0 if keep >= 1.0 else float(g.float().abs().quantile(1.0 - keep))


def exact(x, w, g, t, b):
    """(h float64 (1, N), same-precision h, keep mask) of the CATS-gated up product."""
    keep = keep_mask(g, t)
    u64 = x.double() @ w.double().t()  # (1, N)
    same = F.linear(x, w, b)  # (1, N) in x's dtype
    if b is not None:
        u64 = u64 + b.double()
    h64 = torch.where(keep, g.double() * u64, 0.0)
    return h64, torch.where(keep, g * same, torch.zeros_like(same)), keep


def check(got, x, w, g, t, b, what, slack: float = 0.0) -> list[str]:
    """Failure messages (possibly none) of one product against float64; dropped channels must
    be exactly 0; `slack` (relative to the largest output) widens the tolerance."""
    t = t.cpu() if isinstance(t, torch.Tensor) else t
    x, w, g, b = (None if v is None else v.cpu() for v in (x, w, g, b))
    h64, same, keep = exact(x, w, g, t, b)
    tol = 2 * (same.double() - h64).abs().max().item() + FLOOR[x.dtype] + slack * h64.abs().max().item()
    want_shape = g.shape
    if got.dtype != x.dtype or got.shape != want_shape:
        return [f"{what}: got {got.dtype} {tuple(got.shape)}, want {x.dtype} {tuple(want_shape)}"]
    got = got.cpu()
    fails = [m for m in [mismatch(got, h64, tol, what)] if m]
    nonzero = (got[~keep] != 0).sum().item()
    if nonzero:
        fails.append(f"{what}: {nonzero} dropped channels are not exactly 0")
    return fails


# ---- the masked reference on CPU --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("keep", KEEPS)
def test_reference_matches_float64(keep, N, K, dtype):
    x, w, g, b = make(N, K, dtype, seed=N + int(keep * 100))
    t = threshold_for(g, keep)
    for bias in (b, None):
        fails = check(cats_up_ref(x, w, g, t, bias), x, w, g, t, bias, f"ref keep={keep} {N}x{K} {dtype}")
        assert not fails, "\n".join(fails)
    kept = keep_mask(g, t).float().mean().item()
    assert abs(kept - keep) <= 1.5 / N + 1e-9, f"quantile threshold keeps {kept}, wanted {keep}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_threshold_zero_is_dense_and_all_dropped_is_zero(dtype):
    x, w, g, b = make(300, 1000, dtype, seed=1)
    dense = g.double() * F.linear(x.double(), w.double(), b.double())  # (1, N): SiLU(gate) * up
    fails = check(cats_up_ref(x, w, g, 0.0, b), x, w, g, 0.0, b, f"threshold 0 {dtype}")
    fails += [m for m in [mismatch(exact(x, w, g, 0.0, b)[0], dense, 1e-9, "threshold 0 vs dense")] if m]
    assert not fails, "\n".join(fails)
    assert torch.equal(cats_up_ref(x, w, g, math.inf, b), torch.zeros_like(g))
    assert torch.equal(cats_up_ref(x, w, g, torch.tensor(1e30), None), torch.zeros_like(g))


def test_bad_input_raises_clear_errors():
    x, w, g, b = make(8, 16, torch.float32)
    with pytest.raises(InputError, match="one token"):
        cats_up_ref(torch.cat([x, x]), w, g, 0.1)
    with pytest.raises(InputError, match="does not end in K=16"):
        cats_up_ref(x[:, :15], w, g, 0.1)
    with pytest.raises(InputError, match="N=8 activations"):
        cats_up_ref(x, w, g[:, :7], 0.1)
    with pytest.raises(InputError, match="one dtype"):
        cats_up_ref(x, w, g.half(), 0.1)
    with pytest.raises(InputError, match="float16, bfloat16 or float32"):
        cats_up_ref(x.double(), w.double(), g.double(), 0.1)
    with pytest.raises(InputError, match="bias must be"):
        cats_up_ref(x, w, g, 0.1, b[:3])
    with pytest.raises(InputError, match="1-element float tensor"):
        cats_up_ref(x, w, g, torch.tensor([1, 2]))
    with pytest.raises(InputError, match="w_up"):
        cats_up_ref(x, w[None], g, 0.1)
    if HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        with pytest.raises(InputError, match="masked reference"):
            cats_up(x, w, g, 0.1)


def test_default_config_fills_an_h200(monkeypatch):
    """At the Llama-3.1-8B up shape: one-warp programs over 512-byte row segments, close to
    PROGRAMS_PER_SM per SM of 132 and never more (all resident at once), no empty split."""
    import sparsedecode.kernels.gather_gemv as gg
    from sparsedecode.kernels import common

    monkeypatch.setattr(common, "sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    block_r, block_j, block_k, splits, warps = default_config(14336, 4096, torch.bfloat16, dev)
    programs = -(-14336 // block_r) * splits
    assert block_k * 2 == gg.ROW_BYTES and warps == 1 and block_j <= block_r, (block_r, block_j, block_k)
    assert 0.75 * gg.PROGRAMS_PER_SM * 132 <= programs <= gg.PROGRAMS_PER_SM * 132, (block_r, splits, programs)
    assert (splits - 1) * common.rows_per_split(4096, block_k, splits) < 4096
    assert default_config(37, 129, torch.float16, torch.device("cpu"))[:3] == (32, 8, 256)
    # programs_per_sm (cats_up's argument, a plain value of its op) sets the split count
    fewer = default_config(14336, 4096, torch.bfloat16, dev, programs_per_sm=4)
    assert fewer[:3] == (block_r, block_j, block_k) and fewer[3] < splits, (fewer, splits)
    x, w, g, _ = make(37, 129, torch.float32)
    for bad in (0, 2.5, True):
        with pytest.raises(InputError, match="programs_per_sm"):
            cats_up(x, w, g, 0.1, programs_per_sm=bad)


# ---- the Triton kernel under TRITON_INTERPRET=1 (subprocess) ----------------------------------


def _mlp(d: int, d_ff: int, dtype, seed: int) -> nn.Module:
    """A SwiGLU MLP with gate/up/down nn.Linear; up stored column-major as on a CPU model."""
    torch.manual_seed(seed)
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = nn.Linear(d, d_ff, bias=False), nn.Linear(d, d_ff, bias=True)
    mlp.down_proj = nn.Linear(d_ff, d, bias=False)
    mlp = mlp.to(dtype).requires_grad_(False)
    mlp.up_proj.weight = nn.Parameter(mlp.up_proj.weight.t().contiguous().t(), requires_grad=False)
    return mlp


def _adapter_cases(device) -> tuple[int, list[str]]:
    """cats_up with an up adapter (SATS §4.2): u = A x (rounded to the dtype), then each kept row
    adds s B_j . u; B's values of dropped rows are NaN (a kept row reading one would be NaN); one
    split and several, ranks 5 and 16; dropped rows exactly 0."""
    fails, n = [], 0
    for dtype in (torch.float32, torch.bfloat16):
        for r, cfg in ((5, (32, 4, 128, 3, 1)), (16, (64, 8, 256, 1, 1)), (16, None)):
            x, w, g, b = make(157, 1000, dtype, device=device, seed=r)
            gen = torch.Generator().manual_seed(r + 1)
            a_t = (torch.randn(1000, r, generator=gen) / math.sqrt(1000)).to(device, dtype)
            b_t = torch.randn(r, 157, generator=gen).to(device, dtype)
            t = threshold_for(g, 0.4)
            keep = keep_mask(g, t).reshape(-1)
            bad = torch.where(keep[None, :], b_t, torch.full_like(b_t, math.nan))
            y = cats_up(x, w, g, t, b, config=cfg, lora=(a_t, bad, 2.0, None))
            u = (x.float() @ a_t.float()).to(dtype).double()  # (1, r), as the kernel rounds it
            up = x.double() @ w.double().t() + b.double() + 2.0 * u @ b_t.double()
            want = torch.where(keep[None, :], g.double() * up, 0.0)
            ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 20)
            what = f"cats_up adapter {dtype} r={r} config={cfg}"
            fails += [m for m in [mismatch(y, want, 8 * ulp * want.abs().max().item() + FLOOR[dtype], what)] if m]
            if (y.reshape(-1)[~keep] != 0).any():
                fails.append(f"{what}: dropped channels must be exactly 0")
            n += 1
    return n, fails


def _interpreter_worker() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: kernel vs float64 and the masked reference.

    The interpreter casts float32 to bfloat16 by truncation where the GPU rounds to nearest,
    so bfloat16 outputs get one more unit in the last place of slack here.
    """
    from sparsedecode.projection.cats_runtime import CatsMLP

    fails, n = [], 0
    slack = {torch.bfloat16: 2.0**-7}
    # SHAPES with 157 rows for 300: still odd and off every tile, and the interpreter's time
    # grows with the row blocks it runs.
    shapes = [(37, 129), (157, 1000)]
    for dtype in DTYPES:
        for N, K in shapes:
            x, w, g, b = make(N, K, dtype, seed=N * 7 + K)
            ws = workspace(N, x.device)
            for i, keep in enumerate(KEEPS):
                t = threshold_for(g, keep)
                thr = torch.tensor(t) if i % 2 else t  # float and tensor thresholds
                bias = b if i != 1 else None
                what = f"kernel {dtype} {N}x{K} keep={keep} bias={bias is not None}"
                y = cats_up(x, w, g, thr, bias, ws=ws if i < 2 else None)
                fails += check(y, x, w, g, t, bias, what, slack.get(dtype, 0.0))
                if i < 2:  # the persistent workspace serves a second call alike
                    again = cats_up(x, w, g, thr, bias, ws=ws)
                    fails += [] if torch.equal(y, again) else [f"{what}: a second call differs"]
                ref = cats_up_ref(x, w, g, thr, bias)
                ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10 if dtype == torch.float16 else 20)
                tol = 2 * ulp * ref.abs().max().item() + FLOOR[dtype]
                fails += [m for m in [mismatch(y, ref, tol, what + " vs cats_up_ref")] if m]
                n += 1
            if ws[0].abs().sum() != 0 or ws[1].abs().sum() != 0:
                fails.append(f"{dtype} {N}x{K}: the workspace is not back at zero after the calls")
    # one split (no workspace), two, more splits than K tiles; groups of 1, 16 and all of a block
    for N, K, cfg in ((157, 1000, (64, 8, 64, 1, 1)), (157, 1000, (32, 4, 128, 2, 4)),
                      (37, 129, (16, 16, 16, 99, 1)), (157, 1000, (128, 1, 256, 3, 2)),
                      (157, 1000, (16, 2, 1024, 1, 1))):
        x, w, g, b = make(N, K, torch.bfloat16, seed=3)
        t = threshold_for(g, 0.3)
        ws = workspace(N, x.device)
        y = cats_up(x, w, g, torch.tensor(t), b, ws=ws, config=cfg)
        fails += check(y, x, w, g, t, b, f"kernel {N}x{K} config={cfg}", 2.0**-7)
        n += 1
        if ws[0].abs().sum() != 0 or ws[1].abs().sum() != 0:
            fails.append(f"config={cfg}: the workspace is not back at zero after the call")
    x, w, g, b = make(157, 1000, torch.bfloat16, seed=3)
    dense = g.float() * F.linear(x.float(), w.float(), b.float())  # (1, N): nothing dropped
    fails += [m for m in [mismatch(cats_up(x, w, g, 0.0, b), dense, 0.1, "threshold 0 vs dense")] if m]
    y = cats_up(x, w, g, math.inf, b)
    fails += [] if torch.equal(y, torch.zeros_like(g)) else ["all channels dropped must give exact zeros"]
    traced = torch.compile(lambda x, w, g, t, b: cats_up(x, w, g, t, b), backend="aot_eager", fullgraph=True)
    thr = torch.tensor(threshold_for(g, 0.5))
    fails += check(traced(x, w, g, thr, b), x, w, g, thr, b, "kernel under torch.compile(fullgraph=True)",
                   2.0**-7)
    n += 3

    # CatsMLP through the kernel equals its masked reference (the CPU path's formula).
    for dtype in (torch.float32, torch.bfloat16):
        mlp = _mlp(64, 96, dtype, seed=5)
        xs = torch.randn(1, 1, 64).to(dtype)  # (B, L, d): one decode token
        act = F.silu(mlp.gate_proj(xs))
        t = threshold_for(act, 0.4)
        up_w = mlp.up_proj.weight.detach().clone()
        gate, down = mlp.gate_proj, mlp.down_proj  # CatsMLP takes them over (and empties mlp)
        cats = CatsMLP(mlp, t, track=True)
        if not cats.up_proj.weight.is_contiguous():
            fails.append("CatsMLP under the interpreter must store up row-major")
        got = cats(xs)
        keep = keep_mask(act, t)
        masked = cats.down_proj((act * keep) * F.linear(xs, up_w, cats.up_proj.bias))
        tol = {torch.float32: 1e-5, torch.bfloat16: 0.05}[dtype] * masked.abs().max().item()
        fails += [m for m in [mismatch(got, masked, tol, f"CatsMLP {dtype} vs masked reference")] if m]
        via_ref = cats.down_proj(cats_up_ref(xs, cats.up_proj.weight, act, cats.threshold, cats.up_proj.bias))
        fails += [m for m in [mismatch(got, via_ref, tol, f"CatsMLP {dtype} vs cats_up_ref")] if m]
        if cats.realized_keep() != keep.sum().item() / keep.numel():
            fails.append(f"CatsMLP {dtype}: realized keep {cats.realized_keep()}, kept {keep.sum()} of 96")
        several = torch.randn(1, 5, 64).to(dtype)  # prefill stays dense
        dense = down(F.silu(gate(several)) * F.linear(several, up_w, cats.up_proj.bias))
        fails += [m for m in [mismatch(cats(several), dense, tol, f"CatsMLP {dtype} prefill")] if m]
        n += 3
    m, more = _adapter_cases("cpu")
    # CatsMLP holding up's adapter apart: the kernel path against the masked formula
    mlp = _mlp(64, 96, torch.float32, seed=6)
    xs = torch.randn(1, 1, 64)
    act = F.silu(mlp.gate_proj(xs))
    t = threshold_for(act, 0.5)
    up_w = mlp.up_proj.weight.detach().clone()
    cats = CatsMLP(mlp, t)
    gen = torch.Generator().manual_seed(8)
    a, b = torch.randn(4, 64, generator=gen) / 8, torch.randn(96, 4, generator=gen)
    cats.attach_up_lora_(a, b, 2.0)
    up = F.linear(xs, up_w, cats.up_proj.bias) + 2.0 * (xs @ a.t()) @ b.t()
    masked = cats.down_proj((act * keep_mask(act, t)) * up)
    more += [e for e in [mismatch(cats(xs), masked, 1e-5 * masked.abs().max().item(), "CatsMLP up adapter")] if e]
    print(json.dumps({"cases": n + m + 1, "fails": fails + more}))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_gather_gemv as t; t._interpreter_worker()"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["cases"] >= 30 and not report["fails"], "\n".join(report["fails"])


def _compile_for_hopper(dtype, config, even_k=True, split=True):
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"triton's compiler API is not available: {e}")
    from sparsedecode.kernels import gather_gemv as gg

    block_r, block_j, block_k, _, warps = config
    fn = gg._cats_up_kernel
    ty = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    consts = dict(BLOCK_R=block_r, BLOCK_J=block_j, BLOCK_K=block_k, THR_T=True, HAS_BIAS=True,
                  EVEN_K=even_k, SPLIT=split, VEC=16 // torch.empty((), dtype=dtype).element_size(),
                  FIN_LOAD=gg.finish_mode(warps) == "load",  # the split-K finish as launched
                  LORA=False, BLOCK_RK=16)  # no up adapter: the base kernel
    types = dict(X=ty, W=ty, G=ty, Bias=ty, Y=ty, Thr="*fp32", Acc="*fp32", Count="*i32", thr_f="fp32",
                 U=ty, Bt=ty, lora_s="fp32")
    names = fn.arg_names
    sig = {n: types.get(n, "i32") for n in names}
    sig.update({n: "constexpr" for n in consts})
    aligned = [(names.index(n),) for n in ("X", "W", "G", "Y", "Acc", "K", "N", "cols_per_split")]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in consts.items()},
                    attrs={a: [["tt.divisibility", 16]] for a in aligned})
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))
    except (RuntimeError, FileNotFoundError) as e:
        if "ptxas" in str(e).lower():
            pytest.skip(f"no ptxas for sm_90: {e}")
        raise


def _loop_body(ptx: str, first: int) -> list[str]:
    """The PTX lines of the innermost loop around line `first`: from the label that a later
    backward branch jumps to, up to that branch."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", line))}
    for j in range(first, len(lines)):
        m = re.search(r"bra(\.uni)?\s+(\$L__BB\d+_\d+);", lines[j])
        if m and labels.get(m.group(2), len(lines)) < first:
            return lines[labels[m.group(2)]:j + 1]
    raise AssertionError("no loop around the weight loads")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weight_loads_are_predicated_vectors_on_hopper(dtype):
    """Compile the default config for sm_90 (no GPU needed): per iteration each lane issues one
    predicated 16-byte vector per row of the group (an empty slot issues no load) beside its
    x vector, and the loop holds no barrier (nothing in it goes through shared memory)."""
    config = default_config(14336, 4096, dtype, torch.device("cpu"))
    block_j, block_k, warps = config[1], config[2], config[4]
    elem = torch.empty((), dtype=dtype).element_size()
    ptx = _compile_for_hopper(dtype, config).asm["ptx"]
    lines = ptx.splitlines()
    first = next(i for i, line in enumerate(lines) if re.match(r"^\s*@%p\d+ ld\.global(\.\w+)*\.v4\.b32", line))
    body = _loop_body(ptx, first)
    weight = [line for line in body if re.match(r"^\s*@%p\d+ ld\.global(\.\w+)*\.v4\.b32", line)]
    per_lane = block_j * block_k * elem // 16 // (warps * 32)  # 16-byte weight vectors per lane and tile
    assert len(weight) == per_lane, f"{len(weight)} predicated vector loads per iteration, expected {per_lane}"
    assert sum("ld.global" in line for line in body) == per_lane + 1, "weight vectors plus one x vector"
    assert not [line for line in body if "bar.sync" in line], "a barrier in the K loop"
    assert "atom.global.gpu.acq_rel.add" in ptx, "the arrival count must be an acq_rel atomic"
    # the fp32 partial adds: red.global (Triton 3.9) or a relaxed atom (Triton 3.6)
    assert re.search(r"red\.global|atom\.global\.gpu\.relaxed\.add(\.v\d)?\.f32", ptx), "no fp32 atomic partial add"
    # one warp: the split-K finish of kernels.common reads the sums by loads, no atomic exchange left
    assert warps == 1 and re.search(r"ld\.global\.cg", ptx) and ".exch." not in ptx, "finish: loads and stores"


# ---- CUDA ---------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA or not HAS_TRITON, reason="needs a CUDA GPU and triton")


@gpu
def test_kernel_with_an_up_adapter_on_cuda():
    n, fails = _adapter_cases("cuda")
    assert n == 6 and not fails, "\n".join(fails)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,K", SHAPES + [(14336, 4096), (11008, 4096)])
@pytest.mark.parametrize("keep", KEEPS)
def test_kernel_on_cuda(keep, N, K, dtype):
    x, w, g, b = make(N, K, dtype, device="cuda", seed=N + K)
    t = threshold_for(g, keep)
    ws = workspace(N, "cuda")
    for thr, bias in ((t, b), (torch.tensor(t, device="cuda"), None)):
        for _ in range(2):
            y = cats_up(x, w, g, thr, bias, ws=ws)
            fails = check(y, x, w, g, t, bias, f"cuda kernel {N}x{K} keep={keep} {dtype}")
            assert not fails, "\n".join(fails)
    y = cats_up(x, w, g, t, b, config=(64, 8, 512 // x.element_size(), 1, 1))  # one split, no workspace
    fails = check(y, x, w, g, t, b, f"cuda kernel one split {N}x{K} keep={keep} {dtype}")
    assert not fails, "\n".join(fails)
    assert ws[0].abs().sum().item() == 0 and ws[1].abs().sum().item() == 0


@gpu
def test_kernel_in_cuda_graph_follows_threshold_updates():
    x, w, g, b = make(14336, 4096, torch.bfloat16, device="cuda")
    thr = torch.tensor(0.0, device="cuda")
    ws = workspace(14336, "cuda")
    fn = torch.compile(lambda x, g, t: cats_up(x, w, g, t, b, ws=ws), fullgraph=True)
    for call in (lambda: cats_up(x, w, g, thr, b, ws=ws), lambda: fn(x, g, thr)):
        call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for keep in (1.0, 0.5, 0.05, 0.3):
            thr.fill_(threshold_for(g, keep))
            for _ in range(3):  # replays reuse the workspace
                graph.replay()
            torch.cuda.synchronize()
            fails = check(out, x, w, g, threshold_for(g, keep), b, f"graph replay keep={keep}")
            assert not fails, "\n".join(fails)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cats_mlp_on_cuda_matches_masked_reference(dtype):
    from sparsedecode.projection.cats_runtime import CatsMLP

    mlp = _mlp(256, 704, dtype, seed=2).cuda()
    xs = torch.randn(1, 1, 256, device="cuda").to(dtype)
    act = F.silu(mlp.gate_proj(xs))
    t = threshold_for(act, 0.4)
    up_w, up_b = mlp.up_proj.weight.detach().clone(), mlp.up_proj.bias
    cats = CatsMLP(mlp, t)
    got = cats(xs)
    masked = cats.down_proj((act * keep_mask(act, t)) * F.linear(xs, up_w, up_b))
    tol = {torch.float32: 1e-5, torch.bfloat16: 0.05}[dtype] * masked.abs().max().item()
    fails = [m for m in [mismatch(got, masked, tol, f"CatsMLP cuda {dtype}")] if m]
    assert not fails, "\n".join(fails)
