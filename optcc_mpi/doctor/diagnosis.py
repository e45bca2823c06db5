"""What the doctor found, from every rank's timings: the verdicts (:class:`Verdict`) of
every rank (:class:`RankRow`) and node (:class:`NodeRow`), the :class:`Diagnosis` with its
table, its one-line summary and its exit status, and :func:`diagnose`, which reaches them
(a pure function: every rank computes the same). The rounds, and the ``k`` node shifts
and ``R`` repeats counted below, are :mod:`optcc_mpi.doctor.rounds`'s.

Estimator
---------
A message moves at the pace of the slower of its two ends, so its rate is a lower bound
on its sender's egress and its receiver's ingress, and noise (another job's traffic, a
descheduled process) only ever makes a link look slower. A rank's egress is the fastest
of its ``inter`` messages out, over every partner and repeat (``k * R`` measurements),
its ingress the fastest in; a node's aggregate rates likewise from the ``node`` rounds,
where a message pair ``a -> b`` moves ``L(a)`` messages. Fractions are relative to the
median rank (node), which assumes fewer than half of them are degraded, or to
``expect``. A link is flagged only when all of its ``k * R`` measurements fell below
``healthy_above``, which is what separates a degraded link from noise; the spread of
the per-repeat fractions is reported beside it. A rank whose low rate every one of its
partners could explain (their own rates were no faster) is *unresolved*, not blamed.

Fewer than three nodes
----------------------
The median of two links cannot say whether either is slow, and with two nodes every
message crosses both ends, so the measurements alone never say *which* end is slow. The
doctor then judges against an expected rate, the first it has of: ``expect``; under
emulation, the virtual NIC's rate; the speed every node's interface reports (a physical
device's ``/sys/class/net/IF/speed``; the highest one, since a link may have come up
slower on one end); an earlier healthy record's median link (``baseline``). Against it
the link between the two is judged healthy or degraded; its slow end is named where the
ends differ in what the system reports of them (one interface reporting a lower speed
than the other's), otherwise both ends say ``unresolved`` and the summary says that the
ends cannot be told apart. Without any expected rate the verdict is ``inconclusive`` and
its one line says what to pass.

A node is degraded when its aggregate fraction is below the threshold, or when every one
of its ranks is; its ranks then say ``node``, and the summary names the node, not a rank.
A rank below the threshold on a healthy node is blamed alone (one rail of a multi-NIC
node). Intra-node rates are reported beside the others; with ``judge_intra`` a rank
whose intra-node rate is below the threshold of the median intra-node rate says
``intra`` (host memory copies follow the load on the node's CPUs, so this is off by
default).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optcc_mpi import linkrates
from optcc_mpi.doctor.rounds import Layout, Round, RoundPlan
from optcc_mpi.errors import ArgumentError
from optcc_mpi.links import Links

__all__ = [
    "EXIT_HEALTHY",
    "EXIT_ERROR",
    "EXIT_DEGRADED",
    "EXIT_INCONCLUSIVE",
    "EXIT_STATUSES",
    "CHECK_STATUSES",
    "Verdict",
    "RANK_VERDICTS",
    "SLOW_VERDICTS",
    "RankRow",
    "NodeRow",
    "Diagnosis",
    "diagnose",
    "bitrate",
]

#: Exit statuses of ``optcc-mpi doctor`` (:data:`EXIT_STATUSES` says what each means).
EXIT_HEALTHY = 0
EXIT_ERROR = 2
EXIT_DEGRADED = 3
EXIT_INCONCLUSIVE = 4
#: What each exit status of a measuring run means: ``--help``, docs/doctor.md and the
#: code say the same (tests/test_doctor.py checks the first two against this table).
EXIT_STATUSES = {
    EXIT_HEALTHY: "healthy: every link measured and at or above the threshold",
    EXIT_ERROR: "an error: bad arguments, an output path that cannot be written, a world "
    "of one rank (no launcher, or srun without --mpi), MPI or gloo could not start",
    EXIT_DEGRADED: "a link is degraded: a node or rank named, or a slow link whose end "
    "cannot be told (unresolved)",
    EXIT_INCONCLUSIVE: "inconclusive: nothing to judge against (fewer than 3 nodes and no "
    "expected rate), or ranks not measured (a single node)",
}
#: What each exit status of ``--check`` (one host's verdict in a doctor's JSON) means.
CHECK_STATUSES = {
    EXIT_HEALTHY: "every rank of the host was measured and healthy",
    EXIT_ERROR: "an error: no such file, or not a doctor's JSON",
    EXIT_DEGRADED: "the host was named: its link or one of its ranks' paths is degraded",
    EXIT_INCONCLUSIVE: "the host was not named and not cleared: unresolved (a slow link with "
    "it at one end), unmeasured, unjudged, or not in the file",
}


class Verdict(str, enum.Enum):
    """What the doctor concluded of a rank or a node (:class:`RankRow`, :class:`NodeRow`).

    A string as well (its value): records and JSON files hold the words, and a verdict
    compares equal to its word."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    NODE = "node"
    INTRA = "intra"
    UNRESOLVED = "unresolved"
    UNMEASURED = "unmeasured"
    UNJUDGED = "unjudged"
    #: (a node's only) some of its ranks' own paths are slow, not its link
    RANKS = "ranks"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


