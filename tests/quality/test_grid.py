"""The composition grid (ByteCross App. H; issue 7): its settings, one shared dense run,
resuming an interrupted grid without scoring a finished setting again, refusing records
made with other options, the table, and one real run on a tiny random model."""

from __future__ import annotations

import inspect
import json
import math
import typing

import pytest
import torch

import sparsedecode
import sparsedecode.projection.calibrate as calibrate
import sparsedecode.quality.grid as grid_module
import sparsedecode.quality.perplexity as perplexity
from sparsedecode.cli import main
from sparsedecode.cli.eval import ppl as ppl_command
from sparsedecode.cli.eval_grid import grid as grid_command
from sparsedecode.errors import InputError
from sparsedecode.projection.thresholds import Thresholds
from sparsedecode.quality.bootstrap import paired_bootstrap
from sparsedecode.quality.grid import Setting, markdown, parse_keeps, row, run_grid, settings

TINY = dict(model_type="llama", hidden_size=96, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, vocab_size=100, max_position_embeddings=1024,
            rope_theta=10000.0, eos_token_id=None)
SITES = "q k v o gate up down".split()
LOAD = sparsedecode.load  # the fixtures below replace it
SHORT = ("--windows", "2", "--length", "160", "--scored", "32", "--obs", "16", "--resamples", "300")


class WordTokenizer:
    """Text of integers -> ids: the random model has no tokenizer of its own."""

    def __call__(self, text, **kw):
        return {"input_ids": [int(w) % 100 for w in text.split()]}


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: see tests/quality/test_ppl_protocols.py
    yield
    torch.set_num_threads(n)


def _engine(name: str | None = None):
    eng = LOAD(dict(TINY), init="random", device="cpu", dtype="float32", max_len=704)
    with torch.no_grad():  # peaked attention, so the KV selection changes the logits
        for layer in eng.model.layers:
            for proj, scale in (("q_proj", 12.0), ("k_proj", 12.0), ("v_proj", 20.0), ("o_proj", 20.0)):
                getattr(layer.self_attn, proj).weight.mul_(scale)
    eng.tokenizer = WordTokenizer()
    if name is not None:
        eng.name = name
    return eng


@pytest.fixture(scope="module")
def tiny():
    return _engine()


@pytest.fixture
def text(tmp_path):
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "text.txt"
    path.write_text(" ".join(str(int(t)) for t in torch.randint(0, 100, (3000,), generator=g)))
    return str(path)


@pytest.fixture
def model(monkeypatch, tiny):
    """`sparsedecode.load` returns the tiny engine; `cached_teal` thresholds at keep k
    without calibrating (threshold 0.05 k: lower keeps drop more)."""
    def teal(eng, keep, **kw):
        values = {f"layers.{i}.{s}": 0.05 * (1.0 - keep) / 0.5 for i in range(2) for s in SITES}
        return Thresholds(values=values, method="teal", keep=keep, model=eng.name, dims=eng.dims.to_dict())

    monkeypatch.setattr(sparsedecode, "load", lambda ref, **kw: tiny)
    monkeypatch.setattr(calibrate, "cached_teal", teal)
    return tiny


class FakeEvaluate:
    """Per-window NLLs that grow as keeps fall; counts its calls by mode and can fail
    after `fail_after` calls (an interrupted grid)."""

    def __init__(self, fail_after: int | None = None):
        self.calls: list[str] = []
        self.fail_after = fail_after

    def nll(self, config, k: int) -> float:
        p = 1.0 if config is None or config.projection is None else config.projection.keep
        kv = 1.0 if config is None or config.kv is None else config.kv.keep
        return 100.0 + 10 * k + 20.0 * (1 - p) + 3.0 * (1 - kv)

    def __call__(self, engine, ids, protocol, config=None, *, windows, length, scored, **kw):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise RuntimeError("interrupted")
        self.calls.append("dense" if config is None else config.mode)
        starts = perplexity.decode_starts(len(ids), windows, length)
        return perplexity.WindowNLL("decode", [self.nll(config, k) for k in range(windows)],
                                    [scored] * windows, starts)


def _cli(capsys, *args) -> tuple[int, str, str]:
    try:
        main(["eval", "grid", *args])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


