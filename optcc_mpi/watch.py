"""``links="watch"``: a link profile learnt from the collectives themselves, while they run.

Links degrade while a job runs. In watch mode every call measures the throughput of its
own messages (no extra traffic), the observations travel on the argument-check collective
that runs anyway, and when the measured profile departs from the one in use every rank
adopts the same new profile at the same call, so ``auto`` re-plans and no two ranks ever
run different schedules.

Estimator (ours)
----------------
A send is *busy* from the moment its data is ready (the operation is posted) until it
completes: in that time the sender's NIC is serving it or a message queued before it. Per
peer, the union of a rank's send intervals of at least :data:`MIN_BYTES` gives a rate,
``bytes / busy time``, that of the link ``rank -> peer``, which runs at the pace of the
slower of its two NICs. So the rate of every observed link is a lower bound on the
bandwidth of *both* its ends, and a rank's bandwidth is estimated by the fastest link it
takes part in::

    v[r] = max over observed links (a -> b) with r in {a, b} of rate(a -> b)

Each rank contributes the links it sent on; an elementwise maximum over ranks (one
``MPI_Allreduce`` with ``MAX``, folded into the argument check) gives every rank the same
``v``. Fractions are relative to the median observed rank (as the probe's are: the fastest
measurement is a poor reference), fractions at or above ``healthy_above`` count as
healthy, and a rank with no observation keeps its current fraction.

Decision: the measured profile replaces the current one when some rank's fraction differs
by more than ``threshold`` in ``confirm`` consecutive calls (hysteresis against noise).
Every input of the decision is the reduced vector, identical on every rank, so every rank
decides the same at the same call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optcc_mpi.links import Links

__all__ = ["WATCH", "MIN_BYTES", "LinkWatch", "send_rates"]

#: The value of ``links`` that turns watching on.
WATCH = "watch"
#: Sends shorter than this are not timed: an eager send completes before it is on the wire.
MIN_BYTES = 256 * 1024


def send_rates(records: Any, p: int, min_bytes: int = MIN_BYTES) -> np.ndarray:
    """Per peer, the rate (bytes/s) of this rank's sends to it; 0 where none was timed.

    Parameters
    ----------
    records : iterable of (peer, nbytes, posted, completed)
        This rank's sends, times in seconds.
    p : int
        Ranks in the communicator.
    min_bytes : int
        Shorter sends are ignored.
    """
    by_peer: dict[int, list[tuple[float, float, int]]] = {}
    for peer, nbytes, posted, done in records:
        if nbytes >= min_bytes and done > posted:
            by_peer.setdefault(int(peer), []).append((float(posted), float(done), int(nbytes)))
    rates = np.zeros(p)
    for peer, spans in by_peer.items():
        spans.sort()
        busy, end = 0.0, -np.inf
        for lo, hi, _ in spans:
            if hi > end:
                busy += hi - max(lo, end)
                end = hi
        total = sum(n for _, _, n in spans)
        rates[peer] = total / busy if busy > 0 else 0.0
    return rates


@dataclass
class LinkWatch:
    """The watched profile of one communicator (the same state on every rank).

    Parameters
    ----------
    p : int
        Ranks.
    threshold : float
        Departure in some rank's fraction that triggers a change.
    confirm : int
        Consecutive calls that must show the departure.
    healthy_above : float
        Measured fractions at or above this count as healthy.
    """

    p: int
    threshold: float = 0.2
    confirm: int = 2
    healthy_above: float = 0.8
    profile: Links = field(default_factory=Links)
    calls: int = 0
    changes: list[tuple[int, Links]] = field(default_factory=list)
    _mine: np.ndarray | None = None
    _streak: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 1:
            raise ValueError(f"watch: threshold {self.threshold!r} must be in (0, 1)")
        if self.confirm < 1:
            raise ValueError(f"watch: confirm {self.confirm!r} must be at least 1")
        self._mine = np.zeros(self.p)

    # -- one call: contribute, agree, run, record -------------------------------------
    def contribution(self) -> np.ndarray:
        """This rank's observations since the last call, as int64 bytes/s (0: none), for
        the elementwise-maximum reduction."""
        assert self._mine is not None
        return np.round(self._mine).astype(np.int64)

    def agree(self, reduced: np.ndarray) -> Links:
        """Take the elementwise maximum of every rank's :meth:`contribution` and return the
        profile to run this call with (the same on every rank)."""
        self.calls += 1
        self._mine = np.zeros(self.p)
        measured = self.estimate(np.asarray(reduced, dtype=float))
        if measured is None:
            self._streak = 0
            return self.profile
        cur = self.profile.vector(self.p)
        new = measured.vector(self.p)
        if np.max(np.abs(new - cur)) > self.threshold:
            self._streak += 1
        else:
            self._streak = 0
        if self._streak >= self.confirm:
            self.profile = measured
            self.changes.append((self.calls, measured))
            self._streak = 0
        return self.profile

    def estimate(self, v: np.ndarray) -> Links | None:
        """The profile the reduced observations ``v`` (bytes/s per rank) indicate, or None
        when fewer than half of the ranks were observed."""
        seen = v > 0
        if seen.sum() * 2 < self.p or not seen.any():
            return None
        frac = self.profile.vector(self.p).copy()
        ref = float(np.median(v[seen]))
        frac[seen] = np.minimum(v[seen] / ref, 1.0)
        frac = np.where(frac >= self.healthy_above, 1.0, np.round(frac, 2))
        frac = np.maximum(frac, 0.01)
        return Links({r: float(f) for r, f in enumerate(frac) if f < 1.0})

    def record(self, rank: int, sends: Any) -> None:
        """Fold this rank's timed sends ``(peer, nbytes, posted, completed)`` of the call
        into the observation for the next call: ``v[rank]`` and ``v[peer]`` are at least
        the rate of the link ``rank -> peer``."""
        assert self._mine is not None
        rates = send_rates(sends, self.p)
        if not rates.any():
            return
        self._mine = np.maximum(self._mine, rates)
        self._mine[rank] = max(self._mine[rank], float(rates.max()))
