"""Argument types and printing shared by the CLI commands."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from typing import Any

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
    "parse_key_value",
    "key_value_arg",
    "key_values",
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


def _typed(text: str) -> Any:
    # true/false, then int, then float, else the text itself: what a schedule parameter or
    # a table cell means when typed on a command line.
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            continue
    return text


def parse_key_value(text: str, *, typed: bool = True, what: str = "KEY=VALUE") -> tuple[str, Any]:
    """``"k=64"`` -> ``("k", 64)``: the one KEY=VALUE parser of the command line.

    Parameters
    ----------
    text : str
        ``KEY=VALUE``; the key is stripped and must not be empty; the value is everything
        after the first ``=`` (it may contain ``=`` itself).
    typed : bool
        Convert the value: ``true``/``false`` (any case) to bool, then int, then float,
        else keep the text (stripped). ``False`` keeps it verbatim (environment values).
    what : str
        How the error names the expected form (``COLUMN=V1,V2``).

    Raises
    ------
    ArgumentError
        No ``=``, or an empty key.
    """
    from optcc_mpi.errors import ArgumentError

    key, sep, value = str(text).partition("=")
    if not sep or not key.strip():
        raise ArgumentError(f"expected {what}, got {text!r}")
    return key.strip(), (_typed(value.strip()) if typed else value)


def key_value_arg(text: str) -> tuple[str, Any]:
    """:func:`parse_key_value` as an argparse type (typed values)."""
    try:
        return parse_key_value(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


key_value_arg.__name__ = "KEY=VALUE"


def key_values(items: Iterable[str], *, typed: bool = True, what: str = "KEY=VALUE") -> dict:
    """Several ``KEY=VALUE`` items as a dict (a later key wins); see :func:`parse_key_value`."""
    return dict(parse_key_value(item, typed=typed, what=what) for item in items)


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
