#!/usr/bin/env bash
# OptCC at 16 ranks on the testbed with the links' rate told and the ranks per core
# counted (issue 36; docs/testbed.md 1.6j). Run as root from the checkout:
#     bash docs/scale/crowding.sh
# Each case: a fresh 16-rank testbed, `bench` (8 MiB, 3 timed calls after one warm-up,
# the fault-free ring beside OptCC), then at 50 Mbit/s the segment count the builder now
# chooses against the 34 it chose before (docs/testbed/ksweep.py, alternating points).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=$PWD/.venv/bin/python
CLI=.venv/bin/optcc-mpi
out=docs/scale
for rate in 50mbit 200mbit; do
  for links in 0:0.5 0:0.5,8:0.5; do
    tag=crowd-${rate}-${links//[:,]/_}
    $CLI testbed up --name c16 --ranks 16 --rate $rate --links $links --force >/dev/null
    $CLI testbed run --name c16 --env OPTCC_LINK_RATE=$rate --env MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 -- \
      $PY -m optcc_mpi bench -b 8M -e 8M -n 3 -w 1 --algorithms optcc --out $out/$tag.jsonl
    if [ $rate = 50mbit ]; then
      $CLI testbed run --name c16 --env OPTCC_LINK_RATE=$rate --env MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 -- \
        $PY docs/testbed/ksweep.py $links 8 auto,34,auto,34 3 > $out/$tag-k.jsonl
    fi
    $CLI testbed down --name c16 >/dev/null
  done
done
