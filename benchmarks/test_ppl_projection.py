"""The chunked-perplexity table of ppl_projection.py (beside this file), rebuilt from records alone."""

from ppl_projection import load_ppl_records, ppl_table

from sparsedecode.quality.perplexity import pooled_ppl
from sparsedecode.records import stamp, write_record


def test_table_from_records(tmp_path):
    text = {"file": "x", "chunks": 2}
    for label, method, nll in (("dense", "dense", [2048.0, 2048.0]), ("teal 0.5", "teal", [3072.0, 3072.0])):
        write_record(tmp_path / f"{label}.json", stamp({
            "kind": "ppl_chunked", "label": label, "config": {"method": method}, "text": text,
            "nll_per_chunk": nll, "targets_per_chunk": 1024, "realized_keep": None if method == "dense" else 0.5,
            "runtime": "masked reference (CPU)"}, with_torch=False))
    table = ppl_table(load_ppl_records(tmp_path))
    lines = table.splitlines()
    assert lines[2].startswith("| dense |") and f"{pooled_ppl([2048.0, 2048.0]):.3f}" in lines[2]
    assert "| teal 0.5 | 0.500 |" in lines[3] and f"{pooled_ppl([3072.0] * 2) - pooled_ppl([2048.0] * 2):+.3f}" in lines[3]
