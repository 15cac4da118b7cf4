"""Thresholds and routing files are checked on load, and routing calibration holds out text it
can prove is not the routing text (issue 28, item 1): nothing loads silently wrong."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from sparsedecode.errors import InputError
from sparsedecode.projection.routing import FORMAT as ROUTING_FORMAT
from sparsedecode.projection.routing import RoutingTable, file_sha256, held_out_start
from sparsedecode.projection.thresholds import FORMAT as TH_FORMAT
from sparsedecode.projection.thresholds import Thresholds
from sparsedecode.stfile import save_with_header

DIMS = {"name": "m", "n_layers": 2, "d": 64, "d_ff": 96, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
        "vocab": 100}


def _thresholds_file(tmp_path, values=None, **header):
    values = values if values is not None else {"layers.0.q": 0.1, "layers.1.q": 0.2}
    h = {"method": "teal", "keep": 0.5, "model": "m", "dims": DIMS, "keep_metric": "param_keep",
         "calibration": {}, "extras": {}, **header}
    h = {k: v for k, v in h.items() if v is not ...}
    path = tmp_path / "th.safetensors"
    save_with_header(path, {k: torch.tensor(v, dtype=torch.float32) for k, v in values.items()}, TH_FORMAT, h)
    return path


def test_good_thresholds_load(tmp_path):
    th = Thresholds.load(_thresholds_file(tmp_path))
    assert th.values == pytest.approx({"layers.0.q": 0.1, "layers.1.q": 0.2}) and th.method == "teal"


@pytest.mark.parametrize("values, header, needle", [
    ({"layers.0.q": math.nan}, {}, "threshold layers.0.q is nan"),
    ({"layers.0.q": math.inf}, {}, "threshold layers.0.q is inf"),
    ({"layers.0.q": -0.5}, {}, "finite and >= 0"),
    (None, {"method": "magic"}, "unknown method 'magic'"),
    (None, {"keep": 1.5}, "outside (0, 1]"),
    (None, {"keep": 0}, "outside (0, 1]"),
    (None, {"keep": "half"}, "outside (0, 1]"),
    (None, {"model": ...}, "lacks model"),
    (None, {"dims": ...}, "lacks dims"),
])
def test_bad_thresholds_files_are_refused(tmp_path, values, header, needle):
    with pytest.raises(InputError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        Thresholds.load(_thresholds_file(tmp_path, values, **header))


def test_a_newer_writers_field_loads_with_a_note(tmp_path):
    with pytest.warns(UserWarning, match="fields this version does not know .*sparsity_schedule"):
        th = Thresholds.load(_thresholds_file(tmp_path, sparsity_schedule="cosine"))
    assert th.keep == 0.5


def _routing_file(tmp_path, text=None, scores=None, **header):
    scores = scores if scores is not None else torch.rand(100)
    h = {"model": "m", "vocab": 100, "tokenizer": {"vocab": 100, "sha256": None},
         "thresholds": {"method": "cats", "keep": 0.5}, "text": text or {"source": "t", "tokens": 10},
         "unseen": "dense", "stats": {}, "held_out": {}, **header}
    h = {k: v for k, v in h.items() if v is not ...}
    path = tmp_path / "route.safetensors"
    save_with_header(path, {"scores": scores, "count": torch.ones(100, dtype=torch.int64)}, ROUTING_FORMAT, h)
    return path


@pytest.mark.parametrize("header, scores, needle", [
    ({"tau": math.nan, "target": 0.5, "routed": 0.5}, None, "header tau is nan"),
    ({"tau": 0.1, "target": 1.5, "routed": 0.5}, None, "header target is 1.5, outside"),
    ({"tau": 0.1, "target": 0.5, "routed": -0.1}, None, "header routed is -0.1"),
    ({}, torch.full((100,), math.inf), "infinities"),
    ({"model": ...}, None, "lacks model"),
])
def test_bad_routing_tables_are_refused(tmp_path, header, scores, needle):
    with pytest.raises(InputError, match=needle):
        RoutingTable.load(_routing_file(tmp_path, scores=scores, **header))


def test_routing_table_with_a_newer_field_loads_with_a_note(tmp_path):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t = RoutingTable.load(_routing_file(tmp_path, priority="high"))
    assert t.model == "m" and any("priority" in str(x.message) for x in w)


def test_calibration_holds_out_only_what_it_can_prove_is_not_routing_text(tmp_path):
    routing = tmp_path / "valid.txt"
    routing.write_text("a b c " * 1000)
    other = tmp_path / "other.txt"
    other.write_text("x y z " * 1000)
    sha = file_sha256(routing)
    table = RoutingTable.load(_routing_file(tmp_path, text={"source": "valid.txt[:300]", "path": str(routing),
                                                           "sha256": sha, "start": 100, "tokens": 300}))
    assert held_out_start(table, routing, explicit=False)[0] == 400  # after the routing range
    moved = tmp_path / "copy.txt"
    moved.write_bytes(routing.read_bytes())
    assert held_out_start(table, moved, explicit=True)[0] == 400  # found by its content, not its path
    assert held_out_start(table, other, explicit=True)[0] == 0  # other text: no overlap possible
    with pytest.raises(InputError, match="is not at"):
        held_out_start(table, other, explicit=False)  # the default text is not the routing text
    old = RoutingTable.load(_routing_file(tmp_path, text={"source": "wiki.valid.raw[:300]", "path": None,
                                                         "tokens": 300}))
    with pytest.raises(InputError, match="records no hash of its routing text"):
        held_out_start(old, routing, explicit=True)  # cannot tell: refused, never calibrated on overlap
    assert json.dumps(table.text)  # the recorded range stays JSON
