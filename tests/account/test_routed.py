"""The byte account of token routing (SATS §3.2): effective keep r*k + (1 - r), the bound
at that keep, and bad --routed values refused with one line."""

import json

import pytest

from sparsedecode import account as acc
from sparsedecode.cli import main
from sparsedecode.errors import InputError


def test_effective_keep_is_the_mean_step():
    assert acc.routed_keep(0.5, 0.5) == pytest.approx(0.75)
    assert acc.routed_keep(0.3, 0.25) == pytest.approx(0.25 * 0.3 + 0.75)
    assert acc.routed_keep(0.4, 0.0) == 1.0  # all dense
    assert acc.routed_keep(0.4, 1.0) == pytest.approx(0.4)  # all sparse: the static keep
    # bytes are linear in the keep: the mean of the two paths' step bytes is the bytes at k_eff
    dims = acc.ModelDims.known("llama-3.1-8b")
    n, r, k = 8192, 0.6, 0.5
    total = acc.step_bytes(dims, n).total
    sparse_step = total - acc.projection_saving(dims, k, ff_only=True)
    mean = r * sparse_step + (1 - r) * total
    assert total / mean == pytest.approx(acc.bounds(dims, n, acc.routed_keep(k, r), 0.3, True).projection)


@pytest.mark.parametrize("bad", ["-0.1", "1.5", "x", "nan"])
def test_bad_routed_values_are_refused(bad):
    with pytest.raises(InputError, match="routed"):
        acc.check_routed(bad)


def _cli(capsys, *args):
    try:
        main(["account", "--model", "llama-3.1-8b", *args])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_reports_effective_keep_and_bound(capsys):
    code, out, err = _cli(capsys, "--proj-keep", "0.5", "--routed", "0.5", "--ff-only", "--context", "8K", "--json")
    assert code == 0, err
    got = json.loads(out)
    rt = got["routing"]
    assert rt["routed"] == 0.5 and rt["sparse_keep"] == 0.5 and got["rp"] == 0.5
    assert rt["effective_keep"] == pytest.approx(0.75)
    dims = acc.ModelDims.known("llama-3.1-8b")
    assert rt["bound"] == pytest.approx(acc.bounds(dims, 8192, 0.75, 0.3, True).projection)
    assert rt["static_bound"] == pytest.approx(acc.bounds(dims, 8192, 0.5, 0.3, True).projection)
    assert 1.0 < rt["bound"] < rt["static_bound"]
    # the rest of the account follows the mean step
    assert got["bounds"]["projection"] == pytest.approx(rt["bound"])
    assert got["crossover_exact"] == pytest.approx(acc.crossover(dims, 0.75, 0.3, True))
    code, out, err = _cli(capsys, "--proj-keep", "0.5", "--routed", "0.25")
    assert code == 0 and "effective keep 0.875" in " ".join(out.split())


@pytest.mark.parametrize("bad", ["1.5", "-1", "half"])
def test_cli_refuses_bad_routed_with_one_line(capsys, bad):
    code, out, err = _cli(capsys, "--routed", bad)
    assert code == 2 and out == ""
    assert err.startswith("error: --routed") and err.count("\n") == 1 and "[0, 1]" in err