#: Verdicts of a rank (:class:`RankRow`), each with what it means.
RANK_VERDICTS = {
    Verdict.HEALTHY: "every measurement at or above the threshold",
    Verdict.DEGRADED: "this rank's own path is slow (its node is not)",
    Verdict.NODE: "its node's link is slow",
    Verdict.INTRA: "slow inside its node (only with --judge-intra)",
    Verdict.UNRESOLVED: "slow, but every partner was as slow: cannot tell which end",
    Verdict.UNMEASURED: "no message of it crossed a network (a node alone)",
    Verdict.UNJUDGED: "measured, with nothing to judge it against (fewer than 3 nodes and "
    "no expected rate)",
}
#: Verdicts that name a slow link somewhere: the run's status is then ``degraded``.
SLOW_VERDICTS = (Verdict.DEGRADED, Verdict.NODE, Verdict.INTRA, Verdict.UNRESOLVED)
#: A partner whose own rate is within this factor of a rank's low rate may have been
#: what limited it.
_EXPLAIN = linkrates.EXPLAIN


@dataclass
class RankRow:
    """One rank's measurements and verdict (rates in bytes/s; NaN: not measured)."""

    rank: int
    host: str
    node: str
    local_rank: int
    egress: float
    ingress: float
    fraction_egress: float
    fraction_ingress: float
    fraction: float
    """The smaller of the two fractions."""
    spread: tuple[float, float]
    """Lowest and highest fraction over the repeats."""
    intra_egress: float
    intra_ingress: float
    intra_fraction: float
    verdict: Verdict
    """One of :data:`RANK_VERDICTS`: ``healthy``, ``degraded`` (this rank's own path),
    ``node`` (its node's link is degraded), ``intra`` (slow within its node),
    ``unresolved``, ``unmeasured`` or ``unjudged``."""


@dataclass
class NodeRow:
    """One node's measurements and verdict (rates in bytes/s; NaN: not measured)."""

    name: str
    ranks: list[int]
    egress: float
    """All of the node's ranks sending at once (one rank per node: that rank's)."""
    ingress: float
    fraction_egress: float
    fraction_ingress: float
    fraction: float
    verdict: Verdict
    """``healthy``, ``degraded`` (its link), ``ranks`` (some of its ranks' paths),
    ``intra`` (within the node), ``unresolved``, ``unmeasured`` or ``unjudged``."""
    interface: str | None = None
    """The interface its traffic leaves by (:func:`expected.interface_speed`), as the lowest rank
    of the node found it."""
    reported: float = math.nan
    """The speed the system reports for that interface (bytes/s; NaN: none)."""


