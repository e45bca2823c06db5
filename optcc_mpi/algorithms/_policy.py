"""Policy shared by the algorithm modules: which sizes ``auto`` hands to whom, and how
large a message should be on each kind of transport.

A point-to-point schedule costs at least 2(p-1) message latencies plus our executor's
per-message work, the MPI library's short-message algorithms about 2 log2(p) latencies in
compiled code; below :data:`SMALL_BYTES` per rank ``auto`` therefore leaves the call to
the library (``native``) and above it to the point-to-point schedules.

Message size by transport (measured, docs/bench.md): a builder that declares a
``transport`` parameter is told by :func:`optcc_mpi.allreduce` which kind of transport
joins the communicator's ranks, ``"shared-memory"`` (MPI says every rank shares one node)
or ``"network"`` (anything else, and every emulated network):

* over a network the NIC moves data while the CPU reduces, so a section is cut into
  messages of about :data:`NETWORK_MESSAGE_BYTES` and the reduction of one overlaps the
  transfer of the next;
* in shared memory the transfer *is* CPU copying, progressed only inside MPI calls, so
  nothing overlaps and every extra message costs a round trip through the progress
  engine: a section travels as one message. Measured at p = 2: the ring with 1 MiB
  messages took 1.18-1.23x a blocking ``Sendrecv`` ring at 16-64 MiB, with one message
  per section 1.04-1.07x.
"""

from __future__ import annotations

from optcc_mpi.errors import ArgumentError
from optcc_mpi.links import Links

__all__ = [
    "SMALL_BYTES",
    "NETWORK_MESSAGE_BYTES",
    "TRANSPORTS",
    "small_messages",
    "large_messages",
    "message_bytes",
]

#: Bytes per rank below which ``auto`` uses the MPI library's AllReduce.
SMALL_BYTES = 256 * 1024
#: Message size over a network: small enough to overlap the reduction of one message
#: with the transfer of the next, large enough that per-message costs stay small.
NETWORK_MESSAGE_BYTES = 1 << 20
#: The kinds of transport a builder's ``transport`` parameter may name.
TRANSPORTS = ("network", "shared-memory")


def small_messages(p: int, nbytes: float, links: Links) -> bool:
    """``auto`` predicate of the library's AllReduce: short messages, or a single rank."""
    return p < 2 or nbytes < SMALL_BYTES


def large_messages(p: int, nbytes: float, links: Links) -> bool:
    """``auto`` predicate of point-to-point schedules: messages of SMALL_BYTES or more."""
    return not small_messages(p, nbytes, links)


def message_bytes(section_bytes: int, transport: str = "network") -> int:
    """Target size of one message when a section of ``section_bytes`` is sent over
    ``transport`` (see the module docstring)."""
    if transport not in TRANSPORTS:
        raise ArgumentError(
            f"transport must be one of {', '.join(map(repr, TRANSPORTS))}, got {transport!r}"
        )
    if transport == "shared-memory":
        return max(1, int(section_bytes))
    return NETWORK_MESSAGE_BYTES
