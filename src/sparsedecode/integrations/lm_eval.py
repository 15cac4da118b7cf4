"""lm-evaluation-harness on the engine under a sparsity configuration (ByteCross App. A,
'Quality protocols').

The paper scores tasks through the evaluation harness as plain completion, so only paired
differences between dense and sparse runs mean anything, and for MMLU it 'sparsifies only
the final position of each scoring call'. `SparseLM` is an `lm_eval` model over our
`Engine` with a `SparsityConfig`, batch 1, registered as `sparsedecode`:

    pip install "sparsedecode[lmeval]"
    python -m sparsedecode.integrations.lm_eval --model sparsedecode \\
        --model_args model=smollm2-135m,proj_keep=0.5 --tasks arc_easy --limit 200
    python -m sparsedecode.integrations.lm_eval --model sparsedecode --tasks mmlu --num_fewshot 5 \\
        --model_args model=llama-3.1-8b,thresholds=t.st,kv=snapkv,kv_keep=0.3,device=cuda

`python -m sparsedecode.integrations.lm_eval` is the `lm_eval` command with this model
registered: lm_eval 0.4 finds third-party models only in modules that were imported. From
Python, import this module, then `lm_eval.simple_evaluate(model="sparsedecode",
model_args=...)`, or pass `SparseLM(...)` itself as the model.

model_args: `model` (known name, HF folder, hub id or .gguf; default smollm2-135m);
`proj_keep` (uniform TEAL thresholds calibrated once and cached, as `eval ppl --proj-keep`)
or `thresholds` (a file from `sparsedecode calibrate`); `routing` (a calibrated table from
`sparsedecode route build` + `route calibrate`, with cats or sats `thresholds`: each decode
step runs the dense MLP or the CATS one by its input token, SATS paper §3.2); `kv` (snapkv or window) with
`kv_keep` and `obs` (observation window, 64); `device`, `dtype`, `max_len` (cache and
longest request, default min(model window, 4096)), `max_gen_toks` (256), `add_bos_token`.

How requests run, one at a time:

- loglikelihood(context, continuation): the context but its last token is prefilled densely;
  the KV selection, if any, runs after that prefill with room for the continuation; then the
  last context token and the continuation but its last token go one at a time through the
  engine's decode step under the configuration, each step scoring the next token. A one-token
  continuation (MMLU's answer letter) thus runs exactly its final position sparse, as the
  paper does. A request that shares the previous one's prefilled tokens (the choices of one
  question) reuses them. is_greedy: every continuation token is the step's argmax.
- loglikelihood_rolling: lm-eval's disjoint rolling windows of `max_len` tokens, each scored
  as above (every scored position is a decode step: slow on CPU for long documents).
- generate_until: the engine's generation loop (dense prefill, selection, decode steps),
  greedy unless the task samples, stopping at EOS or the first `until` string, which is cut.

A KV selection needs room for its sinks and observation window (kv/select.py): a request
whose context is too short for that reads its whole cache instead; such requests are
counted, warned about and reported in the results' config (`kv_dense_fallbacks`).
"""

from __future__ import annotations

import logging

import torch

try:
    import lm_eval.models  # noqa: F401  (registers lm_eval's own models first: see below)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import model_registry
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        f"sparsedecode.integrations.lm_eval needs lm-evaluation-harness ({e}): "
        'pip install "sparsedecode[lmeval]"'
    ) from e

from sparsedecode.errors import InputError

NAME = "sparsedecode"
log = logging.getLogger(__name__)


