#!/usr/bin/env bash
# Issue 4 on the H200: the sparse GEMV beside cuBLAS on a dense weight of just the kept rows (the
# same bytes; what one library launch achieves at that size), then the llama-3.1-8b decode step
# at keep 0.5 and 2K, dense and sparse, with each kernel's device time per step (profiler).
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/gemv_floor_profile.sh
set -u
: "${OUT:?set OUT to the folder for the records}"
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes gate_up down gate_up2 qkv q_o --keeps 1.0 0.5 0.3 \
  > "$OUT/gemv.log" 2>&1
echo "gemv: rc=$?"; grep -E "default" "$OUT/gemv.log" | grep -v "^[a-z_0-9]* *[0-9.]* default *[0-9.]* *[0-9.]* *[0-9.]* *[0-9.]*$" | head -15
python3 "$here/proj_decode_h200.py" --out "$OUT/step" --keeps 0.5 --context 2K --compile-mode '' --profile 20 \
  2>&1 | tee "$OUT/step.log" | grep -vi warn | tail -32
