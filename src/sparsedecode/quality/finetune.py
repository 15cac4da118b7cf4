"""LoRA fine-tuning of a sparse model, with its thresholds applied as the decode step applies them
(SATS paper §4 'Fine-tuned model performance', §4.2 'Fine-tuning Methods').

Training-free CATS and SATS cost perplexity; the SATS paper recovers part of it by fine-tuning
the sparsified model with LoRA on a small text subset, so the adapter learns to work with the
channels the thresholds drop. Here the forward pass of training runs every position under the
thresholds' masks (`projection.calibrate.masks`, the masked reference of the sparse step, the same
hooks the chunked perplexity protocol uses): CATS/SATS zero the channels of |SiLU(gate)| at or
below the threshold before down, TEAL sites zero the input channels with |x| <= t of each
projection. The masks sit on the adapted module itself, so a TEAL mask reaches both the base
weight and the LoRA path: the output is (W + s·B·A) x_masked, exactly what the merged model's
sparse kernel computes (`projection.lora.merge_`). The LoRA layers are peft's (`pip install
'sparsedecode[lora]'`), injected into the engine's own decoder; the forward pass is the decoder's
cacheless one (`models.decoder.forward_uncached`).

Text: the first `tokens` tokens of WikiText-2 validation by default (test stays held out for
evaluation), cut into windows of `seq_len` + 1 tokens, visited in a seeded random order, `batch`
windows per step. AdamW, a linear warm-up then a cosine decay, gradients clipped to norm 1.
Everything is seeded: two runs with the same options give the same loss curve and adapter.

Interruption: the run saves a checkpoint into the output folder every `checkpoint_every` steps
and when SIGTERM or Ctrl-C asks it to stop (after the step under way): the LoRA factors, AdamW's
state and the loss curve so far, written atomically. The same call again resumes from it and
ends with the same adapter as an uninterrupted run; a checkpoint of other options is refused
with what differs. The finished adapter (peft's layout, `projection.lora`) and a record of the
run (kind 'finetune', its loss curve) are written at the end, and the checkpoint is removed.
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsedecode.errors import InputError, option

CHECKPOINT = ".finetune_checkpoint.pt"
RECORD = "finetune.json"


@dataclass(frozen=True)
class FinetuneOptions:
    """A fine-tuning run: the adapter's shape (rank, alpha, targets: 'mlp' or 'all'), the text
    (`tokens` of it, windows of `seq_len`, `batch` windows a step), `steps`, the peak learning
    rate `lr` after `warmup` steps, the `seed`, and how often a checkpoint is saved. The defaults
    train smollm2-135m's MLPs in a few minutes on two CPU cores."""

    rank: int = 16
    alpha: float = 32.0
    targets: str = "mlp"
    tokens: int = 32768
    seq_len: int = 256
    batch: int = 1
    steps: int = 128
    lr: float = 1e-3
    warmup: int = 8
    seed: int = 0
    checkpoint_every: int = 16

    def __post_init__(self):
        self.spec  # noqa: B018 (rank, alpha and targets are checked there)
        for name in ("tokens", "seq_len", "batch", "steps", "checkpoint_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{option(name, v)}: must be a whole number >= 1")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise InputError(f"{option('warmup', self.warmup)}: must be a whole number >= 0")
        if isinstance(self.lr, bool) or not isinstance(self.lr, int | float) or not math.isfinite(self.lr) \
                or not 0 < self.lr < 1:
            raise InputError(f"{option('lr', self.lr)}: the learning rate must be a number in (0, 1)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InputError(f"{option('seed', self.seed)}: must be a whole number >= 0")
        if self.tokens < self.seq_len * self.batch + 1:
            raise InputError(f"{option('tokens', self.tokens)} holds less than one step of {self.batch} window(s) "
                             f"of {option('seq_len', self.seq_len)} (+1) tokens; give more tokens or shorter windows")

    @property
    def spec(self):
        from sparsedecode.projection.lora import LoraSpec

        return LoraSpec(rank=self.rank, alpha=self.alpha, targets=self.targets)

    def lr_at(self, step: int) -> float:
        """The learning rate of step `step` (0-based): linear warm-up, then cosine to 0."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        span = max(1, self.steps - self.warmup)
        return self.lr * 0.5 * (1 + math.cos(math.pi * (step - self.warmup) / span))


def windows_of(ids, opts: FinetuneOptions) -> torch.Tensor:
    """(n, seq_len + 1) training windows of the first `opts.tokens` ids (consecutive, stride seq_len)."""
    t = torch.as_tensor(ids[: opts.tokens], dtype=torch.long)
    n = (t.numel() - 1) // opts.seq_len
    return torch.stack([t[i * opts.seq_len: (i + 1) * opts.seq_len + 1] for i in range(n)])


def order_of(n: int, opts: FinetuneOptions) -> torch.Tensor:
    """The window index of every (step, slot): seeded permutations of the n windows, one per epoch."""
    gen = torch.Generator().manual_seed(opts.seed)
    need = opts.steps * opts.batch
    perms = [torch.randperm(n, generator=gen) for _ in range(-(-need // n))]
    return torch.cat(perms)[:need].view(opts.steps, opts.batch)


def thresholds_id(thresholds) -> dict | None:
    """What a run records of its thresholds: method, keep and the sha256 of their values (and of
    the file, where they came from one)."""
    if thresholds is None:
        return None
    values = ";".join(f"{k}={v!r}" for k, v in sorted(thresholds.values.items()))
    return {"method": thresholds.method, "keep": thresholds.keep, "keep_metric": thresholds.keep_metric,
            "values_sha256": hashlib.sha256(values.encode()).hexdigest()}


class Stop:
    """Whether SIGTERM or Ctrl-C asked the run to stop; set by `stop_on_signals`, read between steps."""

    def __init__(self):
        self.asked: str | None = None

    def __bool__(self) -> bool:
        return self.asked is not None


@contextmanager
def stop_on_signals():
    """A `Stop` that SIGTERM and SIGINT set (the step under way finishes and is checkpointed);
    a second signal stops at once (the last checkpoint stays). Handlers are restored on exit."""
    stop = Stop()
    names = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def handler(signum, frame):
        if stop.asked is not None:
            raise KeyboardInterrupt
        stop.asked = names.get(signum, str(signum))

    old = {}
    try:
        for s in names:
            old[s] = signal.signal(s, handler)
    except ValueError:  # not the main thread: no handlers; an interruption loses the steps since the last save
        pass
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class Interrupted(Exception):
    """The run stopped on a signal after saving its checkpoint; the same call resumes it."""


def finetune(engine, ids, thresholds, opts: FinetuneOptions, out, *, text: str = "", thresholds_file=None,
             progress: bool = False, stop=None, max_steps: int | None = None) -> dict:
    """Train a LoRA adapter of `engine`'s model on `ids` (the training text's token ids) under
    `thresholds` (a `Thresholds`; None trains the dense model) and write it to folder `out`
    (module doc). Returns the run's record. `stop` (a `Stop`, or anything falsy until the run
    should stop) is read after every step; `max_steps` ends this call after that many steps with
    a checkpoint, as an interruption would (tests). Raises `Interrupted` after checkpointing on
    a stop. The engine's projections are restored when it returns."""
    from sparsedecode.corpus import require_tokens

    out = Path(out)
    from sparsedecode.projection.lora import CONFIG_FILE

    if (out / CONFIG_FILE).exists():
        raise InputError(f"{out} holds an adapter already; adapters are never overwritten: pick a new "
                         f"{option('out')} folder (or delete the old one)")
    if engine.thresholds is not None or engine.adapter is not None:
        raise InputError("fine-tune a freshly loaded engine: this one runs "
                         + ("a projection branch" if engine.thresholds is not None else "a merged adapter")
                         + "; the thresholds are applied by the training itself")
    if thresholds is not None:
        thresholds.validate(engine.dims)
    opts.spec.check(engine.dims)
    require_tokens(ids, opts.tokens, text or "the training text", option("tokens"))
    data = windows_of(ids, opts)
    order = order_of(len(data), opts)
    key = {"model": engine.name, "dims": engine.dims.to_dict(), "options": asdict(opts),
           "thresholds": thresholds_id(thresholds), "text": text,
           "text_sha256": hashlib.sha256(data.numpy().tobytes()).hexdigest()}
    ckpt_path = out / CHECKPOINT
    state = _read_checkpoint(ckpt_path, key)
    t0 = time.perf_counter()
    model = engine.model
    engine.reset()
    engine.need_linear("fine-tuning")  # peft wraps nn.Linear projections
    try:
        layers = _inject(model, opts)
        params = [p for _, (a, b) in layers.items() for p in (a, b)]
        optim = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0)
        losses: list[float] = []
        start = 0
        if state is not None:
            with torch.no_grad():
                for name, (a, b) in layers.items():
                    a.copy_(state["lora"][name][0])
                    b.copy_(state["lora"][name][1])
            optim.load_state_dict(state["optim"])
            losses, start = list(state["losses"]), int(state["step"])
        seconds = float(state["seconds"]) if state is not None else 0.0
        result = _train(model, layers, optim, data, order, thresholds, opts, losses, start, ckpt_path, key,
                        seconds, t0, progress, stop, max_steps)
        factors = _factors(layers, opts)
    finally:
        _unwrap(model)
        engine.need_linear(None)
    return _finish(engine, out, opts, factors, losses, key, thresholds, thresholds_file, text, result, ckpt_path)


