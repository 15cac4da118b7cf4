#!/usr/bin/env bash
# Last call: wait for the chain to end itself (--stop-after), at most $1 seconds (default 540);
# if it still runs then, wait for its next record and stop it with SIGTERM (the cell it has just
# started writes no record and stays pending). Then send back runs.tgz, logs.tgz, suite.tgz and
# the compile caches as cache.tgz when under 16 MiB (next session: put it at
# .xfer/cache/cache.tgz in the tree sent to the device).
W=${W:-~/w}; end=$((SECONDS + ${1:-540}))
running() { [ -f $W/$1.pid ] && kill -0 $(cat $W/$1.pid) 2>/dev/null; }
while [ $SECONDS -lt $end ] && { running drive || running chain; }; do sleep 3; done
if running chain; then
  last=$(find $W/runs -path '*/cells/*.json' | wc -l); t=$((SECONDS + ${RECORD_WAIT:-90}))
  while [ $SECONDS -lt $t ] && [ $(find $W/runs -path '*/cells/*.json' | wc -l) -eq $last ]; do sleep 1; done
  echo "stopping the chain (SIGTERM) after $(find $W/runs -path '*/cells/*.json' | wc -l) records"
  kill -TERM $(cat $W/chain.pid); while running chain; do sleep 1; done
fi
cat $W/drive.log 2>/dev/null; cat $W/chain.json 2>/dev/null; tail -c 600 $W/chain.err 2>/dev/null
[ -f $W/suite/rc ] && tar czf $OUT/suite.tgz -C $W suite
tar czf $OUT/runs.tgz -C $W --exclude=logs runs
tar czf $OUT/logs.tgz -C $W runs --wildcards '*/logs/*' 2>/dev/null
du -sh $W/cache/* 2>/dev/null; tar czf $W/cache.tgz -C $W/cache . && ls -l $W/cache.tgz
[ $(stat -c %s $W/cache.tgz) -lt 16000000 ] && cp $W/cache.tgz $OUT/cache.tgz
for d in $W/runs/*/; do (cd $W/tree && PYTHONPATH=src python3 -m sparsedecode campaign status $d | head -3); done
