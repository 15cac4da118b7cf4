"""What a decode step reads, named once: the projection branch, the KV branch, both or neither.

A `SparsityConfig` is the one configuration type of the package (ByteCross §3: the projection
branch skips weight rows of small input channels, §4 the KV branch reads a selected subset of the
cache; App. A names the paper's cells). Every command, the server, the dispatcher, the timing
harness and the records use it; `Engine.configure(config)` installs it. It is frozen, comparable
and hashable, so it keys captured graphs, price tables and records, and it round-trips through
text: `SparsityConfig.parse(str(c)) == c`.

The text form joins parts with '+':

    dense                       every weight row and the whole cache
    proj0.5                     TEAL thresholds at projection keep 0.5, calibrated by the engine
    proj[t.safetensors]         a thresholds file (any calibrator: teal, cats, sats, greedy ...)
    sel0.3                      SnapKV selection keeping 0.3 of the cache (ByteCross §4.1)
    window0.3                   sinks + the recent window, 0.3 of the cache
    NAME0.3                     any other registered KV selector (`kv.SELECTORS`) by its name
    sel0.3(window=32,sinks=4)   a selector's fields
    both0.5/0.3                 the paper's composed cell: proj0.5+sel0.3
    proj[c.st]+route[r.json]    token routing between the dense MLP and CATS thresholds (SATS §3.2)
    ...+lora[adapter]           an adapter (the LoRA setting fills this slot)

This module sits on the floor above `account/` (docs/architecture.md): it names and checks, it does
not resolve. Selector names and fields are checked where the registry lives (`Engine.configure`,
the CLI's option checks); a keep is calibrated and a file is read by the engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sparsedecode.account.units import check_keep
from sparsedecode.errors import InputError

SNAPKV, WINDOW = "snapkv", "window"
RESERVED = ("dense", "proj", "both", "route", "lora")  # words that are not KV selector names
_KV_WORDS = {"sel": SNAPKV}  # text word -> selector; other words name the selector itself
_KV_TEXT = {SNAPKV: "sel"}
_NUM = r"\d*\.?\d+(?:[eE][-+]?\d+)?"
_FIELDS = r"(?:\((?P<fields>[^()]*)\))?"
_PART = {
    "both": re.compile(rf"^both(?P<p>{_NUM})/(?P<k>{_NUM}){_FIELDS}$"),
    "proj": re.compile(rf"^proj(?P<p>{_NUM})$"),
    "file": re.compile(r"^(?P<word>proj|route|lora)\[(?P<path>[^\[\]]+)\]$"),
    "kv": re.compile(rf"^(?P<word>[a-z_]+?)(?P<k>{_NUM}){_FIELDS}$"),
}
_FORMS = ("dense, proj<keep>, proj[FILE], sel<keep>, window<keep>, <selector><keep>, both<proj keep>/<kv keep>, "
          "and parts joined with '+' (route[TABLE], lora[ADAPTER], selector fields as sel0.3(window=32))")


class Fields(dict):
    """A selector's fields: a read-only dict that hashes, so configurations holding it do."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))

    def _readonly(self, *args, **kwargs):
        raise TypeError("a configuration's fields are read-only: build a new KVConfig")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _readonly


@dataclass(frozen=True)
class ProjectionConfig:
    """The projection branch (ByteCross §3.2): TEAL thresholds at `keep`, calibrated by the engine
    on its own text, or a thresholds `file` made by `sparsedecode calibrate` (any method); `routing`,
    a routing table file that sends each decode step to the dense MLP or the CATS thresholds of the
    file by its token id (SATS paper §3.2)."""

    keep: float | None = None
    file: str | None = None
    routing: str | None = None

    def __post_init__(self):
        if self.routing is not None and self.file is None and self.keep is None:
            raise InputError("token routing chooses between the dense MLP and CATS thresholds: give the cats or "
                             "sats thresholds file too (proj[c.safetensors]+route[r.json])")
        if (self.keep is None) == (self.file is None):
            raise InputError("the projection branch takes a keep (calibrated TEAL thresholds) or a thresholds "
                             "file, exactly one: proj0.5 or proj[t.safetensors]")
        if self.keep is not None:
            object.__setattr__(self, "keep", check_keep(self.keep, "projection keep"))
        for name in ("file", "routing"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, _path(v, name))
        if self.routing is not None and self.file is None:
            raise InputError("token routing chooses between the dense MLP and CATS thresholds: give a cats or "
                             "sats thresholds file (proj[c.safetensors]+route[r.json]), not a keep")

    @property
    def method(self) -> str:
        """'teal' for a calibrated keep; 'file' where the file says (read by the engine)."""
        return "teal" if self.keep is not None else "file"


