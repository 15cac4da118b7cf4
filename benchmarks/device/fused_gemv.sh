#!/usr/bin/env bash
# Issue 4 on the H200 (run at 7325777: records h200/sparse_gemv_20261130T1938Z_fused_gemv): which of the fused decoder layer's four sparse GEMV calls pays
# the 92 us a step that the fused norms cost in the step profile (records
# h200/sparse_gemv_20261130T1738Z_fused_norms): the default config of the step's four shapes at keeps
# 1, 0.5 and 0.3, plain, with residual= (o and down add the residual and leave the tiles' sums of
# squares) and with norm= (q|k|v and gate|up form RMSNorm in their x loads); then the step, profiled.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/fused_gemv.sh
set -u
source "$(dirname "$0")/lib.sh"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes qkv q_o gate_up2 down --keeps 1 0.5 0.3 --fused \
  > "$OUT/gemv.log" 2>&1
echo "gemv: rc=$? [$(elapsed)]"
grep -E "^(qkv|q_o|gate_up2|down) +keep=" "$OUT/gemv.log" | cut -c1-80
# then the step profiled, to confirm that the per-layer gather and pos + 1 kernels of 8d5c177 are gone
python3 "$here/proj_decode_h200.py" --out "$OUT/step" --keeps 0.5 --context 2K --compile-mode '' \
  --variants default,plain --profile 20 > "$OUT/step.log" 2>&1
echo "step: rc=$? [$(elapsed)]"
grep -E "% of bound|kernels .*us/step|calls  (triton|_rope)" "$OUT/step.log" | sed "s/^/  /"
