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


@pytest.mark.parametrize("marker", ["headline", "dense", "serve", "serve_h200", "smollm2_h200"])
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
