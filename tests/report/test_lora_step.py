"""The LoRA step table (report/lora_step.py, issue 45): a real tiny CPU campaign times dense and
TEAL 0.5 without an adapter and with a random one apart; the table pairs them, prices the adapter's
bytes from its rank, targets and the realized keep, and leaves the ceiling columns blank on CPU
(no measured ceiling). A campaign without the apart cells is refused."""

from __future__ import annotations

import json

import pytest

from sparsedecode.account.dims import ModelDims
from sparsedecode.errors import InputError
from sparsedecode.report import lora_step
from sparsedecode.timing.campaign import run_campaign

TINY = dict(model_type="llama", hidden_size=96, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, vocab_size=100, max_position_embeddings=512,
            rope_theta=10000.0, eos_token_id=None)
GRIDS = ('[[grid]]\ngroup = "base"\ncontexts = [64]\nmodes = ["dense", "proj0.5"]\n'
         '[[grid]]\ngroup = "lora"\ncontexts = [64]\nmodes = ["dense", "proj0.5"]\n'
         'adapter = "random:r4:all"\nvariants = ["lora.merge=false"]\n')


@pytest.fixture(scope="module")
def campaign_folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_step")
    (tmp / "config.json").write_text(json.dumps(TINY))
    spec = tmp / "spec.toml"
    spec.write_text(f'name = "lora_tiny"\nmodel = "{tmp / "config.json"}"\ninit = "random"\ndtype = "float32"\n'
                    'device = "cpu"\nblocks = 1\nrepeats = 2\nsteps = 3\nwarmup = 2\ncalib_tokens = 256\n'
                    + GRIDS)
    out = tmp / "run"
    s = run_campaign(spec, out, progress=False, echo=lambda line: None)
    assert (s.ok, s.failed) == (4, 0), s
    return out


def test_the_table_pairs_apart_with_no_adapter(campaign_folder):
    data = lora_step.load(campaign_folder)
    assert data["ceiling_gbps"] is None and data["cpu"]  # CPU: no measured ceiling, columns blank
    got = {r["cell"]: r for r in lora_step.rows(data)}
    assert sorted(got) == ["dense", "proj50"]
    for r in got.values():
        assert set(r["ms"]) == {"none", "apart"} and r["bytes_us"] is None and r["ratio"] is None
        assert r["extra_us"] == pytest.approx((r["ms"]["apart"] - r["ms"]["none"]) * 1e3)
        want = lora_step.adapter_bytes(data["dims"], {"rank": 4, "targets": "all"}, r["keep"], "float32") / 1e6
        assert r["adapter_mb"] == pytest.approx(want)
    assert got["dense"]["keep"] == 1.0 and 0.3 < got["proj50"]["keep"] < 0.7
    table = lora_step.markdown(data)
    assert table.count("\n") == 4 and "| proj50 | 64 | `lora.merge=false` |" in table


def test_adapter_bytes_are_kept_rows_of_a_and_all_of_b():
    dims = ModelDims(name="m", d=8, d_ff=16, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=4, vocab=10)
    # mlp: gate/up (16, 8) and down (8, 16); r * (keep * in + out) each, bf16, three layers
    per_layer = 2 * (0.5 * 8 + 16) + (0.5 * 16 + 8)
    assert lora_step.adapter_bytes(dims, {"rank": 2, "targets": "mlp"}, 0.5, "bfloat16") == 2 * per_layer * 3 * 2
    # CATS at act keep 0.25: gate whole; up A^T whole, B^T kept rows; down A^T kept rows, B^T whole
    cats = (8 + 16) + (8 + 0.25 * 16) + (0.25 * 16 + 8)
    assert lora_step.adapter_bytes(dims, {"rank": 2, "targets": "mlp"}, 0.9, "bfloat16", 0.25) == 2 * cats * 3 * 2


def test_a_campaign_without_apart_cells_is_refused(campaign_folder, tmp_path):
    import shutil

    folder = tmp_path / "c"
    shutil.copytree(campaign_folder, folder)
    shutil.rmtree(folder / "cells" / "lora.lora.merge-false")
    with pytest.raises(InputError, match="no cells with an adapter apart"):
        lora_step.load(folder)


def _second_apart_group(campaign_folder, tmp_path, kernels):
    """A copy of the campaign with the apart cells again under another group whose spec's
    --kernels is `kernels` (as a grid variant such as gemv.lora_programs_per_sm=8 writes them),
    their steps 1 ms slower."""
    import shutil

    folder = tmp_path / "c"
    shutil.copytree(campaign_folder, folder)
    src, dst = folder / "cells" / "lora.lora.merge-false", folder / "cells" / "cap.lora.merge-false_other"
    shutil.copytree(src, dst)
    for f in dst.glob("*.json"):
        rec = json.loads(f.read_text())
        rec["group"], rec["spec"]["kernels"] = dst.name, kernels
        rec["ms_per_token"] += 1.0
        f.write_text(json.dumps(rec))
    return folder


def test_two_apart_variants_are_two_rows(campaign_folder, tmp_path):
    """The acceptance campaign times the adapter apart at the launcher's splits and at
    gemv.lora_programs_per_sm=8: one row each, the launcher's own first, priced alike."""
    data = lora_step.load(_second_apart_group(campaign_folder, tmp_path, "lora.merge=false,gemv.lora_programs_per_sm=8"))
    got = lora_step.rows(data)
    assert [(r["cell"], r["variant"]) for r in got] == [
        ("dense", "lora.merge=false"), ("dense", "lora.merge=false,gemv.lora_programs_per_sm=8"),
        ("proj50", "lora.merge=false"), ("proj50", "lora.merge=false,gemv.lora_programs_per_sm=8")]
    for own, cap in (got[:2], got[2:]):
        assert cap["ms"]["none"] == own["ms"]["none"] and cap["adapter_mb"] == pytest.approx(own["adapter_mb"])
        assert cap["extra_us"] == pytest.approx(own["extra_us"] + 1e3)
    assert "| proj50 | 64 | `lora.merge=false,gemv.lora_programs_per_sm=8` |" in lora_step.markdown(data)


def test_two_groups_of_the_same_apart_kernels_are_refused(campaign_folder, tmp_path):
    """Two groups timing the same form with the same kernels would pool into one row: refused."""
    with pytest.raises(InputError, match="several groups time one form"):
        lora_step.load(_second_apart_group(campaign_folder, tmp_path, "lora.merge=false"))
