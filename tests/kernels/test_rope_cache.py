"""One-launch RoPE and cache write of a decode token (`kernels.rope_cache`) against `models.rope`:
the reference against apply_rope and index_copy_, the Triton kernel against the reference under
TRITON_INTERPRET=1 (odd head dims, two sequences, a position read on the device) and on CUDA
(also inside torch.compile, where the cache write must be seen by the read after it). The same
for `kernels.rope_attention`, which adds the split-K attention to the launch."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from interpreted import run_interpreted
from sparsedecode.errors import InputError
from sparsedecode.kernels.rope_attention import rope_attention, rope_attention_ref
from sparsedecode.kernels.rope_cache import rope_cache, rope_cache_ref
from sparsedecode.models.rope import apply_rope

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available() and HAS_TRITON


def make(B, Hq, Hkv, D, T, dtype, device="cpu", seed=0):
    """(q, k, v (B, heads * D), cos, sin (T, D) tables, pos, k_cache, v_cache (B, Hkv, T, D))."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h * D, generator=g).to(device, dtype) for h in (Hq, Hkv, Hkv))
    ang = torch.rand(T, D // 2, generator=g) * 6.0
    cos, sin = (torch.cat((f, f), dim=-1).to(device, dtype) for f in (ang.cos(), ang.sin()))
    kc, vc = (torch.randn(B, Hkv, T, D, generator=g).to(device, dtype) for _ in range(2))
    return q, k, v, cos, sin, torch.tensor([T - 2], device=device), kc, vc


def cases(device: str, dtypes) -> list[str]:
    """Failure messages of the kernel against the reference (outputs and every cache row)."""
    fails = []
    for dtype in dtypes:
        for B, Hq, Hkv, D, T in ((1, 4, 2, 8, 5), (2, 6, 2, 12, 7), (1, 32, 8, 128, 9)):
            args = make(B, Hq, Hkv, D, T, dtype, device, seed=D)
            want_caches = [c.clone() for c in args[6:]]
            want = rope_cache_ref(*args[:6], *want_caches)
            got = rope_cache(*args)
            ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10 if dtype == torch.float16 else 22)
            what = f"{dtype} B={B} Hq={Hq} Hkv={Hkv} D={D}"
            for name, a, b in (("q", got, want), ("k_cache", args[6], want_caches[0]),
                               ("v_cache", args[7], want_caches[1])):
                err = (a.float() - b.float()).abs().max().item()
                if a.shape != b.shape or err > 2 * ulp * b.abs().max().item():
                    fails.append(f"{what} {name}: max error {err}")
    traced = torch.compile(lambda *a: (rope_cache(*a), a[6][:, :, a[5]].clone()), backend="aot_eager",
                           fullgraph=True)
    args = make(2, 6, 2, 12, 7, torch.float32, device, seed=1)
    want_caches = [c.clone() for c in args[6:]]
    want = rope_cache_ref(*args[:6], *want_caches)
    q1, row = traced(*args)
    if not (torch.allclose(q1, want) and torch.allclose(args[6], want_caches[0])
            and torch.allclose(row, want_caches[0][:, :, args[5]])):
        fails.append("under torch.compile the cache write must land and be seen by the read after it")
    return fails


def attention_cases(device: str, dtypes) -> list[str]:
    """`rope_attention` (RoPE, cache write and split-K attention in one launch) against
    `rope_cache_ref` then `split_k_ref`: the output, the LSE and every cache row, with the
    position at a split's first and last key, mid-chunk and at 0, one and several splits. The
    caches start random, so a program that attended the stale row at pos would be caught."""
    fails = []
    for dtype in dtypes:
        ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10 if dtype == torch.float16 else 22)
        for B, Hq, Hkv, D, T, p, splits in ((1, 8, 2, 64, 300, 170, 4), (2, 7, 1, 80, 130, 127, 3),
                                            (1, 4, 4, 32, 70, 0, None), (1, 32, 8, 128, 260, 128, 5),
                                            (1, 6, 3, 16, 200, 63, 1)):
            q, k, v, cos, sin, _, kc, vc = make(B, Hq, Hkv, D, T, dtype, device, seed=D + p)
            pos = torch.tensor([p], device=device)
            want_caches = [kc.clone(), vc.clone()]
            want, want_lse = rope_attention_ref(q, k, v, cos, sin, pos, *want_caches)
            got, lse = rope_attention(q, k, v, cos, sin, pos, kc, vc, num_splits=splits)
            what = f"rope_attention {dtype} B={B} Hq={Hq} Hkv={Hkv} D={D} pos={p} splits={splits}"
            for name, a, b, tol in (("out", got, want, 2 * ulp * want.abs().max().item() + 1e-5),
                                    ("lse", lse, want_lse, 1e-4 * want_lse.abs().max().item()),
                                    ("k_cache", kc, want_caches[0], 2 * ulp * want_caches[0].abs().max().item()),
                                    ("v_cache", vc, want_caches[1], 0.0)):
                err = (a.float() - b.float()).abs().max().item()
                if a.shape != b.shape or err > tol:
                    fails.append(f"{what} {name}: max error {err} > {tol}")
    fails += compact_cases(device, dtypes)
    traced = torch.compile(lambda *a: (rope_attention(*a)[0], a[6][:, :, a[5]].clone()), backend="aot_eager",
                           fullgraph=True)
    q, k, v, cos, sin, pos, kc, vc = make(1, 8, 2, 64, 100, torch.float32, device, seed=3)
    want_caches = [kc.clone(), vc.clone()]
    want = rope_attention_ref(q, k, v, cos, sin, pos, *want_caches)[0]
    out, row = traced(q, k, v, cos, sin, pos, kc, vc)
    if not (torch.allclose(out, want, atol=1e-5) and torch.allclose(row, want_caches[0][:, :, pos])):
        fails.append("rope_attention under torch.compile: the cache write must land and be seen by the read after it")
    return fails


