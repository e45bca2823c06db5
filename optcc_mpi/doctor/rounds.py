"""The doctor's rounds: which ranks share a node (:class:`Layout`), who sends to whom in
every round (:func:`plan`, :class:`RoundPlan`), and how long that takes (:func:`estimate`).

A plan is a pure function of the layout and the parameters, the same on every rank;
:func:`optcc_mpi.doctor.run.doctor` runs it and :func:`optcc_mpi.doctor.diagnosis.diagnose`
reads its timings.

What it sends
-------------
Ranks that report the same host name share a node (and its NICs); with
``group="rank"`` (the default under emulation, whose virtual NICs are per rank) every
rank is a node of its own. Nodes are numbered in the order of their first rank, and the
ranks of a node by rank (their *local rank*). Every message is ``size`` bytes; a
*round* is one set of simultaneous messages between two barriers, and every receiver
times its messages from the end of the barrier. Three kinds of rounds:

``inter``
    Across nodes, one flow per node: for each local rank ``j``, each of ``partners``
    node shifts ``s`` and each of ``repeats`` repeats, local rank ``j`` of every node
    ``a`` sends to local rank ``j mod L(b)`` of node ``b = a + s``. Every NIC carries one
    flow out and one in, so each rank's own path to the network is measured alone.
``node``
    Only where a node holds several ranks: the same shifts, every rank of a node at once,
    so a node's NIC carries all of its ranks' traffic (what a collective sees).
``intra``
    Only where a node holds several ranks: within every node, local rank ``j`` sends to
    local rank ``j + t`` (``t`` of up to ``partners`` local shifts); no byte crosses a NIC.

The shifts are spread over the ring of nodes (``1``, about a third and two thirds of the
way round for three partners), so that two degraded nodes next to each other in the
numbering rarely limit each other's every partner. Repeats are the outer loop: a
transient disturbance spoils one repeat of everything rather than every repeat of one
link. With ``N`` nodes of at most ``L`` ranks, ``k = min(partners, N - 1)`` shifts and
``R`` repeats, a rank sends (and receives about) ``size * R * k`` bytes in ``R * k``
rounds when ``L = 1``, and ``size * R * (2 k + min(partners, L - 1))`` bytes in
``R * (k (L + 1) + min(partners, L - 1))`` rounds otherwise (:attr:`RoundPlan.rounds`;
:meth:`RoundPlan.bytes_sent` per rank). Over links of ``B`` bytes/s that takes about
``size * R * k / B`` at one rank per node and ``size * R * k * 2 L / B`` otherwise
(a node round moves ``L`` messages through one NIC), plus two barriers per round
(:func:`estimate` times the schedules with the simulator). The
defaults (8 MiB, 3 partners, 5 repeats) send 120 MiB per rank at one rank per node:
0.1 s at 10 Gbit/s, 2.5 s at 400 Mbit/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optcc_mpi import linkrates
from optcc_mpi.errors import ArgumentError
from optcc_mpi.links import Links
from optcc_mpi.probe import RANK_PROBE_PARTNERS
from optcc_mpi.schedule import Schedule, ScheduleBuilder
from optcc_mpi.simulate import simulate
from optcc_mpi.units import format_size

__all__ = [
    "DEFAULT_SIZE",
    "DEFAULT_PARTNERS",
    "DEFAULT_REPEATS",
    "Layout",
    "Round",
    "RoundPlan",
    "plan",
    "check_plan_params",
    "estimate",
]

#: Bytes per message.
DEFAULT_SIZE = 8 << 20
#: Partners (node shifts) per rank and phase: the watch's probe's number
#: (:data:`optcc_mpi.probe.RANK_PROBE_PARTNERS`), one number of partners spread over the
#: ring (:func:`optcc_mpi.linkrates.spread`) for every measurement of the ranks' links.
DEFAULT_PARTNERS = RANK_PROBE_PARTNERS
#: Repeats of every round.
DEFAULT_REPEATS = 5


@dataclass(frozen=True, eq=False)
class Layout:
    """Which ranks share a node.

    Parameters
    ----------
    hosts : sequence of str
        Host name of every rank.
    group : {"host", "rank"}
        ``"host"``: ranks with the same host name share a node; ``"rank"``: every rank is
        a node of its own (a per-rank NIC, or software emulation).
    """

    hosts: tuple[str, ...]
    group: str = "host"
    node: np.ndarray = field(init=False, repr=False)
    """Per rank, its node's index."""
    local: np.ndarray = field(init=False, repr=False)
    """Per rank, its index among its node's ranks (its local rank)."""
    names: tuple[str, ...] = field(init=False)
    """Per node, its name."""
    members: tuple[tuple[int, ...], ...] = field(init=False)
    """Per node, its ranks, ascending."""

    def __post_init__(self) -> None:
        hosts = tuple(str(h) for h in self.hosts)
        if not hosts:
            raise ArgumentError("a layout needs at least one rank")
        if self.group not in ("host", "rank"):
            raise ArgumentError(f"group must be 'host' or 'rank', not {self.group!r}")
        keys = hosts if self.group == "host" else tuple(f"{h}[r{r}]" for r, h in enumerate(hosts))
        order: dict[str, list[int]] = {}
        for r, key in enumerate(keys):
            order.setdefault(key, []).append(r)
        node = np.zeros(len(hosts), dtype=np.int64)
        local = np.zeros(len(hosts), dtype=np.int64)
        for i, ranks in enumerate(order.values()):
            node[ranks] = i
            local[ranks] = np.arange(len(ranks))
        object.__setattr__(self, "hosts", hosts)
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "names", tuple(order))
        object.__setattr__(self, "members", tuple(tuple(v) for v in order.values()))

    @classmethod
    def uniform(cls, p: int, per_node: int = 1) -> Layout:
        """``p`` ranks, ``per_node`` consecutive ranks on each node (``n0``, ``n1``, ...);
        for plans and estimates without a job."""
        if p < 1 or per_node < 1:
            raise ArgumentError(f"need p >= 1 and per_node >= 1, not p={p}, {per_node}")
        return cls(tuple(f"n{r // per_node}" for r in range(p)))

    @property
    def p(self) -> int:
        """Ranks."""
        return len(self.hosts)

    @property
    def n_nodes(self) -> int:
        """Nodes."""
        return len(self.members)

    @property
    def per_node(self) -> int:
        """Most ranks on one node."""
        return max(len(m) for m in self.members)


