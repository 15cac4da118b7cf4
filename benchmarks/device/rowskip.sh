#!/usr/bin/env bash
# (Its stages 2, 3, 5, 6 and 7 were removed after 512e6bb: run it at that commit to repeat it.)
# Issue 4 on the H200: the sparse GEMV's stages 6 and 7 configs (unrolled by two tiles; dropped rows
# skipped by uniform branches) against the default on the decode step's four shapes, the fastest
# per shape chosen at keeps 0.5 and 0.3, then the llama-3.1-8b decode step (keep 0.5, 2K) with them.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/rowskip.sh
set -u
: "${OUT:?set OUT to the folder for the records}"
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes gate_up2 down qkv q_o --keeps 0.5 0.3 \
  --sweep --sweep-stages 6 7 --choose "$OUT/chosen.json" > "$OUT/gemv.log" 2>&1
echo "gemv: rc=$?"; grep -E "^(chosen|gate_up2|down|qkv|q_o) " "$OUT/gemv.log" | awk 'NF==7 || /chosen/' | head -60
python3 "$here/proj_decode_h200.py" --out "$OUT/step" --keeps 0.5 --context 2K --compile-mode '' \
  --gemv-configs "$OUT/chosen.json" 2>&1 | tee "$OUT/step.log" | grep -vi warn | tail -4
