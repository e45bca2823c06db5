"""Argument types and printing shared by the CLI commands."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from optcc_mpi.links import Links
from optcc_mpi.units import parse_duration, parse_rate, parse_size

__all__ = [
    "size_arg",
    "rate_arg",
    "duration_arg",
    "links_arg",
    "algorithms_arg",
    "print_table",
    "add_network_args",
]


def _wrap(fn, what: str):  # noqa: ANN001, ANN202 - argparse type adaptor
    def conv(text: str):  # noqa: ANN202
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    conv.__name__ = what
    return conv


size_arg = _wrap(parse_size, "size")
rate_arg = _wrap(parse_rate, "bandwidth")
duration_arg = _wrap(parse_duration, "duration")
links_arg = _wrap(Links.parse, "link profile")


def print_table(header: Sequence[str], rows: Sequence[Sequence[object]], *, right: int = 1) -> None:
    """Print an aligned text table; columns from index ``right`` on are right-aligned."""
    cells = [[str(h) for h in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i >= right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ).rstrip()

    print(fmt(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(fmt(row))


def add_network_args(p: argparse.ArgumentParser) -> None:
    """``--p``, ``--degrade``/``--links``, ``--size`` and ``--bw``: the network a modelled or
    simulated AllReduce runs on."""
    p.add_argument("--p", type=int, default=8, help="ranks (default 8)")
    p.add_argument(
        "--degrade",
        "--links",
        type=links_arg,
        default=Links.parse("0:0.5"),
        metavar="RANK:FRACTION[,...]",
        help="degraded ranks and their bandwidth fractions (default 0:0.5)",
    )
    p.add_argument(
        "--size",
        type=size_arg,
        default=256 * 2**20,
        help="bytes per rank, e.g. 256M (default 256M)",
    )
    p.add_argument(
        "--bw",
        type=rate_arg,
        default=25e9,
        help="healthy NIC bandwidth per direction, e.g. 25GB/s, 400mbit (default 25GB/s)",
    )
    p.add_argument(
        "--latency",
        type=duration_arg,
        default=0.0,
        help="per-message latency, e.g. 5us (default 0: bandwidth only)",
    )


def algorithms_arg(text: str) -> list[str]:
    """A comma-separated list of registered algorithm names (argparse type)."""
    from optcc_mpi import algorithms
    from optcc_mpi.errors import ArgumentError

    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected at least one algorithm name")
    for name in names:
        try:
            algorithms.get(name)
        except ArgumentError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names
