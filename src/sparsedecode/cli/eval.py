"""`sparsedecode eval ppl`: perplexity of a configuration beside dense on the same windows,
with paired bootstrap intervals (ByteCross App. A 'Quality protocols', App. H; issue 7).

    sparsedecode eval ppl --model smollm2-135m --protocol chunked --chunks 16 --proj-keep 0.5
    sparsedecode eval ppl -m smollm2-135m --protocol decode --windows 8 --length 4096 \\
        --kv snapkv --kv-keep 0.3 --out runs/ppl/sel0.3.json
    sparsedecode eval ppl -m llama-3.1-8b --protocol decode --length 32768 --thresholds t.st \\
        --kv snapkv --kv-keep 0.2 --device cuda --json

Dense runs first, then the configuration, over the same chunks or windows of the
text's token stream (WikiText-2 test by default). The record (kind 'ppl_eval')
holds the per-window NLLs of both, so any table or interval can be rebuilt from
it. torch is imported inside the command.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from sparsedecode.cli.app import app
from sparsedecode.cli.common import (
    COUNT_MAX,
    SEED_MAX,
    TOKENS,
    AdapterOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    KvKeepOpt,
    KvOpt,
    ObsOpt,
    ProjKeepOpt,
    TextFileOpt,
    ThreadsOpt,
    ThresholdsOpt,
    apply_threads,
    bounded,
    emit_json,
    out_file,
)
from sparsedecode.errors import InputError

eval_app = typer.Typer(help="Quality: perplexity with paired bootstrap intervals, retrieval tests, admissibility.",
                       no_args_is_help=True)
app.add_typer(eval_app, name="eval")


# Options every perplexity command shares (`eval ppl`, `eval grid`), declared once; each
# command sets its defaults (the same ones, checked by tests/quality/test_grid.py).
ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Known name, HF folder, hub id or .gguf file.")]
ProtocolOpt = Annotated[str, typer.Option("--protocol", help="chunked (2,048-token chunks, last 1,024 scored) or decode (last --scored tokens of each window through the decode step).")]
ChunksOpt = Annotated[int, typer.Option("--chunks", callback=bounded(1, COUNT_MAX), help="chunked: chunks of 2,048 tokens from token 0 (ByteCross: 128).")]
WindowsOpt = Annotated[int, typer.Option("--windows", callback=bounded(1, COUNT_MAX), help="decode: evenly spaced windows (ByteCross: 8).")]
LengthOpt = Annotated[int, typer.Option("--length", **TOKENS, help="decode: window length in tokens (32768, 32K), at most the model window (ByteCross: 32K).")]
ScoredOpt = Annotated[int, typer.Option("--scored", **TOKENS, help="decode: tokens per window scored one step at a time (ByteCross: 512).")]
ResamplesOpt = Annotated[int, typer.Option("--resamples", callback=bounded(1, COUNT_MAX), help="Paired bootstrap resamples of the windows.")]
KvParamOpt = Annotated[list[str] | None, typer.Option("--kv-param", help="A KV selector field KEY=VALUE, repeatable (e.g. pool_kind=max, pool_width=5, sinks=8).")]
SeedOpt = Annotated[int, typer.Option("--seed", callback=bounded(0, SEED_MAX), help="Bootstrap seed.")]
LevelOpt = Annotated[float, typer.Option("--level", callback=bounded(0, 1, low_open=True, high_open=True), help="Interval level.")]


@eval_app.command("ppl")
def ppl(
    model: ModelOpt = "smollm2-135m",
    protocol: ProtocolOpt = "chunked",
    chunks: ChunksOpt = 128,
    windows: WindowsOpt = 8,
    length: LengthOpt = 4096,
    scored: ScoredOpt = 512,
    thresholds: ThresholdsOpt = None,
    proj_keep: ProjKeepOpt = None,
    kv: KvOpt = None,
    kv_keep: KvKeepOpt = None,
    obs: ObsOpt = 64,
    kv_param: KvParamOpt = None,
    adapter: AdapterOpt = None,
    text_file: TextFileOpt = None,
    resamples: ResamplesOpt = 20000,
    seed: SeedOpt = 0,
    level: LevelOpt = 0.95,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    out: Annotated[str | None, typer.Option("--out", "-o", callback=out_file(new=True), help="Record to write (kind 'ppl_eval'; never overwritten).")] = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Aggregate perplexity of dense and of a configuration on the same windows, and ΔPPL with
    its paired bootstrap interval.

    The token stream is WikiText-2 test or --text-file; the KV branch (--kv) needs the decode
    protocol."""
    from sparsedecode.corpus import wikitext_path
    from sparsedecode.quality.perplexity import CHUNK

    # Everything the user can get wrong fails here, before a model loads.
    apply_threads(threads)
    keep, kv_config = _check_sparsity(out, thresholds, proj_keep, kv, kv_keep, obs, kv_param)
    _check_run(protocol, kv_config, chunks=chunks, windows=windows, length=length, scored=scored,
               resamples=resamples, level=level)
    path = wikitext_path("test", text_file)
    from sparsedecode.cli.common import check_adapter, check_engine_args, check_text_file

    check_text_file(path)
    check_engine_args(device, dtype)
    lora = check_adapter(adapter)
    need = CHUNK if protocol == "chunked" else length

    t0 = time.perf_counter()
    eng = _load(model, need, protocol, device=device, dtype=dtype, quiet=json_out, adapter=lora)
    rec = _run(eng, path, protocol, thresholds, keep, kv_config, text_file, chunks=chunks,
               windows=windows, length=length, scored=scored, resamples=resamples, seed=seed,
               level=level, progress=not json_out)
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    if out is not None:
        from sparsedecode.records import stamp, write_record

        rec = stamp(rec)
        write_record(out, rec)
    if json_out:
        emit_json(rec)
        return
    _show(rec, out)


