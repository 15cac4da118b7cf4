"""Dense decode step of llama-3.1-8b dims on one GPU: our engine against compiled transformers.

ByteCross App. A timing: random-init weights (bytes per step do not depend on
values), bf16, batch 1, the decode step captured in a CUDA graph, 5 warm-up
steps, then 5 repeats of 50 steps timed with CUDA events; one JSON record per
(impl, context) with step time and achieved GB/s counting weights, KV of the
valid context and the LM head (account.traffic.step_bytes, Eq. 1-4).

- ours: `sparsedecode.load(init="random")`, the compiled decode step captured
  by the engine. One engine with a cache of max(contexts)+new tokens serves
  every context: the position lives in a device tensor and split-K attention
  reads only [0, n+1), so one compile and one graph cover all contexts.
- transformers: `LlamaForCausalLM` from the same config (random init, bf16)
  with a `StaticCache` of n+new tokens per context and its forward under
  `torch.compile(mode="reduce-overhead")`, the recipe transformers documents.
  A failure is recorded as an error, never a crash.

The cache is filled with random K/V (`--fill random`, the default: a 128K
prefill would take most of the time budget), or by a chunked prefill of random
token ids (`--fill prefill`, ours only; the peer is always random-filled).
Cells still pending when `--budget-s` runs out are recorded as skipped.

    PYTHONPATH=src python benchmarks/dense_decode_h200.py --out benchmarks/records/h200
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import traceback
from pathlib import Path

import torch

from sparsedecode.account.dims import ModelDims
from sparsedecode.account.known import known_model
from sparsedecode.account.traffic import step_bytes
from sparsedecode.account.units import parse_token_list
from sparsedecode.records import stamp, write_record
from sparsedecode.timing.clock import time_blocks

TARGETS_MS = {2048: 4.1, 32768: 5.2, 131072: 8.7}  # issue 3: >= 90% of 4.15 TB/s


def time_steps(step, warmup: int, repeats: int, steps: int) -> list[float]:
    """Per-step ms of `repeats` timed blocks of `steps` calls, after `warmup` calls (CUDA events)."""
    return time_blocks(step, warmup, repeats, steps, cuda=True)


def summary(ms: list[float], dims: ModelDims, n: int) -> dict:
    med = statistics.median(ms)
    b = step_bytes(dims, n, weight_bytes=2, kv_bytes=2)
    return {"step_ms": ms, "step_ms_median": med, "tok_s": 1e3 / med,
            "bytes": b.to_dict(), "achieved_GBps": b.total / (med * 1e-3) / 1e9,
            "target_ms": TARGETS_MS.get(n)}


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def run_ours(a, dims, contexts, write, deadline):
    import sparsedecode

    t0 = time.perf_counter()
    eng = sparsedecode.load(a.model, device="cuda", dtype="bfloat16", init="random",
                            max_len=max(contexts) + a.new, attention=a.attention,
                            compile=(a.compile_mode or True) if a.compile else False)
    load_s = time.perf_counter() - t0
    if a.fill == "random":
        gen = torch.Generator("cuda").manual_seed(0)
        for layer in eng.model.layers:
            layer.self_attn.cache.k.normal_(generator=gen)
            layer.self_attn.cache.v.normal_(generator=gen)
    for n in contexts:
        cell = {"impl": "ours", "context": n, "load_s": load_s, "attention": a.attention,
                "compile": eng.compile, "compile_mode": eng.compile_mode,
                "cuda_graph": eng.cuda_graph, "fill": a.fill}
        if time.perf_counter() > deadline:
            write(cell, skipped="time budget spent")
            continue
        try:
            if a.fill == "prefill":
                ids = torch.randint(0, dims.vocab, (n,), generator=torch.Generator().manual_seed(n))
                t = time.perf_counter()
                eng.prefill(ids)
                torch.cuda.synchronize()
                cell["prefill_s"] = time.perf_counter() - t
            eng.pos = n
            eng._pos.fill_(n)  # the step writes slot n and attends [0, n+1)
            eng._tok.fill_(1)
            t = time.perf_counter()
            eng.decode_replay()  # first call compiles and captures
            torch.cuda.synchronize()
            cell["capture_s"] = time.perf_counter() - t
            ms = time_steps(eng.decode_replay, a.warmup, a.repeats, a.steps)
            write({**cell, **summary(ms, dims, n)})
            if a.profile and n == min(contexts):
                profile_step(eng.decode_replay)
        except Exception as e:  # keep going: the other cells are still worth having
            write(cell, error=f"{type(e).__name__}: {e}", tb=traceback.format_exc(limit=6))
    del eng
    free()


def profile_step(step, steps: int = 20, rows: int = 25) -> None:
    """Print where a replayed decode step spends GPU time, kernel by kernel."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    print(f"GPU time of {steps} steps by kernel:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))


