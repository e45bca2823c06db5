"""The bandwidth-optimal ring: reduce-scatter then all-gather (the NCCL baseline).

With q members each holding n elements, every member sends and receives 2(q-1)/q * n
elements in 2(q-1) steps. The buffer is cut into q sections; member i owns section i at
the end of the reduce-scatter. Sections may be cut further into chunks, which only
shortens messages (the ring keeps every link busy at every step already).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from optcc_mpi.algorithms import register
from optcc_mpi.algorithms._policy import (
    NETWORK_MESSAGE_BYTES,
    Fabric,
    fabric_of,
    large_messages,
    message_bytes,
)
from optcc_mpi.links import Links
from optcc_mpi.model import fault_free, fractions
from optcc_mpi.schedule import Schedule, ScheduleBuilder, check_size, split

__all__ = ["ring", "ring_time", "add_ring_allreduce", "reduce_scatter", "all_gather", "ring_chunks"]

#: Default message size over a network (``_policy.NETWORK_MESSAGE_BYTES``); schedules that
#: know their fabric take it from :func:`optcc_mpi.algorithms._policy.message_bytes`.
CHUNK_BYTES = NETWORK_MESSAGE_BYTES


def ring_chunks(section_elems: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Chunks per section so that messages are at most about ``chunk_bytes``."""
    return max(1, -(-section_elems * itemsize // max(1, chunk_bytes)))


def reduce_scatter(
    b: ScheduleBuilder,
    members: np.ndarray,
    clo: np.ndarray,
    chi: np.ndarray,
    *,
    chan: int,
    first_deps: npt.ArrayLike = -1,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Ring reduce-scatter over ``members``; section j is ``[clo[j], chi[j])``.

    ``clo``/``chi`` have shape (q, c): q sections of c chunks. In step t member i sends
    section (i-1-t) mod q to member i+1, which adds it to its own, so the chain of section
    j starts at member j+1 and ends, fully reduced, at its owner, member j.

    Parameters
    ----------
    first_deps
        What each member's first send waits for: an array of op ids indexed by member
        (shape (q, c) or broadcastable; -1 for none), or a list of such arrays.

    Returns
    -------
    sends : list of arrays
        Per step, the send ids indexed by sending member, shape (q, c).
    final : array
        Per member, the receive that completes its own section (shape (q, c)); all -1
        when q == 1 (nothing to receive).
    """
    q = members.size
    i = np.arange(q)
    me, nxt = members[:, None], members[(i + 1) % q][:, None]
    sends: list[np.ndarray] = []
    prev: npt.ArrayLike = first_deps
    final = np.full(clo.shape, -1, dtype=np.int64)
    for t in range(q - 1):
        s = (i - 1 - t) % q
        sids, rids = b.transfer(me, nxt, clo[s], chi[s], chan=chan, reduce=True, send_deps=prev)
        sends.append(sids)
        prev = final = rids[(i - 1) % q]  # what member i received, indexed by member i
    return sends, final


def all_gather(
    b: ScheduleBuilder,
    members: np.ndarray,
    clo: np.ndarray,
    chi: np.ndarray,
    *,
    chan: int,
    first_deps: npt.ArrayLike,
    rs_sends: list[np.ndarray],
) -> list[np.ndarray]:
    """Ring all-gather of the sections each member owns after :func:`reduce_scatter`.

    In step t member i forwards section (i-t) mod q. A member may overwrite a section
    only after its own reduce-scatter send of that section completed (the same step t),
    which ``rs_sends`` provides.

    Returns
    -------
    list of arrays
        Per step, the receive ids indexed by *receiving* member, shape (q, c); in step t
        member i receives section (i-1-t) mod q.
    """
    q = members.size
    i = np.arange(q)
    me, nxt = members[:, None], members[(i + 1) % q][:, None]
    recvs: list[np.ndarray] = []
    prev: npt.ArrayLike = first_deps
    for t in range(q - 1):
        s = (i - t) % q
        _, rids = b.transfer(
            me,
            nxt,
            clo[s],
            chi[s],
            chan=chan,
            send_deps=prev,
            recv_deps=rs_sends[t][(i + 1) % q],
        )
        prev = rids[(i - 1) % q]
        recvs.append(prev)
    return recvs


def add_ring_allreduce(
    b: ScheduleBuilder,
    members: Sequence[int],
    lo: int,
    hi: int,
    *,
    chunks: int = 1,
    chan: int = 0,
) -> None:
    """Add a ring AllReduce of ``[lo, hi)`` over ``members`` (in ring order) to ``b``."""
    q = len(members)
    if q < 2 or hi <= lo:
        return
    m = np.asarray(members, dtype=np.int64)
    sec = split(lo, hi, q)
    bounds = split(sec[:-1], sec[1:], chunks)  # (q, chunks + 1)
    clo, chi = bounds[:, :-1], bounds[:, 1:]
    sends, final = reduce_scatter(b, m, clo, chi, chan=chan)
    all_gather(b, m, clo, chi, chan=chan, first_deps=final, rs_sends=sends)


def ring_time(
    p: int,
    nbytes: float,
    bw: float,
    links: Links | str | None = None,
    *,
    latency: float = 0.0,
    fabric: str | Fabric = "network",
    chunk_bytes: int | None = None,
    itemsize: int = 4,
    window: int = 2,
) -> float:
    """The ring, held back at every step by the slowest NIC, ``T_ff / min_r f_r``, plus one
    latency per step (2(p-1) steps; the chunks of one step are pipelined).

    A measured :class:`~optcc_mpi.algorithms._policy.Fabric` (not a name, whose figures
    are only defaults for the message size) adds its costs (derived, ours): data moves at
    ``min(bw, fabric.rate)``, and each step pays the fabric's latency and, with
    overlap, one exposed message cost (the others run while earlier messages travel),
    without overlap one per message (``c`` messages per section)."""
    if p < 2:
        return 0.0
    steps = 2 * (p - 1)
    if not isinstance(fabric, Fabric):
        return fault_free(p, nbytes, bw) / fractions(links, p).min() + steps * latency
    fab = fabric_of(fabric)
    section = -(-int(nbytes) // (max(1, itemsize) * p)) * max(1, itemsize)
    size = fab.message_bytes(section, window) if chunk_bytes is None else chunk_bytes
    msgs = ring_chunks(section, 1, size) if section else 0
    per_step = max(latency, fab.latency) + fab.message_cost * (1 if fab.overlap else msgs)
    rate = min(bw, fab.rate)
    return fault_free(p, nbytes, rate) / fractions(links, p).min() + steps * per_step


@register(
    summary="bandwidth-optimal ring reduce-scatter + all-gather (NCCL's algorithm)",
    cost=ring_time,
    auto=large_messages,
    order=0,
)
def ring(
    p: int,
    count: int,
    links: Links | None = None,
    *,
    itemsize: int = 4,
    chunk_bytes: int | None = None,
    window: int = 2,
    fabric: str | Fabric = "network",
) -> Schedule:
    """Ring AllReduce over ranks 0..p-1 in rank order.

    Parameters
    ----------
    p, count : int
        Ranks and elements.
    links : Links, optional
        Ignored: the ring does not adapt to the network (that is the point of the baseline).
    itemsize : int
        Bytes per element, for chunking.
    chunk_bytes : int, optional
        Target message size; default from the fabric
        (:func:`optcc_mpi.algorithms._policy.message_bytes`).
    window : int
        Messages in flight per connection.
    fabric : {"network", "shared-memory"} or Fabric
        What joins the ranks (set by :func:`optcc_mpi.allreduce` from the communicator,
        or a measured :class:`~optcc_mpi.algorithms._policy.Fabric`): the message size
        follows from its model; in shared memory each section travels as one message.
    """
    section = -(-count // max(p, 1))
    if chunk_bytes is None:
        chunk_bytes = message_bytes(section * itemsize, fabric, window)
    else:
        fabric_of(fabric)  # the same error for an unknown fabric
    chunks = ring_chunks(section, itemsize, chunk_bytes)
    check_size("ring", 4 * p * (p - 1) * min(chunks, max(1, count)), p=p, chunks=chunks)
    b = ScheduleBuilder(p, count, "ring", window=window, chunks=chunks)
    add_ring_allreduce(b, range(p), 0, count, chunks=chunks)
    return b.build()
