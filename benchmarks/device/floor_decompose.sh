#!/usr/bin/env bash
# Issue 4 on the H200: the sparse GEMV's time over the floor of its bytes, taken apart in one
# process each. The floor (read_floor_bench.py, with the configs added after the first run); then
# the GEMV at the defaults on the same cells, also ablated (sparse_gemv.ABLATE: no finish, no x,
# both, the finish's atomic adds alone, x and those adds), all launched with PDL as the library does.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/floor_decompose.sh
set -u
source "$(dirname "$0")/lib.sh"
python3 "$here/read_floor_bench.py" --out "$OUT/floor" > "$OUT/floor.log" 2>&1
echo "floor: rc=$? [$(elapsed)]"
grep -E " floor |Error|error" "$OUT/floor.log"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes gate_up down \
  --ablate finish x both reds x+reds > "$OUT/gemv.log" 2>&1
echo "gemv: rc=$? [$(elapsed)]"
grep -E "keep=" "$OUT/gemv.log"
python3 "$here/speed_tables.py" "$OUT"/floor/read_floor_bench-*.json "$OUT"/gemv/sparse_gemv_bench-*.json | grep -B2 -A8 "floor µs"
