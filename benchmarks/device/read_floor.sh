#!/usr/bin/env bash
# Issue 4 on the H200: the floor under the GEMV's byte-time target. The read-floor kernel's CUDA
# tests; then one launch reading exactly the bytes of each sparse GEMV cell (gate_up and down at
# keeps 1, 0.5 and 0.3) in every read-floor config, plain and with PDL, and torch.sum
# (read_floor_bench.py); then the sparse GEMV on the same cells on the same machine.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/read_floor.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/timing/test_read_floor.py"
python3 "$here/read_floor_bench.py" --out "$OUT/floor" > "$OUT/floor.log" 2>&1
echo "floor: rc=$? [$(elapsed)]"
grep -E " floor |Error|error" "$OUT/floor.log"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes gate_up down > "$OUT/gemv.log" 2>&1
echo "gemv: rc=$? [$(elapsed)]"
grep -E "keep=" "$OUT/gemv.log"
python3 "$here/speed_tables.py" "$OUT"/floor/read_floor_bench-*.json "$OUT"/gemv/sparse_gemv_bench-*.json | grep -B2 -A8 "floor µs"
