"""The lm-evaluation-harness adapter (ByteCross App. A 'Quality protocols'; issue 7): the
package imports without lm_eval; with it, SparseLM's scores against a full forward and
against the masked reference of the final position, the KV selection and its fallback,
generation with stop strings, and a tiny local multiple-choice task through the harness
under the registered name. Tests that need lm_eval skip without it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import sparsedecode
from sparsedecode.config import SparsityConfig
from sparsedecode.projection.thresholds import Thresholds

HAVE_LM_EVAL = importlib.util.find_spec("lm_eval") is not None
needs_lm_eval = pytest.mark.skipif(not HAVE_LM_EVAL, reason='lm-eval not installed (pip install "sparsedecode[lmeval]")')
SITES = "q k v o gate up down".split()


def test_the_package_imports_without_lm_eval():
    """`import lm_eval` fails in the child (sys.modules entry None): the package and its CLI
    still import, and the adapter says how to install what it needs."""
    code = textwrap.dedent("""
        import sys
        sys.modules["lm_eval"] = None
        import sparsedecode, sparsedecode.integrations, sparsedecode.cli
        try:
            import sparsedecode.integrations.lm_eval
        except ImportError as e:
            print(e)
        else:
            raise SystemExit("imported without lm_eval")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert 'pip install "sparsedecode[lmeval]"' in res.stdout


