"""Finding the slow links: a short, bounded pairwise bandwidth probe.

Users rarely know which rank is degraded. ``links="probe"`` measures it: in each of a few
*shifts* every rank sends ``nbytes`` to rank + s and receives from rank - s at the same
time, so every NIC carries one flow per direction; the receiver times its message. A
transfer runs at the rate of the slower of its two ends, so a rank's send rate is at least
the fastest of its outgoing transfers and its receive rate at least the fastest incoming
one; a degraded NIC limits both, so a rank's rate is the faster of the two (the estimator
of :mod:`optcc_mpi.linkrates`, the watch's too). With two shifts every healthy rank meets
at least one healthy partner (p >= 3), and a degraded rank shows up slow on both sides.
Fractions are relative to the median rank, which
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

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optcc_mpi import linkrates
from optcc_mpi.arrays import Array, ArrayOps
from optcc_mpi.emulation import Emulation
from optcc_mpi.executor import execute
from optcc_mpi.links import Links
from optcc_mpi.schedule import RECV, Schedule, ScheduleBuilder
from optcc_mpi.transports import Communicator, Transport
from optcc_mpi.transports import of as transport_of

__all__ = [
    "ProbeResult", "probe", "ONE_SHOT_HEALTHY_ABOVE", "RankProbe", "probe_ranks",
    "MIN_SECONDS", "MAX_BYTES", "RANK_PROBE_BYTES", "RANK_PROBE_PARTNERS", "RANK_PROBE_REPEATS",
    "rank_fractions", "link_rate",
]  # fmt: skip

#: The healthy threshold of :func:`probe` (``links="probe"``) alone: fractions of the
#: median rank at or above this count as healthy. Lower than the doctor's and the watch's
#: :data:`optcc_mpi.linkrates.HEALTHY_ABOVE` (0.8) because what it judges is noisier: one
#: probe of two shifts, taken once and cached for the communicator, whose single
#: measurements of healthy ranks vary by up to 20% on the namespace testbed (2 shared
#: cores); nothing measures again to clear a healthy rank it named slow.
ONE_SHOT_HEALTHY_ABOVE = 0.75

#: :func:`probe_ranks` doubles its messages until the fastest takes at least this long
#: (a message's fixed costs then weigh under about 5% on the testbed; its receives are
#: timed at their arrival, ``execute(stamp_from=)``: 80 ms before they were, and the 8-rank
#: testbed's probes at 40 ms found every profile of a long run)...
MIN_SECONDS = 0.04
#: ... or they reach this size.
MAX_BYTES = 16 << 20
#: :func:`probe_ranks`' defaults, the watch's too (:class:`optcc_mpi.watch.LinkWatch`'s
#: ``probe_size``, ``probe_partners``, ``probe_repeats``): bytes per message to start from
#: (doubled while too short to time, above), partners per rank spread over the ring (the
#: doctor's too: :data:`optcc_mpi.doctor.DEFAULT_PARTNERS` is this one), and repeats (fewer
#: than the doctor's 5: the watch runs it mid-job).
RANK_PROBE_BYTES = 2 << 20
RANK_PROBE_PARTNERS = 3
RANK_PROBE_REPEATS = 3


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
    reference: float = math.nan
    """A healthy link's rate (bytes/s) as measured: the upper quartile of the ranks' rates
    (NaN: nothing measured). The same on every rank (from the gathered rates)."""

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
    healthy_above: float = ONE_SHOT_HEALTHY_ABOVE,
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
        Fractions of the median rank's bandwidth at or above this count as healthy
        (default :data:`ONE_SHOT_HEALTHY_ABOVE`).
    """
    wire = transport_of(comm)
    p, rank = wire.size, wire.rank
    t_start = time.perf_counter()
    if p < 2:
        return ProbeResult(Links(), np.full(1, np.inf), np.full(1, np.inf), 0.0, nbytes)
    emu = Emulation.coerce(emulate)
    shifts = [1] if p == 2 else [1, 2]
    buf, arrays = wire.scratch(nbytes)
    rates: dict[int, np.ndarray] = {}
    for s in shifts:
        sched = _shift_schedule(p, nbytes, s)
        best = 0.0
        for _ in range(repeats):
            pacer = emu.pacer(rank, p, Links()) if emu is not None else None
            wire.barrier()
            stats = execute(
                sched,
                buf,
                comm=wire,
                op="sum",
                arrays=arrays,
                pacer=pacer,
                trace=True,
                stamp_from=1,
            )
            for _op, kind, posted, done in stats.trace:
                if kind == RECV and done > posted:
                    best = max(best, nbytes / (done - posted))
        rates[s] = np.array(wire.allgather(best))
    # rate[r] of shift s: the transfer r - s -> r. Each rank's rate is the shared
    # estimator's (linkrates.rank_rates: the faster of its directions, each the fastest of
    # its transfers), against the median rank.
    pair = {((r - s) % p, r): float(v) for s, rate in rates.items() for r, v in enumerate(rate)}
    send, recv = linkrates.bounds(pair, p)
    both = linkrates.rank_rates(send, recv)
    frac, _ = linkrates.relative_rates(both, None)
    frac = np.where(np.isnan(frac), 1.0, frac)  # (not measured: nothing to name)
    frac = np.where(frac >= healthy_above, 1.0, np.maximum(np.round(frac, 2), 0.01))
    links = Links({r: float(f) for r, f in enumerate(frac) if f < 1.0})
    return ProbeResult(
        links, np.nan_to_num(send, nan=0.0), np.nan_to_num(recv, nan=0.0),
        time.perf_counter() - t_start, nbytes, rates,
        linkrates.upper_quartile(both) or math.nan,
    )  # fmt: skip


