#!/bin/bash
# Issue 35 on the namespace testbed (root): the watch across healthy -> degraded -> recovered
# at 4 and 8 ranks (Deliver 1 and 3), then DDP on the optcc backend learning its links
# against the same backend told them (Deliver 2). Rows and links logs land beside this
# script; docs/testbed/watch35/table.py summarises the transitions.
#   bash docs/testbed/watch35/run.sh [transitions|ddp|all]
set -u
cd "$(dirname "$0")/../../.."
OUT=docs/testbed/watch35
PY=$PWD/.venv/bin/python
T="$PWD/.venv/bin/optcc-mpi"
what=${1:-all}
if [ "$what" != ddp ]; then
  for P in 4 8; do
    $T testbed down --name tb35 >/dev/null 2>&1
    $T testbed up --name tb35 --ranks $P --rate 400mbit >/dev/null || exit 1
    if [ $P = 4 ]; then cases="0:0.5 1:0.6,2:0.4 0:0.6,2:0.4"; else cases="0:0.5 2:0.6,3:0.4 2:0.6,5:0.4"; fi
    for c in $cases; do
      tag=$(echo $c | tr ':,' '-_')
      rm -f $OUT/transition-p$P-$tag.jsonl $OUT/linklog-p$P-$tag.jsonl
      echo "== transition p=$P links=$c $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
      OPTCC_LINKS_LOG=$OUT/linklog-p$P-$tag.jsonl timeout 900 $T testbed run --name tb35 -- \
        $PY -m optcc_mpi lab transition --size 4M --links $c --calls 4,10,10 \
        --out $OUT/transition-p$P-$tag.jsonl 2>&1 | tail -25
    done
    $T testbed down --name tb35 >/dev/null
  done
fi
if [ "$what" != transitions ]; then
  for spec in "4 0:0.5" "8 2:0.6,5:0.4" "4 healthy"; do
    set -- $spec; P=$1; L=$2
    $T testbed down --name tb35d >/dev/null 2>&1
    if [ $L = healthy ]; then links=""; else links="--links $L"; fi
    $T testbed up --name tb35d --ranks $P --rate 400mbit $links >/dev/null || exit 1
    tag=$(echo $L | tr ':,' '-_')
    echo "== ddp p=$P links=$L $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    OPTCC_LINKS_LOG=$OUT/ddp-linklog-p$P-$tag.jsonl timeout 1500 $T testbed run --name tb35d -- \
      $PY -m optcc_mpi lab ddp --backend --links watch --told \
      --out $OUT/ddp-p$P-$tag.jsonl 2>&1 | grep -v "W1205\|socket.cpp" | tail -8
    $T testbed down --name tb35d >/dev/null
  done
fi
