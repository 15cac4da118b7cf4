# Sourced by the device scripts after `set -u`: checks and makes OUT, sets `here` (the benchmarks
# folder) and `tests` (the tests folder), starts the clock. `elapsed` prints the seconds since;
# `run_tests ARGS` runs pytest ARGS into $OUT/tests.log and prints its summary and first failures.
: "${OUT:?set OUT to the folder for the records}"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tests=$here/../tests
mkdir -p "$OUT"
start=$(date +%s)
elapsed() { echo "$(($(date +%s) - start)) s"; }
run_tests() {
  python3 -m pytest -q "$@" > "$OUT/tests.log" 2>&1
  echo "tests: rc=$? $(tail -1 "$OUT/tests.log") [$(elapsed)]"
  grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -8
}
# `decode_step NAME ARGS`: the llama-3.1-8b step at keep 0.5 and 2K (proj_decode_h200.py ARGS) into
# $OUT/step_NAME, its summary lines (and those matching $STEP_GREP) printed.
decode_step() {
  local name=$1; shift
  python3 "$here/proj_decode_h200.py" --out "$OUT/step_$name" --keeps 0.5 --context 2K --compile-mode '' "$@" \
    > "$OUT/step_$name.log" 2>&1
  echo "step $name: rc=$? [$(elapsed)]"
  grep -E "% of bound|dense n=${STEP_GREP:+|$STEP_GREP}" "$OUT/step_$name.log" | sed "s/^/  /"
}
