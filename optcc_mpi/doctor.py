"""Which node's link is slow? A bounded, repeated measurement of every link, and a verdict.

:func:`doctor` measures the send (egress) and receive (ingress) rate of every rank's and
every node's link and says which are degraded, relative to the median link (or to an
expected rate). ``optcc-mpi doctor`` is its command-line face.

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

Communication
-------------
Everything the doctor says to other ranks goes through a few functions of one section
below, each taking the communicator: :func:`_barrier`, :func:`_allgather` (small per-rank
records), :func:`_run` (a schedule through :func:`optcc_mpi.executor.execute`),
:func:`_rank_size`, and :func:`_private` (the communicator's private duplicate,
:mod:`optcc_mpi.comm`, on which all of it travels), so that a transport other than MPI
can carry the doctor by replacing those.
"""

from __future__ import annotations

import enum
import math
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optcc_mpi import linklog, linkrates, transports
from optcc_mpi.backend import NUMPY
from optcc_mpi.emulation import Emulation
from optcc_mpi.errors import ArgumentError, mark_everywhere
from optcc_mpi.executor import ExecStats, execute
from optcc_mpi.links import Links
from optcc_mpi.progress import Progress
from optcc_mpi.schedule import RECV, Schedule, ScheduleBuilder
from optcc_mpi.simulate import simulate
from optcc_mpi.units import format_size

__all__ = [
    "DEFAULT_SIZE",
    "DEFAULT_PARTNERS",
    "DEFAULT_REPEATS",
    "EXIT_HEALTHY",
    "EXIT_ERROR",
    "EXIT_DEGRADED",
    "EXIT_INCONCLUSIVE",
    "EXIT_STATUSES",
    "CHECK_STATUSES",
    "RANK_VERDICTS",
    "interface_speed",
    "baseline_rate",
    "Layout",
    "Round",
    "RoundPlan",
    "RankRow",
    "NodeRow",
    "Diagnosis",
    "plan",
    "estimate",
    "diagnose",
    "doctor",
    "plot",
]

#: Bytes per message.
DEFAULT_SIZE = 8 << 20
#: Partners (node shifts) per rank and phase.
DEFAULT_PARTNERS = 3
#: Repeats of every round.
DEFAULT_REPEATS = 5
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

# ------------------------------------------------------------------------ who is where


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


# ------------------------------------------------------------------------------- the plan


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
    _check_params(size, partners, repeats)
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


def _check_params(size: Any, partners: Any, repeats: Any) -> None:
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


# ----------------------------------------------------- what the system says of the links

#: Variables that name the interface a transport's traffic leaves by (gloo's and NCCL's
#: sockets, UCX's devices, Open MPI's TCP transport), in the order they are read.
IFACE_VARIABLES = (
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "UCX_NET_DEVICES",
    "OMPI_MCA_btl_tcp_if_include",
)