def _train(model, layers, optim, data, order, thresholds, opts, losses, start, ckpt_path, key, seconds, t0,
           progress, stop, max_steps):
    from tqdm.auto import tqdm

    from sparsedecode.projection.calibrate import masks

    params = [p for _, (a, b) in layers.items() for p in (a, b)]
    table = {} if thresholds is None else dict(thresholds.values)
    bar = tqdm(total=opts.steps, initial=start, desc="fine-tune", unit="step", leave=False, disable=not progress)
    end = opts.steps if max_steps is None else min(opts.steps, start + max_steps)
    save = lambda step: _save_checkpoint(ckpt_path, key, layers, optim, losses, step,  # noqa: E731
                                         seconds + time.perf_counter() - t0)
    try:
        with masks(model, table):
            for step in range(start, end):
                batch = data[order[step]]  # (batch, seq_len + 1)
                for group in optim.param_groups:
                    group["lr"] = opts.lr_at(step)
                logits = _forward(model, batch[:, :-1])  # (batch, seq_len, V)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optim.step()
                optim.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
                bar.update(1)
                bar.set_postfix_str(f"loss {losses[-1]:.3f}", refresh=False)
                done = step + 1
                if stop:
                    save(done)
                    raise Interrupted(f"stopped by {getattr(stop, 'asked', 'a request')} after step {done} of "
                                      f"{opts.steps}; the checkpoint {ckpt_path} holds it: run the same command "
                                      "again to resume")
                if done < opts.steps and (done == end or done % opts.checkpoint_every == 0):
                    save(done)
            if end < opts.steps:
                raise Interrupted(f"stopped after step {end} of {opts.steps} (max_steps); run again to resume")
    finally:
        bar.close()
    return {"seconds": round(seconds + time.perf_counter() - t0, 2)}


