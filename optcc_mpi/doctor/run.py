"""The doctor's run (:func:`doctor`, collective): check and agree on the parameters, plan
the rounds (:mod:`optcc_mpi.doctor.rounds`), choose the reference
(:mod:`optcc_mpi.doctor.expected`), measure every round, gather every rank's timings, judge
them (:mod:`optcc_mpi.doctor.diagnosis`) and log the verdict.

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

import math
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from optcc_mpi import linklog, linkrates, transports
from optcc_mpi.arrays import NUMPY
from optcc_mpi.doctor.diagnosis import Diagnosis, diagnose
from optcc_mpi.doctor.expected import interface_speed, reference
from optcc_mpi.doctor.rounds import (
    DEFAULT_PARTNERS,
    DEFAULT_REPEATS,
    DEFAULT_SIZE,
    Layout,
    RoundPlan,
    check_plan_params,
    plan,
)
from optcc_mpi.emulation import Emulation
from optcc_mpi.errors import ArgumentError, mark_everywhere
from optcc_mpi.executor import ExecStats, execute
from optcc_mpi.links import Links
from optcc_mpi.progress import Progress
from optcc_mpi.schedule import RECV, Schedule

__all__ = ["doctor"]


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
    return execute(schedule, buf, comm=comm, op="sum", arrays=NUMPY, pacer=pacer, trace=True)


def _private(comm: Any) -> Any:
    """What the doctor's messages travel on: ``comm``'s transport (an MPI communicator's
    private duplicate, a torch.distributed group's private group)."""
    return transports.of(comm)


def _rank_size(comm: Any) -> tuple[int, int]:
    """This process's rank and the number of ranks."""
    return comm.rank, comm.size


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
        (:mod:`optcc_mpi.doctor.diagnosis`, :func:`expected.reference`).
    group : {"host", "rank"}, optional
        What shares a NIC: ranks on one host (default), or nothing (``"rank"``, the
        default under emulation, whose virtual NICs are per rank).
    emulate : Emulation or str, optional
        Software emulation (its ``degrade`` is the emulated truth); default
        ``$OPTCC_EMULATE``, if set.
    judge_intra : bool
        Also flag slow intra-node paths (:func:`diagnosis.diagnose`); they are measured and
        reported either way.
    log : str or Path, optional
        Append the verdict to this JSON-lines link log (:mod:`optcc_mpi.linklog`);
        default ``$OPTCC_LINKS_LOG``, if set.
    progress : bool
        Show a progress bar on rank 0.
    baseline : float, optional
        A healthy link's rate (bytes/s) from an earlier record (:func:`expected.baseline_rate`),
        the expected rate of fewer than 3 nodes where nothing else gives one.
    iface : str, optional
        The interface whose reported speed is read (:func:`expected.interface_speed`; default:
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
        check_plan_params(size, partners, repeats)
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
    """Every rank's host name and interface (:func:`expected.interface_speed`), once every rank's
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
