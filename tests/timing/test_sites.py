"""`timing.sites.call_sites`: each launch of a kernel within a step, averaged over the steps."""

from __future__ import annotations

import random

from sparsedecode.timing.sites import call_sites


def test_sites_average_each_launch_of_a_step_over_the_steps():
    # two steps of four GEMV launches (times by site: 10, 20, 30, 40 +- 1) and two attention launches
    launches = {"gemv": [], "attn": [], "lm_head": [], "odd": []}
    for step in range(2):
        t0 = 1000.0 * step
        for i, us in enumerate((10, 20, 30, 40)):
            launches["gemv"].append((t0 + 10 * i, us + (1 if step else -1)))
        launches["attn"] += [(t0 + 5, 7.0), (t0 + 25, 9.0)]
        launches["lm_head"].append((t0 + 90, 100.0))  # once a step: no sites
    launches["odd"] = [(1.0, 1.0), (2.0, 2.0), (3.0, 3.0)]  # not the same count every step
    for calls in launches.values():
        random.Random(0).shuffle(calls)  # the profiler's event order is not launch order
    assert call_sites(launches, 2) == {"gemv": [10.0, 20.0, 30.0, 40.0], "attn": [7.0, 9.0]}
