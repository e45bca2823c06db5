"""What every lab tool shares: its ``python -m optcc_mpi.lab.TOOL`` entry point and its
JSON-lines records.

A tool module defines its command line (``add_arguments``) and what running it does
(``run_args``); ``optcc-mpi lab TOOL`` (:mod:`optcc_mpi.cli.lab`) and
``python -m optcc_mpi.lab.TOOL`` (:func:`tool_main`) both start it from those two, so the
two faces parse, record and report errors alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from optcc_mpi.errors import ArgumentError

__all__ = ["tool_main", "append_rows"]


def tool_main(
    module: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run_args: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None = None,
) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) with the tool's own arguments and run it.

    ``args.command_line`` records what was run (the rows a tool writes carry it), and an
    :class:`~optcc_mpi.errors.ArgumentError` from the run is reported as a usage error
    (exit status 2), as ``optcc-mpi lab TOOL`` reports it.

    Parameters
    ----------
    module : str
        The tool's module name, e.g. ``"optcc_mpi.lab.percall"`` (the program name shown).
    add_arguments, run_args : callable
        The tool module's own functions.
    argv : sequence of str, optional
        The arguments, without the program name.
    """
    parser = argparse.ArgumentParser(
        prog=f"python -m {module}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.command_line = shlex.join([*parser.prog.split(), *argv])
    try:
        return run_args(args)
    except ArgumentError as exc:
        parser.error(str(exc))  # exits with status 2


def append_rows(path: str | os.PathLike[str], rows: Iterable[Mapping[str, Any]]) -> None:
    """Append ``rows`` to ``path`` as JSON lines (one object per line; earlier runs' rows
    stay, so that repeated runs accumulate in one record)."""
    with open(path, "a") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