def compact_cases(device: str, dtypes) -> list[str]:
    """`rope_attention(..., compact=(k_buf, v_buf, offset))` against its reference: the output,
    the LSE, every row of the buffers and of the caches. The buffers start random past the
    kept entries and at the token's slot, so reading past the slot, or the stale row at it, is
    caught; the angles must be those of the position, not of the slot."""
    fails = []
    for dtype in dtypes:
        ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10 if dtype == torch.float16 else 22)
        for B, Hq, Hkv, D, T, slots, p, off, splits in ((1, 8, 2, 64, 300, 90, 250, 190, 3),
                                                        (2, 6, 3, 16, 130, 40, 100, 61, None),
                                                        (1, 32, 8, 128, 400, 200, 333, 140, 5),
                                                        (1, 4, 4, 32, 64, 8, 20, 20, 1)):
            q, k, v, cos, sin, _, kc, vc = make(B, Hq, Hkv, D, T, dtype, device, seed=D + p)
            g = torch.Generator().manual_seed(p)
            kb, vb = (torch.randn(B, Hkv, slots, D, generator=g).to(device, dtype) for _ in range(2))
            pos, offset = torch.tensor([p], device=device), torch.tensor([off], device=device)
            want = [t.clone() for t in (kb, vb, kc, vc)]
            ref, ref_lse = rope_attention_ref(q, k, v, cos, sin, pos, want[2], want[3], compact=(want[0], want[1], offset))
            got, lse = rope_attention(q, k, v, cos, sin, pos, kc, vc, num_splits=splits, compact=(kb, vb, offset))
            what = f"rope_attention compact {dtype} B={B} Hq={Hq} Hkv={Hkv} D={D} pos={p} offset={off}"
            for name, a, b, tol in (("out", got, ref, 2 * ulp * ref.abs().max().item() + 1e-5),
                                    ("lse", lse, ref_lse, 1e-4 * ref_lse.abs().max().item()),
                                    ("k_buf", kb, want[0], 2 * ulp * want[0].abs().max().item()),
                                    ("v_buf", vb, want[1], 0.0),
                                    ("k_cache", kc, want[2], 2 * ulp * want[2].abs().max().item()),
                                    ("v_cache", vc, want[3], 0.0)):
                err = (a.float() - b.float()).abs().max().item()
                if a.shape != b.shape or err > tol:
                    fails.append(f"{what} {name}: max error {err} > {tol}")
    return fails


def _worker() -> None:
    fails = cases("cpu", (torch.float32, torch.float16)) + attention_cases("cpu", (torch.float32, torch.float16))
    print(json.dumps({"fails": fails}))


def test_reference_matches_apply_rope_and_index_copy():
    q, k, v, cos, sin, pos, kc, vc = make(2, 6, 2, 12, 7, torch.float32)
    kc0, vc0 = kc.clone(), vc.clone()
    out = rope_cache_ref(q, k, v, cos, sin, pos, kc, vc)
    torch.testing.assert_close(out, apply_rope(q.view(2, 6, 1, 12), cos[pos], sin[pos])[:, :, 0])
    kc0.index_copy_(2, pos, apply_rope(k.view(2, 2, 1, 12), cos[pos], sin[pos]))
    vc0.index_copy_(2, pos, v.view(2, 2, 1, 12))
    torch.testing.assert_close(kc, kc0)
    assert torch.equal(vc, vc0)


