"""Run one rank's program of a schedule over a transport.

The executor knows nothing about algorithms, and nothing about the library that moves the
bytes: it talks to a :class:`~optcc_mpi.transports.Transport` (MPI, torch.distributed).
It keeps every operation whose dependencies have completed in flight at once, so
pipelined stages really overlap, and reacts to completions:

* a point-to-point operation is posted once its dependencies completed and the earlier
  operations of its queue (peer, channel, direction) were posted: the order of posting
  per queue is program order on both sides, which makes message matching deterministic;
* a received message is reduced into place (on the device for device arrays) when it
  arrives;
* local copies and reductions run as soon as they are ready.

How completions are seen is the transport's (``Transport.caps.completion``,
:class:`~optcc_mpi.transports.Completion`):

``"any"`` (MPI)
    ``Waitsome`` names whatever completed.
``"ordered"`` (gloo)
    A completion is seen only by waiting for that request, so the executor always waits
    for the outstanding operation of lowest *level* (:func:`levels`). Every operation
    below that level has completed on this rank, hence on every rank the partners of the
    lowest outstanding operations anywhere have been posted: the wait ends, whatever the
    schedule, if the verifier accepts it. A message that arrived while the loop waited
    for another would be timed when the loop reached it; where its arrival time matters
    (``stamp_from``: the watch's messages), a helper thread waits for it from its
    posting on and notes when it arrived (:class:`_Helpers`).
``"grouped"`` (NCCL)
    The host waits for nothing: the operations of each level are posted as one group,
    local work follows on the device stream, and the stream orders everything after it.

With arrays on a device and a transport that does not order itself after the current
stream (MPI), the stream is synchronised before every library call; where the library
cannot take device memory, messages are staged through host copies.

An optional *pacer* (:mod:`optcc_mpi.emulation`) delays posting sends and completing
receives so each rank behaves like a NIC of a given rate and latency.

Cost per message
----------------
Everything that depends only on the schedule and this rank (operation kinds, peers, tags,
byte offsets, dependency counts, the operations ready at the start) is computed once and
cached on the schedule (:class:`_Flat`), so a call only copies two small lists before the
loop starts. The loop creates one slice per message and keeps received-then-reduced data in
a pool of temporary buffers reused across calls (a fresh large allocation costs page faults
on first touch). Completed requests are removed by swapping with the last one, without
rebuilding the lists.

Out of place
------------
Given a separate, read-only *source* (``execute(..., source=sendbuf)``), buffer 0 starts
empty instead of holding the input: an operation whose reads of buffer 0 precede every
write of those elements (in dependency order) reads the source instead, so out of place
costs no extra pass over memory (:class:`_Sourcing`, built once per rank's lists). A send of such a
range sends from the source; a receive-and-reduce into it receives straight into its
target (no temporary) and then computes ``target = op(source, target)``, a local reduction
``target = op(source, operand)`` (:meth:`~optcc_mpi.arrays.ArrayOps.reduce_into`: the same
operands in the same order, so the bits of the in-place call). A target read partly before
its first write is reduced piece by piece; only a send's or a copy's range read partly
before and partly after its first write, and the ranges of the library's own AllReduce
(``COLL``, in place by nature), are copied up front. Elements no operation writes are
copied at the end.

Every call records, per message, ``(op, peer, bytes, posted, completed)`` in
:attr:`ExecStats.sends` and :attr:`ExecStats.recvs` (times in seconds from the start of
the call, on ``time.perf_counter``): one tuple append per message, cheap enough to be
always on. :mod:`optcc_mpi.lab.bench` turns these into link utilisation (``--trace``).
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as _FutureTimeout
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar, cast

import numpy as np

from optcc_mpi import transports
from optcc_mpi.arrays import Array, ArrayOps
from optcc_mpi.emulation import Pacer
from optcc_mpi.errors import ArgumentError, ExecutionError
from optcc_mpi.schedule import COLL, COPY, RECV, RECV_REDUCE, REDUCE, SEND, Schedule
from optcc_mpi.transports.base import Completion, LevelClock, Post, Req, Transport

__all__ = ["ExecStats", "DeviceTimes", "Message", "TraceEvent", "execute", "levels", "TAG_BASE"]

#: Tags of our messages are TAG_BASE + channel, on a communicator of our own.
TAG_BASE = 1000
#: The index of the source (the send buffer of a call out of place) among a run's buffers:
#: after buffer 0 (the result) and buffer 1 (the schedule's scratch).
SOURCE = 2
#: ``rbuf`` of a reduction whose target is read from the source in some pieces only.
PIECES = -1


class Message(NamedTuple):
    """One message a rank sent or received (:attr:`ExecStats.sends`, ``recvs``)."""

    #: The operation's index in the schedule.
    op: int
    #: The other rank.
    peer: int
    #: Bytes moved.
    nbytes: int
    #: When it was handed to the library (seconds since :attr:`ExecStats.start`).
    posted: float
    #: When the library reported it done.
    completed: float


class TraceEvent(NamedTuple):
    """One operation's times, when tracing (:attr:`ExecStats.trace`)."""

    #: The operation's index in the schedule.
    op: int
    #: Its kind (:data:`optcc_mpi.schedule.SEND`, ...).
    kind: int
    #: When it was posted (seconds since the start of the call).
    posted: float
    #: When it completed.
    completed: float


