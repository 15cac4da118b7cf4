"""`kernels.override` and `kernels.knobs`: benchmark flags set module knobs only when given; a
variant's knobs are restored after it."""

from __future__ import annotations

import pytest

from sparsedecode.errors import InputError
from sparsedecode.kernels import decode_attention, knobs, override
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


def test_knobs_are_restored_after_the_block_even_on_error(monkeypatch):
    monkeypatch.setattr(sg, "ABLATE", 0)
    monkeypatch.setattr(sg, "BF16_PAIRS", True)
    with knobs(sg, ABLATE=3, BF16_PAIRS=None) as got:
        assert got == {"ABLATE": 3, "BF16_PAIRS": True} and sg.ABLATE == 3
    assert sg.ABLATE == 0
    with pytest.raises(RuntimeError, match="inside"), knobs(sg, ABLATE=2, BF16_PAIRS=False):
        raise RuntimeError("inside")
    assert sg.ABLATE == 0 and sg.BF16_PAIRS is True
    with pytest.raises(InputError, match="has no knob ABLATES$"), knobs(sg, ABLATE=1, ABLATES=1):
        pass
    assert sg.ABLATE == 0
