#!/usr/bin/env bash
# Issue 4 on the H200: after the cheaper split-K finish, the stages-4 tile configs swept on fused gate|up
# (called with norm=) and down (called with up= and residual=, SwiGLU in its load) at keeps 0.5 and 0.3,
# as the fused decoder layer calls them (sparse_gemv_bench.py --fused-sweep). Timing only; for the next
# session's step runs.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/fused_resweep.sh
set -u
source "$(dirname "$0")/lib.sh"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/down" --shapes down --keeps 0.5 0.3 --sweep --sweep-stages 4 \
  --fused-sweep glu+residual --choose "$OUT/chosen_down.json" > "$OUT/down.log" 2>&1
echo "down: rc=$? [$(elapsed)]"
grep -E "^chosen" "$OUT/down.log"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gate_up2" --shapes gate_up2 --keeps 0.5 0.3 --sweep \
  --sweep-stages 4 --fused-sweep norm --choose "$OUT/chosen_gate_up2.json" > "$OUT/gate_up2.log" 2>&1
echo "gate_up2: rc=$? [$(elapsed)]"
grep -E "^chosen" "$OUT/gate_up2.log"
