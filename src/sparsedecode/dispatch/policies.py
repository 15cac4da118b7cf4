"""Pricing requests and dispatch policies (ByteCross §3.3 'Dispatch and batching', §5.4, App. I).

A request of p prompt tokens and a answer tokens costs the step cost integrated along its
generated sequence, in 64-token segments priced at each segment's midpoint context
(p + t + k/2 for the segment of k tokens starting t tokens in), plus the one-time cost of its
configuration (the KV selection's observation, scoring and gather). §5.4: 'integrating the
measured decode cost of each request along its generated sequence and charging the selection
pass as a one-time cost of its prompt'.

Policies, each a choice of configuration per request:

- always X: every request runs X. As in the paper's Table 5, a request is priced under X
  even where X's KV budget could not hold the selector's sinks and window; `Result.infeasible`
  counts those requests (an engine would run them without the selection).
- gate (the calibrated gate of §3.3): per request, the admissible and feasible configuration of
  least cost in the latency table, one-time costs included; 'gate, single branches' is the same
  gate without the compositions, so the difference is what composing adds (§5.4: 'nearly all of
  the gate's gain comes from composition').
- byte gate: the same argmin over a prediction that needs no latency curve of the sparse
  modes, only the dense curve and one kernel cost per configuration (App. D): t_b(n) =
  t_D(n) B_b(n) / B_D(n) + c_b, with the byte ratio from the account at the configuration's
  nominal keeps and c_b the mean of t_b - t_D B_b / B_D over the measured contexts. It is
  priced, like every policy, with the measured curves.
- threshold gate: what production engines ship, a prompt-length threshold. Below it the
  fastest always-policy without KV selection, at or above it the fastest with it; the threshold
  is where the two step curves cross (one-time costs left out, as a fixed threshold does).

Speedups divide the total cost of always-dense on the same mix by the policy's total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from sparsedecode.dispatch.mix import WORKLOADS, Mix, check_request, get_mix
from sparsedecode.dispatch.prices import ConfigPrice, PriceTable
from sparsedecode.errors import InputError, option
from sparsedecode.validate import (
    require_bool,
    require_dict,
    require_list,
    require_number,
    require_str,
)

SEGMENT = 64  # tokens per pricing segment (App. I)
BYTE_GATE, GATE, THRESHOLD_GATE = "byte gate", "gate", "threshold gate"
SINGLE_GATE = "gate, single branches"  # the gate restricted to configurations without composition


# -- one request, pure Python (the runtime gate) ------------------------------------------
def request_ms(price: ConfigPrice, prompt: int, answer: int) -> float:
    """Cost in ms of one request under one configuration (inf where infeasible is not
    checked here: see `ConfigPrice.feasible`). Past the curve's last context every segment
    costs its last step time, so the tokens from there on are priced at once (a 2^20-token
    answer costs no more to price than a 64-token one)."""
    total, t = 0.0, 0
    at = price.curve.at
    flat = int(_flat_start(price.curve.contexts[-1], prompt, answer))
    while t < flat:
        k = min(SEGMENT, answer - t)
        total += k * at(prompt + t + k / 2)
        t += k
    total += (answer - t) * price.curve.ms[-1]
    if price.select is not None:
        total += 1000.0 * price.select.at(prompt)
    return total


def _flat_start(last: int, prompt, answer):
    """The first segment start (a multiple of SEGMENT, at most `answer`) at which the context
    has passed `last`, where the curve is flat: every later segment's midpoint lies beyond it."""
    return np.minimum(np.ceil(np.maximum(last - np.asarray(prompt, dtype=float), 0) / SEGMENT) * SEGMENT,
                      answer).astype(np.int64)


def choose(table: PriceTable, prompt: int, answer: int, specs: list[str]) -> tuple[str, dict[str, float]]:
    """The configuration of least predicted cost among `specs` for one request, and the
    predicted cost in ms of each (inf where its KV budget cannot hold sinks and window).
    Sizes beyond `mix.PROMPT_LIMIT` and `mix.ANSWER_LIMIT` are refused."""
    prompt, answer = check_request(prompt, answer)
    costs = {s: (request_ms(table.configs[s], prompt, answer) if table.configs[s].feasible(prompt, answer)
                 else math.inf) for s in specs}
    best = min(costs, key=costs.__getitem__)
    if not math.isfinite(costs[best]):
        raise InputError(f"no configuration can run a {prompt}-token prompt with {answer} new tokens")
    return best, costs