@dataclass
class RankProbe:
    """What :func:`probe_ranks` measured and concluded (the same on every rank)."""

    links: Links
    """The ranks named slow, at their fractions."""
    fractions: np.ndarray
    """Per rank, the fraction of its rate (:func:`optcc_mpi.linkrates.rank_rates`: the
    faster of its egress and ingress; NaN: not measured)."""
    unresolved: list[int]
    """Ranks below the threshold whose partners were as slow (not named)."""
    reference: float
    """The rate (bytes/s) fractions are of."""
    source: str
    """Where the reference came from: ``the emulated rate`` or ``the upper quartile``."""
    seconds: float
    shifts: list[int]
    size: int
    repeats: int

    def __str__(self) -> str:
        text = f"{self.links} ({len(self.shifts)} partners, {self.repeats} repeat"
        text += f"{'s' if self.repeats != 1 else ''} of {self.size >> 10} KiB, "
        text += f"{self.seconds * 1e3:.0f} ms; against {self.source}"
        if self.unresolved:
            text += f"; unresolved {','.join(map(str, self.unresolved))}"
        return text + ")"


def probe_ranks(
    comm: Communicator,
    *,
    nbytes: int = RANK_PROBE_BYTES,
    partners: int = RANK_PROBE_PARTNERS,
    repeats: int = RANK_PROBE_REPEATS,
    healthy_above: float = linkrates.HEALTHY_ABOVE,
    emulate: Emulation | str | None = None,
    clock: bool = False,
    min_seconds: float = MIN_SECONDS,
    max_bytes: int = MAX_BYTES,
) -> RankProbe:
    """Every rank's fraction from messages to and from partners spread over the ring:
    the doctor's ``inter`` rounds and estimator (:mod:`optcc_mpi.linkrates`), short and
    with no agreement of its own (the caller's ranks agreed to run it: the watch).

    In each round every rank ``r`` sends ``nbytes`` to ``r + s`` for one shift ``s`` of
    :func:`~optcc_mpi.linkrates.spread` (so every NIC carries one flow per direction),
    after a barrier from whose end the receiver times its message; repeats are the outer
    loop. Under emulation a message's seconds are what the virtual NICs charged for it
    (one repeat: the charges do not vary), and fractions are of the emulated rate;
    otherwise of the upper quartile of the ranks' rates (up to half of them may be
    slow). Collective on ``comm``; ``partners * repeats`` messages of ``nbytes`` per
    rank. ``clock``: time the messages by the clock under emulation too, as on a real
    network (the tests of that path; the reference stays the emulated rate).

    Timed by the clock, a message carries a fixed cost of its own (TCP's window opening,
    the ranks' wake-ups on shared cores) that makes a fast link look slower, and so a
    slow rank look less slow than it is: on the 8-rank testbed at 400 Mbit/s, 2 MiB
    messages rated the healthy links at 38-44 MB/s and ranks at 0.6 and 0.4 at 0.69 and
    0.49; 4 MiB at 45-46 MB/s and 0.60-0.61, 0.43-0.44. So where the fastest message of a
    repeat took under ``min_seconds``, the size doubles (up to ``max_bytes``, the same
    on every rank: decided from the gathered times) and the repeats start again at it;
    only the repeats at the last size count. ``size`` in the result is that size.
    """
    wire = transport_of(comm)
    p = wire.size
    t_start = time.perf_counter()
    emu = Emulation.coerce(emulate)
    shifts = linkrates.spread(p, partners)
    # Per message (sender, receiver, seconds), the receiver's clock from the barrier; under
    # emulation the virtual NICs' charges instead (the sender's for its send, the
    # receiver's for its receive: the slower is the link's), exact and free of the noise
    # of ranks that share cores, as the watch's own emulated observations are.
    paced = emu is not None and emu.bw is not None and not clock
    size = nbytes
    rows: list[list[tuple[int, int, int, float]]] = []
    rep = 0
    buf, arrays = wire.scratch(size)
    while rep < (1 if paced else repeats):  # (charges do not vary: once is enough)
        mine = _probe_repeat(wire, shifts, buf, arrays, size, rep, emu, paced)
        got = wire.allgather(mine)
        rows.extend(got)
        fastest = min((secs for r in got for *_, secs in r if secs > 0), default=math.inf)
        if not paced and fastest < min_seconds and size < max_bytes:
            # Every rank saw the same gathered times: the same new size, the same restart.
            size, rows, rep = min(2 * size, max_bytes), [], 0
            buf, arrays = wire.scratch(size)
            continue
        rep += 1
    if emu is not None and emu.bw is not None:  # (paced)
        ref: float | None = float(emu.bw)
        source = "the emulated rate"
    else:
        ref, source = None, "the upper quartile"
    links, unresolved, frac, ref = rank_fractions(rows, size, p, ref, healthy_above)
    return RankProbe(
        links, frac, unresolved, float(ref or 0.0), source, time.perf_counter() - t_start,
        shifts, size, 1 if paced else repeats,
    )  # fmt: skip