def _check_sparsity(out: str | None, thresholds: str | None, proj_keep: str | None, kv: str | None,
                    kv_keep: str | None, obs: int, kv_params: list[str] | None = None):
    """(projection keep or None, KVConfig or None) of the sparsity options every `eval`
    command shares, refused before a model loads: a record that exists, both --thresholds
    and --proj-keep, --kv without --kv-keep (or the reverse), a bad keep or KV method."""
    from sparsedecode.account.units import check_keep

    if out is not None and Path(out).exists():
        raise InputError(f"record {out} exists; records are never overwritten (pick a new --out)")
    if thresholds is not None and proj_keep is not None:
        raise InputError("give --thresholds FILE or --proj-keep K, not both")
    if thresholds is not None:
        from sparsedecode.projection.thresholds import Thresholds

        Thresholds.load(thresholds)  # a missing or bad file fails before the model loads
    if (kv is None) != (kv_keep is None):
        raise InputError("the KV branch needs both --kv METHOD and --kv-keep K (e.g. --kv snapkv --kv-keep 0.3)")
    if kv_params and kv is None:
        raise InputError("--kv-param sets a field of the KV selector: give --kv METHOD --kv-keep K too")
    kv_config = None if kv is None else _kv_config(kv, check_keep(kv_keep, "--kv-keep"), obs, kv_params)
    return (None if proj_keep is None else check_keep(proj_keep, "--proj-keep")), kv_config


def _projection(eng, thresholds, keep, text_file, progress: bool):
    """What the configuration's projection branch runs: the thresholds file, or for a keep
    below 1 uniform TEAL thresholds calibrated (once, cached) on validation text: a folder's
    wiki.valid.raw, never the evaluated file."""
    if keep is None or keep >= 1.0:
        return thresholds
    from sparsedecode.projection.calibrate import cached_teal

    folder = text_file if text_file is not None and Path(text_file).expanduser().is_dir() else None
    return cached_teal(eng, keep, text_file=folder, progress=progress)


