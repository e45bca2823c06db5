"""Recording fakes of device streams and events, so the stream protocol of
:mod:`optcc_mpi.torch.streams` is checked on machines without a GPU.

:class:`FakeStreams` is a :class:`~optcc_mpi.torch.streams.StreamApi`: its streams and events
do nothing but append what was asked of them to one log, in order, as tuples of names:

``("record", event, stream)``
    An event recorded on a stream.
``("wait", stream, event)``
    A stream made to wait on an event (no host wait).
``("keep", tensor, stream)``
    A tensor's memory marked in use by a stream (``record_stream``).
``("launch", what, stream)``
    Device work queued: :meth:`FakeStreams.launch`, which a test's job calls where real
    code would queue a kernel, on the calling thread's current stream of the current
    device.
``("host-sync", what)``
    The host waited for the device (an event's or a stream's ``synchronize``): what the
    protocol must never do outside ``wait(timeout)``.

As in CUDA, the current stream is per thread and per device, and a new thread's is the
device's default stream (``"default:<device>"``). Events pass (``query()`` true) only when
the test says the device got there (:meth:`FakeStreams.finish`). Devices are names
(``"cuda:0"``); :class:`FakeTensor` stands for a tensor on one. Nothing here needs torch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

__all__ = ["FakeStreams", "FakeStream", "FakeEvent", "FakeTensor"]


class FakeTensor:
    """Stands for a tensor on ``device`` (``"cpu"`` or ``"cuda:N"``)."""

    def __init__(self, name: str, device: str) -> None:
        self.name = name
        self.device = device
        self.is_cuda = device.startswith("cuda")

    def __repr__(self) -> str:
        return f"FakeTensor({self.name!r}, {self.device!r})"


class FakeStream:
    """A stream of ``device`` that logs the waits queued on it."""

    def __init__(self, api: FakeStreams, name: str, device: Hashable) -> None:
        self.api = api
        self.name = name
        self.device = device

    def wait_event(self, event: FakeEvent) -> None:
        self.api.log.append(("wait", self.name, event.name))
        self.api.waits_on[self.name].append(event)

    def synchronize(self) -> None:
        self.api.log.append(("host-sync", self.name))

    def __repr__(self) -> str:
        return f"FakeStream({self.name!r})"


class FakeEvent:
    """An event that logs where it is recorded; it passes once the test says so
    (:meth:`FakeStreams.finish`)."""

    def __init__(self, api: FakeStreams, name: str) -> None:
        self.api = api
        self.name = name
        self.stream: str | None = None
        self.passed = False

    def record(self, stream: FakeStream) -> None:
        self.api.log.append(("record", self.name, stream.name))
        self.stream = stream.name
        self.passed = False

    def query(self) -> bool:
        self.api.queries += 1
        return self.passed

    def synchronize(self) -> None:
        self.api.log.append(("host-sync", self.name))

    def __repr__(self) -> str:
        return f"FakeEvent({self.name!r} on {self.stream!r})"


class FakeStreams:
    """A :class:`~optcc_mpi.torch.streams.StreamApi` that records (module docstring)."""

    def __init__(self) -> None:
        #: Everything asked of the streams and events, in order.
        self.log: list[tuple[str, ...]] = []
        #: The events each stream was made to wait on, by stream name.
        self.waits_on: dict[str, list[FakeEvent]] = {}
        #: Calls of an event's ``query`` (polling, not a host wait).
        self.queries = 0
        self._events: list[FakeEvent] = []
        self._defaults: dict[Hashable, FakeStream] = {}
        self._made = 0
        self._lock = threading.Lock()
        self._local = threading.local()

    # -- the StreamApi ------------------------------------------------------------------
    def devices(self, tensors: Sequence[Any]) -> list[Hashable]:
        return sorted({t.device for t in tensors if getattr(t, "is_cuda", False)})

    def current_stream(self, device: Hashable) -> FakeStream:
        current: dict[Hashable, FakeStream] = self._current()
        stream = current.get(device)
        return stream if stream is not None else self.default_stream(device)

    def new_stream(self, device: Hashable) -> FakeStream:
        with self._lock:
            self._made += 1
            return self._stream(f"side{self._made}:{device}", device)

    def new_event(self) -> FakeEvent:
        with self._lock:
            event = FakeEvent(self, f"e{len(self._events) + 1}")
            self._events.append(event)
            return event

    @contextlib.contextmanager
    def using(self, streams: Sequence[FakeStream]) -> Iterator[None]:
        current = self._current()
        saved = dict(current), getattr(self._local, "device", None)
        for stream in streams:
            current[stream.device] = stream
        if streams:
            self._local.device = streams[0].device
        try:
            yield
        finally:
            current.clear()
            current.update(saved[0])
            self._local.device = saved[1]

    def record_stream(self, tensor: FakeTensor, stream: FakeStream) -> None:
        self.log.append(("keep", tensor.name, stream.name))

    # -- for tests ------------------------------------------------------------------------
    def default_stream(self, device: Hashable) -> FakeStream:
        """``device``'s default stream (every thread's current stream until changed)."""
        with self._lock:
            stream = self._defaults.get(device)
            if stream is None:
                stream = self._defaults[device] = self._stream(f"default:{device}", device)
            return stream

    def user_stream(self, name: str, device: Hashable) -> FakeStream:
        """A stream of the caller's own (``torch.cuda.Stream()``), to make current with
        :meth:`using`."""
        return self._stream(name, device)

    def set_device(self, device: Hashable) -> None:
        """Make ``device`` the calling thread's current device (``torch.cuda.set_device``)."""
        self._local.device = device

    def launch(self, what: str) -> None:
        """Device work queued by the calling thread: on its current stream of its current
        device (``set_device``, or the first stream of :meth:`using`)."""
        device = getattr(self._local, "device", None)
        if device is None:
            raise AssertionError(f"{what!r} launched with no current device")
        self.log.append(("launch", what, self.current_stream(device).name))

    def finish(self) -> None:
        """The device has run everything queued so far: every recorded event passes."""
        for event in self._events:
            if event.stream is not None:
                event.passed = True

    def entries(self, kind: str) -> list[tuple[str, ...]]:
        """The log's entries of ``kind`` (``"record"``, ``"wait"``, ...)."""
        return [e for e in self.log if e[0] == kind]

    def _stream(self, name: str, device: Hashable) -> FakeStream:
        self.waits_on.setdefault(name, [])
        return FakeStream(self, name, device)

    def _current(self) -> dict[Hashable, FakeStream]:
        current = getattr(self._local, "current", None)
        if current is None:
            current = self._local.current = {}
        return current
