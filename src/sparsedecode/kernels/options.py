"""Kernel options as data: frozen dataclasses owned by the engine and recorded whole.

An engine holds one `KernelOptions` (`sparsedecode.load(..., kernels=...)`,
`Engine.set_kernels`); the sparse projections and the attention layers each hold the part
they launch with, and the custom ops receive it unpacked into plain parameters, so a captured
CUDA graph bakes in exactly the options of the engine that captured it. Only real tuning
parameters live here: a choice that was measured and lost is deleted from the code, with a row
in its kernel's decision log (docs/kernels/<kernel>.md).

`KernelOptions.parse("gemv.pdl=false,attention.min_split_keys=256")` reads the `--kernels` flag.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from sparsedecode.errors import InputError, option


def _positive_int(v, what: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InputError(f"{what} must be an integer >= 1, got {v!r}")


@dataclass(frozen=True)
class GemvOptions:
    """Launch options of the sparse GEMVs (`kernels.sparse_gemv`, `kernels.gather_gemv`).

    pdl: programmatic dependent launch on Hopper and later (each launch may start while the
        kernel before it drains; docs/kernels/sparse_gemv.md). Ignored where the GPU lacks it.
    programs_per_sm: one-warp programs per SM that the default split count aims at, where the
        device's tuned table (kernels/tuned/<device>.json) has no entry for the shape.
    dense: the projections that hold no threshold (every site of a dense step, the attention
        sites of an MLP-only file) run this GEMV reading every row instead of F.linear under
        inductor. None (the default): on wherever the Triton kernel runs and nothing installed
        needs the nn.Linear modules (CATS thresholds, the runtime gate), which an engine
        resolves to true or false and records so (`Engine.kernels`); it won every mode's
        step on the H200 (benchmarks/records/h200/campaigns/h200_dense_gemv). true: asked
        for, refused where it cannot run; false: F.linear.
    lora_programs_per_sm: the same aim for a launch that carries an adapter apart (None: as
        programs_per_sm and the tuned table): fewer programs a SM raise the register cap of the
        one-wave grid, so the adapter's tiles need not spill (docs/kernels/lora_gemv.md, 'register
        cap with an adapter'); the default tiles with its splits, the tuned table not read.
    lora_prefetch: in the two-tiles-in-flight loop, the adapter's A^T rows of the next tile are
        loaded beside the weight's (true) or each tile's at its sum (false: one A^T tile live in
        registers, not two; fewer spills at the launcher's cap, the load's latency exposed;
        docs/kernels/lora_gemv.md, 'A^T tile in flight').
    """

    pdl: bool = True
    programs_per_sm: int = 16
    dense: bool | None = None
    lora_programs_per_sm: int | None = None
    lora_prefetch: bool = True

    def __post_init__(self):
        if not isinstance(self.pdl, bool):
            raise InputError(f"gemv.pdl must be true or false, got {self.pdl!r}")
        if not isinstance(self.lora_prefetch, bool):
            raise InputError(f"gemv.lora_prefetch must be true or false, got {self.lora_prefetch!r}")
        if self.dense is not None and not isinstance(self.dense, bool):
            raise InputError(f"gemv.dense must be true, false or none, got {self.dense!r}")
        _positive_int(self.programs_per_sm, "gemv.programs_per_sm")
        if self.lora_programs_per_sm is not None:
            _positive_int(self.lora_programs_per_sm, "gemv.lora_programs_per_sm")


@dataclass(frozen=True)
class AttentionOptions:
    """Launch options of the split-K decode attention (`kernels.decode_attention`).

    programs_per_sm: programs per SM at full allocation (splits x KV heads / SMs).
    min_split_keys: fewest keys a split covers, so short contexts get fewer, longer splits
        (None: programs_per_sm alone sets the count).
    """

    programs_per_sm: int = 2
    min_split_keys: int | None = 128

    def __post_init__(self):
        _positive_int(self.programs_per_sm, "attention.programs_per_sm")
        if self.min_split_keys is not None:
            _positive_int(self.min_split_keys, "attention.min_split_keys")


@dataclass(frozen=True)
class CpuOptions:
    """Options of the CPU decode step.

    step: run the whole one-token step as one C call (`kernels/cpu_step.c`, `engine.cpu_step`)
        rather than the eager PyTorch step. None (the default): wherever it can run (a CPU engine
        of batch 1, uncompiled, whose sites are the fused GEMVs: the dense step and TEAL's), the
        PyTorch step elsewhere, and `Engine.step_runtime` says which ran and why; an engine
        resolves it to true or false and records so. true: asked for, a step it cannot run is
        refused with the reason; false: the PyTorch step.
    """

    step: bool | None = None

    def __post_init__(self):
        if self.step is not None and not isinstance(self.step, bool):
            raise InputError(f"cpu.step must be true, false or none, got {self.step!r}")


@dataclass(frozen=True)
class LoraOptions:
    """How a LoRA adapter runs (SATS paper §4.2 'Fine-tuning Methods'; docs/kernels/lora_gemv.md).

    merge: add s·B·A into the base weights at load (true, the default): every kernel runs
        unchanged on the fine-tuned weights and the step reads no more bytes than the base.
        false: the factors stay apart and each adapted site adds s·B(A x_m) inside its GEMV
        launch (`kernels.lora_gemv`: A^T read only in kept input rows, the expand in the same
        launch; q|k|v and gate|up in their one fused launch), re-attached after every
        `Engine.configure`. Fixed for an engine's life once an adapter is loaded. A CATS/SATS
        MLP's up adapter: u = A x in one more launch, B read for the kept rows only.
    """

    merge: bool = True

    def __post_init__(self):
        if not isinstance(self.merge, bool):
            raise InputError(f"lora.merge must be true or false, got {self.merge!r}")


@dataclass(frozen=True)
class KernelOptions:
    """Every kernel option of an engine; `to_dict()` is what records store under 'kernels'."""

    gemv: GemvOptions = field(default_factory=GemvOptions)
    attention: AttentionOptions = field(default_factory=AttentionOptions)
    cpu: CpuOptions = field(default_factory=CpuOptions)
    lora: LoraOptions = field(default_factory=LoraOptions)

    def __post_init__(self):
        if not all(isinstance(getattr(self, g), part) for g, part in GROUPS.items()):
            raise InputError("KernelOptions takes a GemvOptions, an AttentionOptions, a CpuOptions and a LoraOptions")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> KernelOptions:
        """The inverse of to_dict; a record's missing part (or None) is the default."""
        d = d or {}
        unknown = sorted(set(d) - set(GROUPS))
        if unknown:
            raise InputError(f"unknown kernel option group(s) {', '.join(unknown)}: the groups are {', '.join(GROUPS)}")
        try:
            return cls(**{g: part(**(d.get(g) or {})) for g, part in GROUPS.items()})
        except TypeError as e:
            raise InputError(f"kernel options {d}: {e}") from None

    def with_(self, **values) -> KernelOptions:
        """A copy with 'group.name' (or group__name) keys set, checked like parse."""
        out = self
        for key, v in values.items():
            group, _, name = key.replace("__", ".").partition(".")
            part = getattr(out, group, None) if group in GROUPS else None
            if part is None or name not in {f.name for f in fields(part)}:
                raise InputError(f"unknown kernel option '{key}'; options are {', '.join(option_names())}")
            out = replace(out, **{group: replace(part, **{name: v})})
        return out

    @classmethod
    def parse(cls, text: str | None, base: KernelOptions | None = None) -> KernelOptions:
        """'gemv.pdl=false,attention.min_split_keys=256' (values: true/false, integers, none)."""
        base = base or cls()
        if not text:
            return base
        values = {}
        for item in str(text).split(","):
            key, eq, raw = item.strip().partition("=")
            if not eq or not key:
                raise InputError(f"{option('kernels')} '{item}': write KEY=VALUE, e.g. gemv.pdl=false "
                                 f"(options: {', '.join(option_names())})")
            values[key.strip()] = _value(raw.strip(), key.strip())
        return base.with_(**values)

    def changed(self) -> dict:
        """The options that differ from the defaults, as 'group.name': value."""
        d, ref = self.to_dict(), KernelOptions().to_dict()
        return {f"{g}.{k}": v for g in d for k, v in d[g].items() if ref[g][k] != v}

    def label(self) -> str:
        """'default', or the changed options as parse reads them (a cell name's variant)."""
        ch = self.changed()
        return "default" if not ch else ",".join(f"{k}={_text(v)}" for k, v in ch.items())


def option_names() -> list[str]:
    return [f"{g}.{f.name}" for g, part in GROUPS.items() for f in fields(part)]


def _value(raw: str, key: str):
    """raw read as the type of option `key`'s field (bool, int, or int | None)."""
    group, _, name = key.partition(".")
    part = GROUPS.get(group)
    f = next((f for f in fields(part) if f.name == name), None) if part else None
    if f is None:
        raise InputError(f"unknown kernel option '{key}'; options are {', '.join(option_names())}")
    low = raw.lower()
    if low == "none" and "None" in f.type:
        return None
    if "bool" in f.type:
        if low in ("true", "false"):
            return low == "true"
        raise InputError(f"{key}={raw}: write true or false" + (" or none" if "None" in f.type else ""))
    try:
        return int(raw)
    except ValueError:
        raise InputError(f"{key}={raw}: write an integer" + (" or none" if "None" in f.type else "")) from None


def _text(v) -> str:
    return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


GROUPS = {"gemv": GemvOptions, "attention": AttentionOptions, "cpu": CpuOptions, "lora": LoraOptions}
DEFAULT = KernelOptions()

__all__ = ["DEFAULT", "AttentionOptions", "CpuOptions", "GemvOptions", "KernelOptions", "LoraOptions", "option_names"]
