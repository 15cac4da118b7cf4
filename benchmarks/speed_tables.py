"""Markdown tables of the lab's timing records, rebuilt from the records alone (ByteCross §4, App. A).

    PYTHONPATH=src python benchmarks/speed_tables.py RECORD.json [RECORD.json ...]

The record kinds of the step scripts that came before cells and of the kernel benches
(`benchmarks/kernels/`), which the docs' history tables cite; campaign records go through
`sparsedecode report`. One function per record kind; `speed_tables(paths)` sorts a list of record
files (or JSON lists of records) by kind and returns every table that has rows. Nothing here
measures: numbers come from the records, formatted.
"""

from __future__ import annotations

import json
from pathlib import Path

from sparsedecode.errors import InputError


def load_records(paths) -> list[dict]:
    """Records from files holding one record or a JSON list of them, in the order given."""
    out = []
    for p in paths:
        try:
            data = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"cannot read record {p}: {e}") from e
        out += data if isinstance(data, list) else [data]
    return out


def _commit(r: dict) -> str:
    return (r.get("env", {}).get("git_commit") or "")[:7]


def gemv_table(records: list[dict]) -> str:
    """Default-config cells of 'sparse_gemv_bench' and 'cats_gemv_bench': time against byte time
    (and, where the record has it, against cuBLAS on a dense weight of just the kept rows). Cells
    whose split-K finish took the sum with atomic exchanges, recorded as such, say '(xchg)', and
    those whose finish zeroed the arrival count with one '(count xchg)'."""
    cells = [r for r in records if r["kind"] in ("sparse_gemv_bench", "cats_gemv_bench")
             and r["config_label"] in ("default", "default+finloadon", "default+finloadoff", "default+rstoreon",
                                       "default+rstoreoff")]
    equiv = any("ratio_to_dense_equiv" in r for r in cells)
    rows = ["| kernel | shape | keep | µs | TB/s | × byte time | × dense cuBLAS |"
            + (" × cuBLAS on the kept rows |" if equiv else "") + " run |",
            "|---|---|---|---|---|---|---|" + ("---|" if equiv else "") + "---|"]
    for r in sorted(cells, key=lambda r: (r["kind"] != "sparse_gemv_bench", r["shape"], -r["keep_target"])):
        kernel = (("input-sparse GEMV" if r["kind"] == "sparse_gemv_bench" else "CATS row-gather up") + _pdl_mark(r)
                  + (" (xchg)" if r.get("finish_load") is False else "")
                  + (" (count xchg)" if r.get("reset_store") is False else ""))
        rows.append(f"| {kernel} | {r['shape']} {r['K']}→{r['N']} | {r['keep_target']:g} | {r['time_s'] * 1e6:.1f} "
                    f"| {r['tb_per_s']:.2f} | {r['ratio_to_byte_time']:.2f} | {r['speedup_vs_dense']:.2f} "
                    + (f"| {r['ratio_to_dense_equiv']:.2f} " if 'ratio_to_dense_equiv' in r else
                       "|  " if equiv else "") + f"| {_commit(r)} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def _pdl_mark(r: dict) -> str:
    """' (PDL early)' or ' (PDL exit)' for a benchmark cell launched as a programmatic dependent, else ''."""
    pdl = r.get("pdl")
    if pdl in (None, False, "off"):
        return ""
    return f" (PDL {'early' if pdl in (True, 'early') else pdl})"


def gemv_fit(cells: list[dict]) -> tuple[float, float, float]:
    """(fixed seconds F, streaming rate R in B/s, worst residual seconds) of the least-squares
    line time = F + bytes / R through 'sparse_gemv_bench' cells of one config and keep at two
    or more sizes: what a call costs whatever its bytes, and how fast it moves the bytes."""
    n = len(cells)
    xs, ys = [c["bytes_read"] for c in cells], [c["time_s"] for c in cells]
    if n < 2 or len(set(xs)) < 2:
        raise InputError(f"a fixed cost and a rate need cells of two sizes or more; got bytes {sorted(set(xs))}")
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    fixed = my - slope * mx
    return fixed, 1.0 / slope, max(abs(y - fixed - slope * x) for x, y in zip(xs, ys, strict=True))


def gemv_fit_table(records: list[dict]) -> str:
    """Each config's time per call split into a fixed cost and a streaming rate (`gemv_fit`) over
    the shapes of one K it ran at in one run, beside an empty kernel on its smallest shape's grid
    ('launch_probe', where the run has one), and the fixed cost the 1.15x target leaves gate_up
    (else the smallest shape) at the fitted rate: 1.15 x bytes / 4.15 TB/s - bytes / R
    (negative: out of reach at that rate even with no fixed cost at all). cuBLAS's dense GEMV,
    timed beside every shape, gets the same fit ('cuBLAS dense'). Runs launched as programmatic
    dependents fit apart, their label marked '(PDL early)' or '(PDL exit)'."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["kind"] != "sparse_gemv_bench" or r.get("fused") or r["keep_target"] <= 0:
            continue
        c = r["config"]
        key = (_commit(r), r["config_label"] + _pdl_mark(r), c["num_warps"], c["num_stages"], c["block_n"],
               c["block_k"], r.get("stride_const"), r.get("pattern"), r["K"], r["keep_target"])
        groups.setdefault(key, []).append(r)
        if r["config_label"] == "default" and r["keep_target"] == 1.0 and "dense_time_s" in r:
            dense = {**r, "config_label": "cuBLAS dense", "time_s": r["dense_time_s"], "bytes_read": r["dense_bytes"],
                     "byte_time_s": r["dense_bytes"] / r["byte_rate"]}
            groups.setdefault((_commit(r), "cuBLAS dense", "", "", "", "", None, None, r["K"], 1.0), []).append(dense)
    probes = {(_commit(r), r["shape"], r.get("config_label", "default") + _pdl_mark(r)): r for r in records
              if r["kind"] == "launch_probe"}
    rows = ["| kernel config | warps | K | keep | shapes | fixed µs | stream TB/s | worst residual µs "
            "| empty launch µs | fixed left by 1.15× | run |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, cells in sorted(groups.items(), key=lambda kv: (tuple(map(str, kv[0][:-1])), -kv[0][-1])):
        if len({c["N"] for c in cells}) < 2:
            continue
        fixed, rate, resid = gemv_fit(cells)
        small = next((c for c in cells if c["shape"] == "gate_up"), min(cells, key=lambda c: c["bytes_read"]))
        left = small["target_ratio"] * small["byte_time_s"] - small["bytes_read"] / rate
        probe = probes.get((key[0], small["shape"], key[1]))
        empty = "" if probe is None else f"{probe['time_s'] * 1e6:.2f}"
        names = list(dict.fromkeys(c["shape"] for c in sorted(cells, key=lambda c: c["N"])))
        shapes = ", ".join(names) + (f" ({len(cells)} cells)" if len(cells) > len(names) else "")
        rows.append(f"| {key[1]} | {key[2]} | {key[8]} | {key[9]:g} | {shapes} | {fixed * 1e6:.2f} "
                    f"| {rate / 1e12:.2f} | {resid * 1e6:.2f} | {empty} "
                    f"| {left * 1e6:.2f} on {small['shape']} | {key[0]} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def _step_mode(r: dict) -> str:
    """A step record's mode, marked where it ran off a default: '+rope_cache' when its attention
    took RoPE from `rope_cache` in a launch of its own (--no-rope-attention), '+unfolded' when
    split-K attention kept a short last split (--no-attn-fold-tail), '+wN' when the sparse GEMVs'
    default configs ran N warps per program (--gemv-warps), '+deferred' when gate|up skipped its
    split-K finish (--defer-gate-up-finish; records from before a knob say nothing of it and are
    not marked), '+attnpdl' when the split-K attention was launched as a programmatic dependent
    (--attn-pdl), '+exit' when the sparse GEMVs launched with PDL let the next kernel launch only as
    their programs exit (--pdl-trigger exit), '+prefill' when the steps attended over a cache filled
    by a dense prefill (--fill prefill, the default since the flag came; the records before it, and
    --fill random, attend over random normals, which leave o's input far below its calibration),
    '+xchg' when the sparse GEMVs' split-K finish took the sum with atomic exchanges
    (--no-finish-load; the default before sparse_gemv.FINISH_LOAD, whose earlier records are not marked),
    '+countxchg' when its last program zeroed the arrival count with an atomic exchange
    (--no-reset-store; the default before sparse_gemv.RESET_STORE, whose earlier records are not marked),
    '+configs' when its sparse GEMVs took tile configs from a file (--gemv-configs; recorded since
    the runs of h200/kernels/sparse_gemv/sparse_gemv_20261201T1054Z_finish_sweep, whose own rows say
    nothing of it).
    A timing ablation's mode already says so ('proj0.5+ablate-x')."""
    return (r["mode"] + ("+rope_cache" if r.get("rope_in_attention") is False else "")
            + ("+unfolded" if r.get("attn_fold_tail") is False else "")
            + (f"+w{r['gemv_warps']}" if r.get("gemv_warps", 1) != 1 else "")
            + ("+deferred" if r.get("defer_gate_up_finish") else "")
            + ("+attnpdl" if r.get("attn_pdl") else "")
            + ("+exit" if r.get("pdl") and r.get("pdl_trigger") == "exit" else "")
            + ("+prefill" if r.get("fill") == "prefill" else "")
            + ("+xchg" if r.get("finish_load") is False else "")
            + ("+countxchg" if r.get("reset_store") is False else "")
            + ("+configs" if r.get("gemv_configs_file") else ""))


def decode_table(records: list[dict]) -> str:
    """'proj_decode_bench' sparse modes beside their paired dense step and byte bound."""
    rows = ["| mode | compile | realized keep | step ms | dense ms | speedup | byte bound | % of bound | run |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["kind"] != "proj_decode_bench" or r["mode"] == "dense" or r.get("gemv_ablate"):
            continue  # an ablated step computes something else: no bound applies
        mode = _step_mode(r)
        rows.append(f"| {mode} ({r['calibration']['method']}) | {r['compile_mode'] or 'default'} "
                    f"| {r['realized_keep']:.3f} | {r['step_ms_median']:.3f} | {r['paired_dense_ms']:.3f} "
                    f"| {r['speedup']:.3f}× | {r['bound']:.3f}× | {100 * r['fraction_of_bound']:.1f}% "
                    f"| {_commit(r)} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def dense_table(records: list[dict]) -> str:
    """'dense_decode_bench' step times per implementation and context."""
    rows = ["| impl | compile | context | step ms | GB/s | target ms | run |", "|---|---|---|---|---|---|---|"]
    cells = [r for r in records if r["kind"] == "dense_decode_bench" and "step_ms_median" in r]
    for r in sorted(cells, key=lambda r: (r["impl"], r["context"])):
        compile_mode = r.get("compile_mode") or r.get("compile")
        rows.append(f"| {r['impl']} | {compile_mode if compile_mode is not True else 'default'} | {r['context']} "
                    f"| {r['step_ms_median']:.3f} | {r['achieved_GBps']:.0f} | {r.get('target_ms') or ''} "
                    f"| {_commit(r)} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def attention_table(records: list[dict]) -> str:
    """'attention_bench' records: one row per backend, one column per context (µs, TB/s)."""
    cells: dict[str, dict[int, dict]] = {}
    for r in records:
        if r["kind"] == "attention_bench":
            cells.setdefault(r["backend"], {})[r["context"]] = r
    if not cells:
        return ""
    contexts = sorted({c for row in cells.values() for c in row})
    rows = ["| backend | " + " | ".join(f"{c} tokens" for c in contexts) + " |",
            "|---|" + "---|" * len(contexts)]
    for backend, row in cells.items():
        rows.append(f"| {backend} | " + " | ".join(
            f"{row[c]['time_s'] * 1e6:.1f} µs ({row[c]['tb_per_s']:.2f} TB/s)" if c in row else ""
            for c in contexts) + " |")
    return "\n".join(rows)


def kv_select_table(records: list[dict]) -> str:
    """'kv_select_bench' records: the KV branch's one-time cost against its target."""
    rows = ["| method | keep | context | budget | select ms (median) | first call ms | target ms | run |",
            "|---|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in records if r["kind"] == "kv_select_bench"),
                    key=lambda r: (r["method"], r["context"], -r["keep"])):
        rows.append(f"| {r['method']} | {r['keep']:g} | {r['context']} | {r['budget']} "
                    f"| {r['select_s_median'] * 1e3:.1f} | {r['first_s'] * 1e3:.1f} | {r['target_s'] * 1e3:.0f} "
                    f"| {_commit(r)} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def kv_decode_table(records: list[dict]) -> str:
    """'kv_decode_bench' records: each KV mode's step beside the paired dense step and its byte
    bound (the selection's bound counts the entries read at its last generated token)."""
    rows = ["| context | mode | budget | step ms | dense ms | speedup | byte bound | % of bound | select ms | run |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    cells = [r for r in records if r["kind"] == "kv_decode_bench" and r["mode"] != "dense"]
    for r in sorted(cells, key=lambda r: r["context"]):
        rows.append(f"| {r['context']} | {r['mode']} | {r['kv_budget']} | {r['step_ms_median']:.3f} "
                    f"| {r['paired_dense_ms']:.3f} | {r['speedup']:.3f}× | {r['bound']:.3f}× "
                    f"| {100 * r['fraction_of_bound']:.1f}% | {r['select_s'] * 1e3:.0f} | {_commit(r)} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def passkey_table(records: list[dict]) -> str:
    """'passkey_kv' records: per mode, which key depths it answered (and, for the window,
    whether the key lay inside its region)."""
    rows = []
    for r in records:
        if r["kind"] != "passkey_kv":
            continue
        depths = sorted({x["depth"] for x in r["rows"]})
        if not rows:
            rows = ["| model | mode | keep | " + " | ".join(f"depth {d:g}" for d in depths) + " |",
                    "|---|---|---|" + "---|" * len(depths)]
        modes = dict.fromkeys((x["mode"], x["keep"]) for x in r["rows"])
        for mode, keep in modes:
            cells = {x["depth"]: x for x in r["rows"] if (x["mode"], x["keep"]) == (mode, keep)}
            marks = []
            for d in depths:
                x = cells.get(d)
                mark = "" if x is None else ("yes" if x["correct"] else "no")
                if x is not None and "key_in_window" in x:
                    mark += " (in window)" if x["key_in_window"] else " (outside)"
                marks.append(mark)
            rows.append(f"| {r['model']} ({r['runtime']}, {r['tokens']} tokens) | {mode} | {keep:g} | "
                        + " | ".join(marks) + " |")
    return "\n".join(rows)


def kernel_group(name: str) -> str:
    """The part of a decode step a kernel belongs to, from its name (for step profiles).
    Inductor's generated kernels ('triton_poi_fused_...', 'triton_red_...') are 'other' even
    where their names list a custom op whose output they read (the SwiGLU product after the
    gate|up GEMV is 'triton_poi_fused_mul_silu_sparse_gemv_...')."""
    low = name.lower()
    if low.startswith("triton_"):
        return "other"
    if "sparse_gemv" in low or "gather_gemv" in low:
        return "sparse GEMV"
    if "attention" in low or "_split_kernel" in low or "flash" in low:
        return "attention"
    if any(k in low for k in ("cublas", "nvjet", "gemv", "gemm", "cutlass", "splitkreduce")):
        return "cuBLAS"
    return "other"


def profile_table(records: list[dict]) -> str:
    """'proj_decode_bench' records with a kernel profile: device time per step by kernel group."""
    profiled = [r for r in records if r["kind"] == "proj_decode_bench" and r.get("profile")]
    groups = ["cuBLAS", "sparse GEMV", "attention", "other"]
    rows = ["| mode | step ms | kernels ms | " + " | ".join(f"{g} ms" for g in groups) + " | launches | run |",
            "|---|---|---|" + "---|" * len(groups) + "---|---|"]
    for r in profiled:
        by = dict.fromkeys(groups, 0.0)
        for k in r["profile"]["kernels"]:
            by[kernel_group(k["name"])] += k["us_per_step"]
        launches = sum(k["calls_per_step"] for k in r["profile"]["kernels"])
        rows.append(f"| {_step_mode(r)} | {r['step_ms_median']:.3f} | {r['profile']['kernel_us_per_step'] / 1e3:.3f} | "
                    + " | ".join(f"{by[g] / 1e3:.3f}" for g in groups) + f" | {launches:.0f} | {_commit(r)} |")
    return "\n".join(rows) if len(rows) > 2 else ""


STEP_GEMV_CALLS = ("q|k|v", "o", "gate|up", "down")  # a fused decoder layer's sparse GEMVs, in launch order
STEP_BYTE_RATE = 4.15e12  # bytes/s: the H200's measured streaming rate, as sparse_gemv_bench's byte time


def step_gemv_table(records: list[dict]) -> str:
    """The sparse GEMV judged inside the decode step: per call of a layer (q|k|v, o, gate|up,
    down), its mean device time over the layers in a profiled 'proj_decode_bench' record (the
    profile's call sites of `_sparse_gemv_kernel`, 4 a layer in launch order) beside the byte
    time of the weight bytes it read (the record's `call_bytes`: each site's realized keep; for
    an ablated step, rows kept by parity, half of each weight). The pipes of a call's name are
    escaped for Markdown. A step whose sparse GEMVs launched with PDL is marked: each launch's
    profiled time then includes its wait for the kernel before it."""
    rows = ["| mode | call | µs per call | weight MB per call | byte time µs | × byte time | run |",
            "|---|---|---|---|---|---|---|"]
    for r in records:
        sites = ((r.get("profile") or {}).get("sites_us") or {}).get("_sparse_gemv_kernel")
        if r["kind"] != "proj_decode_bench" or not sites or not r.get("call_bytes"):
            continue
        if len(sites) % len(STEP_GEMV_CALLS):
            raise InputError(f"{r['mode']}: {len(sites)} sparse GEMV calls a step, not {len(STEP_GEMV_CALLS)} a layer")
        layers = len(sites) // len(STEP_GEMV_CALLS)
        mode = _step_mode(r) + (" (PDL: waits included)" if r.get("pdl") else "")
        for i, call in enumerate(STEP_GEMV_CALLS):
            us = sum(sites[i::len(STEP_GEMV_CALLS)]) / layers
            read = r["call_bytes"][call]["read"] / layers
            byte_us = read / STEP_BYTE_RATE * 1e6
            name = call.replace("|", "\\|")
            rows.append(f"| {mode} | {name} | {us:.2f} | {read / 1e6:.1f} | {byte_us:.2f} "
                        f"| {us / byte_us:.2f} | {_commit(r)} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def read_floor_table(records: list[dict]) -> str:
    """'read_floor_bench' cells: per shape, keep and run, the fastest one-launch read of the cell's
    bytes (its config and launch mode) against the byte time, beside the default sparse GEMV of
    the same shape and bytes among the records given ('sparse_gemv_bench'; the fastest of them, its
    launch mode and commit said; one of the floor's own commit first, timed on its machine), what the 1.15x target leaves the GEMV past the floor, and where
    given, the same GEMV timed without its split-K finish and without both the finish and x."""
    floors: dict[tuple, dict] = {}
    for r in records:
        if r["kind"] == "read_floor_bench":
            key = (r["shape"], r["keep_target"], r.get("run_id") or _commit(r))
            if key not in floors or r["time_s"] < floors[key]["time_s"]:
                floors[key] = r
    if not floors:
        return ""
    gemvs: dict[tuple, dict] = {}  # (shape, bytes, ablate bits, commit or None) -> the fastest default cell
    for r in records:
        if (r["kind"] == "sparse_gemv_bench" and (r["config_label"] == "default" or r.get("ablate"))
                and not r.get("fused")):
            for key in ((r["shape"], r["bytes_read"], r.get("ablate") or 0, _commit(r)),
                        (r["shape"], r["bytes_read"], r.get("ablate") or 0, None)):
                if key not in gemvs or r["time_s"] < gemvs[key]["time_s"]:
                    gemvs[key] = r

    def gemv(shape: str, nbytes: int, bits: int, commit: str) -> dict | None:  # its own run's first
        return gemvs.get((shape, nbytes, bits, commit)) or gemvs.get((shape, nbytes, bits, None))

    rows = ["| shape | keep | MB read | byte time µs | floor µs | floor config | × byte time | sparse GEMV µs "
            "| GEMV × byte time | GEMV − floor µs | 1.15× less floor µs | GEMV, no finish µs "
            "| GEMV, no finish, no x µs | run |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (shape, keep, _), f in sorted(floors.items(), key=lambda kv: (kv[0][0], -kv[0][1], kv[0][2])):
        g = gemv(shape, f["bytes_read"], 0, _commit(f))
        # ablated cells (sparse_gemv.ABLATE 1: no finish; 3: nor x, rows kept by parity, keep 0.5's bytes)
        # (of the floor's own run only: an ablation is read against the default beside it)
        ablated = [gemvs.get((shape, f["bytes_read"], bits, _commit(f))) for bits in (1, 3)]
        ablated_us = " | ".join("" if a is None else f"{a['time_s'] * 1e6:.2f}" for a in ablated)
        byte_us, floor_us = f["byte_time_s"] * 1e6, f["time_s"] * 1e6
        mode = f["config_label"] + (" (PDL)" if f.get("pdl") == "early" else "")
        cells = ("|  |  |  " if g is None else
                f"| {g['time_s'] * 1e6:.2f}{' (PDL)' if g.get('pdl') == 'early' else ''} ({_commit(g)}) "
                f"| {g['ratio_to_byte_time']:.3f} | {(g['time_s'] - f['time_s']) * 1e6:.2f} ")
        rows.append(f"| {shape} | {keep:g} | {f['bytes_read'] / 1e6:.1f} | {byte_us:.2f} | {floor_us:.2f} | {mode} "
                    f"| {f['ratio_to_byte_time']:.3f} {cells}| {f['target_ratio'] * byte_us - floor_us:.2f} "
                    f"| {ablated_us} | {_commit(f)} |")
    return "\n".join(rows)


def speed_tables(paths) -> str:
    """Every table the given record files fill, separated by blank lines."""
    recs = load_records(paths)
    tables = [f(recs) for f in (dense_table, attention_table, decode_table, gemv_table, gemv_fit_table,
                                kv_select_table, kv_decode_table, passkey_table, profile_table, step_gemv_table,
                                read_floor_table)]
    return "\n\n".join(t for t in tables if t)


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print(speed_tables(sys.argv[1:]))
