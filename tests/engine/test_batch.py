"""Batched decoding (issue 44, ByteCross §3.3, App. F): B sequences in one decode step give, on
CPU float32 and greedy, the tokens batch-1 decoding gives each of them: dense, with TEAL
thresholds (the step reading the union of the kept rows), with SnapKV selection per sequence,
and in a batch mixing selected and dense sequences; a finished sequence frees its slot for a
queued one; bad input is refused in words."""

from __future__ import annotations

import pytest
import torch

from conftest import require_embedded
from quality.test_ppl_protocols import TINY
from sparsedecode.kernels.options import KernelOptions

MODEL = "smollm2-135m"
STORY = " ".join(["The old harbour town grew slowly over the centuries, and its fishermen"] * 24)
PROMPTS = [  # different lengths: each slot sits at its own position
    STORY + " One morning the",
    "def fibonacci(n):\n    ",
    "Notes on the river: " + STORY + " Later that year",
    "1, 2, 3, 4,",
]
LONG = [STORY[:k] + " And then" for k in (1000, 1150, 1300, 1500)]  # long enough to select at keep 0.5
NEW = 8


@pytest.fixture(scope="module")
def engines():
    import sparsedecode

    require_embedded(MODEL)
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    # the batch step is the PyTorch step with B rows, so its batch-1 reference is the PyTorch step
    # (the C step, kernels/cpu_step.c, sums in another order: a TEAL channel at its threshold can flip)
    one = sparsedecode.load(MODEL, device="cpu", dtype="float32", max_len=512, quiet=True,
                            kernels=KernelOptions.parse("cpu.step=false"))
    four = sparsedecode.load(MODEL, device="cpu", dtype="float32", max_len=512, quiet=True, batch=4)
    yield one, four
    del one, four


def _batch1(one, prompts, new, kvs):
    out = []
    for p, kv in zip(prompts, kvs, strict=True):
        one.configure(kv or "dense")
        out.append(one.generate(p, new).ids)
    one.configure("dense")
    return out


@pytest.mark.parametrize("prompts, kvs", [
    pytest.param(PROMPTS, [None] * 4, id="dense"),
    pytest.param(LONG, ["sel0.5"] * 4, id="snapkv-every-sequence"),
    pytest.param(PROMPTS, ["sel0.5", None, "sel0.6", None], id="selected-and-dense-mixed"),
])
def test_a_batch_decodes_each_sequence_as_batch_1_does(engines, prompts, kvs):
    one, four = engines
    want = _batch1(one, prompts, NEW, kvs)
    got = four.generate_batch(prompts, NEW, kv=kvs)
    assert [g.ids for g in got] == want
    assert all(len(g.ids) == NEW for g in got)
    if any(kvs):  # the selected sequences read their compact regions
        assert four.model.layers[0].self_attn.cache.rows is not None
        assert all(g.kv_select_s > 0 for g, kv in zip(got, kvs, strict=True) if kv)


def test_a_selected_sequence_reads_other_entries_than_dense(engines):
    """The selection is real: at a low keep one of the long prompts decodes otherwise."""
    _, four = engines
    long = [PROMPTS[0], PROMPTS[2]]
    dense = [g.ids for g in four.generate_batch(long, 24, kv=[None, None])]
    sel = [g.ids for g in four.generate_batch(long, 24, kv=["sel0.35", "sel0.35"])]
    assert sel != dense


def test_teal_thresholds_in_a_batch_read_the_union_and_match_batch_1(engines):
    one, four = engines
    one.configure("proj0.5")
    try:
        want = [one.generate(p, NEW).ids for p in PROMPTS]
        four.configure("proj0.5", thresholds=one.thresholds)
        for m in four.model.modules():
            if hasattr(m, "union_host"):
                m.track = True
                m.reset_keep()
        got = four.generate_batch(PROMPTS, NEW)
        assert [g.ids for g in got] == want
        from sparsedecode.projection.sparse_linear import sparse_modules

        mods = sparse_modules(four.model)
        unions = [m.realized_union() for m in mods]
        keeps = [m.realized_keep() for m in mods]
        assert all(0.0 < u <= 1.0 for u in unions)
        # the union of B tokens' kept channels holds at least the mean token's keep (u_B >= r_P)
        assert sum(unions) / len(unions) > sum(keeps) / len(keeps)
    finally:
        one.configure("dense")
        four.configure("dense")


