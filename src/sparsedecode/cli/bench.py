"""`sparsedecode bench cell|ceiling|union` and `sparsedecode campaign run|status` (ByteCross App. A
'Timing', §4.2; App. F).

    sparsedecode bench ceiling [--gib 1] --out runs/h200/ceiling.json
    sparsedecode bench union --model smollm2-135m --proj-keep 0.5 [--sequences 64 --context 4K --steps 16] --out u.json
    sparsedecode bench cell --model llama-3.1-8b --init random --context 32K --mode sel0.3 \\
        [--attention split_k] [--repeats 5 --steps 50 --warmup 5] [--fill prefill|random] \\
        [--compile-mode ''] [--device cuda] [--dtype bfloat16] [--text-file F] --out cell.json [--json]
    sparsedecode campaign run examples/campaigns/h200_sweep.toml --out runs/h200 [--executor local|ray]
    sparsedecode campaign status runs/h200 [--json]
    sparsedecode campaign plan-crossing SWEEP_DIR --group sweep --prediction P.json --spec C.toml
    sparsedecode campaign merge RUN_ELSEWHERE [...] --into runs/h200 [--json]

A cell runs in the current process; a campaign launches each cell as a fresh
process of `bench cell`. torch is imported inside the commands.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from sparsedecode.cli.app import app
from sparsedecode.cli.common import (
    COUNT_MAX,
    SECONDS_MAX,
    TOKENS,
    AdapterOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    MethodOpt,
    ObsOpt,
    ProjKeepOpt,
    TextFileOpt,
    ThreadsOpt,
    ThresholdsOpt,
    bounded,
    check_out_file,
    emit_json,
    out_dir,
    out_file,
)
from sparsedecode.errors import InputError

bench_app = typer.Typer(help="Timing in this process: one cell of the App. A protocol, or the bandwidth ceiling.",
                        no_args_is_help=True)
campaign_app = typer.Typer(help="Timing campaigns: every cell of a grid in blocks, fresh processes, "
                           "resumable.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(campaign_app, name="campaign")


@bench_app.command("cell")
def cell(
    model: Annotated[str, typer.Option("--model", "-m", help="Known name, HF folder, config.json, hub id or .gguf file.")],
    context: Annotated[int, typer.Option("--context", **TOKENS, help="Context n in tokens (e.g. 32K; K = 1024).")],
    mode: Annotated[str, typer.Option("--mode", help="dense, proj0.5, sel0.3, window0.3 or both0.5/0.3.")] = "dense",
    init: Annotated[str, typer.Option("--init", help="pretrained or random (weights from the config).")] = "pretrained",
    attention: Annotated[str, typer.Option("--attention", help="split_k, sdpa_masked or sdpa_fused.")] = "split_k",
    warmup: Annotated[int, typer.Option("--warmup", help="Warm-up decode steps.")] = 5,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed repeats.")] = 5,
    steps: Annotated[int, typer.Option("--steps", help="Decode steps per repeat.")] = 50,
    fill: Annotated[str, typer.Option("--fill", help="prefill (dense prefill of the stream) or random (seeded K/V).")] = "prefill",
    compile_mode: Annotated[str, typer.Option("--compile-mode", help="torch.compile mode on CUDA ('' = default).")] = "",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    text_file: TextFileOpt = None,
    calib_tokens: Annotated[int, typer.Option("--calib-tokens", **TOKENS, help="Projection calibration tokens.")] = "2048",
    obs: ObsOpt = 64,
    seed: Annotated[int, typer.Option("--seed", help="Seed of random weights, ids and fills.")] = 0,
    impl: Annotated[str, typer.Option("--impl", help="ours, or a peer (dense, random init and fill): transformers (compiled, StaticCache) or graph (a hand-written F.linear + SDPA step in a CUDA graph).")] = "ours",
    kernels: Annotated[str, typer.Option("--kernels", help="Kernel options, e.g. gemv.pdl=false,attention.min_split_keys=256 (default: none changed).")] = "",
    profile: Annotated[int, typer.Option("--profile", help="After the timed steps, this many more under torch.profiler: the record's 'profile' says where the step's time goes (0 = none).")] = 0,
    shared_gpu: Annotated[str, typer.Option("--shared-gpu", help="When other processes hold the GPU: refuse (the default: they skew the step) or allow (time anyway; the record names them).")] = "refuse",
    batch: Annotated[int, typer.Option("--batch", callback=bounded(1, 4096), help="Sequences a step decodes, each its own stretch of the stream and cache row (issue 44; 1 = one sequence).")] = 1,
    adapter: AdapterOpt = None,
    method: MethodOpt = "teal",
    out: Annotated[str | None, typer.Option("--out", "-o", callback=out_file(new=True), help="Record to write (never overwritten); a failure writes a 'failed' record.")] = None,
    campaign: Annotated[str, typer.Option("--campaign", hidden=True)] = "",
    block: Annotated[int, typer.Option("--block", hidden=True)] = 0,
    group: Annotated[str, typer.Option("--group", hidden=True)] = "",
    cell_id: Annotated[str, typer.Option("--cell-id", hidden=True)] = "",
    order: Annotated[int, typer.Option("--order", hidden=True)] = 0,
    json_out: JsonOpt = False,
) -> None:
    """Time one mode at one context and write its record (ByteCross App. A protocol).

    --text-file replaces WikiText-2 as the token stream of the prefill (test) and as the
    projection's calibration text (validation)."""
    from sparsedecode.records import write_record

    if out is not None and Path(out).exists():
        raise InputError(f"record {out} exists; records are never overwritten (pick a new --out)")
    fields = _failure_fields(model=model, init=init, context=context, mode=mode, campaign=campaign,
                             block=block, group=group, cell=cell_id, order=order,
                             attention=attention, fill=fill)
    try:
        from sparsedecode.account.units import parse_tokens
        from sparsedecode.timing.cell import CellSpec, run_cell

        spec = CellSpec(model=model, init=init, dtype=dtype, device=device, context=parse_tokens(context),
                        mode=mode, attention=attention, warmup=warmup, repeats=repeats, steps=steps,
                        fill=fill, compile_mode=compile_mode, text=text_file,
                        calib_tokens=parse_tokens(calib_tokens, "--calib-tokens"), obs=obs, seed=seed,
                        kernels=kernels, impl=impl, profile=profile, shared_gpu=shared_gpu, batch=batch, adapter=adapter or "", method=method, campaign=campaign, block=block, group=group,
                        cell=cell_id, order=order)
        log = None if json_out else (lambda line: print(line, file=sys.stderr, flush=True))
        rec = run_cell(spec, log=log)
    except Exception as e:  # a campaign keeps the failure beside the cells that worked
        if out is not None:
            from sparsedecode.timing.cell import failed_record

            write_record(out, failed_record(fields, e))
        raise
    if out is not None:
        write_record(out, rec)
    if json_out:
        emit_json(rec)
    else:
        batch_ = f" x{rec['batch']}" if rec.get("batch", 1) > 1 else ""
        typer.echo(f"{rec['model_name']} {rec['mode_spec']}{batch_} n={rec['context']} ({rec['label']}, "
                   f"{rec['attention']}): {rec['ms_per_token']:.3f} ms/token, "
                   f"{rec['tokens_per_sec']:.1f} tok/s, {rec['achieved_gbps']:.3g} GB/s, "
                   f"byte bound {rec['byte_bound']:.3f}x; dense step: {rec.get('dense_step') or 'n/a'}")


