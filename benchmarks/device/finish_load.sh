#!/usr/bin/env bash
# Issue 4 on the H200: the split-K finish reading the tile's sum with loads (sparse_gemv.FINISH_LOAD)
# against the atomic exchange. Its CUDA tests; the sparse GEMV on the step's shapes at keeps 1, 0.5 and
# 0.3 with both finishes in one process; the llama-3.1-8b step (keep 0.5, 2K, prefilled cache) with
# each, twice, in alternating processes.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/finish_load.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_sparse_gemv.py" -k "finish_load or loop_configs or fused_norm"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes gate_up down q_o qkv gate_up2 \
  --compare FINISH_LOAD > "$OUT/gemv.log" 2>&1
echo "gemv: rc=$? [$(elapsed)]"
grep -E "keep=0\.[35] " "$OUT/gemv.log"
STEP_GREP="calls +_sparse_gemv_kernel"
decode_step base_1
decode_step load_1 --finish-load
decode_step base_2
decode_step load_2 --finish-load
