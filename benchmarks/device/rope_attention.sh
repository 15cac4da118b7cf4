#!/usr/bin/env bash
# Issue 4 on the H200: RoPE, the cache write and the split-K attention as one launch per layer
# (kernels.decode_attention.rope_attention, ROPE_IN_ATTENTION) where `rope_cache` and split_k took
# two. GPU tests of both RoPE kernels and of the captured engine step; then the llama-3.1-8b step
# (keep 0.5, 2K) with it (profiled), without it, and with it again in a third process.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/rope_attention.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_rope_cache.py" "$tests/engine/test_cuda_capture.py"
STEP_GREP="kernels .*us/step|calls +_(rope_cache|split)_kernel"
decode_step fused_1 --profile 10
decode_step rope_cache --no-rope-attention
decode_step fused_2
