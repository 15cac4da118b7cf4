"""One timing cell: a fresh process times one mode at one context (ByteCross App. A 'Timing', §4.2).

The protocol of App. A, for one (model, context n, mode, attention path):

1. load the engine with a static cache of n + generated tokens, where
   generated = warmup + repeats x steps (every timed step decodes a new token);
2. fill the cache: `prefill` runs a dense prefill of the first n tokens of the
   test stream in chunks of 512 (the paper's protocol); `random` fills keys and
   values with seeded normal values and prefills only the last `obs` positions
   for real, which the selection's observation window needs (a 128K prefill is
   most of a cell's time, and the bytes a step reads do not depend on values);
3. configure the mode: the projection branch calibrates uniform TEAL thresholds
   on the model's own activations (WikiText-2 validation ids when the model has
   a tokenizer, seeded random ids otherwise) and measures the keep they realize
   with 8 tracked eager decode steps; the KV branch selects once
   (`Engine.select_kv`, SnapKV or the sink + recent window) for the generated
   tokens;
4. capture the decode step (the first replay compiles and captures on CUDA;
   sdpa_fused, which slices the cache with host bounds, is compiled with the
   length as a dynamic size and runs without a CUDA graph: `runtime: compiled`),
   run the warm-up steps, then R repeats of S steps decoding on from token n of
   the same stream, each repeat timed with CUDA events (perf_counter on CPU).

The record holds the per-repeat step times and the paper's ms_per_token
(1000 / mean of the per-repeat throughputs), the realized keeps and KV budget,
the bytes a step reads at those keeps (`account.traffic`), the byte bound of
the mode (`account.crossover.bounds`), achieved GB/s and the one-time costs.

Choices the paper leaves open, written down here: the token stream wraps around
when it is shorter than n + generated; random-weight models decode seeded random
ids (token ids do not change the bytes a step reads); the KV read fraction is
(budget + generated) / n, what the selection reads at its last generated token.
"""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from sparsedecode.config import SparsityConfig
from sparsedecode.errors import InputError
from sparsedecode.projection.thresholds import MIN_TOKENS
from sparsedecode.timing.cell_fields import (
    PREFILL_CHUNK,
    calibrate_own,
    engine_fields,
    peak_memory,
    stream_ids,
    timed_step_bytes,
)
from sparsedecode.timing.clock import process_age_s
from sparsedecode.timing.neighbors import SharedGpu, check_alone, device_uuid, neighbors, watched

ATTENTION = ("split_k", "sdpa_masked", "sdpa_fused")
FILLS = ("prefill", "random")
INITS = ("pretrained", "random")
IMPLS = ("ours", "transformers", "graph")  # whose decode step a cell times (timing.peer)
CELL_KINDS = ("dense", "proj", "sel", "window", "both")
CELL_METHODS = ("teal", "cats", "sats")  # what calibrates a cell's projection keep (`calibrate_own`)


def cell_config(text) -> SparsityConfig:
    """The configuration a timing cell runs, from its mode string: dense, proj<keep> (TEAL
    calibrated by the cell), sel<keep>, window<keep> or both<proj keep>/<kv keep>, with the
    selectors' default fields (the cell's `obs` sets the observation window)."""
    try:
        c = SparsityConfig.parse(text)
    except InputError as e:
        raise InputError(f"mode '{text}': {e}") from None
    p, kv = c.projection, c.kv
    if (c.kind not in CELL_KINDS or (p is not None and p.keep in (None, 1.0)) or c.adapter is not None
            or (kv is not None and kv.keep == 1.0)
            or (kv is not None and (kv.params or kv.method not in ("snapkv", "window")))):
        raise InputError(f"mode '{text}': a timing cell runs dense, proj<keep>, sel<keep>, window<keep> or "
                         "both<proj keep>/<kv keep> (e.g. both0.5/0.3) with keeps below 1, without files or selector fields")
    return c


