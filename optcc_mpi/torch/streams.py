"""Side streams and completion events: NCCL's stream semantics for the ``optcc``
backend's CUDA work.

NCCL runs a collective on an internal stream per device, ordered after the work the
caller queued before the call, and hands back a ``Work`` whose ``wait()`` makes the
caller's *current stream* wait for the collective (the host runs ahead). This module gives
the ``optcc`` backend (:mod:`optcc_mpi.torch.process_group`) the same contract, for work that a
group's thread queues rather than the caller, behind a small injectable interface
(:class:`StreamApi`) so that the protocol is tested on the CPU with recording fakes
(:mod:`optcc_mpi.testing.fake_streams`).

The contract
------------
One :class:`SideStreams` per group; it holds one side stream per device, made at the
device's first call. For one call, on tensors on any number of devices:

1. :meth:`SideStreams.start` (the caller's thread, at the call): for *every* CUDA device
   the tensors are on, an event is recorded on the caller's current stream of that device
   (the backward pass that wrote a gradient queued it there). Returns a :class:`StreamCall`.
2. :meth:`StreamCall.run` (the group's thread, in call order): each device's side stream
   waits on that device's event; the tensors are ``record_stream``-ed on the side streams
   (the caching allocator keeps their memory until the side streams' work at their
   release is done); the job (the agreement, the schedule's messages and reductions) runs
   with every side stream current, so every kernel it queues goes to a side stream; then a
   completion event is recorded on each side stream, and a future handed to ``run`` is
   completed there too (a CUDA-aware ``torch.futures.Future`` records its own events on
   the current streams: the side streams).
3. :meth:`StreamCall.wait` (any thread): the host waits until the group's thread has
   *queued* the job (the agreement and the posting are host work, done by that thread),
   never for the device; then the caller's current stream of each device waits on that
   device's completion event, and ``wait`` returns. With a ``timeout``, as NCCL's
   ``Work.wait(timeout)``, it also blocks the host until the device completed, or raises.
   :meth:`StreamCall.is_completed` is NCCL's: queued, and every completion event's
   ``query()`` true (or the job failed).

Nothing here synchronises the host with the device: no event or stream is synchronised,
no tensor read on the host. The host-side agreement of the job (:mod:`optcc_mpi.torch.tensors`:
a gloo collective of CPU tensors on the control group) must not either: a job that needs
the device's values on the host breaks the overlap this gives, and the fakes count such a
synchronisation.

CPU tensors have no streams: a call on them only is run and waited for as before (the
host waits for the job, gloo's semantics).

Two groups on one device have two side streams (two :class:`SideStreams`), so the order
between them is the program's only where the program waits; as with two NCCL groups.

What has not run on a GPU: all of it. It is written to torch's CUDA API
(:class:`CudaStreams`) and checked on the CPU against fakes that record the order of
events; no CUDA stream has been made by it yet.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import torch

from optcc_mpi.errors import ExecutionError

__all__ = ["StreamApi", "Stream", "Event", "CudaStreams", "SideStreams", "StreamCall"]

T = TypeVar("T")
#: How often :meth:`StreamCall.wait` with a timeout asks the device whether it finished
#: (NCCL's ``wait(timeout)`` polls every millisecond too).
_POLL_S = 0.001


class Event(Protocol):
    """A device event (``torch.cuda.Event``)."""

    def record(self, stream: Any) -> None:
        """Mark the point ``stream`` has reached in its queue."""

    def query(self) -> bool:
        """Whether the device has passed the recorded point (no host wait)."""


class Stream(Protocol):
    """A device stream (``torch.cuda.Stream``)."""

    def wait_event(self, event: Any) -> None:
        """Queue a wait for ``event`` on this stream (the host does not wait)."""


class StreamApi(Protocol):
    """What :class:`SideStreams` needs of a device runtime: CUDA's
    (:class:`CudaStreams`), or a fake that records the calls."""

    def devices(self, tensors: Sequence[Any]) -> list[Hashable]:
        """The devices with streams that ``tensors`` are on, each once, in a fixed order."""

    def current_stream(self, device: Hashable) -> Stream:
        """The calling thread's current stream on ``device``."""

    def new_stream(self, device: Hashable) -> Stream:
        """A new stream on ``device``."""

    def new_event(self) -> Event:
        """A new event."""

    def using(self, streams: Sequence[Stream]) -> contextlib.AbstractContextManager[None]:
        """Make each of ``streams`` current on its device for the calling thread, the
        first one's device the current device, within the ``with`` block."""

    def record_stream(self, tensor: Any, stream: Stream) -> None:
        """Tell the allocator that ``tensor``'s memory is in use by ``stream``."""


class CudaStreams:
    """:class:`StreamApi` over ``torch.cuda``."""

    def devices(self, tensors: Sequence[torch.Tensor]) -> list[Hashable]:
        found: set[torch.device] = {t.device for t in tensors if t.is_cuda}
        ordered: list[Hashable] = [*sorted(found, key=lambda d: d.index or 0)]
        return ordered

    def current_stream(self, device: Hashable) -> Stream:
        return torch.cuda.current_stream(device)  # type: ignore[arg-type]

    def new_stream(self, device: Hashable) -> Stream:
        return torch.cuda.Stream(device=device)

    def new_event(self) -> Event:
        return torch.cuda.Event()

    @contextlib.contextmanager
    def using(self, streams: Sequence[Stream]) -> Iterator[None]:
        # torch.cuda.stream also makes the stream's device current; entered last, the
        # first stream's device is the current device in the block.
        with contextlib.ExitStack() as stack:
            for stream in reversed(streams):
                stack.enter_context(torch.cuda.stream(stream))  # type: ignore[arg-type]
            yield

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        tensor.record_stream(stream)  # type: ignore[arg-type]


