"""The AllReduce benchmark, in the style of nccl-tests, run on every rank of a job.

For every message size it times the fault-free ring first (the same ranks with every link
healthy: the links argument dropped under emulation, the shaping switched off on the
testbed), then each algorithm on the degraded network, and reports per (algorithm, size):
median, minimum and maximum time over the iterations, algbw and busbw (nccl-tests'
``2(p-1)/p`` factor for every algorithm), ``#wrong`` summed over ranks, the ratio to the
fault-free ring measured in the same run, and the modelled time and lower bound.

Every timed result is checked: inputs are small integers, exact in every dtype, and each
iteration's output is compared element by element with the exact reduction (outside the
timed region). The inputs repeat every 17 elements and every 17 ranks, so the exact
reduction is a closed form of 17 values (:func:`exact_period`) and the check a chunked
comparison (:func:`count_wrong`): the memory each rank needs is its message, the result
and a few MB, whatever the number of ranks. Each row also reports the largest peak
resident memory of any rank (``peak RSS (MiB)``; every rank's in ``rss_peak_mib_ranks``).

Two transports carry the algorithms (``BenchConfig.transport``): ``mpi`` (an mpi4py
communicator, the default) and ``gloo`` (a torch.distributed process group on gloo, under
``torchrun`` or started from the MPI ranks: :mod:`optcc_mpi.lab.world`). Over gloo the
buffers are CPU tensors, and the row ``gloo`` is gloo's own ``all_reduce`` called
directly on the same group, from the same input into the same output buffer with the
same one copy per call as every algorithm's row (``native`` is that library call through
optcc_mpi's executor, with its checks). Under ``--transport mpi`` a ``gloo`` row runs over
a gloo group started from the MPI ranks.

With ``trace`` it also reports link utilisation from the executor's own per-message
records (:func:`utilisation`, defined there) for the last timed iteration of every row, and
draws a timeline of the degraded rank (:func:`plot_timeline`).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import optcc_mpi
from optcc_mpi import algorithms, config, model, transports
from optcc_mpi.collectives import cached_probe, last_stats
from optcc_mpi.dtypes import DTYPES
from optcc_mpi.emulation import Emulation
from optcc_mpi.lab import testbed, world
from optcc_mpi.lab.provenance import load_average
from optcc_mpi.links import Links

__all__ = [
    "BenchConfig",
    "sizes",
    "exact_period",
    "count_wrong",
    "peak_rss_mib",
    "run",
    "rows_table",
    "notes",
    "write",
    "utilisation",
    "union_length",
    "plot_timeline",
]

#: Columns of the text table, in order.
COLUMNS = (
    ("algorithm", "algorithm", "s"),
    ("size", "size (B)", "d"),
    ("count", "count", "d"),
    ("type", "type", "s"),
    ("redop", "redop", "s"),
    ("time_us", "time (us)", ".1f"),
    ("time_min_us", "min (us)", ".1f"),
    ("time_max_us", "max (us)", ".1f"),
    ("algbw", "algbw (GB/s)", ".4f"),
    ("busbw", "busbw (GB/s)", ".4f"),
    ("wrong", "#wrong", "d"),
    ("ratio_fault_free", "x ff-ring", ".3f"),
    ("model_us", "model (us)", ".1f"),
    ("bound_us", "bound (us)", ".1f"),
    ("rss_peak_mib", "peak RSS (MiB)", ".0f"),
)
#: Extra columns with ``trace``: the degraded rank's send and receive busy fractions.
TRACE_COLUMNS = (
    ("send_busy", "snd busy", ".3f"),
    ("recv_busy", "rcv busy", ".3f"),
)


@dataclass
class BenchConfig:
    """What to run (see ``optcc-mpi bench --help``)."""

    sizes: list[int]
    algorithms: list[str]
    iters: int = 5
    warmup: int = 1
    dtype: str = "float32"
    op: str = "sum"
    links: Any = None
    emulate: Emulation | None = None
    bw: float | None = None
    reference: bool = True
    command: str = field(default_factory=lambda: " ".join(sys.argv))
    trace: str | None = None
    """Directory for utilisation records and timeline plots; None: no tracing."""
    latency: float | None = None
    """Per-message cost (s) for the model column; default the emulated latency, else 0."""
    efficiency: float = 1.0
    """Fraction of the nominal rate the transport delivers (measured), for the model."""
    transport: str = "mpi"
    """What the algorithms run over: ``"mpi"`` or ``"gloo"`` (torch.distributed)."""


def sizes(begin: int, end: int, factor: float) -> list[int]:
    """Message sizes from ``begin`` to ``end`` bytes, multiplying by ``factor``."""
    if begin <= 0 or end < begin:
        raise ValueError(f"sizes: need 0 < begin <= end, got {begin} and {end}")
    if factor <= 1 and begin != end:
        raise ValueError(f"sizes: factor must be > 1, got {factor}")
    out, s = [], float(begin)
    while s <= end * (1 + 1e-9):
        out.append(int(round(s)))
        if factor <= 1:
            break
        s *= factor
    return out


#: The inputs repeat with this period along the element index and along the ranks: rank
#: ``r``'s element ``i`` is ``((7 i + 13 r) mod 17) - 8`` (7 and 13 are invertible modulo
#: 17, so each of the 17 values -8..8 appears once per period in either direction).
PERIOD = 17
#: Elements the check compares at a time (a whole number of periods, about a million):
#: it holds one such chunk of float64 values, not a copy of the result.
CHECK_CHUNK = PERIOD * 61681


def _rank_values(rank: int) -> np.ndarray:
    """One period of rank ``rank``'s input, as integers: element ``i mod 17``'s value."""
    return (np.arange(PERIOD, dtype=np.int64) * 7 + rank * 13) % PERIOD - 8


def _inputs(count: int, rank: int, dtype: np.dtype) -> np.ndarray:
    """This rank's input of ``count`` elements: one period repeated, built directly in
    ``dtype`` (no wider temporary), so it takes the message's size and no more."""
    return np.resize(_rank_values(rank).astype(dtype), count)


