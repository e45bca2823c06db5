"""Cross-rank agreement: one small collective, then the same outcome on every rank.

A check that fails on one rank only must not leave the other ranks waiting in the next
collective. Every place in the package that validates something locally and then
communicates goes through this module:

* :func:`agree` shares each rank's verdict (an exception, a message or None) and an
  optional small payload in one ``allgather``, and raises on every rank if any rank
  failed. The rank that failed re-raises its own exception unchanged (its type and
  message are what the user's ``except`` clause and scikit-learn's checks look for); the
  others raise one error naming the failed ranks and their words.
* :func:`run_everywhere` runs a step on every rank and then agrees on its outcome.
* :func:`agree_fields` is the fixed-shape form for hot paths: one ``Allreduce`` (MAX)
  of a vector of integers and their negations gives every rank the minimum and maximum
  of each field, so a mismatch is seen everywhere at the cost of one tiny message.

:func:`optcc_mpi.allreduce` folds its own per-call check into a fixed-shape ``Allgather``
that can also carry short messages' data (``optcc_mpi.collectives``); when that check
fails, the error is reported through :func:`agree` as well.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, cast, overload

import numpy as np
import numpy.typing as npt

from optcc_mpi import transports
from optcc_mpi.errors import ArgumentError, ArgumentTypeError, mark_everywhere

__all__ = ["agree", "agree_fields", "describe_ranks", "run_everywhere", "Members"]

T = TypeVar("T")
P = TypeVar("P")


class Members(Protocol):
    """The ranks that must agree, as :func:`agree` sees them: mpi4py's communicators and
    :class:`~optcc_mpi.transports.Transport` both have these."""

    @property
    def size(self) -> int: ...

    def allgather(self, obj: object, /) -> list[object]: ...


def describe_ranks(ranks: list[int], size: int | None = None) -> str:
    """``[2]`` -> ``"rank 2"``, ``[0, 1, 2, 5]`` -> ``"ranks 0-2,5"``; ``"all ranks"``
    when the list is every one of ``size`` (> 1) ranks."""
    if size is not None and size > 1 and len(ranks) == size:
        return "all ranks"
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


def _verdict(error: BaseException | str | None) -> tuple[bool, str] | None:
    """What travels for one rank: (was it a TypeError, its words), or None."""
    if error is None:
        return None
    if isinstance(error, BaseException):
        return isinstance(error, TypeError), f"{type(error).__name__}: {error}"
    return False, str(error)


@overload
def agree(
    comm: Members,
    error: BaseException | str | None,
    *,
    what: str = "",
    cls: type[Exception] = ArgumentError,
) -> list[None]: ...


@overload
def agree(
    comm: Members,
    error: BaseException | str | None,
    payload: P,
    *,
    what: str = "",
    cls: type[Exception] = ArgumentError,
) -> list[P]: ...


def agree(
    comm: Members,
    error: BaseException | str | None,
    payload: object = None,
    *,
    what: str = "",
    cls: type[Exception] = ArgumentError,
) -> Sequence[object]:
    """Share every rank's verdict and payload; raise on every rank if any rank failed.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm or optcc_mpi.transports.Transport
        The ranks that must agree (all of them call this): anything with mpi4py's
        ``allgather(obj)`` and ``size``.
    error : BaseException, str or None
        This rank's failure: an exception (re-raised unchanged on this rank), a message
        (raised as ``cls`` on every rank, this one included), or None.
    payload : object, optional
        Anything small to share in the same collective (shapes, checksums).
    what : str, optional
        Prefix of the error the other ranks raise (what was being done).
    cls : type, optional
        Class of that error; :class:`~optcc_mpi.errors.ArgumentTypeError` instead when
        the failed rank's exception was a ``TypeError``.

    Returns
    -------
    list
        Every rank's payload, in rank order.

    Raises
    ------
    Exception
        On every rank when any rank failed: identical messages from several ranks are
        listed once with their ranks.
    """
    # Every rank sends the same pair: (its verdict, its payload).
    verdicts = cast(
        "list[tuple[tuple[bool, str] | None, object]]",
        comm.allgather((_verdict(error), payload)),
    )
    failed: dict[str, list[int]] = {}
    typed = False
    for rank, (verdict, _) in enumerate(verdicts):
        if verdict is not None:
            failed.setdefault(verdict[1], []).append(rank)
            typed = typed or verdict[0]
    if not failed:
        return [p for _, p in verdicts]
    if comm.size == 1:
        words = next(iter(failed))
    else:
        words = "; ".join(f"{m} ({describe_ranks(rs, comm.size)})" for m, rs in failed.items())
    words = f"{what}: {words}" if what else words
    # Every rank raises, by design: marked so that a command prints it once. Raised
    # "from None": an agreement is often reached while handling the signal that a check
    # failed (protocol.Mismatch), which is no part of the user's error. A bad argument
    # (ValueError, TypeError) is shown from this call alone: the frames of the check that
    # found it say nothing its message does not; anything else keeps them.
    if isinstance(error, BaseException):
        if isinstance(error, (ValueError, TypeError)):
            error = error.with_traceback(None)
        # Where this rank's is the only failure, its own words tell the whole story.
        raise mark_everywhere(error, str(error) if len(failed) == 1 else words) from None
    kind = ArgumentTypeError if typed and error is None else cls
    raise mark_everywhere(kind(words), words) from None


def run_everywhere(
    comm: Members, step: Callable[[], T], *, what: str = "", cls: type[Exception] = ArgumentError
) -> T:
    """Run ``step()`` on every rank; if it raised on any rank, raise on every rank.

    The rank whose step failed re-raises its own exception; the others raise ``cls``
    naming it (see :func:`agree`). On one process there is no communication at all.
    """
    if comm.size == 1:
        return step()
    result, error = None, None
    try:
        result = step()
    except Exception as exc:  # any failure must reach the other ranks before a collective
        error = exc
    agree(comm, error, what=what, cls=cls)
    return result  # type: ignore[return-value]


def agree_fields(
    transport: transports.Communicator, fields: npt.ArrayLike
) -> tuple[np.ndarray, np.ndarray]:
    """Minimum and maximum over the ranks of each integer field, in one collective.

    The vector ``(fields, -fields)`` is reduced with MAX
    (:meth:`optcc_mpi.transports.Transport.allreduce_max`), so a single tiny collective
    of fixed shape tells every rank whether all ranks hold the same values (``lo == hi``)
    and which field differs. Every rank must pass the same number of fields.
    """
    f = np.asarray(fields, dtype=np.int64)
    vec = np.concatenate([f, -f])
    transports.of(transport).allreduce_max(vec)
    return -vec[f.size :], vec[: f.size]
