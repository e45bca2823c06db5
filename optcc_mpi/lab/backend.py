"""``dist.all_reduce`` through the ``optcc`` backend against the same call on gloo.

Run under ``torchrun`` (or ``optcc-mpi testbed run``, or ``mpiexec``: the default group is
started from whichever launched it, :mod:`optcc_mpi.lab.world`)::

    torchrun --standalone --nproc-per-node 2 -m optcc_mpi lab backend -b 64M -e 64M

Two process groups over the same ranks: the default gloo group, and a group of the
``optcc`` backend (:mod:`optcc_mpi.torch.process_group`; ``--algorithm`` and ``--links`` are
its options, else ``$OPTCC_ALGORITHM`` and ``$OPTCC_LINKS``), and with ``--no-check`` one
with ``OptccOptions(check=False)``, and with ``--no-board`` one whose check and AllReduce
go through gloo even where the ranks share a machine (``OPTCC_BOARD=0``,
:mod:`optcc_mpi.transports.board`). At each size (float32 SUM, in place, the same buffers
for all) the groups are timed in turn, the order rotated call by call, ``--iters`` calls
each, from a barrier on the control group to the end of the call on the slowest rank; the
first ``--warmup`` calls of each are left out. With ``--queued N``, what is timed is N
``all_reduce(async_op=True)`` calls, then a wait for each; else one call,
``all_reduce(async_op=True)`` then its wait, or with ``--sync`` torch's synchronous
``all_reduce`` (which the backend runs in the caller's thread when nothing is queued).
The table gives the median, minimum and maximum per call and the ratio of the optcc
median to gloo's, with what the backend ran. With ``--out``, one JSON object per (size,
group), with the command.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from optcc_mpi import algorithms, collectives, config, transports
from optcc_mpi.argtypes import int_at_least, links_learnt_arg, positive_size_arg
from optcc_mpi.lab import world
from optcc_mpi.lab.tools import append_rows, tool_main
from optcc_mpi.units import format_size

__all__ = ["measure", "add_arguments", "run_args", "main", "SUMMARY"]

#: What ``optcc-mpi lab --help`` says of this tool.
SUMMARY = "dist.all_reduce through the optcc backend against gloo's, interleaved"


def measure(args: argparse.Namespace, group: Any) -> list[dict[str, Any]]:
    """Time the groups at each size (collective); the rows, on every rank."""
    import torch
    import torch.distributed as dist

    import optcc_mpi.torch as ot

    torch.set_num_threads(1)
    wire = transports.of(group)
    groups = {
        "gloo": group,
        "optcc": dist.new_group(
            backend="optcc",
            pg_options=ot.OptccOptions(algorithm=args.algorithm, links=args.links),
        ),
    }
    if args.no_check:
        groups["optcc nocheck"] = dist.new_group(
            backend="optcc",
            pg_options=ot.OptccOptions(algorithm=args.algorithm, links=args.links, check=False),
        )
    if args.no_board:
        # The group's transport decides at its making whether it takes the board.
        board, config.rc.board = config.rc.board, False
        try:
            groups["optcc noboard"] = dist.new_group(
                backend="optcc",
                pg_options=ot.OptccOptions(algorithm=args.algorithm, links=args.links),
            )
        finally:
            config.rc.board = board
    names = list(groups)
    rows: list[dict[str, Any]] = []
    for nbytes in args.sizes:
        n = max(1, nbytes // 4)
        bufs = [torch.ones(n) for _ in range(args.queued or 1)]
        times: dict[str, list[float]] = {name: [] for name in names}
        ran: dict[str, set[str]] = {name: set() for name in names}
        for i in range(args.warmup + args.iters):
            # Each group in turn, the order rotated call by call: none is always first.
            for name in names[i % len(names) :] + names[: i % len(names)]:
                pg = groups[name]
                wire.barrier()
                t0 = time.perf_counter()
                if args.queued:
                    works = [dist.all_reduce(b, group=pg, async_op=True) for b in bufs]
                    for w in works:
                        w.wait()
                elif args.sync:
                    dist.all_reduce(bufs[0], group=pg)
                    works = []
                else:
                    works = [dist.all_reduce(bufs[0], group=pg, async_op=True)]
                    works[0].wait()
                dt = max(wire.allgather(time.perf_counter() - t0))
                # (a synchronous call returns no work: what it ran is the library's record)
                stats = getattr(works[-1], "stats", None) if works else None
                if args.sync and name != "gloo":
                    stats = collectives.last_stats()
                if stats:
                    # (in the check: every rank's data gathered with it, reduced in
                    # rank order on every rank)
                    inline = " in the check" if stats.get("inline") else ""
                    ran[name].add(f"{stats.get('algorithm')}{inline}")
                if i >= args.warmup:
                    times[name].append(dt)
        ref = statistics.median(times["gloo"])
        for name, t in times.items():
            med = statistics.median(t)
            rows.append(
                {
                    "group": name,
                    "bytes": n * 4,
                    "p": wire.size,
                    "queued": args.queued,
                    "sync": bool(args.sync and not args.queued),
                    "median_ms": med * 1e3,
                    "min_ms": min(t) * 1e3,
                    "max_ms": max(t) * 1e3,
                    "calls": len(t),
                    "ratio_to_gloo": med / ref,
                    "ran": sorted(ran[name]) if name != "gloo" else ["gloo all_reduce"],
                    "algorithm": args.algorithm or "$OPTCC_ALGORITHM/auto",
                    "links": args.links,
                    "command": args.command_line,
                }
            )
    for name in names[1:]:
        dist.destroy_process_group(groups[name])
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``optcc-mpi lab backend``."""
    parser.description = (
        "dist.all_reduce through a group of the optcc torch.distributed backend against "
        "the same call on the default gloo group, interleaved call by call (run under "
        "torchrun, mpiexec or the testbed)."
    )
    parser.epilog = (
        "examples:\n"
        "  torchrun --standalone --nproc-per-node 2 -m optcc_mpi lab backend -b 64M -e 64M\n"
        "  optcc-mpi testbed run -- python -m optcc_mpi lab backend -b 16M -e 64M --out b.jsonl"
    )
    parser.add_argument(
        "-b",
        dest="lo",
        type=positive_size_arg,
        default="1M",
        help="smallest message (1M; sizes double up to -e)",
    )
    parser.add_argument(
        "-e", dest="hi", type=positive_size_arg, default="64M", help="largest message (64M)"
    )
    parser.add_argument(
        "--iters", type=int_at_least(1, "calls"), default=7, help="timed calls of each (7)"
    )
    parser.add_argument(
        "--warmup", type=int_at_least(0, "warm-up calls"), default=2, help="untimed (2)"
    )
    parser.add_argument(
        "--algorithm",
        default=None,
        choices=("auto", *algorithms.names()),
        help="the optcc group's algorithm (default $OPTCC_ALGORITHM, else auto)",
    )
    parser.add_argument(
        "--links",
        type=links_learnt_arg,
        default=None,
        metavar="RANK:FRACTION[,...]|probe|watch",
        help="the optcc group's link profile (default $OPTCC_LINKS)",
    )
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="also time an optcc group with OptccOptions(check=False)",
    )
    parser.add_argument(
        "--no-board",
        action="store_true",
        help="also time an optcc group whose check and AllReduce go through gloo even "
        "where every rank is on one machine (as OPTCC_BOARD=0 makes them), not through "
        "shared memory",
    )
    parser.add_argument(
        "--queued",
        type=int_at_least(1, "calls"),
        default=0,
        metavar="N",
        help="time N all_reduce(async_op=True) calls queued, then all waited for (one "
        "buffer each), instead of one call",
    )
    parser.add_argument(
        "--sync",
        action="store_true",
        help="time the one call as torch's synchronous all_reduce (no async_op), not "
        "all_reduce(async_op=True) and its wait",
    )
    parser.add_argument("--out", help="append rows as JSON lines to this file")


