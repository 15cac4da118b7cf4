#!/usr/bin/env bash
# On the device, from a tree's root: start a chain of campaigns in the background, once any
# earlier chain has ended (two at once would share the GPU and be refused); it starts no cell
# after $1 seconds (--stop-after). Campaign folders committed under benchmarks/records/h200/campaigns
# are copied into $W/runs on first use, so runs resume from their records. The tree is copied to
# $W/tree unless it is $W/tree. GPUS=0,1,2 (a machine of several GPUs) runs block b of each
# campaign whole on GPU b mod 3 (--gpus). SHARED_GPU=allow times beside other processes (each
# record still names them).
#   bash benchmarks/device/chain.sh BUDGET SPEC...
set -u
BUDGET=$1; shift; SPECS=("$@")
W=${W:-~/w}; mkdir -p $W/runs $W/cache $W/tree
# the campaigns under benchmarks/records/h200 are H200 campaigns: start none on another GPU (a call
# with no kind named may get an H100); EXPECT_GPU="" turns this off, e.g. for a CPU campaign
if [ -n "${EXPECT_GPU-H200}" ] && command -v nvidia-smi > /dev/null; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  case "$gpu" in *"${EXPECT_GPU-H200}"*) ;; *) echo "chain: not started: the GPU is '$gpu', not ${EXPECT_GPU-H200}"; exit 3;; esac
fi
[ -f $W/chain.pid ] && while kill -0 $(cat $W/chain.pid) 2>/dev/null; do sleep 2; done
if [ "$(pwd -P)" != "$(cd $W/tree && pwd -P)" ]; then
  rm -rf $W/tree && mkdir -p $W/tree && tar cf - --exclude=./.xfer --exclude=./.dev . | tar xf - -C $W/tree
  [ -d .xfer ] && cp -r .xfer $W/tree/.xfer
fi
for s in "${SPECS[@]}"; do
  c=$(basename $s .toml)
  [ -d benchmarks/records/h200/campaigns/$c ] && [ ! -d $W/runs/$c ] && {
    cp -r benchmarks/records/h200/campaigns/$c $W/runs/$c; rm -rf $W/runs/$c/report $W/runs/$c/README.md; }
done
# a compile cache sent back by end.sh in an earlier session, carried as .xfer/cache/cache.tgz
[ -f $W/tree/.xfer/cache/cache.tgz ] && [ ! -d $W/cache/inductor ] && tar xzf $W/tree/.xfer/cache/cache.tgz -C $W/cache
cd $W/tree
export TORCHINDUCTOR_CACHE_DIR=$W/cache/inductor TRITON_CACHE_DIR=$W/cache/triton PYTHONPATH=src
[ -f $W/chain.json ] && cat $W/chain.json >> $W/chains.json
setsid nohup python3 -m sparsedecode campaign run "${SPECS[@]}" --out-root $W/runs --stop-after $BUDGET \
  ${GPUS:+--gpus $GPUS} ${SHARED_GPU:+--shared-gpu $SHARED_GPU} --json > $W/chain.json 2> $W/chain.err < /dev/null &
echo $! > $W/chain.pid
echo "chain: pid $(cat $W/chain.pid): ${SPECS[*]}"
sleep ${WAIT:-45}; tail -c 600 $W/chain.err; ls -t $W/runs/*/cells/*/ 2>/dev/null | head -3
