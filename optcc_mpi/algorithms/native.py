"""The MPI library's own AllReduce, as one opaque operation per rank (the reference)."""

from __future__ import annotations

from optcc_mpi.algorithms import register
from optcc_mpi.links import Links
from optcc_mpi.schedule import Schedule, ScheduleBuilder

__all__ = ["native"]


@register("native", "the MPI library's MPI_Allreduce")
def native(p: int, count: int, links: Links | None = None, *, itemsize: int = 4) -> Schedule:
    """One ``COLL`` operation on every rank covering the whole buffer.

    With a single rank there is nothing to do and the schedule is empty.
    """
    b = ScheduleBuilder(p, count, "native")
    if p > 1:
        b.coll(0, count)
    return b.build()