def _configured(eng, projection, kv_config):
    """(SparsityConfig, Thresholds or None) of what `_projection` gave (thresholds, a file or
    None) beside the KV branch: the description records carry, and the calibrated values
    `Engine.configure` takes with it (None where the branch is off, keep 1 included)."""
    from sparsedecode.config import ProjectionConfig, SparsityConfig
    from sparsedecode.projection.thresholds import Thresholds
    from sparsedecode.quality.perplexity import resolve_projection

    th = None
    if projection is not None:
        th = projection if isinstance(projection, Thresholds) else Thresholds.load(projection)
        th = resolve_projection(eng, ProjectionConfig(keep=th.keep), th)
    return SparsityConfig(None if th is None else ProjectionConfig(keep=th.keep), kv_config), th


def _kv_config(method: str, keep: float, obs: int, params: list[str] | None = None):
    """The `KVConfig` of a KV method at `keep` with observation window `obs` and the
    selector fields of `params` ('KEY=VALUE' each, the value an int, a float or a word); an
    unknown method or field, or a bad value, fails now."""
    from sparsedecode.config import KVConfig
    from sparsedecode.kv.select import get_selector

    extra = {}
    for item in params or []:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise InputError(f"--kv-param takes KEY=VALUE (e.g. pool_kind=max), got {item!r}")
        if key == "window":
            raise InputError("the observation window has its own option: use --obs N")
        extra[key] = _param_value(value)
    get_selector(method, window=obs, **extra)  # unknown fields and bad values fail here
    return KVConfig(method, keep, {"window": obs, **extra})


def _param_value(text: str):
    """'5' -> 5, '0.5' -> 0.5, anything else stays a string."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _check_run(protocol: str, kv_config, *, chunks: int, windows: int, length: int, scored: int,
               resamples: int, level: float) -> None:
    """Refuse protocol and bootstrap options that cannot run, before a model loads."""
    from sparsedecode.config import SparsityConfig
    from sparsedecode.quality.perplexity import check_config

    check_config(protocol, SparsityConfig(kv=kv_config))
    for value, what in ((chunks, "--chunks"), (windows, "--windows"), (resamples, "--resamples")):
        if value < 1:
            raise InputError(f"{what} must be at least 1, got {value}")
    if not 0.0 < level < 1.0:
        raise InputError(f"--level must lie in (0, 1), got {level}")
    if protocol == "decode" and length <= scored:
        raise InputError(f"--length {length} must exceed --scored {scored} (at least one token is prefilled)")


def _load(model: str, need: int, protocol: str, **kw):
    """The engine with a cache of `need` tokens; a model whose window is shorter gets the
    protocol's fix in the error."""
    import sparsedecode

    try:
        return sparsedecode.load(model, max_len=need, **kw)
    except InputError as e:
        if "exceeds the model window" not in str(e) and "sliding-window" not in str(e):
            raise
        fix = ("use a shorter --length" if protocol == "decode"
               else "its chunks of 2,048 tokens do not fit; use --protocol decode with a shorter --length")
        raise InputError(f"the {protocol} protocol needs a cache of {need:,} tokens, more than "
                         f"'{model}' attends: {str(e).split(';')[0]}; {fix}") from None


