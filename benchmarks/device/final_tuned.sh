#!/usr/bin/env bash
# Issue 4 on the H200: the defaults after this session's changes (FINISH_LOAD, RESET_STORE, the o and
# q|k|v configs built into TUNED). The sparse GEMV's CUDA tests at the default configs and of the finish;
# then the llama-3.1-8b step (keep 0.5, 2K, prefilled cache) twice.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/final_tuned.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_sparse_gemv.py" -k "finish_load or kernel_on_cuda or graph_follows"
STEP_GREP="calls +_sparse_gemv_kernel"
decode_step final_1
decode_step final_2
