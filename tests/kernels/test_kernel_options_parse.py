"""Kernel options as data: parsed from --kernels, refused when wrong, recorded whole."""

from __future__ import annotations

import dataclasses

import pytest

from sparsedecode.errors import InputError
from sparsedecode.kernels.options import AttentionOptions, GemvOptions, KernelOptions


def test_parse_sets_only_what_it_names_and_round_trips_through_a_record():
    k = KernelOptions.parse("gemv.pdl=false, attention.min_split_keys=none")
    assert k.gemv == GemvOptions(pdl=False) and k.attention == AttentionOptions(min_split_keys=None)
    assert KernelOptions.from_dict(k.to_dict()) == k and KernelOptions.from_dict(None) == KernelOptions()
    assert k.changed() == {"gemv.pdl": False, "attention.min_split_keys": None}
    assert KernelOptions.parse(k.label()) == k and KernelOptions().label() == "default"
    assert KernelOptions.parse("", base=k) == k
    lp = KernelOptions.parse("lora.merge=false,gemv.lora_programs_per_sm=8")
    assert lp.gemv.lora_programs_per_sm == 8 and KernelOptions.from_dict(lp.to_dict()) == lp
    assert KernelOptions.parse("gemv.lora_programs_per_sm=none").gemv == GemvOptions()
    pf = KernelOptions.parse("lora.merge=false,gemv.lora_prefetch=false")
    assert pf.gemv == GemvOptions(lora_prefetch=False) and KernelOptions.from_dict(pf.to_dict()) == pf


@pytest.mark.parametrize("text,match", [
    ("gemv.pdl=1", "write true or false"),
    ("gemv.programs_per_sm=many", "write an integer"),
    ("gemv.programs_per_sm=none", "write an integer$"),
    ("attention.programs_per_sm=0", ">= 1"),
    ("gemv.lora_programs_per_sm=0", "gemv.lora_programs_per_sm.*>= 1"),
    ("gemv.lora_prefetch=2", "write true or false"),
    ("gemv.stages=8", "unknown kernel option 'gemv.stages'"),
    ("pdl=false", "unknown kernel option 'pdl'"),
    ("gemv.pdl", "write KEY=VALUE"),
])
def test_a_wrong_option_is_refused_with_the_fix(text, match):
    with pytest.raises(InputError, match=match):
        KernelOptions.parse(text)


def test_options_are_frozen_and_checked_when_built():
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelOptions().gemv.pdl = False  # type: ignore[misc]
    with pytest.raises(InputError, match="gemv.pdl must be true or false"):
        GemvOptions(pdl="yes")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="gemv.lora_prefetch must be true or false"):
        GemvOptions(lora_prefetch=None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="unknown kernel option group"):
        KernelOptions.from_dict({"gemv": {}, "norms": {}})
    with pytest.raises(InputError, match="takes a GemvOptions"):
        KernelOptions(gemv=AttentionOptions())  # type: ignore[arg-type]
