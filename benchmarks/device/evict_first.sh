#!/usr/bin/env bash
# Issue 4 on the H200 (not yet run): the sparse GEMV with and without the evict-first hint on its
# weight loads, on the decode step's four shapes at keeps 0.5 and 0.3, then the llama-3.1-8b step
# (keep 0.5, 2K) with the hint.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/evict_first.sh
set -u
: "${OUT:?set OUT to the folder for the records}"
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
for hint in "" "--evict-first"; do
  name=gemv${hint:+_evict_first}
  python3 "$here/sparse_gemv_bench.py" --out "$OUT/$name" --shapes gate_up2 down qkv q_o --keeps 0.5 0.3 $hint \
    > "$OUT/$name.log" 2>&1
  echo "$name: rc=$?"; grep -E "^[a-z_0-9]+ +[0-9.]+ default" "$OUT/$name.log"
done
python3 "$here/proj_decode_h200.py" --out "$OUT/step" --keeps 0.5 --context 2K --compile-mode '' --evict-first \
  2>&1 | tee "$OUT/step.log" | grep -vi warn | tail -4
