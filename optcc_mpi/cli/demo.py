"""``optcc-mpi demo``: the main job on an embedded default (what ``make demo`` runs).

The work is :func:`optcc_mpi.lab.demo.run` (benchmark and plot); this command checks the
arguments, then prints the model table for the run just made (its ranks, largest size,
link profile and rate) with the ``optcc-mpi model`` command that gives it.
"""

from __future__ import annotations

import argparse
from typing import Any

from optcc_mpi.argtypes import int_at_least, links_arg, positive_size_arg, ranks_arg
from optcc_mpi.cli import model as model_command
from optcc_mpi.cli._common import run_command
from optcc_mpi.lab import demo, testbed


def _as_typed(check: Any, what: str) -> Any:
    """argparse type: ``check`` the text, keep it as typed (it is passed on to commands)."""

    def conv(text: str) -> str:
        check(text)
        return text.strip()

    conv.__name__ = what
    return conv


def _bitrate(text: str) -> int:
    try:
        return testbed.parse_bitrate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    if positive_size_arg(args.end) < positive_size_arg(args.begin):
        raise ValueError(f"--end {args.end} is smaller than --begin {args.begin}")
    try:
        links_arg(args.links).check(args.ranks)
    except ValueError as exc:
        raise ValueError(f"--links {args.links}: {exc} (set by --ranks {args.ranks})") from None
    cfg = demo.DemoConfig(
        ranks=args.ranks,
        rate=args.rate,
        links=args.links,
        begin=args.begin,
        end=args.end,
        iters=args.iters,
        network=args.network,
        out=args.out,
    )
    status, rows = demo.run(cfg)
    # The model of the run just made: its ranks, its largest message, its degraded links
    # and the rate its links ran at (the benchmark's model column uses the same).
    end = positive_size_arg(args.end)
    size = max((r["size"] for r in rows), default=end)
    model = ["model", "--ranks", str(args.ranks), "--links", args.links]
    model += ["--size", args.end if size == end else str(size), "--bw", args.rate]
    print(f"\nthe model of this run at its largest size ({demo.size_label(size)} per rank):")
    print("$ " + demo.shell_line([*demo.cli_argv(), *model]), flush=True)
    # That command, run here: its own parser, its own error handling.
    parser = argparse.ArgumentParser(prog="optcc-mpi")
    model_command.register(parser.add_subparsers(dest="command"))
    run_command(parser.parse_args(model))
    return status


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="the main job: benchmark every algorithm over a degraded link, with a plot",
        description="Run the benchmark on 8 ranks with rank 0 at half bandwidth: on the "
        "network-namespace testbed with real kernel shaping when run as root, otherwise "
        "with software emulation (it says which). Every command it runs is printed so "
        "that it can be pasted into a shell. Prints the table against the fault-free "
        "ring and the bound, writes a PNG of measured and modelled time against message "
        "size, removes the testbed, and prints the model table for the run (its ranks, "
        "largest size, links and rate).",
        epilog="examples:\n  optcc-mpi demo\n  optcc-mpi demo --network emulation\n"
        "  optcc-mpi demo --ranks 4 --links 1:0.25 --end 32M",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ranks", type=ranks_arg, default=8, help="MPI ranks, at least 2 (8)")
    p.add_argument(
        "--rate",
        type=_as_typed(_bitrate, "link rate"),
        default="400mbit",
        help="healthy link rate, with a unit: 400mbit, 1gbit, 50MB/s (400mbit)",
    )
    p.add_argument(
        "--links",
        type=_as_typed(links_arg, "link profile"),
        default="0:0.5",
        metavar="RANK:FRACTION[,...]",
        help="degraded ranks and the fraction of the rate each keeps (0:0.5)",
    )
    p.add_argument(
        "--begin",
        type=_as_typed(positive_size_arg, "size"),
        default="4M",
        help="smallest message per rank (4M)",
    )
    p.add_argument(
        "--end",
        type=_as_typed(positive_size_arg, "size"),
        default="16M",
        help="largest message per rank (16M)",
    )
    p.add_argument(
        "--iters",
        type=int_at_least(1, "timed iterations"),
        default=3,
        help="timed iterations per point (3)",
    )
    p.add_argument(
        "--network",
        choices=("auto", "testbed", "emulation"),
        default="auto",
        help="auto: the testbed when root and namespaces work, else emulation; testbed: "
        "refuse to fall back",
    )
    p.add_argument("--out", default="demo-results", help="folder for rows and the plot")
    p.set_defaults(func=run)
