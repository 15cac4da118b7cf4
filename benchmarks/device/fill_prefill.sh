#!/usr/bin/env bash
# Issue 4 on the H200: the llama-3.1-8b step (keep 0.5, 2K) over a cache filled by a dense prefill of
# random token ids (proj_decode_h200.py --fill prefill, the new default), so that o reads the model's
# own attention output, beside the random-normal cache of the earlier records (--fill random); and the
# standalone sparse GEMV at the library's defaults (PDL early) on gate_up, down and q_o (o's shape).
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/fill_prefill.sh
set -u
source "$(dirname "$0")/lib.sh"
STEP_GREP="calls +_sparse_gemv_kernel"
decode_step prefill_1 --fill prefill --profile 10
decode_step random_1 --fill random
decode_step prefill_2 --fill prefill
python3 "$here/speed_tables.py" "$OUT"/step_prefill_1/proj_decode_proj*.json | grep -A12 "µs per call"
python3 "$here/sparse_gemv_bench.py" --out "$OUT/gemv" --shapes gate_up down q_o --keeps 0.5 0.3 \
  > "$OUT/gemv.log" 2>&1
echo "gemv: rc=$? [$(elapsed)]"
grep -E "keep=0\.[35] " "$OUT/gemv.log"
