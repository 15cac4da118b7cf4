"""Sliding-window attention in the byte account (issue 48): a layer with a window of w tokens
reads min(n, w) cached tokens, so the KV bytes of a layer are capped at its window, and the
crossover is 'never' when every layer slides and the window is below the crossing. Impossible
dims (zero or negative heads, layers, widths, windows) are refused, never defaulted."""

import json

import pytest

from conftest import run_cli
from sparsedecode.account import (
    ModelDims,
    bounds,
    crossover,
    crossover_batched,
    crossover_fixed_budget,
    step_bytes,
)
from sparsedecode.account.traffic import kv_saving
from sparsedecode.errors import InputError

MISTRAL_V01 = {  # mistralai/Mistral-7B-v0.1 config.json: every layer attends to the last 4096 tokens
    "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
    "sliding_window": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}


def full(cfg: dict) -> dict:
    return {**cfg, "sliding_window": None}


def test_mistral_v01_reads_its_window_only():
    d, f = ModelDims.from_config(MISTRAL_V01), ModelDims.from_config(full(MISTRAL_V01))
    assert d.windows == (4096,) * 32 and f.windows == ()
    per_token = 32 * f.kv_elems_per_token * 2
    assert step_bytes(d, 2048).kv == step_bytes(f, 2048).kv == 2048 * per_token  # inside the window: the same
    assert step_bytes(d, 100_000).kv == 4096 * per_token  # beyond it: capped at the window
    assert step_bytes(f, 100_000).kv == 100_000 * per_token
    assert kv_saving(d, 100_000, 0.3) == pytest.approx(0.7 * 4096 * per_token)
    # the KV bound stops growing at the window
    assert bounds(d, 100_000, 0.5, 0.3).kv == pytest.approx(bounds(d, 4096, 0.5, 0.3).kv)
    assert bounds(f, 100_000, 0.5, 0.3).kv > bounds(f, 4096, 0.5, 0.3).kv


def test_the_crossover_is_never_when_every_layer_slides_below_it():
    d, f = ModelDims.from_config(MISTRAL_V01), ModelDims.from_config(full(MISTRAL_V01))
    assert crossover(f, 0.5, 0.3) == pytest.approx(76_068.57, abs=0.01)  # far beyond the 4096 window
    assert crossover(d, 0.5, 0.3) == float("inf")
    assert crossover(d, 0.99, 0.3) == crossover(f, 0.99, 0.3) < 4096  # below the window: unchanged
    assert crossover_fixed_budget(d, 0.5, 1024) == float("inf")
    assert crossover_batched(d, 0.5, 0.3, 32) == pytest.approx(crossover(f, 0.5, 0.3) / 32)  # 2377 < 4096
    assert crossover_batched(d, 0.5, 0.3, 8) == float("inf")


def small(**kw) -> dict:
    return {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, **kw}


def test_per_layer_windows_cap_each_layer():
    types = ["sliding_attention", "full_attention"] * 2
    d = ModelDims.from_config(small(sliding_window=100, layer_types=types))
    assert d.windows == (100, 0, 100, 0)
    assert d.kv_tokens(50) == 200 and d.kv_tokens(1000) == 100 + 1000 + 100 + 1000
    f = ModelDims.from_config(small())
    n_full = crossover(f, 0.5, 0.5)
    # two layers read n, two read min(n, 100): 2 n + 200 = 4 n_full when n_full > 100
    assert n_full > 100 and crossover(d, 0.5, 0.5) == pytest.approx(2 * n_full - 100)
    assert step_bytes(d, 1000).kv == d.kv_tokens(1000) * d.kv_elems_per_token * 2
    # a per-layer list in sliding_window itself (null: full attention)
    assert ModelDims.from_config(small(sliding_window=[100, None, 50, None])).windows == (100, 0, 50, 0)
    # Gemma 2 alternates (even layers slide), Gemma 3 slides five layers of six
    assert ModelDims.from_config(small(model_type="gemma2", sliding_window=64)).windows == (64, 0, 64, 0)
    g3 = ModelDims.from_config(small(model_type="gemma3_text", num_hidden_layers=6, sliding_window=512))
    assert g3.windows == (512,) * 5 + (0,)
    # Qwen2 slides from max_window_layers on, and only with use_sliding_window
    q = small(model_type="qwen2", sliding_window=32, max_window_layers=2)
    assert ModelDims.from_config(q).windows == ()
    assert ModelDims.from_config({**q, "use_sliding_window": True}).windows == (0, 0, 32, 32)


def test_dims_with_windows_round_trip_through_json():
    d = ModelDims.from_config(small(sliding_window=100, layer_types=["sliding_attention", "full_attention"] * 2))
    back = ModelDims(**json.loads(json.dumps(d.to_dict())))
    assert back == d and back.windows == (100, 0, 100, 0)


