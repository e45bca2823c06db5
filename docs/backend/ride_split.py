"""Where a watched 1 MiB call's time goes with nothing set (docs/results.md): gloo and an
``optcc`` group called in turn, 300 calls each; optcc's calls split into those that rode,
those that rode right after an observed call (carrying what it measured), and those that
did not ride (the watch's sample: our ring, timed). Medians, rank 0.

    optcc-mpi testbed run -- .venv/bin/python docs/backend/ride_split.py [COUNT]
"""

import os, sys, time, statistics
import torch, torch.distributed as dist
import optcc_mpi.torch
from optcc_mpi import collectives
from optcc_mpi.transports.distributed import group_of
optcc_mpi.torch.init_process_group_from_mpi("gloo")
rank = dist.get_rank()
optcc = dist.new_group(backend="optcc")
st = collectives.comm_state(group_of(optcc).optcc_transport())
ride = st.ride
count = int(sys.argv[1]) if len(sys.argv) > 1 else 262144
x = torch.ones(count)
for _ in range(20): dist.all_reduce(x, group=optcc); dist.all_reduce(x)
g, rode, other, after_obs = [], [], [], []
prev_obs = False
for _ in range(300):
    t0 = time.perf_counter(); dist.all_reduce(x); g.append(time.perf_counter() - t0)
    h = ride.hits
    t0 = time.perf_counter(); dist.all_reduce(x, group=optcc); dt = time.perf_counter() - t0
    if ride.hits > h:
        (after_obs if prev_obs else rode).append(dt); prev_obs = False
    else:
        other.append(dt); prev_obs = True
if rank == 0:
    m = lambda v: f"{statistics.median(v)*1e3:.2f}ms n={len(v)}" if v else "-"
    print("gloo", m(g), "rode", m(rode), "rode-after-observed", m(after_obs), "not rode", m(other), flush=True)
dist.destroy_process_group()
