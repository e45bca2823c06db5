"""Finding the slow links: a short, bounded pairwise bandwidth probe.

Users rarely know which rank is degraded. ``links="probe"`` measures it: in each of a few
*shifts* every rank sends ``nbytes`` to rank + s and receives from rank - s at the same
time, so every NIC carries one flow per direction; the receiver times its message. A
transfer runs at the rate of the slower of its two ends, so a rank's send rate is at least
the fastest of its outgoing transfers and its receive rate at least the fastest incoming
one. With two shifts every healthy rank meets at least one healthy partner (p >= 3), and a
degraded rank shows up slow on both sides. Fractions are relative to the median rank, which
assumes fewer than half of the ranks are degraded: the fastest measurement is a poor
reference, since socket buffers can make a short transfer look faster than the link.

The probe runs through the executor (as tiny schedules), so software emulation paces it
like any collective, over whatever transport the communicator has (MPI, torch.distributed).
Its cost is ``shifts * repeats`` exchanges of ``nbytes`` plus a barrier each; the result is
cached on the communicator. All its messages, barriers and gathers travel on the
transport's private channel (:mod:`optcc_mpi.transports`), so a receive the user has
posted, even with ``MPI.ANY_SOURCE`` and ``MPI.ANY_TAG``, never matches one of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from optcc_mpi.emulation import Emulation
from optcc_mpi.executor import execute
from optcc_mpi.links import Links
from optcc_mpi.schedule import RECV, Schedule, ScheduleBuilder
from optcc_mpi.transports import Communicator
from optcc_mpi.transports import of as transport_of

__all__ = ["ProbeResult", "probe", "HEALTHY_ABOVE"]

#: Measured fractions at or above this count as healthy. On the namespace testbed
#: (2 shared cores) single measurements of healthy ranks vary by up to 20%.
HEALTHY_ABOVE = 0.75


@dataclass
class ProbeResult:
    """What the probe measured."""

    links: Links
    """The link profile built from the measurements."""
    send_rate: np.ndarray
    """Per rank, estimated send bandwidth (bytes/s)."""
    recv_rate: np.ndarray
    """Per rank, estimated receive bandwidth (bytes/s)."""
    seconds: float
    """Wall time the probe took."""
    nbytes: int
    rates: dict[int, np.ndarray] = field(default_factory=dict)
    """Per shift s, the rate of the transfer rank - s -> rank, indexed by receiver."""

    def __str__(self) -> str:
        return (
            f"probe: {self.links} (took {self.seconds * 1e3:.0f} ms; send "
            f"{np.round(self.send_rate / 1e6, 1).tolist()} MB/s, receive "
            f"{np.round(self.recv_rate / 1e6, 1).tolist()} MB/s)"
        )


def _shift_schedule(p: int, nbytes: int, shift: int) -> Schedule:
    b = ScheduleBuilder(p, nbytes, f"probe-shift{shift}")
    r = np.arange(p)
    b.transfer(r, (r + shift) % p, 0, nbytes)
    return b.build()


def probe(
    comm: Communicator,
    *,
    nbytes: int = 4 << 20,
    repeats: int = 3,
    healthy_above: float = HEALTHY_ABOVE,
    emulate: Emulation | str | None = None,
) -> ProbeResult:
    """Measure every rank's send and receive bandwidth (collective on ``comm``).

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, torch.distributed.ProcessGroup or Transport
        Communicator to probe.
    nbytes : int
        Bytes per probe message (bounded cost: ``shifts * repeats`` messages per rank).
    repeats : int
        Messages per shift; the fastest is kept.
    emulate : Emulation, optional
        Software emulation to apply (its ``degrade`` is the emulated truth).
    healthy_above : float
        Fractions of the median rank's bandwidth at or above this count as healthy.
    """
    wire = transport_of(comm)
    p, rank = wire.size, wire.rank
    t_start = time.perf_counter()
    if p < 2:
        return ProbeResult(Links(), np.full(1, np.inf), np.full(1, np.inf), 0.0, nbytes)
    emu = Emulation.coerce(emulate)
    shifts = [1] if p == 2 else [1, 2]
    buf, backend = wire.scratch(nbytes)
    rates: dict[int, np.ndarray] = {}
    for s in shifts:
        sched = _shift_schedule(p, nbytes, s)
        best = 0.0
        for _ in range(repeats):
            pacer = emu.pacer(rank, p, Links()) if emu is not None else None
            wire.barrier()
            stats = execute(
                sched, buf, comm=wire, op="sum", backend=backend, pacer=pacer, trace=True
            )
            for _op, kind, posted, done in stats.trace:
                if kind == RECV and done > posted:
                    best = max(best, nbytes / (done - posted))
        rates[s] = np.array(wire.allgather(best))
    send = np.zeros(p)
    recv = np.zeros(p)
    for s, rate in rates.items():
        recv = np.maximum(recv, rate)  # rate[r]: transfer r - s -> r
        send = np.maximum(send, np.roll(rate, -s))  # transfer r -> r + s, seen at r + s
    capacity = np.minimum(send, recv)
    frac = np.minimum(capacity / np.median(capacity), 1.0)
    frac = np.where(frac >= healthy_above, 1.0, np.round(frac, 2))
    links = Links({r: float(f) for r, f in enumerate(frac) if f < 1.0})
    return ProbeResult(links, send, recv, time.perf_counter() - t_start, nbytes, rates)