def test_a_finished_sequence_frees_its_slot_for_a_queued_one(engines):
    import sparsedecode

    one, _ = engines
    two = sparsedecode.load(MODEL, device="cpu", dtype="float32", max_len=256, quiet=True, batch=2)
    prompts = ["Hello, my name is", "The weather today", "In 1905, Einstein", "Water boils at"]
    new = [3, 10, 6, 4]
    seen = []
    got = two.generate_batch(prompts, new, on_token=lambda i, t: seen.append(i))
    assert [g.ids for g in got] == [one.generate(p, n).ids for p, n in zip(prompts, new, strict=True)]
    assert [len(g.ids) for g in got] == new
    first = {i: seen.index(i) for i in range(4)}
    last = {i: len(seen) - 1 - seen[::-1].index(i) for i in range(4)}
    # prompt 2 waits for a slot: it starts once prompt 0 is done, while prompt 1 still runs
    assert last[0] < first[2] < last[1]
    dec = two._batch_decoder
    assert dec.occupancy / dec.steps <= 2 and dec.live() == []


def test_sampling_is_per_sequence(engines):
    _, four = engines
    p = ["Once upon a time"] * 3
    a = four.generate_batch(p, 10, temperature=0.9, seed=[1, 2, 1])
    assert a[0].ids == a[2].ids  # same seed, same prompt
    assert a[0].ids != a[1].ids


def test_one_prompt_on_a_batch_engine_generates(engines):
    one, four = engines
    assert four.generate(PROMPTS[3], NEW).ids == one.generate(PROMPTS[3], NEW).ids


@pytest.mark.parametrize("batch, needle", [(0, "whole number >= 1"), (-2, "whole number >= 1"),
                                           (1.5, "whole number >= 1"), (True, "whole number >= 1")])
def test_a_bad_batch_is_refused(batch, needle):
    import sparsedecode
    from sparsedecode.errors import InputError

    with pytest.raises(InputError, match=needle):
        sparsedecode.load(dict(TINY), init="random", device="cpu", batch=batch, quiet=True)


def test_a_batch_beyond_memory_is_refused_before_allocation(monkeypatch):
    import sparsedecode
    from sparsedecode.engine import loader
    from sparsedecode.errors import InputError

    monkeypatch.setattr(loader, "free_bytes", lambda dev: 2**20)
    with pytest.raises(InputError, match=r"needs .* GiB and cpu has 0.00 GiB free: lower --batch|lower batch="):
        sparsedecode.load(MODEL, device="cpu", dtype="float32", max_len=4096, batch=64, quiet=True)


def test_bad_requests_are_refused_in_words(engines):
    _, four = engines
    from sparsedecode.errors import InputError

    with pytest.raises(InputError, match="top_p"):
        four.generate_batch(["a", "b"], 4, top_p=[0.5, 1.5])
    with pytest.raises(InputError, match="3 values for 2 prompts"):
        four.generate_batch(["a", "b"], [4, 4, 4])
    with pytest.raises(InputError, match="list of prompts"):
        four.generate_batch("a single string", 4)
    with pytest.raises(InputError, match="projection keep applies to the whole batch"):
        four.generate_batch(["a"], 4, kv=["proj0.5"])
    with pytest.raises(InputError, match="generate_batch"):
        four.prefill([1, 2, 3])
    with pytest.raises(InputError, match="window selection in a decode batch"):
        four.generate_batch([PROMPTS[1], PROMPTS[0]], 4, kv=[None, "window0.5"])
    assert four._batch_decoder.live() == []  # a refused request leaves no slot taken


def test_a_prompt_prefilled_chunk_by_chunk_between_steps_decodes_as_batch_1(engines):
    """A server admits a long prompt one chunk at a time, running the others' steps between
    chunks: both sequences still decode as batch-1 does."""
    from sparsedecode.engine.batch import BatchDecoder, Request

    one, four = engines
    a, b = one.encode(PROMPTS[3]), one.encode(PROMPTS[0])
    dec = BatchDecoder(four)
    dec.admit(0, "a", Request(a, 14))
    between = 0
    for _ in dec.admit_chunks(1, "b", Request(b, 6), chunk=48):
        dec.decode()
        between += 1
    while dec.live():
        dec.decode()
    assert between == -(-len(b) // 48) - 1 > 1
    assert dec.generations["a"].ids == one.generate(a, 14).ids
    assert dec.generations["b"].ids == one.generate(b, 6).ids
