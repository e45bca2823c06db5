"""Run one rank's program of a schedule with nonblocking mpi4py calls.

The executor knows nothing about algorithms. It keeps every operation whose dependencies
have completed in flight at once (``Isend``/``Irecv``/``Iallreduce``), so pipelined stages
really overlap, and reacts to completions with ``Waitsome``:

* a point-to-point operation is posted once its dependencies completed and the earlier
  operations of its queue (peer, channel, direction) were posted: the order of posting
  per queue is program order on both sides, which makes message matching deterministic;
* a received message is reduced into place (on the GPU for CuPy) when it arrives;
* local copies and reductions run as soon as they are ready.

With a device backend the current stream is synchronised before every MPI call; with an
MPI library that is not CUDA-aware, messages are staged through host copies.

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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optcc_mpi.backend import Backend, mpi_datatype_and_op
from optcc_mpi.schedule import COLL, COPY, RECV, RECV_REDUCE, REDUCE, SEND, Schedule

__all__ = ["ExecStats", "execute", "TAG_BASE"]

#: Tags of our messages are TAG_BASE + channel, on a communicator of our own.
TAG_BASE = 1000


@dataclass
class ExecStats:
    """What one rank did while executing a schedule.

    ``sends`` and ``recvs`` hold one tuple ``(op, peer, nbytes, posted, completed)`` per
    message, in completion order; times are seconds since ``start`` (a
    ``time.perf_counter()`` value, so on one host the records of all ranks share a
    clock). ``posted`` is when the ``Isend``/``Irecv`` was handed to MPI (for a paced send,
    when the virtual NIC released it), ``completed`` when MPI reported the request done
    (for a receive, before any pacing delay of its completion).
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
        self.temp_pool: dict[tuple[str, str, int], list[Any]] = {}


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
    comm: Any,
    op: str,
    backend: Backend,
    staging: bool = False,
    pacer: Any = None,
    trace: bool = False,
) -> ExecStats:
    """Execute ``comm.rank``'s program of ``schedule`` on ``buf``.

    Parameters
    ----------
    schedule : Schedule
        Built for ``comm.size`` ranks and ``buf.size`` elements.
    buf : array
        1-D contiguous array holding this rank's input; holds the result on return.
    comm : mpi4py.MPI.Comm
        Communicator the messages travel on (use a private duplicate).
    op : {"sum", "max", "min"}
        The reduction.
    backend : Backend
        Array backend of ``buf``.
    staging : bool
        Stage device buffers through host memory (MPI library not CUDA-aware).
    pacer : optional
        Link emulation (:class:`optcc_mpi.emulation.Pacer`).
    trace : bool
        Record per-operation times in ``ExecStats.trace`` (the per-message records in
        ``sends``/``recvs`` are always kept).
    """
    from mpi4py import MPI

    rank = comm.Get_rank()
    itemsize = buf.dtype.itemsize
    plan = _plan(schedule, rank, itemsize)
    n = plan.n
    stats = ExecStats()
    if n == 0:
        return stats
    dtype = buf.dtype
    buffers = [buf]
    if schedule.scratch:
        buffers.append(backend.empty(schedule.scratch, dtype))
    device = backend.device
    # Byte views of the buffers, made once per call: a message is one slice of these.
    # (A device buffer goes to mpi_buffer only after synchronising, once per message.)
    raw = None if staging or device else [backend.mpi_buffer(b) for b in buffers]
    pool = plan.temp_pool.setdefault((backend.name, dtype.str), {})  # type: ignore[arg-type]

    kinds, peers, tags = plan.kind, plan.peer, plan.tag
    bufs, los, his, blos, bhis, sizes = plan.buf, plan.lo, plan.hi, plan.blo, plan.bhi, plan.nbytes
    qprev, qnext, dependents = plan.qprev, plan.qnext, plan.dependents
    waiting = plan.waiting.copy()
    posted = [False] * n
    ready: deque[int] = deque(plan.ready)
    reqs: list[Any] = []
    req_op: list[int] = []  # op index of each request in reqs
    temps: dict[int, Any] = {}  # op -> temporary receive buffer (RECV_REDUCE)
    hosts: dict[int, Any] = {}  # op -> host staging copy
    timers: list[tuple[float, int, int, int]] = []  # (when, seq, action, op)
    sends, recvs = stats.sends, stats.recvs
    perf = time.perf_counter
    t0 = stats.start = perf()
    post_time = [0.0] * n
    seq = 0
    completed = 0
    ACT_SEND, ACT_DONE = 0, 1

    def finish(i: int) -> None:
        nonlocal completed
        completed += 1
        if trace:
            stats.trace.append((i, kinds[i], post_time[i] - t0, perf() - t0))
        for d in dependents[i]:
            waiting[d] -= 1
            if waiting[d] == 0 and (qprev[d] < 0 or posted[qprev[d]]):
                ready.append(d)

    def start_send(i: int) -> None:
        if device:
            backend.synchronize()
        if staging:
            host = backend.to_host(buffers[bufs[i]][los[i] : his[i]])
            hosts[i] = host
            req = comm.Isend(host.view(np.uint8), peers[i], tags[i])
        elif raw is None:
            data = backend.mpi_buffer(buffers[bufs[i]][los[i] : his[i]])
            req = comm.Isend(data, peers[i], tags[i])
        else:
            req = comm.Isend(raw[bufs[i]][blos[i] : bhis[i]], peers[i], tags[i])
        post_time[i] = perf()
        reqs.append(req)
        req_op.append(i)

    def take_temp(m: int) -> Any:
        free = pool.get(m)
        return free.pop() if free else backend.empty(m, dtype)

    def post(i: int) -> None:
        nonlocal seq
        posted[i] = True
        j = qnext[i]
        if j >= 0 and waiting[j] == 0:
            ready.append(j)
        kind = kinds[i]
        if kind == SEND:
            if pacer is not None:
                now = perf()
                when = pacer.send_release(now, sizes[i], peers[i])
                if when > now:
                    heapq.heappush(timers, (when, seq, ACT_SEND, i))
                    seq += 1
                    return
            start_send(i)
        elif kind == RECV or kind == RECV_REDUCE:
            if device:
                backend.synchronize()
            if staging:
                host = np.empty(his[i] - los[i], dtype=dtype)
                hosts[i] = host
                req = comm.Irecv(host.view(np.uint8), peers[i], tags[i])
            elif kind == RECV:
                if raw is None:
                    data = backend.mpi_buffer(buffers[bufs[i]][los[i] : his[i]])
                else:
                    data = raw[bufs[i]][blos[i] : bhis[i]]
                req = comm.Irecv(data, peers[i], tags[i])
            else:
                temp = temps[i] = take_temp(his[i] - los[i])
                req = comm.Irecv(backend.mpi_buffer(temp), peers[i], tags[i])
            post_time[i] = perf()
            reqs.append(req)
            req_op.append(i)
        elif kind == COPY or kind == REDUCE:
            post_time[i] = perf()
            lo, hi, slo = los[i], his[i], plan.slo[i]
            dst = buffers[bufs[i]][lo:hi]
            src = buffers[plan.sbuf[i]][slo : slo + (hi - lo)]
            if kind == COPY:
                backend.copyto(dst, src)
            else:
                backend.reduce(op, dst, src)
            finish(i)
        elif kind == COLL:
            target = buffers[bufs[i]][los[i] : his[i]]
            datatype, mpi_op = mpi_datatype_and_op(dtype.name, op)
            if device:
                backend.synchronize()
            host = backend.to_host(target) if staging else None
            data = host if staging else target
            if host is not None:
                hosts[i] = host
            arg = data.view(np.uint16) if datatype == MPI.UINT16_T else data
            post_time[i] = perf()
            reqs.append(comm.Iallreduce(MPI.IN_PLACE, [arg, datatype], mpi_op))
            req_op.append(i)
        else:  # pragma: no cover - the builder rejects unknown kinds
            raise ValueError(f"unknown operation kind {kind}")

    def arrived(i: int, now: float) -> None:
        """MPI completed op i's request: move data into place and finish it."""
        kind = kinds[i]
        if kind == SEND:
            sends.append((i, peers[i], sizes[i], post_time[i] - t0, now - t0))
            stats.messages_sent += 1
            stats.bytes_sent += sizes[i]
            if staging:
                del hosts[i]
            finish(i)
            return
        lo, hi = los[i], his[i]
        if kind == COLL:
            host = hosts.pop(i, None)
            if host is not None:
                backend.from_host(buffers[bufs[i]][lo:hi], host)
            if pacer is not None:
                when = pacer.coll_done(post_time[i], sizes[i])
                if when > perf():
                    _defer(i, when)
                    return
            finish(i)
            return
        recvs.append((i, peers[i], sizes[i], post_time[i] - t0, now - t0))
        stats.messages_received += 1
        stats.bytes_received += sizes[i]
        target = buffers[bufs[i]][lo:hi]
        host = hosts.pop(i, None) if staging else None
        if kind == RECV:
            if host is not None:
                backend.from_host(target, host)
        elif host is not None:
            if device:
                temp = take_temp(hi - lo)
                backend.from_host(temp, host)
                backend.reduce(op, target, temp)
                pool.setdefault(hi - lo, []).append(temp)
            else:
                backend.reduce(op, target, host)
        else:
            temp = temps.pop(i)
            backend.reduce(op, target, temp)
            pool.setdefault(hi - lo, []).append(temp)
        if pacer is not None:
            when = pacer.recv_done(post_time[i], perf(), sizes[i])
            if when > perf():
                _defer(i, when)
                return
        finish(i)

    def _defer(i: int, when: float) -> None:
        nonlocal seq
        heapq.heappush(timers, (when, seq, ACT_DONE, i))
        seq += 1

    waitsome, testsome = MPI.Request.Waitsome, MPI.Request.Testsome
    while completed < n:
        while ready:
            post(ready.popleft())
        if timers:
            now = perf()
            while timers and timers[0][0] <= now:
                _, _, action, i = heapq.heappop(timers)
                if action == ACT_SEND:
                    start_send(i)
                else:
                    finish(i)
            if ready:
                continue
        if completed >= n:
            break
        if len(reqs) > stats.max_in_flight:
            stats.max_in_flight = len(reqs)
        if not reqs:
            if timers:
                time.sleep(max(0.0, timers[0][0] - perf()))
                continue
            raise RuntimeError(
                f"rank {rank}: {schedule.name} stalled with {n - completed} operations left "
                "(the schedule should have failed verification)"
            )
        if timers:
            # Poll so that timers fire on time; sleep a little between polls so that
            # oversubscribed ranks leave the CPU to the others.
            idx = testsome(reqs)
            if not idx:
                delay = timers[0][0] - perf()
                if delay > 0:
                    time.sleep(min(delay, 50e-6))
                continue
        else:
            idx = waitsome(reqs)
            if not idx:  # pragma: no cover - only inactive requests would return none
                continue
        now = perf()
        done: list[int] = []
        # Remove completed requests by swapping in the last one (Waitsome does not care
        # about order); descending indices keep the swapped-in entries valid.
        for j in sorted(idx, reverse=True):
            done.append(req_op[j])
            last_req, last_op = reqs.pop(), req_op.pop()
            if j < len(reqs):
                reqs[j], req_op[j] = last_req, last_op
        for i in reversed(done):
            arrived(i, now)
    if device:
        backend.synchronize()
    stats.seconds = perf() - t0
    return stats