# -- with lm_eval --------------------------------------------------------------------------
@pytest.fixture
def eng(embedded_engine):
    """smollm2-135m (float32, CPU, cache 1,024), dense again after each test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: see tests/quality/test_ppl_protocols.py
    e = embedded_engine("smollm2-135m")
    e.configure(SparsityConfig())
    yield e
    e.configure(SparsityConfig())
    e.reset()
    e.prefill([1])  # a prefill from 0 drops any selection
    e.reset()
    torch.set_num_threads(n)


def _reference(eng, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """Log-probability of the continuation from one dense full forward, and greediness."""
    ids = context + continuation
    logits = eng.forward_logits(ids)[len(context) - 1 : -1].double()  # (k, V): predict the continuation
    lp = torch.log_softmax(logits, -1)[torch.arange(len(continuation)), torch.tensor(continuation)]
    return float(lp.sum()), bool((logits.argmax(-1) == torch.tensor(continuation)).all())


def _thresholds(eng, tmp_path, t: float = 0.2) -> str:
    values = {f"layers.{i}.{s}": t for i in range(eng.dims.n_layers) for s in SITES}
    th = Thresholds(values=values, method="teal", keep=0.5, model=eng.name, dims=eng.dims.to_dict())
    return str(th.save(tmp_path / "t.safetensors"))


def _instances(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


@needs_lm_eval
def test_dense_scores_are_those_of_a_full_forward(eng):
    from sparsedecode.integrations.lm_eval import SparseLM

    lm = SparseLM(engine=eng)
    pairs = [("The capital of France is", " Paris"), ("The capital of France is", " a city in Europe"),
             ("2 + 2 =", " 4"), ("", "Hello world")]
    got = lm.loglikelihood(_instances("loglikelihood", pairs), disable_tqdm=True)
    for (ctx, cont), (lp, greedy) in zip(pairs, got, strict=True):
        c, x = ([lm.prefix_token_id], lm.tok_encode(cont)) if not ctx else lm._encode_pair(ctx, cont)
        want, want_greedy = _reference(eng, c, x)
        assert lp == pytest.approx(want, rel=1e-4, abs=1e-3), (ctx, cont)
        assert greedy == want_greedy
    assert got[0][0] > got[1][0]  # ' Paris' is likelier than a whole phrase
    # greediness on token ids: the argmax token is greedy, the runner-up is not
    ctx = lm.tok_encode("The capital of France is")
    top2 = eng.forward_logits(ctx)[-1].topk(2).indices.tolist()
    (lp1, g1), (lp2, g2) = lm._loglikelihood_tokens([(None, ctx, [top2[0]]), (None, ctx, [top2[1]])],
                                                     disable_tqdm=True)
    assert (g1, g2) == (True, False) and lp1 > lp2
    # a whole document, scored from the prefix token
    doc = "Paris is the capital and most populous city of France, on the Seine."
    (rolled,) = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(doc,)]), disable_tqdm=True)
    assert rolled == pytest.approx(_reference(eng, [lm.prefix_token_id], lm.tok_encode(doc))[0], rel=1e-4)


@needs_lm_eval
def test_projection_runs_the_final_position_sparse_and_the_context_dense(eng, tmp_path):
    """A one-token continuation: the context but its last token prefilled dense, the last
    position under the thresholds. The reference masks that one position in a dense engine
    (projection.calibrate.masks, the masked reference of the sparse GEMV)."""
    from sparsedecode.integrations.lm_eval import SparseLM
    from sparsedecode.projection.calibrate import masks

    path = _thresholds(eng, tmp_path)
    ctx = eng.tokenizer("The quick brown fox jumps over the lazy", add_special_tokens=False)["input_ids"]
    target = eng.tokenizer(" dog", add_special_tokens=False)["input_ids"]
    assert len(target) == 1
    eng.reset()
    eng.prefill(ctx[:-1])
    with masks(eng.model, Thresholds.load(path).values):
        logits = eng.prefill(ctx[-1:], start=len(ctx) - 1)  # (V,): the final position, masked
    want = float(torch.log_softmax(logits.double(), -1)[target[0]])
    dense = _reference(eng, ctx, target)[0]

    lm = SparseLM(engine=eng, thresholds=path)
    assert lm.config.mode == "proj" and lm.get_model_info()["sparsedecode"]["projection"]["keep"] == 0.5
    (lp, _), = lm._loglikelihood_tokens([(None, ctx, target)], disable_tqdm=True)
    assert lp == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert abs(lp - dense) > 1e-3  # the thresholds matter at this position


@needs_lm_eval
def test_kv_selection_after_the_prefill_and_its_fallback(eng, wikitext_test):
    from sparsedecode.integrations.lm_eval import SparseLM

    ids = eng.tokenizer(wikitext_test[:2000], add_special_tokens=False)["input_ids"]
    long_ctx, cont = ids[:200], ids[200:203]  # the next three tokens of the text
    short_ctx = long_ctx[:20]
    lm = SparseLM(engine=eng, kv="window", kv_keep=0.5, obs=16)
    (short, _), = lm._loglikelihood_tokens([(None, short_ctx, cont)], disable_tqdm=True)
    assert lm.kv_dense_fallbacks == 1 and eng.kv is None  # 20 tokens cannot hold sinks + window
    assert short == pytest.approx(_reference(eng, short_ctx, cont)[0], rel=1e-4, abs=1e-3)
    (sel, _), = lm._loglikelihood_tokens([(None, long_ctx, cont)], disable_tqdm=True)
    assert lm.kv_dense_fallbacks == 1 and eng.kv is not None
    assert eng.kv.n == 199 and eng.kv.budget < 199 // 2 + 1  # selected after the dense prefill
    assert abs(sel - _reference(eng, long_ctx, cont)[0]) > 1e-4  # the window drops what matters
    assert lm.get_model_info()["sparsedecode"]["kv_dense_fallbacks"] == 1


@needs_lm_eval
def test_generation_stops_at_the_first_until_string(eng):
    from sparsedecode.integrations.lm_eval import SparseLM

    prompt = "Once upon a time, in a small village,"
    ref = eng.generate(eng.tokenizer(prompt, add_special_tokens=False)["input_ids"], max_new_tokens=12).text
    stop = ref[len(ref) // 2 : len(ref) // 2 + 3]
    assert stop and ref.find(stop) > 0
    lm = SparseLM(engine=eng)
    reqs = [(prompt, {"until": [stop, "never there"], "max_gen_toks": 12}), (prompt, {"until": "@@", "max_gen_toks": 12})]
    cut, full = lm.generate_until(_instances("generate_until", reqs), disable_tqdm=True)
    assert cut == ref[: ref.find(stop)]
    assert full == ref


@needs_lm_eval
def test_generation_configures_the_kv_branch_per_request_and_keeps_the_projection(eng, tmp_path, wikitext_test):
    """generate_until under thresholds and a window: a long prompt generates as the engine does
    under the whole configuration, a prompt too short for the window falls back to the whole
    cache, and between requests the projection modules stay the ones installed (no re-layout)."""
    from sparsedecode.integrations.lm_eval import SparseLM

    lm = SparseLM(engine=eng, thresholds=_thresholds(eng, tmp_path), kv="window", kv_keep=0.5, obs=16)
    th, mods = eng.thresholds, [layer.mlp.up_proj for layer in eng.model.layers]
    assert eng.config == lm.config.with_(kv=None) and lm.config.mode == "proj+window"
    prompt = wikitext_test[:1000]
    reqs = [(prompt, {"until": "@@", "max_gen_toks": 4}), ("Once upon a time,", {"until": "@@", "max_gen_toks": 4})]
    long, short = lm.generate_until(_instances("generate_until", reqs), disable_tqdm=True)
    assert lm.kv_dense_fallbacks == 1 and eng.kv is None  # the short prompt read its whole cache
    assert eng.config == lm.config.with_(kv=None) and eng.thresholds is th
    assert all(a is b for a, b in zip(mods, [layer.mlp.up_proj for layer in eng.model.layers], strict=True))
    eng.configure(lm.config, thresholds=th)
    assert long == eng.generate(lm.tok_encode(prompt), max_new_tokens=4).text and eng.kv is not None
    eng.configure(lm.config.with_(kv=None), thresholds=th)
    assert short == eng.generate(lm.tok_encode("Once upon a time,"), max_new_tokens=4).text


TASK = """
task: sd_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten"], "answer": 1},
    {"question": "What color is the sky on a clear day?", "choices": ["green", "red", "blue"], "answer": 2},
    {"question": "Which animal barks?", "choices": ["cat", "dog", "fish"], "answer": 1},
]


