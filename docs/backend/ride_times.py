"""How steady the library ring's own time is (docs/results.md, the tripwire): 300 synchronous
gloo AllReduces of 64 KiB and 1 MiB, each rank timing its own from posting to completion
(with some arrival skew, as an application makes); rank 0 prints, over the calls, the
fastest rank's time (the ring's own) and the slowest's: median, 90th percentile, and how
many calls took at least 1.25x the median of the 9 before (what would trip the watch).

    optcc-mpi testbed up --ranks 4 --rate 1gbit [--links 2:0.6]
    optcc-mpi testbed run -- .venv/bin/python docs/backend/ride_times.py
"""

import os, sys, time, statistics
import numpy as np
import torch, torch.distributed as dist
import optcc_mpi.torch
optcc_mpi.torch.init_process_group_from_mpi("gloo")
rank, p = dist.get_rank(), dist.get_world_size()
pg = dist.group.WORLD
opts = dist.AllreduceOptions()
for count in (16384, 262144):
    x = torch.ones(count)
    for _ in range(20): dist.all_reduce(x)
    d = []
    for i in range(300):
        if i % 3 == 0: time.sleep(0.0005 * ((i * 7 + rank * 3) % 5))  # (arrival skew, as an application makes)
        t0 = time.perf_counter(); w = pg.allreduce([x], opts); w.wait(); d.append(time.perf_counter() - t0)
    allt = [None] * p
    dist.all_gather_object(allt, d)
    if rank == 0:
        a = np.array(allt) * 1e3  # (p, calls) ms
        mn, mx = a.min(axis=0), a.max(axis=0)
        def trips(v):
            t = 0
            for i in range(9, len(v)):
                if v[i] >= 1.25 * np.median(v[i-9:i]): t += 1
            return t / (len(v) - 9)
        print(f"{count*4} B: min-over-ranks median {np.median(mn):.2f} ms p90 {np.percentile(mn,90):.2f} trips {trips(mn):.1%} | max-over-ranks median {np.median(mx):.2f} p90 {np.percentile(mx,90):.2f} trips {trips(mx):.1%}", flush=True)
dist.destroy_process_group()
