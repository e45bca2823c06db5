"""OptCC's time on the testbed at several values of one schedule parameter: the segment
count k (issue 9, docs/testbed.md 1.6d) or the ramp (1.6e).

Run inside the testbed, one rank per namespace, e.g.::

    optcc-mpi testbed run --name tb8 -- .venv/bin/python docs/testbed/ksweep.py \
        0:0.5 16,32 auto,64,32,16,8 3 > docs/testbed/ksweep-p8.jsonl
    optcc-mpi testbed run --name tb8 -- .venv/bin/python docs/testbed/ksweep.py \
        0:0.5 16,32 8,0,2,3,4,6,8,0,2,3,4,6 5 ramp > docs/testbed/rampsweep-p8.jsonl

Arguments: the links (as ``links=``), sizes in MiB, values of the parameter (``auto`` is
the builder's own choice for this fabric; ``k=47:ramp=5`` sets several parameters at
one point, docs/testbed.md 1.6f), timed calls per point (one warm-up call first), and the
parameter's name (default ``k``). Rank 0 prints one JSON line per point:
median, min and max over the calls of the slowest rank's time, and the k and ramp the
builder used.
"""

import json
import shlex
import sys
import time

import numpy as np
from mpi4py import MPI

import optcc_mpi
from optcc_mpi.collectives import last_stats

comm = MPI.COMM_WORLD
rank, p = comm.Get_rank(), comm.Get_size()
links = sys.argv[1]
sizes = [int(s) << 20 for s in sys.argv[2].split(",")]
ks = [None if k == "auto" else k if "=" in k else int(k) for k in sys.argv[3].split(",")]
n = int(sys.argv[4]) if len(sys.argv) > 4 else 3
name = sys.argv[5] if len(sys.argv) > 5 else "k"
command = shlex.join(["python", *sys.argv])
for nbytes in sizes:
    x0 = np.random.default_rng(rank).random(nbytes // 4, dtype=np.float32)
    want = comm.allreduce(x0.astype(np.float64))
    for k in ks:
        if isinstance(k, str):  # several parameters: "k=47:ramp=5"
            params = {key: int(v) for key, v in (kv.split("=") for kv in k.split(":"))}
        else:
            params = {} if k is None else {name: k}
        ts = []
        for _ in range(n + 1):
            x = x0.copy()
            comm.Barrier()
            t0 = time.perf_counter()
            optcc_mpi.allreduce(
                MPI.IN_PLACE, x, comm=comm, algorithm="optcc", links=links, params=params
            )
            ts.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        used = last_stats()["schedule"].params["k"]
        ramp_used = last_stats()["schedule"].params["ramp"]
        err = float(np.max(np.abs(x - want)) / max(1.0, float(np.max(np.abs(want)))))
        wrong = comm.allreduce(int(err > 1e-5))
        ts = ts[1:]
        if rank == 0:
            row = dict(
                p=p, MiB=nbytes >> 20, links=links, **{name: "auto" if k is None else k},
                k_used=used, ramp_used=ramp_used,
                median_ms=1e3 * float(np.median(ts)), min_ms=1e3 * min(ts),
                max_ms=1e3 * max(ts), calls=n, wrong=wrong, command=command,
            )
            print(json.dumps(row), flush=True)