def exact_period(p: int, op: str) -> np.ndarray:
    """The exact reduction of every rank's input over one period (float64, length 17):
    element ``i`` of the result is ``exact_period(p, op)[i % 17]``.

    Closed form, in O(17^2) whatever ``p``: the value of rank ``r`` depends on ``r`` only
    modulo 17, and ``p`` ranks hold each residue ``c`` ``p // 17`` times, plus once more if
    ``c < p % 17``; a sum weights each residue's value by that count, max and min take
    the residues present. The result is within -36..36 (the 17 values of a full period
    sum to 0), exact in every type the benchmark checks. A partial sum over a run of
    consecutive ranks is within -72..72 for any ``p`` (exact in bfloat16, whose integers
    are exact to 256); over any set of ranks within 36 per started period of 17 ranks,
    so up to 119 ranks in bfloat16 and 967 in float16 whatever the algorithm's order.
    """
    if p < 1:
        raise ValueError(f"exact_period: need at least 1 rank, got {p}")
    counts = np.full(PERIOD, p // PERIOD, dtype=np.int64)
    counts[: p % PERIOD] += 1
    # table[c, i]: rank residue c's value at element residue i.
    table = np.stack([_rank_values(c) for c in range(PERIOD)])
    present = counts > 0
    if op == "sum":
        out = counts @ table
    elif op == "max":
        out = table[present].max(axis=0)
    elif op == "min":
        out = table[present].min(axis=0)
    else:
        raise ValueError(f"the benchmark checks sum, max and min, not {op!r}")
    return out.astype(np.float64)


def count_wrong(out: Any, period: np.ndarray) -> int:
    """Elements of ``out`` (flattened) that differ from the exact result ``period``
    repeated (:func:`exact_period`); NaN counts as wrong. Compares ``CHECK_CHUNK``
    elements at a time, so the check needs a constant few MB beside the result, where
    comparing the whole result at once would take a float64 copy of it (twice a float32
    message) and the exact result as large again."""
    flat = np.asarray(out).reshape(-1)
    expected = np.tile(period, min(flat.size, CHECK_CHUNK) // PERIOD + 1)
    wrong = 0
    for start in range(0, flat.size, CHECK_CHUNK):
        part = flat[start : start + CHECK_CHUNK]
        # start is a multiple of the period, so the chunk's expected values start at 0.
        wrong += int(np.count_nonzero(part.astype(np.float64) != expected[: part.size]))
    return wrong


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, in MiB (``getrusage``'s maximum RSS:
    kilobytes on Linux, bytes on macOS); NaN where the platform has no ``resource``."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return math.nan
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


class _Network:
    """How the degraded network is applied and removed for the fault-free reference.

    ``ctrl`` is the transport whose control collectives (rank, barrier) the benchmark
    uses (:mod:`optcc_mpi.transports`)."""

    def __init__(self, ctrl: Any, cfg: BenchConfig) -> None:
        self.ctrl = ctrl
        self.emulate = cfg.emulate
        self.testbed = None
        if config.get("OPTCC_TESTBED_NAME"):
            self.testbed = testbed.current()
        self.links = self._links(cfg.links)
        self.bw = cfg.bw
        if self.bw is None and self.emulate is not None and self.emulate.bw:
            self.bw = self.emulate.bw
        if self.bw is None and self.testbed is not None:
            self.bw = self.testbed.rate_bit / 8
        self.kind = (
            "testbed"
            if self.testbed is not None
            else "emulation"
            if self.emulate is not None
            else "none"
        )

    def _links(self, links: Any) -> Any:
        if links is None and self.testbed is not None:
            return Links(dict(self.testbed.degrade))  # the shaping in force is the truth
        if isinstance(links, str) and links.strip().lower() == "probe":
            return "probe"
        return Links.coerce(links)

    def degraded(self, on: bool) -> None:
        """Switch the testbed's shaping (rank 0 does it; everyone waits)."""
        if self.testbed is not None:
            if self.ctrl.rank == 0:
                testbed.set_shaping(self.truth() if on else None)
            self.ctrl.barrier()

    def truth(self) -> dict[int, float]:
        """The degradation to put on the testbed for the degraded phase."""
        if isinstance(self.links, Links) and not self.links.healthy:
            return dict(self.links.fractions)
        return dict(self.testbed.degrade) if self.testbed is not None else {}


def model_time(
    name: str,
    p: int,
    size: int,
    bw: float,
    links: Links,
    stats: dict[str, Any],
    *,
    latency: float = 0.0,
) -> float:
    """Modelled time of what ran: the cost the algorithm registered (through the registry),
    with the parameters the call used, the per-message ``latency`` and the rate ``bw``
    (pass the delivered rate, i.e. nominal times efficiency, to predict a measurement)."""
    alg = algorithms.get(name)
    params = {k: v for k, v in (stats.get("params") or {}).items() if k in alg.params}
    return alg.time(p, size, bw, links, latency=latency, **params)


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by the union of ``[start, end)`` intervals."""
    total, cur_lo, cur_hi = 0.0, None, None
    for lo, hi in sorted(intervals):
        if hi <= lo:
            continue
        if cur_hi is None or lo > cur_hi:
            if cur_hi is not None:
                total += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        elif hi > cur_hi:
            cur_hi = hi
    if cur_hi is not None:
        total += cur_hi - cur_lo
    return total


def _intervals(
    ranks: Sequence[dict[str, Any]],
) -> list[dict[str, list[tuple[float, float, int]]]]:
    """Per rank, the busy intervals ``(begin, end, peer)`` of its send and receive sides on
    the common clock.

    ``ranks[r]``: ``start`` (clock value at the executor's start), ``sends`` and ``recvs``
    (``(op, peer, nbytes, posted, completed)`` relative to ``start``) and ``chan`` (op ->
    channel; missing ops are channel 0). A receive is matched with its send as MPI does:
    the k-th send from a to b on a channel meets the k-th receive at b from a on it (op
    order is posting order within a queue).
    """
    send_posted: dict[tuple[int, int, int], list[float]] = {}
    for a, rt in enumerate(ranks):
        chan = rt.get("chan") or {}
        for op, peer, _nb, posted, _done in sorted(rt["sends"]):
            key = (a, peer, chan.get(op, 0))
            send_posted.setdefault(key, []).append(rt["start"] + posted)
    out = []
    for b, rt in enumerate(ranks):
        chan = rt.get("chan") or {}
        t0 = rt["start"]
        send = [(t0 + posted, t0 + done, peer) for _op, peer, _nb, posted, done in rt["sends"]]
        seen: dict[tuple[int, int, int], int] = {}
        recv = []
        for op, peer, _nb, posted, done in sorted(rt["recvs"]):
            key = (peer, b, chan.get(op, 0))
            k = seen.get(key, 0)
            seen[key] = k + 1
            sent = send_posted.get(key, [])
            begin = max(t0 + posted, sent[k]) if k < len(sent) else t0 + posted
            recv.append((begin, t0 + done, peer))
        out.append({"send": send, "recv": recv})
    return out


def utilisation(ranks: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """Fraction of the run during which each rank's send side and receive side were busy.

    Definitions (derived from the executor's timestamps; see ``docs/bench.md``):

    * the *run* is the collective as the benchmark times it, from the earliest start to
      the latest end over all ranks (``start`` + ``seconds``);
    * the **send side** of a rank is busy while at least one of its sends is in MPI's
      hands: posted and not yet reported complete;
    * the **receive side** is busy while at least one message to it is in flight: its
      receive is posted, its sender has posted the matching send, and the receive has not
      completed. (A receive posted early, waiting for a sender that has not started, does
      not count: that wait is a bubble.)

    Busy time is the length of the union of these intervals, so overlapping messages
    count once. Times must share a clock (one host: ``perf_counter``); across hosts pass
    starts aligned at a barrier.
    """
    if not ranks:
        return []
    begin = min(rt["start"] for rt in ranks)
    end = max(rt["start"] + rt["seconds"] for rt in ranks)
    span = end - begin
    res = []
    for rt, iv in zip(ranks, _intervals(ranks)):
        s = union_length([(lo, hi) for lo, hi, _ in iv["send"]])
        r = union_length([(lo, hi) for lo, hi, _ in iv["recv"]])
        res.append(
            {
                "send_busy": s / span if span > 0 else math.nan,
                "recv_busy": r / span if span > 0 else math.nan,
                "seconds": span,
                "messages_sent": len(rt["sends"]),
                "messages_received": len(rt["recvs"]),
            }
        )
    return res


def plot_timeline(
    ranks: Sequence[dict[str, Any]], rank: int, path: str | os.PathLike, title: str = ""
) -> None:
    """PNG of one rank's send and receive sides over the run: one bar per message in
    flight (colour: peer), the busy fractions in the legend."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    begin = min(rt["start"] for rt in ranks)
    iv = _intervals(ranks)[rank]
    util = utilisation(ranks)[rank]
    fig, ax = plt.subplots(figsize=(10, 2.6))
    cmap = plt.get_cmap("tab10")
    for row, side in enumerate(("send", "recv")):
        bars = [((lo - begin) * 1e3, (hi - lo) * 1e3) for lo, hi, _ in iv[side]]
        colours = [cmap(q % 10) for _, _, q in iv[side]]
        ax.broken_barh(bars, (row * 10 + 1, 8), facecolors=colours, alpha=0.6, linewidth=0)
    ax.set_yticks([5, 15])
    ax.set_yticklabels([f"send {util['send_busy']:.0%} busy", f"recv {util['recv_busy']:.0%} busy"])
    ax.set_xlabel("ms since the first rank started (colour: peer)")
    ax.set_xlim(0, util["seconds"] * 1e3)
    ax.set_title(title or f"rank {rank}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _trace_record(ctrl: Any, stats: Any, schedule: Any) -> list[dict[str, Any]] | None:
    """Every rank's per-message records of the last call (on rank 0; None elsewhere)."""
    rank = ctrl.rank
    rec = None
    if stats is not None:
        chan = {}
        if schedule is not None:
            ops = schedule.program(rank).ops
            chan = {op: ops[op][2] for op, *_ in (*stats.sends, *stats.recvs)}
        rec = {
            "start": stats.start,
            "seconds": stats.seconds,
            "sends": list(stats.sends),
            "recvs": list(stats.recvs),
            "chan": chan,
        }
    got = ctrl.allgather(rec)
    if rank != 0 or any(g is None for g in got):
        return None
    return got


def _time(
    ctrl: Any, fn: Any, iters: int, warmup: int, check: Any
) -> tuple[list[float], int, float]:
    """Times of ``iters`` calls of ``fn`` after ``warmup`` (each the slowest rank's), the
    wrong elements of this rank over the timed calls, and this rank's CPU time (user and
    system, all threads) per timed call: ``check(result)`` runs outside the timed region,
    so checking (and the memory it needs) costs no algorithm anything, and no result is
    kept. ``ctrl``: the transport whose barrier and gather frame each call (outside the
    timed region too)."""
    times, wrong, cpu = [], 0, 0.0
    for it in range(warmup + iters):
        ctrl.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        c1 = time.process_time()
        dt = max(ctrl.allgather(t1 - t0))
        if it >= warmup:
            times.append(dt)
            cpu += c1 - c0
            wrong += check(out)
    return times, wrong, cpu / max(iters, 1)


def _scalars(params: Any) -> dict[str, Any]:
    """A schedule's parameters that are numbers or strings (its segment count ``k``, ramp,
    pattern): what says how many messages it cuts a call into, without per-rank arrays."""
    if not isinstance(params, dict):
        return {}
    return {k: v for k, v in params.items() if isinstance(v, (bool, int, float, str))}


#: The library's own AllReduce rows: called directly on the process group, without
#: optcc_mpi in between (``native`` is the same library call through optcc_mpi's
#: executor and checks). Only gloo's so far: ``--transport gloo``'s own, or under
#: ``--transport mpi`` over a gloo group started from the MPI ranks.
LIBRARY_ROWS = ("gloo",)


class _Buffers:
    """One message size's buffers, shared by every row: this rank's input ``x`` and the
    output ``out`` (NumPy); over torch.distributed also tensors on the same memory, so
    that gloo's own all_reduce and optcc_mpi's algorithms start from the same input in
    the same output buffer, with the same one copy per call."""

    def __init__(self, x: np.ndarray, tensors: bool) -> None:
        self.x = x
        self.out = np.empty_like(x)
        self.xt = self.outt = None
        if tensors:
            self.xt, self.outt = _as_torch(self.x), _as_torch(self.out)


def _as_torch(arr: np.ndarray) -> Any:
    """A CPU tensor over ``arr``'s memory (bfloat16 through its 16-bit words)."""
    import torch

    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _library_call(group: Any, bufs: _Buffers, op: str, pacer: Any) -> np.ndarray:
    """gloo's own all_reduce of the input, in place in the output buffer. Under emulation
    it then waits until the emulated library AllReduce would have ended (as ``native``'s
    collective operation does in the executor), so that its row is timed on the emulated
    network like the others."""
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    t0 = time.perf_counter()
    bufs.outt.copy_(bufs.xt)
    dist.all_reduce(bufs.outt, op=ops[op], group=group)
    if pacer is not None:
        time.sleep(max(0.0, pacer.coll_done(t0, bufs.out.nbytes) - time.perf_counter()))
    return bufs.out


def run(cfg: BenchConfig, comm: Any = None) -> list[dict[str, Any]]:
    """Run the benchmark (collective): one row per (algorithm, size), on every rank.

    ``comm``: what the algorithms run over: an mpi4py communicator for
    ``cfg.transport == "mpi"`` (default ``COMM_WORLD``), a torch.distributed gloo process
    group for ``"gloo"`` (default: the default group, started from the launcher's
    variables if it is not yet: :mod:`optcc_mpi.lab.world`). A ``gloo`` row under the MPI
    transport runs over the default process group, started from the MPI ranks if needed
    (and ended again here)."""
    if cfg.transport not in world.TRANSPORTS:
        raise ValueError(f"unknown transport {cfg.transport!r}; choose from mpi, gloo")
    started: list[bool] = []
    if comm is None:
        comm, made = world.start(cfg.transport)
        started.append(made)
    ctrl = transports.of(comm)
    if (ctrl.name == "mpi") != (cfg.transport == "mpi"):
        raise ValueError(
            f"the benchmark's transport is {cfg.transport} but comm is a {ctrl.describe()}"
        )
    group = None  # the torch process group of the library's own rows
    if any(a in LIBRARY_ROWS for a in cfg.algorithms):
        if cfg.transport == "gloo":
            group = comm
        else:
            try:
                group, made = world.torch_group()
            except ImportError as exc:
                raise RuntimeError(
                    f"gloo needs torch ({exc}; pip install torch); drop it from --algorithms"
                ) from None
            started.append(made)
    rows = _run_case(cfg, comm, ctrl, group)
    # Groups started here end here (not after an error: the other ranks may never come
    # to the barrier that ending takes).
    for made in reversed(started):
        world.end(made)
    return rows


def _run_case(cfg: BenchConfig, comm: Any, ctrl: Any, group: Any) -> list[dict[str, Any]]:
    """:func:`run` once ``comm`` (the algorithms'), ``ctrl`` (its transport) and ``group``
    (the library rows' process group, or None) are known."""
    rank, p = ctrl.rank, ctrl.size
    dtype = DTYPES[cfg.dtype]
    net = _Network(ctrl, cfg)
    links = net.links
    if links == "probe":
        net.degraded(True)
        links = cached_probe(comm, emulate=cfg.emulate).links
    latency = cfg.latency
    if latency is None:
        latency = cfg.emulate.latency if cfg.emulate is not None else 0.0
    watch = links.degraded[0] if isinstance(links, Links) and links.degraded else 0
    if cfg.trace and rank == 0:
        Path(cfg.trace).mkdir(parents=True, exist_ok=True)
    tensors = cfg.transport == "gloo" or group is not None
    rows: list[dict[str, Any]] = []
    for size in cfg.sizes:
        count = size // dtype.itemsize
        exact = exact_period(p, cfg.op)
        bufs = _Buffers(_inputs(count, rank, dtype), tensors)

        def call(alg: str, prof: Links, emu: Any, bufs: _Buffers = bufs) -> Any:
            if alg in LIBRARY_ROWS:
                pacer = emu.pacer(rank, p, prof) if emu is not None else None
                return _library_call(group, bufs, cfg.op, pacer)
            if cfg.transport == "gloo":
                # In place in the output tensor, after the same copy as gloo's row.
                bufs.outt.copy_(bufs.xt)
                optcc_mpi.allreduce(
                    optcc_mpi.IN_PLACE, bufs.outt, op=cfg.op, comm=comm, algorithm=alg,
                    links=prof, emulate=emu,
                )  # fmt: skip
                return bufs.out
            return optcc_mpi.allreduce(
                bufs.x, bufs.out, op=cfg.op, comm=comm, algorithm=alg, links=prof, emulate=emu
            )

        def check(o: Any, exact: np.ndarray = exact) -> int:
            return count_wrong(o, exact)

        ff = math.nan
        plan: list[tuple[str, str, Links]] = []
        if cfg.reference:
            plan.append(("ring (fault-free)", "ring", Links()))
        plan += [(a, a, links) for a in cfg.algorithms]
        for label, alg, prof in plan:
            degraded = label != "ring (fault-free)"
            net.degraded(degraded)
            # The fault-free reference drops any emulated degradation too.
            emu = (
                cfg.emulate
                if degraded or cfg.emulate is None
                else dataclasses.replace(cfg.emulate, degrade=Links())
            )
            times, wrong, cpu = _time(
                ctrl, lambda a=alg, pr=prof, e=emu: call(a, pr, e), cfg.iters, cfg.warmup, check
            )
            wrong = sum(ctrl.allgather(wrong))
            # Each rank's peak memory so far: rows run in order of size, so the value beside
            # a row covers it and every smaller size before it.
            rss = ctrl.allgather(peak_rss_mib())
            library = alg in LIBRARY_ROWS
            ls = {} if library else last_stats()
            st = ls.get("stats")
            sent = (st.messages_sent + st.messages_received) if st is not None else 0
            # Where the time goes (issue 36): the ranks' CPU per call against the call's
            # time says whether the cores were saturated; messages per rank, what each
            # call cost the executor.
            spent = ctrl.allgather((cpu, sent))
            med = statistics.median(times)
            if label == "ring (fault-free)":
                ff = med
            chosen = alg if library else last_stats().get("algorithm")
            mod = bound = bound_delivered = math.nan
            if net.bw and p > 1:
                mlinks = links if degraded else Links()
                delivered = net.bw * cfg.efficiency
                # A library's own AllReduce is modelled as native's (bandwidth-optimal,
                # held back by the slowest rank).
                mod = model_time(
                    "native" if library else chosen or alg, p, size, delivered, mlinks,
                    {} if library else last_stats(), latency=latency,
                )  # fmt: skip
                bound = model.lower_bound(p, size, net.bw, mlinks)
                bound_delivered = model.lower_bound(p, size, delivered, mlinks)
            busy: dict[str, Any] = {}
            if cfg.trace and not library:
                ls = last_stats()
                recs = _trace_record(ctrl, ls.get("stats"), ls.get("schedule"))
                # The library's own collective (native) has no messages of ours to trace.
                if recs is not None and any(r["sends"] or r["recvs"] for r in recs):
                    util = utilisation(recs)
                    tag = f"{label.replace(' ', '').replace('(', '-').replace(')', '')}-{size}"
                    busy = {
                        "send_busy": util[watch]["send_busy"],
                        "recv_busy": util[watch]["recv_busy"],
                        "busy_rank": watch,
                        "busy": [[u["send_busy"], u["recv_busy"]] for u in util],
                        "timeline": str(Path(cfg.trace) / f"timeline-{tag}.png"),
                    }
                    with open(Path(cfg.trace) / f"trace-{tag}.json", "w") as fh:
                        json.dump({"label": label, "size": size, "ranks": recs}, fh)
                    plot_timeline(recs, watch, busy["timeline"], f"{label}, {size} B, rank {watch}")
            algbw = size / med / 1e9 if med > 0 else math.nan
            rows.append(
                {
                    "algorithm": label,
                    "chosen": chosen,
                    "transport": cfg.transport,
                    "size": size,
                    "count": count,
                    "type": cfg.dtype,
                    "redop": cfg.op,
                    "p": p,
                    "links": str(links if degraded else Links()),
                    "network": net.kind,
                    "emulate": str(cfg.emulate) if cfg.emulate else None,
                    "time_us": med * 1e6,
                    "time_min_us": min(times) * 1e6,
                    "time_max_us": max(times) * 1e6,
                    "algbw": algbw,
                    "busbw": algbw * 2 * (p - 1) / p if p > 1 else algbw,
                    "wrong": wrong,
                    "ratio_fault_free": med / ff if ff == ff and ff > 0 else math.nan,
                    "model_us": mod * 1e6,
                    "bound_us": bound * 1e6,
                    "bound_delivered_us": bound_delivered * 1e6,
                    "efficiency": cfg.efficiency,
                    "latency_us": latency * 1e6,
                    "rss_peak_mib": max(rss),
                    "rss_peak_mib_ranks": rss,
                    "cpu_s_ranks": [c for c, _ in spent],
                    "cpu_over_wall": sum(c for c, _ in spent) / med if med > 0 else math.nan,
                    "messages_ranks": [m for _, m in spent],
                    "schedule_params": _scalars(getattr(ls.get("schedule"), "params", None)),
                    **busy,
                    "iters": cfg.iters,
                    "warmup": cfg.warmup,
                    "load": load_average(),
                    "command": cfg.command,
                }
            )
    net.degraded(True)
    return rows


def rows_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as an aligned text table (nccl-tests' columns, then ours)."""
    columns = COLUMNS + (TRACE_COLUMNS if any("send_busy" in r for r in rows) else ())
    header = [h for _, h, _ in columns]
    body = []
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            if v is None or (isinstance(v, float) and math.isnan(v)):
                cells.append("-")
            elif key == "algorithm" and r.get("chosen") and r["chosen"] != v and v == "auto":
                cells.append(f"auto->{r['chosen']}")
            else:
                cells.append(format(v, fmt))
        body.append(cells)
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    lines = [
        "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths)))
    ]
    for cells in body:
        lines.append(
            "  ".join(
                c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
            )
        )
    return "\n".join(lines)


def notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the table's ratios cannot show by themselves: where the lower bound is the
    ring's own time, so that no algorithm can beat the ring (``p = 2``, or no degraded
    rank), a ratio above 1 is the network's, not an algorithm's defect. One entry per
    case met, without the ``# `` the table's notes are printed with.

    The model (docs/model.md): the bound is ``n/B max(1/f_min, 2(p-1)/sum f)``, the ring
    ``2(p-1)/p n/B / f_min``. At ``p = 2`` both are ``n/B / f_min``: each rank must send
    its whole message through the slow link and receive the whole result through it, and
    with one partner there is nothing to route around. With every link healthy both are
    the fault-free ring's time.
    """
    out: list[str] = []
    seen: set[tuple[int, str]] = set()
    for r in rows:
        if r["algorithm"] == "ring (fault-free)" or r.get("p", 0) < 2:
            continue
        p, prof = int(r["p"]), str(r["links"])
        if (p, prof) in seen:
            continue
        seen.add((p, prof))
        links = Links.coerce(prof)
        bound = model.lower_bound(p, 1.0, 1.0, links)
        ring = model.fault_free(p, 1.0, 1.0) / model.fractions(links, p).min()
        if bound < ring * (1 - 1e-9):
            continue
        if links.healthy:
            out.append(
                "no degraded rank: the lower bound is the fault-free ring's own time, so no "
                "algorithm can beat the ring here (x ff-ring 1.00 at best); give --links "
                "RANK:FRACTION (or --emulate ...,degrade=RANK:FRACTION) to compare them on a "
                "degraded network"
            )
        elif p == 2:
            slow = 1.0 / model.fractions(links, p).min()
            out.append(
                f"p = 2: the lower bound equals the ring's time on this degraded network, "
                f"{slow:.3g}x the fault-free ring (each rank sends its whole message through "
                "the slow link and receives the whole result through it: with one partner "
                "there is nothing to route around), so OptCC cannot beat the ring at 2 ranks "
                "and a ratio near that is the network's, not a defect. From 3 ranks on it "
                "can: one rank at half rate bounds the time at p/(p-1) of the fault-free ring "
                "(1.5x at 3 ranks, 1.33x at 4) against the ring's 2x"
            )
        else:
            out.append(
                f"the lower bound equals the ring's time on {prof} at {p} ranks: no algorithm "
                "can beat the ring on this network"
            )
    return out


def write(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> None:
    """JSON lines (one object per row), or CSV when ``path`` ends in ``.csv``."""
    path = Path(path)
    if path.suffix == ".csv":
        with path.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["algorithm"])
            w.writeheader()
            w.writerows(rows)
    else:
        with path.open("w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
