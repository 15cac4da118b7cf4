"""Decode-attention backends against a float64 reference (issue 3, acceptance item 2).

Tolerances are set against the error of a same-precision PyTorch reference
(plain softmax attention computed in the test dtype): a backend may be off by at
most twice that error plus a small floor. The Triton kernel runs on CPU under
TRITON_INTERPRET=1 in a subprocess (the interpreter is chosen when @triton.jit
runs, at import), and on CUDA when there is one.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re

import pytest
import torch
from _compare import mismatch

from interpreted import run_interpreted
from shapes import random_qkv
from sparsedecode.errors import InputError
from sparsedecode.kernels.decode_attention import (
    arrival_counters,
    merge_lse,
    split_k_attention,
    split_k_ref,
)
from sparsedecode.kernels.options import AttentionOptions
from sparsedecode.models.attention import BACKENDS, decode_attention, get_backend, split_k_lse

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FLOOR = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}
HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()


make = random_qkv


def attend(q, k, v, start, end, dtype=torch.float64):
    """Plain softmax attention over [start[b], end[b]) in `dtype`: (out (B, Hq, D), lse (B, Hq))."""
    B, Hq, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    qg = q.to(dtype).view(B, Hkv, Hq // Hkv, D)  # (B, Hkv, G, D)
    s = torch.matmul(qg, k.to(dtype).transpose(-1, -2)) / math.sqrt(D)  # (B, Hkv, G, T)
    pos = torch.arange(T, device=q.device)
    lo = torch.as_tensor(start, device=q.device).reshape(-1, 1, 1, 1)
    hi = torch.as_tensor(end, device=q.device).reshape(-1, 1, 1, 1)
    s = s.masked_fill(~((pos >= lo) & (pos < hi)), -math.inf)
    lse = torch.logsumexp(s.float() if dtype != torch.float64 else s, -1)  # (B, Hkv, G)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = torch.matmul(p, v.to(dtype))  # (B, Hkv, G, D)
    return out.reshape(B, Hq, D), lse.reshape(B, Hq)


def out_tol(q, k, v, start, end, ref64):
    """Twice the error of a same-precision PyTorch reference, plus a floor."""
    same = attend(q, k, v, start, end, dtype=q.dtype)[0]
    return 2 * (same.double() - ref64).abs().max().item() + FLOOR[q.dtype]


def lse_tol(ref_lse):
    finite = ref_lse[torch.isfinite(ref_lse)]  # an empty row's -inf must match exactly
    return 1e-5 * (1 + (finite.abs().max().item() if finite.numel() else 0.0))


def check(got_out, got_lse, q, k, v, start, end, what):
    """Failure messages (possibly none) of one call against float64."""
    ref_out, ref_lse = attend(q, k, v, start, end)
    msgs = [mismatch(got_out, ref_out, out_tol(q, k, v, start, end, ref_out), f"{what} out")]
    if got_lse is not None:
        msgs.append(mismatch(got_lse, ref_lse, lse_tol(ref_lse), f"{what} lse"))
    return [m for m in msgs if m]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("G", [1, 3, 7])
@pytest.mark.parametrize("length", [1, 7, 1000, 4097])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backends_agree_with_float64(backend, length, G, dtype):
    D = 80 if G == 3 else 64  # one odd head dim
    B, Hkv = 2, 2
    q, k, v = make(B, Hkv, G, length + 3, D, dtype, seed=length * 10 + G)
    end = torch.tensor([length, max(1, length // 2)])  # rows of different lengths, slack past end
    out = decode_attention(q, k, v, end, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype
    msgs = check(out, None, q, k, v, 0, end, f"{backend} len={length} G={G} {dtype}")
    assert not msgs, "\n".join(msgs)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_start_offsets(backend, dtype):
    q, k, v = make(2, 2, 3, 1200, 64, dtype, seed=3)
    start, end = torch.tensor([5, 900]), torch.tensor([1100, 1200])
    out = decode_attention(q, k, v, end, start=start, backend=backend)
    msgs = check(out, None, q, k, v, start, end, f"{backend} start offsets {dtype}")
    assert not msgs, "\n".join(msgs)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_end_offset_moves_the_end(backend):
    """A decode step passes its position with end_offset=1: the range is [start, pos + 1)."""
    q, k, v = make(2, 2, 3, 300, 64, torch.float32, seed=4)
    pos = torch.tensor([199, 40])
    out = decode_attention(q, k, v, pos, backend=backend, end_offset=1)
    msgs = check(out, None, q, k, v, 0, pos + 1, f"{backend} end_offset=1")
    assert not msgs, "\n".join(msgs)
    assert (out - decode_attention(q, k, v, pos, backend=backend)).abs().max() > 1e-3  # the offset counts


@pytest.mark.parametrize("end_offset", [0, 1])
def test_cpu_split_k_reads_only_the_valid_entries(end_offset):
    """On CPU the split-K path slices the cache to [start, end): entries past the valid length
    (NaN here) are never read, where a masked read would turn the output NaN (0 * NaN)."""
    q, k, v = make(1, 2, 3, 512, 64, torch.float32, seed=5)
    start, end = torch.tensor([7]), torch.tensor([300 - end_offset])
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 300:], v2[:, :, 300:] = float("nan"), float("nan")
    k2[:, :, :7], v2[:, :, :7] = float("nan"), float("nan")
    out, lse = split_k_lse(q, k2, v2, end, start, end_offset=end_offset)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref_out, ref_lse = split_k_ref(q, k, v, end, start, end_offset=end_offset)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_ref_lse_and_splits(num_splits, dtype):
    q, k, v = make(2, 2, 7, 1030, 96, dtype, seed=num_splits)
    start, end = torch.tensor([0, 17]), torch.tensor([1030, 999])
    out, lse = split_k_ref(q, k, v, end, start, num_splits=num_splits)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    msgs = check(out, lse, q, k, v, start, end, f"split_k_ref S={num_splits} {dtype}")
    assert not msgs, "\n".join(msgs)


def test_split_count_keeps_long_splits_at_short_allocations(monkeypatch):
    """On 132 SMs with 8 KV heads: 33 splits at 128K, but splits of at least min_split_keys keys
    at 2K (17, measured faster on the H200 than 33 or 9), and the count of programs_per_sm alone
    without the floor; off CUDA one split whatever the options."""
    from sparsedecode.kernels import decode_attention as da

    monkeypatch.setattr(da, "_sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    default = AttentionOptions()
    assert da.default_num_splits(131072 + 64, 8, dev) == da.default_num_splits(131072 + 64, 8, dev, 64, default) == 33
    assert da.default_num_splits(2048 + 64, 8, dev) == -(-2112 // default.min_split_keys) == 17
    assert da.default_num_splits(2048 + 64, 8, dev, options=AttentionOptions(min_split_keys=None)) == 33
    assert da.default_num_splits(2048 + 64, 8, dev, options=AttentionOptions(min_split_keys=512)) == 5
    assert da.default_num_splits(131072 + 64, 8, dev, options=AttentionOptions(programs_per_sm=6)) == 99
    assert da.default_num_splits(131072 + 64, 8, torch.device("cpu"), options=AttentionOptions(min_split_keys=None)) == 1
    qkv = make(1, 1, 1, 16, 64, torch.float32)
    for fn in (split_k_ref, split_k_attention) if HAS_TRITON else (split_k_ref,):
        with pytest.raises(InputError, match="AttentionOptions"):  # refused, never read as the defaults
            fn(*qkv, 4, options={"min_split_keys": None})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_of_disjoint_ranges_equals_union(dtype):
    """A window reads sinks [0, 4) and recent entries [600, 1000) in place; merged (App. A)."""
    q, k, v = make(1, 2, 4, 1024, 64, dtype, seed=7)
    sinks = split_k_lse(q, k, v, 4)
    recent = split_k_lse(q, k, v, torch.tensor(1000), torch.tensor(600))
    out, lse = merge_lse([sinks[0], recent[0]], [sinks[1], recent[1]])
    assert out.dtype == dtype
    lo, hi = 0, 1000
    ref_out, ref_lse = attend(q, k, v, lo, hi)
    pos = torch.arange(1024)
    keep = (pos < 4) | ((pos >= 600) & (pos < 1000))
    want_out, want_lse = attend(q, k[:, :, keep], v[:, :, keep], 0, int(keep.sum()))
    tol = 2 * out_tol(q, k[:, :, keep], v[:, :, keep], 0, int(keep.sum()), want_out)
    msgs = [
        mismatch(out, want_out, tol, "merged out"),
        mismatch(lse, want_lse, lse_tol(want_lse), "merged lse"),
    ]
    one_out, one_lse = split_k_lse(q, k, v, hi, lo)
    halves = [split_k_lse(q, k, v, 300, 0), split_k_lse(q, k, v, 1000, 300)]
    two_out, two_lse = merge_lse([h[0] for h in halves], [h[1] for h in halves])
    msgs += [
        mismatch(two_lse, one_lse, lse_tol(ref_lse), "[0,300)+[300,1000) lse vs one call"),
        mismatch(two_out, ref_out, 2 * out_tol(q, k, v, lo, hi, ref_out), "[0,300)+[300,1000) out"),
    ]
    msgs = [m for m in msgs if m]
    assert not msgs, "\n".join(msgs)


def test_empty_range_gives_zero_and_minus_inf():
    q, k, v = make(2, 1, 2, 50, 64, torch.float32)
    out, lse = split_k_ref(q, k, v, torch.tensor([5, 0]), torch.tensor([5, 0]), num_splits=4)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    merged, mlse = merge_lse([out, out], [lse, lse])
    assert not merged.isnan().any() and torch.all(merged == 0) and torch.all(torch.isneginf(mlse))
    live, live_lse = split_k_ref(q, k, v, 20)
    m2, l2 = merge_lse([out, live], [lse, live_lse])
    assert torch.equal(m2, live) and torch.equal(l2, live_lse)


def test_bad_input_raises_clear_errors():
    q, k, v = make(1, 2, 2, 16, 64, torch.float32)
    with pytest.raises(InputError, match="unknown attention backend"):
        get_backend("flash")
    with pytest.raises(InputError, match="float16, bfloat16 or float32"):
        decode_attention(q.double(), k.double(), v.double(), 4)
    with pytest.raises(InputError, match="not a multiple"):
        decode_attention(q[:, :3], k, v, 4)
    with pytest.raises(InputError, match="differ"):
        decode_attention(q, k, v[:, :, :8], 4)
    with pytest.raises(InputError, match="integer tensor"):
        decode_attention(q, k, v, torch.tensor([4.0]))
    with pytest.raises(InputError, match="head dim 300"):
        split_k_attention(*make(1, 1, 1, 16, 300, torch.float16), 4)
    if HAS_TRITON:
        with pytest.raises(InputError, match="arrival_counters"):
            split_k_attention(q, k, v, 4, counters=torch.zeros(1, dtype=torch.int32))


# ---- the Triton kernel under TRITON_INTERPRET=1 (subprocess) -------------------------------


def _lengths_worker(fused: bool, splits: tuple[int, ...]) -> tuple[list[str], int]:
    """Lengths 0, 1, 7, 1000, 1025 x GQA ratios 1, 3, 7 (the two-launch path: each length with
    one ratio) x `splits` against float64.

    Rows of one batch differ in length (row 1 reads half, so length 1 leaves it empty): one
    launch mixes an empty row, a single active split (written directly) and several active
    splits, with inactive ones past them (17 splits of 1000 keys: 16 of 64 keys active)
    or a last one of 1 key (17 splits of 1025: 16 x 64 + 1, which the 16th takes (the fold);
    the CUDA test runs 4097, whose split is 16 x 256 + 1, but the interpreter's time grows with
    the keys it walks).
    """
    fails, n = [], 0
    lengths = (0, 1, 7, 1000, 1025)
    # every length x every ratio on the fused path (the default); on the two-launch path each
    # length once, the ratios taken in turn (the interpreter's time grows with the keys it walks)
    pairs = [(x, g) for x in lengths for g in (1, 3, 7)] if fused else list(zip(lengths, (1, 3, 7, 3, 7), strict=True))
    for i, (length, G) in enumerate(pairs):
        dtype = DTYPES[i % len(DTYPES)]
        D = 80 if G == 3 else 32
        q, k, v = make(2, 2, G, length + 5, D, dtype, seed=length + G)
        end = torch.tensor([length, length // 2])
        for S in splits:
            out, lse = split_k_attention(q, k, v, end, num_splits=S, fused_merge=fused)
            what = f"kernel fused={fused} len={length} G={G} S={S} {dtype}"
            fails += [f"{what}: NaN"] if out.isnan().any() or lse.isnan().any() else []
            fails += check(out, lse, q, k, v, 0, end, what)
            n += 1
    return fails, n


def _counters_worker() -> tuple[list[str], int]:
    """Two fused calls in a row on one counter buffer: back at zero after each, both right."""
    fails = []
    q, k, v = make(2, 3, 2, 700, 64, torch.float16, seed=11)
    counters = arrival_counters(2 * 3, q.device)
    for call, (qi, end) in enumerate(((q, torch.tensor([700, 650])), (-q, torch.tensor([699, 1])))):
        out, lse = split_k_attention(qi, k, v, end, num_splits=7, counters=counters)
        fails += check(out, lse, qi, k, v, 0, end, f"fused call {call + 1} on one counter buffer")
        if torch.any(counters != 0):
            fails.append(f"counters {counters.tolist()} not back at zero after fused call {call + 1}")
    from sparsedecode.kernels import decode_attention as da

    left = {key: buf.tolist() for key, buf in da._COUNTERS.items() if torch.any(buf != 0)}
    fails += [f"cached counters not back at zero: {left}"] if left else []
    return fails, 2


def _interpreter_worker() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: kernel vs float64 and vs split_k_ref.

    The fused-merge path runs every case; the two-launch path (fused_merge=False) the
    first dtype's cases and the lengths sweep at one split count, to keep the file short.
    """
    torch.manual_seed(0)
    fails, n = [], 0
    cases = [  # (B, Hkv, G, T, D, start, end, num_splits)
        (2, 2, 1, 70, 64, 0, [1, 70], 4),
        (2, 1, 3, 200, 80, [3, 0], [150, 7], 3),
        (1, 2, 7, 300, 32, 10, 300, None),
        (1, 1, 4, 130, 128, torch.tensor(2), torch.tensor(129), 8),
        (2, 1, 2, 64, 64, [5, 0], [5, 0], 4),  # empty ranges: 0 and -inf
        (1, 2, 4, 2700, 128, 0, 2600, 40),  # the fused merge over three tiles of 16 partials
    ]
    for dtype, fused in [(d, True) for d in DTYPES] + [(DTYPES[0], False)]:
        for B, Hkv, G, T, D, start, end, S in cases:
            q, k, v = make(B, Hkv, G, T, D, dtype, seed=T + G)
            st = torch.tensor(start) if isinstance(start, list) else start
            en = torch.tensor(end) if isinstance(end, list) else end
            out, lse = split_k_attention(q, k, v, en, st, num_splits=S, fused_merge=fused)
            what = f"kernel fused={fused} {dtype} B={B} Hkv={Hkv} G={G} T={T} D={D} [{start},{end}) S={S}"
            if out.isnan().any() or lse.isnan().any():
                fails.append(f"{what}: NaN")
            if torch.as_tensor(end).max() == torch.as_tensor(start).min():
                ok = bool(torch.all(out == 0) and torch.all(torch.isneginf(lse)))
                fails += [] if ok else [f"{what}: empty range must give 0 and -inf"]
            else:
                fails += check(out, lse, q, k, v, st, en, what)
                r_out, r_lse = split_k_ref(q, k, v, en, st, num_splits=S)
                fails += [m for m in [mismatch(lse, r_lse, 1e-5, what + " lse vs split_k_ref")] if m]
            n += 1
    q, k, v = make(1, 2, 4, 256, 64, torch.float16, seed=1)
    a, b = split_k_attention(q, k, v, 4), split_k_attention(q, k, v, 256, 100)
    out, lse = merge_lse([a[0], b[0]], [a[1], b[1]])
    keep = (torch.arange(256) < 4) | (torch.arange(256) >= 100)
    fails += check(out, lse, q, k[:, :, keep], v[:, :, keep], 0, int(keep.sum()), "kernel merge_lse")
    traced = torch.compile(
        lambda q, k, v, e: split_k_attention(q, k, v, e, num_splits=4), backend="aot_eager", fullgraph=True
    )
    end = torch.tensor([200])
    out, lse = traced(q, k, v, end)  # the custom op traces without a graph break
    fails += check(out, lse, q, k, v, 0, end, "kernel under torch.compile(fullgraph=True)")
    for e in (torch.tensor([150]), 150):  # the kernel adds end_offset to a tensor end, the launcher to an int
        out, lse = split_k_attention(q, k, v, e, 3, num_splits=4, end_offset=1)
        fails += check(out, lse, q, k, v, 3, 151, f"kernel end={e!r} end_offset=1")
    n += 4
    for more in (_lengths_worker(True, (4, 17)), _lengths_worker(False, (17,)), _counters_worker()):
        fails += more[0]
        n += more[1]
    print(json.dumps({"cases": n, "fails": fails}))