@needs_lm_eval
def test_a_local_task_through_the_harness_under_the_registered_name(eng, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    from sparsedecode.integrations.lm_eval import SparseLM

    assert get_model("sparsedecode") is SparseLM
    assert get_model("hf").__name__ == "HFLM"  # lm_eval's own models are still found
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps(d) for d in DOCS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "sd_tiny_mc.yaml").write_text(TASK.format(docs=docs))
    path = _thresholds(eng, tmp_path, 0.1)
    loads = []
    monkeypatch.setattr(sparsedecode, "load", lambda ref, **kw: (loads.append((ref, kw)), eng)[1])
    res = lm_eval.simple_evaluate(model="sparsedecode", model_args=f"model=smollm2-135m,thresholds={path}",
                                  tasks=["sd_tiny_mc"], device="cpu",
                                  task_manager=TaskManager(include_path=str(tmp_path / "tasks"),
                                                           include_defaults=False))
    assert loads == [("smollm2-135m", {"device": "cpu", "dtype": "auto", "max_len": None, "quiet": True})]
    acc = res["results"]["sd_tiny_mc"]["acc,none"]
    assert res["config"]["sparsedecode"]["mode"] == "proj"
    # the harness's accuracy is the argmax of our own scores of the choices
    lm = SparseLM(engine=eng, thresholds=path)
    right = 0
    for d in DOCS:
        pairs = [(f"Question: {d['question']}\nAnswer:", f" {c}") for c in d["choices"]]
        scores = [lp for lp, _ in lm.loglikelihood(_instances("loglikelihood", pairs), disable_tqdm=True)]
        right += scores.index(max(scores)) == d["answer"]
    assert acc == right / len(DOCS)


def _routing_table(eng, tmp_path, name: str, unseen: str) -> str:
    """A calibrated table for eng's tokenizer with no scored ids: every token routes `unseen`."""
    from sparsedecode.projection.routing import RoutingTable, tokenizer_fingerprint

    V = eng.dims.vocab
    table = RoutingTable(scores=torch.full((V,), float("nan")), count=torch.zeros(V, dtype=torch.long),
                         model=eng.name, vocab=V, tokenizer=tokenizer_fingerprint(eng.tokenizer),
                         thresholds={"method": "cats", "keep": 0.5}, text={"source": "none"}, unseen=unseen,
                         tau=0.0, target=1.0 if unseen == "sparse" else 0.0)
    return str(table.save(tmp_path / f"{name}.safetensors"))


@needs_lm_eval
def test_routing_sends_each_scored_position_dense_or_sparse_by_its_token(eng, tmp_path):
    """routing=FILE with CATS thresholds: a table routing every token sparse scores as the
    CATS engine does, one routing every token dense as the dense model does."""
    from sparsedecode.errors import InputError
    from sparsedecode.integrations.lm_eval import SparseLM

    cats = Thresholds(values={f"layers.{i}.act": 0.05 for i in range(eng.dims.n_layers)}, method="cats",
                      keep=0.5, model=eng.name, dims=eng.dims.to_dict(), keep_metric="act_keep")
    path = str(cats.save(tmp_path / "cats.safetensors"))
    ctx = eng.tokenizer("The quick brown fox jumps over the lazy", add_special_tokens=False)["input_ids"]
    target = eng.tokenizer(" dog", add_special_tokens=False)["input_ids"]
    dense = _reference(eng, ctx, target)[0]
    (sparse, _), = SparseLM(engine=eng, thresholds=path)._loglikelihood_tokens([(None, ctx, target)],
                                                                               disable_tqdm=True)
    assert abs(sparse - dense) > 1e-3  # the CATS thresholds matter at this position
    for unseen, want in (("sparse", sparse), ("dense", dense)):
        lm = SparseLM(engine=eng, thresholds=path, routing=_routing_table(eng, tmp_path, unseen, unseen))
        (lp, _), = lm._loglikelihood_tokens([(None, ctx, target)], disable_tqdm=True)
        assert lp == pytest.approx(want, rel=1e-5, abs=1e-5), unseen
        info = lm.get_model_info()["sparsedecode"]["routing"]
        assert info["decode_steps_sparse"] == (1.0 if unseen == "sparse" else 0.0) and info["tau"] == 0.0
    with pytest.raises(InputError, match="give thresholds=FILE"):
        SparseLM(engine=eng, routing=_routing_table(eng, tmp_path, "s", "sparse"))
