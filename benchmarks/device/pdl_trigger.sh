#!/usr/bin/env bash
# Issue 4 on the H200: the new defaults (sparse GEMVs with PDL, SwiGLU in down's load) once more on a
# fresh machine beside the former defaults (variant 'norms'), then the same with the sparse GEMVs
# letting the next kernel launch only as their programs exit (--pdl-trigger exit) rather than at
# their start.
#   OUT=/some/dir PYTHONPATH=src bash benchmarks/device/pdl_trigger.sh
set -u
source "$(dirname "$0")/lib.sh"
STEP_GREP=""
decode_step early_1 --variants default,norms
decode_step exit_1 --variants default,norms --pdl-trigger exit