@dataclass
class ExecStats:
    """What one rank did while executing a schedule.

    ``sends`` and ``recvs`` hold one :class:`Message` ``(op, peer, nbytes, posted,
    completed)`` per message, in completion order; times are seconds since ``start`` (a
    ``time.perf_counter()`` value, so on one host the records of all ranks share a
    clock). ``posted`` is when the send or receive was handed to the library (for a paced
    send, when the virtual NIC released it), ``completed`` when the library reported it
    done (for a receive, before any pacing delay of its completion; on a transport that
    reports completions only when asked, when the executor asked).
    """

    seconds: float = 0.0
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    max_in_flight: int = 0
    start: float = 0.0
    sends: list[Message] = field(default_factory=list)
    recvs: list[Message] = field(default_factory=list)
    trace: list[TraceEvent] = field(default_factory=list)
    """With tracing: one :class:`TraceEvent` per operation, times relative to the start."""
    device: DeviceTimes | None = None
    """The grouped driver's marks on the device (:class:`DeviceTimes`), until
    :meth:`settle` has turned them into the messages' times."""

    def settle(self) -> bool:
        """Whether :attr:`sends` and :attr:`recvs` hold times. Where the grouped driver
        left marks on the device (:attr:`device`) and the device has passed them all, the
        messages take their level's times from them now: a receive from its level's start
        to its end, a send from the call's start (a message's two ends then never compare
        two devices' clocks). False while the device has not got there: nothing waits."""
        dev = self.device
        if dev is None:
            return True
        clock = dev.clock
        if not clock.reached([dev.first, *(m for pair in dev.levels for m in pair)]):
            return False
        at = [(clock.seconds(dev.first, a), clock.seconds(dev.first, b)) for a, b in dev.levels]
        self.sends = [
            m._replace(posted=0.0, completed=at[dev.level_of[m.op]][1]) for m in self.sends
        ]
        self.recvs = [
            m._replace(posted=at[dev.level_of[m.op]][0], completed=at[dev.level_of[m.op]][1])
            for m in self.recvs
        ]
        self.device = None
        return True


@dataclass
class DeviceTimes:
    """Where the grouped driver's levels ran on the device, as :meth:`ExecStats.settle`
    reads them: the clock, the mark at the call's start, each posted level's marks
    (start, end), and per operation (this rank's index) the level it was posted in."""

    clock: LevelClock
    first: object
    levels: list[tuple[object, object]]
    level_of: dict[int, int]


# -- levels -------------------------------------------------------------------------------------
def levels(schedule: Schedule) -> np.ndarray:
    """Each operation's *level*: the round in which it completes when every rank posts
    each operation as soon as it may and a message completes one round after both its
    ends were posted (the verifier's rules, in lock step). Cached on the schedule.

    A message's two ends share a level, as do the k-th ``COLL`` of every rank; every
    operation's level exceeds its dependencies'. So waiting always for the lowest level
    outstanding, or posting level by level, cannot deadlock (module docstring).
    """
    cached = schedule.__dict__.get("_levels")
    if cached is not None:
        return cached
    n = schedule.n_ops
    kind = schedule.kind.tolist()
    partner = schedule.partner.tolist()
    qprev = schedule.queue_prev.tolist()
    waiting = np.diff(schedule.dep_ptr).tolist()
    dependents: list[list[int]] = [[] for _ in range(n)]
    for op, d in zip(
        np.repeat(np.arange(n), np.diff(schedule.dep_ptr)).tolist(), schedule.dep_idx.tolist()
    ):
        dependents[d].append(op)
    qnext = [-1] * n
    for i, j in enumerate(qprev):
        if j >= 0:
            qnext[j] = i
    # The k-th COLL of every rank meet: group them.
    colls: dict[int, list[int]] = {}
    seen: dict[int, int] = {}
    for op in np.flatnonzero(schedule.kind == COLL).tolist():
        r = int(schedule.rank[op])
        k = seen.get(r, 0)
        seen[r] = k + 1
        colls.setdefault(k, []).append(op)
    coll_of = {op: k for k, ops in colls.items() for op in ops}
    ready_at = [0] * n  # the round its dependencies completed by
    posted_at = [-1] * n
    level = [-1] * n
    work = deque(op for op in range(n) if waiting[op] == 0 and qprev[op] < 0)
    while work:
        op = work.popleft()
        if posted_at[op] >= 0:
            continue
        q = qprev[op]
        posted_at[op] = max(ready_at[op], posted_at[q] if q >= 0 else 0)
        nxt = qnext[op]
        if nxt >= 0 and waiting[nxt] == 0:
            work.append(nxt)
        k = kind[op]
        if k == COPY or k == REDUCE:
            done = [op]
            at = posted_at[op] + 1
        elif k == COLL:
            group = colls[coll_of[op]]
            if any(posted_at[g] < 0 for g in group):
                continue
            done = group
            at = max(posted_at[g] for g in group) + 1
        else:
            other = partner[op]
            if posted_at[other] < 0:
                continue
            done = [op, other]
            at = max(posted_at[op], posted_at[other]) + 1
        for d in done:
            level[d] = at
            for x in dependents[d]:
                ready_at[x] = max(ready_at[x], at)
                waiting[x] -= 1
                if waiting[x] == 0 and (qprev[x] < 0 or posted_at[qprev[x]] >= 0):
                    work.append(x)
    out = np.asarray(level, dtype=np.int64)
    if n and out.min() < 0:
        raise ExecutionError(f"{schedule.name}: deadlocks (the verifier would reject it)")
    schedule.__dict__["_levels"] = out
    return out


