"""The transport contract: what a library must offer for a schedule to run over it.

A transport is one communicator (or process group) of one library, as the executor, the
argument check, the probe and the watch see it. To add a library, subclass
:class:`Transport` and implement the four required methods; everything else has a default
that is correct, if not the fastest. ``docs/transports.md`` is this page with an example;
:mod:`optcc_mpi.testing.local` is a complete transport in about a hundred lines (ranks as
threads of one process), the minimum made concrete.

Required
--------
``isend(data, peer, tag) -> Req`` and ``irecv(data, peer, tag) -> Req``
    Start sending ``data`` to rank ``peer`` / receiving into it from ``peer``; ``data`` is
    what :meth:`Transport.message` made of an array (by default a 1-D ``uint8`` view).
    Messages between two ranks with the same tag must match in posting order.
``wait(req)``
    Block until ``req`` completed.
``allgather(obj) -> list``
    Every rank's small picklable ``obj``, in rank order (a collective).

Declared
--------
:attr:`Transport.name`
    The library, for messages and records (``"mpi"``, ``"gloo"``, ``"nccl"``).
:attr:`Transport.caps`
    :class:`Capabilities`: how completions are seen (:class:`Completion`), whether device
    memory needs the current stream synchronised before the library reads it, whether
    tensors stay tensors.
``rank``, ``size``, ``kind``
    Passed to ``Transport.__init__``: this process's rank, the number of ranks, and
    the kind of fabric that joins them, ``"shared-memory"`` (every rank on one node) or
    ``"network"``.
``gather_total``
    Where :meth:`~Transport.allgather_block` is much cheaper than the library's
    AllReduce (the board of ranks on one machine), the bytes of every rank's block
    together up to which short messages should travel in the argument check and be
    reduced on every rank; None (the default): the check's own
    (:data:`~optcc_mpi.check.state.FOLD_TOTAL`).
``board_state``
    Whether a shared-memory board (:mod:`optcc_mpi.transports.board`) carries the
    communicator's exchanges: ``"on"``, or ``"none: ..."`` and why not, the same on every
    rank; empty (the default) for a transport that has no board. Every call's record
    carries it (:class:`~optcc_mpi.communicators.CallRecord`).
``crowding``
    Ranks per core where the ranks share CPUs, the same on every rank (1.0, the default,
    where unknown): a transport that can learn it at set-up sets it from
    :func:`crowding_of` of every rank's :func:`cpu_placement`.

Optional, with defaults
-----------------------
``waitsome``/``testsome`` (:attr:`Completion.ANY` only: which requests completed;
default: wait for the first / none known), ``batch`` (post several as one group; default:
one by one), ``message``, ``scratch``, ``staging``, ``check_backend`` (which arrays it
moves; default: host arrays), ``native``/``allreduce``/``allreduce_now`` (the library's
own AllReduce where it reduces exactly as this package does; default: none, and every
rank's data is gathered and reduced in rank order instead), ``allgather_block`` (fixed
blocks of bytes; default: through :meth:`~Transport.allgather`), ``gather_rows``,
``allreduce_max`` (default: through ``allgather``), ``barrier`` and ``quiet_barrier``
(default: through ``allgather``), ``job_links`` (the job's rank numbering to this
communicator's; default: the same), ``describe``, ``level_clock`` (where the host never
sees a message complete, :attr:`Completion.GROUPED`: a :class:`LevelClock` on the device
the levels run on, so that the watch can time them afterwards; default: none).

Provided
--------
:meth:`Transport.on_close` and :meth:`Transport.close`: a transport says when its
communicator goes away (MPI frees it, a process group is destroyed), and whoever keeps
state for it (the collectives' registry) drops that state then. A transport keeps nothing
of the layers above it.
"""

from __future__ import annotations

import enum
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from optcc_mpi.arrays import NUMPY, Array, ArrayOps
from optcc_mpi.errors import ArgumentTypeError
from optcc_mpi.links import Links

__all__ = [
    "Transport",
    "Capabilities",
    "Completion",
    "Post",
    "Req",
    "LevelClock",
    "boot_id",
    "cpu_placement",
    "crowding_of",
    "ABORT_POLL",
]

