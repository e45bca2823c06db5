"""What :mod:`optcc_mpi.glm.comm` exported before the trainer's AllReduce went through the
public collectives, kept for one release behind :func:`optcc_mpi.glm.comm.__getattr__`,
which warns ``FutureWarning`` on each use.

The code is as it was (the trainer's former alpha-beta model: recursive doubling charged
to every size, and its pacer). What replaced it: :func:`optcc_mpi.model.library_allreduce`
(the one model of the library's AllReduce) and :meth:`optcc_mpi.emulation.Pacer.hold`
(the one pacer), docs/casgd.md section 5.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from ..errors import ArgumentError

__all__ = ["PATHS", "NetworkPacer", "allreduce_cost", "allreduce_path"]

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
