"""R2CCL-AllReduce: the state-of-the-art baseline for a degraded server.

The composition of R2CCL's AllReduce, written with our own point-to-point blocks so the
comparison with OptCC is like for like (see ``docs/optcc.md`` for the source):

1. cut the buffer into a *main* part and a *tail* of share Y = X, the bandwidth lost at
   the degraded rank (rounded down to a multiple of 16 bytes, as R2CCL does);
2. main part: ring AllReduce over all ranks;
3. tail: (a) ring AllReduce over the healthy ranks only, (b) a pipelined reduce of the
   degraded ranks' raw tails into the helpers, chunk by chunk, (c) a pipelined broadcast
   of the finished tail from the helpers to every rank.

All parts run as soon as their data allows (R2CCL's overlap schedule 0), which is the
setting R2CCL's own cost model describes.

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

import numpy as np

from optcc_mpi.algorithms import register
from optcc_mpi.algorithms._policy import large_messages
from optcc_mpi.algorithms.ring import CHUNK_BYTES, add_ring_allreduce, ring_chunks
from optcc_mpi.links import Links
from optcc_mpi.model import fault_free, fractions
from optcc_mpi.schedule import SEND, Schedule, ScheduleBuilder, check_size, split

__all__ = ["r2ccl", "r2ccl_time", "tail_share"]


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

    def sends(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        kind, rank = b.column("kind", lo, hi), b.column("rank", lo, hi)
        ids = lo + np.flatnonzero(kind == SEND)
        r = rank[ids - lo]
        order = np.argsort(r, kind="stable")
        return ids[order], r[order]

    lead_ids, lead_rank = sends(*lead)
    fol_ids, fol_rank = sends(*follow)
    for r in ranks:
        a0, a1 = np.searchsorted(lead_rank, [r, r + 1])
        f0, f1 = np.searchsorted(fol_rank, [r, r + 1])
        M, Q = a1 - a0, f1 - f0
        if M == 0 or Q == 0:
            continue
        q = np.arange(Q)
        step = np.ceil((q + 1) * (share * M / Q)).astype(np.int64) - 1
        b.depend(fol_ids[f0:f1][step >= 0], lead_ids[a0 + step[step >= 0]])


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


@register(
    summary="R2CCL-AllReduce: main part over all ranks, tail over the healthy ranks",
    cost=r2ccl_time,
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
    chunk_bytes: int = CHUNK_BYTES,
    schedule: int = 1,
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
    chunk_bytes : int
        Message size target of the rings.
    """
    links = links if links is not None else Links()
    f = links.vector(p)
    degraded = [r for r in range(p) if f[r] < f.max()]
    healthy = [r for r in range(p) if f[r] == f.max()]
    loss = 1.0 - f.min() / f.max()
    tail = tail_share(count, itemsize, loss) if degraded else 0
    main_hi = count - tail
    h, m = len(healthy), len(degraded)
    main_chunks = ring_chunks(-(-main_hi // max(p, 1)), itemsize, chunk_bytes)
    tail_chunks = ring_chunks(-(-tail // max(h, 1)), itemsize, chunk_bytes)
    # Chunks per helper: K at least, and messages of at most chunk_bytes. The degraded
    # ranks start one chunk apart (below), so the broadcast of the first chunk starts m
    # chunks late: 16 m chunks keep that within the model's 1/K = 1/16.
    per = max(
        -(-max(chunks, 16 * m) // max(h, 1)),
        -(-tail * itemsize // max(1, h * chunk_bytes)),
        1,
    )
    estimate = 4 * p * p * main_chunks + 4 * h * h * tail_chunks + 6 * m * h * per + 4 * h * h
    check_size("r2ccl", estimate, p=p, degraded=m)
    b = ScheduleBuilder(p, count, "r2ccl", window=window, tail=tail, chunks=chunks)
    add_ring_allreduce(b, range(p), 0, main_hi, chunks=main_chunks, chan=0)
    if tail == 0:
        return b.build()
    main_done = b.sinks(0)  # what each rank's part of the main AllReduce ends with

    # (a) the healthy ranks' AllReduce of the tail; what each one's part ends with.
    mark = b.next_id
    add_ring_allreduce(b, healthy, main_hi, count, chunks=tail_chunks, chan=1)
    sinks = b.sinks(mark)
    # The healthy AllReduce should end when the model says (T2, or with T1 if later).
    t1 = r2ccl_time(p, 1.0, 1.0, links, chunks=None) - tail / max(count, 1) / f.min()
    t2 = 2.0 * (h - 1) / h * (tail / max(count, 1)) / max(loss, 1e-12) if h > 1 else 0.0
    _pace(b, healthy, (0, mark), (mark, b.next_id), share=min(1.0, t2 / t1) if t1 > 0 else 1.0)
    H = np.asarray(healthy, dtype=np.int64)
    D = np.asarray(degraded, dtype=np.int64)
    # The tail in n_chunks = per * h chunks; chunk i's helper is H[i mod h], so the
    # chunks of one helper are h apart and consecutive chunks have different helpers.
    n_chunks = per * h
    cb = split(main_hi, count, n_chunks)
    lo, hi = cb[:-1], cb[1:]
    i = np.arange(n_chunks)
    helper = H[i % h]

    # (b) Reduce. Degraded rank u sends chunk i at step (i + u) mod n (n = n_chunks;
    # it starts with chunk n - u): at any moment the degraded ranks send different chunks
    # to different helpers, and chunk i is complete about m steps after it started, so
    # the broadcast follows the reduce chunk by chunk (R2CCL's pipelining). A helper adds
    # a chunk's contributions in their order of arrival, which is fixed (bit-reproducible
    # sums): in round r chunk i comes from degraded rank (start_i + r) mod m, start_i
    # being n - i for the last m - 1 chunks (some ranks send them first) and 0 otherwise.
    # Created round by round, each rank's sends come out in its step order; the first
    # contribution waits until the helper's healthy AllReduce is done with the tail.
    start = np.where(i > n_chunks - m, n_chunks - i, 0)
    raw_sends = []
    by_rank: list[list[np.ndarray]] = [[] for _ in range(m)]
    prev = np.full(n_chunks, -1, dtype=np.int64)
    for r in range(m):
        u = (start + r) % m
        sids, rids = b.transfer(D[u], helper, lo, hi, chan=2, reduce=True, recv_deps=prev)
        if r == 0:
            for j, rank in enumerate(healthy):
                own = rids[j::h]
                b.depend(own[:, None], sinks.get(rank, np.zeros(0, np.int64))[None, :])
        for v in range(m):
            by_rank[v].append(sids[u == v])
        raw_sends.append(sids)
        prev = np.where(rids >= 0, rids, prev)
    final = prev  # per chunk: the helper holds the finished chunk
    for v in range(m):
        # Each degraded rank's sends in its step order, two in flight, starting once its
        # part of the main AllReduce is done (R2CCL's overlap schedule 1: the healthy
        # AllReduce of the tail runs beside the main one, reduce and broadcast after it).
        mine = np.concatenate(by_rank[v])
        mine = mine[mine >= 0]
        b.chain(mine, window)
        if schedule >= 1:
            done = main_done.get(int(D[v]), np.zeros(0, np.int64))
            b.depend(mine[:window, None], done[None, :])

    # (c) Broadcast: each helper sends a finished chunk straight to every degraded rank,
    # which receives the chunks in the order they finish (0, 1, ...: a receive waiting
    # for a late chunk would hold up the rest of its queue), each once its own raw chunk
    # has left.
    raw_of = np.full((m, n_chunks), -1, dtype=np.int64)
    for r in range(m):
        raw_of[(start + r) % m, i] = raw_sends[r]
    for v in range(m):
        b.transfer(helper, D[v], lo, hi, chan=3, send_deps=final, recv_deps=raw_of[v])
    # ... and the healthy ranks all-gather the finished chunks over their ring (member j
    # owns chunks j, j + h, ...), one round of h chunks after the other, in the order they
    # finish (a queue waiting for a late chunk would hold up the rest). A member's
    # receives are chained (one queue: no time lost), so only its first waits for its
    # AllReduce to be done with the tail.
    q = h
    k = np.arange(q)
    H1 = H[(k + 1) % q]
    got = np.full(q, -1, dtype=np.int64)
    first = np.full(q, -1, dtype=np.int64)
    for c in range(per):
        cols = c * h + k  # chunk owned by member k in this round
        prev_send = final[cols]
        for t in range(q - 1):
            s = cols[(k - t) % q]  # chunk member k forwards
            _, rids = b.transfer(
                H, H1, lo[s], hi[s], chan=4, send_deps=prev_send, recv_deps=got[(k + 1) % q]
            )
            mine = rids[(k - 1) % q]  # what each member received, by member
            first = np.where((first < 0) & (mine >= 0), mine, first)
            got = np.where(mine >= 0, mine, got)
            prev_send = mine
    for j, rank in enumerate(healthy):
        if first[j] >= 0:
            b.depend(first[j], sinks.get(rank, np.zeros(0, np.int64)))
    return b.build()