class _Flat:
    """One rank's program as flat per-operation lists for the executor's loop.

    Built once per (schedule, rank, itemsize) and cached on the schedule; the loop only
    indexes these lists.
    """

    __slots__ = (
        "n",
        "kind",
        "peer",
        "tag",
        "buf",
        "lo",
        "hi",
        "sbuf",
        "slo",
        "blo",
        "bhi",
        "nbytes",
        "waiting",
        "ready",
        "dependents",
        "qprev",
        "qnext",
        "temp_pool",
        "level",
        "rounds",
        "count",
        "sourcing",
    )

    def __init__(self, schedule: Schedule, rank: int, itemsize: int) -> None:
        prog = schedule.program(rank)
        self.count = schedule.count
        #: How the program reads a separate send buffer (made on the first call out of
        #: place, :meth:`sourced`).
        self.sourcing: _Sourcing | None = None
        ops = prog.ops
        self.n = len(ops)
        cols = list(zip(*ops)) if ops else [()] * 8
        self.kind, self.peer, chan, self.buf, self.lo, self.hi, self.sbuf, self.slo = (
            list(c) for c in cols
        )
        self.tag = [TAG_BASE + c for c in chan]
        self.blo = [lo * itemsize for lo in self.lo]
        self.bhi = [hi * itemsize for hi in self.hi]
        self.nbytes = [(h - lo) * itemsize for lo, h in zip(self.lo, self.hi)]
        self.waiting = [len(d) for d in prog.deps]
        self.qprev, self.qnext = prog.qprev, prog.qnext
        self.dependents = prog.dependents
        self.ready = [i for i in range(self.n) if self.waiting[i] == 0 and self.qprev[i] < 0]
        #: Free temporary receive buffers by (array library, dtype, elements), reused by calls.
        self.temp_pool: dict[tuple[str, str], dict[int, list[Array]]] = {}
        #: Levels of this rank's operations and the operations of each level, in an order
        #: both ends of every pair agree on: made on first use by a transport that needs
        #: them (completions ORDERED or GROUPED).
        self.level: list[int] | None = None
        self.rounds: list[list[int]] | None = None

    def leveled(self, schedule: Schedule, rank: int) -> tuple[list[int], list[list[int]]]:
        """:attr:`level` and :attr:`rounds`, made on first use."""
        level, rounds = self.level, self.rounds
        if level is None or rounds is None:
            level = levels(schedule)[schedule.op_ids(rank)].tolist()
            by: dict[int, list[int]] = {}
            for i, lv in enumerate(level):
                by.setdefault(lv, []).append(i)
            # Within a level, messages between two ranks are posted in (channel, position
            # in queue) order on both ends: libraries without tags (NCCL) match them by
            # order.
            rounds = [by[lv] for lv in sorted(by)]
            self.level, self.rounds = level, rounds
        return level, rounds

    def sourced(self) -> _Sourcing:
        """This program's reads of a separate send buffer (:class:`_Sourcing`), cached."""
        if self.sourcing is None:
            self.sourcing = _Sourcing(self)
        return self.sourcing


class _Sourcing:
    """Where one rank's program reads buffer 0's initial contents from when they live in a
    separate, read-only source (the module docstring's "Out of place").

    Every element has a *first writer*: of the operations that write it, the first in
    dependency order. The verifier rejects a program with two operations that touch an
    element, one writing, and no dependency path between them, so every operation that
    reads an element is ordered against its first writer: it reads the input if it comes
    no later than that writer (the writer itself reads its own target when it reduces
    into it), the written value otherwise. With every operation numbered in a topological
    order, that is a comparison of two numbers per element, done per range of elements
    that no operation's bounds split.

    Attributes
    ----------
    rbuf : list of int
        Per operation, the buffer its data comes from: a send's range, or a
        receive-and-reduce's or local reduction's target as first operand (:data:`SOURCE`
        when it is the input, the operation's own buffer otherwise, :data:`PIECES` for a
        target partly written already).
    sbuf : list of int
        Per operation, the buffer of a local copy's or reduction's source operand.
    pieces : dict
        For each operation with ``rbuf`` :data:`PIECES`: ``(lo, hi, from source)`` per
        piece of its target, in order.
    pre, post : list of (lo, hi)
        Element ranges copied from the source before the program runs (a send's or a
        copy's read partly before and partly after the first write, or a ``COLL``'s) and
        after it (never written).
    """

    __slots__ = ("rbuf", "sbuf", "pieces", "pre", "post")

    def __init__(self, flat: _Flat) -> None:
        n, count = flat.n, flat.count
        self.rbuf = list(flat.buf)
        self.sbuf = list(flat.sbuf)
        self.pieces: dict[int, list[tuple[int, int, bool]]] = {}
        if n == 0:
            self.pre: list[tuple[int, int]] = []
            self.post = [(0, count)] if count else []
            return
        pos = np.asarray(_topological(flat), dtype=np.int64)
        kind = np.asarray(flat.kind, dtype=np.int64)
        buf = np.asarray(flat.buf, dtype=np.int64)
        lo = np.asarray(flat.lo, dtype=np.int64)
        hi = np.asarray(flat.hi, dtype=np.int64)
        sbuf = np.asarray(flat.sbuf, dtype=np.int64)
        slo = np.asarray(flat.slo, dtype=np.int64)
        on0 = buf == 0
        writes = np.flatnonzero(on0 & (kind != SEND))
        # Reads of buffer 0: a send's range, a reduction's target (COLL included), a local
        # copy's or reduction's source operand.
        data = np.flatnonzero(on0 & ((kind == SEND) | (kind == RECV_REDUCE) | (kind == REDUCE)))
        colls = np.flatnonzero(on0 & (kind == COLL))
        operands = np.flatnonzero((sbuf == 0) & ((kind == COPY) | (kind == REDUCE)))
        r_op = np.concatenate([data, colls, operands])
        r_lo = np.concatenate([lo[data], lo[colls], slo[operands]])
        r_hi = r_lo + np.concatenate([(hi - lo)[data], (hi - lo)[colls], (hi - lo)[operands]])
        # Elementary ranges: between consecutive bounds of any access (and 0, count).
        bounds = np.unique(np.concatenate([[0, count], lo[writes], hi[writes], r_lo, r_hi]))
        nseg = bounds.size - 1
        # first[s]: the topological number of the first writer of range s (n: none); one
        # sentinel more, for the reductions over ranges below.
        first = np.full(nseg + 1, n, dtype=np.int64)
        w_a = np.searchsorted(bounds, lo[writes])
        w_n = np.searchsorted(bounds, hi[writes]) - w_a
        starts = np.repeat(w_a - np.cumsum(w_n) + w_n, w_n) + np.arange(int(w_n.sum()))
        np.minimum.at(first, starts, np.repeat(pos[writes], w_n))
        a = np.searchsorted(bounds, r_lo)
        b = np.searchsorted(bounds, r_hi)
        pairs = np.stack([a, b], axis=1).ravel()
        least = np.minimum.reduceat(first, pairs)[::2]
        most = np.maximum.reduceat(first, pairs)[::2]
        mine = pos[r_op]
        fresh = least >= mine  # every element read before its first write
        stale = most < mine  # every element read after its first write
        copied = np.zeros(nseg, dtype=bool)
        n_data, n_colls = data.size, colls.size
        for j in np.flatnonzero(~stale).tolist():
            i = int(r_op[j])
            is_coll = n_data <= j < n_data + n_colls
            if fresh[j] and not is_coll:
                if j < n_data:
                    self.rbuf[i] = SOURCE
                else:
                    self.sbuf[i] = SOURCE
                continue
            seg = np.arange(a[j], b[j])
            early = first[seg] >= mine[j]
            if j < n_data and flat.kind[i] != SEND:
                # A reduction whose target is partly written already: reduced piece by
                # piece, each from where its first operand lives.
                edges = np.flatnonzero(np.diff(early.astype(np.int8))) + 1
                cuts = [0, *edges.tolist(), seg.size]
                self.rbuf[i] = PIECES
                self.pieces[i] = [
                    (int(bounds[seg[x]]), int(bounds[seg[y - 1] + 1]), bool(early[x]))
                    for x, y in zip(cuts, cuts[1:])
                ]
                continue
            # A send or a copy's operand read partly before the first write, or a COLL:
            # copy the ranges read early up front.
            copied[seg[early]] = True
        self.pre = _ranges(bounds, copied)
        self.post = _ranges(bounds, (first[:nseg] == n) & ~copied)


