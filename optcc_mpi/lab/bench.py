"""The AllReduce benchmark, in the style of nccl-tests, run on every rank of a job.

For every message size it times the fault-free ring first (the same ranks with every link
healthy: the links argument dropped under emulation, the shaping switched off on the
testbed), then each algorithm on the degraded network, and reports per (algorithm, size):
median, minimum and maximum time over the iterations, algbw and busbw (nccl-tests'
``2(p-1)/p`` factor for every algorithm), ``#wrong`` summed over ranks, the ratio to the
fault-free ring measured in the same run, and the modelled time and lower bound.

Every timed result is checked: inputs are small integers, exact in every dtype, and each
iteration's output is compared element by element with the exact reduction (outside the
timed region).

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

from optcc_mpi import config
from optcc_mpi.dtypes import DTYPES
from optcc_mpi.emulation import Emulation
from optcc_mpi.links import Links

__all__ = [
    "BenchConfig",
    "sizes",
    "run",
    "table",
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


def _inputs(count: int, rank: int, p: int, dtype: np.dtype, op: str) -> tuple[np.ndarray, Any]:
    """This rank's input and the exact result: small integers, exact in every dtype
    (partial sums stay within 8p, exact in bfloat16 up to p = 32)."""
    i = np.arange(count, dtype=np.int64)
    x = ((i * 7 + rank * 13) % 17 - 8).astype(dtype)
    vals = np.stack([(i * 7 + r * 13) % 17 - 8 for r in range(p)]) if count else None
    if count == 0:
        return x, np.zeros(0)
    exact = {"sum": vals.sum(0), "max": vals.max(0), "min": vals.min(0)}[op]
    return x, exact.astype(np.float64)


class _Network:
    """How the degraded network is applied and removed for the fault-free reference."""

    def __init__(self, comm: Any, cfg: BenchConfig) -> None:
        self.comm = comm
        self.emulate = cfg.emulate
        self.testbed = None
        if config.get("OPTCC_TESTBED_NAME"):
            from optcc_mpi.lab import testbed

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
            if self.comm.Get_rank() == 0:
                from optcc_mpi.lab import testbed

                testbed.set_shaping(self.truth() if on else None)
            self.comm.Barrier()

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
    from optcc_mpi import algorithms

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


def _trace_record(comm: Any, stats: Any, schedule: Any) -> list[dict[str, Any]] | None:
    """Gather every rank's per-message records of the last call to rank 0."""
    rank = comm.Get_rank()
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
    got = comm.gather(rec, root=0)
    if rank != 0 or any(g is None for g in got):
        return None
    return got


def _time(comm: Any, fn: Any, iters: int, warmup: int, check: Any) -> tuple[list[float], int]:
    """Times of ``iters`` calls of ``fn`` after ``warmup``, and the wrong elements summed
    over the timed calls: ``check(result)`` runs outside the timed region, so checking
    (and the memory it needs) costs no algorithm anything, and no result is kept."""
    from mpi4py import MPI

    times, wrong = [], 0
    for it in range(warmup + iters):
        comm.Barrier()
        t0 = time.perf_counter()
        out = fn()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if it >= warmup:
            times.append(dt)
            wrong += check(out)
    return times, wrong


def _gloo(comm: Any) -> tuple[Any, bool]:
    """torch with a torch.distributed gloo group over the same ranks (None without
    torch), and whether this call made the group (then the caller ends it)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None, False
    made = not dist.is_initialized()
    if made:
        import socket

        addr = comm.bcast(socket.gethostbyname(socket.gethostname()), root=0)
        port = comm.bcast(29500 + os.getpid() % 1000, root=0)
        if config.get("OPTCC_TESTBED_NAME"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{addr}:{port}",
            rank=comm.Get_rank(),
            world_size=comm.Get_size(),
        )
    return torch, made


def run(cfg: BenchConfig, comm: Any = None) -> list[dict[str, Any]]:
    """Run the benchmark (collective): one row per (algorithm, size), on every rank."""
    from mpi4py import MPI

    import optcc_mpi
    from optcc_mpi import model
    from optcc_mpi.collectives import last_stats

    comm = MPI.COMM_WORLD if comm is None else comm
    rank, p = comm.Get_rank(), comm.Get_size()
    dtype = DTYPES[cfg.dtype]
    net = _Network(comm, cfg)
    links = net.links
    if links == "probe":
        from optcc_mpi.probe import cached_probe

        net.degraded(True)
        links = cached_probe(comm, emulate=cfg.emulate).links
    torch, made_gloo = _gloo(comm) if "gloo" in cfg.algorithms else (None, False)
    latency = cfg.latency
    if latency is None:
        latency = cfg.emulate.latency if cfg.emulate is not None else 0.0
    watch = links.degraded[0] if isinstance(links, Links) and links.degraded else 0
    if cfg.trace and rank == 0:
        Path(cfg.trace).mkdir(parents=True, exist_ok=True)
    if "gloo" in cfg.algorithms and torch is None:
        raise RuntimeError("gloo needs torch (pip install torch); drop it from --algorithms")
    rows: list[dict[str, Any]] = []
    for size in cfg.sizes:
        count = size // dtype.itemsize
        x, exact = _inputs(count, rank, p, dtype, cfg.op)
        out = np.empty_like(x)

        def call(alg: str, prof: Links, emu: Any, x: np.ndarray = x, out: np.ndarray = out) -> Any:
            if alg == "gloo":
                t = torch.from_numpy(x.astype(np.float32) if dtype.itemsize == 2 else x.copy())
                opmap = {
                    "sum": torch.distributed.ReduceOp.SUM,
                    "max": torch.distributed.ReduceOp.MAX,
                    "min": torch.distributed.ReduceOp.MIN,
                }
                torch.distributed.all_reduce(t, op=opmap[cfg.op])
                return t.numpy()
            return optcc_mpi.allreduce(
                x, out, op=cfg.op, comm=comm, algorithm=alg, links=prof, emulate=emu
            )

        def check(o: Any, exact: np.ndarray = exact) -> int:
            return int(np.count_nonzero(np.asarray(o).astype(np.float64) != exact))

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
            times, wrong = _time(
                comm, lambda a=alg, pr=prof, e=emu: call(a, pr, e), cfg.iters, cfg.warmup, check
            )
            wrong = comm.allreduce(wrong, op=MPI.SUM)
            med = statistics.median(times)
            if label == "ring (fault-free)":
                ff = med
            chosen = last_stats().get("algorithm") if alg != "gloo" else "gloo"
            mod = bound = bound_delivered = math.nan
            if net.bw and p > 1:
                mlinks = links if degraded else Links()
                delivered = net.bw * cfg.efficiency
                mod = model_time(
                    chosen or alg, p, size, delivered, mlinks, last_stats(), latency=latency
                )
                bound = model.lower_bound(p, size, net.bw, mlinks)
                bound_delivered = model.lower_bound(p, size, delivered, mlinks)
            busy: dict[str, Any] = {}
            if cfg.trace and alg != "gloo":
                ls = last_stats()
                recs = _trace_record(comm, ls.get("stats"), ls.get("schedule"))
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
                    **busy,
                    "iters": cfg.iters,
                    "warmup": cfg.warmup,
                    "command": cfg.command,
                }
            )
    net.degraded(True)
    if made_gloo:
        # Our group, ours to end: gloo's threads still running while the interpreter
        # finalises abort the process ("terminate called without an active exception",
        # seen under Open MPI in CI).
        import torch.distributed as dist

        comm.Barrier()
        dist.destroy_process_group()
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
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
