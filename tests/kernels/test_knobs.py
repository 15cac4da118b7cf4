"""`kernels.override`: benchmark flags set module knobs only when given."""

from __future__ import annotations

import pytest

from sparsedecode.errors import InputError
from sparsedecode.kernels import decode_attention, override
from sparsedecode.kernels import sparse_gemv as sg


def test_a_flag_left_out_keeps_the_module_default(monkeypatch):
    monkeypatch.setattr(decode_attention, "MIN_SPLIT_KEYS", 128)
    monkeypatch.setattr(sg, "BF16_PAIRS", True)
    assert override(decode_attention, MIN_SPLIT_KEYS=None) == {"MIN_SPLIT_KEYS": 128}
    assert decode_attention.MIN_SPLIT_KEYS == 128
    # False is a value, not "left out"
    assert override(sg, BF16_PAIRS=False, REGISTER_CAP=None) == {"BF16_PAIRS": False, "REGISTER_CAP": sg.REGISTER_CAP}
    assert sg.BF16_PAIRS is False
    assert override(decode_attention, MIN_SPLIT_KEYS=256) == {"MIN_SPLIT_KEYS": 256}
    assert decode_attention.MIN_SPLIT_KEYS == 256


def test_a_misspelt_knob_is_refused(monkeypatch):
    monkeypatch.setattr(sg, "BF16_PAIRS", True)
    with pytest.raises(InputError, match="has no knob BF16_PAIR$"):
        override(sg, BF16_PAIRS=False, BF16_PAIR=False)
    assert sg.BF16_PAIRS is True  # nothing set when any name is wrong
