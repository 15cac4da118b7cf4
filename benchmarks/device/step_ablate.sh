#!/usr/bin/env bash
# Issue 4 on the H200: what the sparse GEMV's split-K finish costs, alone and in the decode step.
# gate_up and down at keeps 0.5 and 0.3, the default beside the same call without its finish, with
# the finish's atomic adds alone, without x, and the combinations (sparse_gemv.ABLATE, timed only);
# then the llama-3.1-8b step (keep 0.5, 2K) twice, each time also with every sparse GEMV ablated:
# x (rows kept by parity), x+reds (and the finish's atomic adds alone), both (and no finish). The
# three ablated steps run every call on stages 4 and differ only in the finish.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/step_ablate.sh
set -u
source "$(dirname "$0")/lib.sh"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes gate_up down --keeps 0.5 0.3 \
  --ablate finish reds x x+reds both > "$OUT/gemv.log" 2>&1
echo "gemv: rc=$? [$(elapsed)]"
grep -E "keep=0\.[35] " "$OUT/gemv.log"
STEP_GREP="ablated|calls +_sparse_gemv_kernel"
decode_step abl_1 --ablate x x+reds both --profile 10
decode_step abl_2 --ablate x x+reds both