# -- the cell's configuration ---------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class CellSpec:
    """One timing cell (App. A 'Timing'). model: a name, path or config ref that
    `sparsedecode.load` takes; context: n tokens; mode: a configuration's text (`cell_config`);
    attention: the decode attention path; fill: 'prefill' or 'random'; compile_mode:
    '' for torch.compile's default (CUDA only; CPU runs eagerly); text: a folder or
    file for the token stream and the calibration text; calib_tokens: projection
    calibration tokens; obs: the selection's observation window; kernels: kernel options
    that differ from the defaults, as `--kernels` reads them ('' = the defaults; stored in
    canonical form); impl: 'ours', or a peer (`timing.peer`): 'transformers', 'graph' (hand-written, CUDA graph);
    profile: steps to run under torch.profiler after the timed ones (0 = none; `timing.profile`);
    batch: sequences a step decodes (> 1: `timing.batch_cell`, the engine's B slots). campaign,
    block, group, cell (default: the mode's cell id) and order are campaign bookkeeping."""

    model: str
    init: str = "pretrained"
    dtype: str = "auto"
    device: str = "auto"
    context: int
    mode: str = "dense"
    attention: str = "split_k"
    warmup: int = 5
    repeats: int = 5
    steps: int = 50
    fill: str = "prefill"
    compile_mode: str = ""
    text: str | None = None
    calib_tokens: int = 2048
    obs: int = 64
    seed: int = 0
    kernels: str = ""
    impl: str = "ours"
    profile: int = 0
    shared_gpu: str = "refuse"  # timing.neighbors: refuse a GPU other processes hold, or allow and record
    batch: int = 1
    adapter: str = ""  # a LoRA adapter folder, or 'random:r16:all' (projection.lora.random_spec); '' = none
    method: str = "teal"  # what calibrates a proj<keep>: teal (seven projections), cats or sats (SiLU(gate))
    campaign: str = ""
    block: int = 0
    group: str = ""
    cell: str = ""
    order: int = 0

    def __post_init__(self):
        mode = cell_config(self.mode)
        object.__setattr__(self, "mode", str(mode))
        object.__setattr__(self, "kernels", kernels_text(self.kernels))
        if not self.cell:
            object.__setattr__(self, "cell", mode.cell)
        for name, choices in (("init", INITS), ("fill", FILLS), ("attention", ATTENTION), ("impl", IMPLS)):
            if getattr(self, name) not in choices:
                raise InputError(f"{name} '{getattr(self, name)}' is not one of {', '.join(choices)}")
        for name, low in (("context", 1), ("warmup", 0), ("repeats", 1), ("steps", 1),
                          ("calib_tokens", 1), ("obs", 1), ("seed", 0), ("block", 0), ("order", 0),
                          ("profile", 0), ("batch", 1)):
            v, high = getattr(self, name), 2**63 - 1 if name == "seed" else 4096 if name == "batch" else 10**9
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise InputError(f"{name} must be an integer in [{low}, {high:,}], got {v!r}")
        check_alone([], self.shared_gpu)  # the policy's own check
        if mode.proj_method and self.calib_tokens < MIN_TOKENS:  # before a load it would waste
            raise InputError(f"calib_tokens {self.calib_tokens}: {mode} calibrates its thresholds on at "
                             f"least {MIN_TOKENS} tokens (--calib-tokens, or calib_tokens in a campaign spec)")
        if self.profile >= self.generated:
            raise InputError(f"profile {self.profile} steps: a cell decodes {self.generated} tokens "
                             "(warmup + repeats x steps) and profiles after one unprofiled step; "
                             f"profile at most {self.generated - 1}")
        if self.batch > 1:
            check_batch_cell(self, mode)
        if self.adapter and self.impl != "ours":
            raise InputError(f"adapter: a LoRA adapter merges into our engine's weights, not the '{self.impl}' "
                             "peer's; drop the adapter from that cell")
        if self.adapter:
            from sparsedecode.projection.lora import check_adapter_ref

            check_adapter_ref(self.adapter)  # a bad folder or name fails before the model loads
        check_method(self.method, mode, self.batch, self.impl)
        if self.method == "sats" and mode.proj_method:
            from sparsedecode.projection.calibrate import get_calibrator

            least = get_calibrator("sats", keep=0.5).error_tokens  # its per-layer error needs these
            if self.calib_tokens < least:
                raise InputError(f"calib_tokens {self.calib_tokens}: SATS calibrates on at least {least} tokens "
                                 "(--calib-tokens, or calib_tokens in a campaign spec)")
        if self.profile and self.impl != "ours":
            raise InputError(f"profile: only our own step is profiled, not the '{self.impl}' peer; "
                             "drop profile from that cell or grid")

    @property
    def parsed(self) -> SparsityConfig:
        return cell_config(self.mode)

    @property
    def kernel_options(self):
        from sparsedecode.kernels.options import KernelOptions

        return KernelOptions.parse(self.kernels)

    @property
    def generated(self) -> int:
        """Tokens the cell decodes: warm-up plus timed steps."""
        return self.warmup + self.repeats * self.steps


