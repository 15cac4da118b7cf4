"""`sparsedecode report DIR`: tables and figures of a timing campaign from its records (ByteCross §4.2-4.4).

    sparsedecode report runs/h200_sweep
    sparsedecode report data/bytecross/sweep_a100 --out /tmp/a100
    sparsedecode report runs/cpu_smoke --no-figures --json

DIR holds the timing harness's records (cells/{group}/*.json, kind 'timing_cell')
or one campaign folder of the ByteCross paper's records. The markdown report and
the PNG figures go to DIR/report unless --out says otherwise. Imports no torch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from sparsedecode.cli.app import app
from sparsedecode.cli.common import (
    JsonOpt,
    check_out_dir,
    check_out_file,
    emit_json,
    out_place,
    parse_float,
)
from sparsedecode.errors import InputError


def _refuse_tracked(folder: str) -> None:
    """Without --out the report goes to DIR/report: refuse that when git tracks files there,
    so a committed report is rewritten only when --out says so."""
    import subprocess
    from pathlib import Path

    from sparsedecode.errors import InputError

    target = Path(folder) / "report"
    if not target.is_dir():
        return
    try:
        r = subprocess.run(["git", "-C", str(target), "ls-files", "."], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return  # no git here: nothing is committed that could be overwritten
    if r.returncode == 0 and r.stdout.strip():
        raise InputError(f"{target} holds a committed report: give --out FOLDER to write elsewhere, or "
                         f"--out {target} to rewrite it")


@app.command("report")
def report(
    folder: Annotated[str, typer.Argument(help="Campaign folder of timing records.")],
    out: Annotated[
        str | None, typer.Option("--out", "-o", metavar="DIR", callback=out_place, help="Folder for report.md and figures (default DIR/report).")
    ] = None,
    peak_gbps: Annotated[
        str | None,
        typer.Option("--peak-gbps", help="Peak memory bandwidth in GB/s (default: nominal for the GPU)."),
    ] = None,
    ceiling: Annotated[
        str | None,
        typer.Option("--ceiling", help="Bandwidth ceiling record (`sparsedecode bench ceiling`; default: DIR/ceiling.json if there)."),
    ] = None,
    no_figures: Annotated[bool, typer.Option("--no-figures", help="Write tables only.")] = False,
    manifest: Annotated[str, typer.Option("--manifest", help="report results: the manifest of tables.")] = "docs/results.toml",
    json_out: JsonOpt = False,
) -> None:
    """A timing campaign's report: paired speedups, byte bounds, kernel costs, crossings, figures.

    Tables with intervals, failed cells and figures, from the campaign's records.
    `sparsedecode report results` instead rebuilds the results page (docs/results.md) from the
    records its manifest (docs/results.toml) names."""
    if folder == "results" and not Path(folder).exists():
        from sparsedecode.report.results import write

        target = check_out_file(out or "docs/results.md", "--out", ".md")
        written = write(manifest, target)
        if json_out:
            emit_json({"kind": "results_page", "path": str(written), "manifest": manifest})
        else:
            typer.echo(f"wrote {written} from {manifest}")
        return
    from sparsedecode.report.timing_report import write_report

    peak = parse_float(peak_gbps, "--peak-gbps", positive=True) if peak_gbps is not None else None
    if ceiling is not None and not Path(ceiling).is_file():
        raise InputError(f"--ceiling {ceiling}: no such file (write one with `sparsedecode bench ceiling --out F`)")
    if out is not None:
        check_out_dir(out, "--out")
    else:
        _refuse_tracked(folder)
    rep, md = write_report(folder, out, peak, figures=not no_figures, ceiling=ceiling)
    if json_out:
        emit_json(rep)
    else:
        typer.echo(md)
        typer.echo(f"wrote {rep['report_md']}")
    for name, what in rep.get("figures", {}).items():
        msg = f"wrote {what['path']}" if "path" in what else f"skipped {name}: {what['skipped']}"
        # With --json, stdout carries the JSON object alone.
        print(msg, file=sys.stderr if json_out else sys.stdout)
