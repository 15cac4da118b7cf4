"""Retrieval tests: passkey, multi-key and two-turn, each placement decoded dense and under a
configuration from the same dense prefill (ByteCross App. A 'Retrieval tests' and 'Scored
selection'; App. G for the two-turn protocol; issue 7 item 3).

- passkey: a random six-digit code hidden in filler text at relative depths (0.05, 0.25,
  0.5, 0.75, 0.95) x trials (8), the chat template applied, a dense prefill, 8 greedy
  tokens. Correct when the code appears in the output.
- multikey: four codes, each tied to a differently named archive, hidden in WikiText-2 test
  text; one archive is asked for. The queried code sits at the depths x trials, the other
  three at random depths. The verdict is correct, distractor (another archive's code comes
  first in the output) or miss.
- two_turn (App. G): a multi-key prompt whose first question asks for one archive (random
  depth); the correct code follows as the first answer, teacher-forced, and a second user
  turn asks for another archive, which sits at the depths x trials.

Prompt layout. The body (haystack and needles) is spliced in token ids between the
tokenized pieces of the chat template, so every prompt has exactly `context` tokens and
the queried needle starts at token round(depth x R) of the body, R being the body without
it: a fraction `depth` of the other material precedes it. The assistant turn starts with a
primer ('The pass key is'), so the 8 tokens are spent on the code, not on a preamble. A
tokenizer without a chat template gets the plain text (the record says
`chat_template: false`). Codes, archives, haystack offsets and the other needles come from
a generator seeded by (seed, test, depth, trial): the same placement in every record.

Decoding. One dense prefill per placement; dense decodes first. The full cache keeps every
entry, so the configuration then rewinds to the end of the prompt and decodes from the same
cache: its KV selection is made there (after the prompt, room for the generated tokens,
App. A 'Scored selection'), its projection thresholds run in the decode steps only (the
prefill stays dense, as `Engine.sparsify` does). The first generated token comes from the
prefill, as in `Engine.generate`. Two-turn variants (App. G):

- kept: the selection is made once at the end of the first question (budget less every
  later token: answer, second turn and the generated ones), then the answer and the second
  turn are appended to its buffer token by token through the decode step, so they attend
  only the kept entries (the engine has no chunked prefill into the compact buffer; these
  turns are short). Their projections stay dense, being prompt tokens.
- rescored: everything is prefilled densely, then the whole cache is scored again with the
  last observation-window tokens of the second question (`Engine.rescore`).

For a window configuration a placement records whether any needle token lies among the
retained sinks or recent entries of the prompt, the budget of `kv.window.window_ranges`
(`in_window`; null for other configurations). The first decode steps also see up to
new - 1 older entries, which slide out before the last one. For a scored selection it
records how much of the needle the selection kept (`needle_kept`: the fraction of needle
tokens kept over layers and KV heads, and of heads that kept it whole), which tells a code
dropped by the selection from one the model misread.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparsedecode.errors import InputError, option
from sparsedecode.records import json_line

TESTS = ("passkey", "multikey", "two_turn")
VARIANTS = ("kept", "rescored")
VERDICTS = ("correct", "distractor", "miss")
DEPTHS = (0.05, 0.25, 0.5, 0.75, 0.95)
TRIALS = 8
NEW = 8
MIN_HAYSTACK = 64  # tokens of filler a prompt needs besides its template, question and needles

ARCHIVES = ("Amber", "Basalt", "Cobalt", "Juniper", "Marlow", "Obsidian", "Quarry", "Saffron",
            "Tundra", "Willow")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASS_INTRO = ("A pass key is hidden somewhere in the long text below. Find it and remember it; "
              "I will ask for it at the end.\n\n")
PASS_NEEDLE = " The pass key is {code}. Remember it. {code} is the pass key. "
PASS_QUESTION = "\n\nWhat is the pass key?"
PASS_PRIMER = "The pass key is"
KEY_INTRO = ("Four archives each have an access code, hidden somewhere in the long text below. "
             "Find them and remember them; I will ask for one of them.\n\n")
KEY_NEEDLE = " The access code of the {name} archive is {code}. "
KEY_QUESTION = "What is the access code of the {name} archive?"
KEY_ANSWER = "The access code of the {name} archive is {code}."
KEY_PRIMER = "The access code of the {name} archive is"
# Markers where the body and the first answer go in the rendered template.
BODY, TURN = "<<sparsedecode:body>>", "<<sparsedecode:turn>>"


@dataclass(frozen=True)
class Placement:
    """One prompt of a test: ids (context,), the queried code, where its needle lies
    ([start, end) token positions), every needle's code by label, and for two_turn the
    prompt tokens up to the end of the first question (`turn_end`)."""

    depth: float
    trial: int
    ids: list[int] = field(repr=False)
    expected: str
    needle_span: tuple[int, int]
    codes: dict[str, str]
    asked: str
    chat: bool
    turn_end: int | None = None

    @property
    def others(self) -> list[str]:
        """Codes of the needles not asked for (distractors)."""
        return [c for label, c in self.codes.items() if label != self.asked]


# -- input checks -------------------------------------------------------------------
def check_test(test: str) -> str:
    """The test name, with '-' read as '_' (the CLI spells it two-turn)."""
    name = str(test).replace("-", "_")
    if name not in TESTS:
        raise InputError(f"unknown retrieval test '{test}': use passkey, multikey or two-turn")
    return name


def check_depths(depths) -> tuple[float, ...]:
    """Relative depths, each in [0, 1], at least one."""
    out = tuple(float(d) for d in depths)
    if not out:
        raise InputError(f"give at least one depth, e.g. {option('depths', '0.05,0.25,0.5,0.75,0.95', placeholder=True)}")
    bad = [d for d in out if not 0.0 <= d <= 1.0]
    if bad:
        raise InputError(f"depths {', '.join(f'{d:g}' for d in bad)} lie outside [0, 1]: a depth is "
                         "the fraction of the text before the needle (0 = start, 1 = end)")
    return out


def check_counts(context: int, trials: int, new: int) -> None:
    for value, what, low in ((context, option("context"), 1), (trials, option("trials"), 1), (new, option("new"), 1)):
        if value < low:
            raise InputError(f"{what} must be at least {low}, got {value}")


def check_variant(variant: str | None) -> str | None:
    if variant is not None and variant not in VARIANTS:
        raise InputError(f"unknown two-turn variant '{variant}': use kept or rescored")
    return variant


# -- prompts --------------------------------------------------------------------------
def _enc(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def chat_pieces(tokenizer, turns: list[tuple[str, str]], primer: str) -> tuple[list[str], bool]:
    """The conversation `turns` ((role, content), the body marked BODY, the first answer
    marked TURN) rendered with the tokenizer's chat template and a generation prompt, the
    primer appended, split at the markers: [before body, after body (, after TURN)], and
    whether a template was applied (plain 'content\\n\\n' per turn otherwise)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in turns],
                                             add_generation_prompt=True, tokenize=False)
        chat = True
    else:
        text, chat = "".join(f"{c}\n\n" for _, c in turns), False
    text += primer
    if text.count(BODY) != 1 or text.count(TURN) > 1:
        raise InputError("the chat template dropped or repeated the prompt's content: use a model "
                         "whose template keeps each message once")
    head, rest = text.split(BODY)
    return [head, *rest.split(TURN)], chat


