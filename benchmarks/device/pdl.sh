#!/usr/bin/env bash
# Issue 4 on the H200: programmatic dependent launch in the llama-3.1-8b decode step (keep 0.5, 2K),
# last measured before the fused norms were the default (it lost then: records
# h200/sparse_gemv_20261130T1305Z). The CUDA tests of the PDL chains (sparse GEMVs; attention between
# sparse GEMVs), then the step's default beside the sparse GEMVs launched with PDL (pdl+norms) and
# with SwiGLU in down's load too (pdl+norms+swiglu), without and with the split-K attention launched
# with PDL (--attn-pdl), twice, alternating.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/pdl.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_decode_attention.py" "$tests/kernels/test_sparse_gemv.py" -k pdl
STEP_GREP=""
decode_step pdl_1 --variants default,pdl+norms,pdl+norms+swiglu
decode_step attnpdl_1 --variants default,pdl+norms,pdl+norms+swiglu --attn-pdl
decode_step pdl_2 --variants default,pdl+norms,pdl+norms+swiglu
decode_step attnpdl_2 --variants default,pdl+norms,pdl+norms+swiglu --attn-pdl
