"""R2CCL-AllReduce: the state-of-the-art baseline for a degraded server.

The composition of R2CCL's AllReduce, written with our own point-to-point blocks so the
comparison with OptCC is like for like (see ``docs/optcc.md`` for the source):

1. cut the buffer into a *main* part and a *tail* of share Y = X, the bandwidth lost at
   the degraded rank (rounded down to a multiple of 16 bytes, as R2CCL does);
2. main part: ring AllReduce over all ranks;
3. tail: (a) ring reduce-scatter over the healthy ranks only, (b) a pipelined reduce of the
   degraded ranks' raw tails into the helpers, chunk by chunk, (c) a pipelined broadcast
   of the finished tail from the helpers to every rank.

The healthy ranks' reduce-scatter of the tail runs beside the main AllReduce (its
all-gather is the broadcast of the finished tail). When a degraded rank sends its raw
tail: ``schedule=1`` once its part of the main AllReduce is done (R2CCL's overlap
schedule 1), ``schedule=0`` as soon as its data allows, ``schedule=2`` (ours) in step
with the rank's part of the main AllReduce; by default 2 where the main ring is
pipelined finely enough to make room for it, 1 otherwise (:func:`raw_schedule`).

Reduce and broadcast on a flat network (ours)
---------------------------------------------
In R2CCL the degraded server's GPUs reduce their tails among themselves over NVLink, so
the tail crosses the degraded NICs once in each direction: that is the model's
``T3 = Y n / ((1-X) B)``. Our network model has one NIC per rank and no NVLink, so a
reduce chained through the degraded ranks (and a broadcast chained back) would carry
every degraded rank's tail through every other degraded NIC: 2 Y n each way instead of
Y n (simulated, p = 16 with 8 ranks at half rate: +107% over the fault-free ring against
the model's +53%, slower than the plain ring). So each chunk of the tail has its own
helper (the healthy ranks in turn, R2CCL's "first healthy rank" being the helper of the
first chunk): every degraded rank sends its raw chunk straight to that chunk's helper,
which adds them (in a fixed order) to its healthy partial sum, and the helper sends the
finished chunk straight back to every degraded rank; the healthy ranks all-gather the
finished chunks. Each degraded NIC then carries its tail once each way, as in R2CCL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from optcc_mpi.algorithms import register
from optcc_mpi.algorithms._policy import (
    MAX_AUTO_OPS,
    Fabric,
    fabric_of,
    large_messages,
    message_bytes,
)
from optcc_mpi.algorithms.ring import add_ring_allreduce, reduce_scatter, ring_chunks
from optcc_mpi.errors import ArgumentError
from optcc_mpi.links import Links
from optcc_mpi.model import fault_free, fractions
from optcc_mpi.schedule import SEND, Schedule, ScheduleBuilder, check_size, split

__all__ = [
    "PACED_MIN_CHUNKS",
    "r2ccl",
    "r2ccl_time",
    "r2ccl_cost_gap",
    "raw_schedule",
    "tail_share",
]

#: With ``schedule=2``, the share of a degraded rank's main-ring sends by whose
#: completion all its raw tail sends have been released (see :func:`r2ccl`).
RAW_SPREAD = 0.5

#: Pipeline chunks per section of the main ring from which ``schedule=2`` is the default.
PACED_MIN_CHUNKS = 8

#: Rounds of the finished tail round the healthy ranks' ring, per unit of the degraded
#: rate ``fmin / fmax`` (at least; see :func:`r2ccl`).
RING_ROUNDS = 8


def _pace(
    b: ScheduleBuilder,
    ranks: list[int],
    lead: tuple[int, int],
    follow: tuple[int, int],
    share: float = 1.0,
) -> None:
    """Make each rank's sends among the ops ``follow`` keep pace with its sends among
    ``lead``: the q-th of Q waits until the ceil((q+1) share M / Q)-th of M has completed
    (``share`` < 1 lets the follower finish when the leader is that far).

    R2CCL's model runs the healthy AllReduce of the tail on the bandwidth the main
    AllReduce leaves spare (it is held back by the degraded ranks). Sharing a NIC first
    come first served, the tail's messages would instead take their turn with the main
    ring's and slow the ring down, and with it the degraded ranks (simulated, p = 16 with
    one rank at 3/4: 13% above the model); paced, the tail fills the gaps.
    """

    def sends(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Send ids sorted by rank, where each rank's run starts, and its length."""
        kind, rank = b.column("kind", lo, hi), b.column("rank", lo, hi)
        ids = np.flatnonzero(kind == SEND)
        r = rank[ids]
        order = np.argsort(r, kind="stable")
        count = np.bincount(r, minlength=b.p)
        start = np.concatenate(([0], np.cumsum(count)[:-1]))
        return lo + ids[order], start, count

    lead_ids, lead_start, lead_n = sends(*lead)
    fol_ids, fol_start, fol_n = sends(*follow)
    want = np.zeros(b.p, dtype=bool)
    want[list(ranks)] = True
    owner = np.repeat(np.arange(b.p), fol_n)  # rank of each follower send
    q = np.arange(fol_ids.size) - fol_start[owner]
    M, Q = lead_n[owner], fol_n[owner]
    step = np.ceil((q + 1) * (share * M / np.maximum(Q, 1))).astype(np.int64) - 1
    ok = want[owner] & (M > 0) & (step >= 0)
    b.depend(fol_ids[ok], lead_ids[lead_start[owner[ok]] + np.minimum(step[ok], M[ok] - 1)])