def _topological(flat: _Flat) -> list[int]:
    """Each operation's number in one topological order of the dependencies."""
    waiting = flat.waiting.copy()
    todo = deque(i for i in range(flat.n) if waiting[i] == 0)
    pos = [-1] * flat.n
    k = 0
    while todo:
        i = todo.popleft()
        pos[i] = k
        k += 1
        for d in flat.dependents[i]:
            waiting[d] -= 1
            if waiting[d] == 0:
                todo.append(d)
    if k != flat.n:  # pragma: no cover - the builder rejects cycles
        raise ExecutionError("the program's dependencies have a cycle")
    return pos


def _ranges(bounds: np.ndarray, mask: np.ndarray) -> list[tuple[int, int]]:
    """The element ranges of the elementary ranges ``mask`` selects, adjacent ones merged."""
    if not mask.any():
        return []
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    starts, stops = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [(int(bounds[x]), int(bounds[y])) for x, y in zip(starts, stops)]


def _flattened(schedule: Schedule, rank: int, itemsize: int) -> _Flat:
    cache = schedule.__dict__.setdefault("_exec_plans", {})
    key = (rank, itemsize)
    flat = cache.get(key)
    if flat is None:
        flat = cache[key] = _Flat(schedule, rank, itemsize)
    return flat


def execute(
    schedule: Schedule,
    buf: Array,
    *,
    comm: transports.Communicator = None,
    op: str,
    arrays: ArrayOps,
    staging: bool | None = None,
    pacer: Pacer | None = None,
    trace: bool = False,
    source: Array | None = None,
    stamp_from: int = 0,
) -> ExecStats:
    """Execute this rank's program of ``schedule`` on ``buf``.

    Parameters
    ----------
    schedule : Schedule
        Built for the communicator's size and ``buf.size`` elements.
    buf : array
        1-D contiguous array of ``arrays``' library holding this rank's input (unless
        ``source`` is given); holds the result on return.
    comm : Transport, mpi4py communicator or torch.distributed process group
        Where the messages travel (:func:`optcc_mpi.transports.of`: on a communicator,
        its private duplicate).
    op : str
        The reduction, one of :data:`optcc_mpi.dtypes.OPS` (ten reductions; ``max`` and
        ``min`` on floats are expected on the keys, :mod:`optcc_mpi.reductions`).
    arrays : ArrayOps
        The operations of ``buf``'s array library.
    staging : bool, optional
        Stage device buffers through host memory; default: the transport's answer.
    pacer : optional
        Link emulation (:class:`optcc_mpi.emulation.Pacer`).
    trace : bool
        Record per-operation times in ``ExecStats.trace`` (the per-message records in
        ``sends``/``recvs`` are always kept).
    source : array, optional
        This rank's input, when it is not in ``buf``: an array of ``buf``'s library, of its
        type and size, that is only read and must not overlap ``buf`` (the send buffer of
        a call out of place). ``buf``'s contents on entry are then ignored; the result
        is the same, bit for bit, as with ``buf`` holding the input (module docstring).
    stamp_from : int
        Where completions are seen only in order (gloo), receives of at least this many
        bytes (0: none) are timed at their arrival rather than when the loop reaches
        them: each is waited for by a helper thread from its posting on (the watch's
        messages, :mod:`optcc_mpi.watch`: a healthy message queued behind a slow one
        would otherwise look slow). Elsewhere every completion is seen when it happens.
    """
    transport = comm if isinstance(comm, Transport) else transports.of(comm)
    flat = _flattened(schedule, transport.rank, buf.dtype.itemsize)
    stats = ExecStats()
    if source is buf:
        source = None
    if flat.n == 0:
        if source is not None:
            arrays.copyto(buf, source)
        return stats
    grouped = transport.caps.completion is Completion.GROUPED
    if pacer is not None and grouped:
        raise ArgumentError(f"a {transport.name} transport cannot be paced (emulation)")
    if staging is None:
        staging = transport.staging(arrays)
    sourcing = flat.sourced() if source is not None else None
    run = _Run(schedule, flat, buf, transport, op, arrays, staging, pacer, trace, stats)
    if stamp_from > 0 and transport.caps.completion is Completion.ORDERED:
        run.stamp_from = stamp_from
    if sourcing is not None:
        run.read_from(source, sourcing)
    if grouped:
        run.grouped()
    else:
        run.loop()
    return stats