class StreamCall:
    """One call's events on its devices (module docstring, steps 2 and 3).

    Made by :meth:`SideStreams.start`, not by hand.

    Parameters
    ----------
    api : StreamApi
        The device runtime.
    tensors : sequence of tensors
        What the job reads and writes.
    sides : dict
        The side stream of each device of ``tensors``.
    ready : dict
        The event recorded on the caller's current stream of each device at the call.
    timeout : datetime.timedelta
        The group's timeout: how long :meth:`wait` waits for the job to be queued.
    """

    def __init__(
        self,
        api: StreamApi,
        tensors: Sequence[Any],
        sides: dict[Hashable, Stream],
        ready: dict[Hashable, Event],
        timeout: datetime.timedelta,
    ) -> None:
        self._api = api
        self._tensors: Sequence[Any] | None = tensors
        self._sides = sides
        self._ready = ready
        self._done: dict[Hashable, Event] = {}
        self._timeout = timeout
        self._queued = threading.Event()
        self._error: BaseException | None = None

    @property
    def devices(self) -> list[Hashable]:
        """The devices with streams the call's tensors are on (none: CPU tensors)."""
        return list(self._sides)

    def run(
        self, job: Callable[[], T], future: torch.futures.Future[Any] | None = None
    ) -> T | None:
        """Run ``job()`` with the side streams current, ordered after the caller's work at
        the call (the group's thread calls this, in call order).

        Parameters
        ----------
        job : callable
            Queues the call's device work on the current streams (and does the host
            work: the agreement, the posting); must not synchronise with the device.
        future : torch.futures.Future, optional
            Completed with the job's result (or error) with the side streams current, so
            that a CUDA-aware future's events follow the job; then ``run`` never raises.

        Returns
        -------
        object or None
            The job's result (None if it failed and ``future`` took the error).
        """
        api, sides = self._api, list(self._sides.values())
        try:
            for device, side in self._sides.items():
                side.wait_event(self._ready[device])
            for t in self._tensors or ():
                user = self._sides.get(getattr(t, "device", None))
                if user is not None:
                    api.record_stream(t, user)
            with api.using(sides):
                result = job()
                for device, side in self._sides.items():
                    done = api.new_event()
                    done.record(side)
                    self._done[device] = done
                if future is not None:
                    future.set_result(result)
            return result
        except BaseException as exc:
            self._error = exc
            if future is None:
                raise
            with api.using(sides):
                future.set_exception(exc)
            return None
        finally:
            # record_stream holds the memory for the side streams from here on.
            self._tensors = None
            self._queued.set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Make the caller's current streams wait for the call (module docstring, step 3).

        Parameters
        ----------
        timeout : datetime.timedelta, optional
            None: the host waits only for the job to be queued (at most the group's
            timeout). Given: as NCCL's ``wait(timeout)``, the host also waits for the
            device to complete it, all within ``timeout``.

        Returns
        -------
        bool
            True (as ``Work.wait``).

        Raises
        ------
        RuntimeError
            Not queued (or, with ``timeout``, not complete) in time: a rank that never
            made the call, or a stalled peer.
        BaseException
            The job's own error.
        """
        limit = timeout if timeout is not None and timeout.total_seconds() > 0 else None
        queued_by = limit if limit is not None else self._timeout
        start = time.monotonic()
        if not self._queued.wait(queued_by.total_seconds()):
            raise ExecutionError(
                f"the optcc call was not queued after {queued_by} (a rank that never made "
                "the call, or a stalled peer)"
            )
        if self._error is not None:
            raise self._error
        for device, done in self._done.items():
            self._api.current_stream(device).wait_event(done)
        if limit is not None:
            deadline = start + limit.total_seconds()
            while not self.is_completed():
                if time.monotonic() >= deadline:
                    raise ExecutionError(f"the optcc call did not complete within {limit}")
                time.sleep(_POLL_S)
        return True

    def is_completed(self) -> bool:
        """Whether the call is done: queued, and the device past every completion event
        (or the job failed). Never blocks."""
        if not self._queued.is_set():
            return False
        return self._error is not None or all(e.query() for e in self._done.values())

    def exception(self) -> BaseException | None:
        """The job's error, once queued (None while running or on success)."""
        return self._error if self._queued.is_set() else None


class SideStreams:
    """The side streams of one group: one per device (module docstring).

    Parameters
    ----------
    api : StreamApi, optional
        The device runtime; default :class:`CudaStreams`.
    timeout : datetime.timedelta
        The group's timeout (:meth:`StreamCall.wait`).
    """

    def __init__(
        self,
        api: StreamApi | None = None,
        timeout: datetime.timedelta = datetime.timedelta(minutes=30),
    ) -> None:
        self._api: StreamApi = api if api is not None else CudaStreams()
        self._timeout = timeout
        self._streams: dict[Hashable, Stream] = {}
        self._lock = threading.Lock()  # calls may come from several threads

    def stream(self, device: Hashable) -> Stream:
        """The side stream of ``device``, made at its first use."""
        with self._lock:
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = self._api.new_stream(device)
            return side

    def start(self, tensors: Sequence[Any]) -> StreamCall:
        """Step 1 of the module docstring, in the caller's thread at the call: an event on
        the caller's current stream of every device of ``tensors``; the call's
        :class:`StreamCall`."""
        api = self._api
        sides, ready = {}, {}
        for device in api.devices(tensors):
            sides[device] = self.stream(device)
            event = ready[device] = api.new_event()
            event.record(api.current_stream(device))
        return StreamCall(api, tensors, sides, ready, self._timeout)
