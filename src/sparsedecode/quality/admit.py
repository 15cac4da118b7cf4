"""Admissibility of a configuration: retrieval on every placement dense answers, and a ΔPPL
budget (ByteCross §5.1, §5.3, App. H; issue 7).

§5.1: a KV window can meet a perplexity budget and still lose what lies outside its retained
region, 'we therefore admit a KV configuration only if it also passes both retrieval tests';
§6: 'admit a KV configuration only after retrieval tests, because perplexity budgets do not
detect the loss of distant information'. Passing a test means answering every placement
that dense decoding answers: at 127K dense itself misses four multi-key placements, and the
selection, which 'answers exactly the placements that dense decoding answers', passes (App.
G). A placement dense misses says nothing about the configuration and does not count.

§5.3 and App. H hold ΔPPL (configuration minus dense aggregate perplexity on the same
windows) to a budget; 'configuration selection uses the point estimates', which is the
default here. `use_upper` instead holds the upper end of the paired bootstrap interval to
the budget, a stricter reading that the paper does not use.

`admit` is a pure function of three records (dicts): the configuration's 'ppl_eval' record
(`sparsedecode eval ppl` or `eval grid`) and its passkey and multi-key 'retrieval_eval'
records. They must describe the same model and the same configuration; the error names the
first field that differs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from sparsedecode.errors import InputError, option

MODEL_FIELDS = ("name", "init", "dims")
VERDICTS = ("correct", "distractor", "miss")


@dataclass(frozen=True)
class Failure:
    """A placement dense answers and the configuration does not."""

    test: str
    depth: float | None
    trial: int | None
    expected: str
    verdict: str  # 'distractor' or 'miss'
    output: str
    in_window: bool | None = None

    def text(self) -> str:
        where = "" if self.in_window is None else (", needle in the window" if self.in_window
                                                   else ", needle outside the window")
        return (f"{self.test} depth {self.depth} trial {self.trial}: {self.verdict} "
                f"(expected {self.expected}, answered {self.output.strip()[:40]!r}{where})")


@dataclass(frozen=True)
class Retrieval:
    """One retrieval test against dense: placements dense answers, how many of those the
    configuration answers, the ones it does not, and placements dense itself misses."""

    test: str
    context: int | None
    total: int
    dense_correct: int
    kept: int
    failures: list[Failure]

    @property
    def passed(self) -> bool:
        return not self.failures

    def text(self) -> str:
        head = (f"{self.test:<9} {'pass' if self.passed else 'FAIL'}: {self.kept}/{self.dense_correct} "
                f"of the placements dense answers (dense {self.dense_correct}/{self.total}")
        head += "" if self.context is None else f", {self.context:,}-token context"
        head += ")"
        if self.dense_correct == 0:
            head += "; dense answers none, so this test says nothing about the configuration"
        return "\n".join([head] + [f"          {f.text()}" for f in self.failures])


@dataclass(frozen=True)
class Budget:
    """ΔPPL with its interval against the budget; `estimate` is 'point' or 'upper'."""

    delta: float
    low: float
    high: float
    level: float
    budget: float
    estimate: str

    @property
    def value(self) -> float:
        return self.delta if self.estimate == "point" else self.high

    @property
    def passed(self) -> bool:
        return self.value <= self.budget

    def text(self) -> str:
        what = "point estimate" if self.estimate == "point" else f"upper end of the {self.level:.0%} interval"
        rel = "<=" if self.passed else ">"
        note = (f"the paper selects on point estimates; {option('use_upper', True)} holds the interval's upper end"
                if self.estimate == "point" else "stricter than the paper, which selects on point estimates")
        return (f"{'ΔPPL':<9} {'pass' if self.passed else 'FAIL'}: {what} {self.value:+.4f} {rel} budget "
                f"{self.budget:g} (ΔPPL {self.delta:+.4f}, {self.level:.0%} [{self.low:+.4f}, "
                f"{self.high:+.4f}]; {note})")


@dataclass(frozen=True)
class Verdict:
    """Admissible when both retrieval tests pass and ΔPPL meets the budget; `reasons` says
    why not, one line per failed check and per failed placement."""

    model: str
    config: dict
    retrieval: list[Retrieval]
    ppl: Budget
    reasons: list[str] = field(default_factory=list)
    dims: dict | None = None  # the model's dims (ModelDims fields): a gate table compares them

    @property
    def admissible(self) -> bool:
        return not self.reasons

    def to_dict(self) -> dict:
        out = asdict(self)
        out["admissible"] = self.admissible
        for r, d in zip(self.retrieval, out["retrieval"], strict=True):
            d["passed"] = r.passed
        out["ppl"].update(value=self.ppl.value, passed=self.ppl.passed)
        return {"kind": "admissibility", **out}

    def text(self) -> str:
        lines = [f"{self.model}, {config_label(self.config)}"]
        lines += [r.text() for r in self.retrieval] + [self.ppl.text()]
        if self.admissible:
            lines.append("verdict: admissible")
        else:
            lines.append(f"verdict: NOT admissible ({'; '.join(self.reasons)})")
        return "\n".join(lines)


def config_label(cfg: dict) -> str:
    """'both: projection teal keep 0.5, kv snapkv keep 0.3' from a record's `config`."""
    parts = []
    if cfg.get("projection"):
        parts.append(f"projection {cfg['projection'].get('method', '?')} keep {cfg['projection']['keep']:g}")
    if cfg.get("kv"):
        parts.append(f"kv {cfg['kv']['method']} keep {cfg['kv']['keep']:g}")
    return f"{cfg.get('mode', '?')}: {', '.join(parts) or 'every branch off'}"


