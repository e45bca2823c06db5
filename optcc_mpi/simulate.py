"""Discrete-event timing of a schedule under a link model.

The link model
--------------
* Every rank has a full-duplex NIC: a send side of rate ``bw * send[r]`` and a receive
  side of rate ``bw * recv[r]`` bytes/s (the fractions come from a :class:`Links`).
* Each NIC side is an independent first-in-first-out server of bytes. A message of m
  bytes from a to b needs m / send_rate(a) of a's send side and m / recv_rate(b) of b's
  receive side, each side serving messages in the order they became ready (both ends
  posted; messages ready at the same instant in program order, i.e. by the id of their
  send); the message completes ``latency`` seconds after *both* sides served it. So a
  fast NIC talking to a slow one is busy only for its own share of the time and serves
  other messages meanwhile, as with TCP's flow sharing, and no NIC serves more bytes than
  its rate allows over any busy period. (Treating the two sides independently is the
  fluid approximation: it does not track which bytes flow at which instant.)
* Operations start as the executor starts them: when their dependencies have completed
  and the operations ahead of them in their queue were posted. A reduction of m bytes
  costs m / ``reduce_bw`` at the receiver (free by default, as in the fluid model).
* ``COLL`` (the MPI library's AllReduce) is timed as a bandwidth-optimal algorithm held
  back by the slowest NIC, with 2 log2(p) latencies, and occupies every NIC.

The simulator reads only the schedule; it knows nothing about any particular algorithm.
"""

from __future__ import annotations

import ctypes
import functools
import heapq
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from optcc_mpi import compiled, config
from optcc_mpi.errors import ExecutionError, TooLargeError
from optcc_mpi.links import Links
from optcc_mpi.schedule import (
    COLL,
    COPY,
    RECV,
    RECV_REDUCE,
    REDUCE,
    SEND,
    Schedule,
    check_size,
)

__all__ = ["Result", "simulate", "engine"]

#: Bytes per operation the simulator allocates beyond the schedule (its 32-bit index
#: arrays, times and stack; partner and queue arrays the schedule caches).
_SIM_BYTES_PER_OP = 90


@dataclass
class Result:
    """Simulated timing of one schedule."""

    time: float
    """Seconds until the last operation completes."""
    finish: np.ndarray
    """Per-rank completion time of the rank's last operation."""
    send_busy: np.ndarray
    """Per-rank seconds the NIC's send side was serving bytes."""
    recv_busy: np.ndarray
    """Per-rank seconds the NIC's receive side was serving bytes."""
    messages: int
    """Point-to-point messages timed (``COLL`` operations not counted)."""
    params: dict = field(default_factory=dict)
    """How it was simulated: ``bw``, ``latency``, ``itemsize``, ``links`` and ``engine``
    (``"c"`` or ``"python"``)."""
    trace: np.ndarray | None = None
    """With ``trace=True``: one row per message, (send op, src, dst, bytes, ready, send
    start, send end, recv start, recv end, done)."""


def simulate(
    schedule: Schedule,
    links: Links | str | None = None,
    *,
    bw: float = 25e9,
    latency: float = 0.0,
    itemsize: int = 4,
    reduce_bw: float | None = None,
    trace: bool = False,
) -> Result:
    """Time ``schedule`` under the link model of the module docstring.

    Parameters
    ----------
    schedule : Schedule
        What to time.
    links : Links or str, optional
        Per-rank bandwidth fractions; all healthy by default.
    bw : float
        Healthy NIC rate, bytes/s per direction.
    latency : float
        Seconds added to every message.
    itemsize : int
        Bytes per element.
    reduce_bw : float, optional
        Bytes/s of a local reduction; None makes reductions free.
    trace : bool
        Record every message's timing in ``Result.trace``.

    Returns
    -------
    Result
    """
    s = schedule
    p = s.p
    frac = (Links.coerce(links) if links is not None else Links()).vector(p)
    arrays = _prepare(s, itemsize)
    send_rate = bw * frac
    recv_rate = bw * frac
    red = 0.0 if not reduce_bw else 1.0 / reduce_bw
    use_c = engine() == "c"
    run = _run_c if use_c else _run_python
    posted, finish, send_busy, recv_busy, messages, rows = run(
        arrays, p, send_rate, recv_rate, latency, red, trace
    )
    unfinished = int(np.sum(np.asarray(posted) < 0.0))
    if unfinished:
        raise ExecutionError(
            f"{s.name}: {unfinished} operations never became ready (deadlock); "
            "run optcc_mpi.verify.verify on the schedule for details"
        )
    fin = np.asarray(finish, dtype=float)
    return Result(
        time=float(fin.max()) if p else 0.0,
        finish=fin,
        send_busy=np.asarray(send_busy, dtype=float),
        recv_busy=np.asarray(recv_busy, dtype=float),
        messages=int(messages),
        params={
            "bw": bw,
            "latency": latency,
            "itemsize": itemsize,
            "links": str(links),
            "engine": "c" if use_c else "python",
        },
        trace=np.asarray(rows, dtype=float).reshape(-1, 10) if trace else None,
    )


