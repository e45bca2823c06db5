"""The handle torch gets of a call: :class:`OptccWork`, and :func:`submit`, which queues a
job on a group's ordered thread and hands back its work.

An ``optcc`` group's own AllReduces (:mod:`optcc_mpi.torch.process_group`), any collective
of the library underneath that waits its turn behind them, and the calls of the face over
a process group (:mod:`optcc_mpi.torch`: the DDP hook's buckets, ``allreduce``) hand back
an :class:`OptccWork`: torch's ``Work`` of the call, complete once its tensors are reduced.

How a work completes
--------------------
A job of CPU tensors is queued on the group's :class:`~optcc_mpi.torch.worker.OrderedWorker`;
``wait()`` runs it in the caller's thread when its turn has come
(:meth:`~optcc_mpi.torch.worker.OrderedWorker.steal`), else waits for the group's thread to
run it. A job of CUDA tensors follows NCCL's stream semantics
(:mod:`optcc_mpi.torch.streams`): ``wait()`` makes the caller's current streams wait for
the job's completion events, and the host waits only for the job to be queued.

``get_future()`` hands torch a future as code in C++ sees one: the call's error raised as
an error, not its value (DDP's reducer chains on it).
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from optcc_mpi.communicators import CallRecord
from optcc_mpi.errors import ExecutionError
from optcc_mpi.torch.streams import StreamCall
from optcc_mpi.torch.worker import InFlight, OrderedWorker, _Job

__all__ = ["OptccWork", "submit"]

#: The calls' name in their errors (the backend's calls and the hook's queued ones).
_WHAT = "all_reduce on the optcc backend"
_T = TypeVar("_T")


class OptccWork(dist.Work):
    """The handle of one call on an ``optcc`` group: complete once the tensors are
    reduced (before that, they must not be touched).

    Parameters
    ----------
    future : torch.futures.Future
        Completed with the list of tensors, or with the call's error.
    timeout : datetime.timedelta
        How long :meth:`wait` waits at most (the group's timeout).
    """

    def __init__(
        self,
        future: torch.futures.Future[list[torch.Tensor]],
        timeout: datetime.timedelta,
        steal: Callable[[], None] | None = None,
        release: Callable[[], None] | None = None,
        streams: StreamCall | None = None,
    ) -> None:
        super().__init__()
        self._future = future
        self._timeout = timeout
        self._streams = streams  # a CUDA call's events (NCCL's wait semantics)
        self._steal = steal  # runs the call here, if its turn came and no thread took it
        self._release = release  # hands a parked call to the group's thread
        self._done = threading.Event()
        self._seen: torch.futures.Future[list[torch.Tensor]] | None = None  # (get_future)
        #: What this call did (a :class:`~optcc_mpi.communicators.CallRecord`: the
        #: algorithm, its schedule, the executor's stats), once complete; empty for the
        #: collectives that pass through to the library.
        self.stats: Mapping[str, object] = {}
        future.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the call is complete; raise its error if it failed.

        Raises
        ------
        ArgumentError, ArgumentTypeError
            The arguments were refused (the same error on every rank).
        AbortedError
            The group was aborted first.
        RuntimeError
            The call did not complete within ``timeout`` (default: the group's), or a
            peer failed.
        """
        if self._streams is not None:
            # NCCL's: the caller's current streams wait for the job's completion events;
            # the host waits only for the job to be queued (with a timeout: for the device).
            return self._streams.wait(timeout)
        limit = timeout if timeout and timeout.total_seconds() > 0 else self._timeout
        if self._steal is not None and not self._done.is_set():
            self._steal()
        if not self._done.wait(limit.total_seconds()):
            raise ExecutionError(
                f"{_WHAT}: not complete after {limit} (a rank that never made the call, "
                "or a stalled peer)"
            )
        self._future.wait()  # raises the call's error
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """The future that completes with the reduced tensors, or fails with the call's
        error (DDP chains on it, in C++)."""
        if self._release is not None:
            self._release()
        if self._seen is None:
            self._seen = _failing(self._future)
        return self._seen

    def is_completed(self) -> bool:
        """Whether the call has finished (successfully or not)."""
        if self._release is not None:
            self._release()
        if self._streams is not None:
            return self._streams.is_completed()
        return self._future.done()

    def is_success(self) -> bool:
        """Whether the call has finished without an error."""
        return self._future.done() and self.exception() is None

    def exception(self) -> BaseException | None:
        """The call's error, once finished (None while running or on success)."""
        if self._streams is not None:
            return self._streams.exception()
        if not self._future.done():
            return None
        try:
            self._future.value()
        except BaseException as exc:  # noqa: BLE001 - reported, not handled
            return exc
        return None

    def result(self) -> list[torch.Tensor]:
        """The reduced tensors (waits first)."""
        self.wait()
        return self._future.value()


def _failing(future: torch.futures.Future[_T]) -> torch.futures.Future[_T]:
    """``future`` as code in C++ sees it: its value, or its error as an error.

    A Python future's ``set_exception`` completes it with the exception object as its
    value (Python's ``wait`` raises it); DDP's reducer, in C++, reads that value as its
    bucket and dereferences the first tensor of none (SIGSEGV). A future chained with
    ``then`` gets the error C++'s way: its ``wait``/``value`` raise it there too."""
    return future.then(_value_or_raise)


def _value_or_raise(future: torch.futures.Future[_T]) -> _T:
    value = future.value()  # (a wrapper without the parent's unwrapping: no raise)
    if isinstance(value, BaseException):
        raise value
    return value


def submit(
    worker: OrderedWorker,
    tensors: list[Any],
    job: Callable[[], object],
    timeout: datetime.timedelta,
    park: bool = False,
    overlap: bool = False,
) -> OptccWork:
    """Queue ``job()``, which reduces ``tensors`` in place, on ``worker``; its
    :class:`OptccWork`. A job that returns a :class:`~optcc_mpi.communicators.CallRecord`
    gives the work its :attr:`~OptccWork.stats`. A caller that waits for a job of CPU
    tensors runs it itself when its turn has come (:meth:`OrderedWorker.steal`).

    CUDA tensors follow NCCL's stream semantics (:mod:`optcc_mpi.torch.streams`): the call
    records an event on the caller's current stream of every device of the tensors, the
    job runs on the group's side stream of each device after it, the future is completed
    there, and ``wait()`` makes the caller's current streams wait for the job's completion
    without blocking the host beyond the job's queueing."""
    cuda = any(t.is_cuda for t in tensors)
    devices = sorted({t.device for t in tensors if t.is_cuda}, key=str) if cuda else []
    # A CUDA-aware future (its events follow the side streams) where CUDA is there; the
    # stream API may be a recording fake on a build without it.
    aware = list[int | str | torch.device](devices) if torch.cuda.is_available() else []
    future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future(devices=aware or None)
    stolen: list[_Job] = []
    if cuda:
        call = worker.side_streams(timeout).start(tensors)
        work = OptccWork(future, timeout, streams=call)
    else:
        work = OptccWork(
            future,
            timeout,
            lambda: worker.steal(stolen[0]),
            (lambda: worker.release(stolen[0])) if park else None,
        )

    def done(record: object) -> list[Any]:
        if isinstance(record, CallRecord):
            work.stats = record
        return tensors

    def run() -> list[Any] | InFlight | None:
        if cuda:
            # (the future is completed with the side streams current; the worker leaves it)
            call.run(lambda: done(job()), future)
            return None
        record = job()
        if isinstance(record, InFlight):
            finish = record.finish
            return InFlight(lambda: done(finish()))
        return done(record)

    stolen.append(worker.submit(run, future, park and not cuda, overlap and not cuda))
    return work
