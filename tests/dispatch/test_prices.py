"""Latency tables from timing records (ByteCross §3.3, App. I): curves, one-time costs, checks."""

import math

import numpy as np
import pytest
from _tables import CPU_CELLS, dims, paper

from sparsedecode.dispatch.prices import ConfigPrice, Curve, PriceTable, SelectCost, from_records
from sparsedecode.errors import InputError


def test_curve_is_log_log_and_clamped():
    c = Curve((1024, 4096), (2.0, 8.0))
    assert c.at(1024) == 2.0 and c.at(4096) == 8.0
    assert c.at(2048) == pytest.approx(4.0)  # halfway in log n is the geometric mean
    assert c.at(10) == 2.0 and c.at(1 << 20) == 8.0  # clamped at both measured ends
    n = np.array([10, 1024, 1500, 2048, 3000, 4096, 9999])
    assert c.many(n) == pytest.approx([c.at(x) for x in n])


def test_curve_from_points_takes_the_geometric_mean_per_context():
    c = Curve.from_points([(2048, 2.0), (2048, 8.0), (1024, 1.0)])
    assert c.contexts == (1024, 2048) and c.ms == pytest.approx((1.0, 4.0)) and c.cells == 3


@pytest.mark.parametrize("ctx, ms", [((), ()), ((2, 1), (1.0, 1.0)), ((1,), (0.0,)), ((1,), (math.nan,))])
def test_bad_curves_are_refused(ctx, ms):
    with pytest.raises(InputError):
        Curve(ctx, ms)


def test_select_cost_per_token_and_measured():
    assert SelectCost("per_token", seconds_at_32k=0.24).at(65536) == pytest.approx(0.48)
    m = SelectCost("measured", contexts=(1000, 3000), seconds=(0.2, 0.4))
    assert m.at(2000) == pytest.approx(0.3) and m.at(10) == 0.2 and m.at(1e6) == 0.4
    with pytest.raises(InputError, match="select_seconds="):
        SelectCost("per_token", seconds_at_32k=-1.0)


def _table(**kw) -> PriceTable:
    configs = {"dense": ConfigPrice("dense", Curve((512, 4096), (10.0, 12.0))),
               "sel0.3": ConfigPrice("sel0.3", Curve((512, 4096), (9.0, 9.5)),
                                     SelectCost("per_token", seconds_at_32k=0.1))}
    fields = dict(model="m", dims=dims(), gpu="CPU", device="cpu", dtype="float32", attention="split_k",
                  source="sparsedecode", records=("x",), configs=configs)
    return PriceTable(**{**fields, **kw})


def test_a_table_without_a_dense_curve_is_refused():
    t = _table()
    with pytest.raises(InputError, match="no dense curve"):
        PriceTable(**{**t.__dict__, "configs": {"sel0.3": t.configs["sel0.3"]}})


def test_gate_table_round_trips():
    t = _table(admissibility={"dense": {"admitted": True}, "sel0.3": {"admitted": False, "reason": "r"}})
    back = PriceTable.from_dict(t.to_dict())
    assert back.to_dict() == t.to_dict()
    assert back.step_ms("sel0.3", 1000) == t.step_ms("sel0.3", 1000)


def test_a_table_refuses_an_engine_of_other_dims_or_device():
    class Eng:
        name, device = "other", "cpu"
        dims = dims(d=96, name="other")

    with pytest.raises(InputError, match=r"timed on m and the engine runs other.*d 64 vs 96"):
        _table().check_engine(Eng)
    Eng.dims = dims()
    _table().check_engine(Eng)  # same dims, same device
    with pytest.raises(InputError, match="timed on NVIDIA H200 and the engine runs on CPU"):
        _table(gpu="NVIDIA H200").check_engine(Eng)


def test_the_papers_records_need_the_selection_time():
    with pytest.raises(InputError, match="select_seconds="):
        from_records([paper("sweep_a100")])
    t = from_records([paper("sweep_a100")], select_seconds=0.24)
    assert t.specs == ["dense", "proj0.5", "sel0.3", "both0.5/0.3"]
    assert t.gpu == "NVIDIA A100-SXM4-80GB" and t.dims is not None and t.source == "bytecross"
    assert t.configs["dense"].curve.cells == 24  # 8 contexts x 3 blocks, every cell a point
    with pytest.raises(InputError, match="select_seconds="):
        from_records([paper("sweep_a100")], select_seconds=-0.1)


def test_records_of_two_gpus_do_not_mix():
    with pytest.raises(InputError, match="one price table prices one model on one device"):
        from_records([paper("sweep_a100"), paper("sweep_a6000")], select_seconds=0.3)


def test_our_cpu_records_carry_their_selection_times():
    if not CPU_CELLS.is_dir():
        pytest.skip("CPU cell records not committed")
    t = from_records([CPU_CELLS])
    assert t.gpu == "CPU" and t.attention == "split_k" and "masked" in t.notes[0]
    sel = t.configs["sel0.3"].select
    assert sel.kind == "measured" and all(s > 0 for s in sel.seconds)
    assert t.configs["sel0.3"].window == 32  # the campaign's observation window
