#!/bin/bash
# The doctor's runs on the namespace testbed recorded in docs/doctor.md (needs root).
#
#   docs/doctor/testbed-runs.sh [OUT_DIR]        # default docs/doctor/testbed
#
# Four scenarios, RUNS runs each (default 10), every run a separate job of 8 ranks at
# 400 Mbit/s, its JSON (--json) and its printed table kept as OUT_DIR/<scenario>-<i>.json
# and .txt:
#   one-0.5    rank 0 at half rate                  (testbed up ... --degrade 0:0.5)
#   healthy    every link at 400 Mbit/s             (testbed shape --healthy)
#   two        rank 0 at 0.5 and rank 3 at 0.7      (testbed shape --degrade 0:0.5,3:0.7)
#   node       2 ranks per node on 4 nodes, node 1 (ranks 2, 3) at 0.5
#              (testbed up --ranks 8 --ranks-per-node 2 --degrade 1:0.5)
# Then OUT_DIR/summary.md tabulates them (docs/doctor/summarize.py).
#
# PYTHON: the interpreter every rank runs (default: python3 on PATH); the package must be
# importable by it (PYTHONPATH is passed to the ranks).
set -euo pipefail
OUT=${1:-docs/doctor/testbed}
PYTHON=${PYTHON:-python3}
RUNS=${RUNS:-10}
NAME=${NAME:-doctortb}
mkdir -p "$OUT"
tb() { local sub=$1; shift; "$PYTHON" -m optcc_mpi testbed "$sub" --name "$NAME" "$@"; }
doctor() {  # doctor SCENARIO I: one job, its JSON and its table
  local rc=0
  tb run -- "$PYTHON" -m optcc_mpi doctor --no-progress --json "$OUT/$1-$2.json" \
    > "$OUT/$1-$2.txt" 2>&1 || rc=$?
  echo "$1 run $2: exit $rc; $(tail -n 2 "$OUT/$1-$2.txt" | head -n 1 | cut -c1-150)"
}
trap 'tb down --kill >/dev/null' EXIT
tb up --ranks 8 --rate 400mbit --degrade 0:0.5 --force >/dev/null
for i in $(seq 1 "$RUNS"); do doctor one-0.5 "$i"; done
tb shape --healthy >/dev/null
for i in $(seq 1 "$RUNS"); do doctor healthy "$i"; done
tb shape --degrade 0:0.5,3:0.7 >/dev/null
for i in $(seq 1 "$RUNS"); do doctor two "$i"; done
tb up --ranks 8 --ranks-per-node 2 --rate 400mbit --degrade 1:0.5 --force >/dev/null
for i in $(seq 1 "$RUNS"); do doctor node "$i"; done
"$PYTHON" "$(dirname "$0")/summarize.py" "$OUT" > "$OUT/summary.md"
cat "$OUT/summary.md"