def check_method(method: str, mode: SparsityConfig, batch: int = 1, impl: str = "ours") -> None:
    """A cell's calibration method: teal, or cats/sats (SATS §3.1: thresholds on |SiLU(gate)|, the
    attention projections dense) for a mode with a projection keep, one sequence, our own step."""
    if method not in CELL_METHODS:
        raise InputError(f"method '{method}' is not one of {', '.join(CELL_METHODS)} (what calibrates a "
                         "proj<keep> cell's thresholds)")
    if method == "teal":
        return
    if not mode.proj_method:
        raise InputError(f"method '{method}' calibrates a projection keep; mode {mode} has none: give proj<keep> "
                         "or both<proj keep>/<kv keep>, or method teal")
    if batch > 1 or impl != "ours":
        raise InputError(f"method '{method}': CATS/SATS thresholds run in our one-sequence step; give batch 1 and "
                         "impl 'ours', or method teal")


def check_batch_cell(spec: CellSpec, mode: SparsityConfig) -> None:
    """InputError unless a cell of `spec.batch` > 1 sequences is one the batch engine runs (issue 44):
    our own step under split-K attention, TEAL thresholds and scored selection."""
    where = f"batch {spec.batch}"
    if spec.impl != "ours":
        raise InputError(f"{where}: the '{spec.impl}' peer times one sequence; give impl 'ours' or batch 1")
    if spec.attention != "split_k":
        raise InputError(f"{where}: a batch step reads its rows through split_k attention; "
                         f"attention '{spec.attention}' runs one sequence")
    if mode.kv_method == "window":
        raise InputError(f"{where}: window selection in a decode batch is not built; give sel<keep> (SnapKV)")


def kernels_text(text: str | None) -> str:
    """The canonical `--kernels` text of the options `text` sets ('' for the defaults)."""
    from sparsedecode.kernels.options import KernelOptions

    label = KernelOptions.parse(text or "").label()
    return "" if label == "default" else label


def model_window(model, init: str = "pretrained") -> tuple[str, int | None]:
    """(name, max_position_embeddings) of a model reference without loading it;
    None when only a load can tell (a hub id not in the known table)."""
    from sparsedecode.account.dims import load_config
    from sparsedecode.account.known import KNOWN_MODELS, known_model

    if isinstance(model, dict):
        return str(model.get("_name_or_path") or model.get("model_type")), model.get("max_position_embeddings")
    ref = str(model)
    path = Path(ref).expanduser()
    if ref.endswith(".gguf") and path.is_file():
        from sparsedecode.models.gguf import read_header

        header = read_header(path)
        arch = header.get("general.architecture")
        return path.stem, header.get(f"{arch}.context_length")
    if path.is_dir() or path.name == "config.json":
        cfg, name = load_config(path)
        return name, cfg.get("max_position_embeddings")
    if ref.lower() in KNOWN_MODELS or any(ref.lower() == m.hub_id.lower() for m in KNOWN_MODELS.values()):
        km = known_model(ref)
        return km.name, km.config.get("max_position_embeddings")
    return ref, None


