"""`sparsedecode account`: the byte account of a decode step (ByteCross §3, §4.3, §5.2).

    sparsedecode account --model llama-3.1-8b --proj-keep 0.5 --kv-keep 0.3 --context 128K
    sparsedecode account --model llama-3.1-8b --proj-keep 0.5 --routed 0.5 --ff-only --context 8K
    sparsedecode account matched --model llama-3.1-8b --proj 0.7:0.18,0.5:0.995 \
        --sel 0.3:0.004,0.1:0.06 --budget 0.2
    sparsedecode account plot --model llama-3.1-8b --out bounds.png

Imports no torch: it answers in a fraction of a second.
"""

from __future__ import annotations

from typing import Annotated

import typer

from sparsedecode import account as acc
from sparsedecode.account.units import check_keep, fmt_bytes, fmt_k
from sparsedecode.cli.app import app
from sparsedecode.cli.common import (
    COUNT_MAX,
    TOKENS,
    ConfigOpt,
    FfOnlyOpt,
    JsonOpt,
    KvBytesOpt,
    KvKeepOpt,
    ModelOpt,
    ProjKeepOpt,
    WeightBytesOpt,
    bounded,
    emit_json,
    out_file,
    parse_float,
)
from sparsedecode.errors import InputError

account_app = typer.Typer(
    help="The byte account: crossover n*, byte bounds and traffic of a decode step.",
    invoke_without_command=True,
    no_args_is_help=False,
)
app.add_typer(account_app, name="account")


MAX_ELEMENT_BYTES = 8  # float64: larger element sizes are no format, and overflow the byte sums


def _sizes(weight_bytes: str, kv_bytes: str) -> tuple[float, float]:
    out = []
    for text, flag in ((weight_bytes, "--weight-bytes"), (kv_bytes, "--kv-bytes")):
        v = parse_float(text, flag, positive=True)
        if not v <= MAX_ELEMENT_BYTES:
            raise InputError(f"{flag} {text} is not an element size: give bytes per element up to "
                             f"{MAX_ELEMENT_BYTES} (2 = 16-bit, 0.5 = 4-bit)")
        out.append(v)
    return out[0], out[1]


def _window(model: str | None, config: str | None) -> int | None:
    """The model's window (max_position_embeddings), when its config says."""
    try:
        cfg = acc.known_model(model).config if model else acc.load_config(config)[0] if config else {}
    except InputError:
        return None
    w = cfg.get("max_position_embeddings")
    return w if isinstance(w, int) and not isinstance(w, bool) and w > 0 else None


def _window_notes(out: dict, window: int | None) -> list[str]:
    """Say where a context or a crossover lies beyond the model window (the account still
    counts its bytes, but the model cannot decode there)."""
    if window is None:
        return []
    notes = []
    for key, what in (("context", "--context"), ("crossover_exact", "the crossover n*"),
                      ("crossover_ff_exact", "the feed-forward-only crossover")):
        v = out.get(key)
        if isinstance(v, int | float) and v != float("inf") and v > window:
            notes.append(f"{what} ({fmt_k(v)}) lies beyond the model window of {fmt_k(window)} "
                         f"({window:,} tokens): the model cannot decode there")
    for row in out.get("traffic", []):
        if row["context"] > window:
            notes.append(f"--contexts {fmt_k(row['context'])} lies beyond the model window of {fmt_k(window)}")
    return notes


def _refuse_leading_options(ctx: typer.Context) -> None:
    """Options of `account` itself given before a sub-command would be silently dropped:
    refuse them, naming where they go."""
    def explicit(name: str) -> bool:  # by name: typer may carry its own click and its enum
        src = ctx.get_parameter_source(name)
        return src is not None and src.name not in ("DEFAULT", "DEFAULT_MAP")

    given = [p for p in ctx.command.params if explicit(p.name)]
    if given:
        flags = " ".join(p.opts[0] for p in given)
        raise InputError(
            f"{flags} before '{ctx.invoked_subcommand}' would be ignored: options go after the "
            f"sub-command (sparsedecode account {ctx.invoked_subcommand} {flags} ...; see "
            f"sparsedecode account {ctx.invoked_subcommand} --help)")


def _tokens_str(n: float | None) -> str:
    if n is None or n == float("inf"):
        return "never (the KV branch removes nothing, or its sliding windows cap it below the projection's saving)"
    return f"{acc.round_tokens(n):,} tokens ({fmt_k(n)})"