# -- a whole mix, vectorized ------------------------------------------------------------------
def _integrate(step_ms, price: ConfigPrice, mix: Mix, flat_from: int | None = None) -> np.ndarray:
    """Cost in ms (R,) of every request of `mix`: `step_ms` (a vectorized function of context)
    summed over 64-token segments at their midpoints, plus the configuration's one-time cost.
    Where `step_ms` is constant from context `flat_from` on, the segments past it are priced
    at once."""
    p, a = mix.prompt.astype(float), mix.answer
    total = np.zeros(len(mix))
    stop = a if flat_from is None else _flat_start(flat_from, mix.prompt, a)
    for t in range(0, int(stop.max()), SEGMENT):
        k = np.where(stop > t, np.minimum(a - t, SEGMENT), 0)
        live = k > 0
        total[live] += k[live] * step_ms(p[live] + t + k[live] / 2)
    if flat_from is not None:
        rest = a - stop
        total += rest * step_ms(np.array([float(flat_from)]))[0]
    if price.select is not None:
        total += 1000.0 * price.select.many(p)
    return total


def cost_matrix(table: PriceTable, mix: Mix) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(specs, costs (C, R) in ms, feasible (C, R)) of every configuration on every request."""
    specs = table.specs
    out = np.stack([_integrate(table.configs[s].curve.many, table.configs[s], mix, table.configs[s].curve.contexts[-1])
                    for s in specs])
    feas = np.stack([table.configs[s].feasible(mix.prompt, mix.answer) for s in specs])
    return specs, out, feas


@dataclass
class Result:
    """One policy on one mix: its speedup over always-dense, its share of requests per
    configuration, its total cost, and requests it ran where their KV budget was too small."""

    policy: str
    speedup: float
    shares: dict[str, float]
    total_s: float
    infeasible: int = 0
    detail: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"policy": self.policy, "speedup": self.speedup, "shares": self.shares,
                "total_s": self.total_s, "infeasible": self.infeasible, **self.detail}


def _result(name, pick, specs, costs, feas, dense_total, detail=None) -> Result:
    r = np.arange(costs.shape[1])
    total = costs[pick, r].sum()
    shares = {s: float(np.mean(pick == i)) for i, s in enumerate(specs) if np.any(pick == i)}
    return Result(name, float(dense_total / total), shares, float(total / 1000.0),
                  int((~feas[pick, r]).sum()), detail or {})


def byte_predictions(table: PriceTable, contexts: np.ndarray) -> dict[str, np.ndarray]:
    """Step ms of each configuration predicted from the dense curve, the byte account at its
    nominal keeps and one kernel cost per configuration (App. D); (C, len(contexts))."""
    from sparsedecode.account.crossover import bounds

    if table.dims is None:
        raise InputError(f"the byte gate needs the model's dims, and the records of {table.model} carry none")
    dense = table.configs["dense"].curve

    def ratio(spec: str, n: float) -> float:
        m = table.configs[spec].mode
        if m.kind == "dense":
            return 1.0
        b = bounds(table.dims, max(int(n), 1), m.proj_keep, m.kv_keep)
        return 1.0 / {"proj": b.projection, "sel": b.kv, "window": b.kv, "both": b.both}[m.kind]

    out = {}
    for spec, price in table.configs.items():
        pts = price.curve.contexts
        cost = np.mean([price.curve.at(n) - dense.at(n) * ratio(spec, n) for n in pts]) if spec != "dense" else 0.0
        out[spec] = np.array([dense.at(n) * ratio(spec, n) + cost for n in contexts])
    return out


def _byte_costs(table: PriceTable, mix: Mix, specs: list[str]) -> np.ndarray:
    """Request costs (C, R) from `byte_predictions` (on a log grid, interpolated)."""
    lo = max(1, int(mix.prompt.min()))
    hi = int(mix.prompt.max() + mix.answer.max())
    grid = np.unique(np.geomspace(lo, max(hi, lo + 1), 96).astype(int))
    pred = byte_predictions(table, grid)
    lg = np.log(grid)

    def step(ly):
        return lambda n: np.exp(np.interp(np.log(n), lg, ly))

    return np.stack([_integrate(step(np.log(pred[s])), table.configs[s], mix) for s in specs])


def threshold(table: PriceTable, short: str, long: str) -> float:
    """The context at which `long`'s step curve first falls to or below `short`'s, over the
    measured range (inf if it never does)."""
    a, b = table.configs[short].curve, table.configs[long].curve
    lo = min(a.contexts[0], b.contexts[0])
    hi = max(a.contexts[-1], b.contexts[-1])
    grid = np.unique(np.geomspace(lo, hi, 2048).astype(int))
    below = b.many(grid) <= a.many(grid)
    return float(grid[np.argmax(below)]) if below.any() else math.inf


def price(table: PriceTable, mix: Mix, admissible: list[str]) -> list[Result]:
    """Every policy on `mix`: always-X for each configuration, the gate, the byte gate and the
    threshold gate; gates choose among `admissible` (dense is always among them)."""
    specs, costs, feas = cost_matrix(table, mix)
    dense_i = specs.index("dense")
    dense_total = costs[dense_i].sum()
    results = [_result(f"always {s}", np.full(len(mix), i), specs, costs, feas, dense_total)
               for i, s in enumerate(specs)]
    allowed = np.array([s in admissible for s in specs])[:, None]
    masked = np.where(feas & allowed, costs, np.inf)
    results.append(_result(GATE, masked.argmin(0), specs, costs, feas, dense_total))
    single = np.array([table.configs[s].mode.kind != "both" for s in specs])[:, None]
    if not single.all():  # what the gate gains from composition: the same gate without 'both'
        results.append(_result(SINGLE_GATE, np.where(single, masked, np.inf).argmin(0), specs, costs, feas,
                               dense_total))
    if table.dims is not None:
        pred = np.where(feas & allowed, _byte_costs(table, mix, specs), np.inf)
        results.append(_result(BYTE_GATE, pred.argmin(0), specs, costs, feas, dense_total))
    kv = [s for s in specs if table.configs[s].uses_kv and s in admissible]
    nokv = [s for s in specs if not table.configs[s].uses_kv and s in admissible]
    if kv and nokv:
        best = lambda group: min(group, key=lambda s: costs[specs.index(s)].sum())  # noqa: E731
        short, long = best(nokv), best(kv)
        t = threshold(table, short, long)
        si, li = specs.index(short), specs.index(long)
        pick = np.where((mix.prompt >= t) & feas[li], li, si)
        results.append(_result(THRESHOLD_GATE, pick, specs, costs, feas, dense_total,
                               {"threshold_tokens": None if math.isinf(t) else int(t), "short": short,
                                "long": long}))
    return results


def price_workloads(table: PriceTable, chosen: Mix, admissible: list[str], seed: int = 0) -> dict[str, list[Result]]:
    """`price` on `chosen`, then on each other App. I workload drawn with `seed`: mix name ->
    every policy's result, `chosen` first (the columns of `dispatch price`)."""
    mixes = [chosen] + [get_mix(w, seed) for w in WORKLOADS if w != chosen.name]
    return {m.name: price(table, m, admissible) for m in mixes}


