#!/usr/bin/env bash
# Here (not on the device), from the repository root, with the project's Python active: merge a
# returned runs.tgz ($1) into the committed campaign folders and regenerate their reports and the
# results page. Then by hand: the README's <!-- crossings --> rows from docs/results.md, each
# folder's README (what ran, commit, commands), the tests, and a commit.
#   bash benchmarks/device/ingest.sh /path/to/runs.tgz
set -eu
[ -f pyproject.toml ] && [ -d benchmarks/records ] || { echo "run from the repository root"; exit 2; }
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}; PY=${PY:-python3}
T=$(mktemp -d); tar xzf "$1" -C $T
for d in $T/runs/*/; do
  c=$(basename $d); D=benchmarks/records/h200/campaigns/$c
  [ -n "$(find $d -path '*/cells/*.json' | head -1)" ] || { echo "$c: no records, left out"; continue; }
  $PY -m sparsedecode campaign merge $d --into $D
  $PY -m sparsedecode campaign status $D | head -4
  $PY -m sparsedecode report $D --out $D/report > /dev/null
done
$PY -m sparsedecode report results
rm -rf $T
git status --short | head -20
