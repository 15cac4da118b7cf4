#!/usr/bin/env bash
# Issue 4 on the H200: the new defaults, the sparse GEMVs launched as programmatic dependents
# (sparse_gemv.PDL) and SwiGLU formed in down's input load (sparse_linear.FUSE_SWIGLU). The CUDA tests
# of the sparse GEMV, the attention, the fused layer, the captured engine and the routed step under
# them; then the llama-3.1-8b step (keep 0.5, 2K) beside the former defaults (variant 'norms'), twice,
# the first profiled (each sparse GEMV call beside its byte time in the speed tables).
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/pdl_defaults.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/engine/test_cuda_capture.py" "$tests/projection/test_routing_cuda.py" \
  "$tests/kernels/test_sparse_gemv.py" "$tests/kernels/test_sparse_gemv_compact.py" \
  "$tests/projection/test_sparse_linear.py" "$tests/kernels/test_decode_attention.py" \
  -k "cuda or register_cap or stable or pdl"
STEP_GREP="calls +_sparse_gemv_kernel"
decode_step new_1 --variants default,norms --profile 10
decode_step new_2 --variants default,norms
python3 "$here/speed_tables.py" "$OUT"/step_new_1/proj_decode_proj*.json | grep -A12 "µs per call"
