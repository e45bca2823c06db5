"""A transport whose ranks are threads of one process: the contract's minimum, for tests.

:class:`LocalWorld` joins ``size`` ranks through mailboxes in memory; each rank's
:class:`LocalTransport` implements exactly the four methods a transport must
(:mod:`optcc_mpi.transports.base`): ``isend``, ``irecv``, ``wait`` and ``allgather``, and
declares that a completion is seen by waiting for it. Everything else (the argument check's
blocks, the barriers, the maximum over ranks, the library's own AllReduce, which it does
not have) comes from the contract's defaults, so every collective of the package runs over
it, on NumPy arrays, with no MPI library and no process group::

    world = LocalWorld(4)
    results = world.run(lambda t: optcc_mpi.allreduce(x[t.rank], comm=t, algorithm="optcc"))

Sends are eager (the data is copied into the receiver's mailbox at once), and receives
take the messages from one rank with one tag in the order they were posted, as the
contract requires.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar, cast

import numpy as np

from optcc_mpi.errors import ArgumentError, WaitTimeoutError
from optcc_mpi.transports.base import Capabilities, Completion, Transport

__all__ = ["LocalWorld", "LocalTransport", "LocalRequest"]

T = TypeVar("T")


class LocalRequest:
    """A send (complete at once) or a receive (complete once its message arrived)."""

    __slots__ = ("key", "index", "data")

    def __init__(self, key: tuple[int, int, int] | None, index: int, data: np.ndarray) -> None:
        #: ``(source, destination, tag)`` of a receive; None for a send.
        self.key = key
        #: Which message of that key it takes (receives match in posting order).
        self.index = index
        self.data = data


class LocalWorld:
    """``size`` ranks in one process (module docstring).

    Parameters
    ----------
    size : int
        The number of ranks.
    timeout : float
        Seconds a wait or a collective may block before it fails (a test must not hang).
    """

    def __init__(self, size: int, timeout: float = 60.0) -> None:
        if size < 1:
            raise ArgumentError(f"a world needs at least one rank, not {size}")
        self.size = size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._mail: dict[tuple[int, int, int], list[bytes | None]] = {}
        self._posted: dict[tuple[int, int, int], int] = {}
        self._round = 0
        self._slots: list[object] = [None] * size
        self._arrived = 0
        self._results: list[object] = []
        #: One transport per rank.
        self.transports = [LocalTransport(self, r) for r in range(size)]

    def run(self, fn: Callable[[LocalTransport], T]) -> list[T]:
        """``fn(transport)`` on every rank at once, each in its own thread; the results
        in rank order. An exception on any rank is raised here (the lowest rank's)."""
        out: list[object] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def one(rank: int) -> None:
            try:
                out[rank] = fn(self.transports[rank])
            except BaseException as exc:  # reported to the caller below
                errors[rank] = exc

        threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout * 4)
            if t.is_alive():
                raise WaitTimeoutError(
                    f"a rank of the local world still runs after {self.timeout * 4} s"
                )
        for exc in errors:
            if exc is not None:
                raise exc
        return out  # type: ignore[return-value]

    # -- what the transports call -------------------------------------------------------------
    def _send(self, src: int, dst: int, tag: int, data: np.ndarray) -> None:
        with self._cond:
            self._mail.setdefault((src, dst, tag), []).append(data.tobytes())
            self._cond.notify_all()

    def _post_recv(self, src: int, dst: int, tag: int) -> int:
        with self._cond:
            key = (src, dst, tag)
            index = self._posted.get(key, 0)
            self._posted[key] = index + 1
            return index

    def _take(self, key: tuple[int, int, int], index: int, into: np.ndarray) -> None:
        with self._cond:
            box = self._mail.setdefault(key, [])
            if not self._cond.wait_for(lambda: len(box) > index, self.timeout):
                raise WaitTimeoutError(f"rank {key[1]} waited {self.timeout} s for rank {key[0]}")
            data = box[index]
            box[index] = None  # taken: the memory goes
        assert data is not None, "a message taken twice"
        into[...] = np.frombuffer(data, dtype=np.uint8)

    def _gather(self, rank: int, obj: object) -> list[object]:
        with self._cond:
            mine = self._round
            self._slots[rank] = obj
            self._arrived += 1
            if self._arrived == self.size:
                self._results, self._slots = self._slots, [None] * self.size
                self._arrived = 0
                self._round += 1
                self._cond.notify_all()
            elif not self._cond.wait_for(lambda: self._round != mine, self.timeout):
                raise WaitTimeoutError(f"rank {rank} waited {self.timeout} s in a collective")
            return list(self._results)


class LocalTransport(Transport[LocalRequest]):
    """One rank of a :class:`LocalWorld`."""

    name = "local"
    caps = Capabilities(completion=Completion.ORDERED, sync_device=False, tensors=False)

    def __init__(self, world: LocalWorld, rank: int) -> None:
        super().__init__(rank, world.size, "shared-memory")
        self.world = world

    def isend(self, data: object, peer: int, tag: int) -> LocalRequest:
        arr = np.asarray(data)
        self.world._send(self.rank, peer, tag, arr)
        return LocalRequest(None, 0, arr)

    def irecv(self, data: object, peer: int, tag: int) -> LocalRequest:
        arr = np.asarray(data)
        return LocalRequest(
            (peer, self.rank, tag), self.world._post_recv(peer, self.rank, tag), arr
        )

    def wait(self, req: LocalRequest) -> None:
        if req.key is not None:
            self.world._take(req.key, req.index, req.data)
            req.key = None  # complete: a second wait returns at once

    def allgather(self, obj: T) -> list[T]:
        # Every rank passes the same kind of value (the contract): rows of obj's type.
        return cast("list[T]", self.world._gather(self.rank, obj))