# -- admissibility ------------------------------------------------------------------------------
def verdict_spec(v, where: str) -> str:
    """The configuration an 'admissibility' record judges, its fields checked (kind, model,
    admissible, config keeps and method, reasons)."""
    from sparsedecode.config import SparsityConfig

    if not isinstance(v, dict) or v.get("kind") != "admissibility":
        got = v.get("kind") if isinstance(v, dict) else type(v).__name__
        raise InputError(f"{where} is a '{got}' record, expected 'admissibility' "
                         "(sparsedecode eval admit --json > verdict.json)")
    require_str(v.get("model"), "model", where=where)
    require_bool(v.get("admissible"), "admissible", where=where)
    reasons = v.get("reasons")
    if reasons is not None:
        for j, r in enumerate(require_list(reasons, "reasons", where=where, empty=True)):
            require_str(r, f"reasons[{j}]", where=where, empty=True)
    cfg = require_dict(v.get("config"), "config", where=where)
    keeps = {}
    for part in ("projection", "kv"):
        sub = cfg.get(part)
        sub = {} if sub is None else require_dict(sub, f"config.{part}", where=where)
        keep = sub.get("keep", 1.0)
        keeps[part] = float(require_number(keep, f"config.{part}.keep", lo=0, above=True, hi=1, where=where))
        if sub.get("method") is not None:
            require_str(sub["method"], f"config.{part}.method", where=where)
    pk, kk = keeps["projection"], keeps["kv"]
    kv_method = (cfg.get("kv") or {}).get("method")
    kind = "both" if pk < 1 and kk < 1 else "proj" if pk < 1 else (
        ("window" if kv_method == "window" else "sel") if kk < 1 else "dense")
    return str(SparsityConfig.from_fields(kind, pk, kk))


