"""R2CCL-AllReduce: the state-of-the-art baseline for a degraded server.

The composition of R2CCL's AllReduce, written with our own point-to-point blocks so the
comparison with OptCC is like for like (see ``docs/optcc.md`` for the source):

1. cut the buffer into a *main* part and a *tail* of share Y = X, the bandwidth lost at
   the degraded rank (rounded down to a multiple of 16 bytes, as R2CCL does);
2. main part: ring AllReduce over all ranks;
3. tail: (a) ring AllReduce over the healthy ranks only, (b) a pipelined reduce of the
   degraded ranks' raw tails into a helper (the first healthy rank), in K chunks,
   (c) a pipelined broadcast of the finished tail from the helper to every rank, along
   two chains (degraded ranks; other healthy ranks).

All parts run as soon as their data allows (R2CCL's overlap schedule 0), which is the
setting R2CCL's own cost model describes.
"""

from __future__ import annotations

import numpy as np

from optcc_mpi.algorithms import register
from optcc_mpi.algorithms._policy import Transport, large_messages, message_bytes, transport_of
from optcc_mpi.algorithms.ring import add_ring_allreduce, ring_chunks
from optcc_mpi.links import Links
from optcc_mpi.model import fault_free, fractions
from optcc_mpi.schedule import Schedule, ScheduleBuilder, split

__all__ = ["r2ccl", "r2ccl_time", "tail_share"]


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
    chunk_bytes: int | None = None,
    transport: str | Transport = "network",
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
        more are used when chunks would exceed ``chunk_bytes``.
    window : int
        Messages in flight per connection.
    chunk_bytes : int, optional
        Message size target of the rings; default from ``transport``
        (:func:`optcc_mpi.algorithms._policy.message_bytes`, sized for the full ring's
        sections).
    transport : {"network", "shared-memory"} or Transport
        What joins the ranks (set by :func:`optcc_mpi.allreduce`; see the ring).
    """
    if chunk_bytes is None:
        chunk_bytes = message_bytes(-(-count // max(p, 1)) * itemsize, transport, window)
    else:
        transport_of(transport)  # the same error for an unknown transport
    links = links if links is not None else Links()
    f = links.vector(p)
    degraded = [r for r in range(p) if f[r] < f.max()]
    healthy = [r for r in range(p) if f[r] == f.max()]
    loss = 1.0 - f.min() / f.max()
    tail = tail_share(count, itemsize, loss) if degraded else 0
    b = ScheduleBuilder(p, count, "r2ccl", window=window, tail=tail, chunks=chunks)
    main_hi = count - tail

    def ring_over(members: list[int], lo: int, hi: int, chan: int) -> None:
        c = ring_chunks(-(-(hi - lo) // max(1, len(members))), itemsize, chunk_bytes)
        add_ring_allreduce(b, members, lo, hi, chunks=c, chan=chan)

    ring_over(list(range(p)), 0, main_hi, 0)
    if tail == 0:
        return b.build()

    mark = b.next_id
    ring_over(healthy, main_hi, count, 1)
    # What each healthy rank's tail AllReduce ends with (everything else precedes these).
    sinks = b.sinks(mark)
    tail_ops = {r: sinks.get(r, np.zeros(0, dtype=np.int64)) for r in healthy}
    helper = healthy[0]
    # K chunks at least; more when the tail is large, as NCCL's own pipelining would, and
    # at least 4 per healthy rank so the broadcast chain's fill is a small part of it.
    k = min(max(chunks, -(-tail * itemsize // chunk_bytes), 4 * len(healthy)), max(tail, 1))
    cb = split(main_hi, count, k)
    clo, chi = cb[:-1], cb[1:]

    # (b) Reduce: degraded ranks chained into the helper, chunk by chunk.
    chain = [*degraded, helper]
    reduce_ops: dict[int, list[np.ndarray]] = {r: [] for r in degraded}
    prev_recv = np.full(k, -1, dtype=np.int64)
    for src, dst in zip(chain[:-1], chain[1:]):
        sids, rids = b.transfer(src, dst, clo, chi, chan=2, reduce=True, send_deps=prev_recv)
        if dst == helper:
            # The helper may add a chunk only once its healthy AllReduce is done with it.
            b.depend(rids[:, None], tail_ops[helper][None, :])
        reduce_ops[src].append(sids)
        if dst != helper:
            reduce_ops[dst].append(rids)
        prev_recv = rids

    # (c) Broadcast from the helper, pipelined chunk by chunk along two chains: through the
    # degraded ranks, and through the other healthy ranks (each forwards once, as in
    # NCCL's ring broadcast; there are enough chunks that the chain fills quickly).
    got = {helper: prev_recv}  # per rank, the receives that give it each finished chunk

    def deliver(src: int, dst: int, chan: int) -> None:
        # A healthy rank overwrites its partial tail only once its AllReduce is done with
        # it; a degraded rank only once its reduce sends have left.
        _, rids = b.transfer(
            src, dst, clo, chi, chan=chan, send_deps=got[src], recv_deps=reduce_ops.get(dst, ())
        )
        if dst in tail_ops:
            b.depend(rids[:, None], tail_ops[dst][None, :])
        got[dst] = rids

    for src, dst in zip([helper, *degraded[:-1]], degraded):
        deliver(src, dst, 3)
    for src, dst in zip(healthy[:-1], healthy[1:]):
        deliver(src, dst, 4)
    return b.build()
