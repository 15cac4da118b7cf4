#!/usr/bin/env bash
# Issue 4 on the H200: the sparse GEMV and the llama-3.1-8b decode step (keep 0.5, 2K) with the
# kernel's registers capped at 96 (what ptxas chose at b836621) instead of the one-wave budget.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/register_cap.sh
set -u
: "${OUT:?set OUT to the folder for the records}"
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv_r96" --shapes gate_up down gate_up2 qkv q_o --keeps 0.5 0.3 \
  --max-registers 96 > "$OUT/gemv_r96.log" 2>&1
echo "gemv r96: rc=$?"; grep -E "^[a-z_0-9]+ +[0-9.]+ default" "$OUT/gemv_r96.log"
python3 "$here/proj_decode_h200.py" --out "$OUT/step_r96" --keeps 0.5 --context 2K --compile-mode '' \
  --max-registers 96 2>&1 | tee "$OUT/step_r96.log" | grep -vi warn | tail -4
