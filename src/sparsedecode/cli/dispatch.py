"""`sparsedecode dispatch price` and `dispatch table`: dispatch policies priced on request mixes
from measured step latencies, and the gate table the engine reads (ByteCross §3.3, §5.4, App. I).

    sparsedecode dispatch price data/bytecross/sweep_a100 --select-seconds 0.24
    sparsedecode dispatch price runs/h200_sweep --mix traffic.jsonl --assume-admissible --json
    sparsedecode dispatch table runs/h200_sweep --admit verdict_both.json --out gate.json
    sparsedecode generate --model M --gate gate.json --prompt "..."

RECORDS are campaign folders of timing records of one model on one device (ours or the paper's),
or one gate table written by `dispatch table`. Imports no torch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from sparsedecode.cli.app import app
from sparsedecode.cli.common import (
    COUNT_MAX,
    SEED_MAX,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    TextFileOpt,
    bounded,
    check_calibration_text,
    check_out_file,
    emit_json,
    out_file,
    parse_float,
    parse_requests,
)
from sparsedecode.errors import InputError

dispatch_app = typer.Typer(help="Price configurations on request mixes; write the gate table.",
                           no_args_is_help=True)
app.add_typer(dispatch_app, name="dispatch")

RecordsArg = Annotated[list[str], typer.Argument(help="Campaign folders of timing records (one model, one device), or a gate table (.json).")]
SelectOpt = Annotated[str | None, typer.Option("--select-seconds", help="The KV selection's time on a 32K prompt in seconds, charged per prompt token (the paper: 0.24 on A100-SXM4, 0.32 on RTX A6000); default: the cells' measured select_s.")]
SelectRecordOpt = Annotated[str | None, typer.Option("--select-record", help="A 'kv_select_bench' record: its median selection time, per prompt token (instead of --select-seconds).")]
AdmitOpt = Annotated[list[str] | None, typer.Option("--admit", help="An 'admissibility' record (sparsedecode eval admit --json > FILE), repeatable: configurations the gate may choose.")]
AssumeOpt = Annotated[bool, typer.Option("--assume-admissible", help="Let the gate choose every configuration without quality records (say so when you report it).")]


def _select(text: str | None, record: str | None = None) -> float | None:
    if record is not None:
        from sparsedecode.dispatch.prices import select_seconds_of
        from sparsedecode.records import read_record

        if text is not None:
            raise InputError("give --select-seconds or --select-record, not both")
        if not Path(record).is_file():
            raise InputError(f"--select-record {record}: file not found")
        return select_seconds_of(read_record(record), f"--select-record {record}")
    if text is None:
        return None
    v = parse_float(text, "--select-seconds")
    if not (math.isfinite(v) and v >= 0):
        raise InputError(f"--select-seconds must be a finite number of seconds >= 0, got {text}")
    return v


BatchOpt = Annotated[int, typer.Option("--batch", callback=bounded(1, 4096), help="Price steps of this many sequences: the campaign's cells of that batch size (a grid's batch key; issue 44).")]


def _table(records: list[str], select_seconds: float | None, batch: int = 1):
    """A PriceTable from record folders (the cells of `batch` sequences a step), or from one gate
    table file."""
    from sparsedecode.dispatch.prices import PriceTable, from_records

    if len(records) == 1 and Path(records[0]).is_file():
        if select_seconds is not None:
            raise InputError("--select-seconds applies to timing records; a gate table holds its selection costs")
        table = PriceTable.read(records[0])
        if batch != 1 and table.batch != batch:
            raise InputError(f"--batch {batch}: {records[0]} prices steps of {table.batch} sequences; build a table "
                             f"of batch {batch} from the timing records")
        return table
    for r in records:
        if not Path(r).exists():
            raise InputError(f"{r}: no such folder of timing records")
    return from_records(records, select_seconds, batch=batch)


def _verdicts(paths: list[str] | None) -> list[dict]:
    from sparsedecode.records import read_record

    out = []
    for p in paths or []:
        if not Path(p).is_file():
            raise InputError(f"--admit {p}: file not found")
        try:
            out.append(read_record(p))
        except UnicodeDecodeError:
            raise InputError(f"--admit {p}: not UTF-8 JSON") from None
    return out


def _admit(table, admit: list[str] | None, assume: bool):
    from sparsedecode.dispatch.policies import admissible

    verdicts = _verdicts(admit)
    if table.admissibility and not verdicts and not assume:  # a gate table carries its evidence
        ok = [s for s, e in table.admissibility.items() if e.get("admitted")]
        why = {s: e["reason"] for s, e in table.admissibility.items() if e.get("reason")}
        return (["dense"] + [s for s in ok if s != "dense"]), why
    return admissible(table, verdicts, assume, names=list(admit or []))


@dispatch_app.command("price")
def price_cmd(
    records: RecordsArg,
    mix: Annotated[str, typer.Option("--mix", help="mixed, chat, long_doc, agent (App. I), or a trace: JSONL {prompt_tokens, answer_tokens} lines or a CSV with those columns.")] = "mixed",
    seed: Annotated[int, typer.Option("--seed", callback=bounded(0, SEED_MAX), help="Seed of the App. I workloads.")] = 0,
    select_seconds: SelectOpt = None,
    select_record: SelectRecordOpt = None,
    admit: AdmitOpt = None,
    assume_admissible: AssumeOpt = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the speedup table as markdown (for docs).")] = False,
    plot: Annotated[str | None, typer.Option("--plot", callback=out_file(".png"), help="PNG: the gate's choice by prompt and answer length, and its speedup by prompt-length bucket.")] = None,
    batch: BatchOpt = 1,
    json_out: JsonOpt = False,
) -> None:
    """Speedup over always-dense of each policy on the App. I workloads, and its share of requests per configuration.

    The policies: always-X, the calibrated gate, the byte gate, a prompt-length threshold."""
    from sparsedecode.dispatch.mix import get_mix
    from sparsedecode.dispatch.policies import price_workloads

    if seed < 0 or seed >= 2**63:
        raise InputError(f"--seed must be a whole number in [0, 2^63), got {seed}")
    sel = _select(select_seconds, select_record)
    plot_path = check_out_file(plot, "--plot", ".png") if plot else None
    chosen = get_mix(mix, seed)  # a bad trace fails before any pricing
    table = _table(records, sel, batch)
    ok, why = _admit(table, admit, assume_admissible)
    rows = price_workloads(table, chosen, ok, seed)
    main = {r.policy: r for r in rows[chosen.name]}
    if plot_path is not None:
        from sparsedecode.report.dispatch_plot import gate_plot

        gate_plot(table, chosen, ok, plot_path)
    if json_out:
        speed, by_config = {}, {}
        for name, r in main.items():
            if name.startswith("always "):
                spec = name.removeprefix("always ")
                by_config[spec] = r.speedup
                speed.setdefault(_kind(spec), r.speedup)  # the first configuration of each kind
            else:
                speed[name.replace(", ", "_").replace(" ", "_")] = r.speedup
        emit_json({
            "kind": "dispatch_price", "mix": chosen.summary(), "seed": seed,
            "speedup": speed, "speedup_by_config": by_config, "shares": {name: r.shares for name, r in main.items()},
            "policies": [r.to_dict() for r in rows[chosen.name]],
            "workloads": {n: {r.policy: r.speedup for r in rs} for n, rs in rows.items()},
            "admissible": ok, "excluded": {k: v for k, v in why.items() if k not in ok}, "reasons": why,
            "inputs": {"records": list(table.records), "model": table.model, "gpu": table.gpu,
                       "source": table.source, "attention": table.attention,
                       "select": {s: (c.select.to_dict() if c.select else None) for s, c in table.configs.items()},
                       "notes": list(table.notes)},
            **({"plot": str(plot_path)} if plot_path else {}),
        })
        return
    if markdown:
        from sparsedecode.report.dispatch_table import price_markdown

        typer.echo(price_markdown(rows, chosen.name))
        return
    _print(table, rows, chosen.name, ok, why, plot_path)


def _kind(spec: str) -> str:
    from sparsedecode.config import SparsityConfig

    return SparsityConfig.parse(spec).kind


def _print(table, rows, chosen: str, ok, why, plot_path) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"{table.model} on {table.gpu} ({table.source} records: {', '.join(table.records)}); "
              f"attention {table.attention or 'as recorded'}")
    for note in table.notes:
        con.print(f"note: {note}")
    sel = {s: c.select for s, c in table.configs.items() if c.select is not None}
    for s, c in sel.items():
        how = (f"{c.seconds_at_32k:g} s at 32K, per prompt token" if c.kind == "per_token" else
               "measured: " + ", ".join(f"{t:.3f} s at {n:,}" for n, t in zip(c.contexts, c.seconds, strict=True)))
        con.print(f"selection of {s}: {how}")
    t = Table(title="Decode speedup over always-dense (ByteCross Table 5); one-time selection costs included")
    t.add_column("policy")
    names = list(rows)
    for n in names:
        t.add_column(n + (" *" if n == chosen else ""), justify="right")
    for i, r in enumerate(rows[chosen]):
        t.add_row(r.policy, *[f"{rows[n][i].speedup:.3f}" for n in names])
    con.print(t)
    s = Table(title=f"Share of requests per configuration on {chosen}")
    s.add_column("policy")
    for spec in table.specs:
        s.add_column(spec, justify="right")
    s.add_column("notes")
    for r in rows[chosen]:
        note = []
        if r.infeasible:
            note.append(f"{r.infeasible} requests priced as if the selection ran, as the paper prices them: "
                        "their KV budget is below sinks + window, so the gates cannot choose it for them")
        if "threshold_tokens" in r.detail:
            th = r.detail["threshold_tokens"]
            note.append(f"{r.detail['long']} from {'never' if th is None else f'{th:,}'} tokens, else {r.detail['short']}")
        s.add_row(r.policy, *[f"{100 * r.shares.get(spec, 0):.1f}%" for spec in table.specs], "; ".join(note))
    con.print(s)
    con.print(f"the gates choose among: {', '.join(ok)}")
    for spec, reason in why.items():
        con.print(f"  {spec}: {reason}")
    if plot_path is not None:
        con.print(f"wrote {plot_path}")


@dispatch_app.command("table")
def table_cmd(
    records: RecordsArg,
    out: Annotated[str, typer.Option("--out", "-o", callback=out_file(".json"), help="The gate table to write (JSON).")],
    select_seconds: SelectOpt = None,
    select_record: SelectRecordOpt = None,
    admit: AdmitOpt = None,
    assume_admissible: AssumeOpt = False,
    batch: BatchOpt = 1,
    json_out: JsonOpt = False,
) -> None:
    """Write the gate table: dims, device, dtype, attention path, per-configuration step curves
    and one-time costs, and the admissibility evidence; `dispatch.runtime.load_gate(engine, FILE)` and `generate
    --gate FILE` decode each request under its configuration of least predicted cost."""
    from dataclasses import replace

    from sparsedecode.records import stamp, write_record

    path = check_out_file(out, "--out", ".json")
    sel = _select(select_seconds, select_record)
    table = _table(records, sel, batch)
    ok, why = _admit(table, admit, assume_admissible)
    evidence = {s: {"admitted": s in ok, **({"reason": why[s]} if s in why else {})} for s in table.specs}
    table = replace(table, admissibility=evidence)
    rec = stamp(table.to_dict(), with_torch=False)
    if path.exists():
        path.unlink()  # a gate table is a derived file: rewriting it is the point of this command
    write_record(path, rec)
    if json_out:
        emit_json({"kind": "gate_table_written", "path": str(path), "configs": table.specs,
                   "admissible": ok, "excluded": {k: v for k, v in why.items() if k not in ok}, "reasons": why})
        return
    typer.echo(f"wrote {path}: {table.model} on {table.gpu}" + (f", steps of {batch} sequences" if batch > 1 else "")
               + f", configurations {', '.join(table.specs)}; "
               f"the gate may choose {', '.join(ok)}")
    for spec, reason in why.items():
        typer.echo(f"  {spec}: {reason}")


@dispatch_app.command("check")
def check_cmd(
    gate: Annotated[str, typer.Argument(help="Gate table (sparsedecode dispatch table).")],
    model: Annotated[str, typer.Option("--model", "-m", help="Known name, HF folder, hub id or .gguf file.")],
    request: Annotated[list[str], typer.Option("--request", help="PROMPT:ANSWER tokens, e.g. 2K:256, repeatable.")],
    init: Annotated[str, typer.Option("--init", help="pretrained, or random (paper-sized models for timing).")] = "pretrained",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    attention: Annotated[str, typer.Option("--attention", help="split_k, sdpa_masked or sdpa_fused.")] = "split_k",
    repeats: Annotated[int, typer.Option("--repeats", callback=bounded(1, COUNT_MAX), help="Decode each request this many times.")] = 1,
    seed: Annotated[int, typer.Option("--seed", callback=bounded(0, SEED_MAX), help="Seed of the requests' random token ids.")] = 0,
    tolerance: Annotated[str, typer.Option("--tolerance", help="Largest |measured / predicted - 1| that passes.")] = "0.1",
    text_file: TextFileOpt = None,
    out: Annotated[str | None, typer.Option("--out", "-o", callback=out_file(".json"), help="Write a 'gate_check' record (JSON) here.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Decode requests under the gate and set each one's measured ms/token beside the table's prediction.

    The gate's projection keeps calibrate TEAL thresholds once (a pretrained model: on WikiText-2
    validation or --text-file; --init random: on seeded random ids). Exit status 1 when one misses
    by more than --tolerance."""
    import time

    from sparsedecode.dispatch.mix import check_request

    reqs = [check_request(p, a, f"--request {r}") for r, (p, a) in zip(request, parse_requests(request), strict=True)]
    if repeats < 1:
        raise InputError(f"--repeats must be >= 1, got {repeats}")
    tol = parse_float(tolerance, "--tolerance", positive=True)
    path = check_out_file(out, "--out", ".json") if out else None
    if path is not None and path.exists():
        raise InputError(f"--out {path} exists; records are never overwritten (pick a new path)")
    if not Path(gate).is_file():
        raise InputError(f"{gate}: gate table not found")
    check_calibration_text(text_file, calibrates=True, init=init)
    import sparsedecode
    from sparsedecode.dispatch.runtime import check_requests, load_gate
    from sparsedecode.records import stamp, write_record

    t0 = time.perf_counter()
    eng = sparsedecode.load(model, device=device, dtype=dtype, init=init, attention=attention, quiet=True,
                            max_len=max(p + a for p, a in reqs))
    gate_obj = load_gate(eng, gate, progress=not json_out, text_file=text_file)
    load_s = time.perf_counter() - t0
    say = (lambda line: None) if json_out else typer.echo
    say(f"loaded {eng!r} with the gate in {load_s:.1f} s; configurations {', '.join(gate_obj.specs)}")
    warm = gate_obj.warm(lambda spec, s: say(f"  captured {spec} in {s:.1f} s"))

    def show(row):
        say(f"{row['prompt_tokens']:>7,} + {row['answer_tokens']:<5} -> {row['mode']:<12} predicted "
            f"{row['predicted_ms_per_token']:.3f} ms/token, measured {row['ms_per_token']:.3f} "
            f"({100 * (row['ratio'] - 1):+.1f}%), select {row['kv_select_s']:.3f} s "
            f"(predicted {row['predicted_select_s']:.3f}), prefill {row['prefill_s']:.2f} s")

    rows = check_requests(eng, gate_obj, reqs, seed=seed, repeats=repeats, progress=show)
    ok = all(abs(r["ratio"] - 1) <= tol for r in rows)
    rec = stamp({"kind": "gate_check", "gate": str(gate), "table": gate_obj.table.to_dict(),
                 "model": {"name": eng.name, "init": init, "dims": eng.dims.to_dict()},
                 "device": str(eng.device), "dtype": str(eng.dtype).removeprefix("torch."), "attention": attention,
                 "load_s": load_s, "capture_s": warm, "tolerance": tol, "passed": ok, "requests": rows,
                 "protocol": "seeded random token ids, EOS ignored; every configuration captured before timing; "
                             "ms/token = decode seconds / decode steps of Engine.generate"})
    if path is not None:
        write_record(path, rec)
        say(f"wrote {path}")
    if json_out:
        emit_json(rec)
    else:
        say(f"{'all within' if ok else 'NOT all within'} {100 * tol:g}% of the table's prediction")
    if not ok:
        raise typer.Exit(1)
