#!/usr/bin/env bash
# (Its stages 9 to 12 were removed after 58e3e09: run it at that commit to repeat it.)
# Issue 4 on the H200: the sparse GEMV's stages 9 (tensor cores, cp.async pipeline) and BF16_PAIRS
# (stages 4 and 8 widen bf16 read as int32 pairs) against the default on the issue's two shapes and
# the decode step's four at keeps 1, 0.5 and 0.3; the fastest per shape at 0.5 and 0.3 goes to
# chosen.json; then the llama-3.1-8b step (keep 0.5, 2K) with the picks, with pairs, and plain.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/tensor_cores.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_sparse_gemv.py" -k "loop_configs or register_cap or graph"
for v in tc pairs; do
  flags=(--sweep --sweep-stages 9 8 --choose "$OUT/chosen.json"); [ $v = pairs ] && flags=(--bf16-pairs)
  python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv_$v" --shapes gate_up down gate_up2 qkv q_o \
    --keeps 1 0.5 0.3 "${flags[@]}" > "$OUT/gemv_$v.log" 2>&1
  echo "gemv $v: rc=$? [$(elapsed)]"
  grep -E "^(gate_up|down|gate_up2|qkv|q_o) +(keep=)?(1|0\.[35]) +(default|.*s9) " "$OUT/gemv_$v.log" | cut -c1-75
done
python3 -c "import json; [print('chosen', r['shape'], r['label']) for r in json.load(open('$OUT/chosen.json'))]"
for v in chosen pairs default; do
  cfg=(); [ $v = chosen ] && cfg=(--gemv-configs "$OUT/chosen.json"); [ $v = pairs ] && cfg=(--bf16-pairs)
  python3 "$here/proj_decode_h200.py" --out "$OUT/step_$v" --keeps 0.5 --context 2K --compile-mode '' "${cfg[@]}" \
    > "$OUT/step_$v.log" 2>&1
  echo "step $v: rc=$? [$(elapsed)]"; grep -E "% of bound" "$OUT/step_$v.log" | sed "s/^/  $v /"
done
