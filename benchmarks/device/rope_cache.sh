#!/usr/bin/env bash
# Issue 4 on the H200: the decode step with RoPE and the cache write as one launch per layer
# (kernels.rope_cache, in the dense and the sparse step alike) on top of the fused norms: two
# processes with it (variants default and plain, both orders, the first profiled) and one
# without it. First the GPU tests of the kernel, the captured engine step against the
# chunked forward, the fused norm paths and the sparse engine against the masked reference.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/rope_cache.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_rope_cache.py" "$tests/engine/test_cuda_capture.py" "$tests/kernels/test_sparse_gemv.py" \
  "$tests/projection/test_sparse_linear.py" -k "rope or capture or compiled or fused_norm or engine_on_cuda"
for run in 1 2 3; do
  case $run in
    1) args=(--rope-cache --variants default,plain --profile 20) ;;
    2) args=(--rope-cache --variants plain,default) ;;
    3) args=(--no-rope-cache --variants default) ;;
  esac
  python3 "$here/proj_decode_h200.py" --out "$OUT/step_$run" --keeps 0.5 --context 2K --compile-mode '' "${args[@]}" \
    > "$OUT/step_$run.log" 2>&1
  echo "step $run (${args[*]}): rc=$? [$(elapsed)]"
  grep -E "% of bound|kernels .*us/step|dense n=" "$OUT/step_$run.log" | sed "s/^/  /"
done
