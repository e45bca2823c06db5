"""Time a ring AllReduce with all links healthy, then with some ranks degraded.

Run inside a testbed by ``tests/test_testbed.py`` (through ``Testbed.launch_argv``); rank 0
reshapes the links between the two phases with ``optcc_mpi.lab.testbed.set_shaping``, which is
exactly what a benchmark inside the testbed does. Rank 0 writes a JSON result file.

The ring is ``optcc_mpi.allreduce(..., algorithm="ring")``, the package's own. Not named
``test_*``: pytest must not collect it.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import optcc_mpi
from optcc_mpi.lab import testbed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=float, default=8.0, help="message size in MiB")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per phase")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations per phase")
    parser.add_argument("--degrade", default="0:0.5", help="degraded phase, RANK:FRACTION,...")
    parser.add_argument("--out", required=True, help="JSON result file (written by rank 0)")
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    impl = "ring"

    def reduce(buf: np.ndarray) -> np.ndarray:
        # (the links told healthy: this job measures the ring's own bytes through the
        # shapers, and across machines, told nothing, the links would be learnt: probes)
        return optcc_mpi.allreduce(buf, algorithm="ring", links="healthy")

    count = int(args.mib * 2**20) // 4
    buf = np.full(count, rank + 1, dtype=np.float32)
    expected = n * (n + 1) / 2
    result: dict[str, object] = {"ranks": n, "bytes": count * 4, "impl": impl, "phases": {}}
    for phase, degrade in (("healthy", None), ("degraded", args.degrade)):
        if rank == 0:
            testbed.set_shaping(degrade)
        comm.Barrier()
        times = []
        for it in range(args.warmup + args.iters):
            comm.Barrier()
            start = time.perf_counter()
            out = reduce(buf)
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if it >= args.warmup:
                times.append(elapsed)
        if not np.all(out == expected):
            raise SystemExit(f"rank {rank}: wrong sum in phase {phase}")
        result["phases"][phase] = {
            "degrade": degrade,
            "times": times,
            "median": float(np.median(times)),
        }
    result["iterations"] = 2 * (args.warmup + args.iters)
    if rank == 0:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