def rank_fractions(
    records: Iterable[Iterable[tuple[int, int, int, float]]],
    size: int,
    p: int,
    ref: float | None = None,
    healthy_above: float = linkrates.HEALTHY_ABOVE,
) -> tuple[Links, list[int], np.ndarray, float | None]:
    """What :func:`probe_ranks` concludes from its timed messages.

    Parameters
    ----------
    records : iterable of iterables of (round, sender, receiver, seconds)
        Every rank's records (a message both ends timed counts at the slower: each end's
        seconds are a lower bound on the message's).
    size : int
        Bytes per message.
    p : int
        Ranks.
    ref : float, optional
        The rate fractions are of; default the upper quartile of the ranks' rates
        (:func:`optcc_mpi.linkrates.upper_quartile`).
    healthy_above : float
        Fractions at or above this are healthy.

    Returns
    -------
    links, unresolved, fractions, ref
        :func:`optcc_mpi.linkrates.named`'s answer (each rank's rate the shared estimator's,
        :func:`optcc_mpi.linkrates.rank_rates`, of the fastest message per direction: a
        round is one message each way per rank) and the reference used (None: nothing
        measured).
    """
    secs_of: dict[tuple[int, int, int], float] = {}
    for row in records:
        for rnd, a, b, secs in row:
            key = (int(rnd), int(a), int(b))
            secs_of[key] = max(secs_of.get(key, 0.0), float(secs))
    pair: dict[tuple[int, int], float] = {}
    for (_, a, b), secs in secs_of.items():
        if secs > 0:
            pair[(a, b)] = max(pair.get((a, b), 0.0), size / secs)
    if ref is None:
        ref = linkrates.upper_quartile(linkrates.rank_rates(*linkrates.bounds(pair, p)))
    links, unresolved, frac = linkrates.named(pair, p, ref, healthy_above)
    return links, unresolved, frac, ref


def link_rate(comm: Communicator) -> float | None:
    """A healthy link's rate in bytes/s, measured (collective on ``comm``): one round of
    :func:`probe_ranks` (every rank sends to the next and receives from the previous,
    the message doubled until it takes :data:`MIN_SECONDS`), the upper quartile of the
    ranks' rates, so that up to half of them may be slow. The same on every rank (from
    the gathered times); None where nothing was measured (a single rank).

    What the collectives learn when told no rate (:mod:`optcc_mpi.planning`): about
    ``MIN_SECONDS`` plus one barrier, once per communicator (0.05 s at 400 Mbit/s on 8
    ranks, 0.4 s at 50 Mbit/s on 16, where the smallest message already takes longer).
    """
    if transport_of(comm).size < 2:
        return None
    found = probe_ranks(comm, partners=1, repeats=1)
    return found.reference if found.reference > 0 else None


def _probe_repeat(
    wire: Transport[Any],
    shifts: list[int],
    buf: Array,
    arrays: ArrayOps[Any, Any],
    size: int,
    rep: int,
    emu: Emulation | None,
    paced: bool,
) -> list[tuple[int, int, int, float]]:
    """One repeat of :func:`probe_ranks`: a round per shift; this rank's records
    ``(round, sender, receiver, seconds)``."""
    p, rank = wire.size, wire.rank
    mine: list[tuple[int, int, int, float]] = []
    for i, s in enumerate(shifts):
        rnd = rep * len(shifts) + i
        sched = _shift_schedule(p, size, s)
        pacer = emu.pacer(rank, p, Links()) if emu is not None else None
        wire.quiet_barrier()
        t0 = time.perf_counter()
        stats = execute(
            sched, buf, comm=wire, op="sum", arrays=arrays, pacer=pacer, trace=True, stamp_from=1
        )
        src, dst = (rank - s) % p, (rank + s) % p
        if pacer is not None and paced:
            mine.append((rnd, rank, dst, pacer.charged_to.get(dst, 0.0)))
            mine.append((rnd, src, rank, pacer.charged_seconds["recv"]))
            continue
        for _op, kind, _posted, done in stats.trace:
            if kind == RECV:
                mine.append((rnd, src, rank, stats.start + done - t0))
    return mine
