#!/usr/bin/env bash
# Issue 4's profile on the H200: Nsight Compute sections of the sparse GEMV (random and evenly
# spread kept channels) and of cuBLAS's dense GEMV, then the GEMV benchmark with both patterns.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/profile_sparse_gemv.sh
set -u
: "${OUT:?set OUT to the folder for the reports}"
here=$(cd "$(dirname "$0")/.." && pwd)
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats"
mkdir -p "$OUT/ncu"
for spec in "gate_up 0.5 random" "gate_up 0.5 even" "gate_up 1.0 random" "gate_up 0.3 random" "down 0.5 random" "down 0.5 even"; do
  set -- $spec
  ncu --clock-control none -k regex:_sparse_gemv_kernel --launch-skip 2 --launch-count 1 $sections \
    python3 "$here/ncu_sparse_gemv.py" --shape "$1" --keep "$2" --pattern "$3" > "$OUT/ncu/sparse_$1_$2_$3.txt" 2>&1
  echo "ncu sparse $spec: rc=$?"
done
ncu --clock-control none -k regex:'gemv|gemm|Kernel' --launch-skip 2 --launch-count 1 $sections \
  python3 "$here/ncu_sparse_gemv.py" --shape gate_up --keep 0.5 --calls 4 > "$OUT/ncu/dense_gate_up.txt" 2>&1
echo "ncu dense gate_up: rc=$?"
for pattern in random even; do
  python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv_$pattern" --shapes gate_up down gate_up2 qkv \
    --keeps 1.0 0.5 0.3 --pattern "$pattern" 2>&1 | tail -14
done
