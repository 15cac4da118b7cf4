"""Timing cells of B sequences (issue 44; ByteCross §3.3, App. F) on a tiny random model on CPU:
the record against the batched byte account, each row selected on its own, the grid's batch key,
and the errors that say what to do."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from sparsedecode.account import ModelDims, step_bytes
from sparsedecode.errors import InputError
from sparsedecode.kv.select import get_selector
from sparsedecode.timing.batch_cell import batch_step_bytes
from sparsedecode.timing.campaign import cell_argv, plan
from sparsedecode.timing.cell import CellSpec, run_cell, timed_step_bytes
from sparsedecode.timing.spec import parse_spec
from timing.test_cell import CONTRACT, TINY

N, B = 96, 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def spec(tiny, mode, **kw) -> CellSpec:
    base = dict(model=tiny, init="random", device="cpu", dtype="float32", context=N, mode=mode, warmup=1,
                repeats=2, steps=2, fill="random", calib_tokens=256, obs=16, batch=B)
    return CellSpec(**{**base, **kw})


@pytest.mark.parametrize("mode, fill", [("dense", "random"), ("proj0.5", "prefill"), ("sel0.3", "random"),
                                        ("both0.5/0.3", "prefill")])
def test_a_batch_cell_counts_the_bytes_of_its_batch(tiny, mode, fill):
    rec = run_cell(spec(tiny, mode, fill=fill))
    assert CONTRACT <= rec.keys() and rec["status"] == "ok" and rec["batch"] == B
    dims = ModelDims(**{k: tuple(v) if k == "windows" else v for k, v in rec["model"]["dims"].items()})
    union, keep = rec["realized_union"], rec["realized_projection_keep"]
    if "0.5" in mode:  # B tokens' kept channels: the union reads at least the mean token's
        assert 0.3 < keep < 0.7 and keep < union <= 1.0
    else:
        assert union == keep == 1.0
    want_budget = N if "0.3" not in mode else get_selector("snapkv", window=16).budget(N, 0.3, rec["generated"])
    assert rec["kv_budget"] == want_budget
    kv_read = min((want_budget + rec["generated"]) / N, 1.0)
    assert rec["kv_read_fraction"] == pytest.approx(kv_read)
    assert rec["bytes_per_step"] == pytest.approx(batch_step_bytes(dims, N, B, union, kv_read, 4, 4))
    dense = batch_step_bytes(dims, N, B, 1.0, 1.0, 4, 4)
    assert rec["byte_bound"] == pytest.approx(dense / rec["bytes_per_step"])
    assert (rec["byte_bound"] == 1.0) == (mode == "dense")
    assert rec["step_ms_median"] > 0 and rec["tokens_per_sec"] == pytest.approx(
        sum(B * 1e3 / ms for ms in rec["step_ms_runs"]) / len(rec["step_ms_runs"]))
    if "0.3" in mode:  # every row selected after its own fill
        assert len(rec["selection"]["rows_s"]) == B
    assert f"{B} rows" in rec["stream"]


def test_batch_bytes_read_the_weights_once_and_every_cache():
    dims = ModelDims("tiny", n_layers=2, d=96, d_ff=128, n_heads=6, n_kv_heads=2, head_dim=16, vocab=100)
    one = timed_step_bytes(dims, 500, 0.4, 0.25, 2, 2)  # one sequence: the single-sequence account
    assert batch_step_bytes(dims, 500, 1, 0.4, 0.25, 2, 2) == pytest.approx(one)
    b = step_bytes(dims, 500, 2, 2)
    more = batch_step_bytes(dims, 500, 8, 0.4, 0.25, 2, 2) - one
    assert more == pytest.approx(7 * b.kv * 0.25)  # seven more caches, no more weights


def test_a_grid_batch_plans_batch_cells(tiny):
    s = parse_spec(f"""name = "b"
model = "{tiny}"
init = "random"
blocks = 1
device = "cpu"
[[grid]]
group = "b4"
contexts = [{N}]
modes = ["dense", "sel0.3"]
batch = 4
[[grid]]
group = "b1"
contexts = [{N}]
modes = ["dense"]
""", "b.toml")
    cells = plan(s)
    assert sorted((c.group, c.batch) for c in cells) == [("b1", 1), ("b4", 4), ("b4", 4)]
    argv = cell_argv(next(c for c in cells if c.group == "b4"), "x.json")
    assert argv[argv.index("--batch") + 1] == "4"
    assert "--batch" not in cell_argv(next(c for c in cells if c.group == "b1"), "x.json")


@pytest.mark.parametrize("grid, says", [
    ({"batch": 0}, "batch 0"),
    ({"batch": 2, "modes": ["dense", "window0.3"]}, "window selection"),
    ({"batch": 2, "attention": "sdpa_masked"}, "split_k"),
    ({"batch": 2, "impl": "transformers", "modes": ["dense"]}, "impl 'ours'"),
])
def test_a_grid_batch_that_cannot_run_is_refused(tiny, grid, says):
    g = {"group": "g", "contexts": [N], "modes": ["dense", "sel0.3"], **grid}
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in g.items())
    with pytest.raises(InputError, match=says):
        parse_spec(f'name = "b"\nmodel = "{tiny}"\nblocks = 1\n[[grid]]\n{lines}\n', "b.toml")


@pytest.mark.parametrize("kw, says", [
    (dict(batch=0), "batch must be an integer"),
    (dict(mode="window0.3"), "window selection"),
    (dict(attention="sdpa_masked"), "split_k"),
    (dict(profile=2), "profile"),
])
def test_a_batch_cell_that_cannot_run_is_refused(tiny, kw, says):
    with pytest.raises(InputError, match=says):
        spec(tiny, kw.pop("mode", "dense"), **kw)


def test_bench_cell_batch_out_of_range_exits_2(tiny, capsys):
    r = run_cli(capsys, "bench", "cell", "--model", tiny, "--init", "random", "--context", "64", "--batch", "0",
                "--device", "cpu")
    assert r.returncode == 2 and "--batch must be >= 1" in r.stderr and "Traceback" not in r.stderr