def _codes(rng: random.Random, k: int) -> list[str]:
    codes: list[str] = []
    while len(codes) < k:
        c = str(rng.randrange(100_000, 1_000_000))
        if c not in codes:
            codes.append(c)
    return codes


def insert_needles(hay: list[int], needles: list[list[int]], queried: int, depth: float,
                   rng: random.Random) -> tuple[list[int], list[tuple[int, int]]]:
    """The body: hay with every needle spliced in whole; returns (ids, [start, end) per needle).

    The queried needle starts at round(depth x R), R = len(body) - its length; the others
    go at random token offsets of the hay, drawn again while one would straddle it.
    """
    others = [i for i in range(len(needles)) if i != queried]
    rest_len = len(hay) + sum(len(needles[i]) for i in others)
    t = math.floor(depth * rest_len + 0.5)
    while True:
        cuts = sorted((rng.randint(0, len(hay)), i) for i in others)
        spans, shift = {}, 0
        for h, i in cuts:
            spans[i] = (h + shift, h + shift + len(needles[i]))
            shift += len(needles[i])
        if not any(a < t < b for a, b in spans.values()):
            break
    rest, prev = [], 0
    for h, i in cuts:
        rest += hay[prev:h] + needles[i]
        prev = h
    rest += hay[prev:]
    lq = len(needles[queried])
    spans[queried] = (t, t + lq)
    for i in others:  # the ones after the queried needle move by its length
        a, b = spans[i]
        if a >= t:
            spans[i] = (a + lq, b + lq)
    return rest[:t] + needles[queried] + rest[t:], [spans[i] for i in range(len(needles))]


