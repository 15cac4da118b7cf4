"""Options shared by several subcommands, defined once, and output helpers.

Numbers arrive as strings and are parsed by the account's own parsers (token
counts by the `TOKENS` callback, while the command line is read), so bad input
fails with one line that says how to fix it (exit code 2), never a traceback
or a usage box.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from sparsedecode.errors import InputError


def _as_given(value):
    """A typer `parser` that keeps the text as given, so `_tokens` sees it whole."""
    return value


def _tokens(param: typer.CallbackParam, value):
    """The typer callback of a token-count option: 32768, 32K or 32k (K = 1,024) -> int, named by
    its flag when bad (an InputError: one line, exit code 2). A plain integer passes as it is,
    zero and negatives included, so each command keeps its own range check and message."""
    from sparsedecode.account.units import parse_tokens

    if value is None or isinstance(value, int):
        return value
    text = str(value).strip()
    if text.lstrip("+-").isdigit():
        return int(text)
    return parse_tokens(text, param.opts[0])


# The keyword arguments of an option whose value is a token count: `typer.Option("--x", **TOKENS)`.
TOKENS = {"parser": _as_given, "callback": _tokens, "metavar": "TOKENS"}

# Options several commands share, declared once: one flag, one help text; each command sets its
# own default (`proj_keep: ProjKeepOpt = "0.5"`). tests/cli/test_declarations.py counts them.
ProjKeepOpt = Annotated[str | None, typer.Option(
    "--proj-keep", metavar="KEEP",
    help="Projection keep r_P in (0, 1]: the fraction of the projections' weights a decode step reads "
         "(1 is dense). Commands that decode calibrate uniform TEAL thresholds for it on "
         "WikiText-2 validation once and cache them.")]
KvOpt = Annotated[str | None, typer.Option(
    "--kv", metavar="METHOD",
    help="KV selector run after the prefill: snapkv (entries scored by attention) or window "
         "(sinks and the most recent entries).")]
KvKeepOpt = Annotated[str | None, typer.Option(
    "--kv-keep", metavar="KEEP",
    help="KV keep r_KV in (0, 1]: the fraction of the prompt's KV entries a decode step reads "
         "(1 is dense); commands that decode need --kv too.")]
ThresholdsOpt = Annotated[str | None, typer.Option(
    "--thresholds", metavar="FILE",
    help="Projection thresholds file written by `sparsedecode calibrate` (for routing: a cats or "
         "sats one).")]
MethodOpt = Annotated[str, typer.Option(
    "--method", metavar="METHOD", help="Projection calibration method: teal, cats or sats.")]
DeviceOpt = Annotated[str, typer.Option("--device", metavar="DEVICE", help="cpu, cuda, cuda:N or auto.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", metavar="DTYPE", help="float32, bfloat16, float16 or auto.")]
ThreadsOpt = Annotated[int | None, typer.Option(
    "--threads", metavar="N", help="CPU threads for torch (default: torch's own choice).")]
MaxLenOpt = Annotated[int | None, typer.Option(
    "--max-len", **TOKENS,
    help="Cache length in tokens (4096, 32K): the longest prompt plus answer (default: the "
         "model window, at most 4K).")]
TextFileOpt = Annotated[str | None, typer.Option(
    "--text-file", metavar="FILE",
    help="Text to read in place of WikiText-2 (found beside the checkout): a UTF-8 file, or a "
         "folder holding wiki.valid.raw and wiki.test.raw. The command's description says what "
         "it reads the text for.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout, for scripts.")]
ObsOpt = Annotated[int, typer.Option(
    "--obs", **TOKENS, help="Observation window of the KV selection: the last tokens of the prompt, "
                            "whose attention scores the entries.")]

ModelOpt = Annotated[
    str | None, typer.Option("--model", "-m", help="Known model name (see `sparsedecode models`).")
]
ConfigOpt = Annotated[
    str | None,
    typer.Option("--config", help="A HF config.json, a folder holding one, or a hub id."),
]
FfOnlyOpt = Annotated[
    bool,
    typer.Option("--ff-only", help="Sparsify only gate/up/down, not the attention projections."),
]
WeightBytesOpt = Annotated[
    str, typer.Option("--weight-bytes", help="Bytes per weight element (2 = 16-bit, 0.5 = 4-bit).")
]
KvBytesOpt = Annotated[str, typer.Option("--kv-bytes", help="Bytes per KV-cache element.")]


def parse_requests(values: list[str], flag: str = "--request") -> list[tuple[int, int]]:
    """PROMPT:ANSWER token counts such as '2K:256' -> [(2048, 256), ...]."""
    from sparsedecode.account.units import parse_tokens

    out = []
    for r in values:
        if r.count(":") != 1:
            raise InputError(f"{flag} {r!r}: write PROMPT:ANSWER tokens, e.g. 2K:256")
        out.append(tuple(parse_tokens(x.strip(), f"{flag} {r}") for x in r.split(":")))
    return out


def parse_float(text: str, what: str, positive: bool = False) -> float:
    """A float from user text, or an InputError saying what was expected."""
    from sparsedecode.errors import InputError

    try:
        v = float(text)
    except (TypeError, ValueError):
        raise InputError(f"{what} '{text}' is not a number") from None
    if positive and not v > 0:
        raise InputError(f"{what} must be positive, got {text}")
    return v


def emit_json(obj: dict) -> None:
    """One JSON object on stdout; infinities become null."""
    json.dump(_finite(obj), sys.stdout, indent=1)
    sys.stdout.write("\n")


def _finite(x):
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def check_out_file(path: str, flag: str, suffix: str | None = None):
    """An output file path checked before any work: not a folder, a writable place, and with
    `suffix` (e.g. '.png') when given. Returns it as a Path; InputError names the flag."""
    from pathlib import Path

    from sparsedecode.errors import InputError

    p = Path(path)
    if p.is_dir():
        raise InputError(f"{flag} {path} is a folder; give a file path such as {p / ('out' + (suffix or '.json'))}")
    if suffix is not None and p.suffix.lower() != suffix:
        raise InputError(f"{flag} {path} must end in {suffix}")
    _check_writable(p.parent if str(p.parent) else Path("."), path, flag)
    return p


def _check_writable(where, path: str, flag: str) -> None:
    """`where`, or its nearest existing parent (folders are made on write), is a writable folder."""
    import os

    from sparsedecode.errors import InputError

    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise InputError(f"{flag} {path}: cannot write under {probe}; pick a writable place")


def check_engine_args(device: str, dtype: str, max_len: int | None = None, attention: str = "split_k") -> None:
    """The engine options of a command, checked before its model loads (flags named)."""
    from sparsedecode.engine.device import check_dtype, resolve_device, resolve_dtype
    from sparsedecode.errors import InputError
    from sparsedecode.models.attention import get_backend

    get_backend(attention)
    dev = resolve_device(device)
    check_dtype(dev, resolve_dtype(dtype, dev))
    if max_len is not None and max_len < 1:
        raise InputError(f"--max-len must be >= 1 token, got {max_len}")


def check_new_file(path: str, flag: str, suffix: str | None = None):
    """`check_out_file`, and refuse a file that exists (results are never overwritten)."""
    from sparsedecode.errors import InputError

    p = check_out_file(path, flag, suffix)
    if p.exists():
        raise InputError(f"{flag} {path} exists; pick a new path (or delete the old file first)")
    return p


def check_out_dir(path: str, flag: str):
    """An output folder checked before any work: not an existing file, and writable."""
    from pathlib import Path

    from sparsedecode.errors import InputError

    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InputError(f"{flag} {path} is a file; give a folder")
    _check_writable(p, path, flag)
    return p


def check_text_file(path) -> None:
    """A text input read as UTF-8 before the model loads (a bad file fails first)."""
    from sparsedecode.textfile import read_text

    read_text(path, "text file")


def apply_threads(threads: int | None) -> int:
    """--threads: torch's intra-op CPU threads, checked first; returns the count set. Without it,
    $OMP_NUM_THREADS when set (torch reads it), else the cores this process may run on (its
    affinity, which containers and `taskset` narrow; torch's own default counts the host's)."""
    import os

    from sparsedecode.errors import InputError

    if threads is not None and threads < 1:
        raise InputError(f"--threads must be >= 1, got {threads}")
    import torch

    if threads is None and not os.environ.get("OMP_NUM_THREADS"):
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()



def check_sparsity_args(thresholds, proj_keep, kv, kv_keep, gate, routing=None):
    """The decode configuration of `generate` and `serve` from their options, checked before any
    model loads: returns (SparsityConfig, Thresholds or None, RoutingTable or None), the files
    read once here so that a bad one fails first; `Engine.configure` installs the three."""
    from sparsedecode.account.units import check_keep
    from sparsedecode.config import KVConfig, ProjectionConfig, SparsityConfig

    if thresholds is not None and proj_keep is not None:
        raise InputError("give --thresholds FILE or --proj-keep K, not both")
    if gate is not None and (thresholds, proj_keep, kv, kv_keep, routing) != (None,) * 5:
        raise InputError("--gate chooses the configuration per request: drop --thresholds, --proj-keep, "
                         "--kv/--kv-keep and --routing, or drop --gate")
    if gate is not None and not Path(gate).is_file():
        raise InputError(f"--gate {gate}: file not found (make one with sparsedecode dispatch table RECORDS --out gate.json)")
    if (kv is None) != (kv_keep is None):
        raise InputError("the KV branch needs both --kv METHOD and --kv-keep K (e.g. --kv snapkv --kv-keep 0.2)")
    if routing is not None and thresholds is None:
        raise InputError("--routing chooses between the dense MLP and CATS thresholds: give "
                         "--thresholds FILE (a cats or sats file) too")
    proj = None
    if proj_keep is not None:
        proj = ProjectionConfig(keep=check_keep(proj_keep, "--proj-keep"))
    elif thresholds is not None:
        proj = ProjectionConfig(file=thresholds, routing=routing)
    kv_config = None
    if kv is not None:
        from sparsedecode.kv.select import get_selector

        get_selector(kv)
        kv_config = KVConfig(kv, check_keep(kv_keep, "--kv-keep"))
    table = th = None
    if routing is not None:
        from sparsedecode.projection.routing import RoutingTable

        table = RoutingTable.load(routing)  # a bad file fails before the model loads
        table.sparse_of()  # and so does an uncalibrated one
    if thresholds is not None:
        from sparsedecode.projection.thresholds import Thresholds

        th = Thresholds.load(thresholds)
    return SparsityConfig(proj, kv_config), th, table


def apply_sparsity(eng, config, thresholds=None, routing=None, progress: bool = True) -> None:
    """Install on a loaded engine what `check_sparsity_args` checked (`Engine.configure`; TEAL
    thresholds for --proj-keep are calibrated once and cached)."""
    eng.configure(config, thresholds=thresholds, routing=routing, progress=progress)
