"""CPU decode benchmark: our engine against transformers `generate` in the same run.

smollm2-135m (the embedded PyPI GGUF, dequantized to float32), a 1K-token
prefill of the WikiText-2 test stream, then greedy decoding of `--new` tokens
with EOS ignored, on `--threads` CPU threads (2 by default, the size of the
CI machines). Decode speed is steps per second after the first new token,
timed per token by a streamer for transformers and by the engine's own clock
for ours; each figure is the median of `--repeats` runs after one warm-up.
Ours runs twice: eager (the engine's CPU default) and with its decode step
under torch.compile (about a minute of compilation, paid once per process).

The peer is what a user would run: `model.generate` with its default dynamic
cache; the static-cache variant (`cache_implementation="static"`, eager, as
torch.compile on CPU is not what a user picks by default) is timed too.

    PYTHONPATH=src python benchmarks/cpu_decode.py --out benchmarks/records/cpu
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared/data/wikitext-2-raw/wiki.test.raw"
TARGET = 1.5  # issue 26: >= 1.5x transformers' generate at the defaults, 2 threads, 1K prompt, 128 tokens


def ours_decode(eng, ids, new: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one greedy generation with EOS ignored."""
    g = eng.generate(ids, max_new_tokens=new, stop_ids=())
    assert len(g.ids) == new
    return g.prompt_tok_s, g.decode_tok_s


def hf_decode(model, ids, new: int, **gen_kwargs) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of transformers' greedy `generate`, timed per token."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    clock = Clock()
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    out = model.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         streamer=clock, **gen_kwargs)
    assert out.shape[1] == len(ids) + new
    # put() #0 is the prompt, #1 the first new token (end of prefill), #new the last.
    first, last = clock.times[1], clock.times[-1]
    return len(ids) / (first - t0), (new - 1) / (last - first)


def measure_ours(a, compile: bool) -> tuple[list[int], Path, dict]:
    """(prompt ids, GGUF path, speeds) of our engine, eager or with a compiled decode step."""
    import sparsedecode

    eng = sparsedecode.load(a.model, device="cpu", dtype="float32", compile=compile or None, quiet=True)
    ids = eng.tokenizer(WIKITEXT.read_text(encoding="utf-8")[: 40 * a.context])["input_ids"][: a.context]
    assert len(ids) == a.context, "WikiText-2 test split too short for --context"
    ours_decode(eng, ids[:64], 8)  # warm-up (and compilation)
    pf, dec, runs = median_of(lambda: ours_decode(eng, ids, a.new), a.repeats)
    return ids, eng.source_path, {"compile": compile, "attention": eng.attention, "max_len": eng.max_len,
                                  "prefill_chunk": 512,
                                  "prefill_tok_s": pf, "decode_tok_s": dec, "runs": runs}


def median_of(fn, repeats: int) -> tuple[float, float, list]:
    runs = [fn() for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs), runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/records/cpu"))
    ap.add_argument("--no-static", action="store_true", help="skip the static-cache peer")
    ap.add_argument("--compile", action="store_true", help="also time ours with a torch.compile'd step")
    a = ap.parse_args()

    from sparsedecode.records import stamp, write_record

    torch.set_num_threads(a.threads)
    ids, src, ours = measure_ours(a, compile=False)
    print(f"ours (eager): prefill {ours['prefill_tok_s']:.1f} tok/s, decode {ours['decode_tok_s']:.2f} tok/s")
    ours_c = None
    if a.compile:
        _, _, ours_c = measure_ours(a, compile=True)
        print(f"ours (torch.compile): decode {ours_c['decode_tok_s']:.2f} tok/s")

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32).eval()
    hf_decode(hf, ids[:64], 8)  # warm-up
    h_pf, h_dec, h_runs = median_of(lambda: hf_decode(hf, ids, a.new), a.repeats)
    print(f"transformers (dynamic cache): prefill {h_pf:.1f} tok/s, decode {h_dec:.2f} tok/s")
    static = None
    if not a.no_static:
        kw = dict(cache_implementation="static")
        hf_decode(hf, ids[:64], 8, **kw)
        s_pf, s_dec, s_runs = median_of(lambda: hf_decode(hf, ids, a.new, **kw), a.repeats)
        static = {"prefill_tok_s": s_pf, "decode_tok_s": s_dec, "runs": s_runs}
        print(f"transformers (static cache): prefill {s_pf:.1f} tok/s, decode {s_dec:.2f} tok/s")

    best = max([ours] + ([ours_c] if ours_c else []), key=lambda r: r["decode_tok_s"])
    speedup = best["decode_tok_s"] / h_dec
    print(f"decode speedup over transformers generate (dynamic cache): {speedup:.2f}x "
          f"(eager {ours['decode_tok_s'] / h_dec:.2f}x; target {TARGET}x)")
    rec = stamp({
        "kind": "cpu_decode_bench",
        "device": "CPU",
        "model": {"name": a.model, "source": str(src.name), "init": "pretrained (GGUF Q4_1 dequantized)"},
        "dtype": "float32",
        "threads": a.threads,
        "context": a.context,
        "new_tokens": a.new,
        "repeats": a.repeats,
        "prompt": "first tokens of the WikiText-2 raw test split",
        "decoding": "greedy, EOS ignored; decode tok/s = (new-1) / time after the first new token",
        "ours": ours,
        "ours_compiled": ours_c,
        "transformers": {"cache": "dynamic (generate default)", "prefill_tok_s": h_pf,
                         "decode_tok_s": h_dec, "runs": h_runs},
        "transformers_static": static and {"cache": "static, eager", **static},
        "speedup_vs_transformers": speedup,
        "speedup_vs_transformers_eager": ours["decode_tok_s"] / h_dec,
        "speedup_of": "compiled" if best is ours_c else "eager",
        "target_speedup": TARGET,
        "target_met": speedup >= TARGET,
    })
    path = Path(a.out) / f"cpu_decode_{a.model}_ctx{a.context}_t{a.threads}_{rec['timestamp'].replace(':', '')}.json"
    write_record(path, rec)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
