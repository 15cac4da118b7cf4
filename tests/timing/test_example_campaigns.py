"""Every campaign file under examples/campaigns/ parses and plans: a typo there would only show on
the GPU machine, in a lease."""

from pathlib import Path

import pytest

from sparsedecode.config import SparsityConfig
from sparsedecode.timing.campaign import check_cells, load_spec, plan

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "campaigns").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_campaign_plans(path):
    spec = load_spec(path)
    cells = plan(spec)
    check_cells(cells)
    assert cells and spec.name == path.stem
    modes = {c.mode for c in cells}
    # every campaign pairs its cells with dense ones, but a crossing campaign pairs proj with sel
    assert "dense" in modes or sorted(SparsityConfig.parse(m).kind for m in modes) == ["proj", "sel"], modes
