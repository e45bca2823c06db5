"""Every exception optcc_mpi raises on purpose derives from :class:`OptccError`.

Each subclass also derives from the built-in exception a caller would have caught before
(``ValueError`` for bad values, ``TypeError`` for bad types, ``RuntimeError`` for failures
at run time, ...), so ``except ValueError`` clauses written against earlier versions keep
working while ``except optcc_mpi.OptccError`` catches everything of ours.
"""

from __future__ import annotations

__all__ = [
    "OptccError",
    "ArgumentError",
    "ArgumentTypeError",
    "DatasetError",
    "FileMissingError",
    "DivergenceError",
    "VerificationError",
    "PlanError",
    "TestbedError",
    "ExecutionError",
    "WaitTimeoutError",
    "MPIUnavailableError",
    "TooLargeError",
    "mark_everywhere",
    "everywhere",
    "as_ours",
]


class OptccError(Exception):
    """Base of every error optcc_mpi raises on purpose."""


class ArgumentError(OptccError, ValueError):
    """An argument has a bad value (raised on every rank for collective calls)."""


class ArgumentTypeError(OptccError, TypeError):
    """An argument has a type we cannot use."""


class DatasetError(OptccError, ValueError):
    """A dataset file is missing, malformed, corrupt or does not match what was asked."""


class FileMissingError(OptccError, FileNotFoundError):
    """A file we were asked to read (a dataset, a file to convert) is not there."""


class DivergenceError(OptccError, RuntimeError):
    """Training diverged (non-finite loss, or a loss far above its best value)."""


class VerificationError(OptccError, AssertionError):
    """A schedule breaks an invariant the verifier checks."""


class PlanError(OptccError, RuntimeError):
    """No plan could be computed for the requested link profile."""


class TestbedError(OptccError, RuntimeError):
    """The network-namespace testbed could not be set up, used or removed."""

    __test__ = False  # not a pytest test class, despite its name


class ExecutionError(OptccError, RuntimeError):
    """A call could not run to its end: a schedule that deadlocks or stalls, a call not
    complete in time, a step below us that failed, or what it needs missing here."""


class WaitTimeoutError(OptccError, TimeoutError):
    """A wait ran past its time limit (a rank that never made its part of the call)."""


class MPIUnavailableError(OptccError, ImportError):
    """A command that needs MPI ran where no MPI library can be loaded."""


class TooLargeError(OptccError, MemoryError):
    """A request would need more memory than allowed (raised before allocating it)."""


def as_ours(exc: BaseException) -> BaseException:
    """``exc`` as one of ours when it is a ``ValueError`` or ``TypeError`` raised by a
    library under us (the same message, the original as its cause): what an argument
    check reports is an :class:`ArgumentError` or :class:`ArgumentTypeError`, whoever
    found it. Anything else is returned unchanged."""
    if isinstance(exc, OptccError) or not isinstance(exc, (ValueError, TypeError)):
        return exc
    new = (ArgumentTypeError if isinstance(exc, TypeError) else ArgumentError)(str(exc))
    new.__cause__ = exc
    return new


#: The attribute :func:`mark_everywhere` sets on an exception.
_EVERYWHERE = "_optcc_everywhere"


def mark_everywhere(exc: BaseException, words: str) -> BaseException:
    """Mark ``exc`` as raised on every rank of its job by design, ``words`` being what
    the job should say about it once (what every rank that failed said), and return it.

    A command-line face prints such an error on one rank only and exits with the same
    status everywhere (``optcc_mpi.cli``), where an error of one rank alone must instead
    stop the whole job. :mod:`optcc_mpi.check.agreement` marks what it raises.
    """
    setattr(exc, _EVERYWHERE, words)
    return exc


def everywhere(exc: BaseException) -> str | None:
    """The words :func:`mark_everywhere` gave ``exc``, or None if it was not raised on
    every rank by design."""
    words = getattr(exc, _EVERYWHERE, None)
    return words if isinstance(words, str) else None
