"""Compile the default sparse GEMV config of gate_up on this GPU; print ptxas's register count
and write the PTX into the folder given (issue 4: the same PTX took 96 or 151 registers).

    PYTHONPATH=src python3 benchmarks/device/dump_sparse_gemv_kernel.py OUT
"""

from __future__ import annotations

import os
import sys

import torch

from sparsedecode.kernels import sparse_gemv as sg


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    K, N = 4096, 14336
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    cfg = sg.default_config(K, N, torch.bfloat16, x.device)
    print("cfg", cfg)
    t = torch.tensor(float(x.float().abs().quantile(0.5)), device="cuda")
    sg.sparse_gemv(x, w, t, ws=sg.workspace(N, x.device), config=cfg)
    torch.cuda.synchronize()
    for cache in sg._sparse_gemv_kernel.device_caches.values():
        for compiled in cache[0].values():
            print("n_regs", compiled.n_regs, "spills", compiled.n_spills, "shared", compiled.metadata.shared,
                  "warps", compiled.metadata.num_warps)
            with open(os.path.join(out, "k.ptx"), "w") as f:
                f.write(compiled.asm["ptx"])


if __name__ == "__main__":
    main()
