"""The transport's own AllReduce, as one opaque operation per rank (the reference):
``MPI_Allreduce`` over MPI, gloo's or NCCL's over torch.distributed, and for a torch
group whose ranks share one machine the board's (:mod:`optcc_mpi.transports.board`)."""

from __future__ import annotations

from optcc_mpi.algorithms import register
from optcc_mpi.algorithms._policy import small_messages
from optcc_mpi.links import Links
from optcc_mpi.model import library_allreduce
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
    """The library's AllReduce as :func:`optcc_mpi.model.library_allreduce` models it: the
    faster of recursive doubling and Rabenseifner's algorithm, held back by the slowest
    NIC (bandwidth only: Rabenseifner's ``2(p-1)/p n / (B min f)``)."""
    return library_allreduce(p, nbytes, bw, links, latency=latency)


@register(
    summary="the transport's own AllReduce (MPI_Allreduce, gloo's or NCCL's)",
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
