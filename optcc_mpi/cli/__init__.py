"""Command-line interface: ``optcc-mpi <command> ...``.

The CLI is a thin face over the Python API. Each command lives in its own module of this
package and exposes ``register(subparsers)``, which adds an ``argparse`` sub-parser whose
``func`` attribute runs the command and returns an exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Command modules, in the order ``--help`` lists them. Each is imported only when the
# parser is built, so a command's heavy imports (MPI, h5py, matplotlib) stay local to it.
COMMAND_MODULES = (
    "info",
    "model",
    "simulate",
    "demo",
    "bench",
    "testbed",
    "data",
    "train",
    "bench_glm",
    "report",
    "sweep",
    "doctor",
)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every available command registered."""
    parser = argparse.ArgumentParser(
        prog="optcc-mpi",
        description=(
            "Fault-tolerant AllReduce (OptCC) over MPI, its model and lower bound, and "
            "mixed-precision communication-avoiding SGD. Run `optcc-mpi COMMAND --help` for "
            "each command."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            # A command whose module is not written yet is simply absent; a missing
            # dependency *inside* a written module is a real error.
            if exc.name == f"{__name__}.{name}":
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``optcc-mpi`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from optcc_mpi.cli._common import run_command

    # Errors print one line; under MPI an uncaught exception on one rank aborts the job.
    return run_command(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
