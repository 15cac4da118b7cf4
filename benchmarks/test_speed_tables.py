"""The lab's timing tables (speed_tables.py beside this file) rebuilt from records: formatting, filtering and bad input."""

from __future__ import annotations

import json

import pytest
from speed_tables import decode_table, gemv_table, load_records, speed_tables

from sparsedecode.errors import InputError


def gemv(label, keep, t):
    return {"kind": "sparse_gemv_bench", "config_label": label, "shape": "down", "K": 14336, "N": 4096,
            "keep_target": keep, "time_s": t, "tb_per_s": 3.0, "ratio_to_byte_time": 1.25,
            "speedup_vs_dense": 1.5, "env": {"git_commit": "0123456789abcdef"}}


def test_tables_come_from_records_only(tmp_path):
    decode = {"kind": "proj_decode_bench", "mode": "proj0.5", "calibration": {"method": "teal"},
              "compile_mode": "", "realized_keep": 0.4641, "step_ms_median": 3.2571, "paired_dense_ms": 5.4117,
              "speedup": 1.6616, "bound": 1.9601, "fraction_of_bound": 0.8477, "env": {"git_commit": None}}
    (tmp_path / "a.json").write_text(json.dumps([gemv("default", 0.5, 19.6e-6), gemv("b512", 0.5, 1e-6),
                                                  gemv("default", 1.0, 31.7e-6)]))
    (tmp_path / "b.json").write_text(json.dumps(decode))
    recs = load_records([tmp_path / "a.json", tmp_path / "b.json"])
    g = gemv_table(recs).splitlines()
    assert len(g) == 4, "only default-config cells, one row each"
    assert g[2].startswith("| input-sparse GEMV | down 14336→4096 | 1 | 31.7 |"), "keep 1 first"
    assert "| 0.5 | 19.6 | 3.00 | 1.25 | 1.50 | 0123456 |" in g[3]
    pdl = gemv_table([{**gemv("default", 0.5, 18e-6), "pdl": "early"}, {**gemv("default", 0.3, 14e-6), "pdl": "off"}])
    assert pdl.splitlines()[2].startswith("| input-sparse GEMV (PDL early) | down 14336→4096 | 0.5 |")
    assert pdl.splitlines()[3].startswith("| input-sparse GEMV | down 14336→4096 | 0.3 |")
    # the default config with either split-K finish (--compare-finish-load): the exchange is marked
    fin = gemv_table([{**gemv("default", 0.5, 18e-6), "finish_load": False},
                      {**gemv("default+finloadon", 0.5, 17e-6), "finish_load": True},
                      {**gemv("default+ablate-x", 0.5, 16e-6), "finish_load": True},
                      {**gemv("default+rstoreoff", 0.5, 16e-6), "reset_store": False}]).splitlines()[2:]
    assert [row.split(" | ")[0] for row in fin] == ["| input-sparse GEMV (xchg)", "| input-sparse GEMV",
                                                    "| input-sparse GEMV (count xchg)"], fin
    d = decode_table(recs).splitlines()[2]
    assert d == "| proj0.5 (teal) | default | 0.464 | 3.257 | 5.412 | 1.662× | 1.960× | 84.8% |  |"
    assert speed_tables([tmp_path / "b.json"]).count("\n\n") == 0  # one table, no empty ones
    marked = decode_table([{**decode, "rope_in_attention": False}, {**decode, "rope_in_attention": True}])
    assert [row.split(" | ")[0] for row in marked.splitlines()[2:]] == ["| proj0.5+rope_cache (teal)", "| proj0.5 (teal)"]
    folds = decode_table([{**decode, "attn_fold_tail": False}, {**decode, "attn_fold_tail": True}])
    assert [row.split(" | ")[0] for row in folds.splitlines()[2:]] == ["| proj0.5+unfolded (teal)", "| proj0.5 (teal)"]


def test_unreadable_record_is_a_clear_error(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="cannot read record"):
        load_records([tmp_path / "bad.json"])


def test_passkey_table_marks_answers_and_the_window_region():
    from speed_tables import passkey_table

    rows = [{"depth": d, "mode": m, "keep": k, "correct": ok, **extra}
            for d, m, k, ok, extra in [(0.1, "dense", 1.0, True, {}), (0.9, "dense", 1.0, True, {}),
                                       (0.1, "window", 0.3, False, {"key_in_window": False}),
                                       (0.9, "window", 0.3, True, {"key_in_window": True})]]
    rec = {"kind": "passkey_kv", "model": "m", "runtime": "CPU", "tokens": 4096, "rows": rows}
    lines = passkey_table([rec]).splitlines()
    assert lines[0] == "| model | mode | keep | depth 0.1 | depth 0.9 |"
    assert lines[2] == "| m (CPU, 4096 tokens) | dense | 1 | yes | yes |"
    assert lines[3] == "| m (CPU, 4096 tokens) | window | 0.3 | no (outside) | yes (in window) |"