@dataclass
class Diagnosis:
    """What :func:`run.doctor` found (the same on every rank)."""

    status: str
    """``healthy``, ``degraded`` or ``inconclusive``."""
    summary: str
    ranks: list[RankRow]
    nodes: list[NodeRow]
    links: Links
    """The degraded ranks as a link profile (a node's ranks get its fraction): what the
    planner would be told (``allreduce(..., links=...)``)."""
    healthy_above: float
    reference: str
    """``median`` or the expected rate."""
    median_egress: float
    median_ingress: float
    size: int
    partners: int
    repeats: int
    rounds: int
    seconds: float = 0.0
    bytes_sent: list[int] = field(default_factory=list)
    bytes_received: list[int] = field(default_factory=list)
    messages_sent: list[int] = field(default_factory=list)
    messages_received: list[int] = field(default_factory=list)
    charged_seconds: list[float] = field(default_factory=list)
    """Under emulation: per rank, the seconds its virtual NIC was charged over all rounds
    (the busier direction per round)."""
    emulated_seconds: float | None = None
    """Under emulation: the duration by the pacers' own accounting, the sum over rounds
    of the most any rank's virtual NIC was charged (no clock involved)."""
    group: str = "host"
    emulate: str | None = None
    reference_source: str = "median"
    """Where the reference came from: ``median``, ``--expect``, ``the emulated rate``,
    ``the speed IF reports``, ``an earlier healthy record``, or ``none`` (fewer than 3
    nodes and no expected rate)."""
    node_partners: int = 0
    """Partner nodes every rank really had (the plan's node shifts: at most nodes - 1)."""
    local_partners: int = 0
    """Partners inside its node (the plan's local shifts; 0 at one rank per node)."""

    def header(self) -> str:
        """The line above the table: what was sent, counted as it really ran."""
        k, kl, p, n = self.node_partners, self.local_partners, len(self.ranks), len(self.nodes)
        who = f"{k} partner node{'s' if k != 1 else ''}" if k else "no partner node"
        if kl:
            who += f", {kl} partner{'s' if kl != 1 else ''} inside its node"
        sent = max(self.bytes_sent, default=0) / 2**20
        return (
            f"# optcc-mpi doctor: {p} rank{'s' if p != 1 else ''} on {n} "
            f"node{'s' if n != 1 else ''}, {self.rounds} rounds of "
            f"{self.size / 2**20:g} MiB messages ({who}; {self.repeats} repeats), "
            f"{sent:.0f} MiB sent per rank, {self.seconds:.1f} s"
        )

    @property
    def exit_status(self) -> int:
        """:data:`EXIT_HEALTHY`, :data:`EXIT_DEGRADED` or :data:`EXIT_INCONCLUSIVE`."""
        return {
            "healthy": EXIT_HEALTHY,
            "degraded": EXIT_DEGRADED,
        }.get(self.status, EXIT_INCONCLUSIVE)

    @property
    def flagged(self) -> list[int]:
        """Ranks whose verdict names a slow link (:data:`SLOW_VERDICTS`), slowest first."""
        rows = [r for r in self.ranks if r.verdict in SLOW_VERDICTS]
        return [r.rank for r in sorted(rows, key=_rank_key)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (NaN becomes None)."""
        out = {
            "status": self.status,
            "exit_status": self.exit_status,
            "summary": self.summary,
            "links": str(self.links),
            "healthy_above": self.healthy_above,
            "reference": self.reference,
            "median_egress": self.median_egress,
            "median_ingress": self.median_ingress,
            "size": self.size,
            "partners": self.partners,
            "repeats": self.repeats,
            "rounds": self.rounds,
            "seconds": self.seconds,
            "group": self.group,
            "emulate": self.emulate,
            "reference_source": self.reference_source,
            "node_partners": self.node_partners,
            "local_partners": self.local_partners,
            "nodes": [vars(n) for n in self.nodes],
            "ranks": [vars(r) for r in self.ranks],
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "messages_sent": self.messages_sent,
            "messages_received": self.messages_received,
            "charged_seconds": self.charged_seconds,
            "emulated_seconds": self.emulated_seconds,
        }
        return _clean(out)

    def table(self) -> str:
        """The per-node, per-rank table, slowest first, and the summary line."""
        multi = any(len(n.ranks) > 1 for n in self.nodes)
        head = ["node", "rank", "local", "egress", "ingress", "fraction", "repeats"]
        if multi:
            head.append("intra-node")
        head.append("verdict")
        rows: list[list[str]] = []
        by_rank = {r.rank: r for r in self.ranks}
        for node in self.nodes:
            members = sorted((by_rank[r] for r in node.ranks), key=_rank_key)
            if len(node.ranks) > 1:
                row = [node.name, "all", "-", bitrate(node.egress), bitrate(node.ingress)]
                row += [_frac(node.fraction), "-"]
                row += ["-", node.verdict.upper() if node.verdict != Verdict.HEALTHY else "healthy"]
                rows.append(row)
            for r in members:
                name = "" if len(node.ranks) > 1 else node.name
                row = [name, str(r.rank), str(r.local_rank), bitrate(r.egress), bitrate(r.ingress)]
                row += [_frac(r.fraction), f"{_frac(r.spread[0])}-{_frac(r.spread[1])}"]
                if multi:
                    row.append(_frac(r.intra_fraction))
                row.append(r.verdict.upper() if r.verdict != Verdict.HEALTHY else "healthy")
                rows.append(row)
        cells = [head, *rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
        lines = []
        for k, row in enumerate(cells):
            text = "  ".join(
                c.ljust(w) if i in (0, len(head) - 1) else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths))
            )
            lines.append(text.rstrip())
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines) + "\n" + self.summary


def _clean(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return None if not math.isfinite(float(obj)) else round(float(obj), 6)
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def bitrate(v: float) -> str:
    """Bytes/s as people quote links: ``394 Mbit/s``, ``9.87 Gbit/s``."""
    if not math.isfinite(v):
        return "-"
    bits = v * 8
    if bits >= 1e9:
        return f"{bits / 1e9:.3g} Gbit/s"
    return f"{bits / 1e6:.3g} Mbit/s"


def _frac(v: float) -> str:
    return "-" if not math.isfinite(v) else f"{v:.2f}"


def _rank_key(r: RankRow) -> tuple[float, int]:
    return (r.fraction if math.isfinite(r.fraction) else 2.0, r.rank)


#: ``values`` over the reference (:func:`optcc_mpi.linkrates.relative_rates`).
_fractions = linkrates.relative_rates


#: Seconds of every message, by (round, sender, receiver).
_Seconds = dict[tuple[int, int, int], float]


def _seconds(records: Sequence[dict[str, Any]]) -> _Seconds:
    """Every message's seconds from the receivers' records (one per rank, in rank
    order; ``rows`` of (round, sender, seconds))."""
    secs: _Seconds = {}
    for dst, rec in enumerate(records):
        for i, src, t in np.asarray(rec["rows"]).reshape(-1, 3):
            secs[(int(i), int(src), dst)] = float(t)
    return secs


def _message_rates(
    the_plan: RoundPlan, secs: _Seconds, phase: str
) -> list[tuple[Round, int, int, float]]:
    """(round, sender, receiver, bytes/s) of every timed message of ``phase``."""
    out = []
    for i, rnd in enumerate(the_plan.rounds):
        if rnd.phase != phase:
            continue
        for s, d in zip(rnd.src.tolist(), rnd.dst.tolist()):
            t = secs.get((i, s, d))
            if t is not None and t > 0:
                out.append((rnd, s, d, the_plan.size / t))
    return out


def _node_rates(the_plan: RoundPlan, secs: _Seconds) -> tuple[np.ndarray, np.ndarray]:
    """Per node, the fastest aggregate egress and ingress of the ``node`` rounds: all the
    messages from node a to node b of a round, over the time the last of them took."""
    lay = the_plan.layout
    neg = np.full(lay.n_nodes, math.nan)
    nin = np.full(lay.n_nodes, math.nan)
    for i, rnd in enumerate(the_plan.rounds):
        if rnd.phase != "node":
            continue
        flows: dict[tuple[int, int], list[float]] = {}
        for s, d in zip(rnd.src.tolist(), rnd.dst.tolist()):
            key = (int(lay.node[s]), int(lay.node[d]))
            flows.setdefault(key, []).append(secs.get((i, s, d), math.nan))
        for (a, b), ts in flows.items():
            t = max(ts)
            if math.isfinite(t) and t > 0:
                v = the_plan.size * len(ts) / t
                neg[a] = np.fmax(neg[a], v)
                nin[b] = np.fmax(nin[b], v)
    return neg, nin


def diagnose(
    the_plan: RoundPlan,
    records: Sequence[dict[str, Any]],
    *,
    healthy_above: float = linkrates.HEALTHY_ABOVE,
    expect: float | None = None,
    judge_intra: bool = False,
    source: str | None = None,
    speeds: Sequence[float] | None = None,
    ifaces: Sequence[str | None] | None = None,
) -> Diagnosis:
    """The verdicts from every rank's record of :func:`run._measure` (a pure function: every
    rank computes the same).

    Parameters
    ----------
    the_plan : RoundPlan
        What ran.
    records : sequence of dict
        One per rank, in rank order: ``rows``, an array of (round, sender, seconds).
    healthy_above : float
        Fractions at or above this are healthy (default
        :data:`optcc_mpi.linkrates.HEALTHY_ABOVE`).
    expect : float, optional
        Reference rate (bytes/s) instead of the median (:func:`expected.reference`).
    judge_intra : bool
        Flag ranks whose intra-node rate is below the threshold of the median one (off by
        default: the intra-node messages are host memory copies, whose rate follows the
        load on the node's CPUs; on the 2-core testbed it ranged over 0.16-1 of the
        median from one run to the next).
    source : str, optional
        Where ``expect`` came from (:func:`expected.reference`; default ``--expect`` when given).
    speeds, ifaces : sequence, optional
        Per node, the speed its interface reports (bytes/s, NaN: none) and the
        interface's name (:func:`expected.interface_speed`): a slow link's end is named where
        only one end reports less than the others.
    """
    if not 0 < healthy_above <= 1:
        raise ArgumentError(f"healthy_above must be in (0, 1], not {healthy_above!r}")
    lay = the_plan.layout
    if source is None:
        source = "median" if expect is None else "--expect"
    sp = np.full(lay.n_nodes, math.nan) if speeds is None else np.asarray(speeds, dtype=float)
    if sp.shape != (lay.n_nodes,):
        raise ArgumentError(f"speeds: one per node ({lay.n_nodes}), not {sp.shape}")
    secs = _seconds(records)
    alone = _rank_rates(the_plan, secs, expect)
    # Each node's NIC with all its ranks at once (the reference: one link's rate); with
    # one rank per node that is the rank alone.
    node = _node_fractions(the_plan, secs, expect) if lay.per_node > 1 else alone
    intra = _intra_rates(the_plan, secs)
    node_deg, verdicts = _verdicts(lay, alone, node, intra, healthy_above, judge_intra)
    verdicts = _resolve_ends(lay, alone, verdicts, sp, healthy_above)
    for a, members in enumerate(lay.members):  # a node all of whose ranks are now named
        if not node_deg[a] and all(verdicts[r] == Verdict.DEGRADED for r in members):
            node_deg[a] = True
            for r in members:
                verdicts[r] = Verdict.NODE if len(members) > 1 else Verdict.DEGRADED
    # Fewer than 3 nodes with nothing to judge against: measured, not judged.
    too_few = lay.n_nodes < 3 and expect is None
    if too_few:  # (intra-node verdicts are judged against the intra-node median)
        node_deg[:] = False
        verdicts = [
            v if v in (Verdict.UNMEASURED, Verdict.INTRA) else Verdict.UNJUDGED for v in verdicts
        ]
    # An unresolved rank is still a slow link somewhere (at one of its ends).
    slow = bool(node_deg.any() or any(v in SLOW_VERDICTS for v in verdicts))
    if slow:
        status = "degraded"
    elif too_few or Verdict.UNMEASURED in verdicts:
        status = "inconclusive"
    else:
        status = "healthy"
    ranks = _rank_rows(lay, alone, intra, verdicts)
    nodes = _node_rows(lay, alone, node, node_deg, verdicts)
    names = list(ifaces) if ifaces is not None else [None] * lay.n_nodes
    index = {n: i for i, n in enumerate(lay.names)}
    for row in nodes:
        row.interface, row.reported = names[index[row.name]], float(sp[index[row.name]])
    if too_few:  # a fraction of the median of two links would look like a verdict
        for r in ranks:
            r.fraction_egress = r.fraction_ingress = r.fraction = math.nan
            r.spread = (math.nan, math.nan)
        for n in nodes:
            n.fraction_egress = n.fraction_ingress = n.fraction = math.nan
    diag = Diagnosis(
        status=status,
        summary="",
        ranks=ranks,
        nodes=nodes,
        links=_profile(lay, alone, node, verdicts),
        healthy_above=healthy_above,
        reference="median" if source == "median" else "none" if too_few else bitrate(expect),
        median_egress=alone.median_egress,
        median_ingress=alone.median_ingress,
        size=the_plan.size,
        partners=the_plan.partners,
        repeats=the_plan.repeats,
        rounds=len(the_plan.rounds),
        group=lay.group,
        reference_source="none" if too_few else source,
        node_partners=len(the_plan.shifts),
        local_partners=len(the_plan.local_shifts),
    )
    diag.summary = _summary(diag, lay)
    return diag


def _resolve_ends(
    lay: Layout, alone: _RankRates, verdicts: list[Verdict], speeds: np.ndarray, thr: float
) -> list[Verdict]:
    """Unresolved ranks told apart by what the system reports of their ends: where every
    node reports an interface speed, an unresolved rank on a node reporting below
    ``thr`` of the highest is the slow end (``degraded``); an unresolved rank whose every
    partner is then named, on a node reporting full speed, was only held back by them
    (``healthy``)."""
    if Verdict.UNRESOLVED not in verdicts or not np.isfinite(speeds).all():
        return verdicts
    low = speeds < thr * speeds.max()
    out = list(verdicts)
    for r, v in enumerate(verdicts):
        if v == Verdict.UNRESOLVED and low[lay.node[r]]:
            out[r] = Verdict.DEGRADED
    for r, v in enumerate(verdicts):
        if v != Verdict.UNRESOLVED or low[lay.node[r]]:
            continue
        partners = {d for (s, d) in alone.pair if s == r} | {s for (s, d) in alone.pair if d == r}
        if partners and all(out[q] in (Verdict.DEGRADED, Verdict.NODE) for q in partners):
            out[r] = Verdict.HEALTHY
    return out


@dataclass(frozen=True, eq=False)
class _Rates:
    """Per rank (or node): the fastest rates measured out and in (bytes/s; NaN: never
    measured), their fractions of the reference, and the smaller fraction."""

    egress: np.ndarray
    ingress: np.ndarray
    fe: np.ndarray
    fi: np.ndarray
    frac: np.ndarray


@dataclass(frozen=True, eq=False)
class _RankRates(_Rates):
    """Each rank alone (the ``inter`` rounds), with what its verdict needs beyond the
    rates: the references, the spread over repeats, and who it exchanged with."""

    median_egress: float
    median_ingress: float
    per_repeat: np.ndarray
    """(repeats, p): the fraction per repeat, against the same reference."""
    pair: dict[tuple[int, int], float]
    """Fastest rate per (sender, receiver)."""


def _rank_rates(the_plan: RoundPlan, secs: _Seconds, expect: float | None) -> _RankRates:
    """Each rank alone: per repeat, its fastest message out and in; over the repeats,
    the fastest (the estimator of the module docstring: noise only slows a link)."""
    p, reps = the_plan.layout.p, the_plan.repeats
    eg_r = np.full((reps, p), math.nan)
    in_r = np.full((reps, p), math.nan)
    pair: dict[tuple[int, int], float] = {}
    for rnd, s, d, v in _message_rates(the_plan, secs, "inter"):
        eg_r[rnd.repeat, s] = np.fmax(eg_r[rnd.repeat, s], v)
        in_r[rnd.repeat, d] = np.fmax(in_r[rnd.repeat, d], v)
        pair[(s, d)] = max(pair.get((s, d), 0.0), v)
    with np.errstate(all="ignore"):
        egress = np.fmax.reduce(eg_r, axis=0)  # NaN only where never measured
        ingress = np.fmax.reduce(in_r, axis=0)
    fe, med_e = _fractions(egress, expect)
    fi, med_i = _fractions(ingress, expect)
    # Per repeat, the same fractions against the same reference: the spread.
    ref_e = expect if expect is not None else med_e
    ref_i = expect if expect is not None else med_i
    # A rank's fraction is the smaller of its two directions', not the faster as in the
    # one estimator of the watch and the probes (optcc_mpi.linkrates.rank_rates), on
    # purpose: the doctor diagnoses links, and a link slow one way only (a shaper on one
    # direction, a duplex mismatch) is one it must name, where the faster direction would
    # call it healthy (linkrates leaves such links to the doctor). What makes the smaller
    # unsafe there, a healthy rank whose every message one way met a slow partner (a
    # ring's neighbours of a slow rank), cannot blame a rank here: each direction is the
    # best of k partners spread over the ring times R repeats, and a rank whose low
    # direction its partners explain is unresolved, not degraded (_explained).
    # tests/test_doctor.py::test_a_rank_slow_in_one_direction_only_is_named holds it.
    with np.errstate(invalid="ignore"):
        per_rep = np.fmin(np.minimum(eg_r / ref_e, 1.0), np.minimum(in_r / ref_i, 1.0))
    return _RankRates(egress, ingress, fe, fi, np.fmin(fe, fi), med_e, med_i, per_rep, pair)


def _node_fractions(the_plan: RoundPlan, secs: _Seconds, expect: float | None) -> _Rates:
    """Each node's aggregate rates (:func:`_node_rates`) and their fractions."""
    neg, nin = _node_rates(the_plan, secs)
    nfe, _ = _fractions(neg, expect)
    nfi, _ = _fractions(nin, expect)
    return _Rates(neg, nin, nfe, nfi, np.fmin(nfe, nfi))