def _run(eng, path, protocol, thresholds, keep, kv_config, text_file, *, chunks, windows, length,
         scored, resamples, seed, level, progress, dense=None) -> dict:
    """The 'ppl_eval' record of one configuration beside dense. `dense`, a `WindowNLL` of the
    same text, protocol and windows, is reused instead of run again (`eval grid` shares one)."""
    from sparsedecode.config import SparsityConfig
    from sparsedecode.corpus import text_ids
    from sparsedecode.quality.bootstrap import paired_bootstrap
    from sparsedecode.quality.perplexity import CHUNK, DENSE, evaluate

    ids = text_ids(eng.tokenizer, path)
    config, th = _configured(eng, _projection(eng, thresholds, keep, text_file, progress), kv_config)
    args = dict(chunks=chunks, windows=windows, length=length, scored=scored)
    if dense is None:
        if progress:
            typer.echo(f"dense: {eng.name}, {protocol} protocol, {path.name} ({len(ids):,} tokens)", err=True)
        dense = evaluate(eng, ids, protocol, SparsityConfig(), progress=progress, **args)
    same = config.mode == "dense"  # every branch off: the dense run is the configuration's
    if progress and not same:
        typer.echo(f"configuration: {config.mode}", err=True)
    counts = {} if protocol == "chunked" and th is not None else None  # the realized keep of the scored positions
    configured = dense if same else evaluate(eng, ids, protocol, config, thresholds=th, progress=progress,
                                             counts=counts, **args)
    bs = paired_bootstrap(dense.nll, configured.nll, dense.targets, resamples, seed, level)

    from sparsedecode.projection.sparse_linear import runtime

    proj = None if th is None else {**th.header(), "source": str(thresholds) if thresholds else "cached_teal",
                                    "runtime": "masked reference" if protocol == "chunked"
                                    else runtime(th, eng.device, eng.dtype)}
    if counts:
        from sparsedecode.projection.calibrate import keeps_of

        k = keeps_of(counts, eng.dims, th.keep_metric)
        proj["realized"] = {"text": "the scored positions", **{f: k[f] for f in (
            "keep", "param_keep", "ff_keep", "act_keep", "sites")}}
    kvd = None if kv_config is None else {"method": kv_config.method, "keep": kv_config.keep,
                                          "params": dict(kv_config.params)}
    shape = ({"chunks": chunks, "chunk": CHUNK, "dense_prefix": DENSE, "scored": CHUNK - DENSE}
             if protocol == "chunked" else
             {"windows": windows, "length": length, "scored": scored, "prefill": length - scored})
    return {
        "kind": "ppl_eval", "protocol": protocol, "protocol_params": shape,
        "model": {"name": eng.name, "source": str(eng.source_path), "init": eng.init,
                  "dims": eng.dims.to_dict()},
        "device": str(eng.device), "dtype": str(eng.dtype).removeprefix("torch."),
        "attention": eng.attention, "max_len": eng.max_len,
        "text": {"file": str(path), "tokens": len(ids)},
        "config": {"mode": config.mode, "projection": proj, "kv": kvd, "same_as_dense": same,
                   "adapter": None if eng.adapter is None else eng.adapter.summary()},
        "dense": dense.to_dict(), "configured": configured.to_dict(),
        "bootstrap": bs.to_dict(),
    }


def _show(rec: dict, out: str | None) -> None:
    b = rec["bootstrap"]
    pct = f"{b['level']:.0%}"
    p = rec["protocol_params"]
    unit = "chunks" if rec["protocol"] == "chunked" else "windows"
    what = (f"{p['chunks']} chunks of {p['chunk']:,} tokens, last {p['scored']:,} scored"
            if unit == "chunks" else
            f"{p['windows']} windows of {p['length']:,} tokens, last {p['scored']:,} scored in decode steps")
    targets = sum(rec["dense"]["targets"])
    typer.echo(f"{rec['model']['name']}, {rec['protocol']} protocol: {what} ({targets:,} targets)")

    def line(label: str, iv: dict, sign: str = "") -> str:
        return f"{label:<14} {iv['point']:{sign}.4f}  {pct} [{iv['low']:{sign}.4f}, {iv['high']:{sign}.4f}]"

    cfg = rec["config"]
    parts = [cfg["mode"]]
    if cfg["projection"]:
        parts.append(f"projection {cfg['projection']['method']} keep {cfg['projection']['keep']:g}")
    if cfg["kv"]:
        parts.append(f"kv {cfg['kv']['method']} keep {cfg['kv']['keep']:g}")
    label = ", ".join(parts)
    typer.echo(line("dense PPL", b["dense"]))
    typer.echo(line("config PPL", b["config"]) + f"  ({label})")
    typer.echo(line("ΔPPL", b["delta"], "+"))
    typer.echo(f"paired bootstrap: {b['resamples']:,} resamples of the {b['windows']} {unit}, seed {b['seed']}; "
               f"{rec['seconds']:.0f} s")
    if out is not None:
        typer.echo(f"wrote {out}")
