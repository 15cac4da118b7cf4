#!/usr/bin/env bash
# Issue 4 on the H200: split-K attention with a tail of less than one block folded into the split
# before it (decode_attention.FOLD_TAIL). At the step's 2049-key range the 17th of 17 splits holds
# one key: 136 programs on 132 SMs and a second tile of partials for the fused merge. The CUDA
# tests of the fold and of rope_attention, then the llama-3.1-8b step (keep 0.5, 2K) without and
# with it, twice each, alternating, the first of each profiled (the split kernel's time a step).
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/attn_fold.sh
set -u
source "$(dirname "$0")/lib.sh"
run_tests "$tests/kernels/test_decode_attention.py" "$tests/kernels/test_rope_cache.py" -k "fold or cuda"
STEP_GREP="calls +_split_kernel"
decode_step base_1 --no-attn-fold-tail --profile 10
decode_step fold_1 --attn-fold-tail --profile 10
decode_step base_2 --no-attn-fold-tail
decode_step fold_2 --attn-fold-tail
