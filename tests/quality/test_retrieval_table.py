"""The retrieval table is rebuilt from records alone, with known counts."""

from __future__ import annotations

import json

import pytest

from sparsedecode.errors import InputError
from sparsedecode.report.retrieval_table import label, load_retrieval_records, retrieval_table


def _rec(test, kv, dense_v, conf_v, in_window=None, kept=None):
    """A retrieval_eval record: two depths x two trials, verdicts as given (row-major)."""
    places = []
    for i, (d, c) in enumerate(zip(dense_v, conf_v, strict=True)):
        places.append({"depth": (0.1, 0.9)[i // 2], "trial": i % 2, "expected": "123456",
                       "needle_span": [10, 20], "dense": {"output": f"out{i}", "verdict": d},
                       "configured": {"output": "x", "verdict": c,
                                      "in_window": None if in_window is None else in_window[i],
                                      "needle_kept": None if kept is None else {"tokens": kept[i], "whole": 0.0}}})
    count = lambda vs, v: sum(x == v for x in vs)  # noqa: E731
    return {
        "kind": "retrieval_eval", "test": test, "depths": [0.1, 0.9], "trials": 2,
        "config": {"mode": "dense" if kv is None else "sel", "projection": None,
                   "kv": None if kv is None else {"method": kv[0], "keep": kv[1], "params": {}},
                   "variant": None},
        "placements": places,
        "dense": {"correct": count(dense_v, "correct"), "total": 4, "distractor": count(dense_v, "distractor"),
                  "miss": count(dense_v, "miss")},
        "configured": {"correct": count(conf_v, "correct"), "total": 4,
                       "distractor": count(conf_v, "distractor"), "miss": count(conf_v, "miss")},
        "matches_dense": all(c == "correct" for d, c in zip(dense_v, conf_v, strict=True) if d == "correct"),
    }


def test_table_counts_per_depth_and_flags(tmp_path):
    dense_v = ["correct", "correct", "correct", "miss"]
    recs = {"passkey_dense": _rec("passkey", None, dense_v, dense_v),
            "passkey_window": _rec("passkey", ("window", 0.3), dense_v,
                                   ["miss", "distractor", "correct", "correct"], [False, False, True, True]),
            "passkey_snapkv": _rec("passkey", ("snapkv", 0.2), dense_v, ["correct"] * 4),
            "passkey_snapkv3": _rec("passkey", ("snapkv", 0.3), dense_v, ["correct", "miss", "correct", "miss"],
                                    kept=[1.0, 0.5, 1.0, 0.25])}
    for name, r in recs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    (tmp_path / "other.json").write_text(json.dumps({"kind": "ppl_eval"}))
    loaded = load_retrieval_records(tmp_path)
    assert [label(r) for r in loaded] == ["dense", "snapkv 0.2", "snapkv 0.3", "window 0.3"]
    rows = retrieval_table(loaded).splitlines()
    assert rows[2] == "| passkey | dense | 2/2 | 1/2 | 3/4 | 0 | 1 | | | |"
    assert rows[3] == "| passkey | snapkv 0.2 | 2/2 | 2/2 | 4/4 | 0 | 0 | yes |  |  |"
    assert rows[4] == "| passkey | snapkv 0.3 | 1/2 | 1/2 | 2/4 | 0 | 2 | no |  | 0.69 (wrong: 0.50, 0.25) |"
    assert rows[5] == "| passkey | window 0.3 | 0/2 | 2/2 | 2/4 | 1 | 1 | no | 2/4 |  |"
    assert len(rows) == 6


def test_label_names_selector_fields_set_away_from_their_defaults():
    rec = _rec("multikey", ("snapkv", 0.2), ["correct"] * 4, ["correct"] * 4)
    rec["config"]["kv"]["params"] = {"window": 64, "pool_kind": "max"}
    assert label(rec) == "snapkv 0.2 (pool_kind max)"
    rec["config"]["kv"]["params"] = {"window": 32}
    assert label(rec) == "snapkv 0.2 (window 32)"
    rec["config"]["kv"]["params"] = {"window": 64}
    assert label(rec) == "snapkv 0.2"


def test_eval_commands_print_the_tables_label(capsys):
    """`sparsedecode eval multikey` prints a record's configuration as the table labels it."""
    import json
    from pathlib import Path

    from sparsedecode.cli import eval_retrieval

    path = Path(__file__).parents[2] / "benchmarks/records/cpu/retrieval/multikey_snapkv0.2max.json"
    eval_retrieval._show(json.loads(path.read_text()), None)
    assert "configuration: snapkv 0.2 (pool_kind max) (mode sel)\n" in capsys.readouterr().out


def test_records_of_different_placements_are_refused(tmp_path):
    a = _rec("passkey", None, ["correct"] * 4, ["correct"] * 4)
    b = _rec("passkey", ("snapkv", 0.2), ["correct"] * 4, ["correct"] * 4)
    b["placements"][0]["expected"] = "654321"
    with pytest.raises(InputError, match="disagree on their placements"):
        retrieval_table([a, b])
    with pytest.raises(InputError, match="no retrieval_eval records"):
        load_retrieval_records(tmp_path)


def test_a_record_whose_dense_answers_differ_gets_its_own_dense_row():
    """Same placements decoded in another process: its dense half is shown beside it, not hidden."""
    a = _rec("passkey", None, ["correct"] * 4, ["correct"] * 4)
    b = _rec("passkey", ("snapkv", 0.2), ["correct", "correct", "correct", "miss"], ["correct"] * 3 + ["miss"])
    b["placements"][3]["dense"]["output"] = "flipped"
    c = _rec("passkey", ("snapkv", 0.3), ["correct"] * 4, ["correct"] * 4)
    rows = retrieval_table([a, b, c]).splitlines()
    assert rows[2] == "| passkey | dense | 2/2 | 2/2 | 4/4 | 0 | 0 | | | |"
    assert rows[3] == "| passkey | dense (beside snapkv 0.2) | 2/2 | 1/2 | 3/4 | 0 | 1 | | | |"
    assert rows[4] == "| passkey | snapkv 0.2 | 2/2 | 1/2 | 3/4 | 0 | 1 | yes |  |  |"
    assert rows[5].startswith("| passkey | snapkv 0.3 | ")
    assert len(rows) == 6