def check_fits(spec: CellSpec) -> None:
    """InputError unless context + generated fits the model window and the KV budget holds
    the sinks and the observation window (the selector's own rule). Imports torch only for
    the KV modes."""
    if spec.impl != "ours":
        from sparsedecode.timing.peer import check_peer

        check_peer(spec)
    name, window = model_window(spec.model, spec.init)
    n, g = spec.context, spec.generated
    if window and n + g > window:
        raise InputError(
            f"context {n} + {g} generated tokens exceeds the {window}-token window of {name}; "
            f"use at most {window - g}"
        )
    mode = spec.parsed
    if mode.kv_method:
        from sparsedecode.kv.select import get_selector

        get_selector(mode.kv_method, window=spec.obs).budget(n, mode.kv_keep, g)


# -- running a cell ----------------------------------------------------------------
def run_cell(spec: CellSpec, log=None) -> dict:
    """Run one cell in this process and return its 'timing_cell' record (stamped).
    `log` (a callable taking a line) hears the stages."""
    import torch

    import sparsedecode
    from sparsedecode.account.crossover import bounds
    from sparsedecode.engine.device import resolve_device
    from sparsedecode.records import stamp

    if spec.batch > 1:
        from sparsedecode.timing.batch_cell import run_batch_cell

        check_fits(spec)
        return run_batch_cell(spec, log)
    if spec.impl != "ours":
        from sparsedecode.timing.peer import run_peer_cell

        check_fits(spec)  # check_peer, and the model window
        return run_peer_cell(spec, log)
    say = log or (lambda line: None)
    started = process_age_s()  # the process's start and imports: part of what a cell costs
    mode = spec.parsed
    check_fits(spec)
    n, generated = spec.context, spec.generated
    dev = resolve_device(spec.device)
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    t = time.perf_counter()
    if cuda:  # refuse before loading; watched() looks again just before and after the timed steps
        torch.empty(1, device=dev)  # hold a context first, as neighbors() assumes
        check_alone(neighbors(device_uuid(dev)), spec.shared_gpu)
    cuda_init_s = time.perf_counter() - t

    # sdpa_fused slices the cache with host bounds: compiled with a dynamic length, but no CUDA
    # graph can hold a slice whose shape changes every step (the record's runtime says so).
    compile_ = (spec.compile_mode or True) if cuda else False
    t = time.perf_counter()
    eng = sparsedecode.load(spec.model, device=dev, dtype=spec.dtype, init=spec.init, max_len=n + generated,
                            attention=spec.attention, compile=compile_, seed=spec.seed, quiet=True,
                            kernels=spec.kernel_options, adapter=spec.adapter or None)
    sync()
    # where a cell's time goes, in run order (timing.run_conditions): process start to here, the CUDA
    # context and the neighbor probe, then each stage; after_s is the end (bounds, the record)
    one_time = {"start_s": started, "cuda_init_s": cuda_init_s, "load_s": time.perf_counter() - t,
                "calibrate_s": 0.0, "prefill_s": 0.0, "select_s": 0.0, "select_warm_s": 0.0,
                "keep_s": 0.0, "capture_s": 0.0, "after_s": 0.0}
    say(f"loaded {eng!r} in {one_time['load_s']:.1f} s")
    ids, stream = _stream(eng, spec)

    thresholds, calibration = None, None
    if mode.proj_method:  # before the fill: calibration runs its own passes over the cache
        t = time.perf_counter()
        thresholds, calibration = calibrate_own(eng, spec, mode.proj_keep)
        sync()
        one_time["calibrate_s"] = time.perf_counter() - t
        say(f"calibrated {spec.method} {mode.proj_keep:g} on {calibration['ids']} in {one_time['calibrate_s']:.1f} s")

    t = time.perf_counter()
    _fill(eng, spec, ids)
    sync()
    one_time["prefill_s"] = time.perf_counter() - t
    say(f"filled {n} tokens ({spec.fill}) in {one_time['prefill_s']:.1f} s")

    if thresholds is not None:
        eng.configure(mode, thresholds=thresholds)  # the projection branch; the cell selects itself
    budget, selection = n, None
    if mode.kv_method:
        sel = eng.select_kv(mode.kv_method, mode.kv_keep, generated, window=spec.obs)
        budget = sel.budget
        one_time["select_s"] = sel.select_s  # the process's first selection: kernels load on the way
        eng.seek(n)  # the same selection again, as every later request of a process pays it
        again = eng.select_kv(mode.kv_method, mode.kv_keep, generated, window=spec.obs)
        selection = {"first_s": sel.select_s, "first_phases": sel.phases,
                     "warm_s": again.select_s, "warm_phases": again.phases}
        one_time["select_warm_s"] = again.select_s
    realized, mlp_keep = 1.0, None
    if thresholds is not None:
        t = time.perf_counter()
        realized = _tracked_keep(eng, n, ids[n : n + min(KEEP_STEPS, generated)])
        if spec.method != "teal":  # the MLP's weight keep: the seven projections' reads it makes
            mlp_keep, realized = realized, seven_projection_keep(eng.dims, realized)
        sync()
        one_time["keep_s"] = time.perf_counter() - t

    eng.seek(n, ids[n])
    t = time.perf_counter()
    eng.decode_replay()  # the first call compiles and captures; it rewrites slot n, as step 1 does
    if eng.host_len and eng.compile:  # a second length compiles the dynamic-length graph
        eng.seek(n + 1)
        eng.decode_replay()  # rewrites slot n + 1, as step 2 does before reading it
        eng.seek(n)
    sync()
    one_time["capture_s"] = time.perf_counter() - t
    step_ms, seen = watched(dev, spec.shared_gpu, lambda: _time_steps(eng, ids[n:], spec, cuda))
    t_after = time.perf_counter()
    if seen["before"] is None:
        say("could not tell whether other processes share the GPU (no NVML, no nvidia-smi)")
    profiled = None
    if spec.profile:  # the same positions again: the profiled steps read what the timed ones read
        from sparsedecode.timing.profile import profile_steps

        eng.seek(n, ids[n])
        toks = iter(ids[n:])
        profiled = profile_steps(lambda: eng.decode_step(next(toks)), spec.profile, cuda, None)
        say(f"profiled {spec.profile} steps: {profiled['step_us']:.0f} us a step, "
            f"{profiled['gap_us']:.0f} us of it gaps")

    tps = [1e3 / ms for ms in step_ms]
    med = statistics.median(step_ms)
    size = eng.dtype.itemsize
    kv_read = min((budget + generated) / n, 1.0)
    nbytes = timed_step_bytes(eng.dims, n, realized, kv_read, size, size)
    b = bounds(eng.dims, n, realized, kv_read, weight_bytes=size, kv_bytes=size)
    bound = {"dense": 1.0, "proj": b.projection, "sel": b.kv, "window": b.kv, "both": b.both}[mode.kind]
    rec = {
        **engine_fields(spec, eng, mode, dev),
        "compile_mode": spec.compile_mode,
        "compiled": eng.compile,
        "runtime": eng.step_runtime,
        "context": n,
        "generated": generated,
        "fill": spec.fill,
        "stream": stream,
        "protocol": f"{spec.warmup} warm-up steps, {spec.repeats} repeats x {spec.steps} steps, "
                    + ("CUDA events" if cuda else "perf_counter"),
        "step_ms_runs": step_ms,
        "tokens_per_sec_runs": tps,
        "tokens_per_sec": statistics.fmean(tps),
        "ms_per_token": 1e3 / statistics.fmean(tps),
        "step_ms_median": med,
        "realized_projection_keep": realized,
        "realized_mlp_keep": mlp_keep,  # CATS/SATS: gate whole, up and down in kept channels; None for TEAL
        "kv_budget": budget,
        "kv_read_fraction": kv_read,
        "bytes_per_step": nbytes,
        "byte_bound": bound,
        "achieved_gbps": nbytes / (med * 1e-3) / 1e9,
        "peak_memory_bytes": peak_memory(dev),
        "one_time": one_time,
        "phases": {"load": eng.load_phases, "capture": eng.capture_phases},  # where load_s and capture_s went
        "selection": selection,  # the KV selection's first and warm cost by phase; None without one
        "calibration": calibration,
        "gpu_neighbors": seen,  # other processes on the GPU around the timed steps; None = unknown
        "profile": profiled,  # `timing.profile`: the step's kernels by kind; None unless asked
        "spec": asdict(spec),
    }
    one_time["after_s"] = time.perf_counter() - t_after
    return stamp(rec)


