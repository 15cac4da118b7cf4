"""The timing report of one campaign folder: `timing.analysis.build_report` computes it from the
records alone (ByteCross §4.2-4.4, App. D, E); this module draws its figures and writes its
markdown (`report/timing_markdown.py`) as DIR/report.
"""

from __future__ import annotations

from pathlib import Path

from sparsedecode.report.timing_markdown import render_markdown
from sparsedecode.timing.analysis import build_report
from sparsedecode.timing.cells import load_cells


def write_report(
    folder: str | Path,
    out_dir: str | Path | None = None,
    peak_gbps: float | None = None,
    figures: bool = True,
    ceiling=None,
) -> tuple[dict, str]:
    """Load a campaign folder, draw the figures, write report.md; returns (report, markdown).

    ``out_dir`` defaults to DIR/report. The report is derived data and is
    rewritten on every run; the records are only read.
    """
    cc = load_cells(folder, batched=True)  # batch cells get their own section
    rep = build_report(cc, peak_gbps, ceiling)
    out = Path(out_dir) if out_dir is not None else Path(folder) / "report"
    out.mkdir(parents=True, exist_ok=True)
    if figures:
        from sparsedecode.report.figures import draw_figures

        rep["figures"] = draw_figures(rep, out)
    md = render_markdown(rep)
    (out / "report.md").write_text(md, encoding="utf-8")
    rep["report_md"] = str(out / "report.md")
    return rep, md


__all__ = ["write_report"]
