"""Sink+recent window read in place (ByteCross App. A) against attention over a gathered copy.

The oracle gathers the retained entries of each row with torch.cat (sinks, then the
recent slice, ranges worked out here in Python ints) and runs plain softmax attention
in float64. Tolerances: four times the error of the same oracle in the test dtype plus
a floor, as for the LSE merge in tests/kernels (two calls, each rounded to the dtype,
then merged). The Triton kernel runs on CPU under TRITON_INTERPRET=1 in a subprocess;
CUDA tests skip without a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from torch import Tensor

from interpreted import run_interpreted
from shapes import random_qkv
from sparsedecode.errors import InputError
from sparsedecode.models.attention import BACKENDS
from sparsedecode.models.window_attention import WINDOW_BACKENDS, window_attention, window_bounds

_spec = importlib.util.spec_from_file_location(
    "_compare", Path(__file__).resolve().parents[1] / "kernels" / "_compare.py"
)
_compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_compare)
mismatch = _compare.mismatch

FLOOR = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}
HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
SINKS, RECENT = 4, 32
# 1: end < sinks; 5: sinks < end <= sinks + recent (ranges would overlap); 37: one past
# sinks + recent (entry 4 is dropped); 300, 4097: long, several kernel blocks. Row 1 reads
# half the length (0 for length 1: an empty row).
LENGTHS = [1, 5, 37, 300, 4097]


make = random_qkv


def kept(end: int, sinks: int, recent: int) -> list[tuple[int, int]]:
    """The window's disjoint [lo, hi) slices at length `end`, in Python ints."""
    sink_hi = min(sinks, end)
    recent_lo = max(sinks, end - recent)
    return [(0, sink_hi), (recent_lo, end)]


