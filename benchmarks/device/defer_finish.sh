#!/usr/bin/env bash
# Issue 4 on the H200: the fused step's gate|up without its split-K finish
# (sparse_linear.DEFER_GATE_UP_FINISH): the launch leaves its fp32 sums in its workspace and
# swiglu_from_sums forms down's input from them. The CUDA test of accumulate and swiglu_from_sums,
# then the llama-3.1-8b step (keep 0.5, 2K) without and with it, twice each, alternating, the first
# of each profiled.
# Run at 622ed85 (atomic adds kept) or 7a26b6d (partial rows); both lost and the knob was removed after.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/defer_finish.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_sparse_gemv.py" -k "accumulate and cuda"
STEP_GREP="calls +(_sparse_gemv_kernel|_swiglu_sums_kernel|triton_poi)"
decode_step base_1 --no-defer-gate-up-finish --profile 10
decode_step defer_1 --defer-gate-up-finish --profile 10
decode_step base_2 --no-defer-gate-up-finish
decode_step defer_2 --defer-gate-up-finish