# -- checks that the three records describe one configuration -------------------------
def _config_keys(a: dict, b: dict) -> tuple[dict, dict]:
    """What names a configuration in two records' `config`: mode, the projection's method and
    keep (and keep metric and calibration text where both records have them), the KV method,
    keep and fields."""
    out = []
    for cfg in (a, b):
        proj, kv = cfg.get("projection"), cfg.get("kv")
        out.append({
            "mode": cfg.get("mode"),
            "projection": None if not proj else {k: proj.get(k) for k in ("method", "keep")},
            "kv": None if not kv else {"method": kv.get("method"), "keep": kv.get("keep"),
                                       "params": kv.get("params") or {}},
        })
    pa, pb = a.get("projection"), b.get("projection")
    if pa and pb:
        for k in ("keep_metric", "calibration"):
            if k in pa and k in pb:
                out[0]["projection"][k], out[1]["projection"][k] = pa[k], pb[k]
    return out[0], out[1]


def _first_difference(a, b, prefix: str) -> tuple[str, object, object] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            d = _first_difference(a.get(k), b.get(k), f"{prefix}.{k}")
            if d is not None:
                return d
        return None
    return None if a == b else (prefix, a, b)


def _check_kind(rec: dict, kind: str, what: str, test: str | None = None) -> None:
    if not isinstance(rec, dict) or rec.get("kind") != kind:
        got = rec.get("kind") if isinstance(rec, dict) else type(rec).__name__
        raise InputError(f"{what}: expected a '{kind}' record, got '{got}'")
    if test is not None and rec.get("test") != test:
        raise InputError(f"{what}: expected the {test} test, this record holds the '{rec.get('test')}' test")


