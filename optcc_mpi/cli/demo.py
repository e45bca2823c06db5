"""``optcc-mpi demo``: the main job on an embedded default (what ``make demo`` runs)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def mpiexec() -> str:
    """The launcher next to this Python (the MPICH wheel's), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec found; install the mpich wheel (make install)")
    return found


def run(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    # Ranks beyond the cores poll each other's progress engines; throttling makes
    # oversubscribed MPICH runs an order of magnitude faster.
    if args.ranks > (os.cpu_count() or 1):
        env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
    cmd = [
        mpiexec(),
        "-n",
        str(args.ranks),
        sys.executable,
        "-m",
        "optcc_mpi.demo",
        "--size",
        str(args.size),
        "--links",
        args.links,
    ]
    print("$ " + " ".join(cmd), flush=True)
    status = subprocess.call(cmd, env=env)
    print()
    from optcc_mpi.cli import main

    print(f"$ optcc-mpi model --p {args.ranks} --degrade {args.links} --size 256M --bw 25GB/s")
    main(
        [
            "model",
            "--p",
            str(args.ranks),
            "--degrade",
            args.links,
            "--size",
            "256M",
            "--bw",
            "25GB/s",
        ]
    )
    return status


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run every algorithm on 8 ranks, check the results, print the model table",
        description="The main job: launch 8 MPI ranks, run every AllReduce algorithm with "
        "rank 0 declared at half bandwidth, check every result exactly on every rank, then "
        "print the modelled times against the fault-free optimum and the lower bound.",
        epilog="examples:\n  optcc-mpi demo\n  optcc-mpi demo --ranks 4 --links 1:0.25",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ranks", type=int, default=8, help="MPI ranks (default 8)")
    p.add_argument("--size", default="16M", help="bytes per rank (default 16M)")
    p.add_argument("--links", default="0:0.5", help="degraded ranks (default 0:0.5)")
    p.set_defaults(func=run)
