"""`campaign merge`: runs of one campaign made in several folders come together in one, with
nothing overwritten or lost, and two measurements of one cell refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_campaign import FakeCells, toml, write_spec

from conftest import run_cli
from sparsedecode.errors import InputError
from sparsedecode.records import write_record
from sparsedecode.timing import campaign
from sparsedecode.timing.campaign import load_spec, plan, record_path, run_campaign, status
from sparsedecode.timing.merge import merge_campaigns

QUIET = dict(progress=False, echo=lambda line: None)


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """The tiny campaign (8 cells) run in two folders: 'a' ran cells 0-2, 'b' ran 3-7 after
    copying nothing from 'a' (another machine), so together they are the whole campaign."""
    cfg = tmp_path / "tiny.json"
    from test_campaign import TINY

    cfg.write_text(json.dumps(TINY))
    spec = write_spec(tmp_path, toml(str(cfg)))
    names = [record_path(tmp_path, c).relative_to(tmp_path) for c in plan(load_spec(spec))]
    monkeypatch.setattr(campaign, "launch", FakeCells())
    run_campaign(spec, tmp_path / "a", max_cells=3, **QUIET)
    b = tmp_path / "b"
    campaign.prepare(b, spec)
    monkeypatch.setattr(campaign, "launch", FakeCells(fail={names[3].name}))
    run_campaign(spec, b, **QUIET)  # runs all 8 here
    for n in names[:3]:
        (b / n).unlink()  # as if 'b' had started where 'a' stopped
    return {"spec": spec, "a": tmp_path / "a", "b": b, "names": names}


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.json"))}


def test_two_runs_merge_into_a_new_folder_and_again_into_nothing_new(runs, tmp_path):
    into = tmp_path / "all"
    s = merge_campaigns([runs["a"], runs["b"]], into)
    assert (s.copied, s.identical, s.replaced, s.to_failed, s.spec) == (8, 0, 0, 0, "written")
    st = status(into)  # the merged folder is the campaign: 7 ok, the one failed cell retried on a run
    assert (st["groups"]["sweep"]["done"], st["groups"]["sweep"]["failed"]) == (7, 1)
    for n in runs["names"][:3]:
        assert (into / n).read_bytes() == (runs["a"] / n).read_bytes()
    before = _snapshot(into)
    again = merge_campaigns([runs["a"], runs["b"]], into)
    assert (again.copied, again.identical, again.spec) == (0, 8, "kept") and _snapshot(into) == before


def test_an_ok_record_takes_a_failed_ones_place_and_the_failed_one_is_kept(runs, tmp_path, monkeypatch):
    into = tmp_path / "all"
    merge_campaigns([runs["b"]], into)
    failed = runs["names"][3]
    c = tmp_path / "c"  # a third run that retried the failed cell
    campaign.prepare(c, runs["spec"])
    write_record(c / failed, {**json.loads((into / runs["names"][4]).read_text()), "cell": "retried", "status": "ok"})
    s = merge_campaigns([c], into)
    assert (s.copied, s.replaced, s.to_failed) == (0, 1, 0)
    assert json.loads((into / failed).read_text())["cell"] == "retried"
    (kept,) = list((into / "failed").rglob("*.json"))
    assert json.loads(kept.read_text())["status"] == "failed" and kept.name == f"{failed.stem}.1.json"
    s = merge_campaigns([runs["b"]], into)  # the old failure again: history, beside the ok record
    assert (s.identical, s.to_failed) == (4, 1) and len(list((into / "failed").rglob("*.json"))) == 2


def test_two_measurements_of_one_cell_refuse_the_merge_and_write_nothing(runs, tmp_path, monkeypatch):
    into = tmp_path / "all"
    merge_campaigns([runs["a"]], into)
    before = _snapshot(into)
    d = tmp_path / "d"
    campaign.prepare(d, runs["spec"])
    monkeypatch.setattr(campaign, "launch", FakeCells())
    run_campaign(runs["spec"], d, max_cells=4, **QUIET)  # cells 0-2 measured again, and cell 3
    for n in runs["names"][:4]:  # another measurement: another step time
        (d / n).write_text(json.dumps({**json.loads((d / n).read_text()), "ms_per_token": 2.0}))
    with pytest.raises(InputError, match="3 cell.s. measured in two runs, nothing merged"):
        merge_campaigns([d], into)
    assert _snapshot(into) == before and not (into / runs["names"][3]).exists()


def test_only_runs_of_one_spec_merge(runs, tmp_path):
    other = tmp_path / "other"
    spec2 = tmp_path / "other.toml"
    spec2.write_text(runs["spec"].read_text().replace("blocks = 2", "blocks = 3"))
    campaign.prepare(other, spec2)
    with pytest.raises(InputError, match="holds another campaign"):
        merge_campaigns([other], runs["a"])
    with pytest.raises(InputError, match="not a campaign folder"):
        merge_campaigns([tmp_path / "nowhere"], runs["a"])
    with pytest.raises(InputError, match="is the folder merged into"):
        merge_campaigns([runs["a"]], runs["a"])


def test_a_ceiling_is_copied_where_there_is_none_and_kept_where_there_is(runs, tmp_path):
    write_record(runs["a"] / "ceiling.json", {"kind": "bandwidth_ceiling", "gbps": 4100.0})
    write_record(runs["b"] / "ceiling.json", {"kind": "bandwidth_ceiling", "gbps": 4200.0})
    into = tmp_path / "all"
    assert merge_campaigns([runs["a"]], into).ceiling == "copied"
    assert merge_campaigns([runs["a"], runs["b"]], into).ceiling == "kept"
    assert json.loads((into / "ceiling.json").read_text())["gbps"] == 4100.0


def test_the_cli_merges_and_says_what_it_did(runs, tmp_path, capsys):
    into = tmp_path / "all"
    r = run_cli(capsys, "campaign", "merge", str(runs["a"]), str(runs["b"]), "--into", str(into), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["copied"], out["spec"], out["into"]) == (8, "written", str(into))
    r = run_cli(capsys, "campaign", "merge", str(tmp_path / "nowhere"), "--into", str(into))
    assert r.returncode == 2 and "not a campaign folder" in r.stderr
    r = run_cli(capsys, "campaign", "merge", str(runs["a"]), "--into", str(runs["spec"]))
    assert r.returncode == 2 and "is a file" in r.stderr


def test_in_one_merge_a_later_sources_ok_record_wins_over_an_earlier_sources_failure(runs, tmp_path):
    failed = runs["names"][3]
    c = tmp_path / "c"
    campaign.prepare(c, runs["spec"])
    write_record(c / failed, {**json.loads((runs["b"] / runs["names"][4]).read_text()), "cell": "retried"})
    into = tmp_path / "all"
    s = merge_campaigns([runs["b"], c], into)
    assert (s.copied, s.replaced, s.to_failed) == (4, 1, 1)
    assert json.loads((into / failed).read_text())["cell"] == "retried"
    assert [p.name for p in (into / "failed").rglob("*.json")] == [f"{failed.stem}.1.json"]