def build_placement(tokenizer, test: str, context: int, depth: float, trial: int, seed: int,
                    stream: list[int] | None = None) -> Placement:
    """The prompt of one placement, exactly `context` tokens. The haystack is the repeated
    passkey filler, or a slice of `stream` (token ids of a text; needed by multikey and
    two_turn) at a random offset that holds none of the codes."""
    test = check_test(test)
    rng = random.Random(f"{seed}/{test}/{depth!r}/{trial}")
    if test == "passkey":
        (code,) = _codes(rng, 1)
        labels, codes = ["pass key"], [code]
        needles = [_enc(tokenizer, PASS_NEEDLE.format(code=code))]
        turns = [("user", PASS_INTRO + BODY + PASS_QUESTION)]
        primer = PASS_PRIMER
    else:
        labels = rng.sample(ARCHIVES, 4)  # labels[0] is asked; two_turn asks labels[1] first
        codes = _codes(rng, 4)
        needles = [_enc(tokenizer, KEY_NEEDLE.format(name=n, code=c)) for n, c in zip(labels, codes, strict=True)]
        turns = [("user", KEY_INTRO + BODY + "\n\n" + KEY_QUESTION.format(name=labels[1 if test == "two_turn" else 0]))]
        if test == "two_turn":
            turns += [("assistant", TURN + KEY_ANSWER.format(name=labels[1], code=codes[1])),
                      ("user", KEY_QUESTION.format(name=labels[0]))]
        primer = KEY_PRIMER.format(name=labels[0])
    pieces, chat = chat_pieces(tokenizer, turns, primer)
    parts = [_enc(tokenizer, p) for p in pieces]
    frame = sum(map(len, parts)) + sum(map(len, needles))
    n_hay = context - frame
    if n_hay < MIN_HAYSTACK:
        raise InputError(f"{option('context', context)} leaves {n_hay} tokens of text besides the {frame} of the "
                         f"template, questions and needles; give {option('context', frame + MIN_HAYSTACK)} or more")
    hay = _haystack(tokenizer, test, n_hay, codes, rng, stream)
    body, spans = insert_needles(hay, needles, 0, depth, rng)
    head = len(parts[0])
    ids = parts[0] + body + [t for p in parts[1:] for t in p]
    assert len(ids) == context
    start, end = spans[0]
    return Placement(depth=depth, trial=trial, ids=ids, expected=codes[0],
                     needle_span=(head + start, head + end), codes=dict(zip(labels, codes, strict=True)),
                     asked=labels[0], chat=chat,
                     turn_end=head + len(body) + len(parts[1]) if test == "two_turn" else None)


