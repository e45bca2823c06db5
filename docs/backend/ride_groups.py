"""gloo against its own groups and the optcc group (docs/results.md): synchronous AllReduces
of COUNT float32 on the default gloo group, a new gloo group, the gloo group that carries
the optcc transport's data (posted and waited for as the transport does, timed wait), and
the optcc group; the mean of 200 calls each, three rounds, rank 0.

    optcc-mpi testbed run -- .venv/bin/python docs/backend/ride_groups.py COUNT
"""

import os, sys, time, datetime
import torch, torch.distributed as dist
import optcc_mpi.torch
from optcc_mpi.transports.distributed import group_of
optcc_mpi.torch.init_process_group_from_mpi("gloo")
rank = dist.get_rank()
optcc = dist.new_group(backend="optcc")
g2 = dist.new_group(backend="gloo")
tr = group_of(optcc).optcc_transport()
data_pg = tr.data
count = int(sys.argv[1])
x = torch.ones(count)
td = datetime.timedelta(seconds=0.25)
opts = dist.AllreduceOptions()
def raw(pg):
    def f():
        w = pg.allreduce([x], opts); w.wait(td)
    return f
def run(f, n=200):
    for _ in range(20): f()
    t0 = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-t0)/n*1e6
for _ in range(3):
    r = dict(world=run(lambda: dist.all_reduce(x)), newgloo=run(lambda: dist.all_reduce(x, group=g2)), ourdata=run(raw(data_pg)), optcc=run(lambda: dist.all_reduce(x, group=optcc)))
    if rank == 0: print("  ".join(f"{k} {v:.0f}" for k, v in r.items()), flush=True)
dist.destroy_process_group()
