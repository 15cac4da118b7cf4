#!/usr/bin/env bash
# Issue 4 on the H200: stages 4 with each row's input formed once per split (sparse_gemv.X_ONCE)
# and the weight's row stride compiled in (ROW_STRIDE_CONST). In the sm_90 SASS the loop of a
# 16-row tile on gate_up runs 407 instructions with both against 501 without, and the fused-norm
# loop 407 against 525. The CUDA tests that compare both knobs bit for bit with stages 4; the GEMV
# on the step's shapes at keeps 1, 0.5 and 0.3 without them, with X_ONCE, and with both; then the
# llama-3.1-8b step (keep 0.5, 2K) without and with both, twice each, alternating.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/x_once.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_sparse_gemv.py" -k "x_once or fused_norm_and_residual_on_cuda"
gemv() {
  local name=$1; shift
  python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv_$name" --shapes gate_up down qkv q_o --keeps 1.0 0.5 0.3 "$@" \
    > "$OUT/gemv_$name.log" 2>&1
  echo "gemv $name: rc=$? [$(elapsed)]"
  grep -E "keep=.*default" "$OUT/gemv_$name.log" | sed "s/^/  /"
}
gemv base --no-x-once --no-stride-const
gemv once --x-once --no-stride-const
gemv both --x-once --stride-const
decode_step base_1 --no-x-once --no-stride-const
decode_step both_1 --x-once --stride-const
decode_step base_2 --no-x-once --no-stride-const
decode_step both_2 --x-once --stride-const
