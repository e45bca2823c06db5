"""The ride's per-call check (docs/results.md, "The ride"): gloo and an ``optcc`` group
in one job, interleaved in blocks, medians of 300 synchronous ``dist.all_reduce`` calls of
4 B, 64 KiB and 1 MiB (float32), and how many calls rode (``check.ride.Ride.hits``).

Under torchrun (``OPTCC_BOARD=0``: every call as across machines) or the testbed::

    OPTCC_BOARD=0 torchrun --standalone --nproc-per-node 2 docs/backend/ride.py
    optcc-mpi testbed run [--env OPTCC_LINKS=healthy] -- .venv/bin/python docs/backend/ride.py

Rank 0 prints one line per size: gloo's two medians, optcc's two, their ratio (sum of
optcc's over sum of gloo's), the same ratio of the means (the total over the calls: the
calls a watch observes included), the calls that rode and the rounds dropped so far.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import optcc_mpi.torch  # noqa: F401  (registers the optcc backend)
from optcc_mpi import collectives
from optcc_mpi.transports.distributed import group_of


def timed_us(fn: Callable[[], object], n: int = 300, warmup: int = 20) -> tuple[float, float]:
    """The median and the mean (the total a user pays, over ``n``) of ``n`` calls, in us."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, statistics.fmean(times) * 1e6


def main() -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:  # (the testbed starts ranks as MPI does)
        optcc_mpi.torch.init_process_group_from_mpi("gloo")
    rank = dist.get_rank()
    optcc = dist.new_group(backend="optcc")
    ride = collectives.comm_state(group_of(optcc).optcc_transport()).ride
    for count in (1, 16384, 262144):
        x = torch.ones(count)
        hits = ride.hits if ride is not None else 0
        gloo, ours = [], []
        for _ in range(2):  # (interleaved blocks)
            gloo.append(timed_us(lambda x=x: dist.all_reduce(x)))
            ours.append(timed_us(lambda x=x: dist.all_reduce(x, group=optcc)))
        if rank == 0:
            rode = "no ride" if ride is None else f"rode {ride.hits - hits}, dropped {ride.misses}"
            med = sum(o[0] for o in ours) / sum(g[0] for g in gloo)
            mean = sum(o[1] for o in ours) / sum(g[1] for g in gloo)
            print(
                f"{count * 4:>8} B  gloo {gloo[0][0]:.0f} {gloo[1][0]:.0f} us  optcc "
                f"{ours[0][0]:.0f} {ours[1][0]:.0f} us  ratio {med:.2f} (means {mean:.2f})  "
                f"{rode}",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
