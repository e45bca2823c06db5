"""Links that change under a running job: time per call across a degradation and back.

Runs ``allreduce(x, links="watch")`` call after call through three phases (healthy, one
rank degraded, healthy again) and records, per call, the time, the algorithm ``auto``
chose and the profile the watch had adopted. The degradation is real where the job runs
in the namespace testbed (rank 0 reshapes the links with
:func:`optcc_mpi.lab.testbed.set_shaping` between phases) and emulated otherwise (the
emulation's ``degrade`` switches at the same calls). A fault-free ring is timed in the
same run as the reference::

    optcc-mpi testbed up --ranks 8 --rate 400mbit
    optcc-mpi testbed run -- .venv/bin/python -m optcc_mpi lab transition --size 16M --out t.jsonl
    optcc-mpi testbed down
    optcc-mpi lab transition --plot t.jsonl transition.png

    mpiexec -n 4 optcc-mpi lab transition --emulate bw=200MB/s --size 4M ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import optcc_mpi
from optcc_mpi import config
from optcc_mpi.argtypes import StoreTyped, alias, emulation_arg, links_arg, positive_size_arg
from optcc_mpi.collectives import comm_state, last_stats
from optcc_mpi.emulation import Emulation
from optcc_mpi.lab import testbed as tb
from optcc_mpi.lab.report import algorithm_style
from optcc_mpi.lab.tools import tool_main
from optcc_mpi.links import Links

__all__ = ["run", "plot", "add_arguments", "run_args", "main", "SUMMARY"]

#: What ``optcc-mpi lab --help`` says of this tool.
SUMMARY = 'time per call of links="watch" across a degradation and back (or --plot rows)'


def _calls_arg(text: str) -> list[int]:
    """argparse type: three positive counts, ``healthy,degraded,recovered``."""
    try:
        calls = [int(c) for c in text.split(",")]
    except ValueError:
        calls = []
    if len(calls) != 3 or min(calls) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give three positive counts, healthy,degraded,recovered"
        )
    return calls


def run(
    comm: Any,
    *,
    size: int,
    degrade: str,
    calls: Sequence[int] = (8, 12, 12),
    emulate: Any = None,
    testbed: bool = False,
) -> list[dict[str, Any]]:
    """Time ``allreduce(links="watch")`` per call over healthy / degraded / healthy phases
    (collective); every rank returns the same rows."""

    rank, p = comm.Get_rank(), comm.Get_size()
    emu = Emulation.coerce(emulate)
    count = size // 4
    x = np.full(count, float(rank + 1), dtype=np.float32)
    out = np.empty_like(x)
    expected = p * (p + 1) / 2
    rows: list[dict[str, Any]] = []
    phases = (("healthy", Links()), ("degraded", Links.parse(degrade)), ("recovered", Links()))

    def timed(**kw: Any) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        optcc_mpi.allreduce(x, out, comm=comm, **kw)
        return comm.allreduce(time.perf_counter() - t0, op=_max())

    call = 0
    for (phase, truth), n_calls in zip(phases, calls):
        if testbed:
            if rank == 0:
                tb.set_shaping(dict(truth.fractions) or None)
            comm.Barrier()
        phase_emu = dataclasses.replace(emu, degrade=truth) if emu is not None else None
        # The fault-free reference of this phase's network: the ring, told the truth.
        ref = statistics.median(
            timed(algorithm="ring", links=truth, emulate=phase_emu) for _ in range(3)
        )
        for _ in range(n_calls):
            call += 1
            t = timed(links="watch", emulate=phase_emu)
            if not np.all(out == expected):
                raise RuntimeError(f"rank {rank}: wrong sum at call {call}")
            st = last_stats()
            watch = comm_state(comm).watch
            measured = watch.measured if watch is not None else None
            rows.append(
                {
                    "call": call,
                    "phase": phase,
                    "truth": str(truth),
                    "algorithm": st.get("algorithm"),
                    "adopted": str(st.get("links")),
                    "measured": "-" if measured is None else str(measured),
                    "time_s": t,
                    "ring_same_network_s": ref,
                    "p": p,
                    "size": size,
                }
            )
    if testbed and rank == 0:
        tb.set_shaping(None)
    return rows


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def plot(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Time per call against the call number, the phases shaded, markers by algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(8, 4))
    calls = [r["call"] for r in rows]
    for phase, shade in (("degraded", "#fde0dd"),):
        xs = [r["call"] for r in rows if r["phase"] == phase]
        if xs:
            ax.axvspan(min(xs) - 0.5, max(xs) + 0.5, color=shade, label=f"{phase} (truth)")
    ax.plot(calls, [1e3 * r["time_s"] for r in rows], color="0.6", lw=1, zorder=1)
    for alg in sorted({r["algorithm"] for r in rows}):
        color, marker = algorithm_style(alg)
        pts = [(r["call"], 1e3 * r["time_s"]) for r in rows if r["algorithm"] == alg]
        ax.scatter(*zip(*pts), color=color, marker=marker, zorder=3, label=f"auto ran {alg}")
    ref = [1e3 * r["ring_same_network_s"] for r in rows]
    ax.step(calls, ref, where="mid", color="black", ls="--", lw=1, label="ring, same network")
    healthy = [1e3 * r["ring_same_network_s"] for r in rows if r["phase"] == "healthy"]
    if healthy:
        ax.axhline(1.2 * healthy[0], color="tab:green", ls=":", label="1.2 x fault-free ring")
    p, size = rows[0]["p"], rows[0]["size"]
    ax.set(
        xlabel="call",
        ylabel="time per AllReduce (ms)",
        title=f'links="watch", p={p}, {size / 2**20:g} MiB',
    )
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``optcc-mpi lab transition`` (``python -m optcc_mpi.lab.transition``)."""
    parser.description = __doc__.replace("``", "`")
    parser.add_argument(
        "--size", type=positive_size_arg, default="16M", help="bytes per rank (default 16M)"
    )
    links = parser.add_argument(
        "--links",
        type=links_arg,
        default="3:0.5",
        action=StoreTyped,
        metavar="RANK:FRACTION[,...]",
        help="the degraded phase's link profile (default 3:0.5); --degrade is the old name",
    )
    alias(parser, links, "--degrade")
    parser.add_argument(
        "--calls",
        type=_calls_arg,
        default="8,12,12",
        metavar="H,D,R",
        help="calls per phase: healthy,degraded,recovered (default 8,12,12)",
    )
    parser.add_argument(
        "--emulate",
        type=emulation_arg,
        default=None,
        metavar="bw=RATE[,latency=TIME]",
        help="emulate the network, e.g. bw=200MB/s (default: the real links)",
    )
    parser.add_argument("--out", default=None, help="write the rows as JSON lines (rank 0)")
    parser.add_argument(
        "--plot", nargs=2, metavar=("ROWS", "PNG"), help="plot written rows (no MPI needed)"
    )


def run_args(args: argparse.Namespace) -> int:
    """Plot (``--plot``), or run the three phases on ``MPI.COMM_WORLD``; rank 0 prints."""
    if args.plot:
        rows = [json.loads(line) for line in Path(args.plot[0]).read_text().splitlines()]
        print(f"wrote {plot(rows, args.plot[1])}")
        return 0
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rows = run(
        comm,
        size=args.size,
        degrade=str(args.links),
        calls=args.calls,
        emulate=args.emulate,
        testbed=config.is_set("OPTCC_TESTBED_NAME"),
    )
    if comm.Get_rank() == 0:
        for r in rows:
            print(
                f"{r['call']:3d} {r['phase']:9s} truth={r['truth']:8s} ran={r['algorithm']:6s} "
                f"adopted={r['adopted']:8s} measured={r.get('measured', '-'):8s} "
                f"{1e3 * r['time_s']:8.1f} ms "
                f"({r['time_s'] / r['ring_same_network_s']:.2f} x ring)"
            )
        if args.out:
            Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m optcc_mpi.lab.transition``: the same as ``optcc-mpi lab transition``."""
    return tool_main("optcc_mpi.lab.transition", add_arguments, run_args, argv)


if __name__ == "__main__":
    sys.exit(main())