class SparseLM(TemplateLM):
    """An lm_eval model over `sparsedecode.load(model)` under the configuration that
    `proj_keep` / `thresholds` and `kv` / `kv_keep` / `obs` name (see the module doc);
    `engine` passes a loaded `Engine` instead of `model`."""

    def __init__(self, model: str = "smollm2-135m", proj_keep: float | None = None,
                 thresholds: str | None = None, routing: str | None = None,
                 kv: str | None = None, kv_keep: float | None = None,
                 obs: int = 64, device: str | None = None, dtype: str | None = None,
                 max_len: int | None = None, max_gen_toks: int = 256, add_bos_token: bool = False,
                 batch_size: int | str | None = None, max_batch_size: int | None = None,
                 engine=None, **unknown):
        super().__init__()
        if unknown:
            raise InputError(f"unknown model_args for {NAME}: {', '.join(sorted(unknown))}")
        if batch_size not in (None, 1, "1", "auto"):
            log.warning("%s runs one request at a time (batch 1); batch_size=%s is ignored", NAME, batch_size)
        from sparsedecode.account.units import check_keep
        from sparsedecode.config import KVConfig, ProjectionConfig, SparsityConfig
        from sparsedecode.quality.perplexity import resolve_projection

        if thresholds is not None and proj_keep is not None:
            raise InputError("give thresholds=FILE or proj_keep=K, not both")
        if (kv is None) != (kv_keep is None):
            raise InputError("the KV branch needs both kv=METHOD and kv_keep=K (e.g. kv=snapkv,kv_keep=0.3)")
        table = None
        if routing is not None:  # a bad or uncalibrated table fails before the model loads
            from sparsedecode.projection.routing import RoutingTable

            if thresholds is None:
                raise InputError("routing=FILE chooses between the dense MLP and CATS thresholds: give "
                                 "thresholds=FILE (a cats or sats file) too")
            table = RoutingTable.load(routing)
            table.sparse_of()
        if kv is not None:
            from sparsedecode.kv.select import get_selector

            self.selector = get_selector(kv, window=int(obs))  # an unknown method fails now
            self.kv = KVConfig(kv, check_keep(kv_keep, "kv_keep"), {"window": int(obs)})
        else:
            self.selector, self.kv = None, None
        keep = None if proj_keep is None else check_keep(proj_keep, "proj_keep")
        if engine is None:
            import sparsedecode

            engine = sparsedecode.load(model, device=device or "auto", dtype=dtype or "auto",
                                       max_len=max_len, quiet=True)
        if engine.tokenizer is None:
            raise InputError(f"'{engine.name}' has no tokenizer; lm-eval tasks are text")
        self.engine = engine
        projection = None
        if keep is not None:
            projection = ProjectionConfig(keep=keep)
        elif thresholds is not None:
            projection = ProjectionConfig(file=str(thresholds), routing=None if routing is None else str(routing))
        self.thresholds = resolve_projection(engine, projection)  # None at keep 1: dense projections
        self.config = SparsityConfig(projection if self.thresholds is not None else None, self.kv)
        self.routing_file = routing
        self._table = table if self.thresholds is not None else None
        # projections and routing now; the KV selection per request, after its prefill (see _select)
        engine.configure(self.config.with_(kv=None), thresholds=self.thresholds, routing=self._table)
        self.tokenizer = engine.tokenizer
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = bool(add_bos_token)
        self.kv_dense_fallbacks = 0
        self._prefix: list[int] | None = None  # token ids the cache holds from position 0

    # -- what lm_eval asks of a model --------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return int(eos if eos is not None else self.engine.eos_ids[0])

    @property
    def max_length(self) -> int:
        return self.engine.max_len

    @property
    def device(self):
        return self.engine.device

    @property
    def tokenizer_name(self) -> str:
        return self.engine.name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return list(self.tokenizer(string, add_special_tokens=special)["input_ids"])

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def get_model_info(self) -> dict:
        """Merged into the results' config by lm_eval: what ran, and how often the KV branch
        fell back to the whole cache."""
        th = self.thresholds
        return {NAME: {
            "model": self.engine.name, "init": self.engine.init, "device": str(self.engine.device),
            "dtype": str(self.engine.dtype).removeprefix("torch."), "mode": self.config.mode,
            "projection": None if th is None else {"method": th.method, "keep": th.keep},
            "kv": None if self.kv is None else {"method": self.kv.method, "keep": self.kv.keep,
                                                "params": dict(self.kv.params)},
            "routing": self.engine.routing_summary(self.routing_file),
            "kv_dense_fallbacks": self.kv_dense_fallbacks,
        }}

    # -- scoring -------------------------------------------------------------------------
    def _select(self, n: int, max_new: int) -> None:
        """After a prefill of n tokens: select the KV entries for max_new steps, or read the
        whole cache when there is no KV branch or n is too short for the selection."""
        eng = self.engine
        fits = False
        if self.kv is not None and n > 0:
            try:
                self.selector.budget(n, self.kv.keep, max_new)
                fits = True
            except InputError:
                self.kv_dense_fallbacks += 1
                if self.kv_dense_fallbacks == 1:
                    log.warning("%s: a request of %d tokens is too short for %s keep %g; such requests "
                                "read the whole cache (counted in kv_dense_fallbacks)",
                                NAME, n, self.kv.method, self.kv.keep)
        if fits:
            eng.select_kv(self.kv.method, self.kv.keep, max_new=max_new, **self.kv.params)
        elif eng.kv is not None:
            eng.clear_kv()

    def _prefill(self, ids: list[int]) -> None:
        """The cache holds `ids` from position 0, prefilled densely (reused when it already does)."""
        from sparsedecode.quality.perplexity import _prefill_chunk

        eng = self.engine
        if ids and ids == self._prefix:
            eng.seek(len(ids))  # decode steps of the last request wrote only beyond them
            return
        eng.reset()
        if ids:
            eng.prefill(ids, chunk=_prefill_chunk(len(ids)))
        self._prefix = list(ids)

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Log-probability of `continuation` after `context` (token ids) and whether each of
        its tokens is the greedy one; see the module doc for which positions run sparse."""
        if not continuation:
            return 0.0, True
        if not context:
            raise InputError("a continuation needs at least one context token (lm_eval gives the prefix token)")
        if len(continuation) > self.max_length:
            raise InputError(f"a continuation of {len(continuation)} tokens exceeds the cache of "
                             f"{self.max_length}; load with a larger max_len")
        whole = (context + continuation)[-(self.max_length + 1):]  # left-truncate the context
        k = len(continuation)
        feed = torch.tensor(whole[-k - 1 : -1], device=self.engine.device)  # (k,) decode-step inputs
        target = torch.tensor(whole[-k:], device=self.engine.device)  # (k,)
        self._prefill(whole[: -k - 1])
        self._select(self.engine.pos, k)
        logprob = torch.zeros((), dtype=torch.float64, device=self.engine.device)
        greedy = torch.ones((), dtype=torch.bool, device=self.engine.device)
        with torch.no_grad():  # not inference_mode: selection buffers stay ordinary tensors
            for j in range(k):
                logits = self.engine.decode_step(feed[j : j + 1])  # (V,): read before the next step
                logprob += torch.log_softmax(logits.double(), -1)[target[j]]
                greedy &= logits.argmax() == target[j]
        return float(logprob), bool(greedy)  # one host sync per request

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw) -> list[tuple[float, bool]]:
        from tqdm import tqdm

        out = []
        for key, context, continuation in tqdm(requests, desc=NAME, disable=disable_tqdm or self.rank != 0):
            res = self._score(list(context), list(continuation))
            out.append(res)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from tqdm import tqdm

        out = []
        for (text,) in tqdm([r.args for r in requests], desc=NAME, disable=disable_tqdm):
            windows = map(make_disjoint_window, get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length, 1))
            total = sum(self._score(ctx, cont)[0] for ctx, cont in windows)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tqdm import tqdm

        out = []
        for context, gen_kwargs in tqdm([r.args for r in requests], desc=NAME, disable=disable_tqdm):
            text = self._generate(context, dict(gen_kwargs or {}))
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out

    def _generate(self, context: str, kw: dict) -> str:
        until = kw.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kw.pop("max_gen_toks", self.max_gen_toks))
        sample = bool(kw.pop("do_sample", False))
        temperature = float(kw.pop("temperature", 1.0)) if sample else 0.0
        top_p = float(kw.pop("top_p", 1.0)) if sample else 1.0
        if max_new >= self.max_length:
            raise InputError(f"max_gen_toks {max_new} leaves no room for a prompt in the cache of "
                             f"{self.max_length}; load with a larger max_len")
        ids = self.tok_encode(context)[-(self.max_length - max_new):]  # left-truncate the prompt
        eng = self.engine
        self._prefix = None  # generation rewrites the cache
        fits = False
        if self.kv is not None:
            try:
                self.selector.budget(len(ids), self.kv.keep, max_new)
                fits = True
            except InputError:
                self.kv_dense_fallbacks += 1
        # engine.tokens selects after its prefill; the projection branch stays as installed
        eng.configure(self.config.with_(kv=self.kv if fits else None), thresholds=self.thresholds,
                      routing=self._table)
        new: list[int] = []
        text = ""
        try:
            for tok in eng.tokens(ids, max_new, temperature=temperature, top_p=top_p,
                                  seed=kw.pop("seed", None) if sample else None):
                if tok in eng.eos_ids:
                    break
                new.append(tok)
                text = self.tok_decode(new)
                if any(u in text for u in until):
                    break
        finally:
            eng.configure(self.config.with_(kv=None), thresholds=self.thresholds, routing=self._table)
        cut = min((text.find(u) for u in until if u in text), default=len(text))
        return text[:cut]


# A lazy entry, so the name resolves to this module's class even when the file also runs as
# __main__ (a second class object under the same name would be refused).
model_registry.register(NAME, target="sparsedecode.integrations.lm_eval:SparseLM")


def main() -> None:
    """The `lm_eval` command with `sparsedecode` registered as a model."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
