"""A long run whose links change under it, nothing told (issue 42, Deliver 5).

Every ``--every`` calls rank 0 reshapes the testbed's links to the next profile of
``--phases`` (cycling), between two barriers; every call is an ``allreduce`` of
``--size`` bytes with no ``links`` and no ``OPTCC_*`` variable, over MPI
(``optcc_mpi.allreduce``) or, with ``--torch``, through a process group of the ``optcc``
backend (``dist.all_reduce``). Every sum is checked exactly (integers in float32) and
every rank's results must be the same bits (a digest per call, gathered at the end).
Rank 0 prints, per phase, the call at which the watch's profile first matched the
truth (every rank within 0.1), and writes one JSON line per call to ``--out``. With
``OPTCC_LINKS_LOG=FILE`` the watch records what it adopts; ``optcc-mpi report --links
FILE`` draws it.

Run on the testbed (as root)::

    optcc-mpi testbed up --ranks 8 --rate 400mbit
    optcc-mpi testbed run --env OPTCC_LINKS_LOG=links.jsonl -- \\
        .venv/bin/python docs/testbed/long_run.py --calls 1000 --out calls.jsonl [--torch]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib

import numpy as np

from optcc_mpi.collectives import comm_state, last_stats
from optcc_mpi.lab import testbed
from optcc_mpi.links import Links
from optcc_mpi.units import parse_size

PHASES = "healthy;0:0.5;2:0.6,5:0.4;3:0.3"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100, help="calls per phase (100)")
    ap.add_argument("--size", default="4M", help="bytes per call (4M)")
    ap.add_argument("--phases", default=PHASES, help=f"profiles, ';'-separated ({PHASES})")
    ap.add_argument("--torch", action="store_true", help="through the optcc backend")
    ap.add_argument("--out", default=None, help="one JSON line per call")
    args = ap.parse_args()
    told = [k for k in ("OPTCC_LINKS", "OPTCC_LINK_RATE", "OPTCC_ALGORITHM") if k in os.environ]
    assert not told, f"nothing may be told: {told}"
    phases = [Links.parse(text) for text in args.phases.split(";")]
    n = parse_size(args.size) // 4
    if args.torch:
        import torch
        import torch.distributed as dist
        from nothing_set import start

        start()
        rank, p = dist.get_rank(), dist.get_world_size()
        group = dist.new_group(backend="optcc")
        wire = group

        def barrier() -> None:
            dist.barrier()

        def gather(obj: object) -> list[object]:
            out: list[object] = [None] * p
            dist.all_gather_object(out, obj)
            return out

        def call(x: np.ndarray) -> np.ndarray:
            t = torch.from_numpy(x.copy())
            dist.all_reduce(t, group=group)
            return t.numpy()

    else:
        from mpi4py import MPI

        import optcc_mpi

        comm = MPI.COMM_WORLD
        rank, p = comm.Get_rank(), comm.Get_size()
        wire = comm
        barrier, gather = comm.Barrier, comm.allgather

        def call(x: np.ndarray) -> np.ndarray:
            return optcc_mpi.allreduce(x)

    # Integers below 2**24 / p: every sum is exact in float32, whatever the order.
    base = (np.arange(n, dtype=np.int64) % 1021).astype(np.float32)
    rows, digests, wrong = [], [], 0
    t_start = time.perf_counter()
    for i in range(args.calls):
        if i % args.every == 0:
            barrier()
            if rank == 0:
                testbed.set_shaping(phases[(i // args.every) % len(phases)].fractions)
            barrier()
        x = base + rank
        t0 = time.perf_counter()
        y = call(x)
        dt = time.perf_counter() - t0
        wrong += int(not np.array_equal(y, p * base + p * (p - 1) / 2))
        digests.append(zlib.crc32(y.tobytes()))
        watch = comm_state(wire).watch
        rows.append(
            {
                "call": i,
                "seconds": dt,
                "truth": str(phases[(i // args.every) % len(phases)]),
                "profile": None if watch is None else str(watch.profile),
                "algorithm": last_stats().get("algorithm"),
            }
        )
    total = time.perf_counter() - t_start
    every = gather((wrong, digests))
    same = all(d == every[0][1] for _, d in every)
    if rank == 0:
        testbed.set_shaping(None)
        how = "optcc backend" if args.torch else "MPI"
        bad = sum(w for w, _ in every)
        print(f"{p} ranks, {args.calls} calls of {args.size} ({how}), {total:.1f} s; "
              f"wrong sums {bad}; same bits everywhere {same}")  # fmt: skip
        for start in range(0, args.calls, args.every):
            truth = phases[(start // args.every) % len(phases)].vector(p)
            hit = next(
                (r["call"] - start for r in rows[start : start + args.every]
                 if r["profile"] is not None
                 and np.abs(Links.parse(r["profile"]).vector(p) - truth).max() <= 0.1),
                None,
            )  # fmt: skip
            spent = sum(r["seconds"] for r in rows[start : start + args.every])
            named = Links({r: float(f) for r, f in enumerate(truth) if f < 1})
            print(f"calls {start}-{start + args.every - 1}: truth {named}, "
                  f"matched after {hit} calls, {spent:.1f} s")  # fmt: skip
        if args.out:
            with open(args.out, "w") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
