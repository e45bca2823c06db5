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

How completions are seen is the transport's (``Transport.observe``):

``"any"`` (MPI)
    ``Waitsome`` names whatever completed.
``"ordered"`` (gloo)
    A completion is seen only by waiting for that request, so the executor always waits
    for the outstanding operation of lowest *level* (:func:`levels`). Every operation
    below that level has completed on this rank, hence on every rank the partners of the
    lowest outstanding operations anywhere have been posted: the wait ends, whatever the
    schedule, if the verifier accepts it.
``"grouped"`` (NCCL)
    The host waits for nothing: the operations of each level are posted as one group,
    local work follows on the device stream, and the stream orders everything after it.

With a device backend and a transport that does not order itself after the current
stream (MPI), the stream is synchronised before every library call; where the library
cannot take device memory, messages are staged through host copies.

An optional *pacer* (:mod:`optcc_mpi.emulation`) delays posting sends and completing
receives so each rank behaves like a NIC of a given rate and latency.

Cost per message
----------------
Everything that depends only on the schedule and this rank (operation kinds, peers, tags,
byte offsets, dependency counts, the operations ready at the start) is computed once and
cached on the schedule (:class:`_Plan`), so a call only copies two small lists before the
loop starts. The loop creates one slice per message and keeps received-then-reduced data in
a pool of temporary buffers reused across calls (a fresh large allocation costs page faults
on first touch). Completed requests are removed by swapping with the last one, without
rebuilding the lists.

Every call records, per message, ``(op, peer, bytes, posted, completed)`` in
:attr:`ExecStats.sends` and :attr:`ExecStats.recvs` (times in seconds from the start of
the call, on ``time.perf_counter``): one tuple append per message, cheap enough to be
always on. :mod:`optcc_mpi.lab.bench` turns these into link utilisation (``--trace``).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as _FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optcc_mpi import transports
from optcc_mpi.backend import Backend
from optcc_mpi.schedule import COLL, COPY, RECV, RECV_REDUCE, REDUCE, SEND, Schedule
from optcc_mpi.transports.base import Transport

__all__ = ["ExecStats", "execute", "levels", "TAG_BASE"]

#: Tags of our messages are TAG_BASE + channel, on a communicator of our own.
TAG_BASE = 1000


