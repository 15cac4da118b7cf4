"""Call sites of a profiled decode step: the mean device time of a kernel's i-th launch of a step.

A captured decode step launches the same kernels in the same order every replay, so over `steps`
profiled replays a kernel launched n times a step has n call sites; averaging each over the
replays gives, e.g., the time of each of a layer's four sparse GEMV calls (q|k|v, o, gate|up,
down) separately, where a per-name sum lumps them together (`report.speed_tables.step_gemv_table`).
"""

from __future__ import annotations


def call_sites(launches: dict[str, list[tuple[float, float]]], steps: int) -> dict[str, list[float]]:
    """{kernel name: [mean time of its i-th launch of a step, in launch order]} from each kernel's
    (start, duration) launches over `steps` replays, for kernels launched at least twice a step
    and the same number of times every step (others are left out: they have no fixed sites)."""
    sites = {}
    for name, calls in launches.items():
        per_step = len(calls) // steps
        if per_step < 2 or per_step * steps != len(calls):
            continue
        times = [t for _, t in sorted(calls)]
        sites[name] = [sum(times[j * per_step + i] for j in range(steps)) / steps for i in range(per_step)]
    return sites


__all__ = ["call_sites"]