# -- settings --------------------------------------------------------------------------
def test_settings_are_the_composition_grid_of_app_h():
    grid = settings([0.7, 0.6, 0.5], [0.5, 0.3, 0.2], "snapkv")
    assert len(grid) == 16 and grid[0] == Setting() and grid[0].name == "dense"
    assert [s.name for s in grid[1:7]] == ["proj0.7", "proj0.6", "proj0.5", "snapkv0.5", "snapkv0.3", "snapkv0.2"]
    assert grid[7].name == "proj0.7_snapkv0.5" and grid[-1] == Setting(0.5, 0.2, "snapkv")
    assert len({s.name for s in grid}) == 16
    # keep 1 is the branch off, already in the grid; repeats count once
    assert settings([0.7, 1.0, 0.7], [1.0], "window") == [Setting(kv_method="window"), Setting(0.7, 1.0, "window")]
    assert parse_keeps("0.7, 0.6,,0.7", "--proj-keeps") == [0.7, 0.6] and parse_keeps("", "x") == []
    with pytest.raises(InputError, match="--kv-keeps 1.5 is outside"):
        parse_keeps("0.5,1.5", "--kv-keeps")


def test_grid_defaults_are_those_of_eval_ppl():
    """The options the grid shares with `eval ppl` keep its defaults, except the protocol:
    the KV branch is scored with the decode protocol only."""
    mine, theirs = inspect.signature(grid_command).parameters, inspect.signature(ppl_command).parameters
    hints = [typing.get_type_hints(f, include_extras=True) for f in (grid_command, ppl_command)]
    shared = [n for n in mine if n in theirs and n not in ("out", "kv", "json_out")]
    assert len(shared) == 14  # adapter since issue 45
    for n in shared:
        if n == "protocol":
            assert (mine[n].default, theirs[n].default) == ("decode", "chunked")
        else:
            assert mine[n].default == theirs[n].default, n
            assert hints[0][n] == hints[1][n], n  # the same option, help text and all