def test_bad_input_raises_clear_errors():
    q, k, v, cos, sin, pos, kc, vc = make(1, 4, 2, 8, 5, torch.float32)
    with pytest.raises(InputError, match="heads \\* 8"):
        rope_cache_ref(q[:, :6], k, v, cos, sin, pos, kc, vc)
    with pytest.raises(InputError, match="like the cache"):
        rope_cache_ref(q.double(), k, v, cos, sin, pos, kc, vc)
    with pytest.raises(InputError, match="cos and sin"):
        rope_cache_ref(q, k, v, cos[:, :4], sin, pos, kc, vc)
    with pytest.raises(InputError, match="like the cache"):
        rope_cache_ref(q, k, v, cos.double(), sin.double(), pos, kc, vc)
    with pytest.raises(InputError, match="position"):
        rope_cache_ref(q, k, v, cos, sin, pos.float(), kc, vc)
    with pytest.raises(InputError, match="even head dim"):
        rope_cache_ref(q[:, :28], k[:, :14], v[:, :14], cos[:, :7].contiguous(), sin[:, :7].contiguous(), pos,
                       kc[..., :7].contiguous(),
                       vc[..., :7].contiguous())


def test_rope_attention_bad_input_raises_clear_errors():
    """Checked before the device: the same errors on CPU as on CUDA."""
    q, k, v, cos, sin, pos, kc, vc = make(1, 6, 4, 16, 9, torch.float32)
    with pytest.raises(InputError, match="not a multiple of 4 KV heads"):
        rope_attention(q, k, v, cos, sin, pos, kc, vc)
    q, k, v, cos, sin, pos, kc, vc = make(1, 4, 2, 4, 9, torch.float32)
    with pytest.raises(InputError, match="head dim 4"):
        rope_attention(q, k, v, cos, sin, pos, kc, vc)
    q, k, v, cos, sin, pos, kc, vc = make(1, 4, 2, 16, 9, torch.float32)
    with pytest.raises(InputError, match="num_splits"):
        rope_attention(q, k, v, cos, sin, pos, kc, vc, num_splits=0)
    with pytest.raises(InputError, match="like the cache"):
        rope_attention(q.double(), k, v, cos, sin, pos, kc, vc)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernel_under_interpreter():
    report = run_interpreted(__file__, "_worker")
    assert not report["fails"], "\n".join(report["fails"])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and triton")
def test_kernel_on_cuda():
    fails = cases("cuda", (torch.bfloat16, torch.float16, torch.float32))
    assert not fails, "\n".join(fails)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and triton")
def test_rope_attention_on_cuda():
    fails = attention_cases("cuda", (torch.bfloat16, torch.float16, torch.float32))
    assert not fails, "\n".join(fails)


def test_compact_reference_writes_both_and_reads_the_buffer():
    """With a compact buffer the reference's entry lands at slot pos - offset of the buffer and at
    pos of the cache, and its attention is `split_k_ref` over the buffer's first slot + 1 rows."""
    from sparsedecode.kernels.decode_attention import split_k_ref

    q, k, v, cos, sin, pos, kc, vc = make(1, 8, 2, 16, 40, torch.float32, seed=4)  # pos = 38
    kb, vb = torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    offset = torch.tensor([30])
    kc0, vc0 = kc.clone(), vc.clone()
    q_rot = rope_cache_ref(q, k, v, cos, sin, pos, kc0, vc0)
    got = rope_attention_ref(q, k, v, cos, sin, pos, kc, vc, compact=(kb, vb, offset))
    torch.testing.assert_close(kc, kc0)
    assert torch.equal(kb[:, :, 8], kc0[:, :, 38]) and torch.equal(vb[:, :, 8], vc0[:, :, 38])
    torch.testing.assert_close(got, split_k_ref(q_rot, kb, vb, 9))
    with pytest.raises(InputError, match="compact buffers"):
        rope_attention_ref(q, k, v, cos, sin, pos, kc, vc, compact=(kb[..., :8], vb, offset))
    with pytest.raises(InputError, match="compact offset"):
        rope_attention_ref(q, k, v, cos, sin, pos, kc, vc, compact=(kb, vb, offset.float()))


def test_rope_attention_reference_is_rope_then_attention():
    """The reference is the two steps it fuses: the cache rows of `rope_cache_ref` and the
    attention of `split_k_ref` over [0, pos + 1) with the rotated queries."""
    from sparsedecode.kernels.decode_attention import split_k_ref

    q, k, v, cos, sin, pos, kc, vc = make(1, 8, 2, 16, 40, torch.float32, seed=2)
    want_caches = [kc.clone(), vc.clone()]
    q_rot = rope_cache_ref(q, k, v, cos, sin, pos, *want_caches)
    want = split_k_ref(q_rot, *want_caches, int(pos) + 1)
    got = rope_attention_ref(q, k, v, cos, sin, pos, kc, vc)
    torch.testing.assert_close(got, want)
    assert torch.equal(kc, want_caches[0]) and torch.equal(vc, want_caches[1])
