#!/usr/bin/env bash
# Device calls 2..n-1: wait up to $1 seconds (default 540) while the driver (suite, then chain
# start) or the chain runs, then send back to $OUT: runs.tgz (every campaign folder, without the
# cells' logs) and suite.tgz (the suite's JUnit, log, GPU and command, once it has ended).
W=${W:-~/w}; end=$((SECONDS + ${1:-540}))
busy() { { [ -f $W/drive.pid ] && kill -0 $(cat $W/drive.pid) 2>/dev/null; } || \
         { [ -f $W/chain.pid ] && kill -0 $(cat $W/chain.pid) 2>/dev/null; }; }
while [ $SECONDS -lt $end ] && busy; do sleep 5; done
cat $W/drive.log 2>/dev/null
[ -f $W/suite/rc ] && { tar czf $OUT/suite.tgz -C $W suite; grep -E "passed|failed|error" $W/suite/pytest.log | tail -3; }
[ -d $W/runs ] && tar czf $OUT/runs.tgz -C $W --exclude=logs runs
if [ -f $W/chain.pid ]; then
  kill -0 $(cat $W/chain.pid) 2>/dev/null && echo "chain running" || { echo "chain ended"; cat $W/chain.json; }
  tail -c 600 $W/chain.err
fi
du -sh $W/cache/* 2>/dev/null
for d in $W/runs/*/; do [ -d "$d" ] && (cd $W/tree && PYTHONPATH=src python3 -m sparsedecode campaign status $d | head -3); done
