"""Composition under perplexity budgets (ByteCross §5.3, Table 4, App. H): for each budget on
the observed ΔPPL, the fastest admissible single branch, the fastest admissible composition,
and the speedup of the one over the other.

Quality comes from a composition grid: a folder of `sparsedecode eval grid` records (ours), or
the paper's `quality/grid_ppl.json`. Speed comes from timing campaigns at the grid's context
(ours or the paper's), each setting's paired speedup over the dense cell of its own block. As in
App. H, a setting is admissible when its point ΔPPL is at most the budget, and choice uses point
estimates. The ratio of composition to single branch pairs their blocks when one campaign group
timed both (its interval enumerates the block resamples, App. A); across campaigns it is the
ratio of their speedups over each campaign's own dense cells, without an interval, and says so.

An admissible setting that no campaign timed is listed under the table, and a budget whose
choice it could change is marked: a pick never silently ignores a faster candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from sparsedecode.errors import InputError
from sparsedecode.timing import stats

BUDGETS = (0.1, 0.2, 0.5, 1.0)


@dataclass(frozen=True)
class Quality:
    """One grid setting: keeps (1 = branch off), its perplexity and ΔPPL over dense (point and,
    where the records have one, the paired bootstrap interval)."""

    proj_keep: float
    kv_keep: float
    ppl: float
    delta: float
    low: float | None = None
    high: float | None = None

    @property
    def kind(self) -> str:
        return {(True, True): "dense", (False, True): "proj", (True, False): "sel"}.get(
            (self.proj_keep == 1.0, self.kv_keep == 1.0), "both")

    @property
    def label(self) -> str:
        return {"dense": "dense", "proj": f"proj{self.proj_keep:g}", "sel": f"sel{self.kv_keep:g}",
                "both": f"both{self.proj_keep:g}/{self.kv_keep:g}"}[self.kind]


def load_quality(path) -> tuple[list[Quality], dict]:
    """(settings, about) of a composition grid: a folder of `eval grid` records, or the paper's
    grid_ppl.json. `about` names the model, context, KV method and source."""
    path = Path(path)
    if path.is_file():
        return _paper_grid(path)
    if not path.is_dir():
        raise InputError(f"{path}: no such grid (a folder of `sparsedecode eval grid` records, or the "
                         "paper's quality/grid_ppl.json)")
    from sparsedecode.quality.grid import row
    from sparsedecode.textfile import read_json

    out, about = [], {}
    for f in sorted(path.glob("*.json")):
        rec = read_json(f, "grid record")
        if rec.get("kind") != "ppl_eval":
            continue
        r = row(rec)
        if r["kv_method"] not in (None, "snapkv"):
            raise InputError(f"{f}: KV method {r['kv_method']}; Table 4 composes the attention-scored "
                             "selection (snapkv)")
        d = r["delta"]
        out.append(Quality(r["proj_keep"], r["kv_keep"], r["ppl"], d["point"], d.get("low"), d.get("high")))
        params = rec.get("protocol_params") or {}
        about = {"model": (rec.get("model") or {}).get("name"), "context": params.get("length"),
                 "protocol": rec.get("protocol"), "device": rec.get("device"), "source": str(path)}
    if not out:
        raise InputError(f"{path}: no 'ppl_eval' records (write them with `sparsedecode eval grid --out {path}`)")
    return out, about


def _paper_grid(path: Path) -> tuple[list[Quality], dict]:
    from sparsedecode.textfile import read_json

    res = read_json(path, "the paper's grid").get("results")
    if not isinstance(res, list) or not res:
        raise InputError(f"{path}: no 'results' list (the ByteCross records' quality/grid_ppl.json)")
    dense = [r for r in res if r["projection_keep"] == 1.0 and r["kv_keep"] == 1.0]
    if len(dense) != 1:
        raise InputError(f"{path}: needs one dense setting (keeps 1.0 / 1.0), found {len(dense)}")
    base = dense[0]["ppl"]
    out = [Quality(float(r["projection_keep"]), float(r["kv_keep"]), r["ppl"], r["ppl"] - base) for r in res]
    contexts = {r["context"] for r in res}
    return out, {"model": "Llama-3.1-8B-Instruct (the paper's)", "context": contexts.pop() if len(contexts) == 1 else None,
                 "protocol": "decode", "device": "the paper's", "source": str(path)}


@dataclass(frozen=True)
class Timed:
    """A setting's paired speedup over dense in one campaign group, and its per-block step times."""

    campaign: str
    group: str
    speedup: stats.Estimate
    ms_by_block: dict[int, float]


