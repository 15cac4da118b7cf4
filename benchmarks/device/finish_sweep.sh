#!/usr/bin/env bash
# Issue 4 on the H200, after the cheaper split-K finish (FINISH_LOAD, RESET_STORE): the floor and the
# GEMV taken apart again (read_floor_bench.py; sparse_gemv_bench.py --ablate on gate_up and down); the
# stages-4 and -8 tile configs swept on the step's four shapes (fused q|k|v, o, fused gate|up, down) at
# keeps 0.5 and 0.3, the fastest per shape chosen; the llama-3.1-8b step (keep 0.5, 2K, prefilled)
# with the chosen configs against the built-in ones, twice, alternating.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/finish_sweep.sh
set -u
source "$(dirname "$0")/lib.sh"
python3 "$here/read_floor_bench.py" --out "$OUT/floor" --keeps 0.5 0.3 > "$OUT/floor.log" 2>&1
echo "floor: rc=$? [$(elapsed)]"
grep -E " floor |Error|error" "$OUT/floor.log"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes gate_up down --keeps 0.5 0.3 \
  --ablate finish x both reds > "$OUT/gemv.log" 2>&1
echo "gemv: rc=$? [$(elapsed)]"
grep -E "keep=" "$OUT/gemv.log"
python3 "$here/speed_tables.py" "$OUT"/floor/read_floor_bench-*.json "$OUT"/gemv/sparse_gemv_bench-*.json \
  "$OUT"/gemv/ablate/sparse_gemv_bench-*.json | grep -A6 "floor µs"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/sweep" --shapes qkv q_o gate_up2 down --keeps 0.5 0.3 \
  --sweep --sweep-stages 4 8 --choose "$OUT/chosen.json" > "$OUT/sweep.log" 2>&1
echo "sweep: rc=$? [$(elapsed)]"
grep -E "^chosen" "$OUT/sweep.log"
STEP_GREP="calls +_sparse_gemv_kernel"
decode_step base_1
decode_step chosen_1 --gemv-configs "$OUT/chosen.json"
decode_step base_2
decode_step chosen_2 --gemv-configs "$OUT/chosen.json"
