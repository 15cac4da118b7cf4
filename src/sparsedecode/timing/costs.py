"""What a timed step reads and what it costs beyond its bytes (ByteCross §3.3, §4.2, App. D).

`cell_bytes`: a cell's bytes per step and byte bound, from its record (realized keeps) or else
from the byte account of the model's known dims at the nominal keeps (App. D counts the head and
norms, as ``step_bytes`` does). `nominal_peak`: the GPU's datasheet bandwidth.
"""

from __future__ import annotations

from sparsedecode.account import bounds, step_bytes
from sparsedecode.timing.cells import CampaignCells
from sparsedecode.timing.paper import PaperCell

# Nominal peak memory bandwidth in GB/s; every substring must occur in the
# normalized GPU name, first match wins (vendor data sheets).
PEAK_GBPS: tuple[tuple[tuple[str, ...], float, str], ...] = (
    (("h200",), 4800.0, "H200"),
    (("h100", "hbm3"), 3350.0, "H100 SXM"),
    (("h100", "sxm"), 3350.0, "H100 SXM"),
    (("a100", "80gb", "pcie"), 1935.0, "A100 80GB PCIe"),
    (("a100", "80gb"), 2039.0, "A100 80GB SXM"),
    (("a100", "40gb"), 1555.0, "A100 40GB"),
    (("a6000",), 768.0, "RTX A6000"),
)
# The byte bound of a sparse mode: which field of `account.bounds` it reads.
BOUND_OF_MODE = {"proj": "projection", "sel": "kv", "window": "kv", "both": "both"}


def nominal_peak(gpu: str) -> tuple[float | None, str]:
    """(peak GB/s, which entry matched) for a GPU name; (None, reason) when unknown."""
    name = gpu.lower().replace("-", " ").replace("_", " ")
    for keys, gbps, label in PEAK_GBPS:
        if all(k in name for k in keys):
            return gbps, f"nominal peak of the {label}"
    return None, (f"no nominal peak for GPU '{gpu}': fraction of peak left blank "
                  "(pass --peak-gbps)")


def share(gbps: float | None, of: float | None) -> float | None:
    """gbps as a share of a bandwidth (the peak, the measured ceiling); None where either is."""
    return None if gbps is None or of is None else gbps / of


def _account_bytes(cc: CampaignCells, c: PaperCell) -> tuple[float | None, float | None]:
    """(bytes per step, byte bound) from the byte account at the nominal keeps, or Nones."""
    if cc.dims is None:
        return None, None
    if c.mode == "dense":
        return step_bytes(cc.dims, c.context).total, 1.0
    if c.mode not in BOUND_OF_MODE:
        return None, None
    b = getattr(bounds(cc.dims, c.context, c.projection_keep, c.kv_keep), BOUND_OF_MODE[c.mode])
    return step_bytes(cc.dims, c.context).total / b, b


def cell_bytes(cc: CampaignCells, c: PaperCell) -> tuple[float | None, float | None, str]:
    """(bytes per step, byte bound, source) of one cell: the record's own, else the account's."""
    x = cc.extra(c)
    if x.bytes_per_step is not None:
        bound = x.byte_bound if x.byte_bound is not None else (1.0 if c.mode == "dense" else None)
        return x.bytes_per_step, bound, "records"
    by, bound = _account_bytes(cc, c)
    if x.byte_bound is not None:
        bound = x.byte_bound
    return by, bound, "account" if by is not None else "none"


def bytes_note(cc: CampaignCells, sources: set[str]) -> str:
    """Where a group's B_b / B_D came from (`cell_bytes`' sources), in one sentence."""
    if sources == {"records"}:
        return "B_b / B_D from the records' bytes_per_step (realized keeps)."
    if "none" in sources:
        return (f"kernel cost left blank where bytes are unknown: records lack bytes_per_step "
                f"and {cc.dims_note or 'the model has no dims'}.")
    return (f"B_b / B_D from the byte account ({cc.dims_note}, 16-bit weights and cache, "
            "nominal keeps; head and norms included, App. D).")


__all__ = ["BOUND_OF_MODE", "PEAK_GBPS", "bytes_note", "cell_bytes", "nominal_peak", "share"]