def _default_iface(root: Path) -> str | None:
    """The interface of the default route (``/proc/net/route``), if any."""
    try:
        lines = (root / "proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        cols = line.split()
        if len(cols) > 1 and cols[1] == "00000000":
            return cols[0]
    return None


def interface_speed(
    iface: str | None = None,
    *,
    env: dict[str, str] | None = None,
    root: str | Path = "/",
) -> tuple[str | None, float]:
    """The interface this host's traffic leaves by and the speed the system reports for
    it, in bytes/s (NaN where it reports none).

    The interface is ``iface``, else the first one named by :data:`IFACE_VARIABLES` (an
    exclusion list, ``^...``, or a device port such as ``mlx5_0:1`` names no interface),
    else the default route's. Its speed is ``/sys/class/net/IF/speed`` (Mbit/s) where
    that is a physical device (``IF/device`` exists) reporting a positive number:
    virtual devices (veth, bridges, tunnels, loopback) report a nominal figure or none,
    and the links of a network-namespace testbed are shaped below what their veths say.
    ``root`` replaces ``/`` (tests).
    """
    import os

    base = Path(root)
    env = dict(os.environ) if env is None else env
    name = iface
    if name is None:
        for var in IFACE_VARIABLES:
            first = env.get(var, "").split(",")[0].strip()
            if first and not first.startswith("^") and ":" not in first:
                name = first
                break
    if name is None:
        name = _default_iface(base)
    if name is None:
        return None, math.nan
    dev = base / "sys/class/net" / name
    try:
        mbit = float((dev / "speed").read_text().strip())
    except (OSError, ValueError):
        return name, math.nan
    if not (dev / "device").exists() or not mbit > 0 or not math.isfinite(mbit):
        return name, math.nan
    return name, mbit * 1e6 / 8


def baseline_rate(path: str | Path) -> float:
    """The healthy link rate (bytes/s) of an earlier doctor's ``--json``: the slower of
    its median egress and ingress, from a run whose verdict was healthy.

    Raises
    ------
    ArgumentError
        The file is missing, not a doctor's JSON, or its verdict was not healthy (a
        degraded or inconclusive run's median says nothing of a healthy link).
    """
    import json

    p = Path(path)
    try:
        data = json.loads(p.read_text())
        status = data["status"]
        rate = min(float(data["median_egress"]), float(data["median_ingress"]))
    except FileNotFoundError:
        raise ArgumentError(f"--baseline {p}: no such file") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArgumentError(f"--baseline {p} is not a doctor's --json ({exc})") from None
    if status != "healthy":
        raise ArgumentError(
            f"--baseline {p}: that run was {status}, not healthy; its median is no healthy "
            "link's rate"
        )
    if not (rate > 0 and math.isfinite(rate)):
        raise ArgumentError(f"--baseline {p}: no median rate in it")
    return rate


def reference(
    n_nodes: int,
    *,
    expect: float | None = None,
    emulated: float | None = None,
    speeds: Sequence[float] = (),
    ifaces: Sequence[str | None] = (),
    baseline: float | None = None,
) -> tuple[float | None, str]:
    """The rate a link is judged against and where it came from: ``(None, "median")`` to
    judge against the median link (3 nodes or more, no ``expect``), else the first of
    ``expect``, the emulated rate, the interfaces' reported ``speeds`` (one per node; all
    must report one: the highest), the ``baseline`` (module docstring), or ``(None,
    "none")`` when fewer than 3 nodes have none of them."""
    if expect is not None:
        return float(expect), "--expect"
    if n_nodes >= 3:
        return None, "median"
    if emulated:
        return float(emulated), "the emulated rate"
    sp = np.asarray(speeds, dtype=float)
    if sp.size and np.isfinite(sp).all():
        names = sorted({str(i) for i in ifaces if i}) or ["?"]
        return float(sp.max()), f"the speed {'/'.join(names)} reports"
    if baseline is not None:
        return float(baseline), "an earlier healthy record"
    return None, "none"


# ------------------------------------------------------------ communication (only here)


def _barrier(comm: Any) -> float:
    """Wait for every rank; return ``perf_counter()`` at the end.

    A nonblocking barrier polled with short sleeps first, so that ranks with nothing to
    do in a round leave the CPU to those that move bytes (on a shared machine a spinning
    rank slows the transfers it waits for); then a blocking one, whose end is nearly the
    same instant on every rank: the receivers time their messages from it."""
    comm.quiet_barrier()
    return time.perf_counter()


def _allgather(comm: Any, value: Any) -> list[Any]:
    """Every rank's small ``value`` (picklable), in rank order."""
    return comm.allgather(value)


def _run(comm: Any, schedule: Schedule, buf: np.ndarray, pacer: Any) -> ExecStats:
    """This rank's part of ``schedule`` (per-operation times traced)."""
    return execute(schedule, buf, comm=comm, op="sum", backend=NUMPY, pacer=pacer, trace=True)


def _private(comm: Any) -> Any:
    """What the doctor's messages travel on: ``comm``'s transport (an MPI communicator's
    private duplicate, a torch.distributed group's private group)."""
    return transports.of(comm)


def _rank_size(comm: Any) -> tuple[int, int]:
    """This process's rank and the number of ranks."""
    return comm.rank, comm.size


# ------------------------------------------------------------------------------ measure


def _measure(
    comm: Any, the_plan: RoundPlan, emu: Emulation | None, rank: int, progress: Any
) -> dict[str, Any]:
    """Run every round; this rank's record: ``rows`` (round, sender, seconds from the
    barrier to the message's completion) of the messages it received, and its own
    accounting (bytes and messages sent and received, and under emulation the seconds
    its virtual NIC was charged per round)."""
    p = the_plan.layout.p
    buf = np.zeros(the_plan.count, dtype=np.uint8)
    buf[:] = 1  # touch every page before anything is timed
    rows: list[tuple[int, int, float]] = []
    sent = received = n_sent = n_received = 0
    charged: list[float] = []
    for i, rnd in enumerate(the_plan.rounds):
        pacer = emu.pacer(rank, p, Links()) if emu is not None else None
        sched = rnd.schedule
        view = buf[: sched.count]
        t0 = _barrier(comm)
        stats = _run(comm, sched, view, pacer)
        ops = sched.program(rank).ops
        for op, kind, _posted, done in stats.trace:
            if kind == RECV:
                rows.append((i, int(ops[op][1]), stats.start + done - t0))
        sent += stats.bytes_sent
        received += stats.bytes_received
        n_sent += stats.messages_sent
        n_received += stats.messages_received
        if pacer is not None:
            charged.append(max(pacer.charged_seconds["send"], pacer.charged_seconds["recv"]))
        if progress is not None:
            progress.update(1, postfix=rnd.phase)
    return {
        "rows": np.array(rows, dtype=np.float64).reshape(-1, 3),
        "bytes_sent": sent,
        "bytes_received": received,
        "messages_sent": n_sent,
        "messages_received": n_received,
        "charged": charged,
    }


# ------------------------------------------------------------------------------ diagnose


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
    """The interface its traffic leaves by (:func:`interface_speed`), as the lowest rank
    of the node found it."""
    reported: float = math.nan
    """The speed the system reports for that interface (bytes/s; NaN: none)."""


@dataclass
class Diagnosis:
    """What :func:`doctor` found (the same on every rank)."""

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
                row = [node.name, "all", "-", _rate(node.egress), _rate(node.ingress)]
                row += [_frac(node.fraction), "-"]
                row += ["-", node.verdict.upper() if node.verdict != Verdict.HEALTHY else "healthy"]
                rows.append(row)
            for r in members:
                name = "" if len(node.ranks) > 1 else node.name
                row = [name, str(r.rank), str(r.local_rank), _rate(r.egress), _rate(r.ingress)]
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


def _rate(v: float) -> str:
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
    """The verdicts from every rank's record of :func:`_measure` (a pure function: every
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
        Reference rate (bytes/s) instead of the median (:func:`reference`).
    judge_intra : bool
        Flag ranks whose intra-node rate is below the threshold of the median one (off by
        default: the intra-node messages are host memory copies, whose rate follows the
        load on the node's CPUs; on the 2-core testbed it ranged over 0.16-1 of the
        median from one run to the next).
    source : str, optional
        Where ``expect`` came from (:func:`reference`; default ``--expect`` when given).
    speeds, ifaces : sequence, optional
        Per node, the speed its interface reports (bytes/s, NaN: none) and the
        interface's name (:func:`interface_speed`): a slow link's end is named where
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
        reference="median" if source == "median" else "none" if too_few else _rate(expect),
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
        ref = f"the median link ({_rate(d.median_egress)} out, {_rate(d.median_ingress)} in)"
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
                said = f"; {node.interface} reports {_rate(node.reported)}"
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
                    said = f"; {node.interface} reports {_rate(node.reported)}"
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


# -------------------------------------------------------------------------------- doctor


def doctor(
    comm: Any = None,
    *,
    size: int = DEFAULT_SIZE,
    partners: int = DEFAULT_PARTNERS,
    repeats: int = DEFAULT_REPEATS,
    healthy_above: float = linkrates.HEALTHY_ABOVE,
    expect: float | None = None,
    group: str | None = None,
    emulate: Emulation | str | None = None,
    judge_intra: bool = False,
    log: str | Path | None = None,
    progress: bool = False,
    baseline: float | None = None,
    iface: str | None = None,
) -> Diagnosis:
    """Measure every link and say which are degraded (collective on ``comm``).

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, optional
        Communicator (default ``COMM_WORLD``).
    size : int
        Bytes per message.
    partners : int
        Partners (node shifts) per rank and phase.
    repeats : int
        Times every round runs; a link is flagged only when every measurement of it is
        below the threshold.
    healthy_above : float
        Fractions of the reference at or above this are healthy (default
        :data:`optcc_mpi.linkrates.HEALTHY_ABOVE`).
    expect : float, optional
        The rate in bytes/s one link should carry (a node's NIC, or a rank's own rail),
        instead of the median link. Fewer than 3 nodes need an expected rate: without
        this one, the emulated rate, the interfaces' reported speed or ``baseline``
        (module docstring, :func:`reference`).
    group : {"host", "rank"}, optional
        What shares a NIC: ranks on one host (default), or nothing (``"rank"``, the
        default under emulation, whose virtual NICs are per rank).
    emulate : Emulation or str, optional
        Software emulation (its ``degrade`` is the emulated truth); default
        ``$OPTCC_EMULATE``, if set.
    judge_intra : bool
        Also flag slow intra-node paths (:func:`diagnose`); they are measured and
        reported either way.
    log : str or Path, optional
        Append the verdict to this JSON-lines link log (:mod:`optcc_mpi.linklog`);
        default ``$OPTCC_LINKS_LOG``, if set.
    progress : bool
        Show a progress bar on rank 0.
    baseline : float, optional
        A healthy link's rate (bytes/s) from an earlier record (:func:`baseline_rate`),
        the expected rate of fewer than 3 nodes where nothing else gives one.
    iface : str, optional
        The interface whose reported speed is read (:func:`interface_speed`; default:
        the one the transports' variables name, else the default route's).

    Returns
    -------
    Diagnosis
        The same on every rank.

    Raises
    ------
    ArgumentError
        On every rank, before any message, when a parameter is bad or differs between
        ranks, or when the communicator has one rank (no link to measure).
    """

    wire = _private(comm)
    rank, p = _rank_size(wire)
    if p == 1:
        raise ArgumentError(
            "doctor: a world of one rank has no link to measure; run it on every rank of a "
            "job, one rank per node (mpiexec, srun --mpi=..., torchrun), or emulate links "
            "on one machine with several ranks and emulate='bw=RATE'"
        )
    # Check and agree: every rank checks its own parameters, then every rank learns every
    # rank's verdict and raises the same error, before any measuring message.
    params, err, emu, grp = _checked(
        size=size,
        partners=partners,
        repeats=repeats,
        healthy_above=healthy_above,
        expect=expect,
        group=group,
        emulate=emulate,
        judge_intra=judge_intra,
        baseline=baseline,
        iface=iface,
    )
    hosts, nics = _agree(wire, params, err, iface)
    layout = Layout(hosts, grp)
    the_plan = plan(layout, size=size, partners=partners, repeats=repeats)
    # Per node, its lowest rank's interface and reported speed.
    first = [m[0] for m in layout.members]
    ifaces = [nics[r][0] for r in first]
    speeds = [nics[r][1] for r in first]
    ref, source = reference(
        layout.n_nodes,
        expect=expect,
        emulated=emu.bw if emu is not None else None,
        speeds=speeds,
        ifaces=ifaces,
        baseline=baseline,
    )
    # Measure, then judge the same records on every rank.
    bar = Progress(len(the_plan.rounds), "doctor", enabled=progress and rank == 0, unit="round")
    t0 = time.perf_counter()
    try:
        mine = _measure(wire, the_plan, emu, rank, bar)
    finally:
        bar.close()
    records = _allgather(wire, mine)
    seconds = time.perf_counter() - t0
    diag = diagnose(
        the_plan, records, healthy_above=healthy_above, expect=ref, judge_intra=judge_intra,
        source=source if ref is not None else None, speeds=speeds, ifaces=ifaces,
    )  # fmt: skip
    diag.seconds = seconds
    _account(diag, records, emu)
    if rank == 0:
        writer = linklog.LinkLog(log) if log is not None else linklog.from_env()
        if writer is not None:
            writer.doctor(diag.to_dict(), p)
    return diag


def _checked(
    *,
    size: Any,
    partners: Any,
    repeats: Any,
    healthy_above: float,
    expect: float | None,
    group: str | None,
    emulate: Emulation | str | None,
    judge_intra: bool,
    baseline: float | None = None,
    iface: str | None = None,
) -> tuple[tuple[Any, ...] | None, str | None, Emulation | None, str]:
    """This rank's parameters checked (nothing is sent): ``(params, None, emulation,
    group)``, where ``params`` is what every rank must agree on, or ``(None, error,
    None, "host")``. An error is returned, not raised, so that every rank can raise it."""
    try:
        _check_params(size, partners, repeats)
        if not 0 < healthy_above <= 1:
            raise ArgumentError(f"healthy_above must be in (0, 1], not {healthy_above!r}")
        for name, rate in (("expect", expect), ("baseline", baseline)):
            if rate is not None and not (rate > 0 and math.isfinite(rate)):
                raise ArgumentError(f"{name} must be a positive rate in bytes/s, not {rate!r}")
        if iface is not None and (not isinstance(iface, str) or not iface or "/" in iface):
            raise ArgumentError(f"iface must be an interface name, not {iface!r}")
        emu = Emulation.coerce(emulate)
        grp = group if group is not None else ("rank" if emu is not None else "host")
        if grp not in ("host", "rank"):
            raise ArgumentError(f"group must be 'host' or 'rank', not {grp!r}")
        params = (int(size), int(partners), int(repeats), float(healthy_above), expect, grp,
                  str(emu) if emu is not None else None, bool(judge_intra), baseline,
                  iface)  # fmt: skip
    except (ValueError, TypeError) as exc:
        return None, f"{type(exc).__name__}: {exc}", None, "host"
    return params, None, emu, grp


def _agree(
    wire: Any, params: tuple[Any, ...] | None, err: str | None, iface: str | None
) -> tuple[tuple[str, ...], list[tuple[str | None, float]]]:
    """Every rank's host name and interface (:func:`interface_speed`), once every rank's
    parameters passed and are the same; otherwise the same :class:`ArgumentError` on
    every rank (the first rank's error, or the first rank whose parameters differ from
    rank 0's), marked as raised everywhere (a command prints it once)."""
    nic = interface_speed(iface) if err is None else (None, math.nan)
    seen = _allgather(wire, (socket.gethostname(), params, err, nic))
    errors = [(r, e) for r, (_, _, e, _) in enumerate(seen) if e]
    text = None
    if errors:
        r, e = errors[0]
        text = f"doctor: rank {r}: {e}" if wire.size > 1 else f"doctor: {e}"
    elif any(s[1] != params for s in seen):
        r = next(r for r, s in enumerate(seen) if s[1] != seen[0][1])
        text = (
            f"doctor: rank {r} was called with {seen[r][1]}, rank 0 with {seen[0][1]}; every "
            "rank must pass the same parameters"
        )
    if text is not None:
        raise mark_everywhere(ArgumentError(text), text)
    return tuple(s[0] for s in seen), [s[3] for s in seen]


def _account(diag: Diagnosis, records: Sequence[dict[str, Any]], emu: Emulation | None) -> None:
    """Copy every rank's own accounting from ``records`` into ``diag``: bytes and
    messages, and under emulation the seconds the virtual NICs were charged."""
    diag.bytes_sent = [int(r["bytes_sent"]) for r in records]
    diag.bytes_received = [int(r["bytes_received"]) for r in records]
    diag.messages_sent = [int(r["messages_sent"]) for r in records]
    diag.messages_received = [int(r["messages_received"]) for r in records]
    if emu is not None:
        diag.charged_seconds = [float(sum(r["charged"])) for r in records]
        per_round = np.array([r["charged"] for r in records], dtype=float).reshape(len(records), -1)
        diag.emulated_seconds = float(per_round.max(axis=0).sum())
        diag.emulate = str(emu)


# ---------------------------------------------------------------------------------- plot


def plot(diag: Diagnosis, path: str | Path) -> Path:
    """Draw ``diag``: every rank's egress and ingress fraction, the threshold and the
    verdicts; nodes' aggregate fractions beside them where nodes hold several ranks.
    Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    multi = any(len(n.ranks) > 1 for n in diag.nodes)
    fig, axes = plt.subplots(
        1, 2 if multi else 1, figsize=(11 if multi else 8, 4.2), squeeze=False,
        gridspec_kw={"width_ratios": [3, 1]} if multi else None,
    )  # fmt: skip
    ax = axes[0][0]
    order = [r for node in diag.nodes for r in sorted(node.ranks)]
    by_rank = {r.rank: r for r in diag.ranks}
    x = np.arange(len(order))
    fe = [by_rank[r].fraction_egress for r in order]
    fi = [by_rank[r].fraction_ingress for r in order]
    colors = {
        "healthy": "tab:green",
        "degraded": "tab:red",
        "node": "tab:red",
        "intra": "tab:orange",
        "unresolved": "tab:gray",
        "unjudged": "tab:blue",
        "unmeasured": "0.85",
    }
    col = [colors.get(by_rank[r].verdict, "tab:gray") for r in order]
    ax.bar(x - 0.2, np.nan_to_num(fe), 0.4, color=col, alpha=0.9, label="egress")
    ax.bar(x + 0.2, np.nan_to_num(fi), 0.4, color=col, alpha=0.5, hatch="//", label="ingress")
    ax.axhline(diag.healthy_above, color="k", ls="--", lw=1)
    ax.set_xticks(x)
    ax.set_xticklabels([f"{r}\n{by_rank[r].node}" for r in order], fontsize=7)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel(f"fraction of the {diag.reference}")
    ax.set_title(f"{diag.status.upper()}: rank links (one flow per NIC)")
    for xi, r in zip(x, order):
        v = by_rank[r].verdict
        if v != Verdict.HEALTHY:
            ax.annotate(v, (xi, 0.02), ha="center", fontsize=7, rotation=90, color="w")
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor="0.5", label="egress"),
        Patch(facecolor="0.8", hatch="//", label="ingress"),
        *(Patch(facecolor=c, label=v) for v, c in colors.items() if v != Verdict.NODE),
        plt.Line2D([], [], color="k", ls="--", label=f"threshold {diag.healthy_above:.2f}"),
    ]
    ax.legend(handles=handles, fontsize=7, loc="lower right", ncol=2)
    if multi:
        ax2 = axes[0][1]
        names = [n.name for n in diag.nodes]
        # A node whose link is fine but some of whose ranks' own paths are not: purple.
        ncol = [
            colors.get(n.verdict, "tab:gray") if n.verdict != Verdict.RANKS else "tab:purple"
            for n in diag.nodes
        ]
        xn = np.arange(len(names))
        ax2.bar(xn - 0.2, np.nan_to_num([n.fraction_egress for n in diag.nodes]), 0.4, color=ncol)
        ax2.bar(
            xn + 0.2,
            np.nan_to_num([n.fraction_ingress for n in diag.nodes]),
            0.4,
            color=ncol,
            alpha=0.5,
            hatch="//",
        )
        ax2.axhline(diag.healthy_above, color="k", ls="--", lw=1)
        ax2.set_xticks(xn)
        ax2.set_xticklabels(names, fontsize=7, rotation=45)
        ax2.set_ylim(0, 1.1)
        ax2.set_title("nodes (all ranks at once)")
        if any(n.verdict == Verdict.RANKS for n in diag.nodes):
            ax2.legend(
                handles=[Patch(facecolor="tab:purple", label="some ranks degraded")],
                fontsize=7,
                loc="lower right",
            )
    fig.suptitle(
        diag.summary if len(diag.summary) < 140 else diag.summary[:137] + "...", fontsize=8
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
