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
])
def test_a_batch_cell_that_cannot_run_is_refused(tiny, kw, says):
    with pytest.raises(InputError, match=says):
        spec(tiny, kw.pop("mode", "dense"), **kw)


def test_a_batch_cell_profiles_its_batch_step(tiny):
    rec = run_cell(spec(tiny, "sel0.3", profile=2))
    prof = rec["profile"]
    assert prof is not None and prof["steps"] == 2 and prof["host_us"] > 0
    assert prof["step_us"] > 0 and prof["clock"].startswith("host time")


def test_bench_cell_batch_out_of_range_exits_2(tiny, capsys):
    r = run_cli(capsys, "bench", "cell", "--model", tiny, "--init", "random", "--context", "64", "--batch", "0",
                "--device", "cpu")
    assert r.returncode == 2 and "--batch must be >= 1" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def batch_folder(tiny, tmp_path_factory):
    """A campaign folder of one block: groups b1 and b2 (batch 2), dense, proj0.5 and sel0.3 at two
    contexts, written where `campaign run` writes its cells."""
    from sparsedecode.records import write_record
    from sparsedecode.timing.campaign import record_path

    folder = tmp_path_factory.mktemp("batch_campaign") / "tiny_batch"
    for group, batch in (("b1", 1), ("b2", 2)):
        for n in (96, 160):
            for mode in ("dense", "proj0.5", "sel0.3"):
                s = spec(tiny, mode, context=n, batch=batch, group=group, campaign="tiny_batch")
                write_record(record_path(folder, s), run_cell(s))
    return folder


def test_the_report_shows_the_step_against_batch_and_each_batch_crossover(batch_folder):
    from sparsedecode.account import crossover_batched
    from sparsedecode.report.timing_report import write_report

    rep, md = write_report(batch_folder, figures=False)
    assert {g["name"]: g["batch"] for g in rep["groups"]} == {"b1": 1, "b2": 2}
    b = rep["batches"]
    assert b["batches"] == [1, 2] and len(b["steps"]) == 6  # three modes at two contexts
    for r in b["steps"]:
        one, two = (x for x in r["by_batch"])
        assert (one["batch"], two["batch"]) == (1, 2)
        assert two["step_over_b1"] == pytest.approx(two["step_ms"] / one["step_ms"])
        assert two["tokens_per_sec"] == pytest.approx(2e3 / two["step_ms"])
    cross = {c["batch"]: c for c in b["crossings"]}
    assert set(cross) == {1, 2}
    two = cross[2]
    dims = next(g for g in rep["groups"] if g["batch"] == 2)
    union = [r["realized_union"] for r in dims["rows"] if r["mode"] == "proj"]
    assert two["union"] == pytest.approx(sum(union) / len(union))
    from sparsedecode.timing.cells import load_cells

    cc = load_cells(batch_folder, batched=True)
    want = crossover_batched(cc.dims, two["union"], two["kv_read"], 2)
    assert two["byte_tokens"] == pytest.approx(want)
    assert "## Batched steps" in md and "| 2 | proj50 | sel30 |" in md
    assert all(d["group"] == "b1" for d in rep["dense_steps"])  # a batch's step is no dense step of one sequence


def test_single_sequence_readers_leave_batch_cells_out(batch_folder):
    from sparsedecode.timing.cells import load_cells

    cc = load_cells(batch_folder)
    assert {c.group for c in cc.cells} == {"b1"} and cc.batched == 6
    assert len(load_cells(batch_folder, batched=True).cells) == 12


def test_a_price_table_of_a_batch_prices_its_steps(batch_folder, tiny):
    import sparsedecode
    from sparsedecode.dispatch.prices import PriceTable, from_records
    from sparsedecode.timing.cells import load_cells

    cc = load_cells(batch_folder, batched=True)
    two = from_records([batch_folder], batch=2)
    assert two.batch == 2 and set(two.specs) == {"dense", "proj0.5", "sel0.3"}
    for spec, cell in (("dense", "dense"), ("sel0.3", "sel30")):
        got = dict(zip(two.configs[spec].curve.contexts, two.configs[spec].curve.ms, strict=True))
        want = {c.context: 2 * c.ms_per_token for c in cc.cells if c.group == "b2" and c.cell == cell}
        assert got == pytest.approx(want)  # ms a step: each sequence's ms per token
    one = from_records([batch_folder])
    assert one.batch == 1 and one.configs["dense"].curve.ms == pytest.approx(tuple(
        c.ms_per_token for c in sorted(cc.cells, key=lambda c: c.context) if c.group == "b1" and c.cell == "dense"))
    assert PriceTable.from_dict(two.to_dict()).batch == 2
    with pytest.raises(InputError, match="no cells of batch 3 .*batch sizes timed: 1, 2"):
        from_records([batch_folder], batch=3)
    eng = sparsedecode.load(tiny, init="random", device="cpu", dtype="float32", max_len=128)
    with pytest.raises(InputError, match="prices steps of 2 sequence.* decodes 1 at once.*--batch 1"):
        two.check_engine(eng)


def test_a_batch_runs_the_projection_priced_cheapest_at_its_size():
    from sparsedecode.dispatch.prices import ConfigPrice, Curve, PriceTable, SelectCost
    from sparsedecode.dispatch.runtime import batch_projection

    sel = SelectCost("per_token", seconds_at_32k=0.1)

    def table(proj_ms):
        c = lambda spec, ms: ConfigPrice(spec, Curve.from_points([(1024, ms[0]), (8192, ms[1])]),  # noqa: E731
                                         sel if "0.3" in spec else None)
        configs = {"dense": c("dense", (10, 14)), "sel0.3": c("sel0.3", (10.5, 11)),
                   "proj0.5": c("proj0.5", proj_ms), "both0.5/0.3": c("both0.5/0.3", (proj_ms[0] + 0.5, 10))}
        return PriceTable("m", None, "CPU", "cpu", None, None, "sparsedecode", (), configs, batch=8)

    specs = ["dense", "sel0.3", "proj0.5", "both0.5/0.3"]
    assert batch_projection(table((12, 16)), specs) == "dense"  # the union reads every row: proj pays nothing
    assert batch_projection(table((7, 11)), specs) == "proj0.5"
    assert batch_projection(table((12, 16)), ["dense", "proj0.5"]) == "dense"
