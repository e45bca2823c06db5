"""The schedule: one representation of a collective for every reader.

An algorithm is a pure function that returns a :class:`Schedule`: for every rank, a
*program* of operations on element ranges, each with the operations (of the same rank)
it must wait for. Three readers take the same object and know nothing of the algorithm
that made it: the MPI executor (:mod:`optcc_mpi.executor`), the simulator
(:mod:`optcc_mpi.simulate`) and the symbolic verifier (:mod:`optcc_mpi.verify`).

Operations
----------
``SEND``         send ``buf[lo:hi]`` to ``peer`` on channel ``chan``
``RECV``         receive from ``peer`` into ``buf[lo:hi]`` (overwrite)
``RECV_REDUCE``  receive from ``peer`` and reduce into ``buf[lo:hi]``
``COPY``         ``buf[lo:hi] = sbuf[slo:slo+hi-lo]`` (local)
``REDUCE``       ``buf[lo:hi] op= sbuf[slo:slo+hi-lo]`` (local)
``COLL``         the transport's own AllReduce of ``buf[lo:hi]`` over all ranks

``op`` is whichever reduction the call asks for (any of :data:`optcc_mpi.dtypes.OPS`:
sum, prod, max, min and the logical and bitwise ones): the executor applies it, and a
schedule does not depend on it (the verifier checks contributions, not values).

Buffer 0 is the user's buffer: it holds the rank's input when the program starts and must
hold the reduced result when it ends. Buffer 1, if the schedule asks for ``scratch``
elements, is uninitialised work space.

Semantics (what the executor implements and the verifier checks)
-----------------------------------------------------------------
* An operation may start once every operation it depends on has *completed*.
* Point-to-point operations are matched in order per *queue* = (sender, receiver,
  channel): the k-th send from a to b on channel c meets the k-th receive at b from a on
  c, and must have the same length. The executor posts the operations of one queue in
  program order, so matching is deterministic; channels map to MPI tags.
* A program may not have two operations that touch overlapping elements, at least one of
  them writing, without a dependency path between them. This is what makes results
  independent of message timing, hence bit-identical from run to run.
* ``COLL`` operations are matched in program order across all ranks, with equal ranges.

Operations whose range is empty are dropped when the schedule is built (on both sides
of a transfer, since every rank computes the same schedule), and dependencies on them
are dropped with them; an empty range carries no data, so no hazard is lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeAlias, cast

import numpy as np
import numpy.typing as npt

from optcc_mpi.errors import ArgumentError, TooLargeError

__all__ = [
    "SEND",
    "RECV",
    "RECV_REDUCE",
    "COPY",
    "REDUCE",
    "COLL",
    "KIND_NAMES",
    "Schedule",
    "ScheduleBuilder",
    "Program",
    "split",
    "check_size",
    "memory_available",
    "BYTES_PER_OP",
    "Params",
    "Deps",
]

#: An algorithm's parameters by name (``{"k": 16}``): keyword arguments of its builder
#: function, each typed by the builder that takes it (so of any type here).
Params = dict[str, Any]
#: What operations wait for: operation ids (an array-like broadcast against the operations
#: added; -1 for none), or a list of such, nested as builders find convenient.
Deps: TypeAlias = npt.ArrayLike | Sequence["Deps"]

SEND, RECV, RECV_REDUCE, COPY, REDUCE, COLL = range(6)
_COLUMNS = ("kind", "rank", "peer", "chan", "buf", "lo", "hi", "sbuf", "slo")
#: Storage type of each column (39 bytes per operation).
_DTYPES = {
    "kind": np.int8,
    "rank": np.int32,
    "peer": np.int32,
    "chan": np.int32,
    "buf": np.int8,
    "lo": np.int64,
    "hi": np.int64,
    "sbuf": np.int8,
    "slo": np.int64,
}
KIND_NAMES = ("send", "recv", "recv_reduce", "copy", "reduce", "coll")


def split(lo: npt.ArrayLike, hi: npt.ArrayLike, parts: int) -> np.ndarray:
    """Cut ``[lo, hi)`` into ``parts`` contiguous pieces, the first ``len % parts`` one
    element longer.

    Vectorised over ``lo`` and ``hi``: returns boundaries of shape ``(..., parts + 1)``.
    Every rank computes the same offsets, which is what makes the schedule agree
    across ranks.
    """
    lo = np.asarray(lo, dtype=np.int64)
    hi = np.asarray(hi, dtype=np.int64)
    length = hi - lo
    base, extra = np.divmod(length, parts)
    j = np.arange(parts + 1, dtype=np.int64)
    return lo[..., None] + j * base[..., None] + np.minimum(j, extra[..., None])


#: Bytes one operation takes at the peak of building a schedule and simulating it
#: (measured: about 160 while building, 60 in the schedule, 90 in the simulator).
BYTES_PER_OP = 250


def memory_available() -> int:
    """Bytes this process may still allocate: the smallest of the memory the kernel
    reports available, the cgroup's remaining limit and the address-space limit."""
    limits = []
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
                    break
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as fh:
            text = fh.read().strip()
        if text != "max":
            with open("/sys/fs/cgroup/memory.current") as fh:
                limits.append(int(text) - int(fh.read().strip()))
    except (OSError, ValueError):
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft not in (resource.RLIM_INFINITY, -1):
            limits.append(soft)
    except (ImportError, OSError, ValueError):
        pass
    return max(0, min(limits)) if limits else 1 << 62


