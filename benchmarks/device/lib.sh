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
