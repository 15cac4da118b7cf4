"""sparsedecode.validate: one line naming the file, the field, the value and what is expected."""

import math

import pytest

from sparsedecode.errors import InputError
from sparsedecode.validate import (
    require_bool,
    require_field,
    require_increasing,
    require_number,
    require_str,
)


@pytest.mark.parametrize("bad", [True, False, None, "3", math.nan, math.inf, -math.inf, [1], {"a": 1}])
def test_number_refuses_what_is_not_a_number(bad):
    with pytest.raises(InputError) as e:
        require_number(bad, "ms", lo=0, where="gate.json")
    msg = str(e.value)
    assert msg.startswith("gate.json: field 'ms' is ") and "expected a finite number >= 0" in msg
    assert "\n" not in msg


def test_number_range_and_integers():
    assert require_number(5, "n", lo=1, hi=10, integer=True) == 5
    assert require_number(0.5, "keep", lo=0, hi=1) == 0.5
    with pytest.raises(InputError, match=r"t.jsonl line 2: field 'prompt_tokens' is 9223372036854775808, "
                                         r"expected a whole number from 1 to 16777216"):
        require_number(2**63, "prompt_tokens", lo=1, hi=2**24, integer=True, where="t.jsonl line 2")
    with pytest.raises(InputError, match="is 2.5, expected a whole number"):
        require_number(2.5, "n", integer=True)
    with pytest.raises(InputError, match="is 0, expected a finite number > 0"):
        require_number(0, "ms", lo=0, above=True)
    with pytest.raises(InputError, match="is -1, expected a whole number >= 0"):
        require_number(-1, "sinks", lo=0, integer=True)


def test_null_is_shown_as_json_and_long_values_are_cut():
    with pytest.raises(InputError, match="field 'model' is null, expected a non-empty string"):
        require_str(None, "model")
    with pytest.raises(InputError) as e:
        require_str("x" * 500, "kind", choices=("gate_table",))
    assert len(str(e.value)) < 150 and "..." in str(e.value)


def test_bool_str_field_increasing():
    assert require_bool(False, "admitted") is False
    with pytest.raises(InputError, match="is \"false\", expected true or false"):
        require_bool("false", "admitted")
    with pytest.raises(InputError, match="field 'dims.vocab' is missing"):
        require_field({}, "vocab", where="g.json", prefix="dims.")
    with pytest.raises(InputError, match="field 'dims.vocab' is null"):
        require_field({"vocab": None}, "vocab", where="g.json", prefix="dims.")
    assert require_increasing([1, 2, 3], "contexts") == [1, 2, 3]
    with pytest.raises(InputError, match="field 'contexts' must increase, but 2 follows 2"):
        require_increasing([1, 2, 2], "contexts", where="g.json")
