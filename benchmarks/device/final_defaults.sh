#!/usr/bin/env bash
# Issue 4 on the H200, the records of the defaults: GPU tests of the kernels; the sparse GEMV
# on the issue's two shapes and the decode step's four at keeps 1, 0.5 and 0.3 (with the fixed
# cost of a launch); split-K attention at 2K; the llama-3.1-8b step at keep 0.5 and 2K, twice
# (two processes: the spread between runs).
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/final_defaults.sh
set -u
: "${OUT:?set OUT to the folder for the records}"
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
start=$(date +%s)
python3 -m pytest -q "$here/../tests/kernels/test_sparse_gemv.py" "$here/../tests/kernels/test_decode_attention.py" \
  > "$OUT/tests.log" 2>&1
echo "tests: rc=$? $(tail -1 "$OUT/tests.log") [$(($(date +%s) - start)) s]"
grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -5
for run in 1 2; do
  python3 "$here/proj_decode_h200.py" --out "$OUT/step_$run" --keeps 0.5 --context 2K --compile-mode '' \
    > "$OUT/step_$run.log" 2>&1
  echo "step $run: rc=$? [$(($(date +%s) - start)) s]"; grep -E "% of bound" "$OUT/step_$run.log"
done
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes gate_up down gate_up2 qkv q_o --keeps 1 0.5 0.3 \
  --probe > "$OUT/gemv.log" 2>&1
echo "gemv: rc=$? [$(($(date +%s) - start)) s]"; grep -E "^(gate_up|down) +keep=0\.[35] " "$OUT/gemv.log" | cut -c1-80
python3 "$here/attention_bench.py" --out "$OUT/attn" --contexts 2048 --backends split_k > "$OUT/attn.log" 2>&1
echo "attention: rc=$? [$(($(date +%s) - start)) s]"; grep -E "n= +2048" "$OUT/attn.log"