# -- resume ------------------------------------------------------------------------------
def test_interrupted_grid_resumes_without_scoring_finished_settings(capsys, monkeypatch, model, text, tmp_path):
    out = tmp_path / "grid"
    args = ("--proj-keeps", "0.7,0.5", "--kv-keeps", "0.3", "--text-file", text, "--out", str(out), *SHORT)
    # dense, proj0.7, proj0.5, snapkv0.3, proj0.7_snapkv0.3, proj0.5_snapkv0.3
    fake = FakeEvaluate(fail_after=3)
    monkeypatch.setattr(perplexity, "evaluate", fake)
    with pytest.raises(RuntimeError, match="interrupted"):
        _cli(capsys, *args)
    assert fake.calls == ["dense", "proj", "proj"]
    done = {p.name: p.read_bytes() for p in out.glob("*.json")}
    assert sorted(done) == ["dense.json", "proj0.5.json", "proj0.7.json"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp file left behind

    fake = FakeEvaluate()
    monkeypatch.setattr(perplexity, "evaluate", fake)
    code, stdout, err = _cli(capsys, *args)
    assert code == 0, err
    assert fake.calls == ["sel", "both", "both"]  # neither dense nor a finished setting again
    assert {n: (out / n).read_bytes() for n in done} == done  # finished records untouched
    assert "3 settings scored now, 3 read from" in stdout

    fake = FakeEvaluate()
    monkeypatch.setattr(perplexity, "evaluate", fake)
    code, stdout, err = _cli(capsys, *args, "--json")
    assert code == 0 and fake.calls == []  # a finished grid scores nothing
    res = json.loads(stdout)
    assert res["kind"] == "ppl_grid" and res["scored_now"] == []
    rows = {r["setting"]: r for r in res["settings"]}
    assert list(rows) == ["dense", "proj0.7", "proj0.5", "snapkv0.3", "proj0.7_snapkv0.3", "proj0.5_snapkv0.3"]

    # every record pairs its configuration with the one dense run; ΔPPL is that of the fake NLLs
    dense = json.loads((out / "dense.json").read_text())
    assert dense["kind"] == "ppl_eval" and dense["config"]["mode"] == "dense" and "env" in dense
    ppl = lambda c: math.exp(sum(fake.nll(c, k) for k in range(2)) / 64)  # noqa: E731
    for name, r in rows.items():
        rec = json.loads((out / ("dense.json" if name == "dense" else f"{name}.json")).read_text())
        assert rec["dense"] == dense["dense"] and rec["seconds"] >= 0, name
        p, kv = r["proj_keep"], r["kv_keep"]
        want = math.exp(sum(100.0 + 10 * k + 20.0 * (1 - p) + 3.0 * (1 - kv) for k in range(2)) / 64)
        assert r["ppl"] == pytest.approx(want, rel=1e-12), name
        assert r["delta"]["point"] == pytest.approx(want - ppl(None), rel=1e-9, abs=1e-12), name
    assert rows["dense"]["delta"] == {"point": 0.0, "low": 0.0, "high": 0.0}
    assert rows["proj0.5_snapkv0.3"]["mode"] == "both" and rows["snapkv0.3"]["kv_method"] == "snapkv"
    assert rows["proj0.5"]["delta"]["point"] > rows["proj0.7"]["delta"]["point"] > 0

    # the table: printed, and written as DIR/grid.md
    lines = (out / "grid.md").read_text().splitlines()
    assert lines[2].startswith("| setting | mode | proj keep | kv keep | realized keep | PPL | ΔPPL | 95% interval |")
    assert len(lines) == 4 + 6 and lines[-1].startswith("| proj0.5_snapkv0.3 | both | 0.5 | 0.3 |  | ")


def test_grid_refuses_records_made_with_other_options(capsys, monkeypatch, model, text, tmp_path):
    out = tmp_path / "grid"
    base = ("--proj-keeps", "0.5", "--kv-keeps", "0.3", "--text-file", text, "--out", str(out))
    fake = FakeEvaluate()
    monkeypatch.setattr(perplexity, "evaluate", fake)
    code, _, err = _cli(capsys, *base, *SHORT)
    assert code == 0 and fake.calls == ["dense", "proj", "sel", "both"], err
    other = _engine("another-model")

    # another window shape: refused before a model loads
    monkeypatch.setattr(sparsedecode, "load", lambda *a, **k: pytest.fail("loaded a model"))
    code, _, err = _cli(capsys, *base, *SHORT[:2], "--length", "128", *SHORT[4:])
    assert code == 2 and "protocol_params.length = 160, this grid runs protocol_params.length = 128" in err
    code, _, err = _cli(capsys, *base, *SHORT[:-1], "500")
    assert code == 2 and "bootstrap.resamples = 300" in err

    # another model: refused once it is loaded, before anything is scored
    monkeypatch.setattr(sparsedecode, "load", lambda *a, **k: other)
    code, _, err = _cli(capsys, *base, *SHORT)
    assert code == 2 and "dense.json was made with model.name = " in err and "'another-model'" in err
    assert "rerun with the options the folder was made with, or give another --out" in err

    # the same name, another KV observation window: the setting's record is not this setting
    monkeypatch.setattr(sparsedecode, "load", lambda *a, **k: model)
    code, _, err = _cli(capsys, *base, *SHORT[:6], "--obs", "8", *SHORT[8:])
    assert code == 2 and "snapkv0.3.json holds config.kv = " in err and "'window': 8" in err

    # a record of another text dropped into the folder
    stray = json.loads((out / "proj0.5.json").read_text())
    stray["text"]["tokens"] = 2999
    (out / "stray.json").write_text(json.dumps(stray))
    code, _, err = _cli(capsys, *base, *SHORT)
    assert code == 2 and "stray.json was made with text.tokens = 2999, this grid runs text.tokens = 3000" in err
    assert len(fake.calls) == 4  # nothing was scored by any refused run


def test_reclaim_reaches_run_grid(capsys, monkeypatch, model, text, tmp_path):
    """--reclaim is how a user takes over claims of a worker on another host that died
    (several workers on one folder: tests/quality/test_grid_claims.py)."""
    seen = []

    def run_grid(*args, **kw):
        seen.append(kw["reclaim"])
        raise RuntimeError("stop")

    monkeypatch.setattr(grid_module, "run_grid", run_grid)
    for extra in ((), ("--reclaim",)):
        with pytest.raises(RuntimeError, match="stop"):
            _cli(capsys, "--kv-keeps", "", "--text-file", text, "--out", str(tmp_path / "g"), *SHORT, *extra)
    assert seen == [False, True]


def test_bad_options_fail_before_loading(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(sparsedecode, "load", lambda *a, **k: pytest.fail("loaded a model"))
    out = ("--out", str(tmp_path / "g"))
    code, _, err = _cli(capsys, *out, "--protocol", "chunked")
    assert code == 2 and "--kv-keeps '' for a projection-only grid" in err
    code, _, err = _cli(capsys, *out, "--kv", "nope")
    assert code == 2 and "nope" in err
    code, _, err = _cli(capsys, *out, "--proj-keeps", "0.7,0")
    assert code == 2 and "--proj-keeps 0 is outside (0, 1]" in err
    code, _, err = _cli(capsys, *out, "--length", "256", "--scored", "512")
    assert code == 2 and "--length 256 must exceed --scored 512" in err
    (tmp_path / "file").write_text("1 2 3")
    code, _, err = _cli(capsys, "--out", str(tmp_path / "file"), "--text-file", str(tmp_path / "file"))
    assert code == 2 and "is a file; give a folder" in err


def test_run_grid_refuses_a_setting_scored_on_other_windows(tmp_path):
    def rec(mode, starts):
        w = {"protocol": "decode", "nll": [1.0, 2.0], "targets": [4, 4], "starts": starts, "ppl": 1.5}
        return {"kind": "ppl_eval", "config": {"mode": mode, "projection": None, "kv": None},
                "dense": w, "configured": w}

    grid = settings([], [0.5], "window")
    with pytest.raises(InputError, match="setting window0.5 was scored on other windows than dense.json"):
        run_grid(tmp_path, grid, {}, lambda: rec("dense", [0, 10]), lambda s, d: rec("window", [0, 11]), obs=16)
    assert [p.name for p in tmp_path.iterdir()] == ["dense.json"]  # the dense record stays


def test_row_shows_a_realized_keep_when_the_record_has_one():
    iv = {"point": 0.5, "low": 0.25, "high": 0.75}
    rec = {"config": {"mode": "proj", "projection": {"method": "teal", "keep": 0.5, "realized_keep": 0.516},
                      "kv": None},
           "bootstrap": {"dense": iv, "config": {**iv, "point": 9.5}, "delta": iv, "level": 0.9}}
    r = row(rec, "proj0.5")
    assert (r["proj_keep"], r["kv_keep"], r["realized_keep"], r["ppl"]) == (0.5, 1.0, 0.516, 9.5)
    assert markdown([r]).splitlines()[0].endswith("| 90% interval |")
    assert markdown([r]).splitlines()[2] == "| proj0.5 | proj | 0.5 | 1 | 0.516 | 9.5000 | +0.5000 | [+0.2500, +0.7500] |"


# -- a real run -------------------------------------------------------------------------------
def test_grid_on_a_tiny_model_pairs_every_setting_with_one_dense_run(capsys, monkeypatch, model, text, tmp_path):
    calls = []
    real = perplexity.evaluate
    monkeypatch.setattr(perplexity, "evaluate", lambda eng, ids, protocol, config=None, **kw: (
        calls.append(config.mode), real(eng, ids, protocol, config, **kw))[1])
    out = tmp_path / "grid"
    code, stdout, err = _cli(capsys, "--proj-keeps", "0.5", "--kv-keeps", "0.5", "--text-file", text,
                             "--out", str(out), *SHORT, "--json")
    assert code == 0, err
    assert calls == ["dense", "proj", "sel", "both"]  # dense once
    res = json.loads(stdout)
    dense = json.loads((out / "dense.json").read_text())["dense"]
    assert dense["nll"] == real(model, WordTokenizer()(open(text).read())["input_ids"], "decode",
                                windows=2, length=160, scored=32).nll
    for r in res["settings"][1:]:
        rec = json.loads((out / f"{r['setting']}.json").read_text())
        assert rec["dense"] == dense and rec["configured"]["starts"] == dense["starts"]
        assert rec["configured"]["nll"] != dense["nll"], r["setting"]  # each branch changes the loss
        again = paired_bootstrap(dense["nll"], rec["configured"]["nll"], dense["targets"], resamples=300)
        assert again.to_dict() == rec["bootstrap"], r["setting"]
