"""Size policy shared by the algorithm modules: which sizes ``auto`` hands to whom.

A point-to-point schedule costs at least 2(p-1) message latencies plus our executor's
per-message work, the MPI library's short-message algorithms about 2 log2(p) latencies in
compiled code; below :data:`SMALL_BYTES` per rank ``auto`` therefore leaves the call to
the library (``native``) and above it to the point-to-point schedules.
"""

from __future__ import annotations

from optcc_mpi.links import Links

__all__ = ["SMALL_BYTES", "small_messages", "large_messages"]

#: Bytes per rank below which ``auto`` uses the MPI library's AllReduce.
SMALL_BYTES = 256 * 1024


def small_messages(p: int, nbytes: float, links: Links) -> bool:
    """``auto`` predicate of the library's AllReduce: short messages, or a single rank."""
    return p < 2 or nbytes < SMALL_BYTES


def large_messages(p: int, nbytes: float, links: Links) -> bool:
    """``auto`` predicate of point-to-point schedules: messages of SMALL_BYTES or more."""
    return not small_messages(p, nbytes, links)