def load_timing(folders, context: int) -> dict[tuple[float, float], Timed]:
    """(proj keep, KV keep) -> its timing at `context`, from the first campaign folder (in the
    order given) that times it beside dense cells of the same blocks."""
    from sparsedecode.timing.cells import load_cells

    out: dict[tuple[float, float], Timed] = {}
    for folder in folders:
        cc = load_cells(folder)
        at = [c for c in cc.paired() if c.context == context]
        dense = {(c.group, c.block): c.ms_per_token for c in at if c.mode == "dense"}
        per: dict[tuple[str, float, float], dict[int, float]] = {}
        for c in at:
            if c.mode in ("proj", "sel", "both") and (c.group, c.block) in dense:
                per.setdefault((c.group, c.projection_keep, c.kv_keep), {})[c.block] = c.ms_per_token
        for (group, p, k), ms in sorted(per.items()):
            if (p, k) in out:
                continue
            ratios = [dense[(group, b)] / t for b, t in sorted(ms.items())]
            out[(p, k)] = Timed(str(folder), group, stats.resampled_mean(ratios), ms)
    return out


def _over(comp: Timed, single: Timed) -> tuple[stats.Estimate | None, float, str]:
    """(paired estimate or None, point, how) of t_single / t_composition."""
    if (comp.campaign, comp.group) == (single.campaign, single.group):
        blocks = sorted(set(comp.ms_by_block) & set(single.ms_by_block))
        if blocks:
            est = stats.resampled_mean([single.ms_by_block[b] / comp.ms_by_block[b] for b in blocks])
            return est, est.value, f"paired over {len(blocks)} blocks"
    return None, comp.speedup.value / single.speedup.value, "ratio of speedups over each campaign's dense"


def build(quality_path, timing_folders, context: int | None = None, budgets=BUDGETS) -> dict:
    """Table 4: per budget the picks and the composition's speedup over the best single branch."""
    quality, about = load_quality(quality_path)
    ctx = context or about.get("context")
    if ctx is None:
        raise InputError(f"{quality_path}: the grid does not say its context; give one")
    if about.get("context") not in (None, ctx):
        raise InputError(f"{quality_path} scores {about['context']}-token windows, the timing asked for is at "
                         f"{ctx}: price a grid with timings at its own context (§5.3)")
    timing = load_timing(timing_folders, ctx)
    if not timing:
        raise InputError(f"no sparse cell with a dense partner at context {ctx} in {', '.join(map(str, timing_folders))}")
    rows = []
    for budget in budgets:
        ok = [q for q in quality if q.kind != "dense" and q.delta <= budget]
        untimed = [q.label for q in ok if (q.proj_keep, q.kv_keep) not in timing]
        timed = [q for q in ok if (q.proj_keep, q.kv_keep) in timing]
        speed = lambda q: timing[(q.proj_keep, q.kv_keep)].speedup.value  # noqa: E731
        single = max((q for q in timed if q.kind in ("proj", "sel")), key=speed, default=None)
        comp = max((q for q in timed if q.kind == "both"), key=speed, default=None)
        row = {"budget": budget, "single": _pick(single, timing), "composition": _pick(comp, timing),
               "over_single": None, "how": "", "untimed": untimed,
               "complete": not untimed}
        if single and comp:
            est, point, how = _over(timing[(comp.proj_keep, comp.kv_keep)], timing[(single.proj_keep, single.kv_keep)])
            row["over_single"] = {"value": point, "low": None if est is None else est.low,
                                  "high": None if est is None else est.high}
            row["how"] = how
        rows.append(row)
    return {"kind": "composition_table", "quality": about, "context": ctx,
            "timing": [str(f) for f in timing_folders], "rows": rows,
            "dense_ppl": next((q.ppl for q in quality if q.kind == "dense"), None)}


def _pick(q: Quality | None, timing) -> dict | None:
    if q is None:
        return None
    t = timing[(q.proj_keep, q.kv_keep)]
    return {"setting": q.label, "delta": q.delta, "speedup": {"value": t.speedup.value, "low": t.speedup.low,
                                                              "high": t.speedup.high},
            "campaign": t.campaign}


def markdown(rep: dict) -> str:
    """Table 4 as markdown, with the untimed admissible settings under it."""
    def pick(p):
        if p is None:
            return "none admissible"
        s = p["speedup"]
        return f"{p['setting']} (ΔPPL {p['delta']:+.3f}; {s['value']:.3f}× [{s['low']:.3f}, {s['high']:.3f}])"

    lines = ["| ΔPPL budget | fastest single branch | fastest composition | composition over single |",
             "|---|---|---|---|"]
    notes = []
    for r in rep["rows"]:
        o = r["over_single"]
        if o is None:
            over = ""
        elif o["low"] is None or math.isnan(o["low"]):
            over = f"{o['value']:.3f}× ({r['how']})"
        else:
            over = f"{o['value']:.3f}× [{o['low']:.3f}, {o['high']:.3f}]"
        mark = "" if r["complete"] else " †"
        lines.append(f"| {r['budget']:g}{mark} | {pick(r['single'])} | {pick(r['composition'])} | {over} |")
        if r["untimed"]:
            notes.append(f"{r['budget']:g}: {', '.join(r['untimed'])}")
    if notes:
        lines += ["", "† admissible but not timed at this context, so not a candidate: " + "; ".join(notes) + "."]
    return "\n".join(lines)


__all__ = ["BUDGETS", "Quality", "Timed", "build", "load_quality", "load_timing", "markdown"]