def _forward(model, x):
    from sparsedecode.models.decoder import forward_uncached

    return forward_uncached(model, x)


def _inject(model, opts: FinetuneOptions) -> dict:
    """peft's LoRA layers on the targeted projections of `model`, seeded (A: peft's Kaiming init,
    B: zeros): {site key: (A weight (r, in), B weight (out, r))}; every other parameter frozen."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.lora import LoraLayer
    except ImportError:
        raise InputError("fine-tuning needs peft: pip install 'sparsedecode[lora]'") from None
    spec = opts.spec
    for p in model.parameters():
        p.requires_grad_(False)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.modules),
                        lora_dropout=0.0, bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(opts.seed)
        inject_adapter_in_model(config, model)
    layers = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer):
            a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
            a.requires_grad_(True)
            b.requires_grad_(True)
            layers[name] = (a, b)
    if not layers:
        raise InputError(f"no projection of {spec.targets!r} found to adapt in this model")
    return layers


def _unwrap(model) -> None:
    """Put every projection peft wrapped back as its base layer (the engine's own nn.Linear)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return
    for name, mod in list(model.named_modules()):
        if isinstance(mod, LoraLayer):
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, mod.get_base_layer())
    if "peft_config" in vars(model):
        del model.peft_config  # peft's mark of an injected model: the next injection starts clean