def run_args(args: argparse.Namespace) -> int:
    """Run the tool on every rank; rank 0 prints (and writes ``--out``)."""
    args.sizes = [args.lo]
    while args.sizes[-1] * 2 <= args.hi:
        args.sizes.append(args.sizes[-1] * 2)
    group, started = world.torch_group()
    rows = measure(args, group)
    if transports.of(group).rank == 0:
        what = (
            f"{args.queued} calls queued, then waited"
            if args.queued
            else "one synchronous call"
            if args.sync
            else "one call"
        )
        print(f"# {args.command_line}\n# {rows[0]['p']} ranks, float32 SUM, in place, {what}")
        print(
            f"{'size':>8} {'group':<13} {'median ms':>10} {'min':>9} {'max':>9} {'x gloo':>7}  ran"
        )
        for r in rows:
            print(
                f"{format_size(r['bytes']):>8} {r['group']:<13} {r['median_ms']:>10.3f} "
                f"{r['min_ms']:>9.2f} {r['max_ms']:>9.2f} {r['ratio_to_gloo']:>7.3f}  "
                f"{', '.join(r['ran'])}"
            )
        if args.out:
            append_rows(args.out, rows)
            print(f"# appended {len(rows)} rows to {args.out}")
        sys.stdout.flush()
    world.end(started)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m optcc_mpi.lab.backend``: the same as ``optcc-mpi lab backend``."""
    return tool_main("optcc_mpi.lab.backend", add_arguments, run_args, argv)


if __name__ == "__main__":
    sys.exit(main())
