"""The markdown of a timing report (`timing.analysis.build_report`): one table per group with
speedups, bounds, kernel costs and crossings, then failed and unpaired cells, other processes on
the GPU and where each cell's device time went (`timing.run_conditions`); records alone, nothing
re-measured (ByteCross §4.2-4.4, App. D, E)."""

from __future__ import annotations

import math
from pathlib import Path


def fmt_ctx(n: float) -> str:
    """2048 -> '2K', 76069 -> '74.3K' (K = 1,024 tokens, §3)."""
    if n >= 1024:
        return f"{n / 1024:g}K" if n % 1024 == 0 else f"{n / 1024:.1f}K"
    return f"{n:.0f}"


def _f(x: float | None, fmt: str) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _interval(e: dict | None, fmt: str, scale: float = 1.0, unit: str = "") -> str:
    if e is None:
        return ""
    v, lo, hi = (e[k] / scale for k in ("value", "low", "high"))
    if math.isnan(v):
        return "none"
    return f"{v:{fmt}}{unit} [{lo:{fmt}}, {hi:{fmt}}]"


def _group_md(g: dict) -> list[str]:
    att = f" (attention {g['attention']}" + (f", {'/'.join(g['runtime'])}" if g.get("runtime") else "") + ")" \
        if g["attention"] else ""
    out = [f"## Group `{g['name']}`{att}", "",
           "| context | cell | mode | blocks | ms/token | speedup [95%] | byte bound | % of bound "
           "| kernel cost ms | GB/s | % of peak | % of ceiling |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in g["rows"]:
        sp = _interval(r["speedup"], ".3f", unit="×")
        out.append(
            f"| {fmt_ctx(r['context'])} | {r['cell']} | {r['mode']} | {len(r['blocks'])} "
            f"| {r['ms_per_token']:.3f} | {sp} | {_f(r['byte_bound'], '.3f')} "
            f"| {_f(r['fraction_of_bound'] and 100 * r['fraction_of_bound'], '.1f')} "
            f"| {_f(r['kernel_cost_ms'] and r['kernel_cost_ms']['value'], '.3f')} "
            f"| {_f(r['achieved_gbps'], '.0f' if (r['achieved_gbps'] or 0) >= 100 else '.3g')} "
            f"| {_f(r['fraction_of_peak'] and 100 * r['fraction_of_peak'], '.1f')} "
            f"| {_f(r.get('fraction_of_ceiling') and 100 * r['fraction_of_ceiling'], '.1f')} |")
    out += ["", f"Kernel cost c_b = t_b − t_D·B_b/B_D (App. D): {g['bytes_note']}"]
    # A group without dense cells is summarised once under "Missing pairs".
    notes = [f"{fmt_ctx(r['context'])} {r['cell']}: {r['note']}"
             for r in g["rows"] if r["note"] and g["has_dense"]]
    out += [f"- {n}" for n in notes]
    once = [r for r in g["rows"] if r["one_time_s"] or r["peak_memory_bytes"]]
    if once:
        keys = sorted({k for r in once for k in r["one_time_s"]})
        out += ["", "| context | cell | " + " | ".join(f"{k} (s)" for k in keys) + " | peak memory GB |",
                "|---|---|" + "---|" * (len(keys) + 1)]
        for r in once:
            out.append(f"| {fmt_ctx(r['context'])} | {r['cell']} | "
                       + " | ".join(_f(r["one_time_s"].get(k), ".3g") for k in keys)
                       + f" | {_f(r['peak_memory_bytes'] and r['peak_memory_bytes'] / 1e9, '.2f')} |")
    x = g["crossing"]
    if x is not None:
        out += ["", f"### Projection against selection (`{x['proj']}` − `{x['sel']}`, §4.3, App. E)", ""]
        if x["rows"]:
            out += ["| context | proj ms | sel ms | difference ms [95%] | sel faster |",
                    "|---|---|---|---|---|"]
            for r in x["rows"]:
                out.append(f"| {fmt_ctx(r['context'])} | {r['proj_ms']:.3f} | {r['sel_ms']:.3f} "
                           f"| {_interval(r['difference_ms'], '+.3f')} "
                           f"| {r['sel_faster_blocks']}/{r['blocks']} |")
            out.append("")
        m = x["measured"]
        if m is not None:
            out.append(f"- measured crossing: {_crossing_str(m)} "
                       f"({m['n_resamples']} block resamples, {m['n_undefined']} without a crossing)")
        nb = x["byte_crossover"]
        if nb is not None:
            out.append(f"- byte crossover n*: {fmt_ctx(nb['tokens']) if nb['tokens'] else 'never'} "
                       f"(Eq. 5 at {nb['keeps']} keeps r_P={nb['rp']:.3f}, r_KV={nb['rkv']:.3f})")
        c = x.get("committed")
        if c is not None:
            out.append(f"- prediction committed before the campaign ran: {fmt_ctx(c['tokens'])} (from "
                       f"{c['source']}, {c['timestamp']}; App. D)")
        p = x["predicted"]
        if p is not None and p.get("tokens") is not None:
            out.append(f"- cost-aware prediction: {fmt_ctx(p['tokens'])} (t_D, c_P, c_KV from group "
                       f"`{p['source_group']}` at {', '.join(fmt_ctx(n) for n in p['contexts'])}; App. D)")
        elif p is not None:
            out.append(f"- {p['note']}")
        if x["note"]:
            out.append(f"- {x['note']}")
    out.append("")
    return out


def _crossing_str(m: dict) -> str:
    if math.isnan(m["value"]):
        return "none inside the contexts"
    lo = "?" if math.isnan(m["low"]) else fmt_ctx(m["low"])
    hi = "?" if math.isnan(m["high"]) else fmt_ctx(m["high"])
    return f"{fmt_ctx(m['value'])} [{lo}, {hi}]"


def batch_md(b: dict | None) -> list[str]:
    """The batch section (`timing.batch_report`): the step against B per mode and context, and each
    batch size's measured crossing beside its byte crossover n*_B."""
    if not b:
        return []
    bs = b["batches"]
    out = ["## Batched steps (§3.3, App. F)", "",
           "One step decodes B sequences, each at its own position in its own cache row. Each entry: ms a step, "
           "tokens/s (B a step), and the step over the same mode's at B = 1; `u` the union of kept projection "
           "rows the step read, `%c` the share of the measured ceiling. " + b["note"] + ".", "",
           "| context | mode | " + " | ".join(f"B = {x}" for x in bs) + " |", "|---|---|" + "---|" * len(bs)]
    for r in b["steps"]:
        per = {x["batch"]: x for x in r["by_batch"]}
        cells = []
        for B in bs:
            x = per.get(B)
            if x is None:
                cells.append("")
                continue
            extra = [f"{x['step_over_b1']:.2f}× B=1" if x["step_over_b1"] and B != 1 else "",
                     f"u {x['realized_union']:.3f}" if x["realized_union"] is not None and B != 1 else "",
                     f"%c {100 * x['fraction_of_ceiling']:.0f}" if x["fraction_of_ceiling"] else ""]
            cells.append(f"{x['step_ms']:.3f} ms, {x['tokens_per_sec']:.0f} tok/s"
                         + "".join(f"; {e}" for e in extra if e))
        out.append(f"| {fmt_ctx(r['context'])} | {r['mode_spec']} | " + " | ".join(cells) + " |")
    if b["crossings"]:
        out += ["", "Crossings of each batch size: the measured crossing of its proj and sel cells (App. E) beside "
                "the byte crossover n*_B = P (1 - u_B) / (2 B h_kv d_h (1 - r_KV)) at the union its proj cells "
                "realized and the KV read of its sel cells.", "",
                "| B | proj | sel | union u_B (whose) | KV read | n*_B (bytes) | measured [95%] |",
                "|---|---|---|---|---|---|---|"]
        for c in b["crossings"]:
            m = _crossing_str(c["measured"]) if c["measured"] else (c["note"] or "none")
            u = "" if c["union"] is None else f"{c['union']:.3f}" + (f" ({c['union_source']})" if c["union_source"] else "")
            out.append(f"| {c['batch']} | {c['proj']} | {c['sel']} | {u} "
                       f"| {_f(c['kv_read'], '.3f')} | {_f(c['byte_tokens'] and fmt_ctx(c['byte_tokens']), 's')} | {m} |")
    return out + [""]


def neighbors_md(nb: dict | None) -> list[str]:
    """The report's section on other processes on the GPU (none when no record was probed)."""
    if not nb:
        return []
    out = ["", "## Other processes on the GPU (around each cell's timed steps)", ""]
    if nb["shared"]:
        out += ["| record | group | cell | context | block | processes |", "|---|---|---|---|---|---|"]
        for s in nb["shared"]:
            out.append(f"| {Path(s['path']).name} | {s['group']} | {s['cell']} | {fmt_ctx(s['context'])} "
                       f"| {s['block']} | {', '.join(s['processes'])} |")
    else:
        out.append(f"none seen around the {nb['probed']} probed cells")
    if nb["unknown"]:
        out.append(f"\n{nb['unknown']} probed cell(s) could not tell (no NVML, no nvidia-smi).")
    if nb["no_probe"]:
        out.append(f"\n{nb['no_probe']} cell(s) carry no probe (timed before cells looked).")
    return out


def overhead_md(o: dict | None) -> list[str]:
    """The report's section: one row per part, seconds per cell."""
    if not o:
        return []
    f = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    out = ["", f"## Where each cell's device time went (mean seconds over {o['cells']} cells)", "",
           "| part | s per cell | cells |", "|---|---|---|"]
    out += [f"| {name} | {f(v)} | {k} |" for name, v, k in o["parts"]]
    out.append(f"| timed steps (warm-up + repeats × steps) | {f(o['timed_s'])} | {o['timed_cells']} |")
    if o["gap_s"] is not None:
        out.append(f"| whole cell: median gap between consecutive records | {f(o['gap_s'])} | {o['gaps']} gaps |")
    if o.get("rest_s") is not None:
        out.append(f"| the rest of the gap, in no record | {f(o['rest_s'])} | |")
    out += ["", "start: the process's start and imports; cuda_init: the CUDA context and the neighbor probe; "
            "select_warm: the same selection again; keep: the eager steps that measure the realized projection "
            "keep; after: bounds and the record. The gap holds a cell's whole cost when cells run one after "
            "another; with several lanes at once it is shorter than a cell. Records timed before a part was "
            "recorded leave it out (its cells column)."]
    return out



def render_markdown(rep: dict) -> str:
    """The report as markdown: one table per group, crossings, failed cells, missing pairs."""
    cpu = " — CPU" if rep["label"] == "CPU" else ""
    out = [f"# Timing report: {rep['campaign']}{cpu}", "",
           f"- model {rep['model']} on {rep['gpu']} ({rep['device']}); {rep['n_ok']} ok cells, "
           f"{rep['n_failed']} failed; records: {rep['source']} ({rep['folder']})",
           f"- {rep['peak_note']}" + (f": {rep['peak_gbps']:g} GB/s" if rep["peak_gbps"] else ""),
           f"- {rep.get('ceiling_note', '')}" + (f": {rep['ceiling_gbps']:.0f} GB/s" if rep.get("ceiling_gbps") else ""),
           "- speedup: paired ratio to the dense cell of the same block and context, mean over "
           "blocks, 95% interval over all B^B block resamples (ByteCross App. A, App. E); "
           "ms/token = 1000 / mean repeat throughput; K = 1,024 tokens"]
    if rep["label"] == "CPU":
        out.append("- CPU: these cells time the CPU reference path; they say nothing of GPU speed")
    out.append("")
    for g in rep["groups"]:
        out += _group_md(g)
    out += batch_md(rep.get("batches"))
    if rep["attention_paths"]:
        out += ["## Attention paths (§4.4, Figure 5)", ""]
        for cl in rep["attention_paths"]:
            out.append(f"- cells {', '.join(cl['cells'])}: " + ", ".join(
                f"`{x['group']}` ({x['attention']}" + (f", {'/'.join(x['runtime'])}" if x["runtime"] else "")
                + ")" for x in cl["groups"]))
            if cl["against_dense"]:
                out += ["", "The split-K path's sparse cells against the dense cell of each path "
                        "(paired by block; what a slower dense baseline does to the apparent gain):", "",
                        "| context | cell | ms/token | dense path | dense ms/token | dense % of peak "
                        "| apparent speedup [95%] |", "|---|---|---|---|---|---|---|"]
                for a in cl["against_dense"]:
                    out.append(f"| {fmt_ctx(a['context'])} | {a['cell']} | {a['sparse_ms']:.3f} "
                               f"| {a['dense_attention']} | {a['dense_ms']:.3f} "
                               f"| {_f(a['dense_fraction_of_peak'] and 100 * a['dense_fraction_of_peak'], '.1f')} "
                               f"| {_interval(a['speedup'], '.3f', unit='×')} |")
        out.append("")
    if rep.get("dense_steps"):
        out += ["## Dense steps", "", "Every dense step timed at a context; the sparse cells' speedups divide the "
                "dense cell of their own group. Last column: the fastest of ours over each, paired by block.", "",
                "| context | group | cell | impl | dense step | ms/token | % of ceiling | % of peak "
                "| fastest ours over it [95%] |", "|---|---|---|---|---|---|---|---|---|"]
        for d in rep["dense_steps"]:
            mark = "fastest of ours" if d["fastest_ours"] else _interval(d["fastest_ours_speedup"], ".3f", unit="×")
            out.append(f"| {fmt_ctx(d['context'])} | {d['group']} | {d['cell']} | {d['impl']} "
                       f"| {d['dense_step'] or ''} | {d['ms_per_token']:.3f} "
                       f"| {_f(d['fraction_of_ceiling'] and 100 * d['fraction_of_ceiling'], '.1f')} "
                       f"| {_f(d['fraction_of_peak'] and 100 * d['fraction_of_peak'], '.1f')} | {mark} |")
        out.append("")
    if rep.get("step_profiles"):
        out += ["## Where the step goes", "", "Profiled steps (`profile` in the spec; CUPTI kernel times on CUDA), "
                "mean over the blocks that profiled them. The time above the step's bytes at the measured "
                "ceiling splits into gaps (no kernel running), fixed kernels (no weight or KV bytes; the two "
                "largest kinds named) and the streaming kernels' time past the byte time; the last column "
                "is the streaming kernels' time by kind.", "", *step_profile_table(rep["step_profiles"]), ""]
    out += ["## Failed cells", ""]
    if rep["failed"]:
        out += ["| record | group | cell | context | block | error |", "|---|---|---|---|---|---|"]
        for f in rep["failed"]:
            err = f["error"].replace("|", "\\|").replace("\n", " ")
            out.append(f"| {Path(f['path']).name} | {f['group'] or ''} | {f['cell'] or ''} "
                       f"| {'' if f['context'] is None else fmt_ctx(f['context'])} "
                       f"| {'' if f['block'] is None else f['block']} | {err} |")
    else:
        out.append("none")
    out += neighbors_md(rep.get("gpu_neighbors"))
    out += overhead_md(rep.get("overhead"))
    out += ["", "## Missing pairs (sparse cells without a dense cell of the same group, context "
            "and block)", ""]
    listed = [m for m in rep["missing"] if m["group"] not in rep["groups_without_dense"]]
    for g in rep["groups_without_dense"]:
        k = sum(m["group"] == g for m in rep["missing"])
        out.append(f"- group `{g}` has no dense cells: its {k} sparse cells have no speedup "
                   "(a crossing campaign times only proj and sel, App. E)")
    for m in listed:
        out.append(f"- `{m['group']}` {m['cell']} at {fmt_ctx(m['context'])}, block {m['block']} "
                   f"({Path(m['path']).name})")
    if not rep["missing"]:
        out.append("none")
    if rep["retired"]:
        out += ["", f"{rep['retired']} earlier failed attempt(s) were retried; their records lie in "
                "DIR/failed/ and do not enter the tables."]
    figs = rep.get("figures")
    if figs:
        out += ["", "## Figures", ""]
        for name, what in figs.items():
            out.append(f"- {name}: " + (f"![{name}]({Path(what['path']).name})" if "path" in what
                                        else f"skipped ({what['skipped']})"))
    return "\n".join(out) + "\n"


def step_profile_table(profiles: list[dict]) -> list[str]:
    """The rows of "Where the step goes" (`timing.profile.step_profiles`), header first."""
    out = ["| context | group | cell | step µs | bytes at ceiling µs | above µs | gaps µs "
           "| fixed kernels µs (largest) | streaming past bytes µs | kernels a step | streaming kernels µs |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in profiles:
        largest = ", ".join(f"{k} {us:.0f}" for k, us in p["largest_fixed"])
        streams = ", ".join(f"{k} {us:.0f}" for k, us in p["streaming_kinds"])
        out.append(f"| {fmt_ctx(p['context'])} | {p['group']} | {p['cell']} | {p['step_us']:.0f} "
                   f"| {_f(p['byte_us'], '.0f')} | {_f(p['above_us'], '.0f')} | {p['gap_us']:.0f} "
                   f"| {p['fixed_us']:.0f} ({largest}) | {_f(p['streaming_past_us'], '.0f')} "
                   f"| {p['launches']:.0f} | {streams} |")
    return out


__all__ = ["fmt_ctx", "render_markdown", "step_profile_table"]

