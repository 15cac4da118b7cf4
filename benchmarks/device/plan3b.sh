#!/usr/bin/env bash
# Here (not on the device), from the repository root, once the 3B sweep is complete in a returned
# runs.tgz ($1): commit the sweep's records, then the 3B prediction and its crossing campaign,
# the prediction first (ByteCross App. D: predict, commit, then measure).
#   bash benchmarks/device/plan3b.sh /path/to/runs.tgz
# Then on the device: bash benchmarks/device/chain.sh BUDGET examples/campaigns/h200_crossing_3b_p50_s30.toml
set -eu
[ -f pyproject.toml ] && [ -d benchmarks/records ] || { echo "run from the repository root"; exit 2; }
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}; PY=${PY:-python3}
T=$(mktemp -d); tar xzf "$1" -C $T
S=benchmarks/records/h200/campaigns/h200_sweep_3b
$PY -m sparsedecode campaign merge $T/runs/h200_sweep_3b --into $S
$PY -m sparsedecode campaign status $S | head -3
if $PY -m sparsedecode campaign status $S | grep -q "pending:"; then echo "the sweep is not complete"; exit 1; fi
$PY -m sparsedecode report $S --out $S/report > /dev/null
git add $S && git commit -qm "H200 3B sweep records (examples/campaigns/h200_sweep_3b.toml): the kernel costs of the 3B crossing prediction"
P=benchmarks/records/h200/campaigns/h200_crossing_3b_p50_s30
$PY -m sparsedecode campaign plan-crossing $S --group sweep --half-width 16K \
  --prediction $P/prediction.json --spec examples/campaigns/h200_crossing_3b_p50_s30.toml
git add $P/prediction.json examples/campaigns/h200_crossing_3b_p50_s30.toml
git commit -qm "3B 0.5/0.3 crossing: the App. D prediction from the H200 3B sweep, committed before its campaign runs"
git log --oneline -2
rm -rf $T