def test_kv_select_table():
    from speed_tables import kv_select_table

    rec = {"kind": "kv_select_bench", "method": "snapkv", "keep": 0.3, "context": 32768, "budget": 9766,
           "select_s_median": 0.155, "first_s": 0.5277, "target_s": 0.1, "env": {"git_commit": "83120796f5"}}
    assert kv_select_table([rec]).splitlines()[2] == "| snapkv | 0.3 | 32768 | 9766 | 155.0 | 527.7 | 100 | 8312079 |"
    assert kv_select_table([{"kind": "other"}]) == ""


def test_kv_decode_table_puts_each_mode_beside_dense_and_its_bound():
    from speed_tables import kv_decode_table

    dense = {"kind": "kv_decode_bench", "mode": "dense", "context": 131007, "step_ms_median": 9.0}
    sel = {"kind": "kv_decode_bench", "mode": "sel0.3", "context": 131007, "kv_budget": 39238,
           "step_ms_median": 6.0, "paired_dense_ms": 9.0, "speedup": 1.5, "bound": 1.6,
           "fraction_of_bound": 0.9375, "select_s": 0.3621, "env": {"git_commit": "df5df6be4c"}}
    small = {**sel, "context": 32768, "mode": "window0.3", "select_s": 0.0004}
    lines = kv_decode_table([dense, sel, small]).splitlines()
    assert len(lines) == 4  # header, rule, two sparse rows: dense is the paired column, not a row
    assert lines[2].startswith("| 32768 | window0.3 |")
    assert lines[3] == "| 131007 | sel0.3 | 39238 | 6.000 | 9.000 | 1.500× | 1.600× | 93.8% | 362 | df5df6b |"
    assert kv_decode_table([dense]) == ""


def test_gemv_table_shows_the_same_bytes_cublas_ratio_and_profile_table_groups_kernels():
    from speed_tables import kernel_group, profile_table

    cells = [{**gemv("default", 0.5, 18e-6), "ratio_to_dense_equiv": 0.61}, gemv("default", 1.0, 31e-6)]
    lines = gemv_table(cells).splitlines()
    assert lines[0].endswith("| × cuBLAS on the kept rows | run |")
    assert lines[2].endswith("| 1.50 |  | 0123456 |") and lines[3].endswith("| 1.50 | 0.61 | 0123456 |")
    assert [kernel_group(n) for n in ("_sparse_gemv_kernel", "nvjet_sm90_tst_64x8", "void cublasLt::splitKreduce_kernel",
                                      "_split_kernel", "triton_red_fused_add_mean_rsqrt",
                                      "triton_poi_fused_mul_silu_sparse_gemv_split_with_sizes_view_5")] == [
        "sparse GEMV", "cuBLAS", "cuBLAS", "attention", "other", "other"]
    rec = {"kind": "proj_decode_bench", "mode": "proj0.5", "step_ms_median": 3.264, "env": {"git_commit": "b9e8bbb0"},
           "profile": {"kernel_us_per_step": 3000.0, "kernels": [
               {"name": "_sparse_gemv_kernel", "calls_per_step": 128, "us_per_step": 2400.0},
               {"name": "void cublasLt::splitKreduce_kernel", "calls_per_step": 1, "us_per_step": 100.0},
               {"name": "_split_kernel", "calls_per_step": 32, "us_per_step": 300.0},
               {"name": "triton_poi_fused_mul_silu", "calls_per_step": 32, "us_per_step": 200.0}]}}
    row = profile_table([rec, {**rec, "profile": None}]).splitlines()
    assert len(row) == 3, "records without a profile give no row"
    assert row[2] == "| proj0.5 | 3.264 | 3.000 | 0.100 | 2.400 | 0.300 | 0.200 | 193 | b9e8bbb |"


