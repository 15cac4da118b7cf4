"""One timing cell (ByteCross App. A 'Timing', §4.2) on a tiny random model on CPU: the
record contract, its numbers against the byte account, the stream it decodes, and the
errors that say what to do."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sparsedecode.account import ModelDims, bounds, step_bytes
from sparsedecode.cli import app
from sparsedecode.engine.engine import Engine
from sparsedecode.errors import InputError
from sparsedecode.kernels.cpu_gemv import has_entry
from sparsedecode.timing.cell import CellSpec, cell_config, run_cell, timed_step_bytes

TINY = dict(model_type="llama", hidden_size=96, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, vocab_size=100, max_position_embeddings=512,
            rope_theta=10000.0, eos_token_id=None)
N = 128
CONTRACT = {
    "kind", "status", "campaign", "block", "group", "cell", "order", "model", "model_name", "dtype",
    "device", "gpu", "label", "mode", "mode_spec", "projection_keep", "kv_keep", "proj_method",
    "kv_method", "attention", "compile_mode", "context", "generated", "fill", "stream", "step_ms_runs",
    "tokens_per_sec_runs", "tokens_per_sec", "ms_per_token", "step_ms_median",
    "realized_projection_keep", "kv_budget", "kv_read_fraction", "bytes_per_step", "byte_bound",
    "achieved_gbps", "peak_memory_bytes", "one_time", "selection",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A config.json of a tiny llama (init='random' builds it from the config)."""
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def spec(model: str, **kw) -> CellSpec:
    base = dict(model=model, init="random", dtype="float32", device="cpu", context=N, warmup=2,
                repeats=2, steps=3, obs=16, calib_tokens=256)
    return CellSpec(**(base | kw))


