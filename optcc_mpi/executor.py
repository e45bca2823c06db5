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
    """What one rank did while executing a schedule."""

    seconds: float = 0.0
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    max_in_flight: int = 0
    trace: list[tuple[int, int, float, float]] = field(default_factory=list)
    """With tracing: (op index, kind, post time, completion time) relative to the start."""


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
        Record per-operation times in the returned stats.
    """
    from mpi4py import MPI

    rank = comm.Get_rank()
    prog = schedule.program(rank)
    ops = prog.ops
    n = len(ops)
    stats = ExecStats()
    if n == 0:
        return stats
    itemsize = buf.dtype.itemsize
    dtype = buf.dtype
    buffers = [buf]
    if schedule.scratch:
        buffers.append(backend.empty(schedule.scratch, dtype))
    device = backend.device

    waiting = [len(d) for d in prog.deps]
    qprev, qnext = prog.qprev, prog.qnext
    dependents = prog.dependents
    posted = [False] * n
    ready: deque[int] = deque(i for i in range(n) if waiting[i] == 0 and qprev[i] < 0)
    reqs: list[Any] = []
    pending: list[tuple[int, Any, Any]] = []  # (op, temp or None, host staging or None)
    timers: list[tuple[float, int, int, int]] = []  # (when, seq, action, op)
    t0 = time.perf_counter()
    post_time = [0.0] * n
    seq = 0
    completed = 0
    ACT_SEND, ACT_DONE = 0, 1

    def view(b: int, lo: int, hi: int) -> Any:
        return buffers[b][lo:hi]

    def finish(i: int) -> None:
        nonlocal completed
        completed += 1
        if trace:
            stats.trace.append((i, ops[i][0], post_time[i] - t0, time.perf_counter() - t0))
        for d in dependents[i]:
            waiting[d] -= 1
            if waiting[d] == 0 and (qprev[d] < 0 or posted[qprev[d]]):
                ready.append(d)

    def start_send(i: int) -> None:
        _, peer, chan, b, lo, hi, _, _ = ops[i]
        data = view(b, lo, hi)
        if device:
            backend.synchronize()
        if staging:
            host = backend.to_host(data)
            req = comm.Isend(host.view(np.uint8), peer, TAG_BASE + chan)
            pending.append((i, None, host))
        else:
            req = comm.Isend(backend.mpi_buffer(data), peer, TAG_BASE + chan)
            pending.append((i, None, None))
        reqs.append(req)
        stats.messages_sent += 1
        stats.bytes_sent += (hi - lo) * itemsize

    def post(i: int) -> None:
        nonlocal seq
        posted[i] = True
        post_time[i] = time.perf_counter()
        j = qnext[i]
        if j >= 0 and waiting[j] == 0:
            ready.append(j)
        kind, peer, chan, b, lo, hi, sb, slo = ops[i]
        if kind == SEND:
            if pacer is not None:
                when = pacer.send_release(post_time[i], (hi - lo) * itemsize)
                if when > post_time[i]:
                    heapq.heappush(timers, (when, seq, ACT_SEND, i))
                    seq += 1
                    return
            start_send(i)
        elif kind == RECV or kind == RECV_REDUCE:
            target = view(b, lo, hi)
            temp = backend.empty(hi - lo, dtype) if kind == RECV_REDUCE else None
            if device:
                backend.synchronize()
            if staging:
                host = np.empty(hi - lo, dtype=dtype)
                req = comm.Irecv(host.view(np.uint8), peer, TAG_BASE + chan)
            else:
                host = None
                dest = temp if temp is not None else target
                req = comm.Irecv(backend.mpi_buffer(dest), peer, TAG_BASE + chan)
            reqs.append(req)
            pending.append((i, temp, host))
        elif kind == COPY or kind == REDUCE:
            dst = view(b, lo, hi)
            src = view(sb, slo, slo + (hi - lo))
            if kind == COPY:
                backend.copyto(dst, src)
            else:
                backend.reduce(op, dst, src)
            finish(i)
        elif kind == COLL:
            target = view(b, lo, hi)
            datatype, mpi_op = mpi_datatype_and_op(dtype.name, op)
            if device:
                backend.synchronize()
            host = backend.to_host(target) if staging else None
            data = host if staging else target
            arg = data.view(np.uint16) if datatype == MPI.UINT16_T else data
            req = comm.Iallreduce(MPI.IN_PLACE, [arg, datatype], mpi_op)
            reqs.append(req)
            pending.append((i, None, host))
        else:  # pragma: no cover - the builder rejects unknown kinds
            raise ValueError(f"unknown operation kind {kind}")

    def arrived(i: int, temp: Any, host: Any) -> None:
        """MPI completed op i's request: move data into place and finish it."""
        kind, peer, chan, b, lo, hi, _, _ = ops[i]
        if kind == SEND:
            finish(i)
            return
        if kind == COLL:
            if host is not None:
                backend.from_host(view(b, lo, hi), host)
            if pacer is not None:
                when = pacer.coll_done(post_time[i], (hi - lo) * itemsize)
                if when > time.perf_counter():
                    _defer(i, when)
                    return
            finish(i)
            return
        stats.messages_received += 1
        stats.bytes_received += (hi - lo) * itemsize
        target = view(b, lo, hi)
        if kind == RECV:
            if host is not None:
                backend.from_host(target, host)
        else:
            if host is not None:
                temp = backend.empty(hi - lo, dtype) if device else host
                if device:
                    backend.from_host(temp, host)
            backend.reduce(op, target, temp)
        if pacer is not None:
            when = pacer.recv_done(post_time[i], time.perf_counter(), (hi - lo) * itemsize)
            if when > time.perf_counter():
                _defer(i, when)
                return
        finish(i)

    def _defer(i: int, when: float) -> None:
        nonlocal seq
        heapq.heappush(timers, (when, seq, ACT_DONE, i))
        seq += 1

    while completed < n:
        while ready:
            post(ready.popleft())
        if timers:
            now = time.perf_counter()
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
                time.sleep(max(0.0, timers[0][0] - time.perf_counter()))
                continue
            raise RuntimeError(
                f"rank {rank}: {schedule.name} stalled with {n - completed} operations left "
                "(the schedule should have failed verification)"
            )
        if timers:
            # Poll so that timers fire on time; sleep a little between polls so that
            # oversubscribed ranks leave the CPU to the others.
            idx = MPI.Request.Testsome(reqs) or []
            if not idx:
                delay = timers[0][0] - time.perf_counter()
                if delay > 0:
                    time.sleep(min(delay, 50e-6))
                continue
        else:
            idx = MPI.Request.Waitsome(reqs) or []
        done_items = [pending[j] for j in idx]
        keep = sorted(set(range(len(reqs))) - set(idx))
        reqs[:] = [reqs[j] for j in keep]
        pending[:] = [pending[j] for j in keep]
        for i, temp, host in done_items:
            arrived(i, temp, host)
    if device:
        backend.synchronize()
    stats.seconds = time.perf_counter() - t0
    return stats