def sized(shape, N, keep, fixed, rate, label="default", warps=1, dense=None):
    """A sparse_gemv_bench cell of K=4096 whose time is fixed + bytes / rate exactly."""
    nbytes = int(keep * 4096) * N * 2 + 4096 * 2
    rec = {"kind": "sparse_gemv_bench", "config_label": label, "shape": shape, "K": 4096, "N": N, "keep_target": keep,
           "bytes_read": nbytes, "time_s": fixed + nbytes / rate, "byte_time_s": nbytes / 4.15e12, "byte_rate": 4.15e12,
           "target_ratio": 1.15, "stride_const": True, "pattern": "random",
           "config": {"num_warps": warps, "num_stages": 4, "block_n": 256 * warps, "block_k": 16},
           "env": {"git_commit": "0123456789abcdef"}}
    if dense is not None:
        rec |= {"dense_time_s": dense[0] + (4096 * N * 2 + 8192) / dense[1], "dense_bytes": 4096 * N * 2 + 8192}
    return rec


def test_gemv_fit_recovers_a_fixed_cost_and_a_rate():
    from speed_tables import gemv_fit, gemv_fit_table

    cells = [sized(s, n, 0.5, 4e-6, 4.2e12) for s, n in (("qkv", 6144), ("gate_up", 14336), ("gate_up2", 28672))]
    fixed, rate, resid = gemv_fit(cells)
    assert fixed == pytest.approx(4e-6, rel=1e-6) and rate == pytest.approx(4.2e12, rel=1e-6) and resid < 1e-12
    cells[0]["time_s"] += 1e-6  # off the line: the fit moves and says by how much
    assert gemv_fit(cells)[2] > 0.3e-6
    with pytest.raises(InputError, match="two sizes"):
        gemv_fit(cells[1:2])
    recs = [sized(s, n, k, f, r, dense=(6e-6, 4.8e12)) for s, n in (("gate_up", 14336), ("gate_up2", 28672))
            for k, f, r in ((1.0, 5e-6, 4.6e12), (0.3, 4e-6, 3.8e12))]
    recs += [sized("gate_up", 14336, 0.5, 3e-6, 4.4e12, warps=8), sized("gate_up2", 28672, 0.5, 3e-6, 4.4e12, warps=8),
             sized("down", 14336, 0.5, 3e-6, 4.4e12),  # one size of its config and K alone: no row
             {"kind": "launch_probe", "shape": "gate_up", "config_label": "default", "time_s": 1.9e-6,
              "env": {"git_commit": "0123456789abcdef"}}]
    recs[-2]["K"] = 14336
    rows = gemv_fit_table(recs).splitlines()[2:]
    assert len(rows) == 4, rows
    assert rows[0].startswith("| cuBLAS dense |  | 4096 | 1 | gate_up, gate_up2 | 6.00 | 4.80 | 0.00 |")
    assert rows[1].startswith("| default | 1 | 4096 | 1 | gate_up, gate_up2 | 5.00 | 4.60 | 0.00 | 1.90 |")
    assert rows[2].startswith("| default | 1 | 4096 | 0.3 | gate_up, gate_up2 | 4.00 | 3.80 |")
    # the fixed cost 1.15x leaves gate_up at keep 0.3 and 3.8 TB/s: 1.15 * b / 4.15 - b / 3.8, b its bytes
    b = int(0.3 * 4096) * 14336 * 2 + 8192
    assert rows[2].endswith(f"| {(1.15 * b / 4.15e12 - b / 3.8e12) * 1e6:.2f} on gate_up | 0123456 |")
    assert rows[3].startswith("| default | 8 | 4096 | 0.5 |"), "configs of other warps fit apart"
    # cells of the same commit launched with PDL fit apart, and say so
    pdl = [{**r, "pdl": "early", "time_s": r["time_s"] - 1e-6} for r in recs[:4]]
    both = gemv_fit_table(recs[:4] + pdl).splitlines()[2:]
    assert [row.split(" | ")[0] for row in both] == ["| cuBLAS dense", "| default", "| default",
                                                     "| default (PDL early)", "| default (PDL early)"], both
    assert both[3].startswith("| default (PDL early) | 1 | 4096 | 1 | gate_up, gate_up2 | 4.00 | 4.60 |")
    assert both[0].startswith("| cuBLAS dense |  | 4096 | 1 | gate_up, gate_up2 (4 cells) |")  # no PDL: one fit
    twice = gemv_fit_table(recs[:4] + recs[:4]).splitlines()[2:]  # the same run's cells twice: one line still
    assert twice[1].startswith("| default | 1 | 4096 | 1 | gate_up, gate_up2 (4 cells) | 5.00 | 4.60 | 0.00 |")