def check_size(name: str, n_ops: int, *, per_op: int = BYTES_PER_OP, **what: object) -> None:
    """Raise :class:`~optcc_mpi.errors.TooLargeError` before building a schedule of about
    ``n_ops`` operations that would not fit in the memory available.

    Builders call this with their own estimate, so an oversized request fails with a
    message instead of being killed by the kernel part-way through. ``what`` names the
    parameters that made it large (shown in the message).
    """
    need = int(n_ops) * per_op
    have = memory_available()
    if need > have:
        detail = ", ".join(f"{k}={v}" for k, v in what.items())
        raise TooLargeError(
            f"{name} ({detail}): about {n_ops / 1e6:.1f} million operations, "
            f"{need / 2**30:.1f} GiB to build and simulate, but only "
            f"{have / 2**30:.1f} GiB of memory is available; use fewer ranks, fewer "
            "segments or larger chunks"
        )


@dataclass(frozen=True)
class Program:
    """One rank's operations, in program order, with local dependency lists.

    Attributes are plain Python lists: the executor walks them one operation at a time,
    where list indexing is much cheaper than NumPy scalar access.
    """

    rank: int
    ops: list[tuple[int, int, int, int, int, int, int, int]]
    """(kind, peer, chan, buf, lo, hi, sbuf, slo) per operation."""
    deps: list[list[int]]
    """Local indices each operation waits for."""
    dependents: list[list[int]]
    """Local indices that wait for each operation."""
    qprev: list[int]
    """Local index of the previous operation of the same queue, or -1."""
    qnext: list[int]
    """Local index of the next operation of the same queue, or -1."""


