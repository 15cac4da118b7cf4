#!/usr/bin/env bash
# Issue 4 on the H200: the sparse GEMV's fixed cost (an empty kernel on the default grid, keep 0),
# stages 5 (warps splitting the rows) and programmatic dependent launch, then the GPU tests.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/gemv_pdl_stage5.sh
set -u
: "${OUT:?set OUT to the folder for the records}"
here=$(cd "$(dirname "$0")/.." && pwd)
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sparse_gemv.py tests/projection/test_sparse_linear.py \
  > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests: rc=$? $(tail -1 "$OUT/gpu_tests.txt")"
for pdl in "" "--pdl"; do
  name=gemv${pdl:+_pdl}
  python3 "$here/sparse_gemv_bench.py" --out "$OUT/$name" --shapes gate_up down --keeps 1.0 0.5 0.3 0 \
    --probe --sweep --sweep-stages 5 $pdl > "$OUT/$name.log" 2>&1
  echo "$name: rc=$?"; grep -E "empty kernel|default|failed" "$OUT/$name.log" | head -30
done
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv_pdl_small" --shapes gate_up2 qkv q_o --keeps 1.0 0.5 0.3 \
  --pdl > "$OUT/gemv_pdl_small.log" 2>&1
echo "gemv_pdl_small: rc=$?"; grep -E "default" "$OUT/gemv_pdl_small.log" | head -12
for f in gemv gemv_pdl; do echo "== $f best per shape/keep"; grep -E "^(gate_up|down) " "$OUT/$f.log" | \
  awk 'NF==7 {k=$1" "$2; if (!(k in b) || $4<b[k]) {b[k]=$4; l[k]=$0}} END {for (k in l) print l[k]}' | sort; done
