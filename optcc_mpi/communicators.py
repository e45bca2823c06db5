"""What the collectives keep per communicator, and the one registry of it.

The first collective call on a communicator (an mpi4py communicator or a
``torch.distributed`` process group, through its transport) makes its :class:`CommState`
in the one :class:`Registry` (:data:`_STATES`, which the collectives alone write); every
later call finds it there. It holds what every later call would otherwise recompute: the
link profile from ``$OPTCC_LINKS`` translated to this communicator's ranks, the probe's
result, the watch, the link rate learnt, the schedules built (:class:`Plan`), the argument
check's buffers, room, gather limit and compiled context
(:class:`~optcc_mpi.check.state.CheckState`), and the plans of the short calls the
compiled path may take.

Transports hold nothing of this: a transport only says when its communicator goes away
(:meth:`~optcc_mpi.transports.Transport.on_close`), and the registry then drops the
state, so that the compiled call path can never reach a freed communicator.

Records
-------
:class:`Plan`
    What a call runs: the algorithm, its schedule, whether the schedule is only the
    library's own AllReduce.
:class:`CallRecord`
    What the last call did (:func:`optcc_mpi.collectives.last_stats`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Generic, TypeVar

from optcc_mpi.check.fastcall import FoldCall
from optcc_mpi.check.ride import Ride, serves
from optcc_mpi.check.state import CheckState
from optcc_mpi.emulation import Emulation
from optcc_mpi.errors import ArgumentError
from optcc_mpi.executor import ExecStats
from optcc_mpi.links import Links
from optcc_mpi.probe import ProbeResult
from optcc_mpi.schedule import Schedule
from optcc_mpi.transports import Transport, world_handle
from optcc_mpi.watch import LinkWatch

__all__ = ["CommState", "Plan", "CallRecord", "Fold", "Registry", "PLAN_CACHE"]

#: Cached schedules per communicator (oldest dropped first).
PLAN_CACHE = 64

K = TypeVar("K")
V = TypeVar("V")


class _Bounded(Generic[K, V]):
    """A dictionary that keeps its :data:`PLAN_CACHE` newest entries."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        return self._items.get(key)

    def put(self, key: K, value: V) -> V:
        if key not in self._items and len(self._items) >= PLAN_CACHE:
            self._items.pop(next(iter(self._items)))
        self._items[key] = value
        return value

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True, slots=True)
class Plan:
    """What one call runs (cached per communicator by its arguments)."""

    #: The algorithm that runs (``auto`` resolved).
    algorithm: str
    #: Its schedule.
    schedule: Schedule
    #: Whether the schedule is only the library's own AllReduce (one ``COLL`` operation).
    library_only: bool


@dataclass(slots=True, eq=False)
class CallRecord(Mapping[str, object]):
    """What the last :func:`optcc_mpi.allreduce` on this process did.

    Read it by attribute (``record.algorithm``) or, as before it was a record, by key
    (``record["algorithm"]``, ``dict(record)``).
    """

    #: The algorithm that ran.
    algorithm: str
    #: Its schedule.
    schedule: Schedule
    #: What the executor measured (empty when no schedule ran on the executor).
    stats: ExecStats = field(default_factory=ExecStats)
    #: The link profile the call was planned for.
    links: Links = field(default_factory=Links)
    #: The emulation, if any.
    emulate: Emulation | None = None
    #: The algorithm's extra parameters.
    params: dict[str, object] = field(default_factory=dict)
    #: True when the data travelled with the argument check.
    inline: bool = False
    #: The transport's library: ``mpi``, ``gloo``, ``nccl``.
    transport: str = ""
    #: Whether the shared-memory board of a torch group's ranks on one machine carried the
    #: call's exchanges (:mod:`optcc_mpi.transports.board`): ``"on"``; ``"none: WHY"``
    #: where the group has none and ``transport`` carried them (``"none: /dev/shm
    #: budget"``: the boards would take too much of ``/dev/shm``); empty for a transport
    #: that has no board (MPI).
    board: str = ""

    def __getitem__(self, key: str) -> object:
        if key not in _RECORD_FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_RECORD_FIELDS)

    def __len__(self) -> int:
        return len(_RECORD_FIELDS)


_RECORD_FIELDS = tuple(f.name for f in fields(CallRecord))


@dataclass(frozen=True, slots=True)
class Fold:
    """A short call the compiled path may take (by bytes and element type), with the
    records of its two outcomes, made once: such a call allocates no record."""

    #: What the call runs.
    plan: Plan
    #: Its record when the data travelled with the check.
    gathered: CallRecord
    #: Its record when the check was followed by the library's AllReduce.
    library: CallRecord