def test_fold_tail_rule():
    """The fold: a last split of fewer than BLOCK_N keys goes to the one before it (17 splits of
    1025 keys in 64-key chunks: 16 active, not 17), a longer one stays."""
    from sparsedecode.kernels.split_k_merge import _active_splits, _chunk_len

    def active(length, splits):
        n = torch.tensor(length)
        return int(_active_splits(n, _chunk_len(n, splits, 64), 64))

    assert active(1025, 17) == 16 and active(2049, 17) == 16  # the step at 2K: 128-key chunks
    assert active(1088, 17) == 17 and active(1089, 17) == 9  # a full 64-key tail; 128-key chunks, a 65-key tail
    assert [active(64, 17), active(65, 17), active(0, 17)] == [1, 1, 0]


def _fold_worker() -> None:
    """Split-K attention (fused merge and two launches) against float64 and split_k_ref where the
    tail folds (1025 keys in 17 splits) and where it does not; rope_attention with the new entry
    in the folded tail and elsewhere."""
    from sparsedecode.kernels.rope_attention import rope_attention, rope_attention_ref

    fails, n = [], 0
    for length, G, S in ((1025, 2, 17), (1089, 1, 17), (65, 3, 17), (1025, 4, 4)):
        D = 32
        q, k, v = make(2, 2, G, length + 3, D, torch.float32, seed=length + S)
        end = torch.tensor([length, length - 700 if length > 700 else 1])
        for fused in (True, False):
            out, lse = split_k_attention(q, k, v, end, num_splits=S, fused_merge=fused)
            what = f"fold fused={fused} len={length} G={G} S={S}"
            fails += check(out, lse, q, k, v, 0, end, what)
            r_lse = split_k_ref(q, k, v, end, num_splits=S)[1]
            fails += [m for m in [mismatch(lse, r_lse, 1e-5, what + " lse vs split_k_ref")] if m]
            n += 1
    gen = torch.Generator().manual_seed(5)
    B, Hq, Hkv, D, T = 1, 4, 2, 32, 1100
    q, k, v = (torch.randn(B, h * D, generator=gen) for h in (Hq, Hkv, Hkv))
    ang = torch.randn(T, D // 2, generator=gen)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    for p in (1024, 1000, 1087, 3):  # length p + 1: 1025 and 1001 fold (p in the last split's extension), 1088 and 4 do not
        kc, vc = torch.randn(B, Hkv, T, D, generator=gen), torch.randn(B, Hkv, T, D, generator=gen)
        want_caches = [kc.clone(), vc.clone()]
        pos = torch.tensor([p])
        want, want_lse = rope_attention_ref(q, k, v, cos, sin, pos, *want_caches)
        got, lse = rope_attention(q, k, v, cos, sin, pos, kc, vc, num_splits=17)
        what = f"fold rope_attention pos={p}"
        fails += [m for m in [mismatch(got, want, 1e-4, what), mismatch(lse, want_lse, 1e-4, what + " lse"),
                              mismatch(kc, want_caches[0], 1e-5, what + " k_cache")] if m]
        n += 1
    print(json.dumps({"cases": n, "fails": fails}))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fold_tail_under_interpreter():
    report = run_interpreted(__file__, "_fold_worker")
    assert report["cases"] == 12 and not report["fails"], "\n".join(report["fails"])


def _options_worker() -> None:
    """AttentionOptions reach the custom ops: CPU tensors launched as on a GPU of 4 SMs, one KV
    head of 2 query heads over a 640-key allocation, get 5 splits of at least 128 keys by default,
    8 (2 programs per SM) with min_split_keys=None and 4 with programs_per_sm=1 as well, as each
    launch's grid shows; every result matches float64 and split_k_ref under the same options. The
    same for rope_attention, and under torch.compile, which bakes in the options it was given."""
    from sparsedecode.kernels import decode_attention as da
    from sparsedecode.kernels.rope_attention import rope_attention, rope_attention_ref

    da._device_sms = lambda device: 4  # a subprocess: nothing after it sees the mock
    grids, kernel = [], da._split_kernel

    class Spy:  # records the split count of every launch of the split kernel
        def __getitem__(self, grid):
            grids.append(grid[1])
            return kernel[grid]

    da._split_kernel = Spy()
    fails, want = [], []
    q, k, v = make(1, 1, 2, 640, 32, torch.float32, seed=21)
    end = torch.tensor([600])  # 5 chunks of 128 keys, 5 of 128, or 3 of 192 and a folded tail
    gen = torch.Generator().manual_seed(22)
    qr, kr, vr = (torch.randn(1, h * 32, generator=gen) for h in (2, 1, 1))
    ang = torch.randn(640, 16, generator=gen)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    pos = torch.tensor([599])
    for opts, S in ((AttentionOptions(), 5), (AttentionOptions(min_split_keys=None), 8),
                    (AttentionOptions(programs_per_sm=1, min_split_keys=None), 4)):
        what = f"{opts} (want {S} splits)"
        out, lse = split_k_attention(q, k, v, end, options=opts)
        fails += check(out, lse, q, k, v, 0, end, what)
        r_lse = split_k_ref(q, k, v, end, options=opts)[1]
        fails += [m for m in [mismatch(lse, r_lse, 1e-5, what + " lse vs split_k_ref")] if m]
        kc, vc = k.clone(), v.clone()
        want_caches = [k.clone(), v.clone()]
        r_out, r_lse = rope_attention_ref(qr, kr, vr, cos, sin, pos, *want_caches, options=opts)
        out, lse = rope_attention(qr, kr, vr, cos, sin, pos, kc, vc, options=opts)
        fails += [m for m in [mismatch(out, r_out, 1e-4, what + " rope_attention"),
                              mismatch(lse, r_lse, 1e-4, what + " rope_attention lse"),
                              mismatch(kc, want_caches[0], 1e-5, what + " rope_attention k_cache")] if m]
        want += [S, S]
    opts = AttentionOptions(min_split_keys=None)
    traced = torch.compile(lambda q, k, v, e: split_k_attention(q, k, v, e, options=opts), backend="aot_eager",
                           fullgraph=True)
    out, lse = traced(q, k, v, end)
    fails += check(out, lse, q, k, v, 0, end, "min_split_keys=None under torch.compile")
    want.append(8)
    fails += [] if grids == want else [f"split counts launched {grids}, want {want}"]
    print(json.dumps({"cases": len(want), "fails": fails}))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_options_reach_the_kernel_under_interpreter():
    report = run_interpreted(__file__, "_options_worker")
    assert report["cases"] == 7 and not report["fails"], "\n".join(report["fails"])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_under_interpreter():
    report = run_interpreted(__file__, "_interpreter_worker")
    assert report["cases"] == 65 and not report["fails"], "\n".join(report["fails"])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype,D,G", [(torch.bfloat16, 128, 4), (torch.float16, 80, 7), (torch.float32, 64, 1)])
def test_kernel_compiles_for_hopper(dtype, D, G):
    """Compile (no GPU needed) for sm_90: catches what the interpreter lets through.

    The interpreter runs programs one after another, so it cannot test the fused merge's
    memory order; the PTX can: the partial stores, then a CTA barrier, then the arrival
    as a gpu-scope acq_rel atomic (whose release publishes the whole CTA's stores).
    """
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"triton's compiler API is not available: {e}")
    from sparsedecode.kernels import decode_attention as da
    from sparsedecode.kernels import split_k_merge as merge

    ty = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    block_n, num_warps, num_stages = da._kernel_config(D, dtype)
    block_gm, _, tile_s = merge._merge_blocks(G, D, 66)
    split = dict(HKV=8, G=G, D=D, NUM_SPLITS=66, BLOCK_G=16, BLOCK_N=block_n,
                 BLOCK_D=triton.next_power_of_2(D), BLOCK_GM=block_gm, TILE_S=tile_s,
                 START_T=False, END_T=True, PRECISION="ieee" if dtype == torch.float32 else "tf32",
                 DOT_F32=False, ROPE=False, HALF=D // 2, COMPACT=False)
    split_types = dict(Q=ty, K=ty, V=ty, Out=ty, Count="*i32", Start="*i64", End="*i64", qk_scale="fp32",
                       Knew=ty, Vnew=ty, Cos=ty, Sin=ty, Shift="*i64", KF=ty, VF=ty)
    kernels = [
        (da._split_kernel, dict(split, FUSED=True), split_types, num_stages),
        (da._split_kernel, dict(split, FUSED=True, ROPE=True), split_types, num_stages),  # rope_attention
        (da._split_kernel, dict(split, FUSED=True, ROPE=True, COMPACT=True), split_types, num_stages),  # compact
        (da._split_kernel, dict(split, FUSED=False), split_types, num_stages),
        (merge._merge_kernel, dict(HQ=8 * G, D=D, NUM_SPLITS=66, BLOCK_S=128, TILE_S=16, BLOCK_N=block_n,
                                BLOCK_D=triton.next_power_of_2(D), START_T=False, END_T=True),
         dict(Out=ty, Start="*i64", End="*i64"), 1),
    ]
    for fn, consts, types, stages in kernels:
        names = fn.arg_names
        pointers = {"O_part", "L_part", "Lse"}
        sig = {n: types.get(n, "*fp32" if n in pointers else "i32") for n in names}
        sig.update({n: "constexpr" for n in consts})
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in consts.items()})
        try:
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=num_warps, num_stages=stages))
        except (RuntimeError, FileNotFoundError) as e:
            if "ptxas" in str(e).lower():
                pytest.skip(f"no ptxas for sm_90: {e}")
            raise
        assert compiled.metadata.shared <= 228 * 1024 // 2, "two programs must fit in an H100/H200 SM"
        if consts.get("FUSED"):
            ptx = compiled.asm["ptx"]
            arrive = re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx)
            assert arrive, "the arrival must be a gpu-scope acq_rel atomic add"
            before = ptx[: arrive.start()]
            assert before.rfind("bar.sync") > before.rfind("st.global"), (
                "a CTA barrier must separate the partial stores from the arrival"
            )
            assert re.search(r"atom\.global\.gpu\.\w+\.exch", ptx[arrive.end():]), "the counter reset"
            # launched plainly (docs/kernels/decode_attention.md#pdl): no wait on a grid dependency
            assert "griddepcontrol" not in ptx, "the split kernel must not wait on a grid dependency"