@pytest.mark.parametrize("mode", ["dense", "proj0.5", "sel0.5", "window0.5", "both0.5/0.5"])
def test_record_holds_the_contract_and_agrees_with_the_byte_account(tiny, mode):
    rec = run_cell(spec(tiny, mode=mode, block=1, group="g", campaign="c", order=7))
    missing = CONTRACT - set(rec)
    assert not missing, f"record lacks {sorted(missing)}"
    m = cell_config(mode)
    assert (rec["kind"], rec["status"], rec["mode"], rec["mode_spec"], rec["cell"]) == (
        "timing_cell", "ok", m.kind, mode, m.cell)
    assert (rec["campaign"], rec["block"], rec["group"], rec["order"]) == ("c", 1, "g", 7)
    assert (rec["device"], rec["gpu"], rec["label"], rec["dtype"]) == ("cpu", "CPU", "CPU", "float32")
    assert rec["model"]["init"] == "random" and rec["model_name"] == rec["model"]["name"]
    assert rec["stream"].startswith("random ids") and rec["fill"] == "prefill"
    load = rec["phases"]["load"]  # where load_s went: phases that add up to at most it
    assert set(load) == {"resolve_s", "build_s", "cache_s", "engine_s"} and min(load.values()) >= 0
    assert sum(load.values()) <= rec["one_time"]["load_s"] and rec["phases"]["capture"] == {}  # no graph on CPU

    # timings: the paper's ms_per_token is 1000 / mean of the per-repeat throughputs
    runs, tps = rec["step_ms_runs"], rec["tokens_per_sec_runs"]
    assert len(runs) == 2 and all(ms > 0 for ms in runs)
    assert tps == pytest.approx([1e3 / ms for ms in runs])
    assert rec["tokens_per_sec"] == pytest.approx(statistics.fmean(tps))
    assert rec["ms_per_token"] == pytest.approx(1e3 / statistics.fmean(tps)) and rec["ms_per_token"] > 0
    assert rec["step_ms_median"] == pytest.approx(statistics.median(runs))
    assert rec["generated"] == 2 + 2 * 3

    # keeps and budget
    assert (rec["projection_keep"], rec["kv_keep"]) == (m.proj_keep, m.kv_keep)
    r = rec["realized_projection_keep"]
    if m.proj_method:
        assert rec["proj_method"] == "teal" and 0.2 < r < 0.9, r  # thresholds really drop channels
        assert rec["one_time"]["calibrate_s"] > 0 and rec["calibration"]["ids"].startswith("random ids")
    else:
        assert r == 1.0 and rec["proj_method"] is None and rec["one_time"]["calibrate_s"] == 0
    if m.kv_method:
        assert rec["kv_method"] == m.kv_method
        assert rec["kv_budget"] == round(m.kv_keep * N) - rec["generated"]  # never attends more than keep x n
        assert rec["kv_read_fraction"] == pytest.approx((rec["kv_budget"] + rec["generated"]) / N)
        assert rec["one_time"]["select_s"] > 0
        sel = rec["selection"]  # the first selection and the same again, warm, each by phase
        assert sel["first_s"] == rec["one_time"]["select_s"] and sel["warm_s"] > 0
        if m.kv_method == "snapkv":
            for phases, total in ((sel["first_phases"], sel["first_s"]), (sel["warm_phases"], sel["warm_s"])):
                assert set(phases) == {"observe", "buffers", "score", "gather"}
                assert all(t >= 0 for t in phases.values()) and sum(phases.values()) <= total
    else:
        assert rec["kv_budget"] == N and rec["kv_read_fraction"] == 1.0 and rec["kv_method"] is None
        assert rec["selection"] is None

    # bytes and bound, from the account at the realized keeps
    dims = ModelDims(**rec["model"]["dims"])
    dense = step_bytes(dims, N, 4, 4).total
    assert rec["bytes_per_step"] == pytest.approx(timed_step_bytes(dims, N, r, rec["kv_read_fraction"], 4, 4))
    assert rec["byte_bound"] == pytest.approx(dense / rec["bytes_per_step"])
    b = bounds(dims, N, r, rec["kv_read_fraction"], weight_bytes=4, kv_bytes=4)
    want = {"dense": 1.0, "proj": b.projection, "sel": b.kv, "window": b.kv, "both": b.both}[m.kind]
    assert rec["byte_bound"] == pytest.approx(want)
    assert (rec["byte_bound"] == 1.0) == (m.kind == "dense") and rec["byte_bound"] >= 1.0
    assert rec["achieved_gbps"] == pytest.approx(rec["bytes_per_step"] / (rec["step_ms_median"] * 1e-3) / 1e9)
    assert rec["peak_memory_bytes"] > 0
    once = rec["one_time"]  # every part of the cell outside its timed steps, in the order it ran
    assert list(once) == ["start_s", "cuda_init_s", "load_s", "calibrate_s", "prefill_s", "select_s",
                          "select_warm_s", "keep_s", "capture_s", "after_s"]
    assert all(v >= 0 for v in once.values()) and once["after_s"] > 0
    assert (once["keep_s"] > 0) == bool(m.proj_method) and (once["select_warm_s"] > 0) == bool(m.kv_method)
    if Path("/proc/self/stat").exists():  # the process's age: its start and imports came before the cell
        assert once["start_s"] > 0
    assert rec["env"]["torch"] and rec["timestamp"]


@pytest.mark.parametrize("attention", ["split_k", "sdpa_masked", "sdpa_fused"])
def test_window_and_dense_run_under_every_attention_path(tiny, attention):
    for mode in ("dense", "window0.5"):
        rec = run_cell(spec(tiny, mode=mode, attention=attention, fill="random"))
        # the C step runs split_k's dense step; a window, or another backend, the PyTorch step
        c_step = attention == "split_k" and mode == "dense" and has_entry("sd_step", torch.float32)
        assert (rec["status"], rec["attention"], rec["runtime"]) == ("ok", attention, "C step" if c_step else "eager")
        assert rec["ms_per_token"] > 0 and len(rec["step_ms_runs"]) == 2


def test_decoding_feeds_the_stream_from_token_n(tiny, monkeypatch):
    fed, positions = [], []
    step = Engine.decode_step

    def spy(self, token):
        fed.append(int(token))
        positions.append(self.pos)
        return step(self, token)

    monkeypatch.setattr(Engine, "decode_step", spy)
    rec = run_cell(spec(tiny, mode="sel0.5", fill="random", seed=3))
    g = rec["generated"]
    stream = torch.randint(0, TINY["vocab_size"], (N + g,), generator=torch.Generator().manual_seed(3)).tolist()
    assert fed == stream[N:N + g]  # warm-up then timed steps, tokens n, n+1, ... of the stream
    assert positions == list(range(N, N + g))  # the cache of n + generated is filled exactly
    assert rec["fill"] == "random" and rec["kv_budget"] == round(0.5 * N) - g


