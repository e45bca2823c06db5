"""Measure the fabric (:class:`optcc_mpi.algorithms._policy.Fabric`, the model of what
joins the ranks) through the executor: per-step latency, per-message cost and the rate it
delivers.

Run under mpiexec, e.g. ``mpiexec -n 2 optcc-mpi lab calibrate``. Three tiny
schedules in the ring's pattern (every rank sends to rank + 1 and receives from rank - 1
at once, so every link carries one flow per direction), each run by
:func:`optcc_mpi.executor.execute`:

* **latency** ``alpha``: ``steps`` exchanges of one small message, each waiting for the
  previous one's receive, as a ring's steps do; ``alpha`` is the time per step;
* **rate** ``bw``: ``nbytes`` as one message, and cut into ``pieces`` messages two in
  flight per connection as our schedules send them; ``bw = nbytes / (t - alpha)`` with
  the faster of the two (over TCP, UCX moves a single rendezvous message at about 80% of
  a shaped link, where two in flight keep it full: measured on the testbed);
* **per-message cost** ``beta = (t_pieces - t_one) / (pieces - 1)``, at least 0: what
  cutting a transfer into messages costs (not ``alpha``: large messages take MPI's
  rendezvous path, small ones go eagerly).

Each is repeated and the median kept (of the slowest rank's time of each repeat); the two
rate runs of a repeat go back to back and ``beta`` comes from the median of their ratios,
so that background load that slows a whole repeat cancels. Whether the fabric overlaps
the reduction is what MPI says of the ranks: all on one node (shared memory) or not.

The result is passed to a schedule as ``params={"fabric": fab}`` (the ring's message size
follows from it) and to its cost model (``algorithms.get("ring").time(..., fabric=fab)``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np

from optcc_mpi.algorithms._policy import Fabric
from optcc_mpi.argtypes import int_at_least, positive_size_arg
from optcc_mpi.arrays import NumpyArrayOps
from optcc_mpi.errors import ArgumentError
from optcc_mpi.executor import execute
from optcc_mpi.lab.tools import append_rows, tool_main
from optcc_mpi.schedule import ScheduleBuilder, split

__all__ = ["measure", "add_arguments", "run_args", "main", "SUMMARY"]

#: What ``optcc-mpi lab --help`` says of this tool.
SUMMARY = "measure the fabric (latency, per-message cost, rate) through the executor"


def _schedules(p: int, nbytes: int, steps: int, small: int, pieces: int) -> tuple[Any, ...]:

    r = np.arange(p)
    nxt = (r + 1) % p
    chain = ScheduleBuilder(p, small, "calibrate-latency")
    prev = np.full(p, -1, dtype=np.int64)
    for _ in range(steps):
        _, rids = chain.transfer(r, nxt, 0, small, send_deps=prev)
        # What rank r received in this step (indexed by receiver) gates its next send.
        prev = np.empty(p, dtype=np.int64)
        prev[nxt] = rids
    big = ScheduleBuilder(p, nbytes, "calibrate-rate")
    big.transfer(r, nxt, 0, nbytes)
    cut = ScheduleBuilder(p, nbytes, "calibrate-pieces", window=2)
    bounds = split(0, nbytes, pieces)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        cut.transfer(r, nxt, lo, hi)
    return chain.build(), big.build(), cut.build()


def measure(
    comm: Any,
    *,
    nbytes: int = 8 << 20,
    steps: int = 50,
    pieces: int = 16,
    repeats: int = 5,
    small: int = 64,
) -> tuple[Fabric, dict[str, Any]]:
    """Measure the fabric that joins ``comm``'s ranks (collective on ``comm``; the same
    result on every rank).

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        At least two ranks, on healthy links.
    nbytes : int
        Bytes of the rate measurement (8 MiB is 168 ms at 400 Mbit/s).
    steps : int
        Dependent exchanges of the latency measurement.
    pieces : int
        Messages the per-message measurement cuts ``nbytes`` into.
    repeats : int
        Repetitions of each; medians are kept.
    small : int
        Bytes of each latency message.

    Returns
    -------
    Fabric, dict
        The model, and how it was measured (sizes, repeats, seconds taken).
    """
    from mpi4py import MPI

    p = comm.Get_size()
    if p < 2:
        raise ArgumentError("calibration needs at least two ranks")
    if nbytes < pieces or steps < 1 or repeats < 1 or small < 1 or pieces < 2:
        raise ArgumentError(
            "calibration: need steps, repeats, small >= 1, pieces >= 2 and nbytes >= pieces"
        )
    t_start = time.perf_counter()
    chain, big, cut = _schedules(p, nbytes, steps, small, pieces)
    be = NumpyArrayOps()
    comm = comm.Dup()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    overlap = local.Get_size() != p  # not all on one node: a NIC moves the data
    local.Free()
    bufs = {size: np.zeros(size, dtype=np.uint8) for size in (small, nbytes)}

    def timed(schedule: Any, size: int) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        execute(schedule, bufs[size], comm=comm, op="sum", arrays=be)
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    try:
        for schedule, size in ((chain, small), (big, nbytes), (cut, nbytes)):
            execute(schedule, bufs[size], comm=comm, op="sum", arrays=be)  # warm-up
        chains, bigs, ratios = [], [], []
        for _ in range(repeats):
            chains.append(timed(chain, small))
            t_big = timed(big, nbytes)
            bigs.append(t_big)
            ratios.append(timed(cut, nbytes) / t_big)
    finally:
        comm.Free()
    alpha = statistics.median(chains) / steps
    t_big = statistics.median(bigs)
    ratio = statistics.median(ratios)
    t_best = min(t_big, ratio * t_big)
    bw = nbytes / max(t_best - alpha, 1e-9)
    beta = max(0.0, (ratio - 1.0) * t_big / (pieces - 1))
    how = {
        "nbytes": nbytes,
        "steps": steps,
        "pieces": pieces,
        "repeats": repeats,
        "seconds": time.perf_counter() - t_start,
    }
    return Fabric("calibrated", alpha, beta, bw, overlap), how


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``optcc-mpi lab calibrate`` (and ``python -m optcc_mpi.lab.calibrate``)."""
    parser.description = (
        "Measure the fabric's latency per step, cost per message and rate through our "
        "executor, and print the message size the ring would use (run under mpiexec with "
        "at least 2 ranks, on healthy links)."
    )
    parser.epilog = (
        "examples:\n"
        "  mpiexec -n 2 optcc-mpi lab calibrate\n"
        "  optcc-mpi testbed run -- .venv/bin/python -m optcc_mpi lab calibrate --json c.jsonl"
    )
    parser.add_argument(
        "--bytes", type=positive_size_arg, default=8 << 20, help="rate message (8M)"
    )
    parser.add_argument(
        "--pieces",
        type=int_at_least(2, "pieces"),
        default=16,
        help="messages the rate message is cut into (16)",
    )
    parser.add_argument(
        "--steps", type=int_at_least(1, "latency steps"), default=50, help="latency exchanges (50)"
    )
    parser.add_argument(
        "--repeats",
        type=int_at_least(1, "repeats"),
        default=5,
        help="repetitions, median kept (5)",
    )
    parser.add_argument(
        "--section",
        type=positive_size_arg,
        default=16 << 20,
        help="section size to size the ring's messages for (16M)",
    )
    parser.add_argument("--json", help="append the result as a JSON line to this file")


