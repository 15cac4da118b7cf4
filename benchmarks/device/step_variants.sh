#!/usr/bin/env bash
# Issue 4 on the H200: the sparse GEMV's default against its byte time (PDL off and early; the
# decode step's other shapes with PDL off), then the llama-3.1-8b decode step at keep 0.5 and
# 2K in four variants (PDL and silu(gate)*up in down's input load, each on and off), then the
# GPU tests of the kernel.
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
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv_step_shapes" --shapes gate_up2 qkv q_o --keeps 1.0 0.5 0.3 \
  > "$OUT/gemv_step_shapes.log" 2>&1
echo "step shapes: rc=$?"; grep -E "default" "$OUT/gemv_step_shapes.log" | head -9
python3 "$here/proj_decode_h200.py" --out "$OUT/step" --keeps 0.5 --context 2K --compile-mode '' \
  --variants plain,swiglu,pdl,pdl+swiglu 2>&1 | tee "$OUT/step.log" | grep -vi warn | tail -10
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sparse_gemv.py > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests: rc=$? $(tail -1 "$OUT/gpu_tests.txt")"