def gathered_attention(q, k, v, ends, sinks, recent, dtype=torch.float64, slices=kept):
    """Plain softmax attention over a torch.cat copy of each row's window: ((B, Hq, D), (B, Hq))."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    outs, lses = [], []
    for b, end in enumerate(ends):
        parts = [(lo, hi) for lo, hi in slices(end, sinks, recent) if hi > lo]
        kg = torch.cat([k[b, :, lo:hi] for lo, hi in parts] or [k[b, :, :0]], dim=1)  # (Hkv, n, D)
        vg = torch.cat([v[b, :, lo:hi] for lo, hi in parts] or [v[b, :, :0]], dim=1)
        qg = q[b].to(dtype).view(Hkv, Hq // Hkv, D)  # (Hkv, G, D)
        s = torch.matmul(qg, kg.to(dtype).transpose(-1, -2)) / math.sqrt(D)  # (Hkv, G, n)
        lses.append(torch.logsumexp(s.float() if dtype != torch.float64 else s, -1).reshape(Hq))
        p = torch.softmax(s, -1).nan_to_num(0.0)  # an empty window: output 0
        outs.append(torch.matmul(p, vg.to(dtype)).reshape(Hq, D))
    return torch.stack(outs), torch.stack(lses)


def check(out, lse, q, k, v, ends, sinks, recent, what):
    """Failure messages (possibly none) of a window call against the float64 gathered oracle."""
    want, want_lse = gathered_attention(q, k, v, ends, sinks, recent)
    same = gathered_attention(q, k, v, ends, sinks, recent, dtype=q.dtype)[0]
    tol = 4 * (same.double() - want).abs().max().item() + FLOOR[q.dtype]
    finite = want_lse[torch.isfinite(want_lse)]
    lse_tol = 1e-5 * (1 + (finite.abs().max().item() if finite.numel() else 0.0))
    msgs = [f"{what}: NaN"] if out.isnan().any() or lse.isnan().any() else []
    msgs += [mismatch(out, want, tol, f"{what} out"), mismatch(lse, want_lse, lse_tol, f"{what} lse")]
    return [m for m in msgs if m]


def row_ends(length: int) -> list[int]:
    return [length, length // 2]


@pytest.mark.parametrize("end_kind", ["tensor", "int"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("G", [1, 3, 7])
@pytest.mark.parametrize("length", LENGTHS)
def test_window_equals_gathered_copy(length, G, dtype, end_kind):
    D = 80 if G == 3 else 64  # one odd head dim
    q, k, v = make(2, 2, G, length + 7, D, dtype, seed=length * 10 + G)  # slack past end
    ends = row_ends(length) if end_kind == "tensor" else [length, length]
    end = torch.tensor(ends) if end_kind == "tensor" else length
    out, lse = window_attention(q, k, v, end, SINKS, RECENT, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == q.shape[:2] and lse.dtype == torch.float32
    msgs = check(out, lse, q, k, v, ends, SINKS, RECENT, f"len={length} G={G} {dtype} {end_kind} end")
    assert not msgs, "\n".join(msgs)
    assert torch.equal(window_attention(q, k, v, end, SINKS, RECENT), out)  # return_lse=False


@pytest.mark.parametrize("sinks,recent", [(0, 8), (3, 0), (1, 1), (64, 1000)])
@pytest.mark.parametrize("length", [1, 5, 300, 1100])
def test_other_window_sizes(sinks, recent, length):
    q, k, v = make(2, 2, 3, length + 3, 64, torch.float32, seed=length + sinks)
    ends = row_ends(length)
    end = torch.tensor(ends, dtype=torch.int32)  # the kernel and the bounds take any integer dtype
    out, lse = window_attention(q, k, v, end, sinks, recent, return_lse=True)
    msgs = check(out, lse, q, k, v, ends, sinks, recent, f"sinks={sinks} recent={recent} len={length}")
    assert not msgs, "\n".join(msgs)


@pytest.mark.parametrize("backend", ["sdpa_masked", "sdpa_fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("length", [1, 5, 37, 300, 1100])
def test_sdpa_baselines_read_the_same_window(length, dtype, backend):
    """The masked and fused paths (labelled baselines, App. D) attend the same entries."""
    q, k, v = make(2, 2, 3, length + 5, 64, dtype, seed=length)
    ends = [length, max(1, length // 2)]  # these paths need end >= 1
    for end in (torch.tensor(ends), ends[0]):
        ends_b = ends if isinstance(end, Tensor) else [ends[0]] * 2
        out = window_attention(q, k, v, end, SINKS, RECENT, backend)
        assert out.shape == q.shape and out.dtype == dtype
        _, lse = gathered_attention(q, k, v, ends_b, SINKS, RECENT)  # SDPA gives no LSE
        msgs = check(out, lse.float(), q, k, v, ends_b, SINKS, RECENT, f"{backend} len={length} {dtype}")
        assert not msgs, "\n".join(msgs)


def test_every_engine_backend_has_a_window():
    assert set(BACKENDS) <= set(WINDOW_BACKENDS)


def test_scalar_tensor_end_and_scale():
    q, k, v = make(1, 2, 2, 500, 64, torch.float32, seed=2)
    out = window_attention(q, k, v, torch.tensor(400), SINKS, RECENT, scale=0.5)
    want = window_attention(q * (0.5 * math.sqrt(64)), k, v, 400, SINKS, RECENT)
    assert (out - want).abs().max() < 1e-5


def test_oracle_catches_double_counted_overlap():
    """The tolerance separates the window from its plausible bugs: the recent range not
    clamped to start at `sinks` (overlap counted twice, while end <= sinks + recent) and
    the dense prefix (past sinks + recent)."""
    q, k, v = make(2, 2, 3, 400, 64, torch.bfloat16, seed=9)

    def unclamped(end, sinks, recent):
        return [(0, min(sinks, end)), (max(0, end - recent), end)]

    def dense(end, sinks, recent):
        return [(0, end)]

    for ends, slices, name in (([5, 20], unclamped, "double-counted overlap"),
                               ([300, 37], dense, "dense prefix")):
        right = window_attention(q, k, v, torch.tensor(ends), SINKS, RECENT, return_lse=True)
        assert not check(*right, q, k, v, ends, SINKS, RECENT, "window")
        bad_out, bad_lse = gathered_attention(q, k, v, ends, SINKS, RECENT, slices=slices)
        msgs = check(bad_out.to(q.dtype), bad_lse.float(), q, k, v, ends, SINKS, RECENT, name)
        assert any(" out:" in m for m in msgs) and any(" lse:" in m for m in msgs), name


def test_window_bounds():
    assert [window_bounds(e, 4, 32) for e in (0, 1, 4, 5, 36, 37, 300)] == [
        (0, 4), (1, 4), (4, 4), (4, 4), (4, 4), (4, 5), (4, 268)
    ]
    sink_end, recent_start = window_bounds(torch.tensor([0, 1, 5, 37, 300]), 4, 32)
    assert sink_end.tolist() == [0, 1, 4, 4, 4] and recent_start.tolist() == [4, 4, 4, 5, 268]


def test_bad_input_raises_clear_errors():
    q, k, v = make(1, 2, 2, 16, 64, torch.float32)
    with pytest.raises(InputError, match="unknown window backend 'flash'"):
        window_attention(q, k, v, 8, 4, 4, backend="flash")
    with pytest.raises(InputError, match="returns no LSE"):
        window_attention(q, k, v, 8, 4, 4, backend="sdpa_masked", return_lse=True)
    with pytest.raises(InputError, match="keeps nothing"):
        window_attention(q, k, v, 8, 0, 0)
    for sinks, recent in ((-1, 4), (4, 2.0), (True, 4), (4, torch.tensor(3))):
        with pytest.raises(InputError, match=">= 0"):
            window_attention(q, k, v, 8, sinks, recent)
    with pytest.raises(InputError, match="integer tensor"):
        window_attention(q, k, v, torch.tensor([8.0]), 4, 4)


@pytest.mark.parametrize("backend", ["split_k", "sdpa_masked"])
def test_traces_without_graph_breaks(backend):
    """fullgraph=True fails on a host sync or a Python branch on a tensor value."""
    q, k, v = make(2, 2, 3, 300, 64, torch.float32, seed=4)
    fn = torch.compile(lambda q, k, v, e: window_attention(q, k, v, e, SINKS, RECENT, backend),
                       backend="aot_eager", fullgraph=True)
    for ends in ([300, 20], [37, 2]):
        _, lse = gathered_attention(q, k, v, ends, SINKS, RECENT)
        msgs = check(fn(q, k, v, torch.tensor(ends)), lse.float(), q, k, v, ends, SINKS, RECENT,
                     f"{backend} compiled {ends}")
        assert not msgs, "\n".join(msgs)


# ---- the Triton kernel under TRITON_INTERPRET=1 (subprocess) -------------------------------


def _interpreter_worker() -> None:
    """Kernel backend vs the gathered oracle and vs split_k_ref, on small shapes; prints JSON."""
    fails, n = [], 0
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    for i, (length, G) in enumerate((x, g) for x in (1, 5, 37, 130) for g in (1, 3)):
        dtype = dtypes[i % len(dtypes)]
        q, k, v = make(2, 2, G, length + 5, 32, dtype, seed=length + G)
        for ends, end in ((row_ends(length), torch.tensor(row_ends(length))), ([length] * 2, length)):
            what = f"kernel len={length} G={G} {dtype} end={end!r}"
            out, lse = window_attention(q, k, v, end, SINKS, RECENT, "split_k_kernel", return_lse=True)
            fails += check(out, lse, q, k, v, ends, SINKS, RECENT, what)
            _, r_lse = window_attention(q, k, v, end, SINKS, RECENT, "split_k_ref", return_lse=True)
            fails += [m for m in [mismatch(lse, r_lse, 1e-5, what + " lse vs split_k_ref")] if m]
            n += 1
    q, k, v = make(1, 2, 4, 200, 64, torch.bfloat16, seed=1)
    fn = torch.compile(
        lambda q, k, v, e: window_attention(q, k, v, e, SINKS, RECENT, "split_k_kernel", return_lse=True),
        backend="aot_eager", fullgraph=True,
    )
    fails += check(*fn(q, k, v, torch.tensor([190])), q, k, v, [190], SINKS, RECENT, "kernel compiled")
    print(json.dumps({"cases": n + 1, "fails": fails}))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_under_interpreter():
    report = run_interpreted(__file__, "_interpreter_worker")
    assert report["cases"] == 17 and not report["fails"], "\n".join(report["fails"])


# ---- CUDA -----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("G", [1, 3, 7])
@pytest.mark.parametrize("length", LENGTHS + [70000])
def test_window_on_cuda(length, G, dtype):
    q, k, v = make(2, 8, G, length + 40, 128, dtype, device="cuda", seed=length + G)
    for backend in WINDOW_BACKENDS:  # split_k picks the kernel on CUDA
        split_k = backend.startswith("split_k")
        ends = row_ends(length) if split_k else [length, max(1, length // 2)]  # SDPA: end >= 1
        end = torch.tensor(ends, device="cuda")
        if split_k:
            out, lse = window_attention(q, k, v, end, SINKS, RECENT, backend, return_lse=True)
        else:
            out = window_attention(q, k, v, end, SINKS, RECENT, backend)
            lse = gathered_attention(q, k, v, ends, SINKS, RECENT)[1].float()  # SDPA gives none
        msgs = check(out, lse, q, k, v, ends, SINKS, RECENT, f"cuda {backend} len={length} G={G} {dtype}")
        assert not msgs, "\n".join(msgs)


@gpu
@pytest.mark.parametrize("backend", ["split_k", "sdpa_masked"])
def test_no_host_sync_on_cuda(backend):
    q, k, v = make(2, 8, 4, 5000, 128, torch.bfloat16, device="cuda", seed=3)
    end = torch.tensor([5000, 30], device="cuda")
    window_attention(q, k, v, end, SINKS, RECENT, backend)  # warm up: compile, cache counters
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        window_attention(q, k, v, end, SINKS, RECENT, backend)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@gpu
@pytest.mark.parametrize("backend", ["split_k", "sdpa_masked"])
@pytest.mark.parametrize("compiled", [False, True])
def test_window_in_cuda_graph(compiled, backend):
    """One captured step follows `end` on replay, across the overlap and end < sinks cases."""
    q, k, v = make(2, 8, 4, 5000, 128, torch.bfloat16, device="cuda", seed=6)
    end = torch.tensor([100, 50], device="cuda")

    def step(q, k, v, e):
        return window_attention(q, k, v, e, SINKS, RECENT, backend)

    fn = torch.compile(step, fullgraph=True) if compiled else step
    fn(q, k, v, end)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(q, k, v, end)
    replays = [[100, 50], [1, 2], [5, 3], [36, 37], [5000, 4097], [38, 2]]
    replays += [[1, 0]] if backend == "split_k" else []  # an empty row: 0 and -inf on split-K
    for ends in replays:
        end.copy_(torch.tensor(ends))
        graph.replay()
        torch.cuda.synchronize()
        lse = gathered_attention(q, k, v, ends, SINKS, RECENT)[1].float()  # only out is checked
        msgs = check(out, lse, q, k, v, ends, SINKS, RECENT, f"{backend} replay ends={ends} compiled={compiled}")
        assert not msgs, "\n".join(msgs)
