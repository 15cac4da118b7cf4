#!/usr/bin/env bash
# Issue 4 on the H200: where the sparse GEMV's fixed cost goes. gate_up, down, gate_up2 and qkv at
# keeps 1, 0.5 and 0.3, the default beside the same call without its split-K finish, without its x
# and threshold loads (rows kept by parity: keep 0.5 only) and without both (sparse_gemv.ABLATE,
# timed only); the speed tables' fit splits each into a fixed cost and a streaming rate.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/ablate.sh
set -u
source "$(dirname "$0")/lib.sh"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes gate_up down gate_up2 qkv --probe \
  --ablate finish x both > "$OUT/gemv.log" 2>&1
echo "gemv: rc=$? [$(elapsed)]"
grep -E "empty kernel|keep=0\.[35] " "$OUT/gemv.log"
python3 "$here/speed_tables.py" "$OUT/gemv/sparse_gemv_records.json" | grep -A40 "kernel config"
