"""``optcc-mpi lab TOOL``: the lab's measuring tools, one sub-command each.

Each tool module of :mod:`optcc_mpi.lab` defines its whole command line
(``add_arguments``, with the types of :mod:`optcc_mpi.argtypes`) and what running it does
(``run_args``); this module only gathers them under one command, so that they are found,
documented and started like every other ``optcc-mpi`` command. ``python -m
optcc_mpi.lab.TOOL`` runs the same parser (it never imports the CLI).
"""

from __future__ import annotations

import argparse
from typing import Any

from optcc_mpi.cli._common import print_help
from optcc_mpi.lab import backend, calibrate, ddp, hsdp, percall, profiles, ring, transition

#: The tools, in the order ``optcc-mpi lab --help`` lists them.
TOOLS = {
    "percall": percall,
    "ring": ring,
    "calibrate": calibrate,
    "transition": transition,
    "profiles": profiles,
    "ddp": ddp,
    "backend": backend,
    "hsdp": hsdp,
}

EPILOG = """\
Each tool's --help says what it measures and how to run it. The ones that time MPI calls
run under a launcher like `optcc-mpi bench` does; `ddp`, `backend` and `hsdp` run under torchrun
too (over torch.distributed's gloo, and the optcc backend); `profiles` and
`transition --plot` need no MPI at all.

examples:
  mpiexec -n 2 optcc-mpi lab percall --iters 2000 --batch 50
  mpiexec -n 2 optcc-mpi lab ring -b 1M -e 256M -f 4 -n 5
  mpiexec -n 2 optcc-mpi lab calibrate
  optcc-mpi testbed run -- .venv/bin/python -m optcc_mpi lab transition --out t.jsonl
  optcc-mpi lab profiles --family server --max-ranks 32 --no-verify
  torchrun --standalone --nproc-per-node 4 -m optcc_mpi lab ddp --links 0:0.5 --steps 5
  torchrun --standalone --nproc-per-node 2 -m optcc_mpi lab backend -b 64M -e 64M

`python -m optcc_mpi.lab.TOOL ...` is the same as `optcc-mpi lab TOOL ...`.
"""


def register(subparsers: Any) -> None:
    """Add the ``lab`` command and one sub-command per tool to ``subparsers``."""
    parser = subparsers.add_parser(
        "lab",
        help="measuring tools: per-call cost, rings, calibration, transitions, profiles, DDP",
        description="The lab's measuring tools, behind the benchmark numbers in docs/.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=lambda args: print_help(parser))
    sub = parser.add_subparsers(dest="lab_tool", metavar="TOOL")
    for name, tool in TOOLS.items():
        p = sub.add_parser(
            name, help=tool.SUMMARY, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        tool.add_arguments(p)
        p.set_defaults(func=tool.run_args)