@dataclass(frozen=True)
class KVConfig:
    """The KV branch (ByteCross §4.1): a selector by its registered name (`kv.SELECTORS`: snapkv,
    window, ...), the keep ratio of the cache it reads, and the selector's fields (a dict)."""

    method: str
    keep: float
    params: Fields = field(default_factory=Fields)

    def __post_init__(self):
        if not isinstance(self.method, str) or not re.fullmatch(r"[a-z_]+", self.method) \
                or self.method in RESERVED or self.method in _KV_WORDS:
            raise InputError(f"KV selector {self.method!r} is not a selector name (snapkv, window, ...)")
        object.__setattr__(self, "keep", check_keep(self.keep, "KV keep"))
        params = dict(self.params or {})
        for k, v in params.items():
            if not re.fullmatch(r"[a-z_]+", str(k)) or not isinstance(v, (int, float, str)) or isinstance(v, bool):
                raise InputError(f"KV selector field {k}={v!r}: write name=number or name=word")
        object.__setattr__(self, "params", Fields(params))


@dataclass(frozen=True)
class SparsityConfig:
    """What a decode step reads: `projection` (None: dense projections), `kv` (None: the whole
    cache) and `adapter` (None: the base weights; the LoRA setting fills it). Build one from text
    with `SparsityConfig.parse`; `str(config)` gives the text back."""

    projection: ProjectionConfig | None = None
    kv: KVConfig | None = None
    adapter: str | None = None

    def __post_init__(self):
        if self.projection is not None and not isinstance(self.projection, ProjectionConfig):
            raise InputError(f"projection takes a ProjectionConfig, got {type(self.projection).__name__}; "
                             "pass calibrated thresholds to Engine.configure(config, thresholds=...)")
        if self.kv is not None and not isinstance(self.kv, KVConfig):
            raise InputError(f"kv takes a KVConfig, got {type(self.kv).__name__}")
        if self.adapter is not None:
            object.__setattr__(self, "adapter", _path(self.adapter, "adapter"))

    # -- text -------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text) -> SparsityConfig:
        """A configuration from its text (module doc); an InputError names the forms otherwise."""
        if isinstance(text, SparsityConfig):
            return text
        s = str(text).strip()
        if s == "dense":
            return cls()
        if not s:
            raise InputError(f"an empty configuration: write one of {_FORMS}")
        keep = proj = file = routing = adapter = None
        kv = None
        for part in _split(s):
            def once(have, what):
                if have is not None:
                    raise InputError(f"configuration '{s}' names {what} twice")

            if m := _PART["both"].match(part):
                once(proj or file, "the projection branch")
                once(kv, "the KV branch")
                keep = _keep(m["p"], s, "projection keep")
                kv = KVConfig(SNAPKV, _keep(m["k"], s, "KV keep"), _fields(m["fields"], s))
            elif m := _PART["proj"].match(part):
                once(proj or file, "the projection branch")
                proj = keep = _keep(m["p"], s, "projection keep")
            elif m := _PART["file"].match(part):
                word, path = m["word"], m["path"]
                if word == "proj":
                    once(proj or file, "the projection branch")
                    file = path
                elif word == "route":
                    once(routing, "routing")
                    routing = path
                else:
                    once(adapter, "an adapter")
                    adapter = path
            elif (m := _PART["kv"].match(part)) and m["word"] not in RESERVED:
                once(kv, "the KV branch")
                kv = KVConfig(_KV_WORDS.get(m["word"], m["word"]), _keep(m["k"], s, "KV keep"),
                              _fields(m["fields"], s))
            else:
                raise InputError(f"configuration '{s}': '{part}' is not one of {_FORMS}")
        projection = None
        if keep is not None or file is not None or routing is not None:
            projection = ProjectionConfig(keep=keep, file=file, routing=routing)
        return cls(projection, kv, adapter)

    @classmethod
    def from_fields(cls, kind: str, proj_keep: float = 1.0, kv_keep: float = 1.0) -> SparsityConfig:
        """The configuration a record's fields name: `kind` as `SparsityConfig.kind` ('dense', 'proj',
        'sel', 'window', 'both', 'proj+window') and the keeps of its branches (a keep of a branch the
        kind does not run is ignored, as records write 1.0 there)."""
        kinds = ("dense", "proj", "sel", "window", "both", "proj+window")
        if kind not in kinds:
            raise InputError(f"mode '{kind}' is not one of {', '.join(kinds)}")
        proj = ProjectionConfig(keep=proj_keep) if kind in ("proj", "both", "proj+window") else None
        kv = None
        if kind in ("sel", "window", "both", "proj+window"):
            kv = KVConfig(WINDOW if kind.endswith("window") else SNAPKV, kv_keep)
        return cls(proj, kv)

    def __str__(self) -> str:
        p, kv = self.projection, self.kv
        parts = []
        if p is not None and kv is not None and p.keep is not None and p.routing is None and kv.method == SNAPKV:
            parts.append(f"both{p.keep:g}/{kv.keep:g}{_fields_text(kv.params)}")
        else:
            if p is not None:
                parts.append(f"proj{p.keep:g}" if p.keep is not None else f"proj[{p.file}]")
            if kv is not None:
                parts.append(f"{_KV_TEXT.get(kv.method, kv.method)}{kv.keep:g}{_fields_text(kv.params)}")
        if p is not None and p.routing is not None:
            parts.append(f"route[{p.routing}]")
        if self.adapter is not None:
            parts.append(f"lora[{self.adapter}]")
        return "+".join(parts) or "dense"

    # -- what the step reads, in the words of the records ---------------------------------------
    @property
    def kind(self) -> str:
        """'dense', 'proj', 'sel' (any scored selector), 'window', 'both' (proj + a scored selector)
        or 'proj+window': the records' `mode` field. A branch at keep 1 reads everything and
        counts as off (its file's keep, for a thresholds file, is the engine's to read)."""
        kv = None if self.kv is None or self.kv.keep >= 1.0 else ("window" if self.kv.method == WINDOW else "sel")
        proj = self.projection is not None and (self.projection.keep is None or self.projection.keep < 1.0)
        if proj and kv:
            return "both" if kv == "sel" else "proj+window"
        return "proj" if proj else kv or "dense"

    @property
    def mode(self) -> str:
        """`kind`, with '+route' where decode steps are routed (the quality records' mode)."""
        return self.kind + ("+route" if self.routed else "")

    @property
    def routed(self) -> bool:
        return self.projection is not None and self.projection.routing is not None

    @property
    def proj_keep(self) -> float | None:
        """The projection keep (1.0 without the branch; None for a thresholds file, whose keep
        the engine reads)."""
        return 1.0 if self.projection is None else self.projection.keep

    @property
    def kv_keep(self) -> float:
        return 1.0 if self.kv is None else self.kv.keep

    @property
    def proj_method(self) -> str | None:
        return None if self.projection is None else self.projection.method

    @property
    def kv_method(self) -> str | None:
        return None if self.kv is None else self.kv.method

    @property
    def cell(self) -> str:
        """The paper's cell id (keeps x 100): dense, proj50, sel30, window30, p50_s30; other
        configurations are their text with the characters a file name cannot hold replaced."""
        pct = lambda k: f"{round(k * 100, 6):g}"  # noqa: E731
        plain = self.adapter is None and not self.routed and (self.kv is None or not self.kv.params)
        if plain and (self.projection is None or self.projection.keep is not None):
            kind = self.kind
            if kind == "dense":
                return "dense"
            if kind == "both":
                return f"p{pct(self.proj_keep)}_s{pct(self.kv_keep)}"
            if kind == "proj":
                return f"proj{pct(self.proj_keep)}"
            if kind != "proj+window" and self.kv.method in (SNAPKV, WINDOW):
                return f"{kind}{pct(self.kv_keep)}"
        return re.sub(r"[^A-Za-z0-9._=-]+", "_", str(self)).strip("_")

    def with_(self, **changes) -> SparsityConfig:
        """A copy with fields replaced (projection=None turns the branch off)."""
        from dataclasses import replace

        return replace(self, **changes)


