"""Per-site activation thresholds, saved as one small safetensors file.

A site is where a channel test |x| > t happens (ByteCross §3.2, issue 4):

- the inputs of the seven projections of layer i, keys `layers.{i}.q|k|v|o|gate|up|down`
  (q, k, v read the attention input; o the attention output; gate and up the
  MLP input; down the MLP intermediate SiLU(gate)·up);
- the CATS site, key `layers.{i}.act`: |SiLU(gate(x))|, whose dropped channels
  skip the matching rows of up and columns of down.

A site without a key stays dense (e.g. q/k/v/o under `ff_only`). The file holds
one 0-d float32 tensor per key and a JSON header in the safetensors metadata:
method, target keep and what it refers to, model name and dims, and the
calibration text. Thresholds transfer between checkpoints of the same shape
(App. A 'Threshold transfer': Llama-3-8B thresholds serve Llama-3.1-8B), so
`validate` refuses other dims but only notes another checkpoint name.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sparsedecode.account.dims import ModelDims
from sparsedecode.errors import InputError
from sparsedecode.stfile import load_with_header, save_with_header

MIN_TOKENS = 256  # the fewest calibration tokens a threshold rests on (projection.calibrate)

INPUT_SITES = ("q", "k", "v", "o", "gate", "up", "down")
ACT_SITE = "act"
SITES = INPUT_SITES + (ACT_SITE,)
# Short site name -> decoder module name (see models/decoder.py).
MODULE_OF = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
             "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
SHAPE_FIELDS = ("n_layers", "d", "d_ff", "n_heads", "n_kv_heads", "head_dim")
METHODS = ("teal", "cats", "sats")  # the calibrators that write thresholds (projection.calibrate)
FORMAT = "sparsedecode-thresholds/1"
_KEY = re.compile(r"^layers\.(\d+)\.([a-z]+)$")


def site_key(layer: int, site: str) -> str:
    return f"layers.{layer}.{site}"


def parse_key(key: str) -> tuple[int, str]:
    """'layers.3.gate' -> (3, 'gate'); anything else is an InputError."""
    m = _KEY.match(key)
    if not m or m.group(2) not in SITES:
        raise InputError(
            f"threshold key '{key}' is not layers.N.SITE with SITE one of {', '.join(SITES)}"
        )
    return int(m.group(1)), m.group(2)


def site_width(dims: ModelDims, site: str) -> int:
    """Channels tested at a site: the input width of its projection (d_ff for act)."""
    return {"o": dims.q_width, "down": dims.d_ff, ACT_SITE: dims.d_ff}.get(site, dims.d)


def site_params(dims: ModelDims, site: str) -> int:
    """Weights whose reads a site gates (for act: the rows of up and columns of down)."""
    return {
        "q": dims.d * dims.q_width, "k": dims.d * dims.kv_width, "v": dims.d * dims.kv_width,
        "o": dims.q_width * dims.d, "gate": dims.d * dims.d_ff, "up": dims.d * dims.d_ff,
        "down": dims.d_ff * dims.d, ACT_SITE: 2 * dims.d * dims.d_ff,
    }[site]


def cats_projection_keep(dims: ModelDims, act_keep: float) -> float:
    """The keep over the seven projections' weights of a CATS/SATS step (SATS §3.2): q, k, v, o and
    gate read whole, up's rows and down's columns of the kept SiLU(gate) channels (`act_keep`; under
    routing the effective keep r * keep + (1 - r))."""
    whole = sum(site_params(dims, s) for s in ("q", "k", "v", "o", "gate"))
    return (whole + site_params(dims, ACT_SITE) * act_keep) / sum(site_params(dims, s) for s in INPUT_SITES)


def act_keep_of_mlp(dims: ModelDims, mlp_keep: float) -> float:
    """The kept fraction of SiLU(gate) channels of a CATS/SATS step whose MLP (gate, up, down)
    reads `mlp_keep` of its weights (gate whole): what the sparse modules' counters report."""
    mlp = sum(site_params(dims, s) for s in ("gate", "up", "down"))
    return (mlp * mlp_keep - site_params(dims, "gate")) / site_params(dims, ACT_SITE)


