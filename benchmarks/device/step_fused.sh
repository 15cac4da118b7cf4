#!/usr/bin/env bash
# Issue 4 on the H200: the llama-3.1-8b step (keep 0.5, 2K) with every current default (fused
# norms, one-launch RoPE reading its table rows on the device, the valid length computed once a
# step, rsqrt in the norm prologue), in two processes, the sparse variants 'default' and 'plain'
# (no fused norms) in both orders. First the quick GPU tests of the kernels these touch.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/step_fused.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_rope_cache.py" "$tests/engine/test_cuda_capture.py" "$tests/kernels/test_sparse_gemv.py" \
  -k "rope or (captured and split_k) or fused_norm"
for run in 1 2; do
  variants=default,plain; [ $run = 2 ] && variants=plain,default
  python3 "$here/proj_decode_h200.py" --out "$OUT/step_$run" --keeps 0.5 --context 2K --compile-mode '' \
    --variants $variants > "$OUT/step_$run.log" 2>&1
  echo "step $run ($variants): rc=$? [$(elapsed)]"
  grep -E "% of bound|dense n=" "$OUT/step_$run.log" | sed "s/^/  /"
done
