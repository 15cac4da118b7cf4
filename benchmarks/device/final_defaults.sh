#!/usr/bin/env bash
# Issue 4 on the H200, the records of the defaults: GPU tests of the kernels; the sparse GEMV
# on the issue's two shapes and the decode step's four at keeps 1, 0.5 and 0.3 (with the fixed
# cost of a launch); split-K attention at 2K; the llama-3.1-8b step at keep 0.5 and 2K, twice
# (two processes: the spread between runs).
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/final_defaults.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_sparse_gemv.py" "$tests/kernels/test_decode_attention.py"
for run in 1 2; do
  python3 "$here/proj_decode_h200.py" --out "$OUT/step_$run" --keeps 0.5 --context 2K --compile-mode '' \
    > "$OUT/step_$run.log" 2>&1
  echo "step $run: rc=$? [$(elapsed)]"; grep -E "% of bound" "$OUT/step_$run.log"
done
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes gate_up down gate_up2 qkv q_o --keeps 1 0.5 0.3 \
  --probe > "$OUT/gemv.log" 2>&1
echo "gemv: rc=$? [$(elapsed)]"; grep -E "^(gate_up|down) +keep=0\.[35] " "$OUT/gemv.log" | cut -c1-80
python3 "$here/attention_bench.py" --out "$OUT/attn" --contexts 2048 --backends split_k > "$OUT/attn.log" 2>&1
echo "attention: rc=$? [$(elapsed)]"; grep -E "n= +2048" "$OUT/attn.log"
