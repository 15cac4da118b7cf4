#!/usr/bin/env bash
# Issue 4 on the H200: the decode step with each layer's two RMSNorms and residual adds inside the
# sparse GEMVs (sparse_linear.FUSE_NORMS: o and down add the residual and leave per-tile sums of
# squares, q|k|v and gate|up norm their input as they load it), against the same step without
# (variant 'plain', the defaults before), in two processes in both orders; the first with a
# per-kernel profile. First the GPU tests of the fused kernel paths, the loop configs and the
# sparse engine against the masked reference.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/fused_norms.sh   (TESTS: the tests' -k)
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_sparse_gemv.py" "$tests/projection/test_sparse_linear.py" \
  -k "${TESTS:-fused_norm or loop_configs or on_cuda}"
for run in 1 2; do
  variants=default,plain; extra=(--profile 20)
  [ $run = 2 ] && { variants=plain,default; extra=(); }
  python3 "$here/proj_decode_h200.py" --out "$OUT/step_$run" --keeps 0.5 --context 2K --compile-mode '' \
    --variants $variants "${extra[@]}" > "$OUT/step_$run.log" 2>&1
  echo "step $run: rc=$? [$(elapsed)]"; grep -E "% of bound|kernels .*us/step" "$OUT/step_$run.log" | sed "s/^/  /"
done
