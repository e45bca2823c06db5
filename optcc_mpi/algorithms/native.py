"""The MPI library's own AllReduce, as one opaque operation per rank (the reference)."""

from __future__ import annotations

import math

from optcc_mpi.algorithms import register
from optcc_mpi.algorithms._policy import small_messages
from optcc_mpi.links import Links
from optcc_mpi.model import fault_free, fractions
from optcc_mpi.schedule import Schedule, ScheduleBuilder

__all__ = ["native", "native_time"]


def native_time(
    p: int,
    nbytes: float,
    bw: float,
    links: Links | str | None = None,
    *,
    latency: float = 0.0,
) -> float:
    """A bandwidth-optimal library AllReduce held back by the slowest NIC, plus
    ``2 ceil(log2 p)`` latencies (Rabenseifner's algorithm, MPICH's choice for large
    messages)."""
    if p < 2:
        return 0.0
    slowest = fractions(links, p).min()
    return fault_free(p, nbytes, bw) / slowest + 2 * math.ceil(math.log2(p)) * latency


@register(
    summary="the MPI library's MPI_Allreduce",
    cost=native_time,
    auto=small_messages,
    order=30,
)
def native(p: int, count: int, links: Links | None = None, *, itemsize: int = 4) -> Schedule:
    """One ``COLL`` operation on every rank covering the whole buffer.

    With a single rank there is nothing to do and the schedule is empty.
    """
    b = ScheduleBuilder(p, count, "native")
    if p > 1:
        b.coll(0, count)
    return b.build()
