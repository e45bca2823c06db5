#!/bin/bash
# The per-call benchmark with the board off (every call as across machines), two trees
# alternating (docs/results.md, "The ride"): BEFORE and AFTER are checkouts, each with
# its extensions built in place; the interpreter is this checkout's .venv.
# usage: docs/backend/ride_ab.sh BEFORE AFTER ROUNDS ITERS SIZE [lab backend options]
# e.g.   docs/backend/ride_ab.sh /work/wt-before . 3 101 1M --sync
set -euo pipefail
py=$(readlink -f .venv/bin/torchrun)
before=$(readlink -f "$1"); after=$(readlink -f "$2"); rounds=$3; iters=$4; size=$5; shift 5
for _ in $(seq "$rounds"); do
  for tree in "$before" "$after"; do
    out=$(cd "$tree" && OPTCC_BOARD=0 PYTHONPATH="$tree" OMP_NUM_THREADS=1 "$py" --standalone \
      --nproc-per-node 2 -m optcc_mpi lab backend -b "$size" -e "$size" --iters "$iters" \
      --warmup 5 "$@" 2>/dev/null)
    echo "$tree $size gloo-median-ms $(echo "$out" | grep ' gloo ' | awk '{print $3}') | $(echo "$out" | grep ' optcc ')"
  done
done