@bench_app.command("ceiling")
def ceiling(
    gib: Annotated[float, typer.Option("--gib", callback=bounded(0, 1024, low_open=True), help="Weight size in GiB (far beyond the L2).")] = 1.0,
    replays: Annotated[int, typer.Option("--replays", callback=bounded(1, COUNT_MAX), help="Timed replays (CUDA) or blocks (CPU).")] = 20,
    calls: Annotated[int, typer.Option("--calls", callback=bounded(1, COUNT_MAX), help="GEMV calls per replay.")] = 10,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    out: Annotated[str | None, typer.Option("--out", "-o", callback=out_file(".json"), help="Record to write (never overwritten), e.g. DIR/ceiling.json of a campaign folder, which `report` then reads.")] = None,
    shared_gpu: Annotated[str, typer.Option("--shared-gpu", help="When other processes hold the GPU: refuse (the default) or allow (measure anyway; the record names them).")] = "refuse",
    json_out: JsonOpt = False,
) -> None:
    """Measure the bandwidth ceiling: GB/s of torch.mv over a large weight (issue 26, ByteCross §4.4)."""
    from sparsedecode.records import write_record
    from sparsedecode.timing.ceiling import measure_ceiling

    if out is not None:
        check_out_file(out, "--out", ".json")
        if Path(out).exists():
            raise InputError(f"record {out} exists; records are never overwritten (pick a new --out)")
    rec = measure_ceiling(device=device, dtype=dtype, gib=gib, replays=replays, calls=calls, shared_gpu=shared_gpu)
    if out is not None:
        write_record(out, rec)
    if json_out:
        emit_json(rec)
    else:
        typer.echo(f"{rec['gpu']} {rec['dtype']}: ceiling {rec['gbps']:.0f} GB/s ({rec['method']})")


