"""Where a CPU decode step goes: the projection calls against the rest, dense and proj0.5.

Issue 46 asks proj0.5 (TEAL, all seven projections) for 1.35x our dense CPU step. Only the
projection calls read fewer bytes at a lower keep; the LM head, attention over the cache, the
norms, RoPE and the Python of the step do not change. This measures, in one process and with the
two engines interleaved round by round, the wall time of a decode step and the part of it spent
inside the projection calls (`kernels.cpu_gemv`'s entries, timed around each call), and so the
Amdahl bound of the projection branch on this step: the dense step with its projection time
scaled by the realized keep, step / (step - projections x (1 - keep)). That bound assumes the
calls' time falls with their bytes; the sparse engine's own projection time says how far it does.

    PYTHONPATH=src python benchmarks/cpu_step_split.py --out benchmarks/records/cpu/decode
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from sparsedecode.corpus import wikitext_path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--config", default="proj0.5")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/records/cpu/decode"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    import sparsedecode
    import sparsedecode.projection.sparse_linear as sl
    from sparsedecode.records import stamp, write_record

    inside = [0.0]

    def timed(fn):
        def call(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                inside[0] += time.perf_counter() - t
        return call

    # the module-level names SparseLinear and SparseConcat call for one token on CPU
    sl.sparse_gemv_cpu = timed(sl.sparse_gemv_cpu)
    sl.sparse_gemv_segs_cpu = timed(sl.sparse_gemv_segs_cpu)

    engines = {"dense": sparsedecode.load(a.model, device="cpu", dtype="float32", quiet=True)}
    engines[a.config] = sparsedecode.load(a.model, device="cpu", dtype="float32", quiet=True, config=a.config)
    eng = engines["dense"]
    ids = eng.tokenizer(wikitext_path("test").read_text(encoding="utf-8")[: 40 * a.context])["input_ids"]
    ids = torch.tensor(ids[: a.context + a.steps + 4])
    prompt, feed = ids[: a.context], ids[a.context:]

    def split(e) -> tuple[float, float]:
        e.reset()
        e.prefill(prompt)
        for t in feed[:4]:
            e.decode_step(int(t))  # warm
        inside[0] = 0.0
        t0 = time.perf_counter()
        for t in feed[4:]:
            e.decode_step(int(t))
        return (time.perf_counter() - t0) / a.steps * 1e3, inside[0] / a.steps * 1e3

    with engines[a.config].tracking_keep() as keep_of:  # untimed: the keep of the same steps
        split(engines[a.config])
        keep = keep_of()
    runs = {k: [] for k in engines}
    for r in range(a.rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            runs[name].append(split(engines[name]))
    rows = {}
    for name, xs in runs.items():
        step = statistics.median(x[0] for x in xs)
        proj = statistics.median(x[1] for x in xs)
        rows[name] = {"step_ms": step, "projection_ms": proj, "rest_ms": step - proj, "runs": xs,
                      "kernels": engines[name].kernels.to_dict(), "runtime": engines[name].projection_runtime()}
        print(f"{name}: step {step:.2f} ms, projection calls {proj:.2f} ms, rest {step - proj:.2f} ms")
    d = rows["dense"]
    bound = d["step_ms"] / (d["step_ms"] - d["projection_ms"] * (1 - keep))
    measured = d["step_ms"] / rows[a.config]["step_ms"]
    print(f"{a.config}: realized keep {keep:.3f}; Amdahl bound on this step {bound:.2f}x; measured {measured:.2f}x; "
          f"its projection calls {rows[a.config]['projection_ms'] / d['projection_ms']:.2f} of dense's")
    rec = stamp({
        "kind": "cpu_step_split", "device": "CPU", "model": a.model, "dtype": "float32", "threads": a.threads,
        "context": a.context, "steps": a.steps, "rounds": a.rounds, "config": a.config,
        "prompt": "first tokens of the WikiText-2 raw test split; the steps feed the tokens that follow",
        "realized_keep": keep, "rows": rows, "amdahl_bound": bound, "measured_speedup": measured,
        "amdahl_bound_of": "dense step / (dense step - dense projection calls x (1 - realized keep))",
        "projection_ms_of": "wall time inside kernels.cpu_gemv's sparse_gemv_cpu and sparse_gemv_segs_cpu "
                            "(Python wrapper and C call), per decode step",
        "order": "rounds alternate the engines' order",
    })
    path = Path(a.out) / f"cpu_step_split_{a.model}_ctx{a.context}_t{a.threads}_{rec['timestamp'].replace(':', '')}.json"
    write_record(path, rec)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
