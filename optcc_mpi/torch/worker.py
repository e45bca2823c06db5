"""A group's calls in call order: :class:`OrderedWorker`, one thread per ``optcc`` group
(and per transport of the DDP hook, :func:`worker_for`), or the thread of a caller that
waits for its own call when every call before it is done.

A group's calls are collectives: every rank must run them in the same order. The worker
keeps that order and lets the caller go on (the backward pass, the next bucket) while
its reductions are on the wire; :func:`optcc_mpi.torch.work.submit` hands it the jobs
(of the backend, :mod:`optcc_mpi.torch.process_group`, and of the DDP hook), and
:class:`InFlight` lets a job leave its library's work in flight while the next one
starts (pipelined as gloo's own queue is).
"""

from __future__ import annotations

import atexit
import collections
import datetime
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from optcc_mpi.errors import ArgumentError, OptccError
from optcc_mpi.torch.streams import SideStreams, StreamApi
from optcc_mpi.transports.distributed import TorchTransport

__all__ = ["AbortedError", "InFlight", "OrderedWorker", "worker_for"]

_T = TypeVar("_T")


class AbortedError(OptccError, RuntimeError):
    """The process group was aborted while this work was queued or running."""


class InFlight:
    """What a job returns when its library's work is still in flight: the worker's thread
    goes on to the next job (a reduction's check and posting) and completes this one,
    in order, with ``finish()`` (which waits for the library first)."""

    __slots__ = ("finish",)

    def __init__(self, finish: Callable[[], Any]) -> None:
        self.finish = finish


class _Job:
    """One job of an :class:`OrderedWorker`: run once, by whichever thread claims it."""

    __slots__ = ("fn", "future", "seq", "claim", "done", "overlap")

    def __init__(
        self, fn: Callable[[], Any], future: torch.futures.Future[Any], seq: int, overlap: bool
    ) -> None:
        self.fn, self.future, self.seq, self.overlap = fn, future, seq, overlap
        self.claim = threading.Lock()  # acquired once, by the thread that runs it
        self.done = threading.Event()