def run_transformers(a, dims, contexts, write, deadline):
    from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

    cfg = dict(known_model(a.model).config)
    config = AutoConfig.for_model(**cfg)
    t0 = time.perf_counter()
    try:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    except Exception as e:
        for n in contexts:
            write({"impl": "transformers", "context": n}, error=f"build failed: {type(e).__name__}: {e}")
        return
    load_s = time.perf_counter() - t0
    fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    for n in contexts:
        cell = {"impl": "transformers", "context": n, "load_s": load_s, "fill": "random",
                "cache": "StaticCache", "compile": "reduce-overhead", "attn_implementation":
                getattr(model.config, "_attn_implementation", None)}
        if time.perf_counter() > deadline:
            write(cell, skipped="time budget spent")
            continue
        cache = None
        try:
            cache = StaticCache(config=model.config, max_cache_len=n + a.new)
            with torch.inference_mode():  # one eager token allocates the cache layers
                model(input_ids=torch.zeros(1, 1, dtype=torch.long, device="cuda"),
                      cache_position=torch.zeros(1, dtype=torch.long, device="cuda"),
                      past_key_values=cache, use_cache=True)
                gen = torch.Generator("cuda").manual_seed(0)
                for layer in cache.layers:  # inference tensors: fill them in inference mode
                    layer.keys.normal_(generator=gen)
                    layer.values.normal_(generator=gen)
            step = _hf_step(fwd, cache, n)
            t = time.perf_counter()
            for _ in range(3):  # compile, record, replay
                step()
            torch.cuda.synchronize()
            cell["capture_s"] = time.perf_counter() - t
            ms = time_steps(step, a.warmup, a.repeats, a.steps)
            write({**cell, **summary(ms, dims, n)})
        except Exception as e:
            write(cell, error=f"{type(e).__name__}: {e}", tb=traceback.format_exc(limit=6))
        finally:
            cache = None
            free()


def _hf_step(fwd, cache, n: int):
    """One compiled transformers decode step at position n, on static input tensors."""
    tok = torch.ones(1, 1, dtype=torch.long, device="cuda")  # (1, 1)
    cpos = torch.tensor([n], dtype=torch.long, device="cuda")  # (1,)
    pids = cpos.view(1, 1)

    def step():
        torch.compiler.cudagraph_mark_step_begin()
        with torch.inference_mode():
            return fwd(input_ids=tok, position_ids=pids, cache_position=cpos,
                       past_key_values=cache, use_cache=True).logits

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--contexts", default="2K,32K,128K", help="comma list, K = 1024")
    ap.add_argument("--new", type=int, default=64, help="cache slack for generated tokens")
    ap.add_argument("--impls", default="ours,transformers")
    ap.add_argument("--attention", default="split_k")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="torch.compile our decode step before capturing it")
    ap.add_argument("--fill", choices=["random", "prefill"], default="random")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--compile-mode", default=None,
                    help="torch.compile mode of our step, e.g. max-autotune-no-cudagraphs")
    ap.add_argument("--profile", action="store_true", help="print a kernel profile of our step")
    ap.add_argument("--budget-s", type=float, default=450.0, help="skip cells after this")
    ap.add_argument("--out", default="benchmarks/records/h200")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    contexts = parse_token_list(a.contexts)
    # A context plus its generated tokens must fit the model window (Llama-3.1: 131,072),
    # so "128K" is timed at 131,072 - new tokens; each record holds the context it ran at.
    window = known_model(a.model).config["max_position_embeddings"]
    contexts = [min(n, window - a.new) for n in contexts]
    dims = ModelDims.known(a.model)
    deadline = time.perf_counter() + a.budget_s
    run_id = time.strftime("%Y%m%dT%H%M%S")
    out = Path(a.out)

    def write(cell: dict, **extra) -> None:
        rec = stamp({
            "kind": "dense_decode_bench",
            "model": {"name": a.model, "dims": dims.to_dict(), "init": "random"},
            "dtype": "bfloat16", "batch": 1, "new_tokens_slack": a.new,
            "protocol": f"{a.warmup} warm-up steps, {a.repeats} repeats x {a.steps} steps, CUDA events",
            "run_id": run_id, **cell, **extra,
        })
        path = out / f"dense_{cell['impl']}_{cell['context']}_{run_id}.json"
        write_record(path, rec)
        if "step_ms_median" in cell:
            tgt = cell.get("target_ms")
            print(f"{cell['impl']:>12} n={cell['context']:>6}: {cell['step_ms_median']:.3f} ms/step, "
                  f"{cell['achieved_GBps']:.0f} GB/s" + (f" (target <= {tgt} ms)" if tgt else ""))
        else:
            print(f"{cell['impl']:>12} n={cell['context']:>6}: {extra}")

    impls = [s.strip() for s in a.impls.split(",") if s.strip()]
    if "ours" in impls:
        run_ours(a, dims, contexts, write, deadline)
    if "transformers" in impls:
        run_transformers(a, dims, contexts, write, deadline)
    free()


if __name__ == "__main__":
    main()