def raw_schedule(main_chunks: int) -> int:
    """The default overlap schedule for a main ring of ``main_chunks`` chunks per section.

    Schedule 2 slots the raw tail's messages between the degraded rank's main-ring
    messages; that pays when the main ring has many of them, and costs when it has few
    (each raw message then holds up a large share of a ring step, and the whole ring waits
    for it). Simulated time over R2CCL's model, 90 runs (the 21 non-random profiles of
    ``python -m optcc_mpi.lab.profiles`` and 9 more: one rank at 0.5 to 0.875, servers of
    4 and 8 ranks, two servers, p = 8 to 128, at 64 MiB, 256 MiB and 1 GiB per rank):
    with at least :data:`PACED_MIN_CHUNKS` chunks per section schedule 2 is at most
    0.002 above schedule 1 and up to 0.069 below it (47 runs); with fewer it is up to
    0.031 above (43 runs). Measured, ours.
    """
    return 2 if main_chunks >= PACED_MIN_CHUNKS else 1


def tail_share(count: int, itemsize: int, loss: float) -> int:
    """Tail elements: ``loss`` of the buffer, rounded down to a multiple of 16 bytes."""
    tail_bytes = int(count * itemsize * loss) // 16 * 16
    return min(count, tail_bytes // itemsize)


def r2ccl_time(
    p: int,
    nbytes: float,
    bw: float,
    links: Links | str | None = None,
    *,
    latency: float = 0.0,
    chunks: int | None = None,
) -> float:
    """R2CCL-AllReduce under its own cost model (from R2CCL's code).

    ``T = max(T1, T2) + T3`` with ``Y = X`` (tail share = bandwidth lost at the worst
    rank): T1 the main AllReduce of ``(1-Y) n`` held back by the degraded rank, T2 the
    healthy-only AllReduce of ``Y n`` on spare bandwidth, T3 the tail crossing the
    degraded link once, ``(1 + 1/K) Y n / ((1-X) B)`` with K pipeline chunks
    (``chunks=None``: K -> infinity). With several degraded ranks X is the largest loss.
    Plus one latency per ring step, 2(p-1).
    """
    if p < 2:
        return 0.0
    f = fractions(links, p)
    fmin = float(f.min())
    x = 1.0 - fmin
    if x <= 0.0:
        return fault_free(p, nbytes, bw) + 2 * (p - 1) * latency
    y = x
    m = int(np.sum(f < 1.0))
    h = p - m
    t1 = 2.0 * (p - 1) / p * (1 - y) * nbytes / (fmin * bw)
    t2 = 2.0 * (h - 1) / h * y * nbytes / (x * bw) if h > 1 else 0.0
    k_term = 1.0 if chunks is None else 1.0 + 1.0 / chunks
    t3 = k_term * y * nbytes / (fmin * bw)
    return max(t1, t2) + t3 + 2 * (p - 1) * latency


def r2ccl_cost_gap(p: int, links: Links) -> str | None:
    """Where :func:`r2ccl_time` cannot describe the schedule: with three or more ranks of
    which only one is at the top rate (a random vector, for one), that rank is the only
    helper and every degraded rank's raw tail goes into it, a load the model leaves out
    (docs/optcc.md, "R2CCL"). None elsewhere."""
    f = fractions(links, p)
    healthy = int(np.sum(f == f.max()))
    if p < 3 or healthy != 1:
        return None
    return (
        "every rank but the fastest is degraded, so R2CCL's composition reduces all their "
        "tails into the one healthy rank, a load its cost model leaves out (that rank's "
        "traffic alone is 1.24 to 1.60 x the model at p = 4 and 8; docs/optcc.md, "
        '"R2CCL"): no schedule of that composition can meet the model there'
    )


@register(
    summary="R2CCL-AllReduce: main part over all ranks, tail over the healthy ranks",
    cost=r2ccl_time,
    cost_gap=r2ccl_cost_gap,
    auto=large_messages,
    order=20,
)
def r2ccl(
    p: int,
    count: int,
    links: Links | None = None,
    *,
    itemsize: int = 4,
    chunks: int = 16,
    window: int = 2,
    chunk_bytes: int | None = None,
    fabric: str | Fabric = "network",
    schedule: int | None = None,
) -> Schedule:
    """R2CCL-AllReduce schedule.

    Parameters
    ----------
    p, count : int
        Ranks and elements.
    links : Links
        Degraded ranks; the tail share is the largest bandwidth loss among them. With no
        degraded rank (or when every rank is degraded) this is the ring.
    itemsize : int
        Bytes per element.
    chunks : int
        K, pipeline chunks of the tail's reduce and broadcast (R2CCL allows up to 16);
        more are used when chunks would exceed ``chunk_bytes``, and at least one per
        healthy rank (each chunk has its own helper).
    window : int
        Messages in flight per connection.
    chunk_bytes : int, optional
        Message size target of the rings; default from ``fabric``
        (:func:`optcc_mpi.algorithms._policy.message_bytes`, sized for the full ring's
        sections).
    fabric : {"network", "shared-memory"} or Fabric
        What joins the ranks (set by :func:`optcc_mpi.allreduce`; see the ring).
    schedule : {None, 0, 1, 2}
        When a degraded rank sends its raw tail. R2CCL's overlap schedules: 1 once its
        part of the main AllReduce is done, 0 as soon as data allows. 2 (ours): released
        in step with its main-ring sends, all of them by :data:`RAW_SPREAD` of the way,
        so that the tail's reduce and broadcast overlap the main ring. ``None`` (the
        default): :func:`raw_schedule` of the main ring's chunks per section, i.e. 2 from
        :data:`PACED_MIN_CHUNKS` on. Simulated at 1 GiB per rank on the 21 profiles of
        ``python -m optcc_mpi.lab.profiles`` other than random vectors, schedule 1 is
        up to 1.065 x R2CCL's model and the default at most 1.028 x (docs/optcc.md,
        "R2CCL").
    """
    if schedule not in (None, 0, 1, 2):
        raise ArgumentError(f"r2ccl: schedule must be None, 0, 1 or 2, not {schedule!r}")
    if chunk_bytes is None:
        chunk_bytes = message_bytes(-(-count // max(p, 1)) * itemsize, fabric, window)
    else:
        fabric_of(fabric)  # the same error for an unknown fabric
    links = links if links is not None else Links()
    cut = _cut(
        p,
        count,
        links,
        itemsize=itemsize,
        chunks=chunks,
        chunk_bytes=chunk_bytes,
        schedule=schedule,
    )
    b = ScheduleBuilder(
        p,
        count,
        "r2ccl",
        window=window,
        tail=cut.tail,
        chunks=chunks,
        schedule=cut.schedule,
        broadcast="ring" if cut.ring else "trees",
        rounds=cut.per,
    )
    # 2. The main part: a ring AllReduce over all ranks.
    add_ring_allreduce(b, range(p), 0, cut.main_hi, chunks=cut.main_chunks, chan=0)
    main_end = b.next_id
    if cut.tail == 0:
        return b.build()
    main = _Main(end=main_end, done=b.sinks(0))
    # 3. The tail: (a) the healthy ranks' reduce-scatter, (b) the degraded ranks' raw
    # chunks into the helpers, (c) the finished chunks back to everyone.
    chunk = _TailChunks.of(cut, count)
    join = _healthy_reduce_scatter(b, cut, chunk, links)
    raw = _reduce_raw(b, cut, chunk, join)
    _release_raw(b, cut, raw, main, window)
    _broadcast_finished(b, cut, chunk, raw, join)
    return b.build()


# ------------------------------------------------------------------ the builder's phases


@dataclass(frozen=True)
class _Cut:
    """How one call is cut (what :func:`_cut` decides)."""

    healthy: list[int]
    """Ranks at the top rate: the helpers of the tail."""
    degraded: list[int]
    f: np.ndarray
    """Per-rank rates (:meth:`Links.vector`)."""
    loss: float
    """X, the bandwidth lost at the worst rank, relative to the top rate."""
    tail: int
    """Elements of the tail ``[main_hi, count)``; 0 without a degraded rank."""
    main_hi: int
    main_chunks: int
    """Chunks per section of the main ring."""
    schedule: int
    """The raw tail's overlap schedule, 0, 1 or 2 (the default resolved)."""
    rs_chunks: int
    """Messages per helper's section in the healthy ranks' reduce-scatter of the tail."""
    per: int
    """Chunks of the tail per helper (the rounds of the healthy ranks' broadcast ring)."""
    ring: bool
    """Whether the healthy ranks get the finished tail round a ring (else binomial trees)."""

    @property
    def h(self) -> int:
        return len(self.healthy)

    @property
    def m(self) -> int:
        return len(self.degraded)


def _cut(
    p: int,
    count: int,
    links: Links,
    *,
    itemsize: int,
    chunks: int,
    chunk_bytes: int,
    schedule: int | None,
) -> _Cut:
    """Decide the sizes: the tail's share (step 1 of the module docstring), the main
    ring's chunks, the overlap schedule, how finely the tail is cut, and whether the
    finished tail goes round the healthy ranks' ring or down trees. Refuses a schedule
    beyond the operation budget (:func:`optcc_mpi.schedule.check_size`)."""
    f = links.vector(p)
    degraded = [r for r in range(p) if f[r] < f.max()]
    healthy = [r for r in range(p) if f[r] == f.max()]
    loss = 1.0 - f.min() / f.max()
    tail = tail_share(count, itemsize, loss) if degraded else 0
    main_hi = count - tail
    h, m = len(healthy), len(degraded)
    main_chunks = ring_chunks(-(-main_hi // max(p, 1)), itemsize, chunk_bytes)
    if schedule is None:
        schedule = raw_schedule(main_chunks)
    # Messages per helper's section of the tail in the healthy reduce-scatter: at most
    # chunk_bytes each.
    rs_chunks = max(1, -(-tail * itemsize // max(1, h * chunk_bytes)))
    # Chunks per helper: K at least, and messages of at most chunk_bytes. The degraded
    # ranks start one chunk apart (_reduce_raw), so the broadcast of the first chunk starts
    # m chunks late: 16 m chunks keep that within the model's 1/K = 1/16.
    per = max(-(-max(chunks, 16 * m) // max(h, 1)), rs_chunks)
    per, ring = _broadcast_rounds(f, h, m, rs_chunks, per)
    check_size("r2ccl", 4 * p * p * main_chunks + _tail_ops(h, m, rs_chunks, per), p=p, degraded=m)
    return _Cut(
        healthy, degraded, f, loss, tail, main_hi, main_chunks, schedule, rs_chunks, per, ring
    )


def _tail_ops(h: int, m: int, rs_chunks: int, per: int) -> int:
    """Operations of the tail with ``per`` chunks per helper (an upper estimate)."""
    # the tail's reduce-scatter and broadcast among the healthy ranks; raw and finished
    # chunks to and from the degraded ranks (with slack); joins
    return 2 * h * h * (rs_chunks + per) + 6 * m * h * per + h


def _broadcast_rounds(f: np.ndarray, h: int, m: int, rs_chunks: int, per: int) -> tuple[int, bool]:
    """Chunks per helper, raised to :data:`RING_ROUNDS` ``fmin / fmax`` where the budget
    allows, and whether the healthy ranks get the finished tail round their ring (else
    along binomial trees)."""
    # The healthy ranks get the finished tail round their ring in rounds of h chunks. The
    # last round leaves when the degraded ranks are done and takes about tail / per at
    # the healthy rate, against the model's T3 = tail / fmin: with per >= RING_ROUNDS
    # fmin / fmax that is at most T3 / RING_ROUNDS (derived, ours). Simulated at 1 GiB,
    # p = 256 and 512, six profiles each: 2 or 3 rounds (what the sizes above gave)
    # 1.034 to 1.063 x the model, binomial trees 1.022 to 1.127, 4 to 7 rounds 1.004 to
    # 1.023. The rounds stay within the operation budget (p = 1024: 4 or 5), and where
    # it allows fewer than half of them (beyond p = 1024), binomial trees: log2(h) hops
    # instead of h - 1, but they load the helpers the degraded ranks wait on.
    want = max(per, math.ceil(RING_ROUNDS * float(f.min() / f.max())))
    # the most rounds with _tail_ops(rounds) <= MAX_AUTO_OPS
    fit = (MAX_AUTO_OPS - h - 2 * h * h * rs_chunks) // (2 * h * h + 6 * m * h)
    ring = 2 * max(per, fit) >= want
    per = max(per, min(want, fit)) if ring else per
    return per, ring


@dataclass(frozen=True)
class _Main:
    """The main ring AllReduce, as the raw tail's release waits for it."""

    end: int
    """The first operation id after it."""
    done: dict[int, np.ndarray]
    """Per rank, the operations its part of it ends with."""


@dataclass(frozen=True)
class _TailChunks:
    """The tail in ``n_chunks = per * h`` chunks, numbered in the order the degraded
    ranks send them (:meth:`of`)."""

    bounds: np.ndarray
    """Chunk boundaries in buffer order (``n_chunks + 1``)."""
    lo: np.ndarray
    hi: np.ndarray
    """Chunk i's elements ``[lo[i], hi[i])``."""
    helper: np.ndarray
    """Chunk i's helper: the healthy rank that reduces and broadcasts it."""

    @property
    def n(self) -> int:
        return int(self.lo.size)

    @classmethod
    def of(cls, cut: _Cut, count: int) -> _TailChunks:
        """Chunk i's helper is H[i mod h], so consecutive chunks have different helpers.
        In the buffer helper j's chunks lie side by side (section j of the tail), so that
        the healthy ranks' reduce-scatter moves a section in messages of the ring's size
        however many chunks the reduce and broadcast need."""
        h, per = cut.h, cut.per
        n_chunks = per * h
        cb = split(cut.main_hi, count, n_chunks)
        i = np.arange(n_chunks)
        at = (i % h) * per + i // h  # chunk i's place in the tail
        H = np.asarray(cut.healthy, dtype=np.int64)
        return cls(cb, cb[at], cb[at + 1], H[i % h])


def _healthy_reduce_scatter(
    b: ScheduleBuilder, cut: _Cut, chunk: _TailChunks, links: Links
) -> np.ndarray:
    """(a) The healthy ranks reduce-scatter the tail, paced beside the main ring; returns
    per healthy rank its *join*: what later writes into its tail wait for."""
    # Each helper ends with the healthy sum of its own chunks (section j of the ring =
    # the chunks of H[j]). Their all-gather is the broadcast of the finished chunks
    # (_broadcast_finished), so the healthy ranks move the tail's all-gather once, not
    # twice (a whole AllReduce here and the broadcast again: simulated, p = 16 with 8
    # ranks at 0.875, that took the healthy ranks to 2.094 n/B of traffic against 1.984,
    # and R2CCL 5.3% above its model).
    p, count, h, per = b.p, b.count, cut.h, cut.per
    H = np.asarray(cut.healthy, dtype=np.int64)
    mark = b.next_id
    if h > 1:
        cb = chunk.bounds
        sec = split(cb[:-1:per], cb[per::per], cut.rs_chunks)  # (h, rs_chunks + 1)
        reduce_scatter(b, H, sec[:, :-1], sec[:, 1:], chan=1)
    sinks = b.sinks(mark)
    # Paced to end when the model's healthy AllReduce would (T2, with T1 if later),
    # scaled to the reduce-scatter's half of its traffic.
    f, tail, loss = cut.f, cut.tail, cut.loss
    t1 = r2ccl_time(p, 1.0, 1.0, links, chunks=None) - tail / max(count, 1) / f.min()
    t2 = 2.0 * (h - 1) / h * (tail / max(count, 1)) / max(loss, 1e-12) if h > 1 else 0.0
    share = min(1.0, 0.5 * t2 / t1) if t1 > 0 else 1.0
    _pace(b, cut.healthy, (0, mark), (mark, b.next_id), share=share)
    # Per healthy rank, a one-element copy of its tail onto itself that waits for its
    # reduce-scatter to be done with the tail.
    main_hi = cut.main_hi
    join = np.full(h, -1, dtype=np.int64)
    for j, rank in enumerate(cut.healthy):
        join[j] = b.copy(rank, main_hi, main_hi + 1, main_hi)
        b.depend(join[j], sinks.get(rank, np.zeros(0, np.int64)))
    return join


@dataclass(frozen=True)
class _Raw:
    """The degraded ranks' raw chunks into the helpers (:func:`_reduce_raw`)."""

    mark: int
    """The first of their operations."""
    by_rank: list[np.ndarray]
    """Per degraded rank, its raw sends in its step order."""
    of: np.ndarray
    """(m, n_chunks): degraded rank v's raw send of chunk i."""
    final: np.ndarray
    """Per chunk, the operation after which its helper holds the finished chunk."""


def _reduce_raw(b: ScheduleBuilder, cut: _Cut, chunk: _TailChunks, join: np.ndarray) -> _Raw:
    """(b) Every degraded rank sends each raw chunk straight to its helper, which adds the
    contributions in a fixed order; when they may leave is :func:`_release_raw`'s."""
    # Degraded rank u sends chunk i at step (i + u) mod n (n = n_chunks; it starts with
    # chunk n - u): at any moment the degraded ranks send different chunks to different
    # helpers, and chunk i is complete about m steps after it started, so the broadcast
    # follows the reduce chunk by chunk (R2CCL's pipelining). A helper adds a chunk's
    # contributions in their order of arrival, which is fixed (bit-reproducible sums): in
    # round r chunk i comes from degraded rank (start_i + r) mod m, start_i being n - i
    # for the last m - 1 chunks (some ranks send them first) and 0 otherwise. Created
    # round by round, each rank's sends come out in its step order; the first
    # contribution waits until the helper's healthy AllReduce is done with the tail.
    h, m, n_chunks = cut.h, cut.m, chunk.n
    D = np.asarray(cut.degraded, dtype=np.int64)
    i = np.arange(n_chunks)
    start = np.where(i > n_chunks - m, n_chunks - i, 0)
    mark = b.next_id
    raw_of = np.full((m, n_chunks), -1, dtype=np.int64)
    by_rank: list[list[np.ndarray]] = [[] for _ in range(m)]
    prev = np.full(n_chunks, -1, dtype=np.int64)
    for r in range(m):
        u = (start + r) % m
        sids, rids = b.transfer(
            D[u], chunk.helper, chunk.lo, chunk.hi, chan=2, reduce=True, recv_deps=prev
        )
        if r == 0:
            b.depend(rids, join[i % h])
        for v in range(m):
            by_rank[v].append(sids[u == v])
        raw_of[u, i] = sids
        prev = np.where(rids >= 0, rids, prev)
    return _Raw(mark, [np.concatenate(x) for x in by_rank], raw_of, prev)


def _release_raw(b: ScheduleBuilder, cut: _Cut, raw: _Raw, main: _Main, window: int) -> None:
    """When each degraded rank's raw sends leave: in its step order, ``window`` in flight,
    and per the overlap schedule (``schedule`` of :func:`r2ccl`) paced by or after its
    part of the main ring."""
    if cut.schedule == 2:
        # Released in step with each degraded rank's own main-ring sends (ours): all of
        # them by RAW_SPREAD of the way (created round by round, a rank's raw sends are
        # in its step order).
        _pace(b, cut.degraded, (0, main.end), (raw.mark, b.next_id), share=RAW_SPREAD)
    for v, rank in enumerate(cut.degraded):
        # Each degraded rank's sends in its step order, two in flight, starting once its
        # part of the main AllReduce is done (R2CCL's overlap schedule 1: the healthy
        # AllReduce of the tail runs beside the main one, reduce and broadcast after it).
        mine = raw.by_rank[v]
        mine = mine[mine >= 0]
        b.chain(mine, window)
        if cut.schedule == 1:
            done = main.done.get(rank, np.zeros(0, np.int64))
            b.depend(mine[:window, None], done[None, :])


def _broadcast_finished(
    b: ScheduleBuilder, cut: _Cut, chunk: _TailChunks, raw: _Raw, join: np.ndarray
) -> None:
    """(c) Every finished chunk from its helper to every other rank."""
    # Straight to every degraded rank, which receives the chunks in the order they
    # finish (0, 1, ...: a receive waiting for a late chunk would hold up the rest of its
    # queue), each once its own raw chunk has left.
    for v, rank in enumerate(cut.degraded):
        b.transfer(
            chunk.helper, rank, chunk.lo, chunk.hi, chan=3, send_deps=raw.final, recv_deps=raw.of[v]
        )
    # ... and to the other healthy ranks: along their ring, one round of h chunks after
    # the other in the order they finish (member j owns chunks j, j + h, ...), or, where
    # enough rounds would not fit the budget, along binomial trees.
    H = np.asarray(cut.healthy, dtype=np.int64)
    if cut.ring:
        _ring_broadcast(b, H, chunk.lo, chunk.hi, raw.final, join, cut.per)
    else:
        _tree_broadcast(b, H, chunk.lo, chunk.hi, raw.final, join)


def _ring_broadcast(
    b: ScheduleBuilder,
    H: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    final: np.ndarray,
    join: np.ndarray,
    per: int,
) -> None:
    """All-gather of the finished chunks over the healthy ring, round by round (a queue
    waiting for a late chunk would hold up the rest). A receive overwrites the rank's
    partial sum of the chunk, so it waits for the rank's AllReduce, through the join."""
    q = H.size
    k = np.arange(q)
    H1 = H[(k + 1) % q]
    for c in range(per):
        cols = c * q + k  # chunk owned by member k in this round
        prev_send = final[cols]
        for t in range(q - 1):
            s = cols[(k - t) % q]  # chunk member k forwards
            _, rids = b.transfer(
                H, H1, lo[s], hi[s], chan=4, send_deps=prev_send, recv_deps=join[(k + 1) % q]
            )
            prev_send = rids[(k - 1) % q]  # what each member received, by member


def _tree_broadcast(
    b: ScheduleBuilder,
    H: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    final: np.ndarray,
    join: np.ndarray,
) -> None:
    """Each finished chunk from its helper to the other healthy ranks along a binomial
    tree (NCCL broadcasts along trees too): a chunk that finishes last reaches every
    healthy rank within log2(h) hops, where a ring takes h - 1 (at p = 1024 that alone
    was 14% above the model). Roots rotate with the chunks, so every healthy rank
    forwards about (h-1)/h of the tail."""
    h = H.size
    n_chunks = lo.size
    i = np.arange(n_chunks)
    # Tree position v of chunk i is healthy index (i + v g_i) mod h, with strides g_i
    # coprime to h that change from chunk to chunk: chunks finish one after the other, and
    # with one fixed layout the same ranks would be the busy inner nodes of consecutive
    # trees (twice their bandwidth for a while, idle otherwise).
    have = np.full((n_chunks, h), -1, dtype=np.int64)  # by chunk and position from root
    have[:, 0] = final
    strides = np.array([g for g in range(1, 8 * h + 2) if np.gcd(g, h) == 1][:64])
    root = i % h
    g = strides[(i // h * 7 + i) % strides.size]
    span = 1
    while span < h:
        v = np.arange(min(span, h - span))
        src = (root[:, None] + v[None, :] * g[:, None]) % h
        dst = (root[:, None] + (v[None, :] + span) * g[:, None]) % h
        _, rids = b.transfer(
            H[src],
            H[dst],
            lo[:, None],
            hi[:, None],
            chan=4,
            send_deps=have[:, v],
            recv_deps=join[dst],
        )
        have[:, v + span] = rids
        span *= 2
