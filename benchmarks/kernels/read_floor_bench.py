"""The floor under the sparse GEMV's byte-time target: one launch reading the same bytes, nothing else.

For each cell of `sparse_gemv_bench.py` (shape, keep: the same random x and quantile threshold,
so the same kept rows and the same bytes), a contiguous buffer of exactly those bytes is read by
`read_floor.stream_sum` (beside this script) (no data-dependent addresses, no reduction across programs) in each
of its `CONFIGS`, plain and launched with PDL, and by `torch.sum`, timed as the GEMV is timed:
`--copies` distinct buffers (beating the 50 MB L2) x `--rounds` calls back to back in one CUDA
graph, the median per call over `--reps` replays. The least of them is the floor: no kernel that
must read those bytes in one launch did better here, least of all one that picks its rows from x
and sums across programs. Its ratio to the byte time (bytes / 4.15 TB/s) says how much of the
1.15x target (ByteCross §4.1, App. A; issue 4) any single launch leaves to the GEMV's own work.

  PYTHONPATH=src python3 benchmarks/kernels/read_floor_bench.py --out DIR [--shapes gate_up down] [--keeps 1 0.5 0.3]

Writes one record of kind 'read_floor_bench' per cell and config into DIR, and all of them as one
JSON list in DIR/read_floor_records.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics

import torch
from read_floor import CONFIGS, label, programs, stream_sum, stream_sum_ref  # beside this script
from sparse_gemv_bench import (
    BYTE_RATE,
    SHAPES,
    TARGET,
    add_cell_args,
    cell_input,
    quantile_threshold,
    time_calls,
)

from sparsedecode.records import stamp, write_record

COMBINED = "read_floor_records.json"


def kept_rows(K: int, keep: float, dev: torch.device) -> int:
    """The kept channel count of sparse_gemv_bench's cell: the same seeded x, the same quantile."""
    x, _ = cell_input(K, dev)
    return int((x.float().abs() > quantile_threshold(x, keep)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cell_args(ap)  # as sparse_gemv_bench.py: --out, --shapes, --keeps, --copies, --rounds, --reps
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("read_floor_bench.py times a CUDA kernel: run it on a machine with a GPU")
    if (args.out / COMBINED).exists():
        raise SystemExit(f"{args.out / COMBINED} exists; records are never overwritten: pick a new --out")
    bad = [k for k in args.keeps if not 0.0 < k <= 1.0]
    if bad:
        raise SystemExit(f"--keeps: {bad} outside (0, 1]")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    run = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    records = []
    for name in args.shapes:
        K, N = SHAPES[name]
        for keep in args.keeps:
            kept = kept_rows(K, keep, dev)
            nbytes = kept * N * 2 + K * 2  # as sparse_gemv_bench counts the cell: kept rows and x
            n = nbytes // 2
            gen = torch.Generator(device=dev).manual_seed(kept)
            bufs = [torch.randn(n, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(args.copies)]
            out = torch.empty(max(programs(n, c, sms) for c in CONFIGS), device=dev)
            cells = [(label(c), c, pdl) for c in CONFIGS for pdl in (False, True)] + [("torch.sum", None, False)]
            best = None
            for lab, cfg, pdl in cells:
                if cfg is None:
                    fn = torch.sum
                else:
                    got = stream_sum(bufs[0], cfg, out, pdl=pdl, sm_count=sms)
                    want = stream_sum_ref(bufs[0], cfg, sms)
                    if not torch.allclose(got, want, rtol=1e-4, atol=1e-2):
                        raise AssertionError(f"{name} keep={keep} {lab}: per-program sums off by up to "
                                             f"{(got - want).abs().max().item():.3g}")

                    def fn(b, cfg=cfg, pdl=pdl, out=out):
                        return stream_sum(b, cfg, out, pdl=pdl, sm_count=sms)
                t = statistics.median(time_calls(fn, [(b,) for b in bufs] * args.rounds, args.reps))
                byte_time = nbytes / BYTE_RATE
                rec = stamp({"kind": "read_floor_bench", "run_id": run, "shape": name, "K": K, "N": N, "keep_target": keep,
                             "kept_rows": kept, "bytes_read": nbytes, "config_label": lab,
                             "config": None if cfg is None else list(cfg), "pdl": "early" if pdl else "off",
                             "programs": None if cfg is None else programs(n, cfg, sms), "sm_count": sms,
                             "copies": args.copies, "rounds": args.rounds, "reps": args.reps, "graph": True,
                             "time_s": t, "tb_per_s": nbytes / t / 1e12, "byte_rate": BYTE_RATE,
                             "byte_time_s": byte_time, "ratio_to_byte_time": t / byte_time, "target_ratio": TARGET})
                write_record(args.out / f"read_floor_bench-{name}-keep{keep:g}-{lab}-pdl{rec['pdl']}-{run}.json", rec)
                records.append(rec)
                if best is None or t < best["time_s"]:
                    best = rec
                print(f"{name:8s} keep={keep:<4g} {lab:18s} PDL {rec['pdl']:5s} {t * 1e6:7.2f} us  "
                      f"{rec['tb_per_s']:5.2f} TB/s  {t / byte_time:5.3f}x byte time", flush=True)
            print(f"{name:8s} keep={keep:<4g} floor {best['time_s'] * 1e6:.2f} us = {best['ratio_to_byte_time']:.3f}x "
                  f"byte time ({best['config_label']}, PDL {best['pdl']}; {nbytes / 1e6:.1f} MB)", flush=True)
            del bufs
            torch.cuda.empty_cache()
    write_record(args.out / COMBINED, records)


if __name__ == "__main__":
    main()