@bench_app.command("union")
def union(
    model: Annotated[str, typer.Option("--model", "-m", help="Known name, HF folder, config.json, hub id or .gguf file.")],
    proj_keep: ProjKeepOpt = None,
    thresholds: ThresholdsOpt = None,
    sequences: Annotated[int, typer.Option("--sequences", metavar="N", callback=bounded(1, 4096), help="WikiText-2 test windows decoded (App. F: 64).")] = 64,
    context: Annotated[int, typer.Option("--context", **TOKENS, help="Prompt tokens of each window (App. F: 4K).")] = "4K",
    steps: Annotated[int, typer.Option("--steps", metavar="N", callback=bounded(1, 4096), help="Greedy decode steps per window (App. F: 16).")] = 16,
    batches: Annotated[str, typer.Option("--batches", metavar="B,B,...", help="Batch sizes B, comma-separated, each at most --sequences.")] = "1,2,4,8,16,32,64",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
    text_file: TextFileOpt = None,
    out: Annotated[str | None, typer.Option("--out", "-o", callback=out_file(".json"), help="Record to write (never overwritten).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Measure u_B, the union of kept channels a batched sparse projection reads (ByteCross §3.3,
    App. F, Table 14): each window decoded greedily with TEAL thresholds, the masks grouped into
    batches of B sequences, the byte-weighted union averaged over steps and groups.

    --text-file replaces WikiText-2: its test text gives the windows, its validation text the
    calibration."""
    from sparsedecode.cli.common import apply_threads

    apply_threads(threads)
    if (proj_keep is None) == (thresholds is None):
        raise InputError("give one of --proj-keep (TEAL thresholds calibrated and cached) or --thresholds FILE")
    if proj_keep is not None:
        from sparsedecode.account.units import check_keep

        proj_keep = check_keep(proj_keep, "--proj-keep")
    try:
        sizes = sorted({int(b) for b in batches.split(",")})
    except ValueError:
        raise InputError(f"--batches '{batches}': write batch sizes as integers, e.g. 1,2,4,8") from None
    if not sizes or sizes[0] < 1 or sizes[-1] > sequences:
        raise InputError(f"--batches '{batches}': each batch size must be 1 to --sequences ({sequences})")
    if out is not None:
        check_out_file(out, "--out", ".json")
        if Path(out).exists():
            raise InputError(f"record {out} exists; records are never overwritten (pick a new --out)")
    rec = _measure_union(model, proj_keep, thresholds, sequences, context, steps, sizes, device, dtype, text_file,
                         progress=not json_out)
    if out is not None:
        from sparsedecode.records import write_record

        write_record(out, rec)
    if json_out:
        emit_json(rec)
        return
    typer.echo(f"{rec['model']} TEAL keep {rec['projection_keep']:g}, {rec['sequences']} windows of "
               f"{rec['context']:,} tokens, {rec['steps']} steps ({rec['device']}):")
    typer.echo("| B | groups | union u_B | min | max | qkv | o | ffn_in | ffn_hidden |")
    typer.echo("|---|---|---|---|---|---|---|---|---|")
    for r in rec["results"]:
        typer.echo(f"| {r['batch']} | {r['groups']} | {r['union']:.4f} | {r['group_min']:.4f} | {r['group_max']:.4f} | "
                   + " | ".join(f"{r['by_input'][k]:.3f}" for k in ("qkv", "o", "ffn_in", "ffn_hidden")) + " |")


def _measure_union(model, proj_keep, thresholds, sequences, context, steps, sizes, device, dtype, text_file,
                   progress: bool) -> dict:
    """The `bench union` record (see `projection.union`)."""
    import torch

    import sparsedecode
    from sparsedecode.corpus import text_ids, wikitext_path
    from sparsedecode.kernels.options import KernelOptions
    from sparsedecode.projection.calibrate import cached_teal
    from sparsedecode.projection.sparse_linear import site_key
    from sparsedecode.projection.thresholds import Thresholds
    from sparsedecode.projection.union import record_masks, union_table, window_starts
    from sparsedecode.records import stamp

    span = context + steps
    eng = sparsedecode.load(model, device=device, dtype=dtype, max_len=span, quiet=not progress,
                            kernels=KernelOptions.parse("gemv.dense=false"))
    if thresholds is not None:
        th = Thresholds.load(thresholds)
        th.validate(eng.dims)  # other dims refused
    else:
        th = cached_teal(eng, proj_keep, text_file=text_file, progress=progress)
    ids = text_ids(eng.tokenizer, wikitext_path("test", text_file))
    starts = window_starts(len(ids), sequences, span)
    windows = [ids[s:s + context] for s in starts]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sequences, desc=f"decoding {sequences} windows of {context:,} tokens", unit="window")
    try:
        masks = record_masks(eng, th.values, windows, steps, progress=None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()
    params = {site_key(i, s): getattr(p, s).weight.numel() for i, s, p in eng.model.projection_sites()}
    return stamp({
        "kind": "union_bench", "model": eng.name, "device": str(eng.device).upper() if eng.device.type == "cpu"
        else torch.cuda.get_device_name(eng.device), "dtype": str(eng.dtype).removeprefix("torch."),
        "projection_keep": th.keep, "thresholds": {"method": th.method, "source": thresholds or "calibrated (cached_teal)"},
        "context": context, "sequences": sequences, "steps": steps, "decoding": "greedy, thresholds on (masked)",
        "window_starts": starts, "text": str(wikitext_path("test", text_file).name),
        "results": union_table(masks, params, sizes),
        "union_of": "byte-weighted fraction of the seven projections' weights whose input channel at least one "
                    "sequence of a group keeps, averaged over steps and groups (ByteCross App. F)",
    })


def _failure_fields(*, model: str, init: str, context: str, mode: str, **given) -> dict:
    """What a failed record can say without the cell having run: the bookkeeping, the model
    name a finished record would carry, and the context and mode as given (parsed if they parse)."""
    from sparsedecode.account.units import parse_tokens
    from sparsedecode.config import SparsityConfig
    from sparsedecode.timing.cell import model_window

    out = dict(given)
    for key, fn in (("model_name", lambda: model_window(model, init)[0]),
                    ("context", lambda: parse_tokens(context)), ("mode_spec", lambda: str(SparsityConfig.parse(mode))),
                    ("mode", lambda: SparsityConfig.parse(mode).kind)):
        try:
            out[key] = fn()
        except Exception:  # the failure itself may be this field; keep what was given
            out[key] = {"model_name": model, "context": context, "mode_spec": mode}.get(key)
    out["cell"] = out.get("cell") or _cell_id(mode)
    return out


def _cell_id(mode: str) -> str:
    from sparsedecode.config import SparsityConfig

    try:
        return SparsityConfig.parse(mode).cell
    except Exception:
        return ""


@campaign_app.command("plan-crossing")
def campaign_plan_crossing(
    folder: Annotated[str, typer.Argument(help="A finished sweep: campaign folder with dense, proj and sel cells.")],
    prediction: Annotated[str, typer.Option("--prediction", callback=out_file(".json", new=True), help="Write the prediction record here (commit it before the campaign runs).")],
    spec_out: Annotated[str, typer.Option("--spec", callback=out_file(".toml", new=True), help="Write the crossing campaign (TOML) here.")],
    group: Annotated[str, typer.Option("--group", help="The sweep's group holding the proj and sel cells.")] = "sweep",
    name: Annotated[str | None, typer.Option("--name", help="Campaign name (default: the spec file's stem).")] = None,
    spacing: Annotated[int, typer.Option("--spacing", **TOKENS, help="Tokens between contexts (App. E: at most 8K).")] = "8K",
    half_width: Annotated[int, typer.Option("--half-width", **TOKENS, help="Contexts cover the prediction plus and minus this.")] = "24K",
    blocks: Annotated[int, typer.Option("--blocks", callback=bounded(3, COUNT_MAX), help="Blocks of the crossing campaign (at least 3).")] = 3,
    proj: Annotated[str | None, typer.Option("--proj", help="The pair's projection mode, e.g. proj0.7 (default: the sweep's).")] = None,
    sel: Annotated[str | None, typer.Option("--sel", help="The pair's selection mode, e.g. sel0.5 (default: the sweep's).")] = None,
    keep_campaign: Annotated[str | None, typer.Option("--keep-campaign", help="Keep-ratio campaign folder: the cost of a keep the sweep lacks (App. D).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Predict a crossing from a sweep (App. D) and write the campaign that measures it (App. E).

    A keep the sweep lacks (--proj/--sel) takes its kernel cost from --keep-campaign."""
    from sparsedecode.account.units import parse_tokens
    from sparsedecode.records import write_record
    from sparsedecode.timing.cell import model_window
    from sparsedecode.timing.plan import (
        crossing_contexts,
        crossing_spec,
        one_cell_record,
        predict_crossing,
    )

    step, half = parse_tokens(spacing, "--spacing"), parse_tokens(half_width, "--half-width")
    if step > 8192:
        raise InputError(f"--spacing {spacing}: a crossing campaign spaces its contexts at most 8K apart (App. E)")
    pred = predict_crossing(folder, group, proj=proj, sel=sel, keep_folder=keep_campaign)
    cell = one_cell_record(folder)
    _, window = model_window(pred["model"], "random")
    generated = cell.get("generated", 64)
    contexts = crossing_contexts(pred["predicted_tokens"], step, half, None if not window else window - generated)
    pred["planned_contexts"] = contexts
    text = crossing_spec(pred, name or Path(spec_out).stem, contexts, blocks, cell)
    write_record(prediction, pred)
    Path(spec_out).parent.mkdir(parents=True, exist_ok=True)
    Path(spec_out).write_text(text, encoding="utf-8")
    if json_out:
        emit_json(pred)
    else:
        typer.echo(f"{pred['model']} {pred['proj']} vs {pred['sel']}: predicted crossing {pred['predicted_tokens']:.0f} "
                   f"tokens; {len(contexts)} contexts {contexts[0]}..{contexts[-1]} x {blocks} blocks -> {spec_out}")


@campaign_app.command("run")
def campaign_run(
    specs: Annotated[list[str], typer.Argument(metavar="SPEC", help="Campaign spec (TOML); several run one after another (with --out-root).")],
    out: Annotated[str | None, typer.Option("--out", "-o", metavar="DIR", callback=out_dir, help="Campaign folder: spec.toml, cells/, failed/, logs/.")] = None,
    out_root: Annotated[str | None, typer.Option("--out-root", metavar="DIR", callback=out_dir, help="Folder holding one campaign folder per spec, named after the spec's `name` (DIR/NAME); for one spec or several.")] = None,
    executor: Annotated[str, typer.Option("--executor", help="local (one process after another) or ray.")] = "local",
    max_cells: Annotated[int | None, typer.Option("--max-cells", callback=bounded(1, COUNT_MAX), help="Run at most this many pending cells, then stop (over all the specs).")] = None,
    gpus: Annotated[str | None, typer.Option("--gpus", help="Local executor on several GPUs: ids like 0,1; block b runs whole on GPU b mod their count.")] = None,
    stop_after: Annotated[float | None, typer.Option("--stop-after", callback=bounded(0, SECONDS_MAX, low_open=True), help="Start no cell after this many seconds (over all the specs; the rest stays pending for a resume).")] = None,
    shared_gpu: Annotated[str | None, typer.Option("--shared-gpu", help="This run's policy when other processes hold the GPU, in place of the specs' shared_gpu: refuse or allow (each record keeps its policy and names them).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run every pending cell of a campaign; finished cells are skipped, failed ones retried.

    Several specs with --out-root run as one chain (a device lease, a batch job): Ctrl-C or
    SIGTERM stops the chain, a failed cell does not."""
    from sparsedecode.cli.common import check_out_dir
    from sparsedecode.timing.campaign import load_spec, run_chain

    if stop_after is not None and stop_after <= 0:
        raise InputError(f"--stop-after must be > 0 seconds, got {stop_after:g}")
    folders = _campaign_folders(specs, out, out_root, load_spec)
    for f in folders:
        check_out_dir(str(f), "--out" if out is not None else "--out-root")
    summaries = run_chain(specs, folders, executor=executor, max_cells=max_cells, progress=not json_out,
                          echo=(lambda line: None) if json_out else None,
                          gpus=gpus.split(",") if gpus is not None else None, stop_after=stop_after,
                          shared_gpu=shared_gpu)
    rows = list(zip(specs, folders, summaries, strict=False))  # an interrupted chain ends at its spec
    ran = [s for s in summaries if s is not None]
    if json_out:
        if out is not None:
            emit_json(ran[0].to_dict())
        else:
            emit_json({"campaigns": [{"spec": sp, "folder": str(f), "started": s is not None,
                                      **(s.to_dict() if s is not None else {})} for sp, f, s in rows]})
    else:
        for _, f, s in rows:
            typer.echo(s.line() if out is not None else f"{f}: " + (s.line() if s is not None else "not started"))
    if any(s.interrupted for s in ran):
        raise typer.Exit(130)
    if any(s.failed for s in ran):
        raise typer.Exit(1)


def _campaign_folders(specs: list[str], out: str | None, out_root: str | None, load_spec) -> list[Path]:
    """The folder of each spec: --out for one spec, or --out-root/NAME for each; every spec is
    read (and a bad one refused) before any cell runs."""
    if (out is None) == (out_root is None):
        raise InputError("give --out DIR (one spec) or --out-root DIR (one folder per spec, DIR/NAME)")
    if out is not None and len(specs) > 1:
        raise InputError(f"--out names one campaign folder and {len(specs)} specs were given; "
                         "use --out-root DIR to run them one after another into DIR/NAME")
    if out is not None:
        load_spec(specs[0])
        return [Path(out)]
    names = [load_spec(s).name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InputError(f"specs share the name {', '.join(twice)}: under --out-root each campaign "
                         "needs its own folder, so give each spec its own `name`")
    return [Path(out_root) / n for n in names]


@campaign_app.command("merge")
def campaign_merge(
    sources: Annotated[list[str], typer.Argument(metavar="SRC", help="Campaign folders of other runs of the same spec.")],
    into: Annotated[str, typer.Option("--into", help="The campaign folder that receives their records (made from their spec.toml if it has none).")],
    json_out: JsonOpt = False,
) -> None:
    """Merge the records of runs made elsewhere into one campaign folder.

    Nothing is overwritten or deleted, and two different measurements of one cell refuse the
    merge."""
    from sparsedecode.timing.merge import merge_campaigns

    summary = merge_campaigns(sources, into)
    if json_out:
        emit_json({"into": into, **asdict(summary)})
    else:
        typer.echo(f"{into}: {summary.line()}")


@campaign_app.command("status")
def campaign_status(
    folder: Annotated[str, typer.Argument(help="Campaign folder (holds spec.toml).")],
    json_out: JsonOpt = False,
) -> None:
    """Done, failed and pending cells per group, and the pending cells in run order."""
    from sparsedecode.timing.campaign import status

    st = status(folder)
    if json_out:
        emit_json(st)
        return
    typer.echo(f"campaign {st['name']} in {folder}: {st['total']} cells")
    typer.echo(f"{'group':<24} {'done':>6} {'failed':>6} {'pending':>7}")
    for group, c in st["groups"].items():
        typer.echo(f"{group:<24} {c['done']:>6} {c['failed']:>6} {c['pending']:>7}")
    if st["failed"]:
        typer.echo("failed (retried on the next run):")
        for c in st["failed"]:
            typer.echo(f"  {c['path']}: {c['error']}")
    est = st["estimate"]
    if st["pending"] and est:
        typer.echo(f"about {est['remaining_s'] / 60:.0f} min for the {len(st['pending'])} pending cells "
                   f"({est['cell_s']:.0f} s a cell: the median of {est['intervals']} gaps between consecutive "
                   "records, breaks over 10 min left out)")
    elif st["pending"]:
        typer.echo("no time estimate yet: it needs two records written one after the other")
    if st["pending"]:
        typer.echo("pending:")
        for c in st["pending"]:
            typer.echo(f"  {c['group']} {c['cell']} n={c['context']} b{c['block']}")


__all__ = ["bench_app", "campaign_app"]
