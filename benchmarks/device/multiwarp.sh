#!/usr/bin/env bash
# Issue 4 on the H200: sparse GEMV programs of several warps (sparse_gemv.NUM_WARPS), the warps per
# SM kept, so the grid launches 2-8x fewer CTAs. `gemv`: the CUDA tests of multi-warp configs, then
# gate_up, down, gate_up2 and qkv at keeps 1, 0.5 and 0.3, the default beside 2, 4 and 8 warps,
# each config also as an empty kernel on its grid (--probe); the speed tables' fit splits each
# config's time into a fixed cost and a streaming rate. `step W [W ...]`: the llama-3.1-8b step
# (keep 0.5, 2K) at the defaults and with each W warps per program, twice each, alternating.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/multiwarp.sh gemv|step W...
set -u
source "$(dirname "$0")/lib.sh"
case "${1:-}" in
  gemv)
    run_tests "$tests/kernels/test_sparse_gemv.py" \
      -k "loop_configs_on_cuda and 2048 or loop_configs_on_cuda and 1024 or fused_norm_and_residual_on_cuda"
    python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes gate_up down gate_up2 qkv --probe \
      --configs b512k16p8w2s4 b1024k16p4w4s4 b2048k16p2w8s4 > "$OUT/gemv.log" 2>&1
    echo "gemv: rc=$? [$(elapsed)]"
    grep -E "empty kernel|keep=0\.[35] " "$OUT/gemv.log"
    python3 "$here/speed_tables.py" "$OUT/gemv/sparse_gemv_records.json" | grep -A40 "kernel config" ;;
  step)
    shift
    for round in 1 2; do
      decode_step "base_$round"
      for w in "$@"; do decode_step "w${w}_$round" --gemv-warps "$w"; done
    done ;;
  *) echo "usage: multiwarp.sh gemv | step W [W ...]" >&2; exit 2 ;;
esac
