"""LoRA fine-tuning under thresholds (issue 45 item 1; SATS paper §4.2): the thresholds are applied
in the forward pass, a seed fixes the loss curve, a run stopped and resumed ends with the adapter
an uninterrupted run writes, and bad input is refused with the reason."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import sparsedecode
from shapes import tiny_llama
from sparsedecode.errors import InputError
from sparsedecode.models.decoder import forward_uncached
from sparsedecode.projection.calibrate import get_calibrator, masks
from sparsedecode.projection.lora import Adapter
from sparsedecode.quality.finetune import (
    CHECKPOINT,
    RECORD,
    FinetuneOptions,
    Interrupted,
    finetune,
    order_of,
    windows_of,
)

pytest.importorskip("peft")

TINY = tiny_llama(max_position_embeddings=256)
IDS = torch.randint(0, 100, (2048,), generator=torch.Generator().manual_seed(0)).tolist()
OPTS = FinetuneOptions(rank=4, alpha=8, tokens=1024, seq_len=16, batch=2, steps=6, lr=2e-2, warmup=1,
                       checkpoint_every=2)


@pytest.fixture(scope="module")
def setup():
    eng = sparsedecode.load(dict(TINY), init="random", dtype="float32", max_len=64, seed=3)
    with torch.no_grad():  # larger MLP weights: the masks then change the loss visibly
        for layer in eng.model.layers:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.mul_(20.0)
    th = get_calibrator("cats", keep=0.5).calibrate(eng, IDS[:512])
    return eng, th


def _factors(path):
    return {k: (f.A, f.B) for k, f in Adapter.load(path).factors.items()}


def test_a_seed_fixes_the_loss_curve_and_the_adapter(setup, tmp_path):
    eng, th = setup
    a = finetune(eng, IDS, th, OPTS, tmp_path / "a", text="ids")
    b = finetune(eng, IDS, th, OPTS, tmp_path / "b", text="ids")
    assert a["loss"] == b["loss"] and len(a["loss"]) == OPTS.steps
    fa, fb = _factors(tmp_path / "a"), _factors(tmp_path / "b")
    assert all(torch.equal(fa[k][0], fb[k][0]) and torch.equal(fa[k][1], fb[k][1]) for k in fa)
    c = finetune(eng, IDS, th, FinetuneOptions(**{**OPTS.__dict__, "seed": 1}), tmp_path / "c", text="ids")
    assert c["loss"] != a["loss"]  # the seed is what fixed it
    assert not any(torch.count_nonzero(f[1]) == 0 for f in fa.values())  # B trained away from 0


def test_training_lowers_the_loss_on_its_text(setup, tmp_path):
    eng, th = setup
    opts = FinetuneOptions(**{**OPTS.__dict__, "steps": 24, "tokens": 128, "batch": 1, "checkpoint_every": 100})
    rec = finetune(eng, IDS, th, opts, tmp_path / "a", text="ids")
    assert sum(rec["loss"][-4:]) / 4 < sum(rec["loss"][:4]) / 4


def test_the_first_step_s_loss_is_the_masked_model_s(setup, tmp_path):
    """B starts at 0, so step 0's loss is the base model's under the thresholds' masks, which
    differs from the dense loss: the thresholds are applied in training."""
    eng, th = setup
    rec = finetune(eng, IDS, th, OPTS, tmp_path / "a", text="ids")
    batch = windows_of(IDS, OPTS)[order_of(len(windows_of(IDS, OPTS)), OPTS)[0]]

    def loss(table):
        with torch.no_grad(), masks(eng.model, table):
            logits = forward_uncached(eng.model, batch[:, :-1])
        return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)))

    assert rec["loss"][0] == pytest.approx(loss(th.values), rel=1e-5)
    assert abs(loss({}) - loss(th.values)) > 1e-3


def test_a_stopped_run_resumes_to_the_same_adapter(setup, tmp_path):
    eng, th = setup
    full = finetune(eng, IDS, th, OPTS, tmp_path / "full", text="ids")
    with pytest.raises(Interrupted, match="run again to resume"):
        finetune(eng, IDS, th, OPTS, tmp_path / "cut", text="ids", max_steps=3)
    assert (tmp_path / "cut" / CHECKPOINT).exists() and not (tmp_path / "cut" / RECORD).exists()

    class StopAfterOne:  # a signal arriving during the next step
        asked = "SIGTERM"

        def __bool__(self):
            return True

    with pytest.raises(Interrupted, match="SIGTERM after step 4 of 6"):
        finetune(eng, IDS, th, OPTS, tmp_path / "cut", text="ids", stop=StopAfterOne())
    resumed = finetune(eng, IDS, th, OPTS, tmp_path / "cut", text="ids")
    assert resumed["loss"] == full["loss"]
    fa, fb = _factors(tmp_path / "full"), _factors(tmp_path / "cut")
    assert all(torch.equal(fa[k][0], fb[k][0]) and torch.equal(fa[k][1], fb[k][1]) for k in fa)
    assert not (tmp_path / "cut" / CHECKPOINT).exists()
    assert json.loads((tmp_path / "cut" / RECORD).read_text())["loss"] == full["loss"]


def test_a_checkpoint_of_other_options_is_refused(setup, tmp_path):
    eng, th = setup
    with pytest.raises(Interrupted):
        finetune(eng, IDS, th, OPTS, tmp_path / "a", text="ids", max_steps=2)
    other = FinetuneOptions(**{**OPTS.__dict__, "lr": 1e-3})
    with pytest.raises(InputError, match=r"checkpoint of another fine-tuning run \(options: lr 0.02 there, 0.001 here"):
        finetune(eng, IDS, th, other, tmp_path / "a", text="ids")


def test_an_adapter_is_never_overwritten(setup, tmp_path):
    eng, th = setup
    finetune(eng, IDS, th, OPTS, tmp_path / "a", text="ids")
    with pytest.raises(InputError, match="holds an adapter already"):
        finetune(eng, IDS, th, OPTS, tmp_path / "a", text="ids")


def test_text_shorter_than_the_tokens_is_refused(setup, tmp_path):
    eng, th = setup
    with pytest.raises(InputError, match="has 1,000 tokens, fewer than tokens= 1,024"):
        finetune(eng, IDS[:1000], th, OPTS, tmp_path / "a", text="ids")


@pytest.mark.parametrize("field, value, match", [
    ("rank", 0, r"rank=0: the LoRA rank must be a whole number >= 1"), ("rank", -2, r"rank=-2: .*>= 1"),
    ("steps", 0, r"steps=0: must be a whole number >= 1"), ("lr", 0.0, r"lr=0.0: .*\(0, 1\)"),
    ("targets", "ffn", "targets='ffn': LoRA targets are one of mlp, all"),
    ("tokens", 16, "less than one step"),
])
def test_bad_options_are_refused(field, value, match):
    with pytest.raises(InputError, match=match):
        FinetuneOptions(**{**OPTS.__dict__, field: value})


def test_the_engine_is_given_back_as_it_was(setup, tmp_path):
    """After training the projections are the engine's own again and it decodes as before."""
    eng, th = setup
    ids = torch.tensor(IDS[:24])
    before = eng.prefill(ids, all_logits=True)
    finetune(eng, IDS, th, OPTS, tmp_path / "a", text="ids")
    assert torch.equal(eng.prefill(ids, all_logits=True), before)
    assert not any("lora" in n for n, _ in eng.model.named_modules())
