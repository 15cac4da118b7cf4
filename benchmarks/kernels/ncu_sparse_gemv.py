"""A few calls of the sparse GEMV and of cuBLAS's dense GEMV on one shape, for Nsight Compute.

The profile target of issue 4's remaining gap (ByteCross §4.1: the projection branch's
speedup follows its byte bound up to fixed kernel costs): at keep 0.5 the kernel runs
about 1.3x its byte time on the H200 while dense cuBLAS runs about 1.05x. Run it under ncu:

    ncu --clock-control none -k regex:_sparse_gemv_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats --section LaunchStats \\
        python3 benchmarks/kernels/ncu_sparse_gemv.py --shape gate_up --keep 0.5

Each kernel runs `--calls` times on distinct weight copies (a copy is not in L2 when it
is read). `--pattern even` spreads the kept channels evenly (see sparse_gemv_bench.py).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sparse_gemv_bench import SHAPES, even_input  # the script's folder is on sys.path

from sparsedecode.kernels import sparse_gemv as sg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="gate_up")
    ap.add_argument("--keep", type=float, default=0.5)
    ap.add_argument("--pattern", choices=("random", "even"), default="random")
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--config", help="BLOCK_N,BLOCK_K,splits,warps,stages (default: the kernel's)")
    a = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    K, N = SHAPES[a.shape]
    gen = torch.Generator(device=dev).manual_seed(K)
    if a.pattern == "even":
        x, t = even_input(K, a.keep, dev, dtype, gen)
    else:
        x = torch.randn(1, K, device=dev, dtype=dtype, generator=gen)
        t = float(x.float().abs().quantile(1.0 - a.keep))
    thr = torch.tensor(t, device=dev)
    ws = sg.workspace(N, dev)
    cfg = tuple(int(v) for v in a.config.split(",")) if a.config else None
    w_ts = [torch.randn(K, N, device=dev, dtype=dtype, generator=gen) for _ in range(a.calls)]
    w_dense = [torch.randn(N, K, device=dev, dtype=dtype, generator=gen) for _ in range(a.calls)]
    torch.cuda.synchronize()
    for w in w_ts:
        sg.sparse_gemv(x, w, thr, ws=ws, config=cfg)
    for w in w_dense:
        F.linear(x, w)
    torch.cuda.synchronize()
    kept = int((x.float().abs() > thr).sum())
    print(f"{a.shape} K={K} N={N} keep {kept / K:.3f} ({a.pattern}); config {cfg or sg.default_config(K, N, dtype, dev)}; "
          f"byte time {(kept * N * 2 + K * 2) / 4.15e12 * 1e6:.1f} us, dense {(K * N * 2) / 4.15e12 * 1e6:.1f} us")


if __name__ == "__main__":
    main()