def check_same(ppl: dict, passkey: dict, multikey: dict) -> None:
    """Refuse records of different models (name, init, dims) or configurations."""
    recs = {option(k, python=k): r for k, r in (("ppl", ppl), ("passkey", passkey), ("multikey", multikey))}
    base = {f: ppl.get("model", {}).get(f) for f in MODEL_FIELDS}
    for what, rec in list(recs.items())[1:]:
        other = {f: rec.get("model", {}).get(f) for f in MODEL_FIELDS}
        d = _first_difference(base, other, "model")
        if d is not None:
            raise InputError(f"{what} is a record of another model: {d[0]} = {d[2]!r}, the {option('ppl', python='ppl')} record "
                             f"has {d[1]!r}; give the three records of one model")
    for what, rec in list(recs.items())[1:]:
        d = _first_difference(*_config_keys(ppl.get("config") or {}, rec.get("config") or {}), "config")
        if d is not None:
            raise InputError(f"{what} is a record of another configuration: {d[0]} = {d[2]!r}, the "
                             f"{option('ppl', python='ppl')} record has {d[1]!r}; give the three records of one configuration")


# -- the verdict ------------------------------------------------------------------------
def retrieval(rec: dict) -> Retrieval:
    """Placements of a 'retrieval_eval' record that dense answers and the configuration
    does not."""
    test = rec.get("test")
    placements = rec.get("placements")
    if not isinstance(placements, list) or not placements:
        raise InputError(f"the {test} record lists no placements; admissibility needs them one by one")
    failures, dense_ok = [], 0
    for i, p in enumerate(placements):
        try:
            dv, cv = p["dense"]["verdict"], p["configured"]["verdict"]
        except (KeyError, TypeError):
            raise InputError(f"{test} placement {i} lacks a dense or configured verdict") from None
        for v in (dv, cv):
            if v not in VERDICTS:
                raise InputError(f"{test} placement {i}: unknown verdict '{v}' (one of {', '.join(VERDICTS)})")
        if dv != "correct":
            continue  # dense misses it: no evidence about the configuration
        dense_ok += 1
        if cv != "correct":
            failures.append(Failure(test, p.get("depth"), p.get("trial"), str(p.get("expected")), cv,
                                    str(p["configured"].get("output", "")),
                                    p["configured"].get("in_window")))
    return Retrieval(test, rec.get("context"), len(placements), dense_ok, dense_ok - len(failures), failures)


def admit(ppl: dict, passkey: dict, multikey: dict, budget: float, *, use_upper: bool = False) -> Verdict:
    """The admissibility `Verdict` of the configuration the three records share: a
    'ppl_eval' record and the passkey and multi-key 'retrieval_eval' records; `budget` is the
    largest admissible ΔPPL, held against the point estimate (the paper's choice) or, with
    `use_upper`, against the upper end of the interval."""
    _check_kind(ppl, "ppl_eval", option("ppl", python="ppl"))
    _check_kind(passkey, "retrieval_eval", option("passkey", python="passkey"), "passkey")
    _check_kind(multikey, "retrieval_eval", option("multikey", python="multikey"), "multikey")
    if not (isinstance(budget, int | float) and math.isfinite(budget) and budget >= 0):
        raise InputError(f"the ΔPPL budget must be a finite number >= 0, got {budget!r}")
    check_same(ppl, passkey, multikey)
    tests = [retrieval(passkey), retrieval(multikey)]
    try:
        d = ppl["bootstrap"]["delta"]
        b = Budget(float(d["point"]), float(d["low"]), float(d["high"]), float(ppl["bootstrap"]["level"]),
                   float(budget), "upper" if use_upper else "point")
    except (KeyError, TypeError):
        raise InputError(f"the {option('ppl', python='ppl')} record has no bootstrap.delta {{point, low, high}}: "
                         "make it with sparsedecode eval ppl or eval grid") from None
    reasons = []
    for t in tests:
        if not t.passed:
            reasons.append(f"{t.test} misses {len(t.failures)} of the {t.dense_correct} placements dense answers")
    if not b.passed:
        reasons.append(f"ΔPPL {b.estimate} {b.value:+.4f} exceeds the budget {b.budget:g}")
    return Verdict(ppl["model"].get("name"), ppl["config"], tests, b, reasons, ppl["model"].get("dims"))


__all__ = ["Budget", "Failure", "Retrieval", "Verdict", "admit", "check_same", "config_label", "retrieval"]