class _Run(Generic[Req]):
    """One execution: the state the loop shares (a class, so that each step is a method
    of a few lines rather than one function of several hundred). Generic in the
    transport's request type."""

    def __init__(
        self,
        schedule: Schedule,
        flat: _Flat,
        buf: Array,
        transport: Transport[Req],
        op: str,
        arrays: ArrayOps,
        staging: bool,
        pacer: Pacer | None,
        trace: bool,
        stats: ExecStats,
    ) -> None:
        self.schedule, self.flat, self.t, self.op = schedule, flat, transport, op
        self.arrays, self.staging, self.pacer, self.tracing = arrays, staging, pacer, trace
        self.stats = stats
        n = flat.n
        self.dtype = buf.dtype
        # Staged messages are NumPy arrays of NumPy's element type: staging is for device
        # arrays of NumPy's API (CuPy's), never for tensors.
        self.host_dtype = cast(np.dtype, buf.dtype)
        scratch = arrays.empty(schedule.scratch, buf.dtype) if schedule.scratch else None
        # Buffer 1 is None where the schedule has no scratch: then no operation names it
        # (the builder checks every range against its buffer's size).
        self.buffers = [buf, cast(Array, scratch)]
        self.sync = arrays.device and transport.caps.sync_device
        # Byte views of the buffers, made once per call: a message is one slice of these.
        # (A device buffer bound for MPI is viewed only after synchronising, per message.)
        self.raw = None if staging or self.sync else [self.bytes_of(b) for b in self.buffers]
        # Per operation, where its data and its source operand come from (out of place:
        # read_from).
        self.rbuf, self.sbuf = flat.buf, flat.sbuf
        self.pieces: dict[int, list[tuple[int, int, bool]]] = {}
        self.unwritten: list[tuple[int, int]] = []
        self.pool = flat.temp_pool.setdefault(
            (arrays.name, getattr(buf.dtype, "str", str(buf.dtype))), {}
        )
        self.waiting = flat.waiting.copy()
        self.posted = [False] * n
        self.ready: deque[int] = deque(flat.ready)
        self.reqs: list[Req] = []
        self.req_op: list[int] = []  # op index of each request in reqs
        self.temps: dict[int, Array] = {}  # op -> temporary receive buffer (RECV_REDUCE)
        self.hosts: dict[int, np.ndarray] = {}  # op -> host staging copy
        self.level: list[int] = []  # each op's level, where completions are ORDERED
        self.timers: list[tuple[float, int, int, int]] = []  # (when, seq, action, op)
        self.seq = 0
        self.completed = 0
        self.post_time = [0.0] * n
        #: Receives of at least this many bytes are waited for by helpers (0: none), the
        #: futures of those waits by op, and their arrival times once the loop saw them.
        self.stamp_from = 0
        self.helping: dict[int, Future[float]] = {}
        self.arrival: dict[int, float] = {}
        self.t0 = stats.start = time.perf_counter()

    def bytes_of(self, arr: Array) -> Array:
        return None if arr is None else self.t.message(self.arrays, arr)

    def read_from(self, source: Array, sourcing: _Sourcing) -> None:
        """Read buffer 0's initial contents from ``source`` (module docstring): the ranges
        to copy up front are copied now, those never written when the program ends."""
        self.buffers.append(source)
        if self.raw is not None:
            self.raw.append(self.bytes_of(source))
        self.rbuf, self.sbuf, self.pieces = sourcing.rbuf, sourcing.sbuf, sourcing.pieces
        buf = self.buffers[0]
        for lo, hi in sourcing.pre:
            self.arrays.copyto(buf[lo:hi], source[lo:hi])
        self.unwritten = sourcing.post

    def copy_unwritten(self) -> None:
        """The elements no operation wrote, from the source (nothing in place)."""
        buf, source = self.buffers[0], self.buffers[-1]
        for lo, hi in self.unwritten:
            self.arrays.copyto(buf[lo:hi], source[lo:hi])

    # -- bookkeeping ----------------------------------------------------------------------
    def finish(self, i: int, at: float | None = None) -> None:
        """Op ``i`` completed (``at``: when its message arrived, if known): its
        dependents may become ready."""
        self.completed += 1
        if self.tracing:
            now = (time.perf_counter() if at is None else at) - self.t0
            self.stats.trace.append(
                TraceEvent(i, self.flat.kind[i], self.post_time[i] - self.t0, now)
            )
        waiting, qprev, posted, ready = self.waiting, self.flat.qprev, self.posted, self.ready
        for d in self.flat.dependents[i]:
            waiting[d] -= 1
            if waiting[d] == 0 and (qprev[d] < 0 or posted[qprev[d]]):
                ready.append(d)

    def slice(self, i: int) -> Array:
        flat = self.flat
        return self.buffers[flat.buf[i]][flat.lo[i] : flat.hi[i]]

    def data(self, i: int) -> Array:
        """What the transport moves for op ``i``, in place in its buffer."""
        if self.raw is not None:
            return self.raw[self.flat.buf[i]][self.flat.blo[i] : self.flat.bhi[i]]
        return self.t.message(self.arrays, self.slice(i))

    def sent(self, i: int) -> Array:
        """The range send ``i`` reads: in its buffer, or in the source."""
        flat = self.flat
        return self.buffers[self.rbuf[i]][flat.lo[i] : flat.hi[i]]

    def take_temp(self, m: int) -> Array:
        free = self.pool.get(m)
        return free.pop() if free else self.arrays.empty(m, self.dtype)

    def track(self, i: int, req: Req) -> None:
        self.post_time[i] = time.perf_counter()
        self.reqs.append(req)
        self.req_op.append(i)
        if self.stamp_from:
            flat = self.flat
            kind = flat.kind[i]
            if (kind == RECV or kind == RECV_REDUCE) and flat.nbytes[i] >= self.stamp_from:
                self.helping[i] = _helpers().wait(self.t.wait, req)

    # -- posting --------------------------------------------------------------------------
    def send_message(self, i: int) -> Array:
        if self.sync:
            self.arrays.synchronize()
        if self.staging:
            host = self.hosts[i] = self.arrays.to_host(self.sent(i))
            return host.view(np.uint8)
        if self.raw is not None:
            flat = self.flat
            return self.raw[self.rbuf[i]][flat.blo[i] : flat.bhi[i]]
        return self.t.message(self.arrays, self.sent(i))

    def recv_message(self, i: int) -> Array:
        flat = self.flat
        if self.sync:
            self.arrays.synchronize()
        if self.staging:
            host = self.hosts[i] = np.empty(flat.hi[i] - flat.lo[i], dtype=self.host_dtype)
            return host.view(np.uint8)
        if flat.kind[i] == RECV or self.rbuf[i] == SOURCE:
            return self.data(i)  # (the latter: its target's first write, from the input)
        temp = self.temps[i] = self.take_temp(flat.hi[i] - flat.lo[i])
        return self.t.message(self.arrays, temp)

    def start_send(self, i: int) -> None:
        self.track(i, self.t.isend(self.send_message(i), self.flat.peer[i], self.flat.tag[i]))

    def local(self, i: int) -> None:
        """A local copy or reduction, done at once."""
        flat = self.flat
        self.post_time[i] = time.perf_counter()
        lo, hi, slo = flat.lo[i], flat.hi[i], flat.slo[i]
        dst = self.buffers[flat.buf[i]][lo:hi]
        src = self.buffers[self.sbuf[i]][slo : slo + (hi - lo)]
        if flat.kind[i] == COPY:
            self.arrays.copyto(dst, src)
        else:
            self.reduce_into_target(i, dst, src)

    def start_coll(self, i: int) -> None:
        target = self.slice(i)
        if self.sync:
            self.arrays.synchronize()
        data = target
        if self.staging:
            data = self.hosts[i] = self.arrays.to_host(target)
        name = cast(str, self.arrays.dtype_name(target))  # checked by the collectives
        self.track(i, self.t.allreduce(self.arrays, data, name, self.op))

    def post(self, i: int) -> None:
        flat = self.flat
        self.posted[i] = True
        j = flat.qnext[i]
        if j >= 0 and self.waiting[j] == 0:
            self.ready.append(j)
        kind = flat.kind[i]
        if kind == SEND:
            if self.pacer is not None:
                now = time.perf_counter()
                when = self.pacer.send_release(now, flat.nbytes[i], flat.peer[i])
                if when > now:
                    self.defer(i, when, _ACT_SEND)
                    return
            self.start_send(i)
        elif kind == RECV or kind == RECV_REDUCE:
            self.track(i, self.t.irecv(self.recv_message(i), flat.peer[i], flat.tag[i]))
        elif kind == COPY or kind == REDUCE:
            self.local(i)
            self.finish(i)
        elif kind == COLL:
            self.start_coll(i)
        else:  # pragma: no cover - the builder rejects unknown kinds
            raise ArgumentError(f"unknown operation kind {kind}")

    def defer(self, i: int, when: float, action: int) -> None:
        heapq.heappush(self.timers, (when, self.seq, action, i))
        self.seq += 1

    # -- completions ----------------------------------------------------------------------
    def arrived(self, i: int, now: float) -> None:
        """The library completed op i's request: move data into place and finish it."""
        flat, stats = self.flat, self.stats
        kind = flat.kind[i]
        if kind == SEND:
            stats.sends.append(
                Message(i, flat.peer[i], flat.nbytes[i], self.post_time[i] - self.t0, now - self.t0)
            )
            stats.messages_sent += 1
            stats.bytes_sent += flat.nbytes[i]
            self.hosts.pop(i, None)
            self.finish(i)
            return
        if kind == COLL:
            host = self.hosts.pop(i, None)
            if host is not None:
                self.arrays.from_host(self.slice(i), host)
            if self.pacer is not None:
                when = self.pacer.coll_done(self.post_time[i], flat.nbytes[i])
                if when > time.perf_counter():
                    self.defer(i, when, _ACT_DONE)
                    return
            self.finish(i)
            return
        stats.recvs.append(
            Message(i, flat.peer[i], flat.nbytes[i], self.post_time[i] - self.t0, now - self.t0)
        )
        stats.messages_received += 1
        stats.bytes_received += flat.nbytes[i]
        self.land(i)
        if self.pacer is not None:
            when = self.pacer.recv_done(self.post_time[i], time.perf_counter(), flat.nbytes[i])
            if when > time.perf_counter():
                self.defer(i, when, _ACT_DONE)
                return
            self.finish(i)
            return
        self.finish(i, now)

    def land(self, i: int) -> None:
        """A received message into its place: copied (staged) or reduced."""
        arrays, flat = self.arrays, self.flat
        target = self.slice(i)
        m = flat.hi[i] - flat.lo[i]
        host = self.hosts.pop(i, None) if self.staging else None
        kind = flat.kind[i]
        if kind == RECV or self.rbuf[i] == SOURCE:
            if host is not None:
                arrays.from_host(target, host)
            if kind != RECV:
                # Received into its target, whose input is still in the source: the input
                # combined in as the first operand, as in place (no temporary either).
                source = self.buffers[SOURCE][flat.lo[i] : flat.hi[i]]
                arrays.reduce_into(self.op, target, source, target)
        elif host is not None:
            if arrays.device:
                temp = self.take_temp(m)
                arrays.from_host(temp, host)
                self.reduce_into_target(i, target, temp)
                self.pool.setdefault(m, []).append(temp)
            else:
                self.reduce_into_target(i, target, host)
        else:
            temp = self.temps.pop(i)
            self.reduce_into_target(i, target, temp)
            self.pool.setdefault(m, []).append(temp)

    def reduce_into_target(self, i: int, target: Array, got: Array) -> None:
        """``target op= got``, or where this is the target's first write ``target =
        op(input, got)`` straight from the source (out of place)."""
        b, flat, arrays = self.rbuf[i], self.flat, self.arrays
        if b == flat.buf[i]:
            arrays.reduce(self.op, target, got)
        elif b == SOURCE:
            arrays.reduce_into(self.op, target, self.buffers[b][flat.lo[i] : flat.hi[i]], got)
        else:
            lo, source = flat.lo[i], self.buffers[SOURCE]
            for a, z, early in self.pieces[i]:
                part, operand = target[a - lo : z - lo], got[a - lo : z - lo]
                if early:
                    arrays.reduce_into(self.op, part, source[a:z], operand)
                else:
                    arrays.reduce(self.op, part, operand)

    def remove(self, idx: list[int]) -> list[int]:
        """Drop completed requests by index (swapping in the last one); their ops."""
        reqs, req_op = self.reqs, self.req_op
        done: list[int] = []
        # Descending indices keep the swapped-in entries valid.
        for j in sorted(idx, reverse=True):
            done.append(req_op[j])
            last_req, last_op = reqs.pop(), req_op.pop()
            if j < len(reqs):
                reqs[j], req_op[j] = last_req, last_op
        done.reverse()
        return done

    def fire_timers(self) -> None:
        now = time.perf_counter()
        while self.timers and self.timers[0][0] <= now:
            _, _, action, i = heapq.heappop(self.timers)
            if action == _ACT_SEND:
                self.start_send(i)
            else:
                self.finish(i)

    # -- the drivers ----------------------------------------------------------------------
    def loop(self) -> None:
        """Post what is ready, then see completions as the transport allows."""
        n, stats = self.flat.n, self.stats
        ordered = self.t.caps.completion is Completion.ORDERED
        if ordered:
            self.level = self.flat.leveled(self.schedule, self.t.rank)[0]
        while self.completed < n:
            while self.ready:
                self.post(self.ready.popleft())
            if self.timers:
                self.fire_timers()
                if self.ready:
                    continue
            if self.completed >= n:
                break
            if len(self.reqs) > stats.max_in_flight:
                stats.max_in_flight = len(self.reqs)
            if not self.reqs and not self.timers:
                raise ExecutionError(
                    f"rank {self.t.rank}: {self.schedule.name} stalled with "
                    f"{n - self.completed} operations left (the schedule should have "
                    "failed verification)"
                )
            done = self.wait_ordered() if ordered else self.wait_any()
            now = time.perf_counter()
            arrival = self.arrival
            for i in done:
                self.arrived(i, arrival.pop(i, now) if arrival else now)
        if self.unwritten:
            self.copy_unwritten()
        if self.arrays.device and self.sync:
            self.arrays.synchronize()
        stats.seconds = time.perf_counter() - self.t0

    def wait_any(self) -> list[int]:
        """``Waitsome``, or with timers pending a poll and a short sleep."""
        if not self.reqs:
            time.sleep(max(0.0, self.timers[0][0] - time.perf_counter()))
            return []
        if self.timers:
            # Poll so that timers fire on time; sleep a little between polls so that
            # oversubscribed ranks leave the CPU to the others.
            idx = self.t.testsome(self.reqs)
            if not idx:
                delay = self.timers[0][0] - time.perf_counter()
                if delay > 0:
                    time.sleep(min(delay, 50e-6))
                return []
        else:
            idx = self.t.waitsome(self.reqs)
            if not idx:  # pragma: no cover - only inactive requests would return none
                return []
        return self.remove(idx)

    def wait_ordered(self) -> list[int]:
        """The lowest-level request, waited for; with timers pending (a pacer), waited for
        only until the next timer is due.

        A request of this transport reports its completion only when waited for, and a
        wait cannot be cut short, so while timers are pending (a paced send, a deferred
        completion) the wait runs on a helper thread (:class:`_Helpers`) and the loop waits
        for that thread until the earliest timer: timers fire on time, and a message
        that completed is seen when it completes, not after a sleep (a message from a
        fast rank timed at the pace of this rank's slow send would make a fast link look
        slow). Without timers the request is waited for here (the helper's hand-off costs
        tens of microseconds), unless a helper already waits for it (``stamp_from``:
        it has the arrival time). Either way the request waited for is the outstanding one of
        lowest level, which cannot deadlock (module docstring), and no wait outlasts a
        timer, so every timer fires."""
        level = self.level
        # The lowest level; among equals the first in program order: within a queue
        # messages complete in posting order, so waiting for a later one first would
        # leave an earlier one's completion (and what it frees) unseen meanwhile.
        best, j_best = None, -1
        for j, i in enumerate(self.req_op):
            key = (level[i], i)
            if best is None or key < best:
                best, j_best = key, j
        helping = self.helping  # op -> its helper's wait (the arrival time)
        if self.timers:
            due = self.timers[0][0]  # a heap: the earliest timer
            if j_best < 0:
                time.sleep(max(0.0, due - time.perf_counter()))
                return []
            i = self.req_op[j_best]
            fut = helping.get(i)
            if fut is None:
                fut = helping[i] = _helpers().wait(self.t.wait, self.reqs[j_best])
            try:
                self.arrival[i] = fut.result(timeout=max(0.0, due - time.perf_counter()))
            except _FutureTimeout:
                return []
            del helping[i]
            return self.remove([j_best])
        i = self.req_op[j_best]
        fut = helping.pop(i, None)
        if fut is not None:
            # (handed to a helper: never wait twice for one request)
            self.arrival[i] = fut.result()
        else:
            self.t.wait(self.reqs[j_best])
        return self.remove([j_best])

    def grouped(self) -> None:
        """Level by level: each level's messages posted as one group, then the local work
        of that level, ordered after them by the device stream; nothing waits on the host
        (module docstring). The reductions of received data follow their group.

        The host does not see when a message arrives, so per-message times are recorded
        by the host only when tracing (the probe, the doctor), which waits for every level
        on the host and is slower for it. Otherwise, where the transport has a clock on
        the device (:meth:`~optcc_mpi.transports.base.Transport.level_clock`: NCCL's CUDA
        events), each level is marked there before and after its group, and the messages
        take their times from the marks once the device has passed them
        (:meth:`ExecStats.settle`, read by the watch at the next call); else only the
        counts are kept."""
        flat, stats, arrays = self.flat, self.stats, self.arrays
        _, rounds = flat.leveled(self.schedule, self.t.rank)
        kinds = flat.kind
        clock = None if self.tracing else self.t.level_clock(arrays)
        dev = DeviceTimes(clock, clock.mark(), [], {}) if clock is not None else None
        for ops in rounds:
            posts = []
            for i in ops:
                k = kinds[i]
                if k == SEND:
                    posts.append(Post(True, self.send_message(i), flat.peer[i], flat.tag[i]))
                elif k == RECV or k == RECV_REDUCE:
                    posts.append(Post(False, self.recv_message(i), flat.peer[i], flat.tag[i]))
            start = time.perf_counter()
            if posts:
                begun = dev.clock.mark() if dev is not None else None
                for req in self.t.batch(posts):
                    if req is not None:
                        self.t.wait(req)  # NCCL: the current stream waits, not the host
                if self.tracing:
                    arrays.synchronize()
                if dev is not None:
                    for i in ops:
                        dev.level_of[i] = len(dev.levels)
                    dev.levels.append((begun, dev.clock.mark()))
            now = time.perf_counter()
            for i in ops:
                self.post_time[i] = start
                k = kinds[i]
                if k == COPY or k == REDUCE:
                    self.local(i)
                    self.finish(i)
                    continue
                if k == COLL:
                    self.start_coll(i)
                    self.t.wait(self.reqs.pop())
                    self.req_op.pop()
                self.arrived(i, now)
            stats.max_in_flight = max(stats.max_in_flight, len(posts))
        if self.unwritten:
            self.copy_unwritten()
        if dev is not None:
            stats.device = dev  # (the times come from the device: ExecStats.settle)
        elif not self.tracing:
            # Times the host never saw are not measurements: keep the counts only.
            stats.sends.clear()
            stats.recvs.clear()
        stats.seconds = time.perf_counter() - self.t0


