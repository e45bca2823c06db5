"""Command-line interface: ``optcc-mpi <command> ...``.

The CLI is a thin face over the Python API. Each command lives in its own module of this
package and exposes ``register(subparsers)``, which adds an ``argparse`` sub-parser whose
``func`` attribute runs the command and returns an exit status.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from types import ModuleType
from typing import Any, NoReturn

from optcc_mpi.cli import (
    bench,
    bench_glm,
    data,
    demo,
    doctor,
    info,
    lab,
    model,
    report,
    simulate,
    sweep,
    testbed,
    train,
)
from optcc_mpi.cli._common import hold_for_rank0, job_rank, run_command

# Command modules, in the order ``--help`` lists them. A command's heavy imports (MPI,
# h5py, matplotlib) stay inside its functions, so importing them all costs little.
COMMANDS: tuple[ModuleType, ...] = (
    info,
    model,
    simulate,
    demo,
    bench,
    testbed,
    data,
    train,
    bench_glm,
    report,
    sweep,
    doctor,
    lab,
)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every available command registered."""
    parser = _Parser(
        prog="optcc-mpi",
        description=(
            "Fault-tolerant AllReduce (OptCC) over MPI, its model and lower bound, and "
            "mixed-precision communication-avoiding SGD. Run `optcc-mpi COMMAND --help` for "
            "each command."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


class _Parser(argparse.ArgumentParser):
    """A parser that names itself in the parsed arguments (``usage_parser``), so that
    :func:`main` reports a wrong flag with the usage of the command it was given to, not
    the top level's. Sub-commands' parsers are of this class too (``add_subparsers`` makes
    its parsers of its own parser's class), and the deepest one parsed sets it last."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.set_defaults(usage_parser=self)

    def error(self, message: str) -> NoReturn:
        """Usage and ``message`` on standard error, status 2; under a launcher every rank
        parsed the same command line, so rank 0 alone says what is wrong with it (the
        others hold back their exit until it has: :func:`~optcc_mpi.cli._common.hold_for_rank0`)."""
        if job_rank() != 0:
            hold_for_rank0(f"{self.prog}: error: {message}")
            self.exit(2)
        super().error(message)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``optcc-mpi`` console script."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse leaves flags no parser knows to the top level, whose usage says nothing
        # about the command's options: let the command's own parser report them.
        getattr(args, "usage_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    # What was run, as a record for the rows a command writes (`optcc-mpi lab percall`).
    args.command_line = shlex.join(["optcc-mpi", *argv])

    # Errors print one line; under MPI an uncaught exception on one rank aborts the job.
    return run_command(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