def _intra_rates(the_plan: RoundPlan, secs: _Seconds) -> _Rates:
    """Inside each node: each rank's fastest message to and from its node's other
    ranks, against the median intra-node rate (never ``expect``, a network rate)."""
    p = the_plan.layout.p
    ieg = np.full(p, math.nan)
    iin = np.full(p, math.nan)
    for _rnd, s, d, v in _message_rates(the_plan, secs, "intra"):
        ieg[s] = np.fmax(ieg[s], v)
        iin[d] = np.fmax(iin[d], v)
    ife, _ = _fractions(ieg, None)
    ifi, _ = _fractions(iin, None)
    return _Rates(ieg, iin, ife, ifi, np.fmin(ife, ifi))


def _explained(r: int, alone: _RankRates, thr: float) -> bool:
    """Whether rank r's low rates could all be its partners' (the estimator the watch's
    probe shares: :func:`optcc_mpi.linkrates.explained`)."""
    return linkrates.explained(
        r, alone.pair, alone.egress, alone.ingress, bool(alone.fe[r] < thr),
        bool(alone.fi[r] < thr), _EXPLAIN,
    )  # fmt: skip


def _verdicts(
    lay: Layout,
    alone: _RankRates,
    node: _Rates,
    intra: _Rates,
    thr: float,
    judge_intra: bool,
) -> tuple[np.ndarray, list[str]]:
    """Which nodes are degraded, and every rank's verdict (:class:`RankRow`).

    A node is degraded when its aggregate fraction is below ``thr`` or every one of its
    ranks is (and no partner explains it); its ranks then say ``node`` (``degraded`` for a
    node of one rank). Otherwise a rank below ``thr`` is ``degraded``, or ``unresolved``
    where its partners were as slow; with ``judge_intra``, a slow intra-node rate says
    ``intra``. A rank none of whose messages crossed a network (a node alone) is
    ``unmeasured``, never ``healthy``."""
    multi = lay.per_node > 1
    frac = alone.frac
    node_deg = np.zeros(lay.n_nodes, dtype=bool)
    for a, members in enumerate(lay.members):
        ranks_low = all(frac[r] < thr and not _explained(r, alone, thr) for r in members)
        node_deg[a] = bool((multi and node.frac[a] < thr) or ranks_low)
    verdicts = []
    for r in range(lay.p):
        if node_deg[lay.node[r]] and len(lay.members[lay.node[r]]) > 1:
            v = Verdict.NODE
        elif node_deg[lay.node[r]]:
            v = Verdict.DEGRADED
        elif frac[r] < thr:
            v = Verdict.UNRESOLVED if _explained(r, alone, thr) else Verdict.DEGRADED
        elif judge_intra and intra.frac[r] < thr:
            v = Verdict.INTRA
        elif not math.isfinite(frac[r]):
            v = Verdict.UNMEASURED
        else:
            v = Verdict.HEALTHY
        verdicts.append(v)
    return node_deg, verdicts


