"""Where a riding call's time goes (docs/results.md): 300 synchronous ``dist.all_reduce``
calls of COUNT float32 (default 262144: 1 MiB) on an ``optcc`` group with nothing set;
for the calls that rode, the medians of the whole call, of its round (the library's
AllReduce alone, ``Ride.took``), of the rest, and of three parts of the rest: the round's
copy in (and its carried values), the rest of the guess (the flags, the copy out, the
carried values read), and the watch's bookkeeping (``watch_ridden``); then gloo's own
AllReduce of the same tensor. Rank 0 prints one line.

    optcc-mpi testbed run -- .venv/bin/python docs/backend/ride_phases.py [COUNT]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import optcc_mpi.torch
from optcc_mpi import collectives
from optcc_mpi.check import ride as ridemod
from optcc_mpi.transports.distributed import group_of

PARTS: dict[str, list[float]] = {"guess": [], "copy_in": [], "watch": []}


def timed(part: str, fn: Callable[..., object], less_took: bool = False) -> Callable[..., object]:
    def wrapped(*args: object, **kwargs: object) -> object:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        spent = time.perf_counter() - t0
        PARTS.setdefault(part, []).append(spent - (args[0].took if less_took else 0.0))  # type: ignore[attr-defined]
        return out

    return wrapped


def main() -> None:
    optcc_mpi.torch.init_process_group_from_mpi("gloo")
    rank = dist.get_rank()
    optcc = dist.new_group(backend="optcc")
    st = collectives.comm_state(group_of(optcc).optcc_transport())
    ridemod.Ride.guess = timed("guess", ridemod.Ride.guess)
    ridemod.Ride._round = timed("copy_in", ridemod.Ride._round, less_took=True)
    collectives.watch_ridden = timed("watch", collectives.watch_ridden)
    x = torch.ones(int(sys.argv[1]) if len(sys.argv) > 1 else 262144)
    for _ in range(30):
        dist.all_reduce(x, group=optcc)
    for values in PARTS.values():
        values.clear()
    whole, rounds = [], []
    for _ in range(300):
        hits = st.ride.hits
        t0 = time.perf_counter()
        dist.all_reduce(x, group=optcc)
        spent = time.perf_counter() - t0
        if st.ride.hits > hits:
            whole.append(spent)
            rounds.append(st.ride.took)
    gloo = []
    for _ in range(100):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        gloo.append(time.perf_counter() - t0)
    if rank == 0:
        ms = lambda v: statistics.median(v) * 1e3  # noqa: E731
        print(
            f"rode {len(whole)} of 300: call {ms(whole):.2f} ms, round {ms(rounds):.2f}, "
            f"rest {ms([a - b for a, b in zip(whole, rounds)]):.2f} (copy in "
            f"{ms(PARTS['copy_in']):.2f}, rest of the guess {ms(PARTS['guess']) - ms(rounds) - ms(PARTS['copy_in']):.2f}, "
            f"watch {ms(PARTS['watch']):.2f}); gloo {ms(gloo):.2f} ms",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