@dataclass(frozen=True, eq=False)
class Round:
    """One set of simultaneous messages between two barriers."""

    phase: str
    """``"inter"``, ``"node"`` or ``"intra"`` (module docstring)."""
    shift: int
    """Node shift (``inter``, ``node``) or local shift (``intra``)."""
    local: int
    """Local rank of the senders of an ``inter`` round; -1 otherwise."""
    repeat: int
    src: np.ndarray
    dst: np.ndarray
    schedule: Schedule


#: The shifts (shared with the watch's probe: :mod:`optcc_mpi.linkrates`).
_spread = linkrates.spread


def _schedule(p: int, size: int, src: np.ndarray, dst: np.ndarray, name: str) -> Schedule:
    """Every ``src[i]`` sends ``size`` bytes to ``dst[i]`` at once. Each rank sends from
    the first ``size`` bytes of its buffer and receives its k-th message into slot k + 1,
    so that no message lands where another is read or written."""
    slot = np.zeros(len(dst), dtype=np.int64)
    seen: dict[int, int] = {}
    for i, d in enumerate(dst.tolist()):
        slot[i] = seen.get(d, 0)
        seen[d] = slot[i] + 1
    slots = 1 + (max(seen.values()) if seen else 0)
    b = ScheduleBuilder(p, slots * size, name)
    if len(src):
        b.send(src, dst, 0, size)
        b.recv(dst, src, (slot + 1) * size, (slot + 2) * size)
    return b.build()


@dataclass(eq=False)
class RoundPlan:
    """Every round the doctor runs, the same on every rank (a pure function of the
    layout and the parameters)."""

    layout: Layout
    size: int
    partners: int
    repeats: int
    shifts: list[int]
    """Node shifts of the ``inter`` and ``node`` rounds."""
    local_shifts: list[int]
    """Local shifts of the ``intra`` rounds (none when every node holds one rank)."""
    rounds: list[Round]

    @property
    def count(self) -> int:
        """Elements (bytes) of the buffer every rank needs: the largest schedule's."""
        return max((r.schedule.count for r in self.rounds), default=self.size)

    def bytes_sent(self) -> np.ndarray:
        """Per rank, bytes it sends over the whole plan."""
        out = np.zeros(self.layout.p, dtype=np.int64)
        for r in self.rounds:
            np.add.at(out, r.src, self.size)
        return out

    def bytes_received(self) -> np.ndarray:
        """Per rank, bytes it receives over the whole plan."""
        out = np.zeros(self.layout.p, dtype=np.int64)
        for r in self.rounds:
            np.add.at(out, r.dst, self.size)
        return out

    def describe(self) -> str:
        """One line: rounds, bytes per rank."""
        lay = self.layout
        sent = self.bytes_sent()
        phases = {ph: sum(r.phase == ph for r in self.rounds) for ph in ("inter", "node", "intra")}
        text = ", ".join(f"{n} {ph}" for ph, n in phases.items() if n)
        return (
            f"{lay.p} ranks on {lay.n_nodes} nodes; {len(self.rounds)} rounds ({text}) of "
            f"{format_size(self.size)} messages; at most {format_size(int(sent.max()))} sent "
            f"per rank"
        )


