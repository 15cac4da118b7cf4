#!/usr/bin/env bash
# (Its stages 9 to 12 were removed after 58e3e09: run it at that commit to repeat it.)
# Issue 4 on the H200: first the llama-3.1-8b step (keep 0.5, 2K) with all of the current defaults
# (the attention floor of 128 keys per split included, which the last step runs missed), so that it
# is measured even if the sweep runs long; then stages 11 (a kept-row list gathered by a cp.async
# pipeline into shared memory, products on the CUDA cores) and 12 (11 with the kept rows dealt out
# evenly over the splits) against the defaults on the issue's two shapes and the step's four at
# keeps 1, 0.5 and 0.3, the fastest per shape at 0.5 and 0.3 in chosen.json; then the step with them.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/pipe_list.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_sparse_gemv.py" -k "loop_configs"
python3 "$here/proj_decode_h200.py" --out "$OUT/step_default" --keeps 0.5 --context 2K --compile-mode '' \
  > "$OUT/step_default.log" 2>&1
echo "step default: rc=$? [$(elapsed)]"; grep -E "% of bound" "$OUT/step_default.log" | sed "s/^/  default /"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes gate_up down gate_up2 qkv q_o --keeps 1 0.5 0.3 \
  --sweep --sweep-stages 11 12 --choose "$OUT/chosen.json" > "$OUT/gemv.log" 2>&1
echo "gemv: rc=$? [$(elapsed)]"
grep -E "^(gate_up|down|gate_up2|qkv|q_o) +keep=(0\.[35]) +(default|.*s1[12]) " "$OUT/gemv.log" | cut -c1-75
python3 -c "import json; [print('chosen', r['shape'], r['label']) for r in json.load(open('$OUT/chosen.json'))]"
python3 "$here/proj_decode_h200.py" --out "$OUT/step_chosen" --keeps 0.5 --context 2K --compile-mode '' \
  --gemv-configs "$OUT/chosen.json" > "$OUT/step_chosen.log" 2>&1
echo "step chosen: rc=$? [$(elapsed)]"; grep -E "% of bound" "$OUT/step_chosen.log" | sed "s/^/  chosen /"