def _rank_rows(
    lay: Layout, alone: _RankRates, intra: _Rates, verdicts: list[Verdict]
) -> list[RankRow]:
    """One :class:`RankRow` per rank, in rank order."""
    rank_rows = []
    for r in range(lay.p):
        rep = alone.per_repeat[:, r]
        rep = rep[np.isfinite(rep)]
        spread = (float(rep.min()), float(rep.max())) if rep.size else (math.nan, math.nan)
        rank_rows.append(
            RankRow(
                rank=r,
                host=lay.hosts[r],
                node=lay.names[lay.node[r]],
                local_rank=int(lay.local[r]),
                egress=float(alone.egress[r]),
                ingress=float(alone.ingress[r]),
                fraction_egress=float(alone.fe[r]),
                fraction_ingress=float(alone.fi[r]),
                fraction=float(alone.frac[r]),
                spread=spread,
                intra_egress=float(intra.egress[r]),
                intra_ingress=float(intra.ingress[r]),
                intra_fraction=float(intra.frac[r]),
                verdict=verdicts[r],
            )
        )
    return rank_rows


def _node_rows(
    lay: Layout, alone: _RankRates, node: _Rates, node_deg: np.ndarray, verdicts: list[Verdict]
) -> list[NodeRow]:
    """One :class:`NodeRow` per node, slowest first (by the lowest of its own fraction
    and its ranks')."""
    node_rows = []
    for a, members in enumerate(lay.members):
        vs = {verdicts[r] for r in members}
        if node_deg[a]:
            nv = Verdict.DEGRADED
        elif Verdict.DEGRADED in vs:
            nv = Verdict.RANKS
        elif Verdict.INTRA in vs:
            nv = Verdict.INTRA
        elif Verdict.UNRESOLVED in vs:
            nv = Verdict.UNRESOLVED
        elif vs == {Verdict.UNMEASURED}:
            nv = Verdict.UNMEASURED
        elif vs <= {Verdict.UNJUDGED, Verdict.UNMEASURED}:
            nv = Verdict.UNJUDGED
        else:
            nv = Verdict.HEALTHY
        node_rows.append(
            NodeRow(
                name=lay.names[a],
                ranks=list(members),
                egress=float(node.egress[a]),
                ingress=float(node.ingress[a]),
                fraction_egress=float(node.fe[a]),
                fraction_ingress=float(node.fi[a]),
                fraction=float(node.frac[a]),
                verdict=nv,
            )
        )
    frac = alone.frac

    def node_key(row: NodeRow) -> tuple[float, int]:
        worst = min([row.fraction, *(frac[r] for r in row.ranks)], key=lambda x: (math.isnan(x), x))
        return (worst if math.isfinite(worst) else 2.0, row.ranks[0])

    node_rows.sort(key=node_key)
    return node_rows


