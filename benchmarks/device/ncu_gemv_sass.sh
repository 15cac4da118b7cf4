#!/usr/bin/env bash
# Issue 4 on the H200: where the sparse GEMV's warps wait, per SASS instruction (Nsight Compute
# warp-state sampling), on gate_up at keep 0 (no weight row read: the fixed cost) and keep 0.3.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/ncu_gemv_sass.sh
set -u
: "${OUT:?set OUT to the folder for the reports}"
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
for keep in 0 0.3; do
  ncu --clock-control none -k regex:_sparse_gemv_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --import-source no \
    -o "$OUT/gate_up_$keep" python3 "$here/ncu_sparse_gemv.py" --shape gate_up --keep "$keep" > "$OUT/ncu_$keep.log" 2>&1
  echo "ncu keep $keep: rc=$?"
  ncu -i "$OUT/gate_up_$keep.ncu-rep" --page details > "$OUT/details_$keep.txt" 2>&1
  ncu -i "$OUT/gate_up_$keep.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$keep.csv" 2>&1
  grep -E "Duration|Warp Cycles Per Issued|Stall" "$OUT/details_$keep.txt" | head -12
done