@account_app.callback()
def account(
    ctx: typer.Context,
    model: ModelOpt = None,
    config: ConfigOpt = None,
    rp: ProjKeepOpt = "0.5",
    rkv: KvKeepOpt = "0.3",
    context: Annotated[
        int | None, typer.Option("--context", "-n", **TOKENS, help="Context length (32768, 32K, 32k).")
    ] = None,
    ff_only: FfOnlyOpt = False,
    batch: Annotated[int | None, typer.Option("--batch", callback=bounded(1, COUNT_MAX), help="Batch size B.")] = None,
    union: Annotated[
        str | None, typer.Option("--union", help="Union keep u_B of a batch's channels.")
    ] = None,
    budget: Annotated[
        int | None, typer.Option("--budget", **TOKENS, help="Fixed KV token budget b (e.g. 4K).")
    ] = None,
    contexts: Annotated[
        str | None, typer.Option("--contexts", help="Traffic table at these contexts: 2K,8K,32K.")
    ] = None,
    cost_proj: Annotated[
        str | None,
        typer.Option("--cost-proj", help="Kernel cost c_P of the projection branch, ms."),
    ] = None,
    cost_kv: Annotated[
        str | None, typer.Option("--cost-kv", help="Kernel cost c_KV of the KV branch, ms.")
    ] = None,
    bandwidth: Annotated[
        str | None, typer.Option("--bandwidth", help="Effective bandwidth in GB/s for --cost-*.")
    ] = None,
    routed: Annotated[
        str | None,
        typer.Option("--routed", help="Token routing: fraction R of decode steps on the sparse "
                     "path (the rest dense); the account then uses the effective keep "
                     "R*rp + (1 - R)."),
    ] = None,
    weight_bytes: WeightBytesOpt = "2",
    kv_bytes: KvBytesOpt = "2",
    json_out: JsonOpt = False,
) -> None:
    """Crossover n*, byte bounds at a context, batched / fixed-budget crossovers, traffic table."""
    if ctx.invoked_subcommand is not None:
        _refuse_leading_options(ctx)
        return
    dims = acc.resolve_dims(model, config)
    r_sparse, r_kv = check_keep(rp, "--proj-keep"), check_keep(rkv, "--kv-keep")
    s_w, s_kv = _sizes(weight_bytes, kv_bytes)
    routing = None
    r_p = r_sparse
    if routed is not None:  # every byte quantity below is linear in the keep: use the mean step's
        r = acc.check_routed(routed, "--routed")
        r_p = acc.routed_keep(r_sparse, r)
        n_b = 0 if context is None else acc.parse_tokens(context, "--context")
        routing = {
            "routed": r,
            "sparse_keep": r_sparse,
            "effective_keep": r_p,
            "bound_context": n_b,
            "bound": acc.bounds(dims, n_b, r_p, r_kv, ff_only, s_w, s_kv).projection,
            "static_bound": acc.bounds(dims, n_b, r_sparse, r_kv, ff_only, s_w, s_kv).projection,
        }
    n_star = acc.crossover(dims, r_p, r_kv, ff_only, s_w, s_kv)
    n_ff = acc.crossover(dims, r_p, r_kv, True, s_w, s_kv)
    out: dict = {
        "model": dims.name,
        "dims": dims.to_dict(),
        "rp": r_p,
        "rkv": r_kv,
        "ff_only": ff_only,
        "weight_bytes": s_w,
        "kv_bytes": s_kv,
        "crossover_tokens": acc.round_tokens(n_star),
        "crossover_exact": n_star,
        "crossover_ff_tokens": acc.round_tokens(n_ff),
        "crossover_ff_exact": n_ff,
    }
    if routing is not None:
        out["rp"] = r_sparse
        out["routing"] = routing
    if (batch is None) != (union is None):
        raise InputError("--batch and --union go together: e.g. --batch 4 --union 0.92")
    if batch is not None:
        u = check_keep(union, "--union")
        if u < r_sparse:
            raise InputError(
                f"--union {u} is below --proj-keep {r_sparse}: a batch reads at least the channels one "
                "sequence reads, so u_B >= r_P"
            )
        nb = acc.crossover_batched(dims, u, r_kv, batch, ff_only, s_w, s_kv)
        out["batched"] = {
            "batch": batch,
            "union": u,
            "crossover_tokens": acc.round_tokens(nb),
            "crossover_exact": nb,
        }
    if budget is not None:
        b = acc.parse_tokens(budget, "--budget")
        nf = acc.crossover_fixed_budget(dims, r_p, b, ff_only, s_w, s_kv)
        out["fixed_budget"] = {
            "budget_tokens": b,
            "crossover_tokens": acc.round_tokens(nf),
            "crossover_exact": nf,
        }
    costs = (cost_proj, cost_kv, bandwidth)
    if any(c is not None for c in costs):
        if any(c is None for c in costs):
            raise InputError(
                "--cost-proj, --cost-kv and --bandwidth go together, e.g. "
                "--cost-proj 2.0 --cost-kv 0.3 --bandwidth 1600"
            )
        cp, ck = parse_float(cost_proj, "--cost-proj"), parse_float(cost_kv, "--cost-kv")
        for flag, v in (("--cost-proj", cp), ("--cost-kv", ck)):
            if not (v >= 0 and v != float("inf")):
                raise InputError(f"{flag} {v:g} is not a kernel cost: the time a step takes above its byte "
                                 "time, in ms, >= 0 (a measured cost below 0 means the step beat its byte "
                                 "time: use 0)")
        bw = parse_float(bandwidth, "--bandwidth", positive=True)
        nl = acc.latency_crossing(dims, r_p, r_kv, cp, ck, bw, ff_only, s_w, s_kv)
        out["latency"] = {
            "cost_proj_ms": cp,
            "cost_kv_ms": ck,
            "bandwidth_gbps": bw,
            "gap_growth_ms_per_k": acc.kv_gap_growth_ms_per_k(dims, r_kv, bw, s_kv),
            "crossing_tokens": acc.round_tokens(nl),
            "crossing_exact": nl,
        }
    if context is not None:
        n = acc.parse_tokens(context, "--context")
        out["context"] = n
        out["bytes"] = acc.step_bytes(dims, n, s_w, s_kv).to_dict()
        out["bounds"] = acc.bounds(dims, n, r_p, r_kv, ff_only, s_w, s_kv).to_dict()
    if contexts is not None:
        ns = acc.parse_token_list(contexts, "--contexts")
        out["traffic"] = acc.traffic_table(dims, ns, r_p, r_kv, ff_only, s_w, s_kv)
    out["notes"] = _window_notes(out, _window(model, config))
    if json_out:
        emit_json(out)
    else:
        _print_account(out)


