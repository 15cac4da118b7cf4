"""Where a step's time goes (timing.profile, issue 26 item 2): the kinds kernels fall into, the
split of a step into gaps, fixed kernels and streaming kernels, and a profiled CPU cell."""

from __future__ import annotations

import json

import pytest

from sparsedecode.errors import InputError
from sparsedecode.timing.cell import CellSpec, run_cell
from sparsedecode.timing.profile import kernel_kind, summarize

TINY = dict(model_type="llama", hidden_size=96, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, vocab_size=100, max_position_embeddings=512,
            rope_theta=10000.0, eos_token_id=None)


@pytest.mark.parametrize("name,kind,streams", [
    ("_sparse_gemv_kernel", "sparse GEMV", True),
    ("_split_kernel", "attention", True),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16>", "dense GEMV/GEMM", True),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm", False),
    ("triton_poi_fused_add_3", "elementwise", False),
    ("Memcpy DtoD (Device -> Device)", "copy", False),
    ("_rope_cache_kernel", "rope/cache write", False),
    ("aten::mm", "dense GEMV/GEMM", True),
    ("aten::matmul", "views/dispatch", False),
    ("aten::to", "views/dispatch", False),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention", True),
    ("some_new_kernel", "other", False),
    ("triton_red_fused__to_copy_embedding_pow_sparse_gemv_sum_view_0", "elementwise", False),
])
def test_kernel_kinds(name, kind, streams):
    assert kernel_kind(name) == (kind, streams)


def test_summary_splits_the_step_into_gaps_fixed_and_streaming():
    # two steps; each: a GEMV 0-10, a norm 12-13, attention 13-20 (overlapping the norm's end
    # not at all), then nothing until the next step starts at 25. Last step ends at 45.
    ks = []
    for t0 in (0.0, 25.0):
        ks += [("_sparse_gemv_kernel", t0, t0 + 10), ("triton_red_fused_rsqrt_0", t0 + 12, t0 + 13),
               ("_split_kernel", t0 + 13, t0 + 20)]
    rec = summarize(ks, steps=2, byte_us=12.0)
    assert rec["step_us"] == pytest.approx(45 / 2)
    assert rec["busy_us"] == pytest.approx(18.0)
    assert rec["gap_us"] == pytest.approx(45 / 2 - 18)
    assert rec["streaming_us"] == pytest.approx(17.0) and rec["fixed_us"] == pytest.approx(1.0)
    assert rec["kinds_us"] == {"sparse GEMV": 10.0, "attention": 7.0, "norm": 1.0}
    assert rec["excess_us"] == pytest.approx(45 / 2 - 12)
    assert rec["streaming_excess_us"] == pytest.approx(5.0)
    # the three parts add up to the excess when no kernels overlap
    assert rec["gap_us"] + rec["fixed_us"] + rec["streaming_excess_us"] == pytest.approx(rec["excess_us"])
    assert [k["name"] for k in rec["kernels"]] == ["_sparse_gemv_kernel", "_split_kernel", "triton_red_fused_rsqrt_0"]
    assert rec["kernels"][0]["launches"] == 1.0


def test_overlapping_kernels_count_once_and_a_waiting_launch_owns_only_its_own_time():
    # b launched early (PDL) while a ran: a owns 0-10, b only 10-12; d lies wholly inside a's run
    ks = [("b", 5.0, 12.0), ("a", 0.0, 10.0), ("d", 2.0, 3.0), ("c", 20.0, 21.0)]
    rec = summarize(ks, steps=1, byte_us=None)
    assert rec["busy_us"] == pytest.approx(13.0) and rec["gap_us"] == pytest.approx(8.0)
    own = {k["name"]: (k["us"], k["launched_us"]) for k in rec["kernels"]}
    assert own == {"a": (10.0, 10.0), "b": (2.0, 7.0), "c": (1.0, 1.0), "d": (0.0, 1.0)}
    assert sum(rec["kinds_us"].values()) == pytest.approx(rec["busy_us"])
    assert "excess_us" not in rec


def test_summary_refuses_an_empty_profile():
    with pytest.raises(RuntimeError, match="no kernels"):
        summarize([], steps=1, byte_us=None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_profile") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _spec(tiny, **kw):
    return CellSpec(**(dict(model=tiny, init="random", dtype="float32", device="cpu", context=64, warmup=1,
                            repeats=2, steps=3, obs=16, calib_tokens=256) | kw))


@pytest.mark.parametrize("mode", ["dense", "both0.5/0.5"])
def test_profiled_cell_records_where_the_step_goes(tiny, mode):
    rec = run_cell(_spec(tiny, mode=mode, profile=3))
    prof = rec["profile"]
    assert prof["steps"] == 3 and prof["clock"].startswith("host time")
    # the C step is one range (kernels/cpu_step.c); the PyTorch step's projections run aten::mm or linear
    kind = "C step" if rec["runtime"] == "C step" else "dense GEMV/GEMM"
    assert prof["kinds_us"][kind] > 0
    assert 0 < prof["busy_us"] and prof["step_us"] > 0 and prof["gap_us"] >= 0
    assert sum(prof["kinds_us"].values()) == pytest.approx(prof["streaming_us"] + prof["fixed_us"])
    assert run_cell(_spec(tiny, mode=mode))["profile"] is None


def test_profile_is_validated(tiny):
    with pytest.raises(InputError, match="profile at most 6"):
        _spec(tiny, profile=7)
    with pytest.raises(InputError, match="profile must be"):
        _spec(tiny, profile=-1)
    with pytest.raises(InputError, match="peer"):
        _spec(tiny, profile=2, impl="graph")


def test_report_says_where_each_profiled_step_goes(tiny, tmp_path):
    from typer.testing import CliRunner

    from sparsedecode.cli import app
    from sparsedecode.timing.campaign import run_campaign

    spec = tmp_path / "prof.toml"
    spec.write_text(f'name = "prof"\nmodel = "{tiny}"\ninit = "random"\ndtype = "float32"\ndevice = "cpu"\n'
                    'blocks = 1\nrepeats = 2\nsteps = 3\nwarmup = 1\nfill = "random"\nobs = 16\n'
                    'calib_tokens = 256\nprofile = 2\n\n[[grid]]\ngroup = "g"\ncontexts = [64]\n'
                    'modes = ["dense", "proj0.5"]\n')
    out = tmp_path / "run"
    summary = run_campaign(spec, out, progress=False, echo=lambda line: None)
    assert (summary.ok, summary.failed) == (2, 0), summary.failures
    res = CliRunner().invoke(app, ["bench", "ceiling", "--device", "cpu", "--dtype", "float32", "--gib", "0.02",
                                   "--replays", "2", "--calls", "2", "--out", str(out / "ceiling.json")])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["report", str(out), "--json", "--no-figures"])
    assert res.exit_code == 0, res.output
    rows = {p["cell"]: p for p in json.loads(res.stdout)["step_profiles"]}
    assert set(rows) == {"dense", "proj50"}
    for p in rows.values():
        assert p["blocks"] == 1 and p["byte_us"] > 0
        assert p["above_us"] == pytest.approx(p["step_us"] - p["byte_us"])
        assert p["streaming_past_us"] == pytest.approx(p["streaming_us"] - p["byte_us"])
        assert p["largest_fixed"] and all(k not in ("sparse GEMV", "attention", "dense GEMV/GEMM")
                                          for k, _ in p["largest_fixed"])
    md = (out / "report" / "report.md").read_text()
    assert "## Where the step goes" in md and "| 64 | g | proj50 |" in md
