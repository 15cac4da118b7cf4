#!/usr/bin/env bash
# (Its stages 2, 3, 5, 6 and 7 were removed after 512e6bb: run it at that commit to repeat it.)
# Issue 4 on the H200: the sparse GEMV's fixed cost (an empty kernel on the default grid, keep 0),
# stages 5 (warps splitting the rows) and programmatic dependent launch, then the GPU tests.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/gemv_pdl_stage5.sh
set -u
: "${OUT:?set OUT to the folder for the records}"
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sparse_gemv.py tests/projection/test_sparse_linear.py \
  > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests: rc=$? $(tail -1 "$OUT/gpu_tests.txt")"
for pdl in off exit early; do
  sweep=""; [ $pdl = off ] && sweep="--sweep --sweep-stages 5"
  python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv_pdl$pdl" --shapes gate_up down --keeps 1.0 0.5 0.3 0 \
    --probe --pdl $pdl $sweep > "$OUT/gemv_pdl$pdl.log" 2>&1
  echo "pdl $pdl: rc=$?"; grep -E "empty kernel|default|failed" "$OUT/gemv_pdl$pdl.log" | head -12
done
echo "== best per shape/keep (no PDL)"
grep -E "^(gate_up|down) " "$OUT/gemv_pdloff.log" | \
  awk 'NF==7 {k=$1" "$2; if (!(k in b) || $4<b[k]) {b[k]=$4; l[k]=$0}} END {for (k in l) print l[k]}' | sort
