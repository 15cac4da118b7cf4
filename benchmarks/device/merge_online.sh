#!/usr/bin/env bash
# Issue 4 on the H200: split-K attention's fused merge online over tiles of partials (each tile's
# LSEs and outputs loaded together, one trip to L2 per tile, where a first pass over the LSEs
# cost one more). The CUDA tests of split-K attention and rope_attention, then the llama-3.1-8b
# step (keep 0.5, 2K) in two processes, the first profiled (split kernel: 335 us a step before,
# records h200/sparse_gemv_20261130T2027Z_rope_attention_loop).
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/merge_online.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_decode_attention.py" "$tests/kernels/test_rope_cache.py" -k "cuda or graph or stable"
STEP_GREP="kernels .*us/step|calls +_split_kernel"
decode_step 1 --profile 10
decode_step 2