def test_step_mode_marks_gemv_warps_and_the_deferred_finish():
    decode = {"kind": "proj_decode_bench", "mode": "proj0.5", "calibration": {"method": "teal"}, "compile_mode": "",
              "realized_keep": 0.46, "step_ms_median": 3.0, "paired_dense_ms": 5.4, "speedup": 1.8, "bound": 1.96,
              "fraction_of_bound": 0.92, "env": {"git_commit": None}}
    rows = decode_table([{**decode, "gemv_warps": 8}, {**decode, "gemv_warps": 1}, decode,
                         {**decode, "defer_gate_up_finish": True}, {**decode, "defer_gate_up_finish": False},
                         {**decode, "attn_pdl": True}, {**decode, "attn_pdl": False},
                         {**decode, "pdl": True, "pdl_trigger": "exit"}, {**decode, "pdl": False, "pdl_trigger": "exit"},
                         {**decode, "pdl": True, "pdl_trigger": "early"},
                         {**decode, "fill": "prefill"}, {**decode, "fill": "random"},
                         {**decode, "finish_load": True}, {**decode, "finish_load": False},
                         {**decode, "reset_store": True}, {**decode, "reset_store": False},
                         {**decode, "gemv_configs_file": "chosen.json"}, {**decode, "gemv_configs_file": None}])
    assert [row.split(" | ")[0] for row in rows.splitlines()[2:]] == [
        "| proj0.5+w8 (teal)", "| proj0.5 (teal)", "| proj0.5 (teal)", "| proj0.5+deferred (teal)", "| proj0.5 (teal)",
        "| proj0.5+attnpdl (teal)", "| proj0.5 (teal)", "| proj0.5+exit (teal)", "| proj0.5 (teal)", "| proj0.5 (teal)",
        "| proj0.5+prefill (teal)", "| proj0.5 (teal)", "| proj0.5 (teal)", "| proj0.5+xchg (teal)",
        "| proj0.5 (teal)", "| proj0.5+countxchg (teal)", "| proj0.5+configs (teal)", "| proj0.5 (teal)"]


def test_ablated_steps_get_no_bound_but_a_profile_row():
    from speed_tables import profile_table

    decode = {"kind": "proj_decode_bench", "mode": "proj0.5", "calibration": {"method": "teal"}, "compile_mode": "",
              "realized_keep": 0.46, "step_ms_median": 3.0, "paired_dense_ms": 5.4, "speedup": 1.8, "bound": 1.96,
              "fraction_of_bound": 0.92, "env": {"git_commit": None},
              "profile": {"kernel_us_per_step": 2900.0, "kernels": [
                  {"name": "_sparse_gemv_kernel", "calls_per_step": 128, "us_per_step": 2300.0}]}}
    ablated = {**decode, "mode": "proj0.5+ablate-both", "gemv_ablate": "both", "step_ms_median": 2.8}
    for key in ("realized_keep", "speedup", "bound", "fraction_of_bound"):
        ablated.pop(key)
    assert [row.split(" | ")[0] for row in decode_table([decode, ablated]).splitlines()[2:]] == ["| proj0.5 (teal)"]
    assert [row.split(" | ")[:2] for row in profile_table([decode, ablated]).splitlines()[2:]] == [
        ["| proj0.5", "3.000"], ["| proj0.5+ablate-both", "2.800"]]


def test_step_gemv_table_sets_each_call_site_beside_its_byte_time():
    from speed_tables import step_gemv_table

    # two layers of (q|k|v, o, gate|up, down) launches, and the weight bytes the step read per call
    sites = [8.0, 6.0, 20.0, 18.0, 10.0, 8.0, 22.0, 20.0]
    read = {"q|k|v": 2 * 20.75e6, "o": 2 * 16.6e6, "gate|up": 2 * 62.25e6, "down": 2 * 58.1e6}
    rec = {"kind": "proj_decode_bench", "mode": "proj0.5", "env": {"git_commit": "0123456789"},
           "call_bytes": {c: {"read": b, "dense": 4 * b} for c, b in read.items()},
           "profile": {"sites_us": {"_sparse_gemv_kernel": sites, "_split_kernel": [9.0, 9.0]}}}
    rows = step_gemv_table([rec, {**rec, "profile": {"sites_us": {}}}]).splitlines()[2:]
    assert rows == ["| proj0.5 | q\\|k\\|v | 9.00 | 20.8 | 5.00 | 1.80 | 0123456 |",
                    "| proj0.5 | o | 7.00 | 16.6 | 4.00 | 1.75 | 0123456 |",
                    "| proj0.5 | gate\\|up | 21.00 | 62.2 | 15.00 | 1.40 | 0123456 |",
                    "| proj0.5 | down | 19.00 | 58.1 | 14.00 | 1.36 | 0123456 |"]
    marked = step_gemv_table([{**rec, "pdl": True}]).splitlines()[2]
    assert marked.startswith("| proj0.5 (PDL: waits included) | q\\|k\\|v | 9.00 |")
    with pytest.raises(InputError, match="not 4 a layer"):
        step_gemv_table([{**rec, "profile": {"sites_us": {"_sparse_gemv_kernel": sites[:7]}}}])


