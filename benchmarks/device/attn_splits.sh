#!/usr/bin/env bash
# Issue 4 on the H200: split-K attention at 2K with fewer, longer splits (the fused merge reads
# fewer partials), then the llama-3.1-8b step (keep 0.5, 2K) with the new defaults (BF16_PAIRS on),
# with the o projection on stages 8 (CONFIGS, the picks of sparse_gemv_20261130T1519Z_tc_list),
# and with that and at least 256 or 512 keys per attention split.
#   OUT=/some/dir CONFIGS=chosen.json PYTHONPATH=src bash benchmarks/device/attn_splits.sh
set -u
source "$(dirname "$0")/lib.sh"
: "${CONFIGS:?set CONFIGS to a sparse_gemv_bench --choose file}"
python3 "$here/attention_bench.py" --out "$OUT/attn" --contexts 2048 --backends split_k --sweep \
  --sweep-splits 3,5,9,17,33 --sweep-configs 64:4:3,128:4:3 > "$OUT/attn.log" 2>&1
echo "attention: rc=$? [$(elapsed)]"; grep -E "n= +2048" "$OUT/attn.log" | head -12
for v in default o8 o8_attn256 o8_attn512; do
  flags=(); [ $v != default ] && flags=(--gemv-configs "$CONFIGS")
  case $v in *attn256) flags+=(--attn-min-split-keys 256);; *attn512) flags+=(--attn-min-split-keys 512);; esac
  python3 "$here/proj_decode_h200.py" --out "$OUT/step_$v" --keeps 0.5 --context 2K --compile-mode '' "${flags[@]}" \
    > "$OUT/step_$v.log" 2>&1
  echo "step $v: rc=$? [$(elapsed)]"; grep -E "% of bound" "$OUT/step_$v.log" | sed "s/^/  $v /"
done