def run_args(args: argparse.Namespace) -> int:
    """Run the tool on ``MPI.COMM_WORLD`` with parsed options; rank 0 prints."""
    if args.bytes < args.pieces:
        raise ArgumentError(f"--bytes {args.bytes} cannot be cut into --pieces {args.pieces}")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    fab, how = measure(
        comm, nbytes=args.bytes, steps=args.steps, pieces=args.pieces, repeats=args.repeats
    )
    if comm.Get_rank() == 0:
        m = fab.message_bytes(args.section)
        print(fab)
        print(f"messages for a {args.section} B section: {m} B ({fab.messages(args.section)})")
        print(
            "use: params={'fabric': Fabric("
            f"'calibrated', {fab.latency:.3g}, {fab.message_cost:.3g}, {fab.rate:.4g}, "
            f"{fab.overlap})}}"
        )
        if args.json:
            row = {
                "latency_us": fab.latency * 1e6,
                "message_cost_us": fab.message_cost * 1e6,
                "rate_MBps": fab.rate / 1e6,
                "overlap": fab.overlap,
                "message_bytes": m,
                "section_bytes": args.section,
                "p": comm.Get_size(),
                **how,
            }
            append_rows(args.json, [row])
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m optcc_mpi.lab.calibrate``: the same as ``optcc-mpi lab calibrate``."""
    return tool_main("optcc_mpi.lab.calibrate", add_arguments, run_args, argv)


if __name__ == "__main__":
    sys.exit(main())
