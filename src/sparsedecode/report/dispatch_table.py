"""The speedup table of `dispatch price --markdown` and of the results page's dispatch tables: one
row per policy, one column per App. I workload (ByteCross Table 5), priced by
`dispatch.policies.price_workloads`."""

from __future__ import annotations


def price_markdown(rows: dict[str, list], chosen: str) -> str:
    """Markdown of `price_workloads`' rows: each policy's speedup over always-dense on every
    workload, and how many requests of `chosen` its selection cannot run."""
    names = list(rows)
    lines = ["| policy | " + " | ".join(names) + f" | requests whose selection cannot run ({chosen}) |",
             "|---|" + "---|" * len(names) + "---|"]
    for i, r in enumerate(rows[chosen]):
        lines.append(f"| {r.policy} | " + " | ".join(f"{rows[n][i].speedup:.3f}" for n in names)
                     + f" | {r.infeasible or ''} |")
    return "\n".join(lines)


__all__ = ["price_markdown"]
