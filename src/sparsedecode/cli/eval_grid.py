"""`sparsedecode eval grid` and `sparsedecode eval admit`: the composition grid of ByteCross
App. H and the admissibility verdict of §5.1 and §5.3 (issue 7).

    sparsedecode eval grid -m smollm2-135m --length 1024 --scored 128 --out runs/grid
    sparsedecode eval grid -m llama-3.1-8b --length 32768 --proj-keeps 0.7,0.6,0.5 \\
        --kv-keeps 0.5,0.3,0.2 --kv snapkv --device cuda --out runs/grid32k --json
    sparsedecode eval admit --ppl runs/grid/proj0.5_snapkv0.2.json --passkey pk.json \\
        --multikey mk.json --budget 0.5

`eval grid` scores dense once (DIR/dense.json), then every other setting beside it, one
'ppl_eval' record each (quality/grid.py); a rerun resumes, and the same command started
several times at once shares the settings out (claims in DIR/.claims; --reclaim when a
worker on another host died holding one). `eval admit` reads a ppl_eval
record and the passkey and multi-key 'retrieval_eval' records of one configuration and
says whether it is admissible (quality/admit.py); its exit status is 0 when it is, 3 when
it is not, 2 on bad input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sparsedecode.cli import eval as ev
from sparsedecode.cli.common import (
    AdapterOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    KvOpt,
    ObsOpt,
    TextFileOpt,
    emit_json,
    out_dir,
    parse_float,
)
from sparsedecode.cli.eval import eval_app
from sparsedecode.errors import InputError


@eval_app.command("grid")
def grid(
    out: Annotated[str, typer.Option("--out", "-o", metavar="DIR", callback=out_dir, help="Folder of the grid's records (DIR/dense.json, one record per setting, grid.md); a rerun resumes it.")],
    proj_keeps: Annotated[str, typer.Option("--proj-keeps", help="Projection keeps, comma-separated (uniform TEAL, calibrated once and cached); 1 is the branch off.")] = "0.7,0.6,0.5",
    kv_keeps: Annotated[str, typer.Option("--kv-keeps", help="KV keeps, comma-separated; 1 is the branch off, '' a projection-only grid.")] = "0.5,0.3,0.2",
    kv: KvOpt = "snapkv",
    reclaim: Annotated[bool, typer.Option("--reclaim", help="Take over every claim already in DIR/.claims (a setting another process said it was scoring): for a worker on another host that died. Claims of this host's dead processes are taken over without it.")] = False,
    model: ev.ModelOpt = "smollm2-135m",
    protocol: ev.ProtocolOpt = "decode",
    chunks: ev.ChunksOpt = 128,
    windows: ev.WindowsOpt = 8,
    length: ev.LengthOpt = 4096,
    scored: ev.ScoredOpt = 512,
    obs: ObsOpt = 64,
    adapter: AdapterOpt = None,
    text_file: TextFileOpt = None,
    resamples: ev.ResamplesOpt = 20000,
    seed: ev.SeedOpt = 0,
    level: ev.LevelOpt = 0.95,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Perplexity of every projection x KV keep pair, each branch alone and dense, on the same windows.

    One dense run shared by all, one record per setting, a table of ΔPPL with paired bootstrap
    intervals; the token stream is WikiText-2 test or --text-file."""
    from sparsedecode.corpus import text_ids, wikitext_path
    from sparsedecode.quality import grid as g
    from sparsedecode.quality.perplexity import CHUNK, WindowNLL

    # Everything the user can get wrong fails here, before a model loads.
    p_keeps = g.parse_keeps(proj_keeps, "--proj-keeps")
    k_keeps = [k for k in g.parse_keeps(kv_keeps, "--kv-keeps") if k < 1.0]
    kv_configs = {k: ev._kv_config(kv, k, obs) for k in k_keeps}
    if protocol == "chunked" and kv_configs:
        raise InputError("the chunked protocol scores a prefill, which reads the whole cache, so KV keeps "
                         "have no meaning there: use --protocol decode, or --kv-keeps '' for a "
                         "projection-only grid")
    ev._check_run(protocol, None, chunks=chunks, windows=windows, length=length, scored=scored,
                  resamples=resamples, level=level)
    grid_settings = g.settings(p_keeps, k_keeps, kv)
    shape = {"chunks": chunks} if protocol == "chunked" else {"windows": windows, "length": length, "scored": scored}
    want = {"protocol": protocol, **{f"protocol_params.{k}": v for k, v in shape.items()},
            "bootstrap.resamples": resamples, "bootstrap.seed": seed, "bootstrap.level": level}
    folder = Path(out)
    g.check_folder(folder, want)
    path = wikitext_path("test", text_file)
    from sparsedecode.cli.common import check_adapter

    lora = check_adapter(adapter)
    want["config.adapter.path"] = None if lora is None else str(lora.path)
    g.check_folder(folder, want)  # again: a folder of another adapter fails before the model loads

    eng = ev._load(model, CHUNK if protocol == "chunked" else length, protocol, device=device,
                   dtype=dtype, quiet=json_out, adapter=lora)
    want.update({"model.name": eng.name, "model.init": eng.init, "model.dims": eng.dims.to_dict(),
                 "dtype": str(eng.dtype).removeprefix("torch."), "device": eng.device.type,
                 "text.file": path.name, "text.tokens": len(text_ids(eng.tokenizer, path))})
    run = dict(chunks=chunks, windows=windows, length=length, scored=scored, resamples=resamples,
               seed=seed, level=level, progress=False)

    def score_dense() -> dict:
        return ev._run(eng, path, protocol, None, None, None, text_file, **run)

    def score(s: g.Setting, dense: dict) -> dict:
        shared = WindowNLL(dense["protocol"], dense["nll"], dense["targets"], dense["starts"])
        keep = s.proj_keep if s.proj_keep < 1.0 else None
        return ev._run(eng, path, protocol, None, keep, kv_configs.get(s.kv_keep), text_file,
                       dense=shared, **run)

    recs, done_now = g.run_grid(folder, grid_settings, want, score_dense, score, obs=obs,
                                progress=not json_out, reclaim=reclaim)
    rows = [g.row(r, s.name) for s, r in zip(grid_settings, recs, strict=True)]
    p = recs[0]["protocol_params"]
    what = (f"{p['chunks']} chunks of {p['chunk']:,} tokens" if protocol == "chunked" else
            f"{p['windows']} windows of {p['length']:,} tokens, last {p['scored']:,} scored")
    title = (f"{eng.name}, {protocol} protocol ({what}), dense PPL {rows[0]['ppl']:.4f}; "
             f"ΔPPL intervals: paired bootstrap, {resamples:,} resamples, seed {seed}")
    md = g.write_text(folder / "grid.md", g.markdown(rows, title))
    if json_out:
        emit_json({"kind": "ppl_grid", "folder": str(folder), "model": recs[0]["model"],
                   "protocol": protocol, "protocol_params": p, "kv_method": kv, "obs": obs,
                   "settings": rows, "scored_now": done_now})
        return
    typer.echo(title)
    typer.echo(g.text_table(rows))
    reused = len(grid_settings) - len(done_now)
    typer.echo(f"{len(done_now)} settings scored now, {reused} read from {folder}; wrote {md}")