def test_context_over_the_window_says_the_largest_that_fits(tiny):
    with pytest.raises(InputError) as e:  # checked before any weight is allocated
        run_cell(CellSpec(model="llama-3.1-8b", init="random", context=131072, mode="dense"))
    assert str(e.value) == ("context 131072 + 255 generated tokens exceeds the 131072-token window "
                            "of llama-3.1-8b; use at most 130817")
    with pytest.raises(InputError, match="use at most 504"):
        run_cell(spec(tiny, context=505))
    with pytest.raises(InputError, match="budget"):  # a selection that cannot hold sinks + window
        run_cell(spec(tiny, mode="sel0.1"))


@pytest.mark.parametrize("text,kind,pk,kk,cell", [
    ("dense", "dense", 1.0, 1.0, "dense"),
    ("proj0.5", "proj", 0.5, 1.0, "proj50"),
    ("sel0.3", "sel", 1.0, 0.3, "sel30"),
    ("window0.3", "window", 1.0, 0.3, "window30"),
    ("both0.5/0.3", "both", 0.5, 0.3, "p50_s30"),
    ("proj0.25", "proj", 0.25, 1.0, "proj25"),
    ("both.7/.2", "both", 0.7, 0.2, "p70_s20"),
])
def test_mode_strings_and_paper_cell_ids(text, kind, pk, kk, cell):
    m = cell_config(text)
    assert (m.kind, m.proj_keep, m.kv_keep, m.cell) == (kind, pk, kk, cell)
    assert cell_config(str(m)) == m


@pytest.mark.parametrize("text,match", [
    ("sparse", "is not one of dense"), ("proj", "is not one of dense"), ("sel0.3/0.5", "is not one of"),
    ("both0.5", "is not one of"), ("proj1.5", "outside"), ("sel0", "outside"),
    ("window1", "keeps below 1"), ("Dense", "is not one of"), ("proj[t.st]", "without files"),
    ("sel0.3(window=8)", "without files or selector fields"), ("proj0.5+window0.3", "a timing cell runs"),
])
def test_bad_mode_strings_say_what_to_write(text, match):
    with pytest.raises(InputError, match=match):
        cell_config(text)


@pytest.mark.parametrize("field,value,match", [
    ("fill", "zeros", "fill 'zeros'"), ("attention", "flash", "attention 'flash'"),
    ("init", "trained", "init 'trained'"), ("repeats", 0, "repeats must be"), ("steps", 2.5, "steps must be"),
    ("mode", "sel", "mode 'sel'"),
])
def test_cell_spec_validates_its_fields(tiny, field, value, match):
    with pytest.raises(InputError, match=match):
        spec(tiny, **{field: value})


def test_too_few_calibration_tokens_are_refused_before_the_load(tiny):
    """Calibration needs MIN_TOKENS; a projection cell says so from its spec, before a model
    load that may take a minute; cells that calibrate nothing accept any count."""
    from sparsedecode.projection.thresholds import MIN_TOKENS

    for mode in ("proj0.5", "both0.5/0.3"):
        with pytest.raises(InputError, match=f"at least {MIN_TOKENS} tokens .--calib-tokens"):
            spec(tiny, mode=mode, calib_tokens=MIN_TOKENS - 1)
    assert spec(tiny, mode="sel0.3", calib_tokens=64).calib_tokens == 64
    assert spec(tiny, mode="proj0.5", calib_tokens=MIN_TOKENS).calib_tokens == MIN_TOKENS