def _factors(layers: dict, opts: FinetuneOptions) -> dict:
    from sparsedecode.projection.lora import LoraFactor

    return {name: LoraFactor(a.detach().clone(), b.detach().clone(), opts.spec.scale)
            for name, (a, b) in layers.items()}


def _save_checkpoint(path: Path, key: dict, layers: dict, optim, losses: list[float], step: int,
                     seconds: float) -> None:
    """The run's state after `step` steps, written to a temp name and renamed (never half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"key": key, "step": step, "losses": list(losses), "seconds": seconds,
             "lora": {n: (a.detach().clone(), b.detach().clone()) for n, (a, b) in layers.items()},
             "optim": optim.state_dict()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_checkpoint(path: Path, key: dict) -> dict | None:
    """The checkpoint of this run, None where there is none; one of another run is refused."""
    if not path.exists():
        return None
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:  # a damaged file: say so, never train over it silently
        raise InputError(f"{path} is not a readable fine-tuning checkpoint ({type(e).__name__}); delete it "
                         "to start the run again from step 0") from None
    if state.get("key") != key:
        old = state.get("key") or {}
        diffs = [k for k in sorted(set(old) | set(key)) if old.get(k) != key.get(k)]
        detail = "; ".join(_diff(k, old.get(k), key.get(k)) for k in diffs)
        raise InputError(f"{path} is the checkpoint of another fine-tuning run ({detail}); rerun with that run's "
                         f"options to resume it, or pick another {option('out')} folder")
    return state


def _diff(k: str, old, new) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        inner = [f"{f} {old.get(f)!r} there, {new.get(f)!r} here" for f in sorted(set(old) | set(new))
                 if old.get(f) != new.get(f)]
        return f"{k}: " + ", ".join(inner[:4])
    return f"{k}: {old!r} there, {new!r} here"


def _finish(engine, out: Path, opts, factors, losses, key, thresholds, thresholds_file, text, result, ckpt_path):
    from sparsedecode.account.known import KNOWN_MODELS
    from sparsedecode.projection.lora import save_adapter
    from sparsedecode.records import stamp, write_record

    th = thresholds_id(thresholds)
    if th is not None and thresholds_file is not None:
        from sparsedecode.cache import sha256_of

        th = {**th, "file": Path(thresholds_file).name, "sha256": sha256_of(thresholds_file)}
    dims = engine.dims.to_dict()
    meta = {"model": engine.name, "dims": dims, "thresholds": th, "rank": opts.rank, "alpha": opts.spec.alpha,
            "targets": opts.targets, "tokens": opts.tokens, "steps": opts.steps, "seed": opts.seed,
            "options": asdict(opts), "text": text, "text_sha256": key["text_sha256"],
            "loss_first": round(losses[0], 5), "loss_last": round(losses[-1], 5)}
    known = KNOWN_MODELS.get(engine.name)
    save_adapter(out, opts.spec, factors, meta, base=known.hub_id if known is not None else engine.name)
    record = stamp({"kind": "finetune", "model": {"name": engine.name, "dims": dims, "init": engine.init},
                    "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
                    "adapter": str(out), "thresholds": th, "options": asdict(opts), "text": text,
                    "text_sha256": key["text_sha256"], "loss": [round(x, 6) for x in losses],
                    "seconds": result["seconds"], "torch_threads": torch.get_num_threads()})
    write_record(out / RECORD, record, overwrite=True)
    ckpt_path.unlink(missing_ok=True)
    return record


__all__ = ["CHECKPOINT", "RECORD", "FinetuneOptions", "Interrupted", "Stop", "finetune", "order_of",
           "stop_on_signals", "thresholds_id", "windows_of"]