@dataclass
class ExecStats:
    """What one rank did while executing a schedule.

    ``sends`` and ``recvs`` hold one tuple ``(op, peer, nbytes, posted, completed)`` per
    message, in completion order; times are seconds since ``start`` (a
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
    sends: list[tuple[int, int, int, float, float]] = field(default_factory=list)
    recvs: list[tuple[int, int, int, float, float]] = field(default_factory=list)
    trace: list[tuple[int, int, float, float]] = field(default_factory=list)
    """With tracing: (op index, kind, post time, completion time) relative to the start."""


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
        raise RuntimeError(f"{schedule.name}: deadlocks (the verifier would reject it)")
    schedule.__dict__["_levels"] = out
    return out


class _Plan:
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
    )

    def __init__(self, schedule: Schedule, rank: int, itemsize: int) -> None:
        prog = schedule.program(rank)
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
        #: Free temporary receive buffers by (backend, dtype, elements), reused by calls.
        self.temp_pool: dict[Any, dict[int, list[Any]]] = {}
        #: Levels of this rank's operations and the operations of each level, in an order
        #: both ends of every pair agree on: made on first use by a transport that needs
        #: them (``observe`` "ordered" or "grouped").
        self.level: list[int] | None = None
        self.rounds: list[list[int]] | None = None

    def leveled(self, schedule: Schedule, rank: int) -> None:
        if self.level is not None:
            return
        self.level = levels(schedule)[schedule.op_ids(rank)].tolist()
        by: dict[int, list[int]] = {}
        for i, lv in enumerate(self.level):
            by.setdefault(lv, []).append(i)
        # Within a level, messages between two ranks are posted in (channel, position in
        # queue) order on both ends: libraries without tags (NCCL) match them by order.
        self.rounds = [by[lv] for lv in sorted(by)]


def _plan(schedule: Schedule, rank: int, itemsize: int) -> _Plan:
    cache = schedule.__dict__.setdefault("_exec_plans", {})
    key = (rank, itemsize)
    plan = cache.get(key)
    if plan is None:
        plan = cache[key] = _Plan(schedule, rank, itemsize)
    return plan


def execute(
    schedule: Schedule,
    buf: Any,
    *,
    comm: Any = None,
    op: str,
    backend: Backend,
    staging: bool | None = None,
    pacer: Any = None,
    trace: bool = False,
) -> ExecStats:
    """Execute this rank's program of ``schedule`` on ``buf``.

    Parameters
    ----------
    schedule : Schedule
        Built for the communicator's size and ``buf.size`` elements.
    buf : array
        1-D contiguous array of ``backend`` holding this rank's input; holds the result
        on return.
    comm : Transport, mpi4py communicator or torch.distributed process group
        Where the messages travel (:func:`optcc_mpi.transports.of`: on a communicator,
        its private duplicate).
    op : str
        The reduction, one of :data:`optcc_mpi.dtypes.OPS` (ten reductions; ``max`` and
        ``min`` on floats are expected on the keys, :mod:`optcc_mpi.reductions`).
    backend : Backend
        Array backend of ``buf``.
    staging : bool, optional
        Stage device buffers through host memory; default: the transport's answer.
    pacer : optional
        Link emulation (:class:`optcc_mpi.emulation.Pacer`).
    trace : bool
        Record per-operation times in ``ExecStats.trace`` (the per-message records in
        ``sends``/``recvs`` are always kept).
    """
    transport = comm if isinstance(comm, Transport) else transports.of(comm)
    plan = _plan(schedule, transport.rank, buf.dtype.itemsize)
    stats = ExecStats()
    if plan.n == 0:
        return stats
    if staging is None:
        staging = transport.staging(backend)
    run = _Run(schedule, plan, buf, transport, op, backend, staging, pacer, trace, stats)
    if transport.observe == "grouped":
        if pacer is not None:
            raise ValueError(f"a {transport.name} transport cannot be paced (emulation)")
        run.grouped()
    else:
        run.loop()
    return stats


class _Run:
    """One execution: the state the loop shares (a class, so that each step is a method
    of a few lines rather than one function of several hundred)."""

    def __init__(
        self,
        schedule: Schedule,
        plan: _Plan,
        buf: Any,
        transport: Any,
        op: str,
        backend: Backend,
        staging: bool,
        pacer: Any,
        trace: bool,
        stats: ExecStats,
    ) -> None:
        self.schedule, self.plan, self.t, self.op = schedule, plan, transport, op
        self.backend, self.staging, self.pacer, self.tracing = backend, staging, pacer, trace
        self.stats = stats
        n = plan.n
        self.dtype = buf.dtype
        self.buffers = [buf]
        if schedule.scratch:
            self.buffers.append(backend.empty(schedule.scratch, buf.dtype))
        self.sync = backend.device and transport.sync_device
        # Byte views of the buffers, made once per call: a message is one slice of these.
        # (A device buffer bound for MPI is viewed only after synchronising, per message.)
        self.raw = (
            None if staging or self.sync else [transport.message(backend, b) for b in self.buffers]
        )
        self.pool = plan.temp_pool.setdefault(
            (backend.name, getattr(buf.dtype, "str", str(buf.dtype))), {}
        )
        self.waiting = plan.waiting.copy()
        self.posted = [False] * n
        self.ready: deque[int] = deque(plan.ready)
        self.reqs: list[Any] = []
        self.req_op: list[int] = []  # op index of each request in reqs
        self.temps: dict[int, Any] = {}  # op -> temporary receive buffer (RECV_REDUCE)
        self.hosts: dict[int, Any] = {}  # op -> host staging copy
        self.timers: list[tuple[float, int, int, int]] = []  # (when, seq, action, op)
        self.seq = 0
        self.completed = 0
        self.post_time = [0.0] * n
        self.t0 = stats.start = time.perf_counter()

    # -- bookkeeping ----------------------------------------------------------------------
    def finish(self, i: int) -> None:
        """Op ``i`` completed: its dependents may become ready."""
        self.completed += 1
        if self.tracing:
            now = time.perf_counter() - self.t0
            self.stats.trace.append((i, self.plan.kind[i], self.post_time[i] - self.t0, now))
        waiting, qprev, posted, ready = self.waiting, self.plan.qprev, self.posted, self.ready
        for d in self.plan.dependents[i]:
            waiting[d] -= 1
            if waiting[d] == 0 and (qprev[d] < 0 or posted[qprev[d]]):
                ready.append(d)

    def slice(self, i: int) -> Any:
        plan = self.plan
        return self.buffers[plan.buf[i]][plan.lo[i] : plan.hi[i]]

    def data(self, i: int) -> Any:
        """What the transport moves for op ``i``, in place in its buffer."""
        if self.raw is not None:
            return self.raw[self.plan.buf[i]][self.plan.blo[i] : self.plan.bhi[i]]
        return self.t.message(self.backend, self.slice(i))

    def take_temp(self, m: int) -> Any:
        free = self.pool.get(m)
        return free.pop() if free else self.backend.empty(m, self.dtype)

    def track(self, i: int, req: Any) -> None:
        self.post_time[i] = time.perf_counter()
        self.reqs.append(req)
        self.req_op.append(i)

    # -- posting --------------------------------------------------------------------------
    def send_message(self, i: int) -> Any:
        if self.sync:
            self.backend.synchronize()
        if self.staging:
            host = self.hosts[i] = self.backend.to_host(self.slice(i))
            return host.view(np.uint8)
        return self.data(i)

    def recv_message(self, i: int) -> Any:
        plan = self.plan
        if self.sync:
            self.backend.synchronize()
        if self.staging:
            host = self.hosts[i] = np.empty(plan.hi[i] - plan.lo[i], dtype=self.dtype)
            return host.view(np.uint8)
        if plan.kind[i] == RECV:
            return self.data(i)
        temp = self.temps[i] = self.take_temp(plan.hi[i] - plan.lo[i])
        return self.t.message(self.backend, temp)

    def start_send(self, i: int) -> None:
        self.track(i, self.t.isend(self.send_message(i), self.plan.peer[i], self.plan.tag[i]))

    def local(self, i: int) -> None:
        """A local copy or reduction, done at once."""
        plan = self.plan
        self.post_time[i] = time.perf_counter()
        lo, hi, slo = plan.lo[i], plan.hi[i], plan.slo[i]
        dst = self.buffers[plan.buf[i]][lo:hi]
        src = self.buffers[plan.sbuf[i]][slo : slo + (hi - lo)]
        if plan.kind[i] == COPY:
            self.backend.copyto(dst, src)
        else:
            self.backend.reduce(self.op, dst, src)

    def start_coll(self, i: int) -> None:
        target = self.slice(i)
        if self.sync:
            self.backend.synchronize()
        data = target
        if self.staging:
            data = self.hosts[i] = self.backend.to_host(target)
        name = self.backend.dtype_name(target)
        self.track(i, self.t.allreduce(self.backend, data, name, self.op))

    def post(self, i: int) -> None:
        plan = self.plan
        self.posted[i] = True
        j = plan.qnext[i]
        if j >= 0 and self.waiting[j] == 0:
            self.ready.append(j)
        kind = plan.kind[i]
        if kind == SEND:
            if self.pacer is not None:
                now = time.perf_counter()
                when = self.pacer.send_release(now, plan.nbytes[i], plan.peer[i])
                if when > now:
                    self.defer(i, when, _ACT_SEND)
                    return
            self.start_send(i)
        elif kind == RECV or kind == RECV_REDUCE:
            self.track(i, self.t.irecv(self.recv_message(i), plan.peer[i], plan.tag[i]))
        elif kind == COPY or kind == REDUCE:
            self.local(i)
            self.finish(i)
        elif kind == COLL:
            self.start_coll(i)
        else:  # pragma: no cover - the builder rejects unknown kinds
            raise ValueError(f"unknown operation kind {kind}")

    def defer(self, i: int, when: float, action: int) -> None:
        heapq.heappush(self.timers, (when, self.seq, action, i))
        self.seq += 1

    # -- completions ----------------------------------------------------------------------
    def arrived(self, i: int, now: float) -> None:
        """The library completed op i's request: move data into place and finish it."""
        plan, stats = self.plan, self.stats
        kind = plan.kind[i]
        if kind == SEND:
            stats.sends.append(
                (i, plan.peer[i], plan.nbytes[i], self.post_time[i] - self.t0, now - self.t0)
            )
            stats.messages_sent += 1
            stats.bytes_sent += plan.nbytes[i]
            self.hosts.pop(i, None)
            self.finish(i)
            return
        if kind == COLL:
            host = self.hosts.pop(i, None)
            if host is not None:
                self.backend.from_host(self.slice(i), host)
            if self.pacer is not None:
                when = self.pacer.coll_done(self.post_time[i], plan.nbytes[i])
                if when > time.perf_counter():
                    self.defer(i, when, _ACT_DONE)
                    return
            self.finish(i)
            return
        stats.recvs.append(
            (i, plan.peer[i], plan.nbytes[i], self.post_time[i] - self.t0, now - self.t0)
        )
        stats.messages_received += 1
        stats.bytes_received += plan.nbytes[i]
        self.land(i)
        if self.pacer is not None:
            when = self.pacer.recv_done(self.post_time[i], time.perf_counter(), plan.nbytes[i])
            if when > time.perf_counter():
                self.defer(i, when, _ACT_DONE)
                return
        self.finish(i)

    def land(self, i: int) -> None:
        """A received message into its place: copied (staged) or reduced."""
        backend, plan = self.backend, self.plan
        target = self.slice(i)
        m = plan.hi[i] - plan.lo[i]
        host = self.hosts.pop(i, None) if self.staging else None
        if plan.kind[i] == RECV:
            if host is not None:
                backend.from_host(target, host)
        elif host is not None:
            if backend.device:
                temp = self.take_temp(m)
                backend.from_host(temp, host)
                backend.reduce(self.op, target, temp)
                self.pool.setdefault(m, []).append(temp)
            else:
                backend.reduce(self.op, target, host)
        else:
            temp = self.temps.pop(i)
            backend.reduce(self.op, target, temp)
            self.pool.setdefault(m, []).append(temp)

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
        n, stats = self.plan.n, self.stats
        ordered = self.t.observe == "ordered"
        if ordered:
            self.plan.leveled(self.schedule, self.t.rank)
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
                raise RuntimeError(
                    f"rank {self.t.rank}: {self.schedule.name} stalled with "
                    f"{n - self.completed} operations left (the schedule should have "
                    "failed verification)"
                )
            done = self.wait_ordered() if ordered else self.wait_any()
            now = time.perf_counter()
            for i in done:
                self.arrived(i, now)
        if self.backend.device and self.sync:
            self.backend.synchronize()
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
        completion) the wait runs on a helper thread (:func:`_waiter`) and the loop waits
        for that thread until the earliest timer: timers fire on time, and a message
        that completed is seen when it completes, not after a sleep (a message from a
        fast rank timed at the pace of this rank's slow send would make a fast link look
        slow). Without timers the request is waited for here (the helper's hand-off costs
        tens of microseconds). Either way the request waited for is the outstanding one of
        lowest level, which cannot deadlock (module docstring), and no wait outlasts a
        timer, so every timer fires."""
        level = self.plan.level
        # The lowest level; among equals the first in program order: within a queue
        # messages complete in posting order, so waiting for a later one first would
        # leave an earlier one's completion (and what it frees) unseen meanwhile.
        best, j_best = None, -1
        for j, i in enumerate(self.req_op):
            key = (level[i], i)
            if best is None or key < best:
                best, j_best = key, j
        bg = self.__dict__.setdefault("_bg", {})  # op -> future of its helper's wait
        if self.timers:
            due = self.timers[0][0]  # a heap: the earliest timer
            if j_best < 0:
                time.sleep(max(0.0, due - time.perf_counter()))
                return []
            i = self.req_op[j_best]
            fut = bg.get(i)
            if fut is None:
                fut = bg[i] = _waiter().submit(self.t.wait, self.reqs[j_best])
            try:
                fut.result(timeout=max(0.0, due - time.perf_counter()))
            except _FutureTimeout:
                return []
            del bg[i]
            return self.remove([j_best])
        fut = bg.pop(self.req_op[j_best], None)
        if fut is not None:
            fut.result()  # already handed to the helper: never wait twice for one request
        else:
            self.t.wait(self.reqs[j_best])
        return self.remove([j_best])

    def grouped(self) -> None:
        """Level by level: each level's messages posted as one group, then the local work
        of that level, ordered after them by the device stream; nothing waits on the host
        (module docstring). The reductions of received data follow their group.

        The host does not see when a message arrives, so per-message times are recorded
        only when tracing (the probe, the doctor), which waits for every level on the host
        and is slower for it; otherwise only the counts."""
        plan, stats, backend = self.plan, self.stats, self.backend
        plan.leveled(self.schedule, self.t.rank)
        kinds = plan.kind
        for ops in plan.rounds:
            posts = []
            for i in ops:
                k = kinds[i]
                if k == SEND:
                    posts.append((True, self.send_message(i), plan.peer[i], plan.tag[i]))
                elif k == RECV or k == RECV_REDUCE:
                    posts.append((False, self.recv_message(i), plan.peer[i], plan.tag[i]))
            start = time.perf_counter()
            if posts:
                for req in self.t.batch(posts):
                    if req is not None:
                        self.t.wait(req)  # NCCL: the current stream waits, not the host
                if self.tracing:
                    backend.synchronize()
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
        if not self.tracing:
            # Times the host never saw are not measurements: keep the counts only.
            stats.sends.clear()
            stats.recvs.clear()
        stats.seconds = time.perf_counter() - self.t0


_ACT_SEND, _ACT_DONE = 0, 1
_WAITER: list[ThreadPoolExecutor] = []


def _waiter() -> ThreadPoolExecutor:
    """The threads that wait for requests while the loop keeps time for its timers
    (:meth:`_Run.wait_ordered`). A request's wait releases the interpreter lock (gloo's
    does), so the loop runs while they block. Several threads: a request handed over and
    not yet complete when a timer fired keeps its thread, and a request of a lower level
    posted since needs another. Threads are made only when none is idle; the bound is far
    above the requests a call has in flight, so that a request handed over is always
    being waited for (one queued behind blocked threads could be what they wait for)."""
    if not _WAITER:
        _WAITER.append(ThreadPoolExecutor(max_workers=1024, thread_name_prefix="optcc-wait"))
    return _WAITER[0]
