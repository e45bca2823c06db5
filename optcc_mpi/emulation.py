"""Software emulation of slow links, where kernel shaping is impossible.

Every rank gets a *virtual NIC*: a send side and a receive side of ``bw`` bytes/s (times
the rank's fraction from the link profile), and a per-message latency. The executor asks
a :class:`Pacer` when it may post each send and when each receive counts as complete, so
a program behaves as in the simulator's link model (:mod:`optcc_mpi.simulate`): each side
is a first-in-first-out server of bytes, and a message completes ``latency`` after both
its sender's and its receiver's side served it.

The real transfers (shared memory, or a fast network) must be faster than the virtual
NIC for the emulation to be faithful; the benchmark reports what the emulation achieved.

The library's own AllReduce (one opaque call) is charged the one model of it,
:func:`optcc_mpi.model.library_allreduce`, at the slowest rank's rate: the executor asks
:meth:`Pacer.coll_done` when such a call counts as complete, and a caller that runs the
call itself (CA-SGD's trainer) has :meth:`Pacer.hold` sleep to its deadline.

String form (CLI ``--emulate`` and ``$OPTCC_EMULATE``): ``"bw=200MB/s,latency=20us"``;
either key may be left out. Which ranks are slow is normally the link profile the
algorithms are told (``links``); ``degrade=RANK:FRACTION,...`` (last in the string) sets
the emulated truth separately, e.g. to check that ``links="probe"`` finds it.
``$OPTCC_EMULATE_FRACTION`` (set per rank, e.g. by ``jobs/degrade-wrapper.sh``) scales this
rank's virtual NIC regardless of the profile.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from optcc_mpi import config
from optcc_mpi.errors import ArgumentError, ArgumentTypeError
from optcc_mpi.links import Links
from optcc_mpi.model import library_allreduce
from optcc_mpi.units import parse_duration, parse_rate

__all__ = ["Emulation", "Pacer", "ENV_EMULATE", "ENV_FRACTION", "forced_fraction"]

ENV_EMULATE = "OPTCC_EMULATE"
ENV_FRACTION = "OPTCC_EMULATE_FRACTION"


def forced_fraction() -> float | None:
    """This process's ``$OPTCC_EMULATE_FRACTION`` as a number in (0, 1], or None if unset.

    A per-rank input: :func:`optcc_mpi.allreduce` reads it before the ranks agree on
    their arguments, so a bad value is an error on every rank rather than on one.

    Raises
    ------
    ArgumentError
        The value is not a number in (0, 1].
    """

    text = config.get(ENV_FRACTION)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value <= 1):
        raise ArgumentError(f"{ENV_FRACTION}={text!r} must be a number in (0, 1]")
    return value


@dataclass(frozen=True)
class Emulation:
    """Virtual NIC rate and per-message latency.

    Parameters
    ----------
    bw : float, optional
        Healthy virtual NIC rate in bytes/s per direction; None leaves bandwidth unpaced.
    latency : float
        Seconds added to every message.
    degrade : Links, optional
        Emulated slow ranks; by default the link profile of each call.

    Examples
    --------
    >>> e = Emulation.parse("bw=200MB/s,latency=20us")
    >>> e.bw, round(e.latency * 1e6, 9)
    (200000000.0, 20.0)
    >>> str(e)
    'bw=200MB/s,latency=20us'
    """

    bw: float | None = None
    latency: float = 0.0
    degrade: Links | None = None

    def __post_init__(self) -> None:
        if self.bw is not None and not (self.bw > 0 and math.isfinite(self.bw)):
            raise ArgumentError(f"emulation: bandwidth {self.bw!r} must be positive")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ArgumentError(f"emulation: latency {self.latency!r} must be >= 0")

    @classmethod
    def parse(cls, text: str) -> Emulation:
        """Parse ``"bw=RATE,latency=DURATION[,degrade=RANK:FRACTION,...]"``."""
        bw: float | None = None
        latency = 0.0
        degrade: list[str] = []
        in_degrade = False
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            if not sep and in_degrade and ":" in item:
                degrade.append(item)  # further RANK:FRACTION items of degrade=
                continue
            in_degrade = False
            if not sep:
                raise ArgumentError(f"emulation: expected KEY=VALUE, got {item!r} in {text!r}")
            if key in ("bw", "bandwidth", "rate"):
                bw = parse_rate(value)
            elif key in ("latency", "lat", "alpha"):
                latency = parse_duration(value)
            elif key == "degrade":
                degrade.append(value)
                in_degrade = True
            else:
                raise ArgumentError(
                    f"emulation: unknown key {key!r} in {text!r}; use bw, latency, degrade"
                )
        links = Links.parse(",".join(degrade)) if degrade else None
        return cls(bw=bw, latency=latency, degrade=links)

    @classmethod
    def coerce(cls, emulate: Emulation | str | None) -> Emulation | None:
        """Accept an Emulation, a string, or None (read ``$OPTCC_EMULATE``, if set)."""
        if emulate is None:
            text = (config.get(ENV_EMULATE) or "").strip()
            return cls.parse(text) if text else None
        if isinstance(emulate, Emulation):
            return emulate
        if isinstance(emulate, str):
            return cls.parse(emulate) if emulate.strip() else None
        raise ArgumentTypeError(
            f"emulate must be an Emulation or a string, not {type(emulate).__name__}"
        )

    def pacer(self, rank: int, p: int, links: Links) -> Pacer:
        """The virtual NIC of ``rank`` in a communicator of ``p`` ranks (slow ranks from
        ``degrade`` if set, else from the call's link profile ``links``)."""
        fractions = (self.degrade if self.degrade is not None else links).vector(p)
        mine = float(fractions[rank])
        forced = forced_fraction()
        if forced is not None:
            mine = forced
        # Peers' own overrides are unknown here: the vector with this rank's entry replaced.
        vector = [float(f) for f in fractions]
        vector[rank] = mine
        return Pacer(self, mine, min(vector), p, fractions=vector)

    def __str__(self) -> str:
        parts = []
        if self.bw is not None:
            parts.append(f"bw={self.bw / 1e6:g}MB/s")
        if self.latency:
            parts.append(f"latency={self.latency * 1e6:g}us")
        if self.degrade is not None:
            parts.append(f"degrade={self.degrade}")
        return ",".join(parts) or "none"


class Pacer:
    """One rank's virtual NIC: when to post sends and when receives are complete.

    A send to peer ``q`` is served at ``bw * min(f_self, f_q)``: a transfer runs at the
    rate of the slower of its two ends, so messages *into* a slow rank are slow at the
    sender too (``fractions`` is the whole profile; without it only this rank's own
    fraction paces its sends). Receives are paced at this rank's own rate.

    The pacer keeps its own accounting, so that what it charged can be checked without a
    clock: ``charged_bytes`` and ``charged_seconds`` per direction (``"send"``,
    ``"recv"``, ``"coll"``: the library AllReduce's modelled time), and ``charged_to[q]``,
    the seconds of send service charged for messages to peer ``q``. :meth:`hold` keeps
    more: ``held`` calls, ``slept_s`` and ``sleeps``, ``overshoot_s`` and ``overrun_s``.

    ``sleep(seconds)`` and the monotonic ``clock()`` of :meth:`hold` are ``time.sleep``
    and ``time.perf_counter`` unless set (looked up at each call, so tests can replace
    them).
    """

    def __init__(
        self,
        emu: Emulation,
        fraction: float,
        slowest: float,
        p: int,
        fractions: list[float] | None = None,
    ) -> None:
        self.latency = emu.latency
        self.bw = emu.bw
        self.fraction = fraction
        self.rate = None if emu.bw is None else emu.bw * fraction
        self.coll_rate = None if emu.bw is None else emu.bw * slowest
        self.p = p
        self.fractions = list(fractions) if fractions is not None else None
        # Send rate per peer, precomputed: the executor asks once per message.
        self._peer_rate = (
            None
            if emu.bw is None or self.fractions is None
            else [emu.bw * min(fraction, f) for f in self.fractions]
        )
        self.send_free = 0.0
        self.recv_free = 0.0
        self.charged_bytes = {"send": 0, "recv": 0, "coll": 0}
        self.charged_seconds = {"send": 0.0, "recv": 0.0, "coll": 0.0}
        self.charged_to: dict[int, float] = {}
        self.sleep: Callable[[float], object] | None = None
        self.clock: Callable[[], float] | None = None
        self.held = 0
        self.slept_s = 0.0
        self.sleeps = 0
        self.overshoot_s = 0.0
        self.overrun_s = 0.0
        self.debt_s = 0.0  # overshoot not yet repaid by a later deadline

    def send_rate(self, peer: int | None = None) -> float | None:
        """Bytes/s at which a send to ``peer`` is served (None: unpaced)."""
        if self._peer_rate is not None and peer is not None:
            return self._peer_rate[peer]
        return self.rate

    def send_release(self, now: float, nbytes: int, peer: int | None = None) -> float:
        """Time the send side finishes serving a message to ``peer`` that became ready
        at ``now``."""
        rate = self.send_rate(peer)
        if rate is None:
            return now
        start = max(now, self.send_free)
        cost = nbytes / rate
        self.send_free = start + cost
        self.charged_bytes["send"] += nbytes
        self.charged_seconds["send"] += cost
        if peer is not None:
            self.charged_to[peer] = self.charged_to.get(peer, 0.0) + cost
        return self.send_free

    def recv_done(self, posted: float, arrived: float, nbytes: int) -> float:
        """Time a receive posted at ``posted`` whose data arrived at ``arrived`` completes."""
        done = arrived
        if self.rate is not None:
            start = max(posted, self.recv_free)
            cost = nbytes / self.rate
            self.recv_free = start + cost
            self.charged_bytes["recv"] += nbytes
            self.charged_seconds["recv"] += cost
            done = max(done, self.recv_free)
        return done + self.latency

    def coll_time(self, nbytes: float) -> float:
        """Modelled seconds of one library AllReduce of ``nbytes`` per rank
        (:func:`optcc_mpi.model.library_allreduce`, held back by the slowest rank)."""
        return library_allreduce(self.p, nbytes, self.coll_rate, latency=self.latency)

    def coll_done(self, posted: float, nbytes: int) -> float:
        """Completion of a library AllReduce started at ``posted`` (:meth:`coll_time`)."""
        cost = self.coll_time(nbytes)
        self.charged_bytes["coll"] += nbytes
        self.charged_seconds["coll"] += cost
        return posted + cost

    def hold(self, started: float, nbytes: int) -> float:
        """Make a library AllReduce that began at ``started`` last its modelled time.

        Call after the real reduction, which counts towards the charge; the rank then
        *sleeps* (never spins, so ranks that share cores leave them to ranks still
        computing) until the deadline ``started + coll_time(nbytes)``. A sleep
        overshoots its request (about 0.06-0.1 ms on Linux); the overshoot is owed to
        the next call, whose deadline is brought forward by it (deadline scheduling), so
        the total waited tracks the total charged instead of drifting by one overshoot
        per call. Returns the seconds charged.
        """
        cost = self.coll_done(started, nbytes) - started
        clock = self.clock or time.perf_counter
        now = clock()
        self.held += 1
        self.overrun_s += max(0.0, now - (started + cost))
        deadline = started + cost - self.debt_s
        if now < deadline:
            wait = deadline - now
            (self.sleep or time.sleep)(wait)
            self.sleeps += 1
            self.slept_s += wait
            late = max(0.0, clock() - deadline)
            self.overshoot_s += late
            self.debt_s = late
        else:
            # No sleep: whatever of the charge the real reduction left over repays debt.
            self.debt_s = max(0.0, self.debt_s - max(0.0, started + cost - now))
        return cost
