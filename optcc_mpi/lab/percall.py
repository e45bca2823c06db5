"""Per-call cost of ``allreduce`` against the MPI library's ``MPI_Allreduce``.

Run under mpiexec, e.g. ``mpiexec -n 2 optcc-mpi lab percall``. For each
message size it times, interleaved in batches so that every variant sees the same
machine load:

``MPI_Allreduce``
    mpi4py's ``comm.Allreduce(x, y, op=MPI.SUM)`` (the library's latency from Python);
``allreduce``
    ``optcc_mpi.allreduce(x, y)`` with default arguments (argument agreement included);
``allreduce check=False``
    the same without the agreement;
``allreduce limit=SIZE``
    (with ``--gather-limit SIZE``, repeatable) the default call on a communicator whose
    gather limit is fixed to SIZE (``$OPTCC_GATHER_LIMIT``) instead of measured: what
    gathering (a large limit) or the check plus the library's AllReduce (``0``) costs at
    each size, in the same run;
``ring`` and ``Sendrecv ring``
    (with ``--p2p``) ``algorithm="ring"``, and a hand-written blocking ``Sendrecv`` ring
    with the same messages: their difference is the schedule's fixed cost per call.

Each batch is ``--batch`` consecutive calls; the table gives the median, minimum and
maximum over batches of the time per call, and the ratio of medians to MPI_Allreduce. The
header names the gather limit the default calls' communicator measured
(:func:`optcc_mpi.collectives.gather_limit`); every row carries it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import optcc_mpi
from optcc_mpi import collectives, config
from optcc_mpi.argtypes import int_at_least, size_arg, sizes_arg
from optcc_mpi.lab.tools import append_rows, tool_main
from optcc_mpi.units import format_size

__all__ = ["measure", "add_arguments", "run_args", "main", "SUMMARY"]

#: What ``optcc-mpi lab --help`` says of this tool.
SUMMARY = "per-call cost of short allreduce calls against MPI_Allreduce"


def _sendrecv_ring(comm: Any, x: np.ndarray, y: np.ndarray) -> None:
    """A blocking ring AllReduce with the schedule's messages: p-1 reduce-scatter and p-1
    all-gather steps over p sections (NumPy reduction)."""
    p, r = comm.Get_size(), comm.Get_rank()
    np.copyto(y, x)
    if p == 1:
        return
    bounds = np.linspace(0, y.size, p + 1).astype(int)
    tmp = np.empty(bounds[1] - bounds[0] + 1, dtype=y.dtype)
    nxt, prv = (r + 1) % p, (r - 1) % p
    for t in range(p - 1):
        s, q = (r - t) % p, (r - t - 1) % p
        seg = y[bounds[s] : bounds[s + 1]]
        got = tmp[: bounds[q + 1] - bounds[q]]
        comm.Sendrecv(seg, nxt, 11, got, prv, 11)
        y[bounds[q] : bounds[q + 1]] += got
    for t in range(p - 1):
        s, q = (r + 1 - t) % p, (r - t) % p
        comm.Sendrecv(y[bounds[s] : bounds[s + 1]], nxt, 12, y[bounds[q] : bounds[q + 1]], prv, 12)


def measure(
    comm: Any, sizes: list[int], iters: int, batch: int, p2p: bool, limits: list[int] = ()
) -> list[dict[str, Any]]:
    """Time the variants (module docstring) at each size in bytes (float32 elements);
    collective. ``limits``: gather limits to time besides the measured one. Returns one
    row per (size, variant) on every rank."""
    from mpi4py import MPI

    mine = comm.Dup()  # the user's traffic of the baselines: not on our private duplicate
    measured = collectives.gather_limit(mine)
    fixed = {}
    for limit in limits:
        other = fixed[limit] = comm.Dup()
        before, config.rc.gather_limit = config.rc.gather_limit, str(limit)
        try:
            collectives.gather_limit(other)  # decided now, from the setting
        finally:
            config.rc.gather_limit = before
    rows = []
    for size in sizes:
        n = max(1, size // 4)
        x = np.arange(n, dtype=np.float32) + comm.Get_rank()
        y = np.empty_like(x)
        variants: dict[str, Callable[[], Any]] = {
            "MPI_Allreduce": lambda x=x, y=y: mine.Allreduce(x, y, op=MPI.SUM),
            "allreduce": lambda x=x, y=y: optcc_mpi.allreduce(x, y, comm=mine),
            "allreduce check=False": lambda x=x, y=y: optcc_mpi.allreduce(
                x, y, comm=mine, check=False
            ),
        }
        for limit, other in fixed.items():
            variants[f"allreduce limit={format_size(limit)}"] = lambda x=x, y=y, other=other: (
                optcc_mpi.allreduce(x, y, comm=other)
            )
        if p2p:
            variants["ring"] = lambda x=x, y=y: optcc_mpi.allreduce(
                x, y, comm=mine, algorithm="ring"
            )
            variants["ring check=False"] = lambda x=x, y=y: optcc_mpi.allreduce(
                x, y, comm=mine, algorithm="ring", check=False
            )
            variants["Sendrecv ring"] = lambda x=x, y=y: _sendrecv_ring(mine, x, y)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for fn in variants.values():  # warm up: caches, agreement room, schedules
            for _ in range(max(3, batch)):
                fn()
        for _ in range(max(1, iters // batch)):
            for name, fn in variants.items():
                mine.Barrier()
                t0 = time.perf_counter()
                for _ in range(batch):
                    fn()
                times[name].append((time.perf_counter() - t0) / batch)
        ref = statistics.median(times["MPI_Allreduce"])
        for name, ts in times.items():
            # The slowest rank's view: a collective is as slow as its slowest member.
            med = comm.allreduce(statistics.median(ts), op=MPI.MAX)
            if name == "MPI_Allreduce":
                ref = med
            rows.append(
                {
                    "p": comm.Get_size(),
                    "bytes": n * 4,
                    "variant": name,
                    "median_us": med * 1e6,
                    "min_us": comm.allreduce(min(ts), op=MPI.MAX) * 1e6,
                    "max_us": comm.allreduce(max(ts), op=MPI.MAX) * 1e6,
                    "ratio": med / ref if ref > 0 else float("nan"),
                    "batches": len(ts),
                    "batch": batch,
                    "gather_limit": measured,
                }
            )
    mine.Free()
    for other in fixed.values():
        other.Free()
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``optcc-mpi lab percall`` (and ``python -m optcc_mpi.lab.percall``)."""
    parser.description = __doc__.replace("``", "`")
    parser.epilog = (
        "examples:\n"
        "  mpiexec -n 2 optcc-mpi lab percall --iters 2000 --batch 50\n"
        "  mpiexec -n 4 optcc-mpi lab percall --sizes 4,1K,16K,64K --p2p --json pc.jsonl\n"
        "  mpiexec -n 2 optcc-mpi lab percall --sizes 4,16K,64K --gather-limit 0 "
        "--gather-limit 128K"
    )
    parser.add_argument(
        "--sizes",
        type=sizes_arg,
        default="4,64,1K,4K,16K,64K",
        metavar="SIZE[,SIZE...]",
        help="message sizes in bytes, comma-separated (4,64,1K,4K,16K,64K)",
    )
    parser.add_argument(
        "--iters",
        type=int_at_least(1, "calls"),
        default=2000,
        help="calls per variant and size (2000)",
    )
    parser.add_argument(
        "--batch",
        type=int_at_least(1, "calls per batch"),
        default=20,
        help="calls per timed batch (20)",
    )
    parser.add_argument("--p2p", action="store_true", help="also time the ring schedule")
    parser.add_argument(
        "--gather-limit",
        type=size_arg,
        action="append",
        default=[],
        metavar="SIZE",
        help="also time the default call with the gather limit fixed to SIZE (repeatable; "
        "0: the least, so above 256 bytes the check plus MPI_Allreduce; 128K: gather all)",
    )
    parser.add_argument("--json", help="append the rows as JSON lines to this file")


def run_args(args: argparse.Namespace) -> int:
    """Run the tool on ``MPI.COMM_WORLD`` with parsed options; rank 0 prints."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rows = measure(comm, args.sizes, args.iters, args.batch, args.p2p, args.gather_limit)
    if comm.Get_rank() == 0:
        command = args.command_line
        limit = format_size(rows[0]["gather_limit"]) if rows else "?"
        print(
            f"# {command}  (p={comm.Get_size()}, medians of batches of {args.batch}, "
            f"gather limit measured: {limit})"
        )
        print(f"{'bytes':>7}  {'variant':<24} {'median us':>10} {'min':>8} {'max':>8} {'ratio':>6}")
        for r in rows:
            print(
                f"{r['bytes']:>7}  {r['variant']:<24} {r['median_us']:>10.2f} "
                f"{r['min_us']:>8.2f} {r['max_us']:>8.2f} {r['ratio']:>6.2f}"
            )
        if args.json:
            append_rows(args.json, ({**r, "command": command} for r in rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m optcc_mpi.lab.percall``: the same as ``optcc-mpi lab percall``."""
    return tool_main("optcc_mpi.lab.percall", add_arguments, run_args, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