def test_cli_failure_writes_a_failed_record_and_exits_nonzero(tiny, tmp_path):
    out = tmp_path / "cell.json"
    args = ["bench", "cell", "--model", tiny, "--init", "random", "--context", "128", "--mode", "sel0.1",
            "--obs", "16", "--warmup", "2", "--repeats", "2", "--steps", "3", "--device", "cpu",
            "--block", "2", "--group", "sweep", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code != 0
    rec = json.loads(out.read_text())
    assert rec["status"] == "failed" and rec["kind"] == "timing_cell"
    assert "budget" in rec["error"] and "Traceback" in rec["traceback"]
    assert (rec["cell"], rec["context"], rec["block"], rec["group"], rec["model_name"]) == (
        "sel10", 128, 2, "sweep", Path(tiny).parent.name)  # the name an ok record would carry
    before = out.read_bytes()
    res = CliRunner().invoke(app, args[:-2] + ["--mode", "dense", "--out", str(out)])
    assert res.exit_code != 0 and "never overwritten" in str(res.exception)
    assert out.read_bytes() == before


def test_cli_cell_writes_its_record(tiny, tmp_path):
    out = tmp_path / "cell.json"
    res = CliRunner().invoke(app, ["bench", "cell", "--model", tiny, "--init", "random", "--context", "96",
                                   "--mode", "window0.5", "--obs", "16", "--warmup", "1", "--repeats", "2",
                                   "--steps", "2", "--device", "cpu", "--fill", "random", "--json",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    assert (rec["status"], rec["cell"], rec["context"], rec["fill"]) == ("ok", "window50", 96, "random")
    assert json.loads(res.stdout)["ms_per_token"] == pytest.approx(rec["ms_per_token"])


@pytest.mark.parametrize("method", ["cats", "sats"])
def test_a_cats_or_sats_cell_reads_the_attention_projections_whole(tiny, method):
    """method cats/sats calibrates a proj<keep> cell on |SiLU(gate)| (SATS §3.1): the MLP's weight
    keep is (1 + 2k)/3 (gate whole, up and down in kept channels) and the seven projections' keep
    the record prices counts q, k, v and o whole."""
    from sparsedecode.projection.thresholds import site_params
    from sparsedecode.timing.cell import seven_projection_keep

    rec = run_cell(spec(tiny, mode="proj0.5", method=method, calib_tokens=512))
    assert rec["status"] == "ok" and rec["proj_method"] == method and rec["calibration"]["method"] == method
    mlp, r = rec["realized_mlp_keep"], rec["realized_projection_keep"]
    assert 1 / 3 < mlp < 1, mlp  # gate is read whole: never below a third
    dims = ModelDims(**rec["model"]["dims"])
    attn = sum(site_params(dims, s) for s in "qkvo")
    ff = sum(site_params(dims, s) for s in ("gate", "up", "down"))
    assert r == pytest.approx((attn + ff * mlp) / (attn + ff)) == seven_projection_keep(dims, mlp)
    assert r > mlp  # the attention projections are read whole
    assert rec["bytes_per_step"] == pytest.approx(timed_step_bytes(dims, N, r, 1.0, 4, 4))
    assert rec["spec"]["method"] == method
    teal = run_cell(spec(tiny, mode="proj0.5"))
    assert teal["proj_method"] == "teal" and teal["realized_mlp_keep"] is None


@pytest.mark.parametrize("kw,match", [
    (dict(method="greedy"), "method 'greedy' is not one of teal, cats, sats"),
    (dict(method="cats", mode="sel0.3"), "mode sel0.3 has none"),
    (dict(method="cats", mode="dense"), "mode dense has none"),
    (dict(method="sats", mode="proj0.5", batch=2), "give batch 1"),
    (dict(method="sats", mode="proj0.5"), "SATS calibrates on at least 512 tokens"),
])
def test_a_cell_method_that_cannot_run_is_refused(tiny, kw, match):
    with pytest.raises(InputError, match=match):
        spec(tiny, **kw)


def test_cli_cell_takes_the_method(tiny, tmp_path):
    out = tmp_path / "cell.json"
    res = CliRunner().invoke(app, ["bench", "cell", "--model", tiny, "--init", "random", "--context", "96",
                                   "--mode", "proj0.5", "--method", "cats", "--calib-tokens", "256",
                                   "--warmup", "1", "--repeats", "2", "--steps", "2", "--device", "cpu",
                                   "--json", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    assert (rec["proj_method"], rec["spec"]["method"]) == ("cats", "cats") and rec["realized_mlp_keep"] > 1 / 3