@pytest.mark.parametrize("fields, words", [
    ({"num_key_value_heads": 0}, "num_key_value_heads' is 0"),
    ({"num_key_value_heads": -8}, "num_key_value_heads' is -8"),
    ({"num_hidden_layers": 0}, "num_hidden_layers' is 0"),
    ({"num_hidden_layers": -1}, "num_hidden_layers' is -1"),
    ({"head_dim": 0}, "head_dim' is 0"),
    ({"hidden_size": -64}, "hidden_size' is -64"),
    ({"vocab_size": 0}, "vocab_size' is 0"),
    ({"intermediate_size": 0}, "intermediate_size' is 0"),
    ({"num_attention_heads": True}, "num_attention_heads' is True"),
    ({"sliding_window": 0}, "sliding_window' is 0"),
    ({"sliding_window": -4096}, "sliding_window' is -4096"),
    ({"sliding_window": True}, "sliding_window' is True"),
    ({"sliding_window": 4096.5}, "sliding_window' is 4096.5"),
    ({"sliding_window": [100, None]}, "lists 2 windows and the model has 4 layers"),
    ({"sliding_window": [100, 0, None, None]}, "sliding_window[1]' is 0"),
    ({"sliding_window": 10, "layer_types": ["sliding_attention"]}, "'layer_types' must list"),
    ({"sliding_window": 10, "layer_types": ["local"] * 4}, "'layer_types' must list"),
    ({"layer_types": ["sliding_attention"] * 4}, "'sliding_window' is missing"),
])
def test_impossible_dims_are_refused_never_defaulted(fields, words):
    with pytest.raises(InputError) as e:
        ModelDims.from_config(small(**fields))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_model_dims_refuse_bad_windows():
    base = ModelDims.from_config(small()).to_dict()
    for windows, words in (([1, 2], "lists 2 layers"), ([0, -1, 0, 0], "windows[1]"), ([0, True, 0, 0], "windows[1]"),
                           ("4096", "a list of one window per layer")):
        with pytest.raises(InputError, match=words.replace("[", r"\[")):
            ModelDims(**{**base, "windows": windows})
    assert ModelDims(**{**base, "windows": [0, 0, 0, 0]}).windows == ()  # no layer slides


def test_the_account_command_says_never_for_a_sliding_model(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(MISTRAL_V01))
    r = run_cli(capsys, "account", "--config", str(cfg), "--proj-keep", "0.5", "--kv-keep", "0.3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["crossover_tokens"] is None and out["dims"]["windows"] == [4096] * 32
    r = run_cli(capsys, "account", "--config", str(cfg), "--proj-keep", "0.5", "--kv-keep", "0.3")
    assert r.returncode == 0 and "never" in r.stdout
    cfg.write_text(json.dumps({**MISTRAL_V01, "num_key_value_heads": 0}))
    r = run_cli(capsys, "account", "--config", str(cfg))
    assert r.returncode == 2 and "num_key_value_heads' is 0" in r.stderr and "Traceback" not in r.stderr


def test_latency_crossing_solves_the_gap_over_the_windows():
    """§4.3's n_lat with sliding windows: the byte-time gap grows only through the layers whose
    window is not full, so n_lat is where the exact gap pays c_P - c_KV (checked by pricing the
    gap at the answer), not n* minus a constant slope; without windows the two agree."""
    from sparsedecode.account import latency_crossing
    from sparsedecode.account.traffic import projection_saving

    half = {**MISTRAL_V01, "sliding_window": [2048 if i % 2 else None for i in range(32)]}
    d, f = ModelDims.from_config(half), ModelDims.from_config(full(MISTRAL_V01))
    bw, c_p, c_kv = 3000.0, 0.30, 0.05  # GB/s, ms

    def gap_ms(dims, n):  # the projection mode's step minus the KV mode's step, in ms
        return ((kv_saving(dims, n, 0.3) - projection_saving(dims, 0.5)) / (bw * 1e9)) * 1e3 + c_p - c_kv

    n_full = latency_crossing(f, 0.5, 0.3, c_p, c_kv, bw)
    assert gap_ms(f, n_full) == pytest.approx(0, abs=1e-9)
    n_half = latency_crossing(d, 0.5, 0.3, c_p, c_kv, bw)
    # past 2048 only the 16 full layers grow the gap: the cost moves the crossing twice as far
    assert n_half == pytest.approx(crossover(d, 0.5, 0.3) - 2 * (crossover(f, 0.5, 0.3) - n_full))
    assert gap_ms(d, n_half) == pytest.approx(0, abs=1e-9)
    assert 2048 < n_half < crossover(d, 0.5, 0.3)


def test_the_engine_prices_its_model_with_the_windows_of_its_config():
    """An engine's dims (ModelArgs.dims, what its records and gate price) keep the config's
    windows, as the account's ModelDims.from_config reads them."""
    from sparsedecode.models.args import ModelArgs

    assert ModelArgs.from_config(MISTRAL_V01).dims() == ModelDims.from_config(MISTRAL_V01)
    assert ModelArgs.from_config(MISTRAL_V01).dims().windows == (4096,) * 32
