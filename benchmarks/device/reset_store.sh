#!/usr/bin/env bash
# Issue 4 on the H200: the split-K finish's last program zeroing the arrival count with a store
# (sparse_gemv.RESET_STORE) against the atomic exchange it waits on. Its CUDA test; the sparse GEMV
# on the step's shapes at keeps 1, 0.5 and 0.3 with both in one process; the llama-3.1-8b step
# (keep 0.5, 2K, prefilled cache) with each, twice, in alternating processes.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/reset_store.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_sparse_gemv.py" -k "finish_load"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes gate_up down q_o qkv gate_up2 \
  --compare RESET_STORE > "$OUT/gemv.log" 2>&1
echo "gemv: rc=$? [$(elapsed)]"
grep -E "keep=0\.[35] " "$OUT/gemv.log"
STEP_GREP="calls +_sparse_gemv_kernel"
decode_step base_1
decode_step rstore_1 --reset-store
decode_step base_2
decode_step rstore_2 --reset-store
