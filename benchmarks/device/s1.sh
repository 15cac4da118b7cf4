#!/usr/bin/env bash
# Device call 1 (one GPU), from the root of the tree sent to the device: start ONE background
# driver (drive.sh) that runs the GPU test suite and then the campaign chain, and return.
#   bash benchmarks/device/s1.sh TOTAL [SPEC...]
# TOTAL: seconds from now by which the driver's chain must have ended (the suite's time is taken
# out of it; the chain starts no cell after TOTAL - CELL_S). Default specs: 8B 0.5/0.3, 8B 0.5/0.5,
# 3B sweep. SPARSEDECODE_GIT_COMMIT=<sha> stamps the records and the suite's README with the commit
# the tree came from (the copy has no .git). SUITE=0 skips the suite (a later session at the same
# commit). W (default ~/w) holds everything on the device: tree/, runs/, cache/, suite/.
set -u
TOTAL=${1:-1400}; shift || true
W=${W:-~/w}; mkdir -p $W
D=$(cd "$(dirname "$0")" && pwd)
if [ -f $W/drive.pid ] && kill -0 $(cat $W/drive.pid) 2>/dev/null; then
  echo "a driver is already running (pid $(cat $W/drive.pid))"; exit 1
fi
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv
setsid nohup bash $D/drive.sh "$TOTAL" "$@" > $W/drive.log 2>&1 < /dev/null &
echo $! > $W/drive.pid
sleep ${WAIT:-20}; cat $W/drive.log