#: Seconds between a waiting rank's looks at whether its group was aborted (or, on the
#: board, destroyed or short of a rank): the one value for every wait that cannot be
#: woken by an abort itself (the board's futex sleep, a gloo collective's timed wait), so
#: that an abort is seen within the same time whatever the rank waits on. A quarter of a
#: second: an abort or a destroy is seen at once by a person, and a sleeping rank wakes
#: four times a second, nothing next to a collective's cost.
ABORT_POLL = 0.25

#: A transport's request: what its ``isend``/``irecv`` return and its ``wait`` takes.
Req = TypeVar("Req")
#: What :meth:`Transport.allgather` carries: the same kind of value from every rank.
T = TypeVar("T")


class Completion(enum.Enum):
    """How a transport reports completed requests (what the executor's loop does)."""

    #: :meth:`Transport.waitsome` blocks until some request completed and names them
    #: (MPI's ``Waitsome``).
    ANY = "any"
    #: A completion is seen only by waiting for that request (gloo's ``Work.wait``): the
    #: executor waits for the outstanding operation of lowest level, which cannot deadlock
    #: for a schedule the verifier accepts.
    ORDERED = "ordered"
    #: Nothing is waited for on the host: each level's messages are posted as one group
    #: (:meth:`Transport.batch`) and the device stream orders what follows (NCCL).
    GROUPED = "grouped"


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a transport can do, as the layers above it need to know."""

    #: How completions are seen.
    completion: Completion = Completion.ORDERED
    #: Whether a device buffer needs the current stream synchronised before the library
    #: reads it (MPI: yes; NCCL orders itself after the current stream).
    sync_device: bool = True
    #: Whether tensors stay tensors (:func:`optcc_mpi.arrays.buffer_of`'s ``tensors``),
    #: rather than being seen as NumPy or CuPy arrays.
    tensors: bool = False
    #: Whether the library's own AllReduce is bandwidth-optimal on healthy links (a ring,
    #: as gloo's and NCCL's are): ``auto`` then leaves it every size it reduces exactly
    #: (:meth:`Transport.native`) while no link is degraded.
    library_optimal: bool = False
    #: Whether the library's AllReduce reduces each element once, in one order, and copies
    #: the result to every rank (a ring, as gloo's and NCCL's): its results are the same
    #: bits everywhere, NaN payloads included, with no pass over them afterwards.
    library_identical: bool = False
    #: Whether a short sum may carry the ranks' flags of agreement as one more element of
    #: the library's AllReduce, so that a call of the signature every rank expects needs
    #: no check of its own (:mod:`optcc_mpi.check.ride`): the library's results are the
    #: same bits everywhere, and nothing on this transport (a compiled path, a board)
    #: takes a call past the Python check.
    ride: bool = False


@dataclass(frozen=True, slots=True)
class Post:
    """One operation of a group posted together (:meth:`Transport.batch`)."""

    #: A send (else a receive).
    send: bool
    #: What :meth:`Transport.message` made of the array.
    data: object
    #: The other rank.
    peer: int
    #: The message's tag.
    tag: int


class LevelClock(Protocol):
    """Times on the device where a grouped transport's levels run (NCCL: CUDA events on
    the stream the executor posts them on). The host records marks as it posts, and
    reads them later, never waiting for the device."""

    def mark(self) -> object:
        """Record a point on the stream now in use, and return it."""
        ...

    def reached(self, marks: Sequence[object]) -> bool:
        """Whether the device has passed every one of ``marks`` (without waiting)."""
        ...

    def seconds(self, a: object, b: object) -> float:
        """Seconds from mark ``a`` to mark ``b``, both reached."""
        ...


class Transport(Generic[Req]):
    """One communicator or process group of one library (module docstring).

    Parameters
    ----------
    rank, size : int
        This process's rank and the number of ranks.
    kind : str
        ``"shared-memory"`` (every rank on one node) or ``"network"``: the kind of fabric
        that joins the ranks (:data:`optcc_mpi.algorithms._policy.FABRICS`), from which
        builders size their messages.
    """

    #: The library: ``"mpi"``, ``"gloo"``, ``"nccl"``, ...
    name: str = "abstract"
    #: What the transport can do.
    caps: Capabilities = Capabilities()
    #: An integer naming the communicator for a fast lookup (MPI's handle), else None.
    handle: int | None = None

    #: The methods every transport implements (module docstring).
    REQUIRED = ("isend", "irecv", "wait", "allgather")

    def __init_subclass__(cls, abstract: bool = False, **kwargs: object) -> None:
        # A transport missing a required method fails where it is written, not in the
        # middle of a collective.
        super().__init_subclass__(**kwargs)
        missing = [m for m in Transport.REQUIRED if getattr(cls, m) is getattr(Transport, m)]
        if missing and not abstract:
            raise ArgumentTypeError(
                f"transport {cls.__name__} must implement {', '.join(missing)} "
                "(optcc_mpi.transports.base; or declare it abstract=True)"
            )

    #: Ranks per core on the most crowded CPU set of the communicator (1.0: unknown, or
    #: no more ranks than cores); builders charge each message's fixed cost that many
    #: times (:func:`crowding_of`).
    crowding: float = 1.0
    #: Every rank's block together, in bytes, up to which short messages travel in the
    #: argument check (None: the check's own default); set where the gather is cheap.
    gather_total: int | None = None
    #: Whether a shared-memory board carries the exchanges (``"on"``), or ``"none: WHY"``
    #: (module docstring); empty for a transport that has no board.
    board_state: str = ""

    def __init__(self, rank: int, size: int, kind: str) -> None:
        self.rank = rank
        self.size = size
        self.kind = kind
        self._on_close: list[Callable[[], None]] = []
        self._closed = False

    # -- required ----------------------------------------------------------------------------
    def isend(self, data: object, peer: int, tag: int) -> Req:
        """Start sending ``data`` to ``peer``; its request."""
        raise NotImplementedError(f"{type(self).__name__} must implement isend")

    def irecv(self, data: object, peer: int, tag: int) -> Req:
        """Start receiving into ``data`` from ``peer``; its request."""
        raise NotImplementedError(f"{type(self).__name__} must implement irecv")

    def wait(self, req: Req) -> None:
        """Block until ``req`` completed."""
        raise NotImplementedError(f"{type(self).__name__} must implement wait")

    def allgather(self, obj: T) -> list[T]:
        """Every rank's (small, picklable) ``obj``, in rank order."""
        raise NotImplementedError(f"{type(self).__name__} must implement allgather")

    # -- completions (Completion.ANY) ---------------------------------------------------------
    def waitsome(self, reqs: Sequence[Req]) -> list[int]:
        """Indices of completed requests, blocking until there is one."""
        self.wait(reqs[0])
        return [0]

    def testsome(self, reqs: Sequence[Req]) -> list[int]:
        """Indices of completed requests, without blocking (none, where unknown)."""
        return []

    def batch(self, posts: Sequence[Post]) -> list[Req]:
        """Post operations as one group; their requests, in order."""
        return [(self.isend if p.send else self.irecv)(p.data, p.peer, p.tag) for p in posts]

    # -- memory --------------------------------------------------------------------------------
    def message(self, arrays: ArrayOps, arr: Array) -> Array:
        """What :meth:`isend`/:meth:`irecv` take for the bytes of ``arr``."""
        return arrays.byte_view(arr)

    def scratch(self, nbytes: int) -> tuple[Array, ArrayOps]:
        """A buffer of ``nbytes`` bytes this transport moves, and its array library (the
        probe's and the doctor's messages): host memory unless the library needs device
        memory."""
        return np.zeros(nbytes, dtype=np.uint8), NUMPY

    def staging(self, arrays: ArrayOps) -> bool:
        """Whether the messages of this array library go through host copies."""
        return False

    def level_clock(self, arrays: ArrayOps) -> LevelClock | None:
        """Where the host never sees a message complete (:attr:`Completion.GROUPED`), a
        clock on the device the arrays of ``arrays`` live on, whose marks time each level of
        a call afterwards (the watch's measurements); None (the default): no times."""
        return None

    def check_arrays(self, arrays: ArrayOps) -> None:
        """ArgumentError if this transport cannot move the arrays of ``arrays`` (checked
        for transports whose :attr:`Capabilities.tensors` is set)."""

    # -- the library's own AllReduce ----------------------------------------------------------
    def native(self, arrays: ArrayOps, dtype_name: str, op: str) -> bool:
        """Whether :meth:`allreduce` reduces ``dtype_name`` with ``op`` exactly as this
        package does (else the caller gathers and reduces in rank order)."""
        return False

    def allreduce(self, arrays: ArrayOps, arr: Array, dtype_name: str, op: str) -> Req:
        """Start the library's in-place AllReduce of ``arr``; its request (the executor
        waits for it as for a message's). Called only where :meth:`native` said yes."""
        raise NotImplementedError(f"{self.describe()} has no AllReduce of its own")

    def allreduce_now(self, arrays: ArrayOps, arr: Array, dtype_name: str, op: str) -> None:
        """:meth:`allreduce`, completed before returning."""
        self.wait(self.allreduce(arrays, arr, dtype_name, op))

    # -- control traffic ----------------------------------------------------------------------
    def allgather_block(self, block: np.ndarray, out: np.ndarray) -> None:
        """Every rank's ``block`` (1-D uint8, the same size everywhere) into the rows of
        ``out``."""
        rows = self.allgather(block.tobytes())
        for r, row in enumerate(rows):
            out[r] = np.frombuffer(row, dtype=np.uint8)

    def gather_rows(self, arrays: ArrayOps, arr: Array) -> Array | None:
        """Every rank's ``arr`` (1-D, the same size everywhere) as the rows of a 2-D array
        of ``arrays``, gathered where it lives (on the device for device memory); None
        where this transport gathers through the host only."""
        return None

    def allreduce_max(self, vec: np.ndarray) -> None:
        """``vec`` (int64) replaced by its element-wise maximum over the ranks."""
        rows = self.allgather(vec.tolist())
        np.copyto(vec, np.max(np.array(rows, dtype=vec.dtype), axis=0))

    def barrier(self) -> None:
        """Return once every rank has called it."""
        self.allgather(None)

    def quiet_barrier(self) -> None:
        """A barrier that leaves the CPU to others while it waits, and ends at about the
        same instant on every rank (measurements start from it)."""
        self.barrier()

    def job_links(self, links: Links) -> Links:
        """A profile in the job's numbering (``$OPTCC_LINKS``: MPI's COMM_WORLD, torch's
        global ranks) in this communicator's ranks; members only."""
        return links

    def describe(self) -> str:
        """One line for messages: the library and the size."""
        return f"{self.name} group of {self.size}"

    # -- provided -----------------------------------------------------------------------------
    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when the communicator goes away (:meth:`close`)."""
        if self._closed:
            callback()
        else:
            self._on_close.append(callback)

    def close(self) -> None:
        """The communicator went away: tell those who asked (:meth:`on_close`), once."""
        if self._closed:
            return
        self._closed = True
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed


#: Where a rank runs, as :func:`crowding_of` compares it: the kernel's boot id (one per
#: machine: network namespaces and containers share it, so the ranks of a namespace
#: testbed count as the one machine's) and the CPUs the rank may run on.
Placement = tuple[str, tuple[int, ...]]


def boot_id() -> str:
    """The running kernel's boot id: the same for every process of one machine (Linux;
    OSError elsewhere)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def cpu_placement() -> Placement:
    """This process's :data:`Placement` (the CPUs from its affinity mask where the system
    has one, else every CPU)."""
    try:
        machine = boot_id()
    except OSError:  # not Linux: the host's name is the best key there is
        machine = socket.gethostname()
    try:
        cpus = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cpus = tuple(range(os.cpu_count() or 1))
    return machine, cpus


def crowding_of(places: Sequence[Placement]) -> float:
    """Ranks per core on the most crowded CPU set, from every rank's
    :func:`cpu_placement` (at least 1.0).

    Ranks of one machine allowed the same CPUs share those CPUs; ranks pinned to CPUs of
    their own (``srun --cpu-bind``, ``mpiexec -bind-to core``) do not crowd each other.
    Why it matters (derived, ours; docs/testbed.md 1.6j): once the ranks outnumber the
    cores, a message whose receiver is not running waits for the receiver to be
    scheduled, so a message's fixed cost grows with the ranks per core (measured through
    the executor on 2 cores: 0.3 us per message at 2 ranks, 1.2, 2.2 and 2.5 ms at 4, 8
    and 16).
    """
    counts: dict[tuple[str, tuple[int, ...]], int] = {}
    for machine, cpus in places:
        key = (str(machine), tuple(cpus))
        counts[key] = counts.get(key, 0) + 1
    most = max((n / max(1, len(cpus)) for (_, cpus), n in counts.items()), default=1.0)
    return max(1.0, float(most))