def _profile(lay: Layout, alone: _RankRates, node: _Rates, verdicts: list[Verdict]) -> Links:
    """The planner's profile: a degraded node's ranks at its fraction, degraded ranks at
    their own, at least 0.01 and rounded to two places."""
    multi = lay.per_node > 1
    frac, nfrac = alone.frac, node.frac
    prof: dict[int, float] = {}
    for r, v in enumerate(verdicts):
        if v == Verdict.NODE:
            f = nfrac[lay.node[r]] if multi and math.isfinite(nfrac[lay.node[r]]) else frac[r]
        elif v == Verdict.DEGRADED:
            f = frac[r]
        else:
            continue
        if math.isfinite(f) and f < 1:
            prof[r] = max(0.01, round(float(f), 2))
    return Links(prof)


def _summary(d: Diagnosis, lay: Layout) -> str:
    """The one-line verdict: what is slow (or why nothing could be judged), then the
    reference and the threshold."""
    n_nodes, p = len(d.nodes), len(d.ranks)
    if d.reference_source == "median":
        ref = f"the median link ({bitrate(d.median_egress)} out, {bitrate(d.median_ingress)} in)"
    else:
        ref = f"the expected {d.reference} ({d.reference_source})"
    tail = f"threshold {d.healthy_above:.2f} of {ref}"
    by_rank = {r.rank: r for r in d.ranks}
    if d.status == "healthy":
        worst = min(d.ranks, key=_rank_key)
        return (
            f"HEALTHY: {n_nodes} nodes ({p} ranks), every link at {worst.fraction:.2f} or "
            f"more; {tail}"
        )
    if d.status == "inconclusive":
        if n_nodes == 1:
            return (
                f"INCONCLUSIVE: 1 node ({lay.hosts[0]}, {p} ranks): no link between nodes "
                "to measure (the intra-node rates are in the table); run one task per node "
                "on 3 or more nodes, or emulate links on this machine with --emulate "
                "bw=RATE[,degrade=RANK:FRACTION] (every rank its own virtual NIC)"
            )
        if d.reference_source == "none":
            return (
                f"INCONCLUSIVE: {n_nodes} nodes and nothing to judge their link against (the "
                "median of two links cannot say whether either is slow): give --expect RATE "
                "(what one link should carry, e.g. --expect 10gbit) or --baseline FILE (an "
                "earlier healthy doctor --json), or run on 3 or more nodes"
            )
        missing = [r.rank for r in d.ranks if r.verdict == Verdict.UNMEASURED]
        return f"INCONCLUSIVE: {_ranks_text(missing)} not measured; {tail}"
    parts = []
    slow = [r for r in d.ranks if r.verdict in SLOW_VERDICTS]
    if len(slow) == p and p > 1 and n_nodes > 2:
        lo = min(r.fraction for r in d.ranks)
        hi = max(r.fraction for r in d.ranks)
        parts.append(f"every link is slow ({lo:.2f}-{hi:.2f})")
    elif n_nodes == 2 and slow and all(r.verdict == Verdict.UNRESOLVED for r in slow):
        a, b = d.nodes if d.nodes[0].ranks[0] < d.nodes[1].ranks[0] else d.nodes[::-1]
        worst = min(slow, key=_rank_key)
        return (
            f"DEGRADED: the link between node {a.name} ({_ranks_text(a.ranks)}) and node "
            f"{b.name} ({_ranks_text(b.ranks)}) at {worst.fraction:.2f} (egress "
            f"{_frac(worst.fraction_egress)}, ingress {_frac(worst.fraction_ingress)}); with 2 "
            "nodes every message crosses both ends, so which end is slow cannot be measured "
            f"(a third node would tell); {tail}"
        )
    for node in d.nodes if not parts else ():
        if node.verdict == Verdict.DEGRADED:
            said = ""
            if math.isfinite(node.reported) and any(
                math.isfinite(n.reported) and n.reported > node.reported for n in d.nodes
            ):
                said = f"; {node.interface} reports {bitrate(node.reported)}"
            if len(node.ranks) == 1:
                r = by_rank[node.ranks[0]]
                parts.append(
                    f"node {node.name} (rank {r.rank}) at {r.fraction:.2f} (egress "
                    f"{_frac(r.fraction_egress)}, ingress {_frac(r.fraction_ingress)}){said}"
                )
            else:
                parts.append(
                    f"node {node.name} ({len(node.ranks)} ranks: {_ranklist(node.ranks)}) at "
                    f"{node.fraction:.2f} (egress {_frac(node.fraction_egress)}, ingress "
                    f"{_frac(node.fraction_ingress)}){said}"
                )
            continue  # its ranks are named with it
        for r in sorted((by_rank[x] for x in node.ranks), key=_rank_key):
            if r.verdict == Verdict.DEGRADED:
                said = ""
                if math.isfinite(node.reported) and any(
                    math.isfinite(n.reported) and n.reported > node.reported for n in d.nodes
                ):
                    said = f"; {node.interface} reports {bitrate(node.reported)}"
                parts.append(
                    f"rank {r.rank} (node {node.name}, local rank {r.local_rank}) at "
                    f"{r.fraction:.2f}{said}"
                )
            elif r.verdict == Verdict.INTRA:
                parts.append(
                    f"rank {r.rank} inside node {node.name} at {r.intra_fraction:.2f} of the "
                    "median intra-node rate"
                )
            elif r.verdict == Verdict.UNRESOLVED:
                parts.append(
                    f"rank {r.rank} (node {node.name}) at {r.fraction:.2f}, but every partner "
                    "was as slow"
                )
    return f"DEGRADED: {'; '.join(parts)}; {tail}"


def _ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0,1``, ``ranks 0-7``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranklist(ranks)}"


def _ranklist(ranks: Sequence[int]) -> str:
    r = list(ranks)
    if r == list(range(r[0], r[-1] + 1)) and len(r) > 2:
        return f"{r[0]}-{r[-1]}"
    return ",".join(map(str, r))