_ACT_SEND, _ACT_DONE = 0, 1
_R = TypeVar("_R")


class _Helpers:
    """Threads that wait for requests, each noting when its request completed
    (:meth:`_Run.wait_ordered`): where completions are seen only by waiting, in order,
    a message that arrived while the loop waited for another is timed at its arrival,
    and while timers are pending the loop keeps time for them. A request's wait
    releases the interpreter lock (gloo's does), so the loop runs while they block.

    A thread is made only when none is idle, with no bound: a request handed over is
    always being waited for (one queued behind blocked threads could be what they wait
    for), and the threads are as many as a call ever had in flight at once. Daemons: a
    call that failed leaves its helpers in their waits until the library ends them, and
    must not keep the interpreter from exiting meanwhile.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], Future[float]]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._idle = 0

    def wait(self, wait: Callable[[_R], None], req: _R) -> Future[float]:
        """Have a helper call ``wait(req)``; the future of the ``perf_counter`` time at
        which it returned (or of its error)."""
        fut: Future[float] = Future()
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        self._jobs.put((lambda: wait(req), fut))
        if spawn:
            threading.Thread(target=self._serve, name="optcc-wait", daemon=True).start()
        return fut

    def _serve(self) -> None:
        while True:
            job, fut = self._jobs.get()
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - the loop's result() raises it
                fut.set_exception(exc)
            else:
                fut.set_result(time.perf_counter())
            del job, fut  # (nothing of a finished call kept alive while idle)
            with self._lock:
                self._idle += 1


_HELPERS: list[_Helpers] = []


def _helpers() -> _Helpers:
    """This process's :class:`_Helpers` (made at first use)."""
    if not _HELPERS:
        _HELPERS.append(_Helpers())
    return _HELPERS[0]
