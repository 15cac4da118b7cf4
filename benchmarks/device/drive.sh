#!/usr/bin/env bash
# Started by s1.sh (setsid, in the background): the GPU suite, then chain.sh, one after the other
# (a timing cell refuses a GPU that another process holds, so the chain must not start before the
# suite's processes are gone). Runs from a copy of the tree in $W/tree, so the next call's tree
# may replace the one it was started from.
set -u
TOTAL=$1; shift; SPECS=("$@"); [ ${#SPECS[@]} -gt 0 ] || SPECS=(examples/campaigns/h200_crossing_8b_p50_s30.toml \
  examples/campaigns/h200_crossing_8b_p50_s50.toml examples/campaigns/h200_sweep_3b.toml)
W=${W:-~/w}; CELL_S=${CELL_S:-75}
echo "driver: start $(date -u +%FT%TZ), total ${TOTAL}s, commit ${SPARSEDECODE_GIT_COMMIT:-unknown}"
rm -rf $W/tree && mkdir -p $W/tree $W/suite && tar cf - --exclude=./.xfer --exclude=./.dev . | tar xf - -C $W/tree
[ -d .xfer ] && cp -r .xfer $W/tree/.xfer   # a carried compile cache, for chain.sh
cd $W/tree
if [ "${SUITE:-1}" != 0 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $W/suite/gpu.txt 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $W/suite/gpu.txt 2>&1
  echo "${SPARSEDECODE_GIT_COMMIT:-unknown}" > $W/suite/commit.txt
  CMD="python3 -m pytest -q -p no:cacheprovider -n ${SUITE_WORKERS:-6} --dist loadfile -k \"not interpreter\" tests/kernels tests/kv tests/engine tests/dispatch tests/timing --junitxml=suite.junit.xml"
  echo "$CMD" > $W/suite/command.txt
  echo "suite: start $(date -u +%FT%TZ)"
  s0=$SECONDS
  # SIGINT at SUITE_MAX: pytest stops, prints its summary and still writes the JUnit file
  PYTHONPATH=src timeout -s INT -k 30 ${SUITE_MAX:-720} bash -c "$CMD" > $W/suite/pytest.log 2>&1
  echo $? > $W/suite/rc; cp suite.junit.xml $W/suite/ 2>/dev/null
  echo "suite: rc $(cat $W/suite/rc) after $((SECONDS - s0)) s: $(tail -1 $W/suite/pytest.log)"
  sleep 2   # let the workers' CUDA contexts go
fi
BUDGET=$((TOTAL - SECONDS - CELL_S))
if [ $BUDGET -lt 60 ]; then echo "chain: not started, ${BUDGET}s left"; exit 0; fi
echo "chain: start $(date -u +%FT%TZ), --stop-after $BUDGET"
WAIT=0 bash benchmarks/device/chain.sh $BUDGET "${SPECS[@]}"