@dataclass
class Thresholds:
    """Thresholds t per site key (a channel is kept when |x| > t) and their header.

    keep: the calibration target; keep_metric: what it is a fraction of
    ('param_keep': projection weights of all seven projections, 'ff_keep': of
    gate/up/down, 'act_keep': SiLU(gate) channels). calibration: where the
    statistics came from ({'text': ..., 'tokens': N}). extras: method fields.
    """

    values: dict[str, float]
    method: str
    keep: float
    model: str
    dims: dict
    keep_metric: str = "param_keep"
    calibration: dict = field(default_factory=dict)
    extras: dict = field(default_factory=dict)

    def __post_init__(self):
        for k in self.values:
            parse_key(k)
        self.values = {k: float(v) for k, v in self.values.items()}

    def get(self, layer: int, site: str) -> float | None:
        """The threshold of (layer, site), or None when that site stays dense."""
        return self.values.get(site_key(layer, site))

    @property
    def sites(self) -> list[str]:
        """Site names that carry a threshold in at least one layer, in site order."""
        present = {parse_key(k)[1] for k in self.values}
        return [s for s in SITES if s in present]

    def header(self) -> dict:
        h = asdict(self)
        del h["values"]
        return h

    # -- files ---------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the safetensors file (written to a temp name, then renamed)."""
        import torch

        tensors = {k: torch.tensor(v, dtype=torch.float32) for k, v in self.values.items()}
        return save_with_header(path, tensors, FORMAT, self.header())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Thresholds:
        """Read a file written by `save`; anything else is an InputError."""
        import math

        from sparsedecode.stfile import fit_header

        tensors, header = load_with_header(path, FORMAT, "thresholds file", "sparsedecode calibrate")
        fields = tuple(f for f in cls.__dataclass_fields__ if f != "values")
        header = fit_header(header, fields, ("method", "keep", "model", "dims"), path, "thresholds file")
        if header["method"] not in METHODS:
            raise InputError(f"{path}: thresholds of unknown method {header['method']!r} (one of "
                             f"{', '.join(METHODS)}); make them with sparsedecode calibrate")
        keep = header["keep"]
        if isinstance(keep, bool) or not isinstance(keep, int | float) or not 0 < keep <= 1:
            raise InputError(f"{path}: header keep is {keep!r}, outside (0, 1]; make the file again "
                             "with sparsedecode calibrate")
        if not isinstance(header["dims"], dict):
            raise InputError(f"{path}: header dims is {header['dims']!r}, expected the model's dims")
        values = {}
        for k, t in tensors.items():
            if t.numel() != 1:
                raise InputError(f"{path}: threshold {k} holds {t.numel()} values, expected one")
            v = float(t)
            if not math.isfinite(v) or v < 0:
                raise InputError(f"{path}: threshold {k} is {v}; thresholds are finite and >= 0 "
                                 "(make the file again with sparsedecode calibrate)")
            values[k] = v
        try:
            return cls(values=values, **header)
        except InputError as err:
            raise InputError(f"{path}: {err}") from None

    # -- checks --------------------------------------------------------------
    def validate(self, dims: ModelDims) -> str | None:
        """Refuse thresholds made for other shapes; return (and warn) a note when only
        the checkpoint name differs. Returns None on a full match."""
        diffs = [
            f"{f} {self.dims.get(f)} (thresholds) vs {getattr(dims, f)} (model)"
            for f in SHAPE_FIELDS
            if self.dims.get(f) != getattr(dims, f)
        ]
        if diffs:
            raise InputError(
                f"thresholds calibrated on '{self.model}' do not fit '{dims.name}': "
                f"{'; '.join(diffs)}. Calibrate for this model: "
                f"sparsedecode calibrate --model {dims.name} --method {self.method} --proj-keep {self.keep:g}"
            )
        beyond = sorted({k for k in self.values if parse_key(k)[0] >= dims.n_layers})
        if beyond:
            raise InputError(
                f"thresholds name layers the model lacks ({', '.join(beyond[:3])}); "
                f"'{dims.name}' has {dims.n_layers} layers"
            )
        if self.model != dims.name:
            note = (
                f"thresholds were calibrated on '{self.model}' and are used on '{dims.name}' "
                "(same dims; transferred as in ByteCross App. A, the realized keep may differ)"
            )
            warnings.warn(note, stacklevel=2)
            return note
        return None


__all__ = [
    "ACT_SITE", "INPUT_SITES", "MODULE_OF", "SITES", "Thresholds", "act_keep_of_mlp", "cats_projection_keep",
    "parse_key", "site_key", "site_params", "site_width",
]