@dataclass(frozen=True, eq=False)
class Schedule:
    """A collective as per-rank programs of point-to-point operations.

    All per-operation data is stored as flat arrays over every rank's operations
    (structure of arrays), ordered by operation id; a rank's program is its operations in
    id order. This keeps schedules for thousands of ranks compact and lets the simulator
    and verifier work with NumPy.
    """

    name: str
    p: int
    count: int
    kind: np.ndarray
    rank: np.ndarray
    peer: np.ndarray
    chan: np.ndarray
    buf: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    sbuf: np.ndarray
    slo: np.ndarray
    dep_ptr: np.ndarray
    dep_idx: np.ndarray
    scratch: int = 0
    params: Params = field(default_factory=dict)

    # -- basic queries ----------------------------------------------------------------------
    @property
    def n_ops(self) -> int:
        """Number of operations over all ranks."""
        return int(self.kind.size)

    @property
    def length(self) -> np.ndarray:
        """Elements each operation touches."""
        return self.hi - self.lo

    def deps(self, op: int) -> np.ndarray:
        """Global ids of the operations ``op`` waits for."""
        return self.dep_idx[self.dep_ptr[op] : self.dep_ptr[op + 1]]

    @cached_property
    def _rank_order(self) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(self.rank, kind="stable")
        ptr = np.zeros(self.p + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.rank, minlength=self.p), out=ptr[1:])
        return order, ptr

    def op_ids(self, rank: int) -> np.ndarray:
        """Global ids of ``rank``'s operations, in program order."""
        order, ptr = self._rank_order
        return order[ptr[rank] : ptr[rank + 1]]

    def program(self, rank: int) -> Program:
        """Rank ``rank``'s program with local dependency lists (cached)."""
        cache = self.__dict__.setdefault("_programs", {})
        prog = cache.get(rank)
        if prog is None:
            prog = self._make_program(rank)
            cache[rank] = prog
        return prog

    def _make_program(self, rank: int) -> Program:
        ids = self.op_ids(rank)
        local = {int(g): i for i, g in enumerate(ids)}
        cols = (self.kind, self.peer, self.chan, self.buf, self.lo, self.hi, self.sbuf, self.slo)
        rows = np.stack([c[ids].astype(np.int64) for c in cols], axis=1).tolist()
        ops = [tuple(r) for r in rows]
        deps: list[list[int]] = []
        dependents: list[list[int]] = [[] for _ in ids]
        for i, g in enumerate(ids):
            mine = [local[int(d)] for d in self.deps(int(g))]
            deps.append(mine)
            for d in mine:
                dependents[d].append(i)
        qprev = [local.get(int(q), -1) for q in self.queue_prev[ids]]
        qnext = [-1] * len(ids)
        for i, q in enumerate(qprev):
            if q >= 0:
                qnext[q] = i
        return Program(
            rank=rank, ops=ops, deps=deps, dependents=dependents, qprev=qprev, qnext=qnext
        )

    # -- matching ---------------------------------------------------------------------------
    @cached_property
    def _queue_order(self) -> tuple[np.ndarray, np.ndarray]:
        """Point-to-point and ``COLL`` op ids sorted by queue, and each one's position in
        its queue (see :func:`_queues`; the builder hands over the copy it computed)."""
        return _queues(self.kind, self.rank, self.peer, self.chan)

    @cached_property
    def partner(self) -> np.ndarray:
        """For each point-to-point op, the id of the op it matches on the other rank.

        The k-th send from a to b on channel c matches the k-th receive at b from a on c.
        ``-1`` for local and ``COLL`` operations. Raises ValueError when a queue has
        unequal numbers of sends and receives or a pair has unequal lengths: such a
        schedule would hang or corrupt data under MPI.
        """
        partner = np.full(self.n_ops, -1, dtype=np.int64)
        ids, _ = self._queue_order
        kind = self.kind[ids]
        # The queue order sorts by (rank, peer, channel) and keeps program order inside a
        # queue: sends come out ordered by (sender, receiver, channel, position) already;
        # receives need one more stable sort by (sender, receiver, channel).
        sends = ids[kind == SEND]
        recvs = ids[(kind == RECV) | (kind == RECV_REDUCE)]
        del kind
        p = np.int64(self.p)
        c = np.int64(int(self.chan.max(initial=0)) + 1)
        s_key = (self.rank[sends].astype(np.int64) * p + self.peer[sends]) * c + self.chan[sends]
        r_key = (self.peer[recvs].astype(np.int64) * p + self.rank[recvs]) * c + self.chan[recvs]
        order = np.argsort(r_key, kind="stable")
        recvs, r_key = recvs[order], r_key[order]
        del order
        if sends.size != recvs.size or not np.array_equal(s_key, r_key):
            s3 = np.stack([self.rank[sends], self.peer[sends], self.chan[sends]], axis=1)
            r3 = np.stack([self.peer[recvs], self.rank[recvs], self.chan[recvs]], axis=1)
            raise ArgumentError(f"{self.name}: unmatched messages: {_first_unmatched(s3, r3)}")
        del s_key, r_key
        bad = (self.hi[sends] - self.lo[sends]) != (self.hi[recvs] - self.lo[recvs])
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            a, b, ch = self.rank[sends[j]], self.peer[sends[j]], self.chan[sends[j]]
            raise ArgumentError(
                f"{self.name}: message {a}->{b} on channel {ch}: send of "
                f"{self.length[sends[j]]} elements meets receive of {self.length[recvs[j]]}"
            )
        partner[sends] = recvs
        partner[recvs] = sends
        self.__dict__["partner"] = partner
        self._release_queue_order()
        return partner

    @cached_property
    def queue_prev(self) -> np.ndarray:
        """For each point-to-point or ``COLL`` op, the previous op of its queue, or -1.

        A queue is (rank, peer, channel, direction); a rank's collectives form one more.
        The executor posts the operations of a queue in program order; this is what keeps
        message matching deterministic.
        """
        prev = np.full(self.n_ops, -1, dtype=np.int64)
        ids, pos = self._queue_order
        later = np.flatnonzero(pos > 0)
        prev[ids[later]] = ids[later - 1]
        self.__dict__["queue_prev"] = prev
        self._release_queue_order()
        return prev

    def _release_queue_order(self) -> None:
        """Drop the queue order (16 bytes per operation) once both matching and queue
        predecessors, the only things computed from it, are cached."""
        if "partner" in self.__dict__ and "queue_prev" in self.__dict__:
            self.__dict__.pop("_queue_order", None)

    def describe(self) -> str:
        """One line: name, size, operation counts, parameters."""
        kinds = np.bincount(self.kind, minlength=len(KIND_NAMES))
        parts = ", ".join(f"{KIND_NAMES[k]}={n}" for k, n in enumerate(kinds) if n)
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.name}(p={self.p}, count={self.count}; {parts}; {params})"

    def __repr__(self) -> str:
        return f"<Schedule {self.describe()}>"


