#!/usr/bin/env bash
# Issue 4 on the H200: the sparse GEMV's default against its byte time (PDL off and early), then
# the llama-3.1-8b decode step at keep 0.5 and 2K in four variants: PDL and silu(gate)*up in
# down's input load, each on and off.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/step_variants.sh
set -u
: "${OUT:?set OUT to the folder for the records}"
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
for pdl in off early; do
  python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv_pdl$pdl" --shapes gate_up down --keeps 1.0 0.5 0.3 0 \
    --probe --pdl $pdl > "$OUT/gemv_pdl$pdl.log" 2>&1
  echo "pdl $pdl: rc=$?"; grep -E "empty kernel|default" "$OUT/gemv_pdl$pdl.log" | head -10
done
python3 "$here/proj_decode_h200.py" --out "$OUT/step" --keeps 0.5 --context 2K --compile-mode '' \
  --variants pdl+swiglu,plain,swiglu,pdl 2>&1 | tee "$OUT/step.log" | grep -vi warn | tail -12
