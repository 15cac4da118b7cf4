#!/usr/bin/env bash
# Issue 4 on the H200: the sparse GEMV judged inside the llama-3.1-8b decode step (keep 0.5, 2K).
# Each profiled step records the time of every sparse GEMV launch, so the speed tables set each
# call of a layer (q|k|v, o, gate|up, down) beside the byte time of the rows it read. Twice the
# default with every sparse GEMV ablated too (x; x and the finish's atomic adds alone; x and no
# finish: sparse_gemv.ABLATE, timed only), and once the default beside it with programmatic
# dependent launch (pdl+norms, last measured before the fused norms were the default).
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/step_calls.sh
set -u
source "$(dirname "$0")/lib.sh"
STEP_GREP="ablated|calls +_sparse_gemv_kernel"
decode_step calls_1 --ablate x x+reds both --profile 10
decode_step pdl_1 --variants default,pdl+norms --profile 10
decode_step calls_2 --ablate x x+reds both --profile 10
python3 "$here/speed_tables.py" "$OUT"/step_*/proj_decode_proj*.json | grep -A50 "µs per call"
