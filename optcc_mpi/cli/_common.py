"""Argument types and printing shared by the CLI commands."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from optcc_mpi.links import Links, parse_duration, parse_rate, parse_size

__all__ = ["size_arg", "rate_arg", "duration_arg", "links_arg", "print_table"]


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