def plan(
    layout: Layout,
    *,
    size: int = DEFAULT_SIZE,
    partners: int = DEFAULT_PARTNERS,
    repeats: int = DEFAULT_REPEATS,
) -> RoundPlan:
    """The rounds the doctor runs on ``layout`` (module docstring).

    Parameters
    ----------
    layout : Layout
        Which ranks share a node.
    size : int
        Bytes per message.
    partners : int
        Node shifts (and local shifts) per phase.
    repeats : int
        Times every round runs.
    """
    check_plan_params(size, partners, repeats)
    lay = layout
    p, n = lay.p, lay.n_nodes
    per = [len(m) for m in lay.members]
    shifts = _spread(n, partners)
    lmax = lay.per_node
    local_shifts = _spread(lmax, partners) if lmax > 1 else []
    members = lay.members

    built: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray, Schedule]] = {}

    def pairs(phase: str, shift: int, j: int) -> tuple[np.ndarray, np.ndarray, Schedule]:
        key = (phase, shift, j)
        if key not in built:
            src: list[int] = []
            dst: list[int] = []
            for a in range(n):
                b = (a + shift) % n
                if phase == "inter":
                    if per[a] > j:
                        src.append(members[a][j])
                        dst.append(members[b][j % per[b]])
                elif phase == "node":
                    for jj in range(per[a]):
                        src.append(members[a][jj])
                        dst.append(members[b][jj % per[b]])
                else:  # intra: local shift within node a
                    if per[a] > 1:
                        for jj in range(per[a]):
                            if shift % per[a]:
                                src.append(members[a][jj])
                                dst.append(members[a][(jj + shift) % per[a]])
            s, d = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)
            built[key] = (s, d, _schedule(p, size, s, d, f"doctor-{phase}"))
        return built[key]

    rounds: list[Round] = []
    for rep in range(repeats):
        for j in range(lmax):
            for s in shifts:
                src, dst, sched = pairs("inter", s, j)
                rounds.append(Round("inter", s, j, rep, src, dst, sched))
        if lmax > 1:
            for s in shifts:
                src, dst, sched = pairs("node", s, -1)
                rounds.append(Round("node", s, -1, rep, src, dst, sched))
            for t in local_shifts:
                src, dst, sched = pairs("intra", t, -1)
                if len(src):
                    rounds.append(Round("intra", t, -1, rep, src, dst, sched))
    rounds = [r for r in rounds if len(r.src)]
    return RoundPlan(lay, int(size), int(partners), int(repeats), shifts, local_shifts, rounds)


def check_plan_params(size: Any, partners: Any, repeats: Any) -> None:
    """``size``, ``partners`` and ``repeats`` are whole numbers >= 1, else
    :class:`~optcc_mpi.errors.ArgumentError`."""
    for name, value, low in (("size", size, 1), ("partners", partners, 1), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ArgumentError(f"doctor: {name} must be a whole number >= {low}, not {value!r}")


def estimate(
    the_plan: RoundPlan, bw: float, latency: float = 0.0, links: Links | str | None = None
) -> dict[str, Any]:
    """How long ``the_plan`` takes over links of ``bw`` bytes/s, by the simulator.

    Every round's schedule is timed by :func:`optcc_mpi.simulate.simulate` (each rank its
    own NIC); a ``node`` round's time is multiplied by the most ranks on a node, whose
    flows share one NIC there, which the simulator does not model. Each round also pays
    two barriers of ``2 ceil(log2 p)`` latencies each. ``links``: degraded ranks (all
    healthy by default).

    Returns
    -------
    dict
        ``seconds`` (total), ``transfer_seconds``, ``barrier_seconds``, ``rounds``,
        ``per_phase`` (seconds by phase), ``bytes_per_rank`` (most sent by one rank).
    """

    if not bw > 0:
        raise ArgumentError(f"estimate: bandwidth must be positive, not {bw!r}")
    times: dict[int, float] = {}
    per_phase = {"inter": 0.0, "node": 0.0, "intra": 0.0}
    transfer = 0.0
    lmax = the_plan.layout.per_node
    for r in the_plan.rounds:
        key = id(r.schedule)
        if key not in times:
            times[key] = simulate(r.schedule, links, bw=bw, latency=latency, itemsize=1).time
        t = times[key] * (lmax if r.phase == "node" else 1)
        per_phase[r.phase] += t
        transfer += t
    p = the_plan.layout.p
    barrier = len(the_plan.rounds) * 2 * 2 * math.ceil(math.log2(max(p, 2))) * latency
    return {
        "seconds": transfer + barrier,
        "transfer_seconds": transfer,
        "barrier_seconds": barrier,
        "rounds": len(the_plan.rounds),
        "per_phase": per_phase,
        "bytes_per_rank": int(the_plan.bytes_sent().max()) if the_plan.rounds else 0,
    }