def test_read_floor_table_takes_the_fastest_read_and_sets_the_gemv_of_the_same_bytes_beside_it():
    from speed_tables import read_floor_table

    env = {"git_commit": "abcdef0123"}
    floor = {"kind": "read_floor_bench", "shape": "gate_up", "keep_target": 0.5, "run_id": "r1", "bytes_read": 58_728_448,
             "byte_time_s": 14.0e-6, "target_ratio": 1.15, "env": env}
    recs = [{**floor, "config_label": "chunk1024x8w4s1", "pdl": "off", "time_s": 15.0e-6, "ratio_to_byte_time": 15 / 14},
            {**floor, "config_label": "chunk2048x4w8s1", "pdl": "early", "time_s": 14.7e-6, "ratio_to_byte_time": 14.7 / 14},
            {**floor, "config_label": "torch.sum", "pdl": "off", "time_s": 16.0e-6, "ratio_to_byte_time": 16 / 14},
            {**floor, "keep_target": 0.3, "bytes_read": 35_000_000, "config_label": "stride1024x8w4s3", "pdl": "off",
             "time_s": 9.9e-6, "byte_time_s": 8.4e-6, "ratio_to_byte_time": 9.9 / 8.4}]
    gemv = {"kind": "sparse_gemv_bench", "shape": "gate_up", "config_label": "default", "fused": None, "ablate": 0,
            "bytes_read": 58_728_448, "env": env}
    recs += [{**gemv, "time_s": 17.6e-6, "ratio_to_byte_time": 17.6 / 14, "pdl": "early"},
             {**gemv, "time_s": 18.2e-6, "ratio_to_byte_time": 18.2 / 14, "pdl": "off"},
             {**gemv, "time_s": 15.0e-6, "ratio_to_byte_time": 15 / 14, "pdl": "off", "ablate": 3,
              "config_label": "default+ablate-both"},  # ablated: its own column
             {**gemv, "time_s": 15.5e-6, "ratio_to_byte_time": 15.5 / 14, "pdl": "off", "ablate": 4,
              "config_label": "default+ablate-reds"},  # an ablation the table does not show
             {**gemv, "time_s": 1.0e-6, "ratio_to_byte_time": 1 / 14, "pdl": "early",
              "config_label": "default+finloadon"}]  # another finish: not the default's cell
    recs += [
             {**gemv, "time_s": 10.0e-6, "bytes_read": 1, "pdl": "off", "ratio_to_byte_time": 1.0},  # other bytes
             {**gemv, "time_s": 16.0e-6, "ratio_to_byte_time": 16 / 14, "pdl": "early",
              "env": {"git_commit": "9999999"}}]  # faster, but another run: the floor's own run's comes first
    rows = read_floor_table(recs).splitlines()[2:]
    assert len(rows) == 2, rows
    assert rows[0] == ("| gate_up | 0.5 | 58.7 | 14.00 | 14.70 | chunk2048x4w8s1 (PDL) | 1.050 | 17.60 (PDL) (abcdef0) "
                       "| 1.257 | 2.90 | 1.40 |  | 15.00 | abcdef0 |")
    assert rows[1].startswith("| gate_up | 0.3 | 35.0 | 8.40 | 9.90 | stride1024x8w4s3 | 1.179 |  |  |  | -0.24 |  |  |")
    assert read_floor_table(recs[4:]) == ""
    assert "| 15.50 |" not in read_floor_table(recs)
    other = read_floor_table([{**r, "env": {"git_commit": "1111111"}} if r["kind"] == "read_floor_bench" else r
                              for r in recs]).splitlines()[2]
    assert "| 16.00 (PDL) (9999999) |" in other, "a floor with no GEMV of its run: the fastest of any run"
    assert other.endswith("|  |  | 1111111 |"), "ablations of another run are not shown"
