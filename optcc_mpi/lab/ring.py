"""Ring benchmark: our executor's ring against a hand-written ring and MPI_Allreduce.

Run under MPI (shared memory or any network)::

    mpiexec -n 2 optcc-mpi lab ring -b 1M -e 256M -f 4 -n 5

For every size it times, interleaved iteration by iteration so that all see the same
machine load:

``executor``
    ``optcc_mpi.allreduce(x, out, algorithm="ring")``, out of place: argument check, cached
    schedule, our executor, everything a user pays.
``executor in place``
    ``optcc_mpi.allreduce(IN_PLACE, out, algorithm="ring")`` (``out`` refilled with the
    input before each timed call, outside the timing).
``executor copy+in place``
    ``np.copyto(out, x)`` then the in-place call: what an out-of-place call cost before
    the executor learnt to read the send buffer itself (the "before" of the same run).
``sendrecv``
    A hand-written blocking ring in NumPy: reduce-scatter then all-gather, one
    ``MPI_Sendrecv`` per step, the same reduction (``np.add`` into place) and the same
    sections, after copying ``x`` into ``out``. What a careful user would write by hand.
``sendrecv in place``
    The same ring on ``out`` holding the input (no copy): the target for the executor.
``mpi``
    The MPI library's own ``MPI_Allreduce``, out of place.

Every result is checked against the exact sum. Output: a text table on rank 0 and, with
``--out``, one JSON object per (method, size) with median, minimum and maximum over the
iterations (each iteration's time is the maximum over ranks), the machine's load average
and the command.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from typing import Any

import numpy as np

import optcc_mpi
from optcc_mpi.argtypes import float_above, int_at_least, positive_size_arg, size_arg
from optcc_mpi.errors import ArgumentError
from optcc_mpi.lab.bench import sizes as size_list
from optcc_mpi.lab.provenance import load_average
from optcc_mpi.lab.tools import append_rows, tool_main
from optcc_mpi.schedule import split

__all__ = ["sendrecv_ring", "run", "add_arguments", "run_args", "main", "SUMMARY"]

#: What ``optcc-mpi lab --help`` says of this tool.
SUMMARY = "executor ring vs hand-written Sendrecv ring vs MPI_Allreduce, large messages"

METHODS = (
    "executor",
    "executor in place",
    "executor copy+in place",
    "sendrecv",
    "sendrecv in place",
    "mpi",
)
#: Methods whose buffer holds the input when called (refilled before each timed call).
IN_PLACE_METHODS = ("executor in place", "sendrecv in place")


def sendrecv_ring(comm: Any, x: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """Ring AllReduce (sum) of ``x`` into ``out`` with blocking ``Sendrecv``.

    ``tmp`` holds at least one section (``ceil(n / p)`` elements). Rank r sends section
    (r - t) mod p in reduce-scatter step t and adds what arrives from its left neighbour;
    it then owns section (r + 1) mod p, and the all-gather forwards sections around the
    ring. ``x`` may be ``out`` (in place: no copy).
    """

    p, r = comm.Get_size(), comm.Get_rank()
    if x is not out:
        np.copyto(out, x)
    if p == 1:
        return out
    b = split(0, x.size, p).tolist()
    right, left = (r + 1) % p, (r - 1) % p
    for t in range(p - 1):
        s, g = (r - t) % p, (r - t - 1) % p
        m = b[g + 1] - b[g]
        comm.Sendrecv(out[b[s] : b[s + 1]], right, 7, tmp[:m], left, 7)
        np.add(out[b[g] : b[g + 1]], tmp[:m], out=out[b[g] : b[g + 1]])
    for t in range(p - 1):
        s, g = (r + 1 - t) % p, (r - t) % p
        comm.Sendrecv(out[b[s] : b[s + 1]], right, 8, out[b[g] : b[g + 1]], left, 8)
    return out


def run(
    sizes: list[int],
    iters: int,
    warmup: int,
    comm: Any = None,
    command: str = "",
    chunks: list[int] = (),
) -> list[dict[str, Any]]:
    """Time the three methods at every size (collective); rows on every rank.

    ``chunks``: further executor variants with the ring's ``chunk_bytes`` set to each
    value (method ``executor/chunk=N``; 0 means one message per section).
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    p, rank = comm.Get_size(), comm.Get_rank()
    rows = []
    for size in sizes:
        n = size // 4
        i = np.arange(n, dtype=np.int64)
        x = ((i * 7 + rank * 13) % 17 - 8).astype(np.float32)
        exact = sum(((i * 7 + q * 13) % 17 - 8) for q in range(p)).astype(np.float32)
        del i
        out = np.empty_like(x)
        tmp = np.empty(-(-n // p) + 1, dtype=np.float32)
        ring = functools.partial(optcc_mpi.allreduce, x, out, comm=comm, algorithm="ring")
        ring_ip = functools.partial(
            optcc_mpi.allreduce, optcc_mpi.IN_PLACE, out, comm=comm, algorithm="ring"
        )

        def copy_then_ring(
            ring_ip: Any = ring_ip, x: np.ndarray = x, out: np.ndarray = out
        ) -> None:
            np.copyto(out, x)
            ring_ip()

        calls = {
            "executor": ring,
            "executor in place": ring_ip,
            "executor copy+in place": copy_then_ring,
            "sendrecv": functools.partial(sendrecv_ring, comm, x, out, tmp),
            "sendrecv in place": functools.partial(sendrecv_ring, comm, out, out, tmp),
            "mpi": functools.partial(comm.Allreduce, x, out, op=MPI.SUM),
        }
        for c in chunks:
            cb = c if c > 0 else size
            calls[f"executor/chunk={c}"] = functools.partial(ring, params={"chunk_bytes": cb})
        methods = list(calls)
        times: dict[str, list[float]] = {m: [] for m in methods}
        wrong = dict.fromkeys(methods, 0)
        load0 = load_average()
        for it in range(warmup + iters):
            for m in methods:
                if m in IN_PLACE_METHODS:
                    np.copyto(out, x)
                else:
                    out.fill(np.nan)
                comm.Barrier()
                t0 = time.perf_counter()
                calls[m]()
                dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                wrong[m] += int(np.count_nonzero(out != exact))
                if it >= warmup:
                    times[m].append(dt)
        for m in methods:
            t = times[m]
            rows.append(
                {
                    "method": m,
                    "size": size,
                    "p": p,
                    "median_ms": statistics.median(t) * 1e3,
                    "min_ms": min(t) * 1e3,
                    "max_ms": max(t) * 1e3,
                    "iters": iters,
                    "wrong": comm.allreduce(wrong[m], op=MPI.SUM),
                    "load": [load0, load_average()],
                    "command": command,
                }
            )
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``optcc-mpi lab ring`` (and ``python -m optcc_mpi.lab.ring``)."""
    parser.description = (
        "Executor ring vs hand-written Sendrecv ring vs MPI_Allreduce, interleaved per "
        "iteration, every result checked (run under mpiexec). Exit status 1 if any result "
        "is wrong."
    )
    parser.epilog = (
        "examples:\n"
        "  mpiexec -n 2 optcc-mpi lab ring -b 1M -e 256M -f 4 -n 5\n"
        "  mpiexec -n 2 optcc-mpi lab ring -b 64M -e 64M --chunk 1M --chunk 0 --out t.jsonl"
    )
    parser.add_argument(
        "-b", "--begin", type=positive_size_arg, default=1 << 20, help="smallest size (1M)"
    )
    parser.add_argument(
        "-e", "--end", type=positive_size_arg, default=256 << 20, help="largest size (256M)"
    )
    parser.add_argument(
        "-f",
        "--factor",
        type=float_above(1.0, "the size step factor"),
        default=4.0,
        help="size step factor, above 1 (4)",
    )
    parser.add_argument(
        "-n",
        "--iters",
        type=int_at_least(1, "timed iterations"),
        default=5,
        help="timed iterations (5)",
    )
    parser.add_argument(
        "-w",
        "--warmup",
        type=int_at_least(0, "warm-up iterations"),
        default=1,
        help="warm-up iterations (1)",
    )
    parser.add_argument(
        "--chunk",
        type=size_arg,
        action="append",
        default=[],
        help="also time the executor with the ring's chunk_bytes set to this (repeatable; "
        "0: one message per section)",
    )
    parser.add_argument("--out", help="append rows as JSON lines to this file")


def run_args(args: argparse.Namespace) -> int:
    """Run the tool on ``MPI.COMM_WORLD`` with parsed options; rank 0 prints."""
    if args.end < args.begin:
        raise ArgumentError(f"-e/--end {args.end} is smaller than -b/--begin {args.begin}")
    from mpi4py import MPI

    command = args.command_line
    comm = MPI.COMM_WORLD
    sizes = size_list(args.begin, args.end, args.factor)
    rows = run(sizes, args.iters, args.warmup, comm, command, args.chunk)
    if comm.Get_rank() == 0:
        print(f"# {command}  (p={comm.Get_size()}, load {rows[0]['load'][0]:.1f})")
        print(
            f"{'size':>10} {'method':>24} {'median ms':>10} {'min':>9} {'max':>9} "
            f"{'vs sr':>6} {'vs sr in place':>14}"
        )
        by = {(r["size"], r["method"]): r for r in rows}
        for r in rows:
            ref = by[(r["size"], "sendrecv")]["median_ms"]
            ref_ip = by[(r["size"], "sendrecv in place")]["median_ms"]
            print(
                f"{r['size']:>10} {r['method']:>24} {r['median_ms']:>10.2f} {r['min_ms']:>9.2f} "
                f"{r['max_ms']:>9.2f} {r['median_ms'] / ref:>6.2f} {r['median_ms'] / ref_ip:>14.2f}"
                + ("" if r["wrong"] == 0 else f"  WRONG {r['wrong']}")
            )
        if args.out:
            append_rows(args.out, rows)
    return 1 if any(r["wrong"] for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m optcc_mpi.lab.ring``: the same as ``optcc-mpi lab ring``."""
    return tool_main("optcc_mpi.lab.ring", add_arguments, run_args, argv)


if __name__ == "__main__":
    sys.exit(main())