def _split(s: str) -> list[str]:
    """Parts joined by '+' outside brackets and parentheses (a file name may hold '+')."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        depth += ch in "[(" and 1 or 0
        depth -= ch in "])" and 1 or 0
        if ch == "+" and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    if any(not p for p in parts):
        raise InputError(f"configuration '{s}' has an empty part: write parts joined by '+', e.g. proj0.5+window0.3")
    return parts


def _keep(text: str, s: str, what: str) -> float:
    return check_keep(text, f"configuration '{s}': {what}")


def _fields(text: str | None, s: str) -> dict:
    out = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        name, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[a-z_]+", name.strip()) or not value.strip():
            raise InputError(f"configuration '{s}': selector field '{item}' is not name=value (e.g. window=32)")
        value = value.strip()
        try:
            out[name.strip()] = int(value)
        except ValueError:
            try:
                out[name.strip()] = float(value)
            except ValueError:
                out[name.strip()] = value
    return out


def _fields_text(params: dict) -> str:
    return "(" + ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in sorted(params.items())) + ")" if params else ""


def _path(value, what: str) -> str:
    text = str(value)
    if not text or any(c in text for c in "[]") or text != text.strip():
        raise InputError(f"{what} path {text!r}: a path in a configuration may not be empty, hold '[' or ']' "
                         "or start or end with spaces")
    return text


__all__ = ["Fields", "KVConfig", "ProjectionConfig", "SparsityConfig"]