def check_verdict_model(table: PriceTable, v: dict, where: str) -> None:
    """Refuse a verdict of another model than the table's: dims are compared when both carry
    them, and the names otherwise (missing dims never skip the check)."""
    from sparsedecode.account.dims import dims_from_dict
    from sparsedecode.dispatch.prices import dims_differences

    if v.get("dims") is not None and table.dims is not None:
        diff = dims_differences(dims_from_dict(v["dims"], where), table.dims)
        if diff:
            raise InputError(f"{where} judges {v['model']}, whose dims differ from those of {table.model} that "
                             f"the table prices ({', '.join(diff)}): give the verdicts of {table.model}")
    elif v["model"] != table.model:
        raise InputError(f"{where} judges {v['model']} and the table prices {table.model}, and "
                         f"{'the verdict' if v.get('dims') is None else 'the table'} carries no dims to "
                         f"compare: give the verdicts of {table.model} (sparsedecode eval admit --json)")


def admissible(table: PriceTable, verdicts: list[dict], assume: bool = False,
               names: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(admissible specs, reason per configuration but dense) from 'admissibility' records (`sparsedecode
    eval admit --json`); dense needs none. With `assume`, every configuration is admitted and
    the reason says so. The paper's own timing records come with the paper's choice: its Table 5
    gate chooses among all the configurations of its sweep (§5.4), and so does ours on them
    unless --admit records are given. `names` names each verdict's file in messages. A verdict
    of another model than the table's (other dims; without dims on both sides, another name)
    is refused: it admits nothing here."""
    passed: dict[str, dict] = {}
    if verdicts:
        assume_paper = False
    else:
        assume_paper = table.source == "bytecross"
    for i, v in enumerate(verdicts):
        where = f"--admit {names[i]}" if names else f"--admit record {i + 1}"
        passed[verdict_spec(v, where)] = v
        check_verdict_model(table, v, where)
    ok, why = ["dense"], {}
    for spec in table.specs:
        if spec == "dense":
            continue
        if spec in passed:
            if passed[spec]["admissible"]:
                ok.append(spec)
                why[spec] = f"admitted by its quality record ({passed[spec].get('model')})"
            else:
                reasons = "; ".join(passed[spec].get("reasons") or []) or "its verdict is not admissible"
                why[spec] = f"failed its quality tests ({reasons})"
        elif assume:
            ok.append(spec)
            why[spec] = (f"assumed admissible ({option('assume', True, flag='--assume-admissible')}): "
                         "no quality record was checked")
        elif assume_paper:
            ok.append(spec)
            why[spec] = ("admitted as in the paper, whose Table 5 lets the gate choose every configuration "
                         f"of its sweep; give {option('verdicts', flag='--admit')} records to hold it to yours")
        else:
            why[spec] = ("no passing 'admissibility' record (sparsedecode eval admit --json); give one "
                         f"with {option('verdicts', flag='--admit')} or {option('assume', True, flag='--assume-admissible')}")
    return ok, why


__all__ = ["BYTE_GATE", "GATE", "SEGMENT", "SINGLE_GATE", "THRESHOLD_GATE", "Result", "admissible", "byte_predictions",
           "choose", "cost_matrix", "price", "price_workloads", "request_ms", "threshold"]