def failed_record(fields: dict, exc: BaseException, lines: int = 20) -> dict:
    """A 'timing_cell' record with status 'failed': the cell's fields as given, the error
    and the last `lines` lines of its traceback."""
    from sparsedecode.records import stamp

    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip().splitlines()
    refused = {"refused": "shared_gpu"} if isinstance(exc, SharedGpu) else {}  # not the cell's fault
    return stamp({"kind": "timing_cell", "status": "failed", **fields, **refused,
                  "error": f"{type(exc).__name__}: {exc}", "traceback": "\n".join(tb[-lines:])})


def _stream(eng, spec: CellSpec) -> tuple[list[int], str]:
    """n + generated token ids of the stream (`cell_fields.stream_ids`)."""
    return stream_ids(eng, spec, spec.context + spec.generated)


def _fill(eng, spec: CellSpec, ids: list[int]) -> None:
    """Cache positions [0, n): a dense prefill in chunks of 512, or seeded normal keys and
    values with the last `obs` positions prefilled for real (the observation window)."""

    n = spec.context
    if spec.fill == "prefill":
        eng.prefill(ids[:n], chunk=PREFILL_CHUNK)
        return
    eng.fill_random_(spec.seed)
    w = min(spec.obs, n)
    eng.prefill(ids[n - w:n], chunk=PREFILL_CHUNK, start=n - w)