def _haystack(tokenizer, test, n: int, codes: list[str], rng: random.Random, stream) -> list[int]:
    if stream is None:
        if test != "passkey":
            raise InputError(f"the {test} test hides its codes in a text: give its token stream")
        filler = _enc(tokenizer, FILLER)
        return (filler * (n // len(filler) + 1))[:n]
    if len(stream) < n:
        raise InputError(f"the text has {len(stream):,} tokens, fewer than the {n:,} a prompt needs: "
                         f"give a longer {option('text_file', python='text')} or a shorter {option('context')}")
    for _ in range(100):  # a slice that already holds a code would make the verdict ambiguous
        at = rng.randint(0, len(stream) - n)
        hay = stream[at : at + n]
        text = tokenizer.decode(hay)
        if not any(c in text for c in codes):
            return hay
    raise InputError("every slice of the text tried holds one of the codes: give another "
                     f"{option('text_file', python='text')}")


def build_placements(tokenizer, test: str, context: int, depths=DEPTHS, trials: int = TRIALS,
                     seed: int = 0, stream: list[int] | None = None) -> list[Placement]:
    """Every placement of a test, depth-major: depths x trials prompts of `context` tokens."""
    if tokenizer is None:
        raise InputError("retrieval tests need a tokenizer: load a pretrained model, not init='random'")
    depths = check_depths(depths)
    check_counts(context, trials, 1)
    return [build_placement(tokenizer, test, context, d, t, seed, stream) for d in depths for t in range(trials)]


# -- verdicts ---------------------------------------------------------------------------
def verdict(output: str, expected: str, others=()) -> str:
    """'correct' when the expected code is the first code in `output`, 'distractor' when
    another needle's code is, 'miss' when none appears."""
    found = [(output.find(c), c) for c in (expected, *others) if c in output]
    if not found:
        return "miss"
    return "correct" if min(found)[1] == expected else "distractor"


def in_window(span: tuple[int, int], n: int, budget: int, sinks: int) -> bool:
    """Whether any token of the needle span [start, end) lies among the sinks or the recent
    entries a window of `budget` keeps of an n-token prompt (`kv.window.window_ranges`)."""
    from sparsedecode.kv.window import window_ranges

    s, e = span
    return any(s < b and e > a for a, b in window_ranges(n, budget, sinks))


def needle_kept(span: tuple[int, int], kept: list[torch.Tensor]) -> dict:
    """How much of the needle span [start, end) a scored selection kept, from its kept
    positions per layer (B, Hkv, budget): 'tokens', the fraction of (layer, batch, KV head,
    needle token) entries kept; 'whole', the fraction of (layer, batch, KV head) that kept
    every needle token. A diagnostic of a wrong answer: a code whose digits were dropped
    in some heads, or a needle kept whole that the model still misread."""
    s, e = span
    if not kept or e <= s:
        raise InputError(f"needle_kept wants a non-empty span and kept positions, got {span} and "
                         f"{0 if not kept else len(kept)} layers")
    need = torch.arange(s, e)  # (L,)
    hit = torch.stack([torch.isin(need, idx.reshape(-1, idx.shape[-1])[j])
                       for idx in kept for j in range(idx.shape[0] * idx.shape[1])])  # (heads, L)
    return {"tokens": round(float(hit.float().mean()), 6), "whole": round(float(hit.all(dim=1).float().mean()), 6)}


def summary(verdicts: list[str]) -> dict:
    """Counts of each verdict and the total."""
    return {"correct": verdicts.count("correct"), "total": len(verdicts),
            "distractor": verdicts.count("distractor"), "miss": verdicts.count("miss")}


# -- decoding -----------------------------------------------------------------------------
def _set_projection(engine, th) -> None:
    """Dense projections (th None) or the thresholds `th` in the decode step (the selections
    are this harness's own, so the configuration names no KV branch)."""
    from sparsedecode.config import ProjectionConfig, SparsityConfig

    if th is None and engine.thresholds is not None:
        engine.configure(SparsityConfig())
    elif th is not None and engine.thresholds is not th:
        engine.configure(SparsityConfig(ProjectionConfig(keep=th.keep)), thresholds=th)


def _rewind(engine, ids: list[int], n: int) -> None:
    """Back to the end of ids[:n]: the cache's first n entries are the dense causal prefill of
    ids[:n] whatever followed, so a selection can be made there (its observation pass re-runs
    the last tokens of ids[:n])."""
    engine.rewind(ids[:n])


def _greedy(engine, first: int, new: int) -> list[int]:
    """`new` greedy tokens from `first` (stopping after an EOS id)."""
    out = [first]
    while len(out) < new and out[-1] not in engine.eos_ids:
        out.append(int(engine.decode_step(out[-1]).argmax()))
    return out


def _append(engine, ids: list[int]) -> int:
    """Teacher-force ids through the decode step (each appends its entry to the selection's
    buffer, or to the window, and attends only what it reads); the greedy next token."""
    if not ids:
        raise InputError("nothing to append: the second turn is empty")
    for t in ids:
        logits = engine.decode_step(t)
    return int(logits.argmax())


def _dense_placement(engine, p: Placement, new: int) -> tuple[int, str]:
    """Dense prefill of the placement's prompt and its dense answer; (first token, text)."""
    _set_projection(engine, None)
    engine.reset()
    first = int(engine.prefill(p.ids).argmax())
    return first, engine.tokenizer.decode(_greedy(engine, first, new), skip_special_tokens=True)


def _configured_placement(engine, p: Placement, first: int, dense: str, th, kv, selector,
                          variant: str | None, new: int) -> dict:
    """The configuration's answer from the dense prefill of `p` (cache entries [0, n) as the
    prefill left them) beside the dense answer. The kept two-turn variant rewrites entries
    past the first turn, so the caller prefills again before the next configuration."""
    n = len(p.ids)
    sel, n_sel = None, n
    _set_projection(engine, None)
    if variant == "kept":
        n_sel = p.turn_end
        _rewind(engine, p.ids, n_sel)
        sel = engine.select_kv(kv.method, kv.keep, n - n_sel + new, indices=True, **kv.params)
        first = _append(engine, p.ids[n_sel:])
    else:
        _rewind(engine, p.ids, n)
        if kv is None:
            engine.clear_kv()
        else:
            sel = engine.select_kv(kv.method, kv.keep, new, indices=True, **kv.params)
    _set_projection(engine, th)
    configured = engine.tokenizer.decode(_greedy(engine, first, new), skip_special_tokens=True)
    window = kept = None
    if kv is not None and kv.method == "window":
        window = in_window(p.needle_span, n_sel, sel.budget, selector.sinks)
    elif sel is not None and sel.kept:
        kept = needle_kept(p.needle_span, sel.kept)
    return {
        "depth": p.depth, "trial": p.trial, "expected": p.expected, "needle_span": list(p.needle_span),
        "asked": p.asked, "codes": dict(p.codes),
        "dense": {"output": dense, "verdict": verdict(dense, p.expected, p.others)},
        "configured": {"output": configured, "verdict": verdict(configured, p.expected, p.others),
                       "in_window": window, "needle_kept": kept},
    }


def evaluate_retrieval(engine, test: str, config=None, *, thresholds=None, context: int, depths=DEPTHS,
                       trials: int = TRIALS, seed: int = 0, new: int = NEW, variant: str | None = None,
                       text_path=None, progress: bool = False, partial=None) -> dict:
    """Run one retrieval test, every placement dense and under `config` (an
    `config.SparsityConfig`; None is dense; `thresholds`: calibrated ones for its projection
    branch) from the same prefill; returns the
    'retrieval_eval' record (unstamped). `text_path`: the text whose token stream hides the
    codes (needed by multikey and two_turn; for passkey it replaces the filler). `variant`
    ('kept' by default) applies to two_turn with a KV configuration. `partial`: a file that
    keeps the finished placements, so an interrupted run resumes (`evaluate_retrieval_many`).
    The engine is left dense."""
    return evaluate_retrieval_many(engine, test, [config], thresholds=[thresholds], context=context, depths=depths,
                                   trials=trials, seed=seed, new=new, variant=variant,
                                   text_path=text_path, progress=progress,
                                   partials=None if partial is None else [partial])[0]


def evaluate_retrieval_many(engine, test: str, configs, *, thresholds=None, context: int, depths=DEPTHS,
                            trials: int = TRIALS, seed: int = 0, new: int = NEW,
                            variant: str | None = None, text_path=None,
                            progress: bool = False, partials=None) -> list[dict]:
    """`evaluate_retrieval` for several configurations at once: one dense prefill and one
    dense answer per placement serve every configuration (a second prefill only after a
    kept two-turn selection, which rewrites the second turn's entries). One record per
    configuration, each the same as `evaluate_retrieval` would return. `thresholds`: a list
    beside `configs` (None entries: from the configuration's file or keep).

    `partials`, one file path per configuration: every finished placement is appended to
    its configuration's file as it ends, and a later call with the same files resumes after
    the placements all of them hold (a long run at 32K loses at most one placement when it is
    interrupted). The caller deletes them once the records are written. A file written for
    other arguments or placements is refused, with what differs."""
    from sparsedecode.config import SparsityConfig
    from sparsedecode.corpus import text_ids
    from sparsedecode.kv.select import get_selector
    from sparsedecode.quality.perplexity import resolve_projection

    test = check_test(test)
    depths = check_depths(depths)
    check_counts(context, trials, new)
    check_variant(variant)
    configs = [c or SparsityConfig() for c in configs]
    ths = list(thresholds) if thresholds is not None else [None] * len(configs)
    if len(ths) != len(configs):
        raise InputError(f"{len(ths)} thresholds for {len(configs)} configurations: give one each (None allowed)")
    if not configs:
        raise InputError("no configuration to evaluate: give at least one (None is dense)")
    if context + new > engine.max_len:
        raise InputError(f"{option('context', context)} plus {option('new', new)} exceed the engine's cache of "
                         f"{engine.max_len} tokens; load it with max_len >= {context + new}")
    if test != "passkey" and text_path is None:
        raise InputError(f"the {test} test needs a text to hide its codes in (WikiText-2 test)")
    stream = None if text_path is None else text_ids(engine.tokenizer, text_path)
    placements = build_placements(engine.tokenizer, test, context, depths, trials, seed, stream)
    plans = []  # (config, th, kv, selector, variant) of each configuration
    for config, given in zip(configs, ths, strict=True):
        kv = config.kv
        var = (variant or "kept") if test == "two_turn" and kv is not None else None
        selector = None if kv is None else get_selector(kv.method, **kv.params)
        if selector is not None:  # every budget fails now, before anything decodes
            for p in placements:
                at = p.turn_end if var == "kept" else context
                try:
                    selector.budget(at, kv.keep, context - at + new)
                except InputError as e:
                    if var != "kept":
                        raise
                    raise InputError(f"two-turn kept: the selection after the first question ({at} "
                                     f"tokens) leaves room for the {context - at}-token second turn "
                                     f"and {new} new tokens; {e}; or use {option('variant', 'rescored')}") from None
        plans.append((resolve_projection(engine, config.projection, given), kv, selector, var))

    it = placements
    rows: list[list[dict]] = [[] for _ in plans]
    books = None
    if partials is not None:
        if len(partials) != len(plans):
            raise InputError(f"{len(partials)} partial files for {len(plans)} configurations: give one each")
        heads = [{"test": test, "context": context, "depths": list(depths), "trials": trials, "seed": seed,
                  "new": new, "model": engine.name, "config": _config_of(th, kv, var)}
                 for th, kv, _, var in plans]
        books = [_Partial(path, head, placements) for path, head in zip(partials, heads, strict=True)]
        done = min(len(b.rows) for b in books)
        for b, r in zip(books, rows, strict=True):
            r.extend(b.keep(done))
        it = placements[done:]
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=test.replace("_", "-"), unit="placement", leave=False,
                  initial=len(placements) - len(it), total=len(placements))
    try:
        with torch.no_grad():  # not inference_mode: a selection's buffers stay ordinary tensors
            for p in it:
                first, dense = _dense_placement(engine, p, new)
                for i, (th, kv, selector, var) in enumerate(plans):
                    if i and plans[i - 1][3] == "kept":  # the kept turn rewrote entries past turn one
                        first, dense = _dense_placement(engine, p, new)
                    rows[i].append(_configured_placement(engine, p, first, dense, th, kv, selector, var, new))
                for b, r in zip(books or (), rows, strict=False):
                    b.add(r[-1])
    finally:
        _set_projection(engine, None)
        engine.clear_kv()
        engine.reset()
    return [_record(engine, test, context, depths, trials, seed, new, placements, text_path, stream,
                    th, kv, var, r) for (th, kv, _, var), r in zip(plans, rows, strict=True)]


def partial_path(out) -> Path:
    """Where a retrieval run writing the record `out` keeps its finished placements until the
    record is written: `.NAME.partial.jsonl` beside it."""
    out = Path(out)
    return out.with_name(f".{out.name}.partial.jsonl")


def _kv_of(kv) -> dict | None:
    return None if kv is None else {"method": kv.method, "keep": kv.keep, "params": dict(kv.params)}


def _config_of(th, kv, variant) -> dict:
    """What a configuration is, as its partial file's header records it."""
    return {"projection": None if th is None else {"method": th.method, "keep": th.keep},
            "kv": _kv_of(kv), "variant": variant}


class _Partial:
    """One configuration's finished placements on disk, a JSON line each after a header line
    naming the run (`evaluate_retrieval_many(partials=...)`)."""

    def __init__(self, path, head: dict, placements: list):
        self.path, self.head = Path(path), json.loads(json.dumps(head))
        lines = self.path.read_text(encoding="utf-8").splitlines() if self.path.is_file() else []
        rows = []
        for ln in lines[1:]:
            try:
                rows.append(json.loads(ln))
            except ValueError:  # a line cut by the interruption: the last one, and not finished
                break
        if lines:
            try:
                got = json.loads(lines[0])["header"]
            except (ValueError, KeyError, TypeError):
                raise InputError(f"{self.path} is not a partial file of retrieval placements (its first "
                                 "line names no run); delete it to start this run over") from None
            if got != self.head:
                diff = sorted(k for k in set(got) | set(self.head) if got.get(k) != self.head.get(k))
                raise InputError(f"{self.path} holds placements of another run ({', '.join(diff)} differ); "
                                 "delete it to start this run over")
        for j, row in enumerate(rows[:len(placements)]):
            want = _placement_id(placements[j])
            if {k: row.get(k) for k in want} != want:
                raise InputError(f"{self.path}: placement {j} is not the one this run builds "
                                 f"({want}); delete the file to start this run over")
        self.rows = rows[:len(placements)]  # the file is rewritten by `keep`, which its caller calls

    def keep(self, n: int) -> list[dict]:
        """The first `n` rows, and the file rewritten to hold just those."""
        self.rows = self.rows[:n]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(json_line(x) + "\n" for x in [{"header": self.head}, *self.rows]), encoding="utf-8")
        os.replace(tmp, self.path)
        return list(self.rows)

    def add(self, row: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json_line(row) + "\n")
        self.rows.append(row)


