"""Registers and spills of the sparse GEMV as a decode step launches it, with and without a LoRA
adapter (issue 45; docs/kernels/lora_gemv.md 'register cap'). No GPU needed: Triton compiles each
launch for sm_90 and `cuobjdump -res-usage` reads the cubin.

A step launches the kernel in four forms a layer (Llama-3.1-8B dims, bf16): q|k|v (three segments,
the input RMSNorm formed in the launch), o (the residual added), gate|up (two segments, the norm)
and down (SwiGLU's product formed in the load, the residual added); `plain` is what
`lora_gemv_bench.py` times (x given). Each is compiled with the launcher's own choices for a
device of `--sms` SMs named `--device-name` (`default_config`: the tuned table of that device, else
the default tiles and splits; the register cap `max_registers` of that grid), LORA off and on
(rank 16, specialised as launched). STACK > 0 means the cap made ptxas spill to local memory,
which the one-wave grid trades for residency; the step pays it in L1/L2 traffic a program.

    PYTHONPATH=src python3 benchmarks/kernels/gemv_registers.py --sms 132 --device-name "NVIDIA H100 80GB HBM3" --out R.json
        [--lora-programs-per-sm 8]   # the adapter's launches as gemv.lora_programs_per_sm=8 makes them
        [--no-lora-prefetch]         # ... as gemv.lora_prefetch=false makes them
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch

from sparsedecode.kernels import common
from sparsedecode.kernels import sparse_gemv as sg
from sparsedecode.records import stamp, write_record

# name: (K, N, segments, NORM, RESID, GLU), Llama-3.1-8B (d 4096, d_ff 14336, 8 KV heads of 128)
LAUNCHES = {"q|k|v": (4096, 6144, 3, True, False, False), "o": (4096, 4096, 1, False, True, False),
            "gate|up": (4096, 28672, 2, True, False, False), "down": (14336, 4096, 1, False, True, True),
            "plain": (4096, 14336, 1, False, False, False)}
RANK = 16


def compile_launch(K, N, nseg, norm, resid, glu, lora, config, maxnreg, ss_tiles=1, prefetch=True) -> dict:
    """REG, STACK and LOCAL bytes of the kernel compiled for sm_90 as `_sparse_gemv_op` launches it
    (`ss_tiles`: the column tiles of the launch whose residual sums of squares a norm reads)."""
    import triton

    from sparsedecode.kernels.sm90 import compile_sparse_gemv

    block_n, block_k, splits, warps, stages = config
    consts = sg.launch_constexprs(N, block_n, block_k, warps, stages, bits=stages == 4, stride=N, nseg=nseg,
                                  pdl=True, glu=glu, resid=resid, norm=norm, n_ss=ss_tiles if norm else 0,
                                  lora=lora, rank=RANK, lora_prefetch=prefetch)
    k = compile_sparse_gemv(torch.bfloat16, consts, warps, maxnreg)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?LOCAL:(\d+)", out, re.S)
    if m is None:
        raise SystemExit(f"cuobjdump printed no resource usage: {out[:400]}")
    return {"regs": int(m.group(1)), "stack_bytes": int(m.group(2)), "local_bytes": int(m.group(3))}


def grid(K: int, N: int, dev, programs_per_sm: int | None = None) -> tuple[tuple, int, int]:
    """(config, programs, register cap) of a (K, N) launch on `dev`, as `_sparse_gemv_op` picks them;
    with `programs_per_sm`, as `sparse_gemv` picks them for an adapter under gemv.lora_programs_per_sm."""
    config = (sg.default_config(K, N, torch.bfloat16, dev) if programs_per_sm is None
              else sg.default_config(K, N, torch.bfloat16, dev, programs_per_sm, tuned=False))
    programs = -(-N // config[0]) * common.splits(K, config[1], config[2])
    return config, programs, sg.max_registers(programs, config[3], dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sms", type=int, required=True, help="SMs of the device (H100 SXM 132, H200 132)")
    ap.add_argument("--device-name", required=True, help="its torch name: picks its tuned table, if shipped")
    ap.add_argument("--lora-programs-per-sm", type=int, default=None,
                    help="compile the adapter's launches as gemv.lora_programs_per_sm=N launches them (default: unset)")
    ap.add_argument("--no-lora-prefetch", dest="lora_prefetch", action="store_false",
                    help="compile the adapter's launches as gemv.lora_prefetch=false launches them (A^T at its sum)")
    ap.add_argument("--out", required=True, help="the record (never overwritten)")
    a = ap.parse_args()
    common.sm_count = lambda index: a.sms  # the launcher's choices for that device, here without it
    common.device_name = lambda index: a.device_name
    dev = torch.device("cuda", 0)
    # a norm reads the sums of squares of the launch before it: o's before gate|up, down's before q|k|v
    producer = {"q|k|v": "down", "gate|up": "o"}
    rows = []
    for name, (K, N, nseg, norm, resid, glu) in LAUNCHES.items():
        config, programs, cap = grid(K, N, dev)
        row = {"launch": name, "K": K, "N": N, "config": list(config), "programs": programs, "maxnreg": cap}
        ss_tiles = 1
        if name in producer:
            pk, pn = LAUNCHES[producer[name]][:2]
            ss_tiles = -(-pn // grid(pk, pn, dev)[0][0])
        row["base"] = compile_launch(K, N, nseg, norm, resid, glu, False, config, cap, ss_tiles)
        if a.lora_programs_per_sm is not None:  # what sparse_gemv launches for an adapter under that option
            config, programs, cap = grid(K, N, dev, a.lora_programs_per_sm)
        row.update(lora_config=list(config), lora_programs=programs, lora_maxnreg=cap)
        row["lora"] = compile_launch(K, N, nseg, norm, resid, glu, True, config, cap, ss_tiles, a.lora_prefetch)
        rows.append(row)
        print(f"{name:8s} {K}x{N} config {row['config']} cap {row['maxnreg']}: base {row['base']} | "
              f"lora (config {config}, cap {cap}) {row['lora']}", flush=True)
    import triton

    write_record(a.out, stamp({"kind": "gemv_registers", "sms": a.sms, "device_name": a.device_name,
                               "lora_programs_per_sm": a.lora_programs_per_sm, "lora_prefetch": a.lora_prefetch,
                               "triton": triton.__version__, "rank": RANK, "dtype": "bfloat16", "rows": rows}))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