def _print_account(out: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    d = out["dims"]
    con.print(
        f"[bold]{out['model']}[/]: {d['n_layers']} layers, d={d['d']}, d_ff={d['d_ff']}, "
        f"{d['n_heads']} query / {d['n_kv_heads']} KV heads of {d['head_dim']}, "
        f"vocab {d['vocab']}; weights {out['weight_bytes']:g} B, KV {out['kv_bytes']:g} B per element"
    )
    for note in out.get("notes", []):
        con.print(f"note: {note}")
    sites = "feed-forward projections" if out["ff_only"] else "seven projections"
    rt = out.get("routing")
    rp = out["rp"] if rt is None else rt["effective_keep"]
    if rt is not None:
        con.print(
            f"token routing: {100 * rt['routed']:g}% of decode steps at keep {rt['sparse_keep']:g}, "
            f"the rest dense: effective keep {rt['effective_keep']:.4g}; projection byte bound "
            f"{rt['bound']:.3f}x at {rt['bound_context']:,} tokens (static sparse "
            f"{rt['static_bound']:.3f}x)"
        )
    t = Table(title=f"Byte crossover at r_P={rp:g}, r_KV={out['rkv']:g} (K = 1,024 tokens)")
    t.add_column("crossover")
    t.add_column("context", justify="right")
    t.add_row(f"n*, {sites}", _tokens_str(out["crossover_exact"]))
    if not out["ff_only"]:
        t.add_row("n*, feed-forward only", _tokens_str(out["crossover_ff_exact"]))
    if "batched" in out:
        b = out["batched"]
        t.add_row(f"n*_B, B={b['batch']}, u_B={b['union']:g}", _tokens_str(b["crossover_exact"]))
    if "fixed_budget" in out:
        f = out["fixed_budget"]
        t.add_row(f"n*, fixed KV budget {f['budget_tokens']:,}", _tokens_str(f["crossover_exact"]))
    if "latency" in out:
        la = out["latency"]
        t.add_row(
            f"latency crossing, c_P={la['cost_proj_ms']:g} ms, c_KV={la['cost_kv_ms']:g} ms, "
            f"s={la['gap_growth_ms_per_k']:.3f} ms/K",
            _tokens_str(la["crossing_exact"]),
        )
    con.print(t)
    if "context" in out:
        n, by, bo = out["context"], out["bytes"], out["bounds"]
        t = Table(title=f"One decode step at {n:,} tokens ({fmt_k(n)})")
        for col in ("MLP", "attention", "KV cache", "other", "total"):
            t.add_column(col, justify="right")
        t.add_row(*(fmt_bytes(by[k]) for k in ("mlp", "attn", "kv", "other", "total")))
        con.print(t)
        t = Table(title="Ideal speedup (byte bound)")
        for col in ("projection", "KV", "both"):
            t.add_column(col, justify="right")
        t.add_row(*(f"{bo[k]:.3f}x" for k in ("projection", "kv", "both")))
        con.print(t)
    if "traffic" in out:
        branch = "FF-only" if out["ff_only"] else "projection"
        t = Table(title="Decode-step traffic (share of reads; MB removed per step)")
        for col in (
            "context",
            "total",
            "MLP",
            "attention",
            "KV",
            "other",
            f"{branch} r_P={rp:g}",
            f"KV r_KV={out['rkv']:g}",
        ):
            t.add_column(col, justify="right")
        for r in out["traffic"]:
            s = r["share"]
            t.add_row(
                fmt_k(r["context"], 0 if r["context"] % 1024 == 0 else 1),
                fmt_bytes(r["total_bytes"]),
                *(f"{100 * s[k]:.1f}%" for k in ("mlp", "attn", "kv", "other")),
                f"{r['removed_mb']['projection']:,.0f}",
                f"{r['removed_mb']['kv']:,.0f}",
            )
        con.print(t)


@account_app.command("matched")
def matched(
    proj: Annotated[
        str, typer.Option("--proj", help="Projection curve KEEP:DELTA,... e.g. 0.7:0.18,0.5:0.995")
    ],
    sel: Annotated[str, typer.Option("--sel", help="KV selection curve KEEP:DELTA,...")],
    budget: Annotated[str, typer.Option("--budget", help="Quality budget (e.g. 0.2 PPL).")],
    model: ModelOpt = None,
    config: ConfigOpt = None,
    ff_only: FfOnlyOpt = False,
    weight_bytes: WeightBytesOpt = "2",
    kv_bytes: KvBytesOpt = "2",
    json_out: JsonOpt = False,
) -> None:
    """Quality-matched crossover: each branch at its most aggressive keep within the budget."""
    dims = acc.resolve_dims(model, config)
    s_w, s_kv = _sizes(weight_bytes, kv_bytes)
    pc, kc = acc.parse_curve(proj, "--proj"), acc.parse_curve(sel, "--sel")
    b = parse_float(budget, "--budget")
    m = acc.matched_crossover(dims, pc, kc, b, ff_only, s_w, s_kv)
    out = {
        "model": dims.name,
        **m.to_dict(),
        "crossover_tokens": acc.round_tokens(m.crossover),
        "proj_curve": pc,
        "sel_curve": kc,
    }
    if json_out:
        emit_json(out)
        return
    fmt_keep = lambda k: "none within budget (stays dense)" if k is None else f"{k:.4f}"  # noqa: E731
    typer.echo(f"{dims.name}, budget {b:g}:")
    typer.echo(f"  projection keep {fmt_keep(m.proj_keep)}")
    typer.echo(f"  KV selection keep {fmt_keep(m.kv_keep)}")
    if m.crossover == 0:
        typer.echo("  crossover: 0 tokens (only the KV branch is admissible)")
    else:
        typer.echo(f"  crossover: {_tokens_str(m.crossover)}")


@account_app.command("plot")
def plot(
    out: Annotated[str, typer.Option("--out", "-o", callback=out_file((".png", ".pdf", ".svg")), help="Output image (.png, .pdf, .svg).")],
    model: ModelOpt = None,
    config: ConfigOpt = None,
    rp: ProjKeepOpt = "0.5",
    rkv: KvKeepOpt = "0.3",
    ff_only: FfOnlyOpt = False,
    max_context: Annotated[
        int | None, typer.Option("--max-context", **TOKENS, help="Right end of the axis (default 4 n*).")
    ] = None,
    weight_bytes: WeightBytesOpt = "2",
    kv_bytes: KvBytesOpt = "2",
) -> None:
    """Byte bounds of the three modes against context (log axis) with n* marked."""
    from sparsedecode.report.account_plot import plot_bounds

    dims = acc.resolve_dims(model, config)
    r_p, r_kv = check_keep(rp, "--proj-keep"), check_keep(rkv, "--kv-keep")
    s_w, s_kv = _sizes(weight_bytes, kv_bytes)
    n_max = acc.parse_tokens(max_context, "--max-context") if max_context is not None else None
    path = plot_bounds(dims, r_p, r_kv, out, ff_only, s_w, s_kv, n_max)
    typer.echo(f"wrote {path}")