def _placement_id(p) -> dict:
    """What identifies a placement in a partial file's rows."""
    return json.loads(json.dumps({"depth": p.depth, "trial": p.trial, "expected": p.expected,
                                  "needle_span": list(p.needle_span), "asked": p.asked}))


def _record(engine, test, context, depths, trials, seed, new, placements, text_path, stream,
            th, kv, variant, rows) -> dict:
    from sparsedecode.config import ProjectionConfig, SparsityConfig
    from sparsedecode.projection.sparse_linear import runtime

    dense = [r["dense"]["verdict"] for r in rows]
    conf = [r["configured"]["verdict"] for r in rows]
    proj = None if th is None else {**th.header(), "runtime": runtime(th, engine.device, engine.dtype)}
    kvd = _kv_of(kv)
    mode = SparsityConfig(None if th is None else ProjectionConfig(keep=th.keep), kv).mode
    return {
        "kind": "retrieval_eval", "test": test,
        "model": {"name": engine.name, "source": str(engine.source_path), "init": engine.init,
                  "dims": engine.dims.to_dict()},
        "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
        "context": context, "depths": list(depths), "trials": trials, "seed": seed, "new": new,
        "chat_template": placements[0].chat,
        "text": None if text_path is None else {"file": str(text_path), "tokens": len(stream)},
        "config": {"mode": mode, "projection": proj, "kv": kvd, "variant": variant},
        "placements": rows,
        "dense": summary(dense), "configured": summary(conf),
        "matches_dense": all(c == "correct" for d, c in zip(dense, conf, strict=True) if d == "correct"),
    }
