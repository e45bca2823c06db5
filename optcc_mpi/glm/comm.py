"""The trainer's communication: a pluggable, counted, timed AllReduce and error agreement.

:class:`Reducer` wraps whichever AllReduce the user chose:

* ``"mpi"``: the MPI library's ``MPI_Allreduce``. 16-bit payloads travel as 2-byte words
  reduced by the user-defined operation of :func:`optcc_mpi.transports.mpi.mpi_datatype_and_op`,
  which adds in float32 and rounds each partial sum back to the payload format, as NCCL
  does for a bf16 AllReduce;
* an :func:`optcc_mpi.allreduce` algorithm (``ring``, ``optcc``, ``r2ccl``, ``native``,
  ``auto``), called with the user's ``links`` and ``emulate`` settings;
* a callable ``f(buf, comm) -> None`` that reduces ``buf`` in place.

Every call is counted (calls, payload bytes) and timed, which is where the trainer's
communication time comes from.

Network emulation for ``"mpi"`` and callables (ours; the ``optcc_mpi.allreduce``
algorithms pace each of their messages instead): with an
:class:`~optcc_mpi.emulation.Emulation` (or ``$OPTCC_EMULATE``) of latency ``alpha`` and
bandwidth ``beta``, a :class:`NetworkPacer` charges every AllReduce of ``n`` bytes the
alpha-beta cost of the critical path of a **recursive-doubling** AllReduce,

    T(P, n) = R(P) * (alpha + n / beta),
    R(P) = log2 P              (P a power of two)
         = floor(log2 P) + 2   (otherwise: one fold-in and one fold-out message)

(derived (ours), see :func:`allreduce_cost`), and makes the call last that long: the real
reduction runs first, then the rank *sleeps* to the call's deadline. It never spins, so
ranks that share cores leave them to the ranks still computing. A sleep overshoots its
request (about 0.06-0.1 ms on Linux); the overshoot is owed to the next call, whose
deadline is measured from where the previous one should have ended (deadline
scheduling), so the total wait tracks the total charge instead of drifting by one
overshoot per call. What was charged, slept and overshot is counted in the pacer and
reported by :meth:`Reducer.stats`.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import agreement, collectives
from ..emulation import Emulation
from ..errors import ArgumentError
from ..transports.mpi import mpi_datatype_and_op

__all__ = [
    "PATHS",
    "NetworkPacer",
    "Reducer",
    "agree",
    "allreduce_cost",
    "allreduce_path",
    "checksum",
]

#: Critical paths :func:`allreduce_cost` knows; the pacer charges the first.
PATHS = ("recursive-doubling", "ring")


def allreduce_path(p: int, nbytes: float, path: str = "recursive-doubling") -> tuple[int, float]:
    """Messages on an AllReduce's critical path and the bytes each one carries.

    Parameters
    ----------
    p : int
        Ranks (>= 1).
    nbytes : float
        Payload bytes per rank.
    path : {"recursive-doubling", "ring"}
        ``recursive-doubling``: ``log2 P`` exchanges of the whole payload (plus one
        fold-in and one fold-out exchange when ``P`` is not a power of two, as MPICH
        does); ``ring``: reduce-scatter then allgather, ``2 (P - 1)`` messages of
        ``n / P`` bytes.

    Returns
    -------
    (messages, bytes_per_message) : (int, float)
    """
    if p < 1:
        raise ArgumentError(f"the number of ranks must be >= 1, got {p}")
    if nbytes < 0:
        raise ArgumentError(f"the payload must be >= 0 bytes, got {nbytes}")
    if p == 1:
        return 0, 0.0
    if path == "recursive-doubling":
        k = p.bit_length() - 1  # floor(log2 p), exact for ints
        return (k if p == 1 << k else k + 2), float(nbytes)
    if path == "ring":
        return 2 * (p - 1), nbytes / p
    raise ArgumentError(f"unknown AllReduce critical path {path!r}; choose one of {PATHS}")


def allreduce_cost(
    p: int,
    nbytes: float,
    latency: float,
    bw: float | None,
    path: str = "recursive-doubling",
) -> float:
    """Alpha-beta time of one AllReduce of ``nbytes`` on ``p`` ranks (derived (ours)).

    ``messages * (latency + bytes_per_message / bw)`` with the critical path of
    :func:`allreduce_path`; ``bw=None`` (or 0) leaves the bandwidth term out.
    Reduction arithmetic is not charged: it is measured as compute.

    Examples
    --------
    >>> round(allreduce_cost(8, 1000, 5e-6, 1e9) * 1e6, 6)  # 3 * (5 us + 1 us)
    18.0
    """
    if latency < 0 or not math.isfinite(latency):
        raise ArgumentError(f"latency must be a finite number >= 0, got {latency}")
    if bw is not None and not (bw >= 0 and math.isfinite(bw)):
        raise ArgumentError(f"bandwidth must be a finite number > 0, got {bw}")
    messages, each = allreduce_path(p, nbytes, path)
    return messages * (latency + (each / bw if bw else 0.0))


class NetworkPacer:
    """Makes each AllReduce last its alpha-beta cost, by sleeping to a deadline.

    Parameters
    ----------
    p : int
        Ranks in the AllReduce.
    latency : float
        Seconds per message (alpha).
    bw : float or None
        Bytes per second of every link (beta); None: no bandwidth term.
    path : str
        Critical path charged (see :func:`allreduce_path`).
    sleep, clock : callable, optional
        ``sleep(seconds)`` and a monotonic ``clock()``; default ``time.sleep`` and
        ``time.perf_counter`` (looked up at each call, so tests can replace them).

    Attributes
    ----------
    calls, messages : int
        AllReduces paced and critical-path messages charged.
    wire_bytes : float
        Critical-path bytes charged (sum over messages).
    charged_s : float
        Sum of the modelled costs: what the network was charged.
    slept_s : float
        Sum of the sleeps requested (the rest of the charge was covered by the real
        reduction, or by overshoot owed from earlier calls).
    sleeps : int
        Sleep calls made (at most one per AllReduce).
    overshoot_s : float
        Sum of how far sleeps ran past their deadline.
    overrun_s : float
        Sum of how far the real reduction alone ran past the charge (the emulation is
        then slower than the modelled network; the benchmark reports it).
    """

    def __init__(
        self,
        p: int,
        latency: float,
        bw: float | None,
        path: str = "recursive-doubling",
        *,
        sleep: Callable[[float], Any] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        allreduce_cost(p, 0, latency, bw, path)  # validates every argument
        self.p, self.latency, self.bw, self.path = p, latency, bw, path
        self._sleep = sleep
        self._clock = clock
        self.calls = 0
        self.messages = 0
        self.wire_bytes = 0.0
        self.charged_s = 0.0
        self.slept_s = 0.0
        self.sleeps = 0
        self.overshoot_s = 0.0
        self.overrun_s = 0.0
        self.debt_s = 0.0  # overshoot not yet repaid by a later deadline

    def now(self) -> float:
        """The pacer's clock."""
        return (self._clock or time.perf_counter)()

    def cost(self, nbytes: float) -> float:
        """Modelled seconds of one AllReduce of ``nbytes``."""
        return allreduce_cost(self.p, nbytes, self.latency, self.bw, self.path)

    def finish(self, started: float, nbytes: float) -> float:
        """Charge an AllReduce that began at ``started``; sleep until its deadline.

        Call after the real reduction. The deadline is ``started + cost`` minus the
        overshoot owed by earlier sleeps. Returns the cost charged.
        """
        cost = self.cost(nbytes)
        messages, each = allreduce_path(self.p, nbytes, self.path)
        self.calls += 1
        self.messages += messages
        self.wire_bytes += messages * each
        self.charged_s += cost
        now = self.now()
        self.overrun_s += max(0.0, now - (started + cost))
        deadline = started + cost - self.debt_s
        if now < deadline:
            wait = deadline - now
            (self._sleep or time.sleep)(wait)
            self.sleeps += 1
            self.slept_s += wait
            late = max(0.0, self.now() - deadline)
            self.overshoot_s += late
            self.debt_s = late
        else:
            # No sleep: whatever of the charge the real reduction left over repays debt.
            self.debt_s = max(0.0, self.debt_s - max(0.0, started + cost - now))
        return cost

    def stats(self) -> dict[str, Any]:
        """The accounting as a JSON-ready dict."""
        return {
            "net_path": self.path,
            "net_latency_s": self.latency,
            "net_bw": self.bw,
            "net_calls": self.calls,
            "net_messages": self.messages,
            "net_wire_bytes": self.wire_bytes,
            "net_charged_s": self.charged_s,
            "net_slept_s": self.slept_s,
            "net_sleeps": self.sleeps,
            "net_overshoot_s": self.overshoot_s,
            "net_overrun_s": self.overrun_s,
        }