class OrderedWorker:
    """Runs a group's jobs in call order, on one thread of its own, or in the thread of
    a caller that waits for its job when every job before it is done (:meth:`steal`).

    A group's calls are collectives: every rank must run them in the same order, and
    each completes only when every rank runs it. One thread per group keeps the order of
    the calls and lets the caller go on (the backward pass, the next bucket); a caller
    that waits at once (``dist.all_reduce`` without ``async_op``) runs its own job and
    need not wait for that thread to wake, nor that thread for the library's.

    Parameters
    ----------
    name : str
        The thread's name (seen in debuggers and ``py-spy``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Signalled whenever a job completes: the worker's thread waits on it for a job run
        # in a caller's thread (stolen, or run at once) to finish before the next starts.
        self._turn = threading.Condition(self._lock)
        self._submitted = 0  # jobs submitted so far (the next job's place)
        self._completed = 0  # jobs completed so far: they complete in order
        self._closed = False
        self._aborted: AbortedError | None = None
        self._running: _Job | None = None
        self._stopping: threading.Thread | None = None
        self._parked: _Job | None = None
        #: The device runtime of the side streams (a recording fake in tests).
        self.stream_api: StreamApi | None = None
        self._side_streams: SideStreams | None = None
        # Jobs whose library's work is in flight, oldest first (the worker's thread alone
        # appends and completes them), and a job taken from the queue that waits for them.
        self._inflight: collections.deque[tuple[_Job, InFlight]] = collections.deque()
        self._head: _Job | None | object = _EMPTY
        _WORKERS.add(self)

    def side_streams(self, timeout: datetime.timedelta) -> SideStreams:
        """The group's side streams (one per device, made at its first CUDA call), on
        :attr:`stream_api` (default: CUDA's)."""
        if self._side_streams is None:
            self._side_streams = SideStreams(self.stream_api, timeout)
        return self._side_streams

    def now(self, job: Callable[[], _T]) -> tuple[bool, _T | None]:
        """``(True, job())`` run in this thread if no job is pending (its errors are
        raised here), else ``(False, None)`` and nothing ran: :meth:`submit` it."""
        with self._lock:
            if self._completed != self._submitted or self._closed:
                return False, None
            return True, job()

    def run_here(self, job: Callable[..., _T], *args: Any) -> tuple[bool, _T | None]:
        """``(True, job(*args))`` run in this thread, in the group's order, if no job is
        pending (jobs submitted meanwhile start after it); else ``(False, None)`` and
        nothing ran: :meth:`submit` it. Unlike :meth:`now`, the lock is not held while
        ``job`` runs (it may wait for peers: an abort must not wait for it)."""
        with self._lock:
            if self._completed != self._submitted or self._closed or self._parked is not None:
                return False, None
            self._submitted += 1
        try:
            return True, job(*args)
        finally:
            with self._lock:
                self._completed += 1
                self._turn.notify_all()

    def submit(
        self,
        job: Callable[[], Any],
        future: torch.futures.Future[Any],
        park: bool = False,
        overlap: bool = False,
    ) -> _Job:
        """Run ``job()`` after every job submitted before it; complete ``future`` with its
        result or its error. ``park``: its caller waits for it at once (and so runs it,
        :meth:`steal`): it is not handed to the worker's thread, which would only wake to
        find it taken, unless something else needs the thread to run it (:meth:`release`).
        ``overlap``: the job may start while jobs before it still have their library's
        work in flight (:class:`InFlight`: reductions, which touch only their own
        tensors); any other job starts after every job before it completed."""
        with self._lock:
            if self._aborted is not None:
                raise self._aborted
            if self._closed:
                raise ArgumentError(f"{self.name}: the process group was destroyed")
            if self._thread is None:
                # A daemon, so that a rank whose peer hangs can still exit; close() (and
                # the interpreter's exit) stops it properly first.
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            item = _Job(job, future, self._submitted, overlap)
            self._submitted += 1
            self._release_locked()
            if park:
                self._parked = item
            else:
                self._jobs.put(item)
        return item

    def release(self, job: _Job | None = None) -> None:
        """Hand the parked job (if it is ``job``, or any with None) to the worker's thread."""
        with self._lock:
            if self._parked is not None and (job is None or self._parked is job):
                self._release_locked()

    def _release_locked(self) -> None:
        if self._parked is not None:
            self._jobs.put(self._parked)
            self._parked = None

    def steal(self, job: _Job) -> None:
        """Run ``job`` in this thread if every job before it is done and no thread
        claimed it yet; else leave it to the worker's thread."""
        with self._lock:
            parked = self._parked is job
            if parked:
                self._parked = None
        if self._completed == job.seq and job.claim.acquire(blocking=False):
            self._execute(job)
        elif parked:
            with self._lock:
                self._jobs.put(job)  # (jobs before it still run: its turn comes after)

    def _execute(self, job: _Job, worker: bool = False) -> None:
        """Run ``job``; on the worker's thread a job whose library's work is still in
        flight is completed later (:meth:`_complete_oldest`), elsewhere here."""
        self._running = job
        try:
            if self._aborted is not None:
                raise self._aborted
            result = job.fn()
            if isinstance(result, InFlight):
                if worker:
                    self._inflight.append((job, result))
                    return
                result = result.finish()
        except BaseException as exc:  # noqa: BLE001 - the caller's wait() raises it
            self._complete(job, None, exc)
        else:
            self._complete(job, result, None)

    def _complete(self, job: _Job, result: Any, failed: BaseException | None) -> None:
        with self._lock:
            self._completed += 1
            self._running = None
            self._turn.notify_all()
            if job.done.is_set() or job.future.done():  # by abort(), or by the job itself
                job.done.set()
                return
            if failed is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(self._aborted or failed)
            job.done.set()

    def _complete_oldest(self) -> None:
        job, pending = self._inflight.popleft()
        try:
            if self._aborted is not None:
                raise self._aborted
            result = pending.finish()
        except BaseException as exc:  # noqa: BLE001 - the caller's wait() raises it
            self._complete(job, None, exc)
        else:
            self._complete(job, result, None)

    def _run(self) -> None:
        inflight = self._inflight
        while True:
            if inflight:
                # Another reduction may start while these are on the wire; anything else,
                # an empty queue or a full pipeline completes the oldest first.
                if self._head is _EMPTY and len(inflight) < _IN_FLIGHT:
                    try:
                        self._head = self._jobs.get_nowait()
                    except queue.Empty:
                        pass
                head = self._head
                if not isinstance(head, _Job) or not head.overlap:
                    self._complete_oldest()
                    continue
                job: _Job | None = head
                self._head = _EMPTY
            elif self._head is not _EMPTY:
                job, self._head = cast("_Job | None", self._head), _EMPTY
            else:
                job = self._jobs.get()
            if job is None:
                return
            self._wait_turn(job)
            if job.claim.acquire(blocking=False):
                self._execute(job, worker=True)
            else:
                job.done.wait()  # its caller runs it: the next job starts after it

    def _wait_turn(self, job: _Job) -> None:
        """Wait until every job before ``job`` completed or is this thread's in flight:
        a job run in a caller's thread (:meth:`steal`, :meth:`run_here`) may still run."""
        inflight = self._inflight
        if self._completed + len(inflight) >= job.seq:
            return
        with self._lock:
            while self._completed + len(inflight) < job.seq and self._aborted is None:
                self._turn.wait()

    def idle(self) -> bool:
        """Whether no job is pending: every job submitted completed (none queued, parked,
        running in any thread, or with its library's work in flight)."""
        with self._lock:
            return (
                self._completed == self._submitted and self._parked is None and not self._inflight
            )

    def close(self, timeout: float = 10.0) -> bool:
        """Let the submitted jobs finish and stop the thread; whether it stopped within
        ``timeout`` seconds (a job waiting for a dead peer may not)."""
        with self._lock:
            if self._closed and self._thread is None:
                return True
            self._closed = True
            self._release_locked()
            thread, self._thread = self._thread, None
        _WORKERS.discard(self)
        if thread is None:
            return True
        self._jobs.put(None)
        if thread is threading.current_thread():
            return False
        thread.join(timeout)
        return not thread.is_alive()

    def abort(self, error: AbortedError) -> None:
        """Fail every queued job with ``error`` at once (the running one fails when the
        library under it is aborted) and stop the thread."""
        with self._lock:
            self._aborted = error
            self._closed = True
            self._stopping, self._thread = self._thread, None
            self._release_locked()
            # The running job may wait inside the library for a peer that never comes (an
            # aborted gloo group does not wake its waiters): its work fails now, and the
            # thread, a daemon, is left to it.
            for job in [self._running] + [job for job, _ in self._inflight]:
                if job is not None and not job.done.is_set():
                    job.future.set_exception(error)
                    job.done.set()
            self._turn.notify_all()
        _WORKERS.discard(self)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.claim.acquire(blocking=False):
                self._execute(job)  # (fails with the abort's error)
        self._jobs.put(None)

    def join(self, timeout: float) -> bool:
        """After :meth:`abort`: wait up to ``timeout`` seconds for the thread to leave
        its job (the library's wait of an aborted transport raises within a poll);
        whether it did. A thread still inside the library's wait when the interpreter
        ends would take the GIL from a finalising interpreter and end the process."""
        thread, self._stopping = self._stopping, None
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()


#: No job taken from the queue ahead of its turn (:meth:`OrderedWorker._run`).
_EMPTY = object()
#: Reductions whose library's work a group's thread keeps in flight at once (queued calls
#: pipeline as gloo's own queue does; one more check waits for the oldest to complete).
_IN_FLIGHT = 8

#: Live workers, stopped at exit: a thread left inside a gloo wait while the interpreter
#: finalises is ended mid-C++ call, and the process aborts ("terminate called without an
#: active exception").
_WORKERS: weakref.WeakSet[OrderedWorker] = weakref.WeakSet()


@atexit.register
def _stop_workers() -> None:
    for worker in list(_WORKERS):
        worker.close(timeout=5.0)


_HOOK_WORKERS: dict[TorchTransport, OrderedWorker] = {}


def worker_for(transport: TorchTransport) -> OrderedWorker:
    """The ordered worker of ``transport`` (the DDP hook's, per process group), made on
    first use and stopped when the transport closes."""
    worker = _HOOK_WORKERS.get(transport)
    if worker is None:
        worker = _HOOK_WORKERS[transport] = OrderedWorker(f"optcc {transport.describe()}")

        def drop() -> None:
            _HOOK_WORKERS.pop(transport, None)
            worker.close()

        transport.on_close(drop)
    return worker