class CommState:
    """What the collectives keep for one communicator (module docstring).

    Parameters
    ----------
    transport : Transport
        The communicator's transport.
    """

    __slots__ = (
        "transport", "size", "rank", "check", "ride", "plans", "folds", "probe", "watch", "rate",
        "watch_codes", "_env",
    )  # fmt: skip

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.size = transport.size
        self.rank = transport.rank
        #: The argument check's buffers, room, gather limit and compiled context.
        self.check = CheckState(transport)
        #: The rides of short sums (check.ride), where the transport allows them.
        self.ride: Ride | None = Ride(transport) if serves(transport) else None
        if self.ride is not None:
            self.ride.links_ride = self._watch_rides
        #: Schedules built, by the call's arguments.
        self.plans: _Bounded[tuple[object, ...], Plan] = _Bounded()
        #: The short calls the compiled path may take, by (bytes, dtype).
        self.folds: _Bounded[tuple[object, ...], Fold] = _Bounded()
        #: The probe's result (``links="probe"``), once measured.
        self.probe: ProbeResult | None = None
        #: The watch (``links="watch"``), once made.
        self.watch: LinkWatch | None = None
        #: A healthy link's rate (bytes/s) learnt on this communicator, which sizes the
        #: segments of its schedules where ``$OPTCC_LINK_RATE`` is not set: None until the
        #: first call that needs it, 0.0 where nothing could be measured.
        self.rate: float | None = None
        #: The header's link codes of the watched calls made (``links="watch"``, at each
        #: link rate): every rank adds those of the calls it makes, so an agreed header's
        #: is in every rank's.
        self.watch_codes: set[int] = set()
        self._env: tuple[str | None, Links | ArgumentError] = ("\0", Links())

    def links_from_env(self, text: str | None) -> Links:
        """The profile ``text`` (the job's ranks) on this communicator's ranks; cached per
        text. ArgumentError if it does not parse or names a rank outside the job."""
        cached_text, value = self._env
        if cached_text != text:
            try:
                value = self.transport.job_links(Links.parse(text or ""))
            except (ValueError, TypeError) as exc:
                value = ArgumentError(f"$OPTCC_LINKS={text!r}: {exc}")
            self._env = (text, value)
        if isinstance(value, ArgumentError):
            raise value
        return value

    def _watch_rides(self, link: int, nbytes: int) -> int | None:
        """The ride's :attr:`~optcc_mpi.check.ride.Ride.links_ride`: a watched call rides
        when the watch needs nothing of it (:meth:`~optcc_mpi.watch.LinkWatch.quiet`:
        the library's AllReduce serves a call of ``nbytes`` whatever it carries),
        carrying what the last call observed
        (:meth:`~optcc_mpi.watch.LinkWatch.carried_size`). Only agreed state is read: the
        watch's, and codes every rank made."""
        watch = self.watch
        if watch is None or link not in self.watch_codes:
            return None
        if not watch.quiet(watch.timeable(nbytes), nbytes):
            return None
        return watch.carried_size()

    def watch_made(self) -> LinkWatch:
        """The communicator's watch, made on first use."""
        if self.watch is None:
            self.watch = LinkWatch(self.size)
        return self.watch


class Registry:
    """Every communicator's :class:`CommState`, by transport (and, for the compiled path's
    one-lookup search, by MPI handle); the last call's record. One instance,
    :data:`_STATES`, written by the collectives alone."""

    __slots__ = ("_states", "_by_handle", "_world", "_lock", "recent", "last", "fold")

    def __init__(self) -> None:
        self._states: dict[int, CommState] = {}
        self._by_handle: dict[int, CommState] = {}
        self._world: int | None = None  # COMM_WORLD's handle, once MPI is loaded
        self._lock = threading.Lock()
        #: ``(communicator object, its state)`` of the last call the compiled path took:
        #: a loop over one communicator skips the lookup. One tuple, replaced whole, so
        #: that a thread never sees one call's communicator with another's state.
        self.recent: tuple[object, CommState | None] = (self, None)
        #: What the last call on this process did.
        self.last: CallRecord | None = None
        #: The compiled call (:func:`optcc_mpi.check.fastcall.fold_function`), bound at the
        #: first call that can use it; None until then or where there is none.
        self.fold: FoldCall | None = None

    def state(self, transport: Transport) -> CommState:
        """The state of ``transport``'s communicator, made on first use."""
        st = self._states.get(id(transport))
        if st is not None and st.transport is transport:
            return st
        with self._lock:
            st = self._states.get(id(transport))
            if st is None or st.transport is not transport:
                st = CommState(transport)
                self._states[id(transport)] = st
                if transport.handle is not None:
                    self._by_handle[transport.handle] = st
                transport.on_close(lambda: self._drop(transport))
        return st

    def known(self, handle: int | None) -> CommState | None:
        """The state of the MPI communicator with ``handle`` (None: COMM_WORLD) if one
        was made, with one dictionary lookup; else None."""
        if handle is None:
            handle = self._world
            if handle is None:
                handle = self._world = world_handle()
                if handle is None:
                    return None
        return self._by_handle.get(handle)

    def _drop(self, transport: Transport) -> None:
        with self._lock:
            st = self._states.pop(id(transport), None)
            if st is None:
                return
            if transport.handle is not None and self._by_handle.get(transport.handle) is st:
                del self._by_handle[transport.handle]
            st.check.close()
            if self.recent[1] is st:
                self.recent = (self, None)


#: Every communicator's state, and the last call's record: the collectives' only state,
#: written by them alone (:mod:`optcc_mpi.collectives`, :mod:`optcc_mpi.compiled_path`).
_STATES = Registry()


def _known(comm: object) -> CommState | None:
    """The state of an MPI communicator seen before (None: COMM_WORLD), found with one
    dictionary lookup; else None."""
    if comm is None:
        return _STATES.known(None)
    handle = getattr(comm, "handle", None)
    return _STATES.known(handle) if type(handle) is int else None
