#!/usr/bin/env bash
# Issue 4 on the H200: the sparse GEMV's stages 8 (each program lists its split's kept rows, then
# streams only those, two tiles in flight) against the default (stages 4) on the issue's two shapes
# and the decode step's four at keeps 1, 0.5 and 0.3; the fastest per shape at 0.5 and 0.3 is
# written to chosen.json and the llama-3.1-8b step (keep 0.5, 2K) timed with those picks and with
# the built-in configs; then the evict-first hint on the default (prepared last session).
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/kept_row_list.sh
set -u
: "${OUT:?set OUT to the folder for the records}"
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
start=$(date +%s)
python3 -m pytest -q "$here/../tests/kernels/test_sparse_gemv.py" -k "kept_row_list or register_cap or graph" \
  > "$OUT/tests.log" 2>&1
echo "tests: rc=$? $(tail -1 "$OUT/tests.log") [$(($(date +%s) - start)) s]"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes gate_up down gate_up2 qkv q_o --keeps 1 0.5 0.3 \
  --sweep --sweep-stages 8 --choose "$OUT/chosen.json" > "$OUT/gemv.log" 2>&1
echo "gemv: rc=$? [$(($(date +%s) - start)) s]"
grep -E "^(gate_up|down|gate_up2|qkv|q_o) " "$OUT/gemv.log" | grep -E "default|s8" | cut -c1-120
python3 -c "import json; [print('chosen', r['shape'], r['label']) for r in json.load(open('$OUT/chosen.json'))]"
for v in chosen default; do
  cfg=(); [ "$v" = chosen ] && cfg=(--gemv-configs "$OUT/chosen.json")
  python3 "$here/proj_decode_h200.py" --out "$OUT/step_$v" --keeps 0.5 --context 2K --compile-mode '' "${cfg[@]}" \
    > "$OUT/step_$v.log" 2>&1
  echo "step $v: rc=$? [$(($(date +%s) - start)) s]"; grep -E "% of bound" "$OUT/step_$v.log" | sed "s/^/  $v /"
done
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv_evict_first" --shapes gate_up down --keeps 0.5 0.3 \
  --evict-first > "$OUT/gemv_evict_first.log" 2>&1
echo "evict-first: rc=$? [$(($(date +%s) - start)) s]"; grep -E "^(gate_up|down) " "$OUT/gemv_evict_first.log" | cut -c1-120
