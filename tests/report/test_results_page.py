"""docs/results.md is what `sparsedecode report results` makes of the records docs/results.toml
names; the README's headline rows come from it. Either drifting from the records fails here."""

from pathlib import Path

import pytest

from sparsedecode.errors import InputError
from sparsedecode.report.results import render

ROOT = Path(__file__).resolve().parents[2]


def test_results_page_is_up_to_date_with_its_records():
    page = render(ROOT / "docs/results.toml")
    assert page == (ROOT / "docs/results.md").read_text(encoding="utf-8"), (
        "docs/results.md is out of date: run `sparsedecode report results` and commit it")


@pytest.mark.parametrize("marker", ["headline", "dense", "serve", "serve_h200", "crossings", "composition", "finetune"])
def test_readme_result_rows_come_from_the_results_page(marker):
    page = (ROOT / "docs/results.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    head = readme.split(f"<!-- {marker} -->")
    assert len(head) == 3, f"the README marks its {marker} table with two <!-- {marker} --> lines"
    rows = [ln for ln in head[1].splitlines() if ln.strip() and not ln.startswith("|---")]
    assert len(rows) > 1 and all(r in page for r in rows), [r for r in rows if r not in page]


def _manifest(root: Path, body: str) -> Path:
    """root/docs/results.toml holding `body`: a manifest whose paths are relative to root."""
    (root / "docs").mkdir(exist_ok=True)
    m = root / "docs/results.toml"
    m.write_text(body)
    return m


def test_a_bad_manifest_is_refused(tmp_path):
    m = _manifest(tmp_path, '[[table]]\ntitle = "t"\nconditions = "c"\nkind = "magic"\nrecords = "x"\n')
    with pytest.raises(InputError, match="kind 'magic'"):
        render(m)
    m.write_text('[[table]]\nkind = "campaign"\n')
    with pytest.raises(InputError, match="lacks 'title'"):
        render(m)


def test_a_dispatch_table_prices_without_the_command_line(tmp_path):
    """The dispatch kind calls the pricing functions (report/ does not import cli/): its table is
    what `dispatch price --markdown` prints, and it refuses two selection prices."""
    from sparsedecode.dispatch.mix import get_mix
    from sparsedecode.dispatch.policies import admissible, price_workloads
    from sparsedecode.dispatch.prices import from_records
    from sparsedecode.report.dispatch_table import price_markdown

    (tmp_path / "data").symlink_to(ROOT / "data")
    head = '[[table]]\ntitle = "t"\nconditions = "c"\nkind = "dispatch"\nrecords = ["data/bytecross/sweep_a100"]\n'
    page = render(_manifest(tmp_path, head + "select_seconds = 0.24\n"))
    table = from_records([ROOT / "data/bytecross/sweep_a100"], 0.24)
    rows = price_workloads(table, get_mix("mixed"), admissible(table, [])[0])
    assert price_markdown(rows, "mixed") in page
    assert "`sparsedecode dispatch price data/bytecross/sweep_a100 --select-seconds 0.24 --markdown`" in page
    with pytest.raises(InputError, match="not both"):
        render(_manifest(tmp_path, head + 'select_seconds = 0.24\nselect_record = "x.json"\n'))


def test_a_step_check_says_which_cells_moved(tmp_path):
    import json
    import shutil

    src = ROOT / "benchmarks/records/h200/campaigns/h200_step_check"
    for side in ("before_b93fd89", "after_f7b6ec2"):
        shutil.copytree(src / side / "cells", tmp_path / "records" / side / "cells")
    slow = tmp_path / "records/after_f7b6ec2/cells/short/proj50_2048_b0.json"
    rec = json.loads(slow.read_text())
    rec["tokens_per_sec_runs"] = [v / 1.1 for v in rec["tokens_per_sec_runs"]]
    rec["tokens_per_sec"] /= 1.1
    rec["ms_per_token"] *= 1.1
    slow.write_text(json.dumps(rec))
    m = _manifest(tmp_path, '[[table]]\ntitle = "t"\nconditions = "c"\nkind = "step_check"\n'
                  'records = { before = "records/before_b93fd89", after = "records/after_f7b6ec2" }\n')
    rows = {r.split("|")[2].strip(): r for r in render(m).splitlines() if r.startswith("| 2K")}
    assert rows["proj0.5"].endswith("| no |") and "| 3.082 |" in rows["proj0.5"], rows
    assert rows["dense"].endswith("| yes |"), rows
    (tmp_path / "records/after_f7b6ec2/cells/short/dense_2048_b0.json").unlink()
    with pytest.raises(InputError, match="in 'before' but not in 'after'"):
        render(m)


def test_a_step_profile_table_needs_profiled_cells(tmp_path):
    import shutil

    src = ROOT / "benchmarks/records/h200/campaigns/h200_step_check/after_f7b6ec2/cells"
    shutil.copytree(src, tmp_path / "records/c/cells")
    m = _manifest(tmp_path, '[[table]]\ntitle = "t"\nconditions = "c"\nkind = "step_profile"\nrecords = "records/c"\n')
    with pytest.raises(InputError, match="no profiled cells"):
        render(m)
    page = (ROOT / "docs/results.md").read_text(encoding="utf-8")  # what render makes (the first test)
    assert "| 2K | short | proj50 |" in page and "sparse GEMV" in page.split("Where each step")[1]


def _retrieval_folder(folder: Path, names: list[str], **change) -> dict[str, dict]:
    """folder/ holding copies of the committed 4K CPU retrieval records `names`, their fields
    replaced by `change` (e.g. context, device): what another run's folder looks like."""
    import json

    folder.mkdir(parents=True)
    recs = {}
    for name in names:
        rec = json.loads((ROOT / f"benchmarks/records/cpu/retrieval/{name}.json").read_text())
        recs[name] = {**rec, **change}
        (folder / f"{name}.json").write_text(json.dumps(recs[name]))
    return recs


def test_a_retrieval_table_leads_each_row_with_its_context_device_and_dtype(tmp_path):
    import json

    _retrieval_folder(tmp_path / "r4k", ["passkey_dense", "passkey_snapkv0.2", "passkey_window0.3"])
    gpu = _retrieval_folder(tmp_path / "r32k", ["passkey_dense", "passkey_snapkv0.2"], context=32760,
                            device="cuda:0", dtype="bfloat16", env={"gpu": "NVIDIA H200"})
    sel = gpu["passkey_snapkv0.2"]  # one placement lost: 9/10, no longer matching dense
    sel["placements"][0]["configured"]["verdict"] = "miss"
    sel["configured"] = {**sel["configured"], "correct": 9, "miss": 1}
    sel["matches_dense"] = False
    (tmp_path / "r32k/passkey_snapkv0.2.json").write_text(json.dumps(sel))
    two = {**sel, "test": "two_turn", "config": {**sel["config"], "variant": "kept"}}
    (tmp_path / "r32k/two_turn_snapkv0.2.json").write_text(json.dumps(two))
    m = _manifest(tmp_path, '[[table]]\ntitle = "T3"\nconditions = "c"\nkind = "retrieval"\n'
                  'records = ["r4k", "r32k"]\n')
    page = render(m)
    rows = [r for r in page.splitlines() if r.startswith("| 4,096 |") or r.startswith("| 32,760 |")]
    assert [r.split(" | ")[:5] for r in rows] == [
        ["| 4,096", "CPU", "float32", "passkey", "dense"], ["| 4,096", "CPU", "float32", "passkey", "snapkv 0.2"],
        ["| 4,096", "CPU", "float32", "passkey", "window 0.3"], ["| 32,760", "H200", "bfloat16", "passkey", "dense"],
        ["| 32,760", "H200", "bfloat16", "passkey", "snapkv 0.2"], ["| 32,760", "H200", "bfloat16", "two_turn", "dense"],
        ["| 32,760", "H200", "bfloat16", "two_turn", "snapkv 0.2 (kept)"]]
    assert "| snapkv 0.2 | 2/2 | 2/2 | 2/2 | 2/2 | 2/2 | 10/10 | 0 | 0 | yes |" in rows[1]
    assert "| window 0.3 | 0/2 | 0/2 | 0/2 | 2/2 | 2/2 | 4/10 | 0 | 6 | no | 4/10 |" in rows[2]
    assert "| snapkv 0.2 | 1/2 | 2/2 | 2/2 | 2/2 | 2/2 | 9/10 | 0 | 1 | no |" in rows[4]
    assert rows[5].endswith("| 10/10 | 0 | 0 | | | |"), "a test's dense row is the dense half of its records"
    assert "`r4k`, `r32k`" in page and str(tmp_path) not in page


def test_a_retrieval_table_names_a_missing_or_empty_folder(tmp_path):
    m = _manifest(tmp_path, '[[table]]\ntitle = "T3"\nconditions = "c"\nkind = "retrieval"\nrecords = "runs/r16k"\n')
    with pytest.raises(InputError, match="runs/r16k: no such folder"):
        render(m)
    (tmp_path / "runs/r16k").mkdir(parents=True)
    (tmp_path / "runs/r16k/ppl.json").write_text('{"kind": "ppl_eval"}')
    with pytest.raises(InputError, match="runs/r16k: no retrieval_eval records"):
        render(m)


def test_a_retrieval_table_is_one_models(tmp_path):
    _retrieval_folder(tmp_path / "a", ["passkey_dense"])
    _retrieval_folder(tmp_path / "b", ["passkey_dense"], model={"name": "smollm2-135m"}, context=512)
    m = _manifest(tmp_path, '[[table]]\ntitle = "T3"\nconditions = "c"\nkind = "retrieval"\nrecords = ["a", "b"]\n')
    with pytest.raises(InputError, match="qwen2.5-coder-0.5b, smollm2-135m; a retrieval table is one model's"):
        render(m)


def test_a_union_table_sets_each_record_beside_the_papers_and_prices_n_star_b(tmp_path):
    """The union kind (Table 14): one u_B column per record and keep, the paper's marked, and n*_B
    from each keep-0.5 union by the account; a file that is not a union record is named."""
    import json

    from sparsedecode.account.crossover import crossover_batched
    from sparsedecode.account.dims import ModelDims
    from sparsedecode.account.known import known_model

    (tmp_path / "data").symlink_to(ROOT / "data")
    ours = {"kind": "union_bench", "model": "smollm2-135m", "projection_keep": 0.5,
            "results": [{"batch": 1, "union": 0.5}, {"batch": 2, "union": 0.75}]}
    (tmp_path / "u.json").write_text(json.dumps(ours))
    head = ('[[table]]\ntitle = "t"\nconditions = "c"\nkind = "union"\nrecords = ["u.json"]\n'
            'paper = ["data/bytecross/batching/union_keep50.json"]\n')
    page = render(_manifest(tmp_path, head))
    assert "| B | u_B smollm2-135m keep 0.5 | u_B Llama-3.1-8B-Instruct keep 0.5 (paper) |" in page
    assert "| 2 | 0.750 | 0.751 |" in page and "| 64 |  | 0.999 |" in page
    dims = ModelDims.from_config(known_model("smollm2-135m").config, "smollm2-135m")
    assert f"| 1 | {crossover_batched(dims, 0.5, 0.3, 1) / 1024:.1f}K |" in page
    (tmp_path / "u.json").write_text(json.dumps({"model": "m"}))
    with pytest.raises(InputError, match="u.json is not a `bench union` record"):
        render(_manifest(tmp_path, head))


def test_a_cpu_decode_table_sets_each_contender_beside_what_its_ratio_divides(tmp_path):
    """The cpu_decode kind: ours dense over transformers, a configuration over our dense step of its
    dtype beside its byte bound and keep, llama.cpp as ours over it; an older record without the
    later fields still renders; a file of another kind is named."""
    import json

    rec = {"kind": "cpu_decode_bench", "context": 1024, "transformers": {"decode_tok_s": 10.0},
           "ours": {"decode_tok_s": 20.0}, "fastest_dense": "default",
           "ours_dense_variants": {"default": {"decode_tok_s": 20.0, "step": "C step"},
                                   "cpu.step=false": {"decode_tok_s": 12.5, "step": "eager"}},
           "ours_dtype_variants": {"bfloat16": {"decode_tok_s": 35.0, "step": "C step"}},
           "ours_configs": {"proj0.5": {"decode_tok_s": 26.0, "speedup_vs_ours_dense": 1.3, "byte_bound": 1.58,
                                        "realized_keep": 0.493, "step": "C step",
                                        "speedup_vs": "the fastest dense step of ours (fastest_dense)"}},
           "llama_cpp": {"llama.cpp F32 fa=off": {"decode_tok_s": 25.0, "ours_dense_float32_over_it": 0.8}}}
    (tmp_path / "r.json").write_text(json.dumps(rec))
    old = {k: rec[k] for k in ("kind", "context", "transformers", "ours")}
    (tmp_path / "old.json").write_text(json.dumps(old))
    head = '[[table]]\ntitle = "t"\nconditions = "c"\nkind = "cpu_decode"\nrecords = ["r.json", "old.json"]\n'
    page = render(_manifest(tmp_path, head))
    assert "| 1024 | ours dense float32 [default] (fastest) | C step | 20.00 | 2.00x | transformers generate | | |" in page
    assert "| 1024 | ours dense bfloat16 | C step | 35.00 | 3.50x | transformers generate (float32) | | |" in page
    assert "| 1024 | ours proj0.5 | C step | 26.00 | 1.30x | the fastest dense step of ours (fastest_dense) | 1.58x | 0.493 |" in page
    assert "| 1024 | llama.cpp F32 fa=off | | 25.00 | 0.80x | ours (fastest float32 dense) over it | | |" in page
    assert page.count("| 1024 | transformers generate (float32, dynamic cache) | | 10.00 |") == 2
    (tmp_path / "old.json").write_text(json.dumps({"kind": "serve_batch"}))
    with pytest.raises(InputError, match="old.json is not a benchmarks/cpu_decode.py record"):
        render(_manifest(tmp_path, head))


def _ft_record(name, label, method, nll, *, free=None, route=None, keep=0.5):
    """An mlp_sparsity_eval record of benchmarks/finetune_sparse.py's shape, 4 chunks."""
    return {"kind": "mlp_sparsity_eval", "name": name, "label": label, "method": method, "model": "m",
            "chunks": 4, "text": {"ppl": "t"}, "targets_per_chunk": 100, "nll": nll,
            "target_keep": None if method == "dense" else keep, "routing_target": route,
            "realized_keep": None if method == "dense" else 0.49, "routed": None if route is None else 0.3,
            "bound": 1.2, "adapter": None if free is None else {"training_free": free, "final_loss": 3.0}}


def test_a_finetune_table_pairs_each_tuned_setting_with_its_training_free_one(tmp_path):
    import json

    from sparsedecode.report.finetune_table import load, rows

    d = tmp_path / "ft"
    d.mkdir()
    dense = [200.0, 210.0, 190.0, 205.0]
    recs = [_ft_record("dense", "dense", "dense", dense),
            _ft_record("sats0.5", "SATS 0.5", "sats", [x + 40 for x in dense]),  # +40 nats a chunk
            _ft_record("sats0.5_ft", "SATS 0.5 + LoRA", "sats", [x + 10 for x in dense], free="sats0.5"),
            _ft_record("sats0.5_ft_route0.5", "SATS 0.5 + LoRA + routing 50%", "sats", [x + 5 for x in dense],
                       free="sats0.5", route=0.5),
            _ft_record("dense_ft", "dense + LoRA", "dense", [x - 8 for x in dense], free="dense")]
    for r in recs:
        (d / f"{r['name']}.json").write_text(json.dumps(r))
    got = {w["name"]: w for w in rows(load(d), resamples=500)}
    assert list(got) == ["dense", "dense_ft", "sats0.5", "sats0.5_ft", "sats0.5_ft_route0.5"]
    assert got["sats0.5_ft"]["vs_control"].low > 0  # 18 nats a chunk above the tuned dense
    assert got["dense_ft"]["vs_control"] is None and got["sats0.5"]["vs_control"] is None
    ft = got["sats0.5_ft"]
    assert ft["free"] == "SATS 0.5" and ft["vs_free"].high < 0  # every chunk better: the interval excludes 0
    p = {k: w["ppl"].point for k, w in got.items()}
    assert ft["gap_closed"] == pytest.approx((p["sats0.5"] - p["sats0.5_ft"]) / (p["sats0.5"] - p["dense"]))
    assert 0.7 < ft["gap_closed"] < 0.8  # 30 of 40 nats a chunk recovered, in PPL terms
    assert got["sats0.5_ft_route0.5"]["gap_closed"] is None  # routing and tuning mixed: no gap share
    assert got["sats0.5"]["vs_free"] is None and got["dense"]["vs_dense"] is None
    m = _manifest(tmp_path, '[[table]]\ntitle = "t"\nconditions = "c"\nkind = "finetune"\nrecords = "ft"\n')
    page = render(m)
    assert "| SATS 0.5 + LoRA | 0.490 |" in page and "vs SATS 0.5 |" in page


def test_a_finetune_table_refuses_records_of_another_run(tmp_path):
    import json

    from sparsedecode.report.finetune_table import load, rows

    d = tmp_path / "ft"
    d.mkdir()
    a = _ft_record("dense", "dense", "dense", [1.0, 2.0, 3.0, 4.0])
    b = {**_ft_record("cats0.5", "CATS 0.5", "cats", [1.0, 2.0, 3.0, 4.0]), "chunks": 8}
    for r in (a, b):
        (d / f"{r['name']}.json").write_text(json.dumps(r))
    with pytest.raises(InputError, match="differs from dense in 'chunks'"):
        rows(load(d), resamples=10)
    with pytest.raises(InputError, match="no mlp_sparsity_eval records"):
        load(tmp_path)
