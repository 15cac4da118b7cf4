"""The CATS / SATS / routed comparison table (mlp_table.py beside this file) is rebuilt from records alone: known PPLs,
ΔPPL against dense and SATS against CATS at the same keep, refusal of mixed runs."""

from __future__ import annotations

import json
import math

import pytest
from mlp_table import KIND, comparison_table, load_records

from sparsedecode.errors import InputError


def _rec(name, method, keep=None, route=None, nll_per_target=2.0, realized=None, routed=None, bound=1.0):
    return {"kind": KIND, "name": name, "label": name, "method": method, "target_keep": keep,
            "routing_target": route, "model": "m", "chunks": 4, "text": {"ppl": "t"},
            "targets_per_chunk": 10, "nll": [nll_per_target * 10 + d for d in (-1, 0, 0, 1)],
            "realized_keep": realized, "routed": routed, "bound": bound}


def test_table_rows_from_known_records(tmp_path):
    recs = [_rec("dense", "dense"), _rec("cats0.5", "cats", 0.5, nll_per_target=2.1, realized=0.5, bound=1.2),
            _rec("sats0.5", "sats", 0.5, nll_per_target=2.05, realized=0.505, bound=1.19),
            _rec("sats0.5_route0.5", "sats", 0.5, 0.5, nll_per_target=2.02, realized=0.505, routed=0.49,
                 bound=1.09)]
    for r in recs:
        (tmp_path / f"{r['name']}.json").write_text(json.dumps(r))
    (tmp_path / "other.json").write_text(json.dumps({"kind": "ppl_eval"}))
    loaded = load_records(tmp_path)
    assert [r["name"] for r in loaded] == ["dense", "cats0.5", "sats0.5", "sats0.5_route0.5"]
    rows = comparison_table(loaded, resamples=2000).splitlines()
    assert len(rows) == 6
    e = math.exp
    assert rows[2].startswith(f"| dense |  |  |  | {e(2.0):.3f} [")
    assert rows[3].startswith(f"| cats0.5 | 0.5 | 0.500 |  | {e(2.1):.3f} [") and rows[3].endswith("|  | 1.200× |")
    assert f"+{e(2.1) - e(2.0):.3f}" in rows[3]
    assert f"| {e(2.05) - e(2.1):+.3f} [" in rows[4]  # SATS against CATS at keep 0.5
    assert "| 0.490 (target 0.5) |" in rows[5] and f"| {e(2.02) - e(2.1):+.3f} [" in rows[5]


def test_mixed_runs_and_missing_dense_are_refused(tmp_path):
    other = _rec("cats0.5", "cats", 0.5)
    other["chunks"] = 8
    with pytest.raises(InputError, match="differs from dense in 'chunks'"):
        comparison_table([_rec("dense", "dense"), other])
    with pytest.raises(InputError, match="no dense record"):
        comparison_table([_rec("cats0.5", "cats", 0.5)])
    with pytest.raises(InputError, match="no mlp_sparsity_eval records"):
        load_records(tmp_path)