class Reducer:
    """A counted, timed, pluggable in-place SUM AllReduce.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        The communicator of the ranks that hold the column blocks.
    allreduce : str or callable
        ``"mpi"``, an ``optcc_mpi.allreduce`` algorithm name, or ``f(buf, comm) -> None``.
    links : object, optional
        Link profile passed to ``optcc_mpi.allreduce`` (``Links`` or its string form).
    emulate : Emulation or str, optional
        Network emulation (``"latency=50us"``; None: ``$OPTCC_EMULATE`` if set). Passed
        to ``optcc_mpi.allreduce``; for ``"mpi"`` and callables it is emulated here.

    Attributes
    ----------
    calls, nbytes : int
        AllReduce calls made and payload bytes reduced.
    seconds : float
        Wall time spent inside the calls (emulated latency included).
    emulated_seconds : float
        Part of ``seconds`` spent sleeping for the emulated network.
    pacer : NetworkPacer or None
        The emulated network's accounting (None when nothing is emulated here).
    """

    def __init__(
        self,
        comm: MPI.Comm,
        allreduce: str | Callable[[np.ndarray, MPI.Comm], None] = "mpi",
        *,
        links: Any = None,
        emulate: Emulation | str | None = None,
    ) -> None:
        self.comm = comm
        self.links = links
        self.calls = 0
        self.nbytes = 0
        self.seconds = 0.0
        self.emulated_seconds = 0.0
        if callable(allreduce):
            self.name = getattr(allreduce, "__name__", "callable")
            self._reduce = self._callable(allreduce)
            self._emulate_here = True
        elif str(allreduce).lower() == "mpi":
            self.name = "mpi"
            self._reduce = self._mpi
            self._emulate_here = True
        else:
            self.name = str(allreduce)
            self._reduce = self._optcc(self.name)
            self._emulate_here = False
        if links is not None and self._emulate_here:
            raise ValueError(
                f"a link profile needs an optcc_mpi.allreduce algorithm, not {self.name!r}"
            )
        # The optcc_mpi algorithms read $OPTCC_EMULATE themselves when emulate is None.
        self.emulate = Emulation.coerce(emulate) if self._emulate_here else emulate
        self.pacer: NetworkPacer | None = None
        if self._emulate_here and self.emulate and (self.emulate.latency or self.emulate.bw):
            self.pacer = NetworkPacer(comm.size, self.emulate.latency, self.emulate.bw)

    def _callable(self, fn: Callable[[np.ndarray, MPI.Comm], None]) -> Callable:
        def reduce(buf: np.ndarray) -> np.ndarray:
            fn(buf, self.comm)
            return buf

        return reduce

    def _mpi(self, buf: np.ndarray) -> np.ndarray:
        if self.comm.size == 1:
            return buf
        datatype, op = mpi_datatype_and_op(buf.dtype.name, "sum")
        view = buf.view(np.uint16) if buf.dtype.itemsize == 2 else buf
        self.comm.Allreduce(MPI.IN_PLACE, [view, datatype], op)
        return buf

    def _optcc(self, name: str) -> Callable:
        if name not in collectives.ALGORITHMS:
            raise ValueError(
                f"unknown AllReduce algorithm {name!r}; choose 'mpi' or one of "
                f"{', '.join(collectives.ALGORITHMS)}"
            )

        def reduce(buf: np.ndarray) -> np.ndarray:
            # Every rank passes the same size, dtype and settings by construction, so the
            # per-call argument check (one more small collective) is skipped.
            return collectives.allreduce(
                collectives.IN_PLACE,
                buf,
                op="sum",
                comm=self.comm,
                algorithm=name,
                links=self.links,
                emulate=self.emulate,
                check=False,
            )

        return reduce

    def __call__(self, buf: np.ndarray) -> np.ndarray:
        """SUM-reduce ``buf`` (a contiguous 1-D host array) over the communicator."""
        t0 = time.perf_counter()
        out = self._reduce(buf)
        if self.pacer is not None:
            # The real reduction counts towards the modelled time; sleep for the rest.
            t1 = time.perf_counter()
            self.pacer.finish(t0, buf.nbytes)
            self.emulated_seconds += time.perf_counter() - t1
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.nbytes += buf.nbytes
        return out

    def stats(self) -> dict[str, Any]:
        """Counters as a JSON-ready dict."""
        return {
            "allreduce": self.name,
            "allreduce_calls": self.calls,
            "allreduce_bytes": self.nbytes,
            "comm_s": self.seconds,
            "emulated_wait_s": self.emulated_seconds,
            **(self.pacer.stats() if self.pacer is not None else {}),
        }


def agree(comm: MPI.Comm, error: str | None, payload: Any = None) -> list[Any]:
    """Share each rank's verdict (and a small payload); raise on every rank if any failed.

    The trainer's use of :func:`optcc_mpi.agreement.agree` (one ``allgather`` of a small
    Python object), so ranks whose own checks passed do not wait forever in the next
    collective while another rank has bailed out.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        Communicator of all ranks that must agree.
    error : str or None
        This rank's error message, or None.
    payload : object, optional
        Anything small to share at the same time (shapes, checksums).

    Returns
    -------
    list
        Every rank's payload, in rank order.

    Raises
    ------
    ArgumentError
        (a ``ValueError``) on every rank, when at least one rank reported an error.
        Identical messages from several ranks are listed once with their ranks.
    """
    return agreement.agree(comm, error, payload)


def checksum(a: np.ndarray) -> int:
    """CRC-32 of an array's bytes: a cheap check that replicated arrays agree."""
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).ravel())