# ---- CUDA -----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("G,D", [(1, 64), (3, 80), (4, 128), (7, 128)])
@pytest.mark.parametrize("length", [1, 7, 1000, 4097])
def test_kernel_on_cuda(length, G, D, dtype):
    q, k, v = make(2, 2, G, length + 40, D, dtype, device="cuda", seed=length + G)
    start, end = torch.tensor([0, length // 3], device="cuda"), torch.tensor([length, length], device="cuda")
    out, lse = split_k_attention(q, k, v, end, start)
    msgs = check(out, lse, q, k, v, start, end, f"cuda kernel len={length} G={G} D={D} {dtype}")
    assert not msgs, "\n".join(msgs)


@gpu
@pytest.mark.parametrize("fused", [True, False])
def test_fold_tail_on_cuda(fused):
    """The fold at the step's shape (8 KV heads, G=4, D=128, a 2112-key allocation: 17 splits)
    for lengths whose tail folds (2049, 2080) and does not (2112), against float64."""
    q, k, v = make(1, 8, 4, 2112, 128, torch.bfloat16, device="cuda", seed=2)
    fails = []
    for length in (2049, 2080, 2112):
        end = torch.tensor([length], device="cuda")
        out, lse = split_k_attention(q, k, v, end, fused_merge=fused)
        fails += check(out, lse, q, k, v, 0, end, f"fold cuda len={length} fused={fused}")
    assert not fails, "\n".join(fails)


@gpu
def test_kernel_in_cuda_graph_and_compile():
    q, k, v = make(1, 8, 4, 5000, 128, torch.bfloat16, device="cuda")
    end = torch.tensor([100], device="cuda")
    attn = torch.compile(lambda q, k, v, e: decode_attention(q, k, v, e), fullgraph=True)
    for fn in (lambda: decode_attention(q, k, v, end), lambda: attn(q, k, v, end)):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        for n in (100, 4097, 5000, 1, 0):
            end.fill_(n)
            graph.replay()
            torch.cuda.synchronize()
            msgs = check(out, None, q, k, v, 0, end, f"graph replay end={n}")
            assert not msgs, "\n".join(msgs)


@gpu
def test_fused_merge_is_stable_over_many_calls():
    """Calls in a row on one counter buffer, alternating inputs: a merge that read a partial
    before it landed (a memory-order bug) would read the previous call's and differ. Every
    call must equal its first result bitwise, which matches the two-launch path and float64."""
    q, k, v = make(2, 8, 4, 9000, 128, torch.bfloat16, device="cuda", seed=5)
    end = torch.tensor([9000, 4097], device="cuda")
    counters = arrival_counters(16, "cuda")
    qs = (q, torch.flip(q, (1,)))
    first = [split_k_attention(x, k, v, end, num_splits=64, counters=counters) for x in qs]
    for x, (out, lse) in zip(qs, first, strict=True):
        two = split_k_attention(x, k, v, end, num_splits=64, fused_merge=False)
        msgs = check(out, lse, x, k, v, 0, end, "fused, 64 splits")
        msgs += [m for m in [mismatch(out, two[0], 1e-2, "fused vs two launches out"),
                             mismatch(lse, two[1], lse_tol(two[1]), "fused vs two launches lse")] if m]
        assert not msgs, "\n".join(msgs)
    for i in range(400):
        out, lse = split_k_attention(qs[i % 2], k, v, end, num_splits=64, counters=counters)
        assert torch.equal(out, first[i % 2][0]) and torch.equal(lse, first[i % 2][1]), f"call {i}"
    torch.cuda.synchronize()
    assert torch.all(counters == 0), counters.tolist()


@gpu
@pytest.mark.parametrize("fused", [True, False])
def test_graph_replays_reuse_the_counters(fused):
    """Three calls per replay on one counter buffer, no memset node; lengths from 0 up."""
    q, k, v = make(2, 8, 4, 5000, 128, torch.bfloat16, device="cuda", seed=6)
    end = torch.tensor([100, 50], device="cuda")
    counters = arrival_counters(16, "cuda")

    def calls():
        return [split_k_attention(q * (i + 1), k, v, end, fused_merge=fused, counters=counters)
                for i in range(3)]

    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = calls()
    for n in (0, 1, 64, 65, 4097, 5000, 0, 3000):
        end.copy_(torch.tensor([n, n // 2]))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.all(counters == 0), f"end={n}: counters {counters.tolist()}"
        for i, (out, lse) in enumerate(outs):
            msgs = check(out, lse, q * (i + 1), k, v, 0, end, f"fused={fused} replay end={n} call {i}")
            assert not msgs, "\n".join(msgs)


@gpu
def test_pdl_chain_between_sparse_gemvs_in_a_graph():
    """The decode step's order, attention then a projection of its output then attention of that,
    with the sparse GEMVs launched as programmatic dependents (each waits for the kernel before
    it) after the plainly launched attention, captured in a graph: what the chain gives without."""
    from sparsedecode.kernels import decode_attention as da
    from sparsedecode.kernels import sparse_gemv as sg

    q, k, v = make(1, 8, 4, 4096, 128, torch.bfloat16, device="cuda", seed=7)
    w = (torch.randn(4096, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(8)) / 64).to(q.dtype)
    thr, ws, end = torch.tensor(0.01, device="cuda"), sg.workspace(4096, "cuda"), torch.tensor([3001], device="cuda")

    from sparsedecode.kernels.options import GemvOptions

    def chain(h, pdl):
        for _ in range(3):  # each launch reads what the one before wrote
            out, _ = da.split_k_attention(h.view(1, 32, 128), k, v, end)
            h = sg.sparse_gemv(out.view(1, 4096), w, thr, ws=ws, options=GemvOptions(pdl=pdl)) * 4.0
        return h

    want = chain(q.view(1, 4096), False)  # the reference chain: plain launches (pdl is the default)
    chain(q.view(1, 4096), True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(q.view(1, 4096), True)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    # the GEMV's split-K atomics add in any order: equal to float32 rounding, not bit for bit
    msg = mismatch(got, want, 2.0**-6 * want.float().abs().max().item(), "PDL chain vs the same without PDL")
    assert msg is None, msg