class ScheduleBuilder:
    """Accumulates operations, vectorised over ranks, and builds a :class:`Schedule`.

    Each method takes array-likes (broadcast together) so one call adds the same step for
    many ranks, and returns the new operations' global ids (``-1`` where the range was
    empty and nothing was added). Ids grow in call order, so the order of calls is each
    rank's program order.

    Parameters
    ----------
    p, count : int
        Ranks and elements.
    name : str
        Algorithm name, kept in the schedule.
    scratch : int
        Elements of work space (buffer 1) every rank needs.
    window : int or None
        If set, each point-to-point operation also waits for the operation ``window``
        places earlier in its queue (same rank, peer, channel and direction). This bounds
        the messages in flight per connection, and with them the executor's temporary
        memory, and is visible to every reader like any other dependency.
    **params
        Algorithm parameters, recorded in the schedule.
    """

    def __init__(
        self,
        p: int,
        count: int,
        name: str,
        *,
        scratch: int = 0,
        window: int | None = None,
        **params: object,
    ) -> None:
        if p < 1:
            raise ArgumentError(f"schedule needs at least one rank, got p={p}")
        if count < 0:
            raise ArgumentError(f"element count must be >= 0, got {count}")
        self.p = int(p)
        self.count = int(count)
        self.name = name
        self.scratch = int(scratch)
        self.window = window
        self.params = dict(params)
        # One list of arrays per column, each already in the schedule's dtype: building a
        # large schedule is then one concatenation per column (no row-major table to
        # transpose), and the columns take 39 bytes per operation, not 72.
        self._cols: dict[str, list[np.ndarray]] = {k: [] for k in _COLUMNS}
        self._dep_op: list[np.ndarray] = []
        self._dep_on: list[np.ndarray] = []
        self._next = 0

    # -- primitive ---------------------------------------------------------------------
    def _add(
        self,
        kind: int,
        rank: npt.ArrayLike,
        peer: npt.ArrayLike,
        lo: npt.ArrayLike,
        hi: npt.ArrayLike,
        *,
        chan: npt.ArrayLike = 0,
        buf: npt.ArrayLike = 0,
        sbuf: npt.ArrayLike = 0,
        slo: npt.ArrayLike = 0,
        deps: Deps = (),
    ) -> np.ndarray:
        values = {
            "kind": kind,
            "rank": rank,
            "peer": peer,
            "chan": chan,
            "buf": buf,
            "lo": lo,
            "hi": hi,
            "sbuf": sbuf,
            "slo": slo,
        }
        arrays = {k: np.asarray(v) for k, v in values.items()}
        shape = np.broadcast_shapes(*(a.shape for a in arrays.values()))
        n = int(np.prod(shape, dtype=np.int64))
        lo_a = np.broadcast_to(arrays["lo"], shape).ravel()
        hi_a = np.broadcast_to(arrays["hi"], shape).ravel()
        keep = hi_a > lo_a
        n_keep = int(np.count_nonzero(keep))
        ids = np.full(n, -1, dtype=np.int64)
        new_ids = np.arange(self._next, self._next + n_keep, dtype=np.int64)
        ids[keep] = new_ids
        self._next += n_keep
        everything = n_keep == n
        for key, dtype in _DTYPES.items():
            a = arrays[key]
            if a.ndim == 0:
                col = np.full(n_keep, a, dtype=dtype)
            else:
                col = np.broadcast_to(a, shape).ravel()
                col = (col if everything else col[keep]).astype(dtype, copy=False)
            self._cols[key].append(col)
        for dep in _dep_list(deps):
            d = np.asarray(dep, np.int64)
            if d.ndim == 0:
                if d >= 0 and n_keep:
                    self._dep_op.append(new_ids)
                    self._dep_on.append(np.full(n_keep, d, dtype=np.int64))
                continue
            d = np.broadcast_to(d, shape).ravel()
            if not everything:
                d = d[keep]
            has = d >= 0
            if has.all():
                self._dep_op.append(new_ids)
                self._dep_on.append(np.ascontiguousarray(d))
            elif has.any():
                self._dep_op.append(new_ids[has])
                self._dep_on.append(d[has])
        return ids.reshape(shape)

    @property
    def next_id(self) -> int:
        """Id the next added operation will get (mark a point in program order)."""
        return self._next

    def _column(self, key: str) -> np.ndarray:
        """One column so far, merged in place (so cheap to ask again)."""
        parts = self._cols[key]
        if len(parts) != 1:
            self._cols[key] = [np.concatenate(parts) if parts else np.zeros(0, dtype=_DTYPES[key])]
        return self._cols[key][0]

    def column(self, key: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Column ``key`` (``"kind"``, ``"rank"``, ...) of the operations added between
        marks ``start`` and ``stop`` (a view: do not modify)."""
        return self._column(key)[start:stop]

    def _deps(self) -> tuple[np.ndarray, np.ndarray]:
        """All dependencies so far, as (op, on) arrays, merged in place."""
        for lst in (self._dep_op, self._dep_on):
            if len(lst) != 1:
                merged = np.concatenate(lst) if lst else np.zeros(0, np.int64)
                lst.clear()
                lst.append(merged)
        return self._dep_op[0], self._dep_on[0]

    def sinks(self, start: int, stop: int | None = None) -> dict[int, np.ndarray]:
        """Per rank, the operations added between marks ``start`` and ``stop`` that no
        other operation of that stretch waits for.

        Every operation of the stretch is one of these or an ancestor of one, so waiting
        for the sinks is waiting for all of it, with few dependencies.
        """
        stop = self._next if stop is None else stop
        ranks = self._column("rank")[start:stop]
        waited = np.zeros(stop - start, dtype=bool)
        op, on = self._deps()
        inside = (op >= start) & (op < stop) & (on >= start) & (on < stop)
        waited[on[inside] - start] = True
        ids = np.arange(start, stop)[~waited]
        ranks = ranks[~waited]
        order = np.argsort(ranks, kind="stable")
        ids, ranks = ids[order], ranks[order]
        cuts = np.flatnonzero(np.diff(ranks)) + 1
        return {int(g[0]): i for g, i in zip(np.split(ranks, cuts), np.split(ids, cuts)) if g.size}

    def depend(self, ops: npt.ArrayLike, on: npt.ArrayLike) -> None:
        """Make ``ops`` also wait for ``on`` (array-likes broadcast together; -1 ignored).

        For orderings known only after both operations exist, e.g. pacing one rank's
        messages across several queues.
        """
        ops_a, on_a = (
            a.ravel()
            for a in np.broadcast_arrays(np.asarray(ops, np.int64), np.asarray(on, np.int64))
        )
        has = (ops_a >= 0) & (on_a >= 0)
        if has.any():
            self._dep_op.append(ops_a[has])
            self._dep_on.append(on_a[has])

    def chain(self, ops: npt.ArrayLike, window: int) -> None:
        """Make each of ``ops`` (one rank's operations, in program order; -1 ignored) wait
        for the one ``window`` places before it: at most ``window`` of them in flight."""
        ids = np.asarray(ops, np.int64).ravel()
        ids = ids[ids >= 0]
        if window > 0 and ids.size > window:
            self.depend(ids[window:], ids[:-window])

    def stream(self, ops: npt.ArrayLike, window: int, state: list[int]) -> None:
        """Append ``ops`` (in the given order) to a stream of one rank's operations held in
        ``state``, each waiting for the one ``window`` places before it in the stream.

        Per-queue windows bound what is in flight on one connection; a stream bounds it
        across connections, so that (for example) a straggler works through segments
        oldest first instead of sharing its link among all of them.
        """
        ids = np.asarray(ops, np.int64).ravel()
        ids = ids[ids >= 0]
        if not ids.size:
            return
        joined = np.concatenate([np.asarray(state[-window:], np.int64), ids])
        if joined.size > window:
            self.depend(joined[window:][-ids.size :], joined[: joined.size - window][-ids.size :])
        state.extend(ids.tolist()[-window:])
        del state[:-window]

    # -- point to point -------------------------------------------------------------------
    def send(
        self,
        rank: npt.ArrayLike,
        peer: npt.ArrayLike,
        lo: npt.ArrayLike,
        hi: npt.ArrayLike,
        *,
        chan: npt.ArrayLike = 0,
        buf: npt.ArrayLike = 0,
        deps: Deps = (),
    ) -> np.ndarray:
        """Send ``buf[lo:hi]`` from ``rank`` to ``peer``."""
        return self._add(SEND, rank, peer, lo, hi, chan=chan, buf=buf, deps=deps)

    def recv(
        self,
        rank: npt.ArrayLike,
        peer: npt.ArrayLike,
        lo: npt.ArrayLike,
        hi: npt.ArrayLike,
        *,
        chan: npt.ArrayLike = 0,
        buf: npt.ArrayLike = 0,
        reduce: bool = False,
        deps: Deps = (),
    ) -> np.ndarray:
        """Receive at ``rank`` from ``peer`` into ``buf[lo:hi]``, reducing if ``reduce``."""
        kind = RECV_REDUCE if reduce else RECV
        return self._add(kind, rank, peer, lo, hi, chan=chan, buf=buf, deps=deps)

    def transfer(
        self,
        src: npt.ArrayLike,
        dst: npt.ArrayLike,
        lo: npt.ArrayLike,
        hi: npt.ArrayLike,
        *,
        chan: npt.ArrayLike = 0,
        reduce: bool = False,
        send_deps: Deps = (),
        recv_deps: Deps = (),
    ) -> tuple[np.ndarray, np.ndarray]:
        """Both sides of a message ``src -> dst`` of ``[lo, hi)`` (same offsets).

        Returns ``(send_ids, recv_ids)``. The send is added first, so on a rank that both
        sends and receives in one call the send comes first in its program.
        """
        s = self.send(src, dst, lo, hi, chan=chan, deps=send_deps)
        r = self.recv(dst, src, lo, hi, chan=chan, reduce=reduce, deps=recv_deps)
        return s, r

    # -- local ------------------------------------------------------------------------------
    def copy(
        self,
        rank: npt.ArrayLike,
        lo: npt.ArrayLike,
        hi: npt.ArrayLike,
        slo: npt.ArrayLike,
        *,
        buf: npt.ArrayLike = 0,
        sbuf: npt.ArrayLike = 0,
        deps: Deps = (),
    ) -> np.ndarray:
        """``buf[lo:hi] = sbuf[slo:slo + hi - lo]`` on ``rank``."""
        return self._add(COPY, rank, -1, lo, hi, buf=buf, sbuf=sbuf, slo=slo, deps=deps)

    def reduce(
        self,
        rank: npt.ArrayLike,
        lo: npt.ArrayLike,
        hi: npt.ArrayLike,
        slo: npt.ArrayLike,
        *,
        buf: npt.ArrayLike = 0,
        sbuf: npt.ArrayLike = 0,
        deps: Deps = (),
    ) -> np.ndarray:
        """``buf[lo:hi] op= sbuf[slo:slo + hi - lo]`` on ``rank``."""
        return self._add(REDUCE, rank, -1, lo, hi, buf=buf, sbuf=sbuf, slo=slo, deps=deps)

    def coll(self, lo: npt.ArrayLike, hi: npt.ArrayLike, *, deps: Deps = ()) -> np.ndarray:
        """The MPI library's AllReduce of ``[lo, hi)``, one operation on every rank."""
        ranks = np.arange(self.p)
        return self._add(COLL, ranks, -1, lo, hi, deps=deps)

    # -- result -----------------------------------------------------------------------------
    def build(self) -> Schedule:
        """Check the operations and return the immutable :class:`Schedule`."""
        cols = {k: self._column(k) for k in _COLUMNS}
        self._cols = {k: [] for k in _COLUMNS}  # the schedule owns the columns now
        n = self._next
        self._check(cols)
        dep_op, dep_on = self._deps()
        self._dep_op, self._dep_on = [], []
        kind, rank, peer, chan = cols["kind"], cols["rank"], cols["peer"], cols["chan"]
        q_ids, q_pos = _queues(kind, rank, peer, chan)
        if self.window:
            far = q_pos >= self.window
            dep_op = np.concatenate([dep_op, q_ids[far]])
            dep_on = np.concatenate([dep_on, q_ids[np.flatnonzero(far) - self.window]])
        if dep_op.size:
            bad = dep_on >= dep_op
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ArgumentError(
                    f"{self.name}: op {dep_op[i]} depends on later op {dep_on[i]} "
                    "(dependencies must point backwards in program order)"
                )
            bad = rank[dep_op] != rank[dep_on]
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ArgumentError(
                    f"{self.name}: op {dep_op[i]} (rank {rank[dep_op[i]]}) depends on op "
                    f"{dep_on[i]} of rank {rank[dep_on[i]]}; dependencies are per rank"
                )
            del bad
            # Sort by op, then dependency, and drop duplicates, through one integer key.
            # Dependencies arrive mostly in order, so a stable (merging) sort is cheap.
            key = dep_op * max(n, 1)
            key += dep_on
            del dep_op, dep_on
            key.sort(kind="stable")
            dup = np.flatnonzero(key[1:] == key[:-1])
            if dup.size:
                key = np.delete(key, dup + 1)
            dep_op, dep_on = np.divmod(key, max(n, 1))
            del key
        dep_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(dep_op, minlength=n), out=dep_ptr[1:])
        del dep_op
        sched = Schedule(
            name=self.name,
            p=self.p,
            count=self.count,
            kind=kind,
            rank=rank,
            peer=peer,
            chan=chan,
            buf=cols["buf"],
            lo=cols["lo"],
            hi=cols["hi"],
            sbuf=cols["sbuf"],
            slo=cols["slo"],
            dep_ptr=dep_ptr,
            dep_idx=dep_on,
            scratch=self.scratch,
            params=dict(self.params),
        )
        # The queues were needed for the window; keep them rather than sort again.
        sched.__dict__["_queue_order"] = (q_ids, q_pos)
        return sched

    def _check(self, cols: dict[str, np.ndarray]) -> None:
        kind, rank, peer = cols["kind"], cols["rank"], cols["peer"]
        if np.any((rank < 0) | (rank >= self.p)):
            raise ArgumentError(f"{self.name}: operation on a rank outside 0..{self.p - 1}")
        comm = kind <= RECV_REDUCE
        bad = comm & ((peer < 0) | (peer >= self.p) | (peer == rank))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ArgumentError(f"{self.name}: op {i} on rank {rank[i]} has invalid peer {peer[i]}")
        del comm, bad
        # Target ranges within their buffers; sources of local operations too. Masks per
        # buffer rather than a per-operation size array: this runs over every operation.
        lo, hi, bufs = cols["lo"], cols["hi"], cols["buf"]
        bad = (bufs < 0) | (bufs > 1) | (lo < 0)
        bad |= (bufs == 0) & (hi > self.count)
        bad |= (bufs == 1) & (hi > self.scratch)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ArgumentError(
                f"{self.name}: op {i} ({KIND_NAMES[kind[i]]}) target range "
                f"[{lo[i]}, {hi[i]}) of buffer {bufs[i]} is out of bounds"
            )
        local = np.flatnonzero((kind == COPY) | (kind == REDUCE))
        if local.size:
            slo, sb = cols["slo"][local], cols["sbuf"][local]
            shi = slo + (hi[local] - lo[local])
            size = np.where(sb == 0, self.count, self.scratch)
            bad = (sb < 0) | (sb > 1) | (slo < 0) | (shi > size)
            if bad.any():
                j = int(np.flatnonzero(bad)[0])
                i = int(local[j])
                raise ArgumentError(
                    f"{self.name}: op {i} ({KIND_NAMES[kind[i]]}) source range "
                    f"[{slo[j]}, {shi[j]}) of buffer {sb[j]} is out of bounds"
                )


def _dep_list(deps: Deps) -> list[npt.ArrayLike]:
    """Normalise ``deps``: one array-like, or a (possibly nested) list/tuple of them."""
    if isinstance(deps, (list, tuple)):
        out: list[npt.ArrayLike] = []
        for d in deps:
            out.extend(_dep_list(d))
        return out
    return [cast("npt.ArrayLike", deps)]  # not a list or tuple: one array-like


def _queues(
    kind: np.ndarray, rank: np.ndarray, peer: np.ndarray, chan: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Point-to-point op ids grouped by queue (rank, peer, channel, direction), each queue
    in program order, and each op's position within its queue."""
    # Collectives form one more queue per rank: they too must be posted in program order.
    ids = np.flatnonzero((kind <= RECV_REDUCE) | (kind == COLL))
    k = kind[ids]
    direction = np.where(k == SEND, 1, np.where(k == COLL, 2, 0)).astype(np.int64)
    del k
    # One integer key per queue; a stable sort keeps each queue in program (id) order.
    p = np.int64(int(max(rank.max(initial=0), peer.max(initial=0))) + 2)
    c = np.int64(int(chan.max(initial=0)) + 1)
    key = rank[ids].astype(np.int64) * p
    key += peer[ids] + 1
    key *= c
    key += chan[ids]
    key *= 3
    key += direction
    del direction
    order = np.argsort(key, kind="stable")
    ids, key = ids[order], key[order]
    del order
    new = np.ones(ids.size, dtype=bool)
    np.not_equal(key[1:], key[:-1], out=new[1:])
    del key
    start = np.maximum.accumulate(np.where(new, np.arange(ids.size), 0))
    return ids, np.arange(ids.size) - start


def _first_unmatched(s_key: np.ndarray, r_key: np.ndarray) -> str:
    """Describe the first queue whose sends and receives do not pair up."""

    def counts(keys: np.ndarray) -> dict[tuple[int, int, int], int]:
        if not keys.size:
            return {}
        uniq, n = np.unique(keys, axis=0, return_counts=True)
        return {(int(k[0]), int(k[1]), int(k[2])): int(c) for k, c in zip(uniq, n)}

    cs, cr = counts(s_key), counts(r_key)
    for key in sorted(set(cs) | set(cr)):
        if cs.get(key, 0) != cr.get(key, 0):
            a, b, c = key
            return (
                f"{cs.get(key, 0)} sends from rank {a} to rank {b} on channel {c} "
                f"but {cr.get(key, 0)} receives"
            )
    return "queues differ"
