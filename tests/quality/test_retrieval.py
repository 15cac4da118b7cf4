"""Retrieval tests (ByteCross App. A 'Retrieval tests', App. G): prompt construction,
verdicts, the window's retained region, dense pairing, records, bad input and the CLI.

Decoding runs on a tiny random model given SmolLM2's tokenizer (its vocabulary), with
attention made peaked so that a selection changes the outputs; one test runs the real
SmolLM2 at 384 tokens.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import typer
from typer.testing import CliRunner

import sparsedecode
from sparsedecode.cli import eval_retrieval, use_help_classes
from sparsedecode.cli.eval import eval_app
from sparsedecode.config import KVConfig, ProjectionConfig, SparsityConfig
from sparsedecode.corpus import text_ids, wikitext_path
from sparsedecode.errors import InputError
from sparsedecode.kv.select import get_selector
from sparsedecode.projection.thresholds import Thresholds
from sparsedecode.quality import retrieval as rt
from sparsedecode.records import read_record, stamp, write_record

TINY = dict(model_type="llama", hidden_size=96, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, vocab_size=49152, max_position_embeddings=1024,
            rope_theta=10000.0, eos_token_id=None)
CTX = 320
RECORD_KEYS = {"kind", "test", "model", "device", "dtype", "context", "depths", "trials", "seed", "config",
               "placements", "dense", "configured", "matches_dense"}


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: two busy shared cores make a two-thread forward wait (see
    tests/quality/test_ppl_protocols.py)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    from sparsedecode.models.load import load_tokenizer, resolve

    return load_tokenizer(resolve("smollm2-135m", quiet=True))


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """The first 40,000 characters of WikiText-2 test (about 9K tokens) as a small text file."""
    path = tmp_path_factory.mktemp("text") / "wiki.txt"
    path.write_text(wikitext_path("test").read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny(tok):
    eng = sparsedecode.load(dict(TINY), init="random", device="cpu", dtype="float32", max_len=CTX + 8,
                            compile=False)
    with torch.no_grad():  # peaked attention: the attended entries change the logits
        for layer in eng.model.layers:
            for name, scale in (("q_proj", 12.0), ("k_proj", 12.0), ("v_proj", 20.0), ("o_proj", 20.0)):
                getattr(layer.self_attn, name).weight.mul_(scale)
    eng.tokenizer = tok
    return eng


def _run(eng, test, config=None, text=None, **kw):
    args = dict(context=CTX, depths=(0.05, 0.95), trials=1, seed=0, text_path=text)
    return rt.evaluate_retrieval(eng, test, config, **{**args, **kw})


def snap(keep, **params):
    return SparsityConfig(kv=KVConfig("snapkv", keep, {"window": 16, **params}))


# -- prompts ----------------------------------------------------------------------------
def _frame(tok, intro=rt.PASS_INTRO):
    """Tokens before the body: the template up to the user turn, and the intro."""
    head = rt.chat_pieces(tok, [("user", intro + rt.BODY)], "")[0][0]
    return len(tok(head, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("depth", [0.0, 0.05, 0.5, 0.95, 1.0])
def test_passkey_needle_sits_at_its_depth_within_a_token(tok, depth):
    p = rt.build_placement(tok, "passkey", 512, depth, 0, 0)
    assert len(p.ids) == 512 and p.chat and p.turn_end is None
    s, e = p.needle_span
    assert tok.decode(p.ids[s:e]) == rt.PASS_NEEDLE.format(code=p.expected)
    assert len(p.expected) == 6 and p.expected.isdigit() and p.codes == {"pass key": p.expected}
    head = _frame(tok)
    tail = len(tok(rt.PASS_QUESTION + "<|im_end|>\n<|im_start|>assistant\n" + rt.PASS_PRIMER,
                   add_special_tokens=False)["input_ids"])
    rest = 512 - head - tail - (e - s)  # the body without the needle
    assert s - head == math.floor(depth * rest + 0.5)
    assert tok.decode(p.ids).endswith("What is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is")


def test_codes_and_placements_are_reproducible_by_seed(tok, text):
    stream = text_ids(tok, text)
    a = rt.build_placements(tok, "multikey", 300, (0.25, 0.75), 2, seed=5, stream=stream)
    b = rt.build_placements(tok, "multikey", 300, (0.25, 0.75), 2, seed=5, stream=stream)
    c = rt.build_placements(tok, "multikey", 300, (0.25, 0.75), 2, seed=6, stream=stream)
    assert [p.ids for p in a] == [p.ids for p in b] and [p.codes for p in a] == [p.codes for p in b]
    assert all(p.codes != q.codes for p, q in zip(a, c, strict=True))
    assert len({p.expected for p in a}) == 4  # every (depth, trial) draws its own codes
    # a placement does not depend on the other depths asked for
    alone = rt.build_placement(tok, "multikey", 300, 0.75, 1, 5, stream)
    assert alone.ids == a[3].ids


@pytest.mark.parametrize("test", ["multikey", "two_turn"])
def test_multikey_has_four_distinct_archives_and_the_queried_code_at_its_depth(tok, text, test):
    stream = text_ids(tok, text)
    for depth in (0.05, 0.5, 0.95):
        p = rt.build_placement(tok, test, 400, depth, 0, 3, stream)
        assert len(p.ids) == 400 and len(p.codes) == 4 and set(p.codes) <= set(rt.ARCHIVES)
        assert len(set(p.codes.values())) == 4 and p.codes[p.asked] == p.expected
        prompt = tok.decode(p.ids)
        for name, code in p.codes.items():  # each code in its own needle (and the first answer) only
            answered = "assistant\n" + rt.KEY_ANSWER.format(name=name, code=code) in prompt
            assert answered == (test == "two_turn" and code == p.codes[first_asked(tok, p)])
            assert prompt.count(code) == 1 + answered
            assert prompt.count(rt.KEY_NEEDLE.format(name=name, code=code)) == 1
        s, e = p.needle_span
        assert tok.decode(p.ids[s:e]) == rt.KEY_NEEDLE.format(name=p.asked, code=p.expected)
        head = _frame(tok, rt.KEY_INTRO)
        body_end = prompt_body_end(tok, p)
        rest = body_end - head - (e - s)
        assert s - head == math.floor(depth * rest + 0.5)
        assert prompt.endswith(rt.KEY_QUESTION.format(name=p.asked) + "<|im_end|>\n<|im_start|>assistant\n"
                               + rt.KEY_PRIMER.format(name=p.asked))
        if test == "two_turn":  # the first question asks for another archive, answered in the prompt
            first = first_asked(tok, p)
            assert first != p.asked
            assert tok.decode(p.ids[:p.turn_end]).endswith(
                rt.KEY_QUESTION.format(name=first) + "<|im_end|>\n<|im_start|>assistant\n")


def first_asked(tok, p):
    """two_turn: the archive whose answer opens the tokens after the first question (None: none)."""
    if p.turn_end is None:
        return None
    turn = tok.decode(p.ids[p.turn_end:])
    return next(n for n, c in p.codes.items() if turn.startswith(rt.KEY_ANSWER.format(name=n, code=c)))


def prompt_body_end(tok, p):
    """Where the body ends: the first token of '\\n\\nWhat is' after the last needle."""
    ids = tok("\n\nWhat", add_special_tokens=False)["input_ids"]
    for i in range(len(p.ids) - len(ids), 0, -1):
        if p.ids[i:i + len(ids)] == ids:
            return i
    raise AssertionError("no question after the body")


def test_insert_needles_keeps_the_hay_in_order_and_each_needle_whole():
    hay = list(range(1000, 1100))
    needles = [[-1] * 5, [-2] * 3, [-3] * 4, [-4] * 2]
    for seed in range(30):
        depth = seed / 29
        body, spans = rt.insert_needles(hay, needles, 0, depth, random.Random(seed))
        assert len(body) == 100 + 14 and [t for t in body if t >= 0] == hay
        for (a, b), needle in zip(spans, needles, strict=True):
            assert body[a:b] == needle
        assert spans[0][0] == math.floor(depth * (len(body) - 5) + 0.5)


def test_no_template_means_plain_text_and_the_record_says_so(tok, tiny):
    class Plain:  # the SmolLM2 tokenizer without its chat template
        chat_template = None

        def __call__(self, text, **kw):
            return tok(text, **kw)

        def decode(self, ids, **kw):
            return tok.decode(ids, **kw)

    p = rt.build_placement(Plain(), "passkey", CTX, 0.5, 0, 0)
    assert not p.chat and "<|im_start|>" not in tok.decode(p.ids)
    assert tok.decode(p.ids).endswith("What is the pass key?\n\nThe pass key is")
    tiny.tokenizer = Plain()
    try:
        rec = _run(tiny, "passkey", depths=(0.5,))
    finally:
        tiny.tokenizer = tok
    assert rec["chat_template"] is False


# -- verdicts and the window ----------------------------------------------------------------
def test_verdicts():
    assert rt.verdict(" 123456.", "123456", ["654321"]) == "correct"
    assert rt.verdict(" 654321.", "123456", ["654321", "111111"]) == "distractor"
    assert rt.verdict(" 12345.", "123456", ["654321"]) == "miss"
    assert rt.verdict("", "123456") == "miss"
    assert rt.verdict("654321 then 123456", "123456", ["654321"]) == "distractor"  # the first code counts
    assert rt.verdict("123456 then 654321", "123456", ["654321"]) == "correct"
    assert rt.summary(["correct", "miss", "distractor", "correct"]) == {
        "correct": 2, "total": 4, "distractor": 1, "miss": 1}


def test_in_window_against_the_positions_the_window_keeps():
    assert rt.in_window((0, 2), 100, 30, 4) and rt.in_window((3, 10), 100, 30, 4)
    assert not rt.in_window((4, 10), 100, 30, 4) and not rt.in_window((60, 74), 100, 30, 4)
    assert rt.in_window((60, 75), 100, 30, 4) and rt.in_window((99, 100), 100, 30, 4)
    window = get_selector("window", window=8)
    k = torch.zeros(1, 1, 300, 4)
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(40, 300)
        keep = rng.uniform(0.1, 1.0)
        try:
            budget = window.budget(n, keep, 3)
        except InputError:  # no room for the sinks and the window
            continue
        kept = set(window.select(None, k, n, keep, 3)[0, 0].tolist())
        s = rng.randrange(n)
        e = min(n, s + rng.randint(1, 20))
        assert rt.in_window((s, e), n, budget, window.sinks) == any(t in kept for t in range(s, e))


# -- decoding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("test,variant", [("passkey", None), ("multikey", None), ("two_turn", "kept"),
                                          ("two_turn", "rescored")])
def test_keep_one_reproduces_dense_and_a_selection_changes_outputs(tiny, text, test, variant):
    txt = None if test == "passkey" else text
    dense_cfg = _run(tiny, test, None, txt)
    one = _run(tiny, test, snap(1.0), txt, variant=variant)
    low = _run(tiny, test, snap(0.5), txt, variant=variant)
    assert dense_cfg["config"]["mode"] == one["config"]["mode"] == "dense" and low["config"]["mode"] == "sel"
    assert one["config"]["variant"] == (variant if test == "two_turn" else None)
    outputs = [p["dense"]["output"] for p in dense_cfg["placements"]]
    for rec in (dense_cfg, one, low):  # the dense half never depends on the configuration
        assert [p["dense"]["output"] for p in rec["placements"]] == outputs
    assert [p["configured"]["output"] for p in dense_cfg["placements"]] == outputs
    assert [p["configured"]["output"] for p in one["placements"]] == outputs
    assert [p["configured"]["output"] for p in low["placements"]] != outputs


@pytest.mark.parametrize("test,variant", [("passkey", None), ("two_turn", "kept")])
def test_many_configurations_from_one_prefill_equal_separate_runs(tiny, text, test, variant):
    """One dense prefill per placement serves every configuration; a kept two-turn
    selection rewrites entries past the first turn, so the next configuration must not
    decode from them (it would differ from its separate run)."""
    txt = None if test == "passkey" else text
    configs = [snap(0.5), None, SparsityConfig(kv=KVConfig("window", 0.5, {"window": 16}))]
    args = dict(context=CTX, depths=(0.05, 0.95), trials=1, seed=0, text_path=txt, variant=variant)
    many = rt.evaluate_retrieval_many(tiny, test, configs, **args)
    for cfg, rec in zip(configs, many, strict=True):
        assert rec == _run(tiny, test, cfg, txt, variant=variant)


def test_an_interrupted_run_resumes_from_its_partial_files(tiny, tmp_path, monkeypatch):
    """Placements are appended to one partial file per configuration as they finish; a run
    stopped after two placements resumes after them and ends with the records of a run that
    was never stopped; files of another run are refused."""
    configs = [snap(0.5), None]
    args = dict(context=CTX, depths=(0.05, 0.5, 0.95), trials=1, seed=0)
    whole = rt.evaluate_retrieval_many(tiny, "passkey", configs, **args)
    parts = [tmp_path / "snap.jsonl", tmp_path / "dense.jsonl"]
    real, calls = rt._dense_placement, []

    def stop_at_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(rt, "_dense_placement", stop_at_third)
    with pytest.raises(KeyboardInterrupt):
        rt.evaluate_retrieval_many(tiny, "passkey", configs, partials=parts, **args)
    monkeypatch.setattr(rt, "_dense_placement", real)
    assert [len(p.read_text().splitlines()) for p in parts] == [3, 3]  # a header and two placements
    with open(parts[0], "a") as f:  # a line cut by the interruption is dropped, not read
        f.write('{"depth": 0.9')
    calls.clear()
    monkeypatch.setattr(rt, "_dense_placement", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    resumed = rt.evaluate_retrieval_many(tiny, "passkey", configs, partials=parts, **args)
    assert len(calls) == 1  # only the third placement ran again
    assert json.loads(json.dumps(resumed)) == json.loads(json.dumps(whole))
    with pytest.raises(InputError, match="context differ"):
        rt.evaluate_retrieval_many(tiny, "passkey", configs, partials=parts, **{**args, "context": CTX - 8})
    parts[1].write_text("not a header\n")
    with pytest.raises(InputError, match="names no run"):
        rt.evaluate_retrieval_many(tiny, "passkey", configs, partials=parts, **args)


def test_projection_runs_in_the_configured_decode_only(tiny):
    values = {f"layers.{i}.{s}": 0.5 for i in range(2) for s in "q k v o gate up down".split()}
    th = Thresholds(values=values, method="teal", keep=0.5, model=tiny.name, dims=tiny.dims.to_dict())
    dense = _run(tiny, "passkey")
    rec = _run(tiny, "passkey", SparsityConfig(ProjectionConfig(keep=th.keep)), thresholds=th)
    assert rec["config"]["mode"] == "proj" and rec["config"]["projection"]["runtime"] == "CPU sparse GEMV (kept rows only)"
    assert [p["dense"] for p in rec["placements"]] == [p["dense"] for p in dense["placements"]]
    assert [p["configured"]["output"] for p in rec["placements"]] != [p["dense"]["output"] for p in dense["placements"]]
    assert tiny.thresholds is None  # left dense


def test_window_records_whether_the_needle_is_retained(tiny):
    cfg = SparsityConfig(kv=KVConfig("window", 0.25, {"window": 16}))
    rec = _run(tiny, "passkey", cfg, depths=(0.0, 0.5, 1.0))
    budget = get_selector("window", window=16).budget(CTX, 0.25, 8)
    got = [p["configured"]["in_window"] for p in rec["placements"]]
    assert got == [rt.in_window(tuple(p["needle_span"]), CTX, budget, 4) for p in rec["placements"]]
    assert got == [False, False, True]  # depth 0 follows the template and intro, past the sinks
    assert all(p["configured"]["in_window"] is None for p in _run(tiny, "passkey", snap(0.4))["placements"])


def test_needle_kept_counts_tokens_and_whole_heads():
    # 2 layers x (1 batch, 2 KV heads): the needle [10, 14) kept whole by one head of
    # layer 0, half by the other, not at all by layer 1's heads.
    l0 = torch.tensor([[[0, 10, 11, 12, 13, 50], [0, 1, 10, 11, 40, 50]]])
    l1 = torch.tensor([[[0, 1, 2, 3, 4, 5], [0, 20, 21, 22, 23, 24]]])
    assert rt.needle_kept((10, 14), [l0, l1]) == {"tokens": 6 / 16, "whole": 0.25}
    assert rt.needle_kept((10, 14), [l0[:, :1]]) == {"tokens": 1.0, "whole": 1.0}
    with pytest.raises(InputError, match="non-empty span"):
        rt.needle_kept((5, 5), [l0])


def test_selection_records_the_needle_it_kept(tiny):
    """keep 1.0 keeps every needle token in every head; the window records in_window
    instead; a low keep matches needle_kept recomputed from a selection of its own."""
    one = _run(tiny, "passkey", snap(1.0))
    assert all(p["configured"]["needle_kept"] is None for p in one["placements"])  # no selection ran
    rec = _run(tiny, "passkey", snap(0.3), depths=(0.0, 0.5, 1.0))
    win = _run(tiny, "passkey", SparsityConfig(kv=KVConfig("window", 0.3, {"window": 16})))
    assert all(p["configured"]["needle_kept"] is None for p in win["placements"])
    placements = rt.build_placements(tiny.tokenizer, "passkey", CTX, (0.0, 0.5, 1.0), 1, 0)
    for p, row in zip(placements, rec["placements"], strict=True):
        tiny.reset()
        tiny.prefill(p.ids)
        sel = tiny.select_kv("snapkv", 0.3, 8, indices=True, window=16)
        assert len(sel.kept) == tiny.dims.n_layers and sel.kept[0].shape[-1] == sel.budget
        assert row["configured"]["needle_kept"] == rt.needle_kept(p.needle_span, sel.kept)
        assert 0.0 <= row["configured"]["needle_kept"]["whole"] <= row["configured"]["needle_kept"]["tokens"] <= 1.0
    tiny.clear_kv()
    tiny.reset()


def test_record_round_trip_and_field_names(tiny, text, tmp_path):
    rec = _run(tiny, "two_turn", snap(0.5), text, variant="rescored")
    assert RECORD_KEYS <= set(rec) and rec["kind"] == "retrieval_eval" and rec["test"] == "two_turn"
    assert set(rec["model"]) == {"name", "source", "init", "dims"}
    assert set(rec["config"]) == {"mode", "projection", "kv", "variant"}
    assert rec["config"]["kv"] == {"method": "snapkv", "keep": 0.5, "params": {"window": 16}}
    assert rec["config"]["variant"] == "rescored" and rec["config"]["projection"] is None
    assert set(rec["dense"]) >= {"correct", "total"}
    assert set(rec["configured"]) >= {"correct", "total", "distractor", "miss"}
    for p in rec["placements"]:
        assert {"depth", "trial", "expected", "needle_span", "dense", "configured"} <= set(p)
        assert set(p["dense"]) == {"output", "verdict"}
        assert set(p["configured"]) == {"output", "verdict", "in_window", "needle_kept"}
        assert p["dense"]["verdict"] == rt.verdict(p["dense"]["output"], p["expected"],
                                                   [c for c in p["codes"].values() if c != p["expected"]])
    assert rec["context"] == CTX and rec["depths"] == [0.05, 0.95] and rec["trials"] == 1
    dense = [p["dense"]["verdict"] for p in rec["placements"]]
    conf = [p["configured"]["verdict"] for p in rec["placements"]]
    assert rec["matches_dense"] == all(c == "correct" for d, c in zip(dense, conf, strict=True) if d == "correct")
    path = write_record(tmp_path / "r.json", stamp(rec))
    back = read_record(path)
    assert {k: back[k] for k in rec} == json.loads(json.dumps(rec))
    with pytest.raises(InputError, match="never overwritten"):
        write_record(path, rec)


def test_matches_dense_is_false_when_a_dense_answer_is_lost(tiny, monkeypatch):
    """Verdicts forced: dense right on both placements, the configuration on one."""
    calls = iter(["correct", "correct", "correct", "miss"])
    monkeypatch.setattr(rt, "verdict", lambda *a: next(calls))
    rec = _run(tiny, "passkey")
    assert rec["dense"]["correct"] == 2 and rec["configured"]["correct"] == 1 and rec["matches_dense"] is False


# -- bad input ---------------------------------------------------------------------------------
def test_library_bad_input(tiny, text):
    with pytest.raises(InputError, match="unknown retrieval test 'needle'"):
        _run(tiny, "needle")
    with pytest.raises(InputError, match="exceed the engine's cache"):
        _run(tiny, "passkey", context=CTX + 1)
    with pytest.raises(InputError, match=r"outside \[0, 1\]"):
        _run(tiny, "passkey", depths=(0.5, 1.5))
    with pytest.raises(InputError, match="trials= must be at least 1"):
        _run(tiny, "passkey", trials=0)
    with pytest.raises(InputError, match="cannot hold the 4 sinks"):
        _run(tiny, "passkey", snap(0.05))
    with pytest.raises(InputError, match="give context="):
        _run(tiny, "multikey", None, text, context=100)
    with pytest.raises(InputError, match="needs a text"):
        _run(tiny, "multikey")
    with pytest.raises(InputError, match="unknown two-turn variant"):
        _run(tiny, "two_turn", snap(0.5), text, variant="sideways")
    # kept: the budget at the end of the first question, less the second turn, is too small
    _run(tiny, "two_turn", snap(0.25), text, depths=(0.5,), variant="rescored")
    with pytest.raises(InputError, match="two-turn kept: the selection after the first question"):
        _run(tiny, "two_turn", snap(0.25), text, depths=(0.5,), variant="kept")
    assert tiny.kv is None and tiny.thresholds is None and tiny.pos == 0  # left dense


cli = typer.Typer()
for _name, _fn in (("passkey", eval_retrieval.passkey), ("multikey", eval_retrieval.multikey),
                   ("two-turn", eval_retrieval.two_turn)):
    cli.command(_name)(_fn)
use_help_classes(cli)  # built as the CLI's own commands are: hints name flags


def _cli(*args) -> tuple[int, str, str]:
    """The commands on an app of their own (other `eval` commands are not theirs to test);
    an InputError exits 2 as `sparsedecode.cli.main` makes it."""
    res = CliRunner().invoke(cli, list(args))
    if isinstance(res.exception, InputError):
        return 2, res.stdout, str(res.exception)
    return res.exit_code, res.stdout, res.stderr


def test_commands_are_registered_on_eval():
    names = {c.name for c in eval_app.registered_commands}
    assert {"passkey", "multikey", "two-turn"} <= names


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("bad input must fail before a model loads")

    monkeypatch.setattr(sparsedecode, "load", refuse)


def test_cli_refuses_bad_input_before_loading(no_load, tmp_path):
    cases = [
        (("passkey", "--context", "9000"), "more than the 8,192 that 'smollm2-135m' attends"),
        (("passkey", "--depths", "0.5,1.5"), "outside [0, 1]"),
        (("passkey", "--depths", "0.5,deep"), "depth 'deep' is not a number"),
        (("multikey", "--trials", "0"), "--trials must be >= 1"),
        (("passkey", "--context", "512", "--kv", "snapkv", "--kv-keep", "0.1"), "raise keep to at least"),
        (("passkey", "--kv", "snapkv"), "needs both --kv METHOD and --kv-keep K"),
        (("passkey", "--kv", "snap", "--kv-keep", "0.3"), "did you mean 'snapkv'"),
        (("two-turn", "--variant", "rescored"), "give --kv METHOD --kv-keep K too"),
        (("two-turn", "--kv", "snapkv", "--kv-keep", "0.3", "--variant", "sideways"), "unknown two-turn variant"),
        (("passkey", "--thresholds", str(tmp_path / "none.st")), "no thresholds file"),
        (("passkey", "--thresholds", "t.st", "--proj-keep", "0.5"), "not both"),
        (("passkey", "--kv-param", "pool_kind=max"), "give --kv METHOD --kv-keep K too"),
        (("passkey", "--kv", "snapkv", "--kv-keep", "0.3", "--kv-param", "pool_kind"), "takes KEY=VALUE"),
        (("passkey", "--kv", "snapkv", "--kv-keep", "0.3", "--kv-param", "pool=max"), "has no option pool"),
        (("passkey", "--kv", "snapkv", "--kv-keep", "0.3", "--kv-param", "pool_kind=mean"), "'avg' or 'max'"),
        (("passkey", "--kv", "snapkv", "--kv-keep", "0.3", "--kv-param", "pool_width=4"), "must be odd"),
        (("passkey", "--kv", "snapkv", "--kv-keep", "0.3", "--kv-param", "window=32"), "use --obs N"),
    ]
    (tmp_path / "r.json").write_text("{}")
    cases.append((("passkey", "--out", str(tmp_path / "r.json")), "never overwritten"))
    for args, message in cases:
        code, _, err = _cli(*args)
        assert code == 2 and message in err, (args, err)


def test_cli_kv_param_reaches_the_selector(tiny, monkeypatch, tmp_path):
    monkeypatch.setattr(sparsedecode, "load", lambda ref, **kw: tiny)
    out = tmp_path / "pk.json"
    code, _, err = _cli("passkey", "--context", str(CTX), "--depths", "0.5", "--trials", "1", "--kv", "snapkv",
                        "--kv-keep", "0.5", "--obs", "16", "--kv-param", "pool_kind=max", "--kv-param",
                        "pool_width=5", "--out", str(out))
    assert code == 0, err
    assert read_record(out)["config"]["kv"]["params"] == {"window": 16, "pool_kind": "max", "pool_width": 5}
    assert not rt.partial_path(out).exists()  # the record written, its partial file goes


def test_cli_resumes_from_the_partial_file_of_an_interrupted_run(tiny, monkeypatch, tmp_path):
    """`eval passkey --out F` keeps finished placements beside F: after a crash at the second
    placement, the same command decodes only the rest and writes the whole record."""
    monkeypatch.setattr(sparsedecode, "load", lambda ref, **kw: tiny)
    out = tmp_path / "pk.json"
    argv = ("passkey", "--context", str(CTX), "--depths", "0.2,0.8", "--trials", "1", "--out", str(out))
    real, calls = rt._dense_placement, []

    def crash_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the machine went away")
        return real(*a, **k)

    monkeypatch.setattr(rt, "_dense_placement", crash_second)
    code, _, _ = _cli(*argv)
    assert code != 0 and not out.exists() and rt.partial_path(out).exists()
    calls.clear()
    monkeypatch.setattr(rt, "_dense_placement", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    code, _, err = _cli(*argv)
    assert code == 0, err
    assert len(calls) == 1 and [p["depth"] for p in read_record(out)["placements"]] == [0.2, 0.8]
    assert not rt.partial_path(out).exists()


def test_cli_writes_a_record_and_prints_json(tiny, text, monkeypatch, tmp_path):
    monkeypatch.setattr(sparsedecode, "load", lambda ref, **kw: tiny)
    out = tmp_path / "multikey.json"
    code, stdout, err = _cli("multikey", "--context", str(CTX), "--depths", "0.1,0.9", "--trials", "1",
                             "--kv", "window", "--kv-keep", "0.5", "--obs", "16", "--text-file", str(text),
                             "--out", str(out), "--json")
    assert code == 0, err
    rec = json.loads(out.read_text())
    shown = json.loads(stdout)
    assert shown["correct"] == rec["configured"]["correct"] and shown["total"] == 2
    assert {k: shown[k] for k in rec} == rec and "env" in rec and "timestamp" in rec
    assert rec["config"]["mode"] == "window" and rec["text"]["file"] == str(text)
    assert [p["depth"] for p in rec["placements"]] == [0.1, 0.9]
    assert all(isinstance(p["configured"]["in_window"], bool) for p in rec["placements"])
    code, stdout, err = _cli("passkey", "--context", str(CTX), "--depths", "0.5", "--trials", "2")
    assert code == 0, err
    assert "matches dense: yes" in stdout and stdout.splitlines()[3].split()[:3] == ["0.5", "0/2", "0/2"]


@pytest.mark.slow
def test_smollm2_finds_the_pass_key(embedded_engine):
    """The real model answers the passkey at 384 tokens, and keep 1 answers the same."""
    eng = embedded_engine("smollm2-135m")
    rec = rt.evaluate_retrieval(eng, "passkey", snap(1.0), context=384, depths=(0.1, 0.9), trials=1)
    assert rec["dense"]["correct"] == 2 and rec["configured"]["correct"] == 2 and rec["matches_dense"]
    assert all(p["dense"]["output"].strip().startswith(p["expected"]) for p in rec["placements"])
