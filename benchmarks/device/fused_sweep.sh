#!/usr/bin/env bash
# Issue 4 on the H200: tile configs chosen as the fused decoder layer calls each shape. The fused
# norms cost q|k|v and gate|up (stages 4) 0.8-1.9 us a call and o (stages 8) 0.1-0.3 us (records
# h200/sparse_gemv_20261130T1938Z_fused_gemv): stages 4 forms the norm in every lane for every row,
# stages 8 once per row. So the stages 4 and 8 configs of SWEEP run with norm= on q|k|v and gate|up,
# with residual= on o and down, and with up= + residual= on down (silu(gate) * up in its load,
# FUSE_SWIGLU). Then the step (keep 0.5, 2K): the built-in configs (variants default and
# swiglu+norms, profiled: the per-layer pos + 1 kernel must be gone), the chosen configs with
# the default layer, and the chosen ones with down forming silu(gate) * up. GPU tests first.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/fused_sweep.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_decode_attention.py" "$tests/kernels/test_sparse_gemv.py" \
  "$tests/engine/test_cuda_capture.py" "$tests/projection/test_sparse_linear.py" -k "cuda or captured or gpu"
sweep() {  # name kind shapes...
  local name=$1 kind=$2; shift 2
  python3 "$here/sparse_gemv_bench.py" --out "$OUT/sweep_$name" --shapes "$@" --keeps 0.5 0.3 --sweep \
    --sweep-stages 4 8 --fused-sweep "$kind" --choose "$OUT/chosen_$name.json" > "$OUT/sweep_$name.log" 2>&1
  echo "sweep $name: rc=$? [$(elapsed)]"
  grep -E "^chosen|keep=.* default" "$OUT/sweep_$name.log" | cut -c1-90
}
sweep norm norm qkv gate_up2
sweep resid residual q_o down
sweep glu glu+residual down
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
load = lambda n: json.load(open(f"{out}/chosen_{n}.json"))
resid = load("resid")
json.dump(load("norm") + resid, open(f"{out}/configs_residual.json", "w"), indent=1)
json.dump(load("norm") + [c for c in resid if c["shape"] == "q_o"] + load("glu"),
          open(f"{out}/configs_glu.json", "w"), indent=1)
PY
STEP_GREP="add_split_k|mul_silu"
decode_step builtin --variants default,swiglu+norms --profile 10
decode_step chosen --gemv-configs "$OUT/configs_residual.json" --variants default
decode_step chosen_glu --gemv-configs "$OUT/configs_glu.json" --variants swiglu+norms
