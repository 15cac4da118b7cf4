"""The dispatch page's tables (docs/dispatch.md) are the output of the commands it names: rebuilt here from the
same records, a table that drifted from them fails."""

from pathlib import Path

import pytest
from _tables import paper

from sparsedecode.cli import main

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "benchmarks/records/h200/campaigns/h200_sweep"
WARM = ROOT / "benchmarks/records/h200/kv_select/kv_select_20261130/kv_select_snapkv0.3_32768.json"


@pytest.mark.parametrize("args", [
    lambda: [str(paper("sweep_a100")), "--select-seconds", "0.24"],
    lambda: [str(paper("sweep_a6000")), "--select-seconds", "0.32"],
    lambda: [str(H200), "--select-record", str(WARM), "--assume-admissible"],
    lambda: [str(H200), "--assume-admissible"],
], ids=["a100", "a6000", "h200-warm-select", "h200-cell-select"])
def test_readme_shows_what_the_command_prints(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["dispatch", "price", *args(), "--markdown"])
    assert exc.value.code in (0, None)
    table = capsys.readouterr().out.strip()
    assert table.startswith("| policy |") and table in (ROOT / "docs/dispatch.md").read_text(encoding="utf-8")
