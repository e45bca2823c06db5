"""``links="watch"``: a link profile learnt from the collectives themselves, while they run.

Links degrade while a job runs. In watch mode every call measures the throughput of its
own messages (no extra traffic), the observations travel on the argument-check collective
that runs anyway, and when the measured profile departs from the one in use every rank
adopts the same new profile at the same call, so ``auto`` re-plans and no two ranks ever
run different schedules.

Estimator (ours)
----------------
A message is *on the wire* from the moment both its ends have posted it (the sender had
the data, the receiver its buffer) until the receiver has it. Only the two ranks together
know that interval: the sender knows when it posted, the receiver when it posted and when
the data arrived. So every rank records, for the messages of the call it ran, its side of
each timed message (at least :data:`MIN_BYTES`): the sender the post time, the receiver
its post and completion times, in microseconds from the end of the argument check (a
collective: it ends at nearly the same instant on every rank, which gives all ranks a
common clock to well under a millisecond, against messages of tens of milliseconds).
Every rank computes the same schedule, so a message is named by the schedule's id of its
send, and the values can travel without their names, in an order every rank can rebuild.

At the next call every rank has every rank's values (the check gathers them) and pairs
them. Per rank, the union of the intervals of the messages it received gives its ingress
busy time, of those it sent its egress busy time, hence two rates, ``bytes / busy``. A
message moves at the pace of the slower of its two ends, so both rates are lower bounds
on the rank's bandwidth, and the faster one is its estimate::

    v[r] = max(ingress rate of r, egress rate of r)

(:func:`optcc_mpi.linkrates.message_rates` and :func:`~optcc_mpi.linkrates.rank_rates`,
the estimator the probes share).

This sees a slow link even in a ring, where every link carries the same bytes in lockstep:
the slow link's messages are on the wire twice as long, the healthy links' messages
arrive early and then wait for the next step. Times taken on the sending side alone
cannot: a send completes when the transport has buffered the data, not when it arrived.

On NCCL the host never sees a message arrive: the executor posts each level of the
schedule as one group on the device's stream and goes on. There the transport's clock
(:meth:`~optcc_mpi.transports.base.Transport.level_clock`: CUDA events) marks each
level's start and end on the device, and a message takes its level's times once the
device has passed the marks (:meth:`~optcc_mpi.executor.ExecStats.settle`): a receive
from its level's start to its end, on the receiver's own clock, a send from the call's
start (so no interval compares two devices' clocks). They are read at the next call's
check, without waiting: a call whose marks the device has not passed yet contributes
nothing. A level's time includes waiting for the slowest message of the level, so these
readings are coarser than the host's; they only raise a suspicion, which the probe
decides (below).

Under emulation (``emulate=``) the virtual NIC is what is slow, and the pacer knows what
it charged: per peer, all bytes sent over the seconds charged for them; those rates are
lower bounds on both ends of their link, and they travel as the first ``p`` values of the
contribution, reduced by the elementwise maximum.

Fractions are relative to the upper quartile of the observed ranks (half of them may be
slow, as on a degraded server; the single fastest measurement is a poor reference);
fractions at or above ``healthy_above`` count as healthy, and a rank with no observation
keeps its current fraction.

Decision: when some rank's measured fraction differs from the current profile by more
than ``threshold`` in ``confirm`` consecutive calls (hysteresis against noise), the
elementwise maximum of those measurements replaces the profile, if it still departs from
it. Every measurement is a lower bound and noise only makes a rank look slower (on the
testbed, the neighbours of a slow rank measured 0.6-0.78 in single calls of a ring): the
maximum keeps what the calls agree on.
Rates are lower bounds, and a plan that spares a slow rank keeps it from showing its full
speed once it recovers (on the testbed, a recovered rank under OptCC's plan for 0.5 looked
like 0.6 to 0.77, against 0.51 to 0.58 while it stayed slow). So rises count from half the
threshold (the profile climbs to what was measured, and the next plan shows more), and a
rank measured faster than the profile by more than ``threshold`` is taken as healthy; if
it is not, the ring that follows measures it in full. A plan that loads a rank at exactly
the fraction the profile gives it can also show exactly that fraction once the rank has
recovered (on the 4-rank testbed a recovered rank settled at 0.73-0.74 under the plan for
0.74): so after ``explore`` calls under an unchanged degraded profile one call runs as if
every link were healthy (the ring, which loads every rank alike, as when the degradation
was found), and where that call measures a rank faster than the profile says, its
measurement is adopted at once (noise only makes a rank look slower); otherwise the
profile stays and the next exploration waits twice as long (up to ``explore_max``).
Every input of the decision is in the gathered rows, identical on every rank, so every
rank decides the same at the same call.

What the traffic cannot tell apart (issue 35)
---------------------------------------------
A schedule's traffic gives lower bounds, and fractions of the fastest ranks it saw.
Where a healthy rank's every message crosses a slow rank's link (in a ring of four with
ranks 0 and 2 slow, ranks 1 and 3 only ever exchange with them; under OptCC's plan much
of a healthy rank's traffic goes through the slow one) it looks as slow as they do, and
where every link it saw is slow the reference is slow too: the ring of four with ranks
0 and 2 at 0.6 and 0.4 shows only rank 2 slow, at 0.67. So the traffic only *suspects*:
where the calls depart from the profile (the confirmed streak above, or an exploring
call's rise), every rank runs a probe at that call (:func:`optcc_mpi.probe.probe_ranks`:
the doctor's rounds and estimator, :mod:`optcc_mpi.linkrates`: every rank against
partners spread over the ring, a rank named only where a partner was clearly faster;
about ``probe_partners * probe_repeats`` messages per rank, from ``probe_size`` up,
doubled while too short to time) and the
profile follows what the probe found. A suspicion the probe found wrong is not probed
again for ``explore`` calls, twice as long each time it is found wrong again (up to
``explore_max``): the same traffic under the same plan keeps saying the same thing, and
a probe per call would cost more than the watch saves; nor is any other suspicion for
as long, up to ``probe_gap_max`` calls (noisy traffic blames a different rank each
time). On healthy links nothing departs
and nothing is probed. The link log's ``adopt`` record says why (which calls measured
what, what the probe found), and a ``probe`` record keeps every probe.

Steady under a held profile (issue 42, ours)
--------------------------------------------
A plan reads its own traffic with a bias: under OptCC's plan the slow ranks read high
(0.74-0.79 for a true 0.6 on the 8-rank testbed while a gloo message was stamped when the
executor's in-order loop reached it: healthy messages queued behind a slow one looked
slow and the reference dropped; stamped at their arrival, ``execute(stamp_from=)``,
ranks 2 and 5 at 0.6 and 0.4 read 0.63 and 0.49), and a watch that compared such
readings with the profile probed again every few calls. So a
profile the probe decided is followed by a few calibrating calls: per schedule (by its
layout's tag) the median of what they read is the schedule's *baseline*, its reading of
the truth, and later calls are compared with it (below the healthy cut, where a reading
is a number); a suspicion the probe clears under a degraded plan sets the baseline too.
A healthy plan loads every rank alike and has none. Where timings are noisy (ranks
outnumbering cores), each streak the probe finds wrong makes the next suspicion need one
more departing call, up to ``confirm_max``. The first exploration after a probe-decided
adoption waits eight times ``explore`` (the probe has just measured every rank alike).

Volume: each rank contributes ``p + 2`` values and its side of the timed messages, at
most :func:`watch_length` int64 (16 KiB up to 16 ranks, less beyond, so that the gather
moves at most ``FOLD_TOTAL`` bytes). When the timed messages need more, every ``s``-th of
them (in schedule order, the same choice on every rank) is recorded; from about 180 ranks
on, only the emulated rates fit. A call leaves the check of the next one exactly the room
its schedule's messages need, so a watched small call pays little.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from optcc_mpi import linklog, linkrates
from optcc_mpi.check.state import FOLD_TOTAL
from optcc_mpi.emulation import Emulation
from optcc_mpi.errors import ArgumentError
from optcc_mpi.executor import ExecStats
from optcc_mpi.linkrates import HEALTHY_ABOVE
from optcc_mpi.links import Links
from optcc_mpi.probe import (
    RANK_PROBE_BYTES,
    RANK_PROBE_PARTNERS,
    RANK_PROBE_REPEATS,
    RankProbe,
    probe_ranks,
)
from optcc_mpi.schedule import SEND, Schedule
from optcc_mpi.transports import Communicator

__all__ = [
    "WATCH", "MIN_BYTES", "LinkWatch", "MessageLayout", "Stopwatch", "send_rates", "watch_length",
]  # fmt: skip

#: The value of ``links`` that turns watching on.
WATCH = "watch"
#: Messages shorter than this are not timed: their time is mostly fixed per-message costs
#: (a 64 KiB message is 1.3 ms at 400 Mbit/s, against about 0.1 ms of such costs on the
#: testbed), and they would make a link look slower than it is.
MIN_BYTES = 64 * 1024
#: Most int64 one rank contributes (16 KiB).
_MOST = 2048
#: Header of the message values: how many values, the layout's tag, and this rank's time
#: of the last call, where the library served it and it was timed (ns; 0: not known here;
#: :meth:`LinkWatch.served`).
_HEAD = 3
#: Where in that header this rank's time of the last call is.
_TIME = 2
#: Timed calls of a size before their times arm the tripwire (:meth:`LinkWatch.armed`).
_ARMED = 5
#: How many of a size's last timed calls the tripwire compares with (their median).
_TIMES = 9


class Stopwatch:
    """This rank's time of a call the library's AllReduce serves in flight: from its
    posting (the stopwatch's making) to the moment its wait returned here
    (:meth:`stop`); 0.0 until then. Read (called) when the next call's contribution is
    made (:meth:`LinkWatch.served`): a call still in flight then is not timed, on any
    rank (a time of 0 on one rank sets the whole call's aside)."""

    __slots__ = ("t0", "took")

    def __init__(self) -> None:
        self.t0 = perf_counter()
        self.took = 0.0

    def stop(self) -> None:
        """The call completed, as seen here now (the first stop counts)."""
        if not self.took:
            self.took = max(perf_counter() - self.t0, 1e-9)

    def __call__(self) -> float:
        return self.took


def watch_length(p: int) -> int:
    """Int64 values each of ``p`` ranks contributes per call: the emulated rates (``p``),
    a header of three, and the message values, within ``FOLD_TOTAL`` bytes over all ranks
    (a power of two while it fits, so that it is a room size of the check)."""
    room = min(_MOST, FOLD_TOTAL // (8 * max(p, 1)))
    return max(room, p + _HEAD)


#: The length of a union of intervals (:func:`optcc_mpi.linkrates.busy`).
_busy = linkrates.busy


def send_rates(
    records: Iterable[tuple[int, int, float, float]], p: int, min_bytes: int = MIN_BYTES
) -> np.ndarray:
    """Per peer, the rate (bytes/s) of this rank's sends to it; 0 where none was timed.

    Parameters
    ----------
    records : iterable of (peer, nbytes, posted, completed)
        This rank's sends, times in seconds (under emulation: the pacer's charges).
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
        lo = np.array([a for a, _, _ in spans])
        hi = np.array([b for _, b, _ in spans])
        busy = _busy(lo, hi)
        rates[peer] = sum(n for _, _, n in spans) / busy if busy > 0 else 0.0
    return rates


class MessageLayout:
    """Which messages of a schedule are timed, and where their values travel.

    The same on every rank (it depends on the schedule, the element size and the room
    only). ``ids``: the schedule ids of the timed sends, ascending (every ``stride``-th
    of those of at least :data:`MIN_BYTES`). Rank ``r`` contributes the post times of
    its sends among them, in that order, then ``(posted, completed)`` of its receives
    among them, in that order.

    Parameters
    ----------
    schedule : Schedule
        What the call ran.
    itemsize : int
        Bytes per element.
    budget : int
        Most values one rank may contribute.
    """

    def __init__(self, schedule: Schedule, itemsize: int, budget: int) -> None:
        p = schedule.p
        nbytes = (schedule.hi - schedule.lo) * itemsize
        timed = np.flatnonzero((schedule.kind == SEND) & (nbytes >= MIN_BYTES))
        self.stride = 1
        while True:
            ids = timed[:: self.stride]
            sends = np.bincount(schedule.rank[ids], minlength=p)
            recvs = np.bincount(schedule.peer[ids], minlength=p)
            if ids.size == 0 or int((sends + 2 * recvs).max()) <= budget:
                break
            self.stride *= 2
        self.p = p
        self.ids = ids
        self.sender = schedule.rank[ids].astype(np.int64)
        self.receiver = schedule.peer[ids].astype(np.int64)
        self.nbytes = nbytes[ids].astype(np.float64)
        self.sends, self.recvs = sends, recvs
        #: Values of the rank that contributes most (every rank's row has this width).
        self.width = int((sends + 2 * recvs).max()) if ids.size else 0
        self.tag = (int(schedule.n_ops) * 131 + itemsize) * 64 + self.stride.bit_length()

    def values(self, rank: int, schedule: Schedule, stats: ExecStats, epoch: float) -> np.ndarray:
        """This rank's values for a call that ran ``schedule`` (``stats``: its
        :class:`~optcc_mpi.executor.ExecStats`; ``epoch``: the end of the check, a
        ``perf_counter`` value); -1 where a message was not recorded."""
        out = np.full(int(self.sends[rank] + 2 * self.recvs[rank]), -1, dtype=np.int64)
        if self.ids.size == 0:
            return out
        local = schedule.op_ids(rank)
        shift = stats.start - epoch
        mine_s = self.ids[self.sender == rank]
        if stats.sends and mine_s.size:
            rec = np.asarray(stats.sends, dtype=np.float64)
            keys = local[rec[:, 0].astype(np.int64)]
            at = _positions(mine_s, keys)
            ok = at >= 0
            out[at[ok]] = np.round((rec[ok, 3] + shift) * 1e6)
        mine_r = self.ids[self.receiver == rank]
        if stats.recvs and mine_r.size:
            rec = np.asarray(stats.recvs, dtype=np.float64)
            keys = schedule.partner[local[rec[:, 0].astype(np.int64)]]
            at = _positions(mine_r, keys)
            ok = at >= 0
            base = mine_s.size + 2 * at[ok]
            out[base] = np.round((rec[ok, 3] + shift) * 1e6)
            out[base + 1] = np.round((rec[ok, 4] + shift) * 1e6)
        return out

    def intervals(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per timed message (in the order of :attr:`ids`), when it was on the wire, in
        seconds from the check: from when both ends had posted it until it arrived, read
        from every rank's values (``rows``: one row per rank, as :meth:`values` wrote
        them); NaN where an end did not record it."""
        n = self.ids.size
        post, start, done = np.full(n, -1.0), np.full(n, -1.0), np.full(n, -1.0)
        for r in range(self.p):
            row = rows[r].astype(np.float64)
            ns, nr = int(self.sends[r]), int(self.recvs[r])
            post[self.sender == r] = row[:ns]
            pairs = row[ns : ns + 2 * nr].reshape(nr, 2)
            start[self.receiver == r] = pairs[:, 0]
            done[self.receiver == r] = pairs[:, 1]
        missing = (post < 0) | (start < 0) | (done < 0)
        lo = np.where(missing, np.nan, np.maximum(post, start) * 1e-6)
        hi = np.where(missing, np.nan, done * 1e-6)
        return lo, hi

    def rates(self, rows: np.ndarray) -> np.ndarray:
        """Per rank, its rate in bytes/s from every rank's values (``rows`` as for
        :meth:`intervals`): :func:`optcc_mpi.linkrates.rank_rates` of the messages'
        :func:`~optcc_mpi.linkrates.message_rates` (the call is one group), the
        estimator the probe shares; 0 where no message of the rank was measured. A
        message that seems to arrive before it was sent (the common clock is only as good
        as the skew of the check's end, which matters where messages take microseconds)
        is left out."""
        lo, hi = self.intervals(rows)
        egress, ingress = linkrates.message_rates(
            self.sender, self.receiver, self.nbytes, lo, hi, self.p
        )
        return np.nan_to_num(linkrates.rank_rates(egress, ingress), nan=0.0)


def _links(fracs: np.ndarray) -> Links:
    """The profile of the fractions ``fracs`` (one per rank; 1: healthy)."""
    return Links({r: float(f) for r, f in enumerate(fracs) if f < 1.0})


def _positions(ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Index of each key in the ascending ``ids``, or -1."""
    at = np.searchsorted(ids, keys)
    at = np.minimum(at, max(ids.size - 1, 0))
    return np.where(ids[at] == keys, at, -1)


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
        Consecutive calls that must show the departure (one more after each streak the
        probe found wrong, up to ``confirm_max``: noisy timings).
    healthy_above : float
        Measured fractions at or above this count as healthy (default
        :data:`optcc_mpi.linkrates.HEALTHY_ABOVE`, the doctor's too).
    explore : int
        Calls under an unchanged degraded profile before one call runs on the healthy
        profile to measure every rank alike (0: never); doubled after each exploration
        that finds the profile right, up to ``explore_max``.
    explore_max : int
        The longest wait between explorations.
    log : LinkLog, optional
        Where the profiles adopted and the algorithms run are recorded
        (:mod:`optcc_mpi.linklog`; rank 0 writes); default the file of
        :func:`~optcc_mpi.linklog.recording` or ``$OPTCC_LINKS_LOG``, if any.
    probe_size, probe_partners, probe_repeats : int
        The probe that decides what the traffic suspects (:func:`optcc_mpi.probe.
        probe_ranks`): bytes per message to start from (it doubles them while they are
        too short to time), partners per rank, repeats.
    probe_gap_max : int
        After a probe that changed nothing, the longest wait before any other suspicion
        is probed (the same suspicion waits ``explore`` calls, doubling up to
        ``explore_max``).
    sample : int
        On healthy links, one call in ``sample`` runs a schedule whose messages the watch
        times; the library's AllReduce serves the others where it is bandwidth-optimal.
    probe_margin : float
        A rank held healthy (or that the traffic shows healthy) that the probe names less
        than ``probe_margin`` under ``healthy_above`` is probed again, and adopted only
        if both probes name it.
    confirm_max : int
        The most departing calls in a row a suspicion may come to need (``confirm``
        grows by one with each streak the probe found wrong).
    """

    p: int
    threshold: float = 0.2
    confirm: int = 2
    healthy_above: float = HEALTHY_ABOVE
    explore: int = 4
    explore_max: int = 64
    profile: Links = field(default_factory=Links)
    calls: int = 0
    changes: list[tuple[int, Links]] = field(default_factory=list)
    #: What the last call's observations indicated (before the decision), if anything.
    measured: Links | None = None
    _mine: np.ndarray | None = None
    _values: np.ndarray | None = None
    #: A call whose message times the device still holds (NCCL's CUDA events): what
    #: :meth:`MessageLayout.values` needs once :meth:`ExecStats.settle` has them.
    _pending: tuple[int, Schedule, ExecStats, float] | None = None
    _layout: MessageLayout | None = None
    #: The measurements of the current run of departing calls; and each as read, with
    #: the schedule its messages came from (its layout's tag; None: emulated rates).
    _recent: list[np.ndarray] = field(default_factory=list)
    _recent_raw: list[tuple[int | None, np.ndarray]] = field(default_factory=list)
    #: Per schedule (layout tag), what its traffic reads while the profile is right:
    #: the departing readings of a suspicion the probe found wrong. Later calls of that
    #: schedule depart from these readings, not from the profile (the plan's own bias:
    #: a message timed when it is waited for, not when it arrived, makes healthy
    #: messages queued behind a slow one look slow, and the fractions of the slow ranks
    #: read high, 0.74-0.79 for 0.6 on the 8-rank testbed). Cleared when the profile
    #: changes (the plan does too).
    _baseline: dict[int | None, np.ndarray] = field(default_factory=dict)
    #: Observed calls left, after a profile the probe found was adopted, whose readings
    #: make their schedules' baselines without another probe (the probe just measured
    #: every rank: what the new plan's traffic reads now is its reading of the truth).
    _calibrating: int = 0
    _calibration: dict[int | None, list[np.ndarray]] = field(default_factory=dict)
    #: Departing calls in a row that make a suspicion (``confirm``, one more after each
    #: streak a probe found wrong, up to ``confirm_max``).
    _need: int = 0
    confirm_max: int = 5
    #: Calls since the profile last changed or was explored, the wait before the next
    #: exploration, and whether the last call was one.
    _steady: int = 0
    _gap: int = 0
    _exploring: bool = False
    log: linklog.LinkLog | None = None
    #: This process's rank, learnt from the first call it records (only rank 0 logs).
    rank: int | None = None
    probe_size: int = RANK_PROBE_BYTES
    probe_partners: int = RANK_PROBE_PARTNERS
    probe_repeats: int = RANK_PROBE_REPEATS
    #: Every probe: (call, what the traffic suspected, what the probe found, adopted).
    probes: list[tuple[int, Links, Links, bool]] = field(default_factory=list)
    #: Why the last profile was adopted (also in the link log's ``adopt`` record).
    why: str | None = None
    #: The ranks of a suspicion a probe found wrong (those the traffic showed departing
    #: from the profile), asked again only from call ``_cleared_until`` on; the wait
    #: doubles each time a probe clears them again.
    _cleared: frozenset[int] | None = None
    _cleared_until: int = 0
    _clear_gap: int = 0
    #: After a probe that changed nothing, no suspicion at all (of other ranks too) is
    #: probed before this call: where the traffic is noisy (8 ranks on 2 shared cores
    #: blamed a different healthy rank every other call) a probe per new suspicion would
    #: cost more than the watch saves. ``probe_gap_max`` bounds that wait, so that a real
    #: change after a cleared suspicion is still followed within about ten calls.
    _quiet_until: int = 0
    probe_gap_max: int = 8
    #: On healthy links, one call in this many runs a schedule whose messages are timed
    #: (:meth:`observes`).
    sample: int = 4
    #: The same where the library's calls of the call's size are timed (:meth:`armed`):
    #: a slow link slows the library's ring as much as ours, and the next call sees it
    #: (the tripwire), so samples are needed less often.
    sample_armed: int = 16
    #: Per size (bytes) of the calls the library's AllReduce served, and per schedule (its layout's
    #: tag, as ``("plan", tag)``) of the calls a degraded profile's plan ran, the times
    #: of the last calls (seconds, the fastest rank's: :meth:`_timed`); the key of the
    #: last call, where it was timed, and this rank's time of it; whether that call took
    #: longer than its key's calls usually do (then the next call that can show anything
    #: is observed), or less.
    _times: dict[object, list[float]] = field(default_factory=dict)
    _timed_key: object | None = None
    _my_time: float | Callable[[], float] = 0.0
    _tripped: bool = False
    _faster: bool = False
    #: A trip that no observed call has answered yet: one found while agreeing a call
    #: already served (a riding call agrees after its round), or by a call that could
    #: show nothing (:meth:`served`). It holds until a call observes.
    _trip_pending: bool = False
    #: A rank named by the probe within this much under ``healthy_above``, where the
    #: profile holds it healthy, is probed once more before it is adopted.
    probe_margin: float = 0.1
    #: On links held healthy, the spans (seconds from the first timed message's start to
    #: the last one's arrival, read from every rank's values alike) of the last observed
    #: calls, per schedule and size (:meth:`_slower`).
    _spans: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    #: Calls agreed that could show anything (:meth:`timeable`): what the sample counts.
    _sampled: int = 0
    #: The probe of the call being agreed (None: none can run, adopt what the traffic
    #: shows).
    _prober: Callable[[], RankProbe] | None = None

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 1:
            raise ArgumentError(f"watch: threshold {self.threshold!r} must be in (0, 1)")
        if self.confirm < 1:
            raise ArgumentError(f"watch: confirm {self.confirm!r} must be at least 1")
        if self.explore < 0 or self.explore_max < self.explore:
            raise ArgumentError(
                f"watch: explore {self.explore!r} must be at least 0 and at most "
                f"explore_max {self.explore_max!r}"
            )
        self._mine = np.zeros(self.p)
        self._need = self.confirm
        self._gap = self.explore
        self._clear_gap = max(self.explore, 1)
        if self.log is None:
            self.log = linklog.from_env()

    @property
    def length(self) -> int:
        """Most int64 values of :meth:`contribution` (:func:`watch_length`)."""
        return watch_length(self.p)

    def contribution_size(self) -> int:
        """Int64 values of the next :meth:`contribution` (the same on every rank: it
        depends on the schedule of the last call, which all of them ran)."""
        lay = self._layout
        return self.p + _HEAD + (lay.width if lay is not None and self._values is not None else 0)

    # -- one call: contribute, agree, run, record -------------------------------------
    def contribution(self) -> np.ndarray:
        """This rank's observations since the last call, :meth:`contribution_size` int64:
        the emulated rates (bytes/s, 0: none), then the number of message values, the
        layout's tag and the values (:class:`MessageLayout`)."""
        assert self._mine is not None
        out = np.zeros(self.contribution_size(), dtype=np.int64)
        out[: self.p] = np.round(self._mine)
        pending, self._pending = self._pending, None
        if pending is not None and self._layout is not None and pending[2].settle():
            self._values = self._layout.values(*pending)
        vals = self._values
        if vals is not None and self._layout is not None:
            out[self.p] = vals.size
            out[self.p + 1] = self._layout.tag
            out[self.p + _HEAD : self.p + _HEAD + vals.size] = vals
        if self._timed_key is not None:
            mine = self._my_time
            took = mine() if callable(mine) else mine
            out[self.p + _TIME] = max(round(took * 1e9), 1) if took > 0 else 0
        return out

    def agree(
        self,
        gathered: np.ndarray | None,
        wire: Communicator | None = None,
        emulate: Emulation | None = None,
        timeable: bool = True,
    ) -> Links:
        """Take every rank's :meth:`contribution` (one row per rank; a 1-D vector is read
        as the rates already reduced; None: every rank's was zeros, a call that rode
        carrying nothing) and return the profile to run this call with (the same on every
        rank). ``timeable``: whether this call could be observed (:meth:`timeable`); only
        such calls count for the sample (:meth:`observes`).

        ``wire``: the communicator's transport, on which every rank runs the probe at the
        same call where the traffic suspects a change (:meth:`_decide`; ``emulate``: the
        call's emulation). Without it, what the traffic shows is adopted as it is.
        """
        if wire is not None:
            self._prober = lambda: probe_ranks(
                wire,
                nbytes=self.probe_size,
                partners=self.probe_partners,
                repeats=self.probe_repeats,
                healthy_above=self.healthy_above,
                emulate=emulate,
            )
        try:
            if gathered is None:
                return self._agree_nothing(timeable)
            return self._agree(gathered, timeable)
        finally:
            self._prober = None

    def _agree_nothing(self, timeable: bool) -> Links:
        """:meth:`_agree` of every rank's contribution of zeros: where the links are held
        healthy with no emulated rates and nothing was to be carried (:meth:`quiet`,
        :meth:`carried_size` 0: no layout, no time to clear), the same state without its
        arrays (a short call riding across machines spent a fifth of its Python there:
        docs/results.md)."""
        assert self._mine is not None
        if self.profile.fractions or self._mine.any() or self.carried_size():
            return self._agree(np.zeros((self.p, self.contribution_size()), np.int64), timeable)
        self.calls += 1
        self._sampled += timeable
        self._tripped, self._trip_pending, self._faster = self._trip_pending, False, False
        self.measured = None
        self._exploring = False
        return self.profile

    def _agree(self, gathered: np.ndarray, timeable: bool = True) -> Links:
        self.calls += 1
        self._sampled += timeable
        self._mine = np.zeros(self.p)
        gathered = np.asarray(gathered)
        # (a trip no call answered yet stands: the next call that can show anything
        # observes, :meth:`observes`)
        self._tripped, self._trip_pending, self._faster = self._trip_pending, False, False
        timed, self._timed_key = self._timed_key, None
        if timed is not None and gathered.ndim == 2 and gathered.shape[1] >= self.p + _HEAD:
            self._timed(timed, gathered[:, self.p + _TIME])
        tag = self._layout.tag if self._layout is not None else None
        span: tuple[tuple[int, int], float] | None = None
        if gathered.ndim == 1:
            v = gathered.astype(float)
        else:
            v = self.observed(gathered)
            span = self._span(gathered)
        self._values, self._layout, self._pending = None, None, None
        measured = self.measured = self.estimate(v)
        explored, self._exploring = self._exploring, False
        if measured is None:
            # Nothing observed (the library served the call, or its messages were too
            # short to time): a streak of departing calls goes on at the next one that is.
            if self.profile.fractions and timeable and not explored:
                # A degraded profile's plan whose messages are all too short to time
                # (OptCC's at 1 MiB over 8 ranks): its traffic can show no change, so its
                # calls count toward the next exploring call (whose ring's messages are
                # timed), and a call that took longer or less than the plan's calls
                # usually do (:meth:`_timed`) makes this one explore: without it, the 8-rank
                # testbed held 0:0.5 for 900 calls while the links changed every 100.
                if self._tripped or self._faster:
                    self._steady = max(self._steady, self._gap)
                return self._steady_call()
            return self.profile
        cur = self.profile.vector(self.p)
        new = measured.vector(self.p)
        if explored:
            # The last call loaded every rank alike: a rank it shows faster than the
            # profile says is at least that fast. Only the rises are taken on this one
            # measurement (noise only makes a rank look slower); a rank it shows slower
            # has to depart in calls of its own.
            # (Against what this schedule read when the probe last found the profile
            # right, if it did: the ring of four with ranks 0 and 2 slow shows rank 0
            # healthy whatever it is.)
            self._recent, self._recent_raw = [], []
            base = self._baseline.get(tag)
            seen, ref = new, cur
            if base is not None:
                seen, ref = (
                    np.minimum(new, self.healthy_above),
                    np.minimum(base, self.healthy_above),
                )
            if np.any(seen - ref > self.threshold / 2):
                before = len(self.changes)
                got = self._decide(
                    np.maximum(cur, new), f"the exploring call {self.calls - 1} (the healthy "
                    f"profile) measured {measured}", {tag: new}, explored=True,
                )  # fmt: skip
                if len(self.changes) > before:
                    return got
            self._steady, self._gap = 0, min(2 * self._gap, self.explore_max)
            return self.profile
        # Where the probe found the profile right while this schedule's traffic read
        # otherwise, what it read then is what it reads while nothing changes: the call
        # departs from that, and its estimate is the profile moved as far as the
        # reading moved (the held fractions while steady).
        raw = new
        if self._calibrating > 0:
            # (the median of the schedule's readings so far: what it typically reads;
            # one fast outlier would make every typical call depart)
            self._calibrating -= 1
            calibration = self._calibration.setdefault(tag, [])
            calibration.append(raw)
            self._baseline[tag] = np.median(calibration, axis=0)
            self.measured = self.profile
            return self.profile
        base = self._baseline.get(tag)
        ref = cur
        if base is not None:
            moved = cur * new / np.maximum(base, 0.01)
            self.measured = _links(np.clip(np.round(moved, 2), 0.01, 1.0))
            # Compared below the healthy cut, where a reading is a number (above it,
            # 0.79 and 1.0 are the same link read either side of the cut).
            ref, new = np.minimum(base, self.healthy_above), np.minimum(new, self.healthy_above)
        # A measured rate is a lower bound: a rank the plan gives little traffic never
        # shows its full speed. So a rank measured clearly faster than the profile says
        # (than its reading while steady) has recovered by more than we can see: it
        # counts as healthy, and the plan that follows (the ring, if it is the only one)
        # measures it in full.
        new = np.where(new > ref + self.threshold, 1.0, new)
        # (on healthy links a departure needs the call to have been slower too: _slower)
        slower = self._slower(span)
        if not self._departs(new, ref) or slower is False:
            self._recent, self._recent_raw = [], []
            return self._steady_call()
        need = self._need
        self._recent = [*self._recent, new][-need:]
        self._recent_raw = [*self._recent_raw, (tag, raw)][-need:]
        if len(self._recent) < need:
            return self.profile
        # Every measurement is a lower bound, and noise only ever makes a rank look slower:
        # the elementwise maximum of the streak's measurements is the tightest bound.
        readings: dict[int | None, np.ndarray] = {}
        for t, r in self._recent_raw:
            readings[t] = r if t not in readings else np.maximum(readings[t], r)
        best = np.max(self._recent, axis=0)
        best = np.where(best >= self.healthy_above, 1.0, best)
        self._recent, self._recent_raw = [], []
        if self._departs(best, cur) or base is not None:
            first = self.calls - need
            return self._decide(
                best, f"calls {first}-{self.calls - 1} measured {_links(best)} "
                f"(each departing from {self.profile})", readings,
            )  # fmt: skip
        return self.profile

    def _decide(
        self,
        suspect: np.ndarray,
        why: str,
        readings: dict[int | None, np.ndarray] | None = None,
        explored: bool = False,
    ) -> Links:
        """The traffic suspects ``suspect`` (``why``: which calls showed what;
        ``readings``: what each schedule's calls read, kept as that schedule's baseline
        if the probe finds the profile right). A
        schedule's traffic can blame a healthy rank whose every message crossed a slow
        one (a lower bound is all a message gives), and fractions are of the fastest ranks
        it saw, which may all be slow: so where a probe can run, every rank runs it at
        this call and the profile follows what it found (:func:`optcc_mpi.probe.
        probe_ranks`: each rank against partners spread over the ring). A suspicion the
        probe found wrong is not probed again for a while (``explore`` calls, doubling up
        to ``explore_max`` while it stays wrong): the same traffic under the same plan
        says the same thing, and a probe per call would cost more than the watch saves."""
        prober = self._prober
        if prober is None:
            return self._adopt(suspect, why)
        cur = self.profile.vector(self.p)
        # Which ranks the traffic blames (or clears): by rank, not by value, so that a
        # noisy repeat of a suspicion already found wrong is still the same suspicion.
        ranks = frozenset(
            int(r) for r in np.flatnonzero(np.abs(suspect - cur) > self.threshold / 2)
        )
        if self.calls < self._quiet_until or (
            self._cleared is not None
            and self.calls < self._cleared_until
            and ranks <= self._cleared
        ):
            return self.profile
        found = prober()
        got = found.links.vector(self.p)
        # A rank the profile holds healthy, or the traffic now shows healthy, that the
        # probe names just under the threshold may be noise (on the 8-rank testbed a
        # recovered rank once read 0.79, and over MPI one the traffic showed recovered
        # read 0.73 and was held there for 100 calls): a second probe decides, each rank
        # keeping the larger of its two fractions (noise only ever makes a rank look
        # slower). Slow ranks, well under it, need no second look.
        low = self.healthy_above - self.probe_margin
        seen_healthy = (cur >= 1.0) | (suspect >= self.healthy_above)
        if np.any((got < self.healthy_above) & (got >= low) & seen_healthy):
            again = prober()
            both = np.maximum(got, again.links.vector(self.p))
            got = np.where(both >= self.healthy_above, 1.0, both)
            found = dataclasses.replace(
                again,
                links=_links(got),
                fractions=np.fmax(found.fractions, again.fractions),
                seconds=found.seconds + again.seconds,
                repeats=found.repeats + again.repeats,
            )
        change = self._departs(got, cur)
        self.probes.append((self.calls, _links(suspect), found.links, change))
        if self.log is not None and self.rank in (None, 0):
            self.log.probed(self.calls, self.p, _links(suspect), found, why, adopted=change)
        if change:
            self._cleared, self._clear_gap = None, max(self.explore, 1)
            adopted = self._adopt(got, f"{why}; the probe found {found}", found=found.fractions)
            # (two readings of each of two alternating schedules: DDP's bucket sizes)
            # (a healthy profile's plan, the library's or the ring, loads every rank
            # alike: its traffic has no plan's bias to learn, only noise)
            self._calibrating = 2 * self.confirm if self.profile.fractions else 0
            # The probe has just measured every rank alike, as an exploring call would:
            # the first exploration waits eight times as long (on the 8-rank testbed the
            # exploring calls 8, 17 and 34 calls after an adoption cost more than the
            # probe that decided it; since a watched call's messages are timed at their
            # arrival, the plan's own traffic shows a recovery: a long run's recoveries
            # were all found by it, none by an exploration).
            self._gap = min(8 * self.explore, self.explore_max)
            return adopted
        if readings and self.profile.fractions:
            # The profile is right and these schedules read otherwise under it: what they
            # read is their reading while nothing changes (_baseline). Not on healthy
            # links, whose plan has no bias: there a wrong suspicion was noise.
            self._baseline.update(readings)
        if not explored:
            # A streak of departing calls that the probe found wrong: this network's
            # timings are noisy (8 ranks on 2 cores: a rank not scheduled when its
            # message arrives reads slow, and in two calls running another rank); one
            # more call must confirm the next streak (noise rarely blames one rank that
            # long; a slow link does every call), up to confirm_max.
            self._need = min(self._need + 1, max(self.confirm_max, self.confirm))
        self._cleared = ranks
        self._cleared_until = self.calls + self._clear_gap
        self._quiet_until = self.calls + min(self._clear_gap, self.probe_gap_max)
        self._clear_gap = min(2 * self._clear_gap, max(self.explore_max, 1))
        return self.profile

    def _adopt(self, fracs: np.ndarray, why: str = "", found: np.ndarray | None = None) -> Links:
        """Make ``fracs`` the profile from this call on (``why``: the link log's reason;
        ``found``: the probe's fractions, if one decided)."""
        self.profile = _links(fracs)
        # (another plan: its traffic reads anew; another network: its times too)
        self._baseline, self._calibrating, self._calibration = {}, 0, {}
        self._times, self._tripped, self._trip_pending = {}, False, False
        self.changes.append((self.calls, self.profile))
        self.why = why or None
        if self.log is not None and self.rank in (None, 0):
            self.log.adopted(
                self.calls, self.p, self.profile, self.measured, why=why or None, probe=found
            )
        self._steady, self._gap = 0, self.explore
        return self.profile

    def _steady_call(self) -> Links:
        """The profile for a call that found it right; every so often under a degraded
        profile, the healthy one instead, so that the call measures every rank alike."""
        if not self.profile.fractions or not self.explore:
            return self.profile
        self._steady += 1
        if self._steady < self._gap:
            return self.profile
        self._steady, self._exploring = 0, True
        return Links()

    def served(self, rank: int, schedule: Schedule, nbytes: int, took: float | Stopwatch) -> None:
        """The library's AllReduce serves the call just agreed (it rode, or the watch left
        it to the library: :meth:`observes` said no), running ``schedule``, and took this
        rank ``took`` seconds from posting to completion, or will have once the
        :class:`Stopwatch` stopped (a call left in flight). The link log is told what it
        ran (:meth:`unobserved`), and where it could show anything (:meth:`timeable`) on
        links held healthy, its time goes with this rank's next contribution
        (:meth:`_timed`). Called on every rank alike, when the call is posted, so that
        every rank's next contribution has a place for the time (:meth:`carried_size`)."""
        self._ran(rank, schedule)
        # (a trip this call did not answer, observing, stands for the next: _agree)
        self._trip_pending = self._tripped
        if self.timeable(nbytes) and not self.profile.fractions:
            self._timed_key, self._my_time = nbytes, took

    def _timed(self, key: object, ns: np.ndarray) -> None:
        """Every rank's time of the last call (``ns``, one per rank), of ``key``: its size
        in bytes where the library served it (or ``("plan", tag)`` where it ran a degraded profile's
        plan: the same test, slower or faster, makes a plan too short to time explore,
        :meth:`_agree`): the fastest rank's is the ring's own time (the last rank to post
        waits for nothing else; the others' add how long they waited for it). Where it is
        at least ``1 / (1 - threshold)`` times the median of the key's last calls (a slow
        link slows the whole ring), the next call that can show anything is observed
        (:meth:`observes`); the rate-based tests decide as before. On the 4-rank testbed
        (1 Gbit/s, 1 MiB) that time varied little (median 12.49 ms, 90th percentile
        12.73 ms: 1.7% of calls over the gate), and a rank at 0.6 made it 20.34 ms
        (docs/results.md)."""
        if not np.all(ns > 0):
            return
        t = float(ns.min()) / 1e9
        times = self._times.setdefault(key, [])
        if len(times) >= _ARMED:
            usual = statistics.median(times)  # (a few floats: NumPy's costs 12 us a call)
            self._tripped = self._tripped or t * (1 - self.threshold) >= usual
            self._faster = t <= usual * (1 - self.threshold)
        times.append(t)
        del times[:-_TIMES]

    def armed(self, nbytes: int) -> bool:
        """Whether the library's calls of ``nbytes`` are timed often enough that a slow
        link shows at the next one (:meth:`_timed`): then the sample is
        ``sample_armed``."""
        return len(self._times.get(nbytes, ())) >= _ARMED

    def _sample(self, nbytes: int | None) -> int:
        """One timeable call in how many a healthy profile samples, for a call of
        ``nbytes`` (None: not known, ``sample``)."""
        armed = nbytes is not None and self.armed(nbytes)
        return max(self.sample_armed if armed else self.sample, 1)

    def timeable(self, nbytes: int) -> bool:
        """Whether a call of ``nbytes`` could show the watch anything on healthy links:
        the ring's messages (``nbytes / p``) are at least :data:`MIN_BYTES`, the
        shortest it times. A shorter call is left to the library (a schedule of ours
        would cost a ring in Python and time nothing) and does not count for the
        sample, so that a pattern of calls (DDP's buckets) cannot keep it from the
        longer ones."""
        return nbytes >= self.p * MIN_BYTES

    def observes(self, timeable: bool = True, nbytes: int | None = None) -> bool:
        """Whether the call being planned (after :meth:`agree`; ``timeable``: as told
        to it) should run a schedule of ours, whose messages the watch times: always
        under a degraded profile; on healthy links every ``sample``-th call that
        could show anything (:meth:`timeable`), the library's AllReduce serving the
        others where it is bandwidth-optimal (what the watch costs there: on the 4-rank
        testbed a ring per call made DDP's step 1.017x the step told healthy links, which
        gloo's AllReduce served; one call in two 1.013-1.016x; one in four 1.007x); one
        in ``sample_armed`` where the library's calls of this size (``nbytes``) are
        timed (:meth:`armed`). A slow rank is still found within a few calls: the first
        call of a job is observed, and so is every call while departing calls are being
        confirmed (two observed departing calls, then the probe), and the call after a
        timed one that was slow (:meth:`_timed`). The same answer on every rank (the
        calls are counted alike, the streak and the times are agreed)."""
        return timeable and (
            bool(self.profile.fractions)
            or bool(self._recent)
            or self._tripped
            or (self._sampled - 1) % self._sample(nbytes) == 0
        )

    def quiet(self, timeable: bool = True, nbytes: int | None = None) -> bool:
        """Whether the next call (``timeable``: :meth:`timeable`) needs nothing of its
        own from the watch: links held healthy, no emulated rates, and a call that could
        show nothing, or one while no departure is being confirmed that the sample does
        not take. Such a call is served by the library's AllReduce whatever it carries
        (:meth:`observes` is False after it), so it may ride
        (:mod:`optcc_mpi.check.ride`), carrying :meth:`carried_size` values. The same
        answer on every rank: it reads only what every rank agreed."""
        assert self._mine is not None
        if self.profile.fractions or self._mine.any():
            return False
        return not timeable or (
            not self._recent and not self._tripped and self._sampled % self._sample(nbytes) != 0
        )

    def carried_size(self) -> int:
        """Int64 values each rank carries to the next call: :meth:`contribution_size`
        where the last call was observed (its message values) or timed (:meth:`served`),
        else 0 (nothing to tell; a contribution of zeros says the same)."""
        told = self._layout is not None or self._timed_key is not None
        return self.contribution_size() if told else 0

    def _span(self, rows: np.ndarray) -> tuple[tuple[int, int], float] | None:
        """The last call's schedule and size, and the span of its timed messages read
        from every rank's values ``rows`` (the same on every rank), or None."""
        lay, values = self._layout, self._message_values(rows)
        if lay is None or values is None or lay.ids.size == 0:
            return None
        lo, hi = lay.intervals(values)
        if np.all(np.isnan(lo)):
            return None
        return (lay.tag, int(lay.nbytes.sum())), float(np.nanmax(hi) - np.nanmin(lo))

    def _slower(self, span: tuple[tuple[int, int], float] | None) -> bool | None:
        """On links held healthy, whether the call just observed took longer than its
        schedule's calls usually do by as much as a link departing by ``threshold``
        would make it (``1 / (1 - threshold)``: a bandwidth-optimal AllReduce on healthy
        links, the ring, goes at its slowest link's pace); None where that cannot be
        told (a degraded profile, no span, fewer than three earlier spans of the same
        schedule and size to compare with). The span is kept for the calls to come.

        Why: a single message's rate is a lower bound that noise only lowers, and
        where messages last a few milliseconds that noise is most of it (at 1 Gbit/s
        on the 4-rank testbed, 4 ranks on 2 cores, every other observed 1 MiB call read
        some healthy rank at 0.02-0.8, while the calls' spans stayed within 0.9-1.2x
        their median): a link slow enough to matter slows the whole call, noise in a
        message's stamps does not."""
        if span is None or self.profile.fractions:
            return None
        key, secs = span
        seen = self._spans.setdefault(key, [])
        slower = None
        if len(seen) >= 3:
            slower = secs >= float(np.median(seen)) / (1.0 - self.threshold)
        if len(self._spans) > 64 and len(seen) == 0:
            self._spans = {key: seen}  # (a handful of schedules: DDP's buckets)
        seen.append(secs)
        del seen[:-9]
        return slower

    def _departs(self, new: np.ndarray, cur: np.ndarray) -> bool:
        """Whether ``new`` departs from ``cur``: some rank slower by more than
        ``threshold``, or faster by more than half of it (a measured rate is a lower
        bound, so a rise is evidence, and a profile that undervalues a rank keeps it from
        showing more)."""
        return bool(np.any(cur - new > self.threshold) or np.any(new - cur > self.threshold / 2))

    def observed(self, rows: np.ndarray) -> np.ndarray:
        """Per rank, bytes/s observed in the gathered contributions ``rows``: the larger
        of the emulated rates' maximum and the paired messages' estimate."""
        v = rows[:, : self.p].max(axis=0).astype(float)
        values = self._message_values(rows)
        if values is None:
            return v
        assert self._layout is not None  # (_message_values: there is one)
        return np.maximum(v, self._layout.rates(values))

    def _message_values(self, rows: np.ndarray) -> np.ndarray | None:
        """The message values of the gathered contributions ``rows`` (one row per rank),
        where every rank recorded the last call under its layout; else None (nothing to
        pair)."""
        lay, p = self._layout, self.p
        if lay is None or rows.shape[1] < p + _HEAD:
            return None
        if not (
            np.all(rows[:, p + 1] == lay.tag)
            and np.array_equal(rows[:, p], lay.sends + 2 * lay.recvs)
        ):
            return None
        return rows[:, p + _HEAD :]

    def estimate(self, v: np.ndarray) -> Links | None:
        """The profile the observations ``v`` (bytes/s per rank) indicate, or None when
        fewer than half of the ranks were observed."""
        seen = v > 0
        if seen.sum() * 2 < self.p or not seen.any():
            return None
        frac = self.profile.vector(self.p).copy()
        # The reference is the upper quartile: half the ranks may be slow (a degraded
        # server), and the single fastest measurement is noise (the probe's too).
        ref = linkrates.upper_quartile(v)
        frac[seen] = linkrates.relative_rates(v, ref)[0][seen]
        frac = np.where(frac >= self.healthy_above, 1.0, np.round(frac, 2))
        frac = np.maximum(frac, 0.01)
        return Links({r: float(f) for r, f in enumerate(frac) if f < 1.0})

    def record(
        self,
        rank: int,
        sends: Iterable[tuple[int, int, float, float]],
        schedule: Schedule | None = None,
    ) -> None:
        """Fold this rank's paced sends ``(peer, nbytes, from, until)`` of the call into
        the observation for the next call (emulation: ``v[rank]`` and ``v[peer]`` are at
        least the rate of the link ``rank -> peer``). ``schedule``, what the call ran,
        names its algorithm in the link log."""
        assert self._mine is not None
        self._ran(rank, schedule)
        rates = send_rates(sends, self.p)
        if not rates.any():
            return
        self._mine = np.maximum(self._mine, rates)
        self._mine[rank] = max(self._mine[rank], float(rates.max()))

    def record_messages(
        self, rank: int, schedule: Schedule, itemsize: int, stats: ExecStats, epoch: float
    ) -> None:
        """Keep this rank's side of the call's timed messages for the next call (a real
        network: see the module's estimator). ``epoch``: when the check ended here."""
        self._ran(rank, schedule)
        self._tripped = False  # (answered: this call observed)
        cache = schedule.__dict__.setdefault("_watch_layouts", {})
        key = (itemsize, self.length)
        lay = cache.get(key)
        if lay is None:
            lay = cache[key] = MessageLayout(schedule, itemsize, self.length - self.p - _HEAD)
        self._layout = lay
        if self.profile.fractions:
            # (the plan's call time: the tripwire of a plan too short to time, _agree)
            self._timed_key, self._my_time = ("plan", lay.tag), stats.seconds
        if stats.settle():
            self._values, self._pending = lay.values(rank, schedule, stats, epoch), None
        else:
            # NCCL: the times are marks on the device, read at the next call's check if
            # the device has passed them by then (the check never waits for the device);
            # until then, values of messages not recorded, of the agreed length.
            width = int(lay.sends[rank] + 2 * lay.recvs[rank])
            self._values = np.full(width, -1, dtype=np.int64)
            self._pending = (rank, schedule, stats, epoch)

    def unobserved(self, rank: int, schedule: Schedule) -> None:
        """A call the library served (:meth:`observes` said no): nothing of it is timed,
        and the link log is told what it ran."""
        self._ran(rank, schedule)

    def _ran(self, rank: int, schedule: Schedule | None) -> None:
        """Note this rank, and on rank 0 tell the link log what the call ran."""
        self.rank = rank
        if self.log is not None and rank == 0 and schedule is not None:
            self.log.ran(
                self.calls,
                self.p,
                str(schedule.name),
                self.profile,
                self.measured,
                explore=self._exploring,
            )