def engine() -> str:
    """The event loop :func:`simulate` runs here: ``"c"``, the compiled one, or
    ``"python"`` (about 50 times slower, identical results) where it could not be built or
    loaded, or ``OPTCC_SIM=python`` asks for it."""
    return "c" if config.get("OPTCC_SIM") != "python" and _core() is not None else "python"


def _prepare(s: Schedule, itemsize: int) -> dict[str, np.ndarray]:
    """Flat arrays both engines read: kinds, ranks, partners, queue successors, ranges,
    dependents (CSR) and how many things each op waits for. Indices that fit are 32-bit
    (the schedule has fewer than 2**31 operations), so that a large schedule costs the
    simulator about 60 bytes per operation beyond the schedule itself."""
    n = s.n_ops
    if n >= 2**31 - 1:
        raise TooLargeError(f"{s.name}: {n} operations; the simulator handles up to 2**31")
    check_size(f"simulating {s.name}", n, per_op=_SIM_BYTES_PER_OP, p=s.p)
    partner = s.partner
    prev = s.queue_prev
    qnext = np.full(n, -1, dtype=np.int32)
    has = np.flatnonzero(prev >= 0)
    qnext[prev[has]] = has
    waiting = np.diff(s.dep_ptr).astype(np.int32)
    waiting[has] += 1
    del has
    # Dependents in CSR: for each op, the ops that wait for it (counting sort by target).
    succ_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(s.dep_idx, minlength=n), out=succ_ptr[1:])
    order = np.argsort(s.dep_idx, kind="stable")
    succ = np.arange(n, dtype=np.int32).repeat(np.diff(s.dep_ptr))[order]
    del order
    return {
        "kind": np.ascontiguousarray(s.kind, dtype=np.int8),
        "rank": np.ascontiguousarray(s.rank, dtype=np.int32),
        "partner": np.ascontiguousarray(partner, dtype=np.int64),
        "qnext": qnext,
        "succ_ptr": succ_ptr,
        "succ": succ,
        "waiting": waiting,
        "lo": np.ascontiguousarray(s.lo, dtype=np.int64),
        "hi": np.ascontiguousarray(s.hi, dtype=np.int64),
        "itemsize": np.array(float(itemsize)),
        "n_coll": np.array(int(np.sum(s.kind == COLL)) // max(s.p, 1)),
    }


def _run_python(
    a: dict[str, np.ndarray],
    p: int,
    send_rate_a: np.ndarray,
    recv_rate_a: np.ndarray,
    latency: float,
    red: float,
    trace: bool,
) -> tuple:
    """The event loop in Python: the specification of the compiled engine
    (``_simcore.c``), and its fallback where no C compiler is available."""
    kind = a["kind"].tolist()
    rank = a["rank"].tolist()
    partner = a["partner"].tolist()
    qnext = a["qnext"].tolist()
    succ_ptr = a["succ_ptr"].tolist()
    succ = a["succ"].tolist()
    waiting = a["waiting"].tolist()
    nbytes = ((a["hi"] - a["lo"]) * float(a["itemsize"])).tolist()
    send_rate = send_rate_a.tolist()
    recv_rate = recv_rate_a.tolist()
    n = len(kind)
    ready_at = [0.0] * n
    posted = [-1.0] * n
    sp = [0.0] * p
    rp = [0.0] * p
    send_busy = [0.0] * p
    recv_busy = [0.0] * p
    finish = [0.0] * p
    coll_ops: list[list[int]] = []
    coll_post: list[float] = []
    coll_count = [0] * p
    heap: list[tuple[float, int, int]] = []
    messages = 0
    rows: list[tuple[float, ...]] = []
    # Posting an op can make others ready (its queue successor, dependents of a local op
    # that completes at once): an explicit stack instead of recursion keeps long chains safe.
    stack: list[tuple[int, float]] = []

    def release(op: int, t: float) -> None:
        if t > ready_at[op]:
            ready_at[op] = t
        waiting[op] -= 1
        if waiting[op] == 0:
            stack.append((op, ready_at[op]))

    def complete(op: int, t: float) -> None:
        r = rank[op]
        if t > finish[r]:
            finish[r] = t
        for i in range(succ_ptr[op], succ_ptr[op + 1]):
            release(succ[i], t)

    def drain() -> None:
        while stack:
            op, t = stack.pop()
            posted[op] = t
            if qnext[op] >= 0:
                release(qnext[op], t)
            k = kind[op]
            if k == SEND or k == RECV or k == RECV_REDUCE:
                other = partner[op]
                if posted[other] >= 0.0:
                    snd = op if k == SEND else other
                    heapq.heappush(heap, (max(t, posted[other]), snd, snd))
            elif k == COPY or k == REDUCE:
                complete(op, t + nbytes[op] * red)
            elif k == COLL:
                r = rank[op]
                c = coll_count[r]
                coll_count[r] += 1
                if c == len(coll_ops):
                    coll_ops.append([-1] * p)
                    coll_post.append(0.0)
                coll_ops[c][r] = op
                coll_post[c] = max(coll_post[c], t)
                if all(o >= 0 for o in coll_ops[c]):
                    heapq.heappush(heap, (coll_post[c], n + c, -1 - c))

    stack.extend((op, 0.0) for op in range(n - 1, -1, -1) if waiting[op] == 0)
    drain()
    lg = math.ceil(math.log2(p)) if p > 1 else 0
    while heap:
        t, _, snd = heapq.heappop(heap)
        if snd < 0:  # a collective over all ranks
            ops = coll_ops[-1 - snd]
            m = nbytes[ops[0]]
            start = max(t, max(sp), max(rp))
            slow = min(min(send_rate), min(recv_rate))
            dur = 2.0 * (p - 1) / p * m / slow
            end = start + dur + 2.0 * lg * latency
            for r in range(p):
                sp[r] = rp[r] = start + dur
                send_busy[r] += dur
                recv_busy[r] += dur
            for o in ops:
                complete(o, end)
            drain()
            continue
        rcv = partner[snd]
        a_, b_ = rank[snd], rank[rcv]
        m = nbytes[snd]
        s_start = t if t > sp[a_] else sp[a_]
        s_time = m / send_rate[a_]
        s_end = s_start + s_time
        sp[a_] = s_end
        send_busy[a_] += s_time
        r_start = t if t > rp[b_] else rp[b_]
        r_time = m / recv_rate[b_]
        r_end = r_start + r_time
        rp[b_] = r_end
        recv_busy[b_] += r_time
        end = (s_end if s_end > r_end else r_end) + latency
        if trace:
            rows.append((snd, a_, b_, m, t, s_start, s_end, r_start, r_end, end))
        messages += 1
        complete(snd, end)
        if kind[rcv] == RECV_REDUCE:
            end += m * red
        complete(rcv, end)
        drain()
    return posted, finish, send_busy, recv_busy, messages, rows


def _run_c(
    a: dict[str, np.ndarray],
    p: int,
    send_rate: np.ndarray,
    recv_rate: np.ndarray,
    latency: float,
    red: float,
    trace: bool,
) -> tuple:
    """The same event loop, compiled (see ``_simcore.c``)."""
    lib = _core()
    assert lib is not None  # the caller runs this only where the loop was compiled
    n = a["kind"].size
    waiting = a["waiting"].copy()
    posted = np.empty(n)
    finish = np.zeros(p)
    send_busy = np.zeros(p)
    recv_busy = np.zeros(p)
    rates = [np.ascontiguousarray(x, dtype=np.float64) for x in (send_rate, recv_rate)]
    rows = np.zeros((int(np.sum(a["kind"] == SEND)) if trace else 0, 10))
    inputs = (
        a["kind"],
        a["rank"],
        a["partner"],
        a["qnext"],
        a["succ_ptr"],
        a["succ"],
        waiting,
        a["lo"],
        a["hi"],
        *rates,
    )
    outputs = (posted, finish, send_busy, recv_busy)
    messages = lib.optcc_simulate(
        n,
        p,
        *(x.ctypes.data for x in inputs),
        float(a["itemsize"]),
        latency,
        red,
        int(a["n_coll"]),
        *(x.ctypes.data for x in outputs),
        rows.ctypes.data if trace else None,
    )
    if messages < 0:
        raise TooLargeError("simulator: out of memory for its event queue")
    return posted, finish, send_busy, recv_busy, messages, rows[:messages]


@functools.lru_cache(maxsize=1)
def _core() -> ctypes.CDLL | None:
    """The compiled event loop (:func:`optcc_mpi.compiled.library`); None when there is none
    (the Python loop then runs, about 50 times slower, with identical results)."""
    lib = compiled.library(Path(__file__).parent, "_simcore")
    if lib is None:
        return None
    lib.optcc_simulate.restype = ctypes.c_int64
    i64, ptr, dbl = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
    argtypes: list[type[ctypes.c_int64 | ctypes.c_void_p | ctypes.c_double]] = [i64, i64]
    argtypes += [ptr] * 11
    argtypes += [dbl, dbl, dbl, i64]
    argtypes += [ptr] * 5
    lib.optcc_simulate.argtypes = argtypes
    return lib
