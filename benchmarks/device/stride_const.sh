#!/usr/bin/env bash
# Issue 4 on the H200: the weight's row stride compiled in (sparse_gemv.ROW_STRIDE_CONST) alone,
# after x_once.sh measured it only with X_ONCE (records h200/sparse_gemv_20261130T2252Z_x_once,
# where X_ONCE lost). The CUDA test of the knob (within rounding of stages 4: the splits' atomic
# adds land in any order); the GEMV on gate_up and down at keeps 1, 0.5 and 0.3 without and with
# it, twice each; the llama-3.1-8b step (keep 0.5, 2K) without and with it, twice each. Run at
# 4430254 (the stride a constant, each row's address still formed per row) and at the commit
# after (a tile's rows at constant offsets of one address).
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/stride_const.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_sparse_gemv.py" -k "constant_stride"
gemv() {
  local name=$1; shift
  python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv_$name" --shapes gate_up down --keeps 1.0 0.5 0.3 "$@" \
    > "$OUT/gemv_$name.log" 2>&1
  echo "gemv $name: rc=$? [$(elapsed)]"
  grep -E "keep=.*default" "$OUT/gemv_$name.log" | sed "s/^/  /"
}
gemv base_1 --no-stride-const
gemv stride_1 --stride-const
gemv base_2 --no-stride-const
gemv stride_2 --stride-const
decode_step base_1 --no-stride-const
decode_step stride_1 --stride-const
decode_step base_2 --no-stride-const
decode_step stride_2 --stride-const
