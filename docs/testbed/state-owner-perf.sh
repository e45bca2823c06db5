#!/bin/bash
# Before/after: the same lab tools on the package at 8739fb9 (a worktree at /work/before,
# its C extension built in place) and on this one (/work/main),
# alternating, in one session. Ratios are within each run (PYTHONPATH picks the tree).
set -u
PY=${PY:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-.venv/bin/mpiexec}
export MPIR_CVAR_CH4_PROGRESS_THROTTLE=1
OUT=${1:?output folder}
mkdir -p $OUT
for round in 1 2; do
  for tree in before main; do
    echo "== $tree round $round"
    PYTHONPATH=/work/$tree $MPIEXEC -n 2 $PY -m optcc_mpi lab percall --sizes 8,64,512,4K,32K,256K --iters 3000 --batch 50 --p2p --json $OUT/percall-$tree.jsonl 2>&1 | grep -v "^#" | tail -30
    PYTHONPATH=/work/$tree $MPIEXEC -n 2 $PY -m optcc_mpi lab transport -b 4M -e 64M -f 4 -n 7 --out $OUT/transport-$tree.jsonl 2>&1 | tail -20
  done
done