NOT_ADMISSIBLE = 3  # exit status of a clean "no": 1 stays for crashes, 2 for bad input


@eval_app.command("admit")
def admit(
    ppl: Annotated[str, typer.Option("--ppl", help="The configuration's 'ppl_eval' record (sparsedecode eval ppl or eval grid).")],
    passkey: Annotated[str, typer.Option("--passkey", help="Its passkey 'retrieval_eval' record.")],
    multikey: Annotated[str, typer.Option("--multikey", help="Its multi-key 'retrieval_eval' record.")],
    budget: Annotated[str, typer.Option("--budget", help="Largest admissible perplexity increase over dense (ΔPPL), e.g. 0.2.")],
    use_upper: Annotated[bool, typer.Option("--use-upper", help="Hold the upper end of the ΔPPL interval to the budget instead of the point estimate (the paper selects on point estimates).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Is a configuration admissible: both retrieval tests right wherever dense is, ΔPPL within the budget?

    Exit status 0 if so, 3 if not (2 is bad input, 1 a crash)."""
    from sparsedecode.quality.admit import admit as verdict_of
    from sparsedecode.records import read_record

    b = parse_float(budget, "--budget")
    v = verdict_of(read_record(ppl), read_record(passkey), read_record(multikey), b, use_upper=use_upper)
    if json_out:
        emit_json(v.to_dict())
    else:
        typer.echo(v.text())
    if not v.admissible:
        raise typer.Exit(NOT_ADMISSIBLE)
