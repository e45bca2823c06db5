#!/usr/bin/env bash
# OptCC at 16 ranks on the testbed with no OPTCC_LINK_RATE: the rate learnt (issue 42;
# docs/results.md). Run as root from the checkout:
#     bash docs/scale/learnt_rate.sh
# A 16-rank testbed at 50 Mbit/s, rank 0 at half; `bench` (8 MiB, 3 timed calls after one
# warm-up, the fault-free ring beside OptCC) with the links the testbed shapes (its
# default), then with `--links probe`.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=$PWD/.venv/bin/python
CLI=.venv/bin/optcc-mpi
out=docs/scale
$CLI testbed up --name c16 --ranks 16 --rate 50mbit --links 0:0.5 --force >/dev/null
$CLI testbed run --name c16 --env MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 -- \
  $PY -m optcc_mpi bench -b 8M -e 8M -n 3 -w 1 --algorithms optcc \
  --out $out/learnt-50mbit-0_0.5-testbed.jsonl
$CLI testbed run --name c16 --env MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 -- \
  $PY -m optcc_mpi bench -b 8M -e 8M -n 3 -w 1 --algorithms optcc --links probe \
  --out $out/learnt-50mbit-0_0.5-probe.jsonl
$CLI testbed down --name c16 >/dev/null
