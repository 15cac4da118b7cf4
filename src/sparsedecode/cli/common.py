"""Options shared by several subcommands, defined once, and output helpers.

Numbers arrive as strings and are parsed by the account's own parsers (token
counts by the `TOKENS` callback, while the command line is read), so bad input
fails with one line that says how to fix it (exit code 2), never a traceback
or a usage box.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer

from sparsedecode.errors import InputError


def _flag(param) -> str:
    return max(param.opts, key=len)  # '--out', not '-o'


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
    n = int(text) if text.lstrip("+-").isdigit() else parse_tokens(text, param.opts[0])
    if n > TOKENS_MAX:
        raise InputError(f"{_flag(param)} {text}: more than {TOKENS_MAX:,} tokens, past any model's window")
    return n


COUNT_MAX = 10**9  # repeats, steps, chunks, cells: more is a typo, not a plan
SEED_MAX = 2**63 - 1  # what every seed reaches (torch, random, numpy) takes
SECONDS_MAX = 10**7  # about 4 months
TOKENS_MAX = 2**31  # a token count past this is no model's window


def bounded(low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    """The typer callback of a numeric option: a finite number in [low, high] (an open end
    excludes it), else an InputError naming the flag and the range (one line, exit 2), read with
    the command line before any work."""
    def check(param: typer.CallbackParam, value):
        if value is None:
            return value
        ok = (math.isfinite(value) and (low < value if low_open else low <= value)
              and (value < high if high_open else value <= high))
        if not ok:
            raise InputError(f"{_flag(param)} must be {'>' if low_open else '>='} {_num(low)} and "
                             f"{'<' if high_open else '<='} {_num(high)}, got {value}")
        return value

    return check


def _num(x) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


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
AdapterOpt = Annotated[str | None, typer.Option(
    "--adapter", metavar="DIR",
    help="LoRA adapter folder written by `sparsedecode finetune`, merged into the weights at load (or kept apart, "
         "added by each site's GEMV, with --kernels lora.merge=false): base + adapter on every path (prefill and "
         "decode, sparse and dense). One made for another model is refused.")]
MethodOpt = Annotated[str, typer.Option(
    "--method", metavar="METHOD", help="Projection calibration method: teal, cats or sats.")]
DeviceOpt = Annotated[str, typer.Option("--device", metavar="DEVICE", help="cpu, cuda, cuda:N or auto.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", metavar="DTYPE", help="float32, bfloat16, float16 or auto.")]
ThreadsOpt = Annotated[int | None, typer.Option(
    "--threads", metavar="N", callback=bounded(1, 4096), help="CPU threads for torch (default: torch's own choice).")]
MaxLenOpt = Annotated[int | None, typer.Option(
    "--max-len", **TOKENS,
    help="Cache length in tokens (4096, 32K): the longest prompt plus answer (default: the "
         "model window, at most 4K).")]
TextFileOpt = Annotated[str | None, typer.Option(
    "--text-file", metavar="FILE",
    help="Text to read in place of WikiText-2 (the copy the package ships): a UTF-8 file, or a "
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
        prompt, answer = (parse_tokens(x.strip(), f"{flag} {r}") for x in r.split(":"))
        if prompt + answer > TOKENS_MAX:
            raise InputError(f"{flag} {r}: {prompt + answer:,} tokens in all, past any model's window "
                             f"(at most {TOKENS_MAX:,})")
        out.append((prompt, answer))
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


def check_out_file(path: str, flag: str, suffix: str | tuple[str, ...] | None = None):
    """An output file path checked before any work: not a folder, a writable place, and with
    `suffix` (e.g. '.png', or one of several) when given. Returns it as a Path; InputError names
    the flag."""
    from pathlib import Path

    from sparsedecode.errors import InputError

    p = Path(path)
    suffixes = (suffix,) if isinstance(suffix, str) else suffix
    if p.is_dir():
        example = p / ("out" + (suffixes[0] if suffixes else ".json"))
        raise InputError(f"{flag} {path} is a folder; give a file path such as {example}")
    if suffixes and p.suffix.lower() not in suffixes:
        raise InputError(f"{flag} {path} must end in {' or '.join(suffixes)}")
    _check_writable(p.parent if str(p.parent) else Path("."), path, flag)
    return p


def out_file(suffix: str | tuple[str, ...] | None = None, new: bool = False):
    """The typer callback of an option naming a file to write, checked while the command line is
    read, before any work: `check_out_file`, or `check_new_file` for a result never overwritten
    (`typer.Option("--out", callback=out_file(".json", new=True))`)."""
    def check(param: typer.CallbackParam, value):
        if value is not None:
            (check_new_file if new else check_out_file)(value, _flag(param), suffix)
        return value

    return check


def out_dir(param: typer.CallbackParam, value):
    """The typer callback of an option naming a folder to write into (`check_out_dir`)."""
    if value is not None:
        check_out_dir(value, _flag(param))
    return value


def out_place(param: typer.CallbackParam, value):
    """The typer callback of an option naming a file or a folder to write, by another option's
    choice: its nearest existing part must be a writable folder (the command checks the rest)."""
    if value is not None:
        p = Path(value)
        _check_writable(p.parent if p.is_file() else p, value, _flag(param))
    return value


def _check_writable(where, path: str, flag: str) -> None:
    """`where`, or its nearest existing parent (folders are made on write), is a writable folder."""
    import os

    from sparsedecode.errors import InputError

    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise InputError(f"{flag} {path}: {probe} is a file, not a folder; pick another path")
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise InputError(f"{flag} {path}: cannot write under {probe}; pick a writable place")


def check_adapter(adapter: str | None):
    """--adapter read before the model loads (a bad folder fails first): its `projection.lora.Adapter`,
    or None. The model's dims are checked against it when it merges (`sparsedecode.load(adapter=)`)."""
    if adapter is None:
        return None
    from sparsedecode.projection.lora import Adapter

    return Adapter.load(adapter)


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
        raise InputError(f"{flag} {path} exists; results are never overwritten: pick a new path (or delete the old file first)")
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


def check_calibration_text(text_file: str | None, *, calibrates: bool, init: str = "pretrained") -> None:
    """--text-file of a command that calibrates thresholds only for --proj-keep or a --gate (generate,
    serve, dispatch check): read before the model loads, and refused where nothing would read it."""
    if text_file is None:
        return
    if init == "random":
        raise InputError("--text-file with --init random: a random-init model has no tokenizer, so its "
                         "thresholds calibrate on seeded random token ids; drop --text-file")
    if not calibrates:
        raise InputError("--text-file is the text that --proj-keep (or a --gate) calibrates thresholds on; "
                         "nothing calibrates here (--thresholds FILE, or no projection branch): drop "
                         "--text-file or give --proj-keep K")
    from sparsedecode.corpus import wikitext_path

    check_text_file(wikitext_path("valid", text_file))


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


def apply_sparsity(eng, config, thresholds=None, routing=None, progress: bool = True, text_file=None) -> None:
    """Install on a loaded engine what `check_sparsity_args` checked (`Engine.configure`; TEAL
    thresholds for --proj-keep are calibrated once, on `text_file` or WikiText-2 validation, and
    cached)."""
    p = config.projection
    if thresholds is None and text_file is not None and p is not None and p.file is None:
        from sparsedecode.projection.calibrate import cached_teal

        thresholds = cached_teal(eng, p.keep, text_file=text_file, progress=progress)
    eng.configure(config, thresholds=thresholds, routing=routing, progress=progress)