KEEP_STEPS = 8  # eager tracked steps that measure the realized projection keep


def seven_projection_keep(dims, mlp_keep: float) -> float:
    """The keep over the seven projections' weights of a step that reads the MLP's (gate, up,
    down) at `mlp_keep` and the attention projections whole (CATS/SATS, SATS §3.2)."""
    from sparsedecode.projection.thresholds import act_keep_of_mlp, cats_projection_keep

    return cats_projection_keep(dims, act_keep_of_mlp(dims, mlp_keep))


def _tracked_keep(eng, n: int, tokens) -> float:
    """Projection keep realized by eager decode steps at positions n, n+1, ... feeding
    `tokens` (App. A 'Timed reads'), pooled over the steps by the sparse modules' counters
    (one token alone is noisy); tracking is off again for the timed steps, which rewrite
    the same cache slots."""
    with eng.tracking_keep() as realized:
        for i, token in enumerate(tokens):
            eng.seek(n + i, token)
            eng.eager_step()  # slot n + i: the timed steps rewrite it
        return realized()


def _time_steps(eng, toks: list[int], spec: CellSpec, cuda: bool) -> list[float]:
    """Mean ms per step of each of `repeats` blocks of `steps` decode steps, after `warmup`
    steps, feeding toks (the stream from position n) one per step. On CUDA each step is a
    graph replay plus two fills of the static token and position buffers; no host sync."""
    from sparsedecode.timing.clock import time_blocks

    it = iter(toks)
    return time_blocks(lambda: eng.decode_step(next(it)), spec.warmup, spec.repeats, spec.steps, cuda)


__all__ = ["ATTENTION", "CELL_METHODS", "FILLS", "CellSpec", "cell_config", "check_fits", "check_method", "failed_record", "model_window",
           "run_cell", "timed_step_bytes"]
