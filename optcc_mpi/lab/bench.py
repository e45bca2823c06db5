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
from optcc_mpi.backend import DTYPES
from optcc_mpi.emulation import Emulation
from optcc_mpi.links import Links

__all__ = ["BenchConfig", "sizes", "run", "table", "write"]

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
    name: str, p: int, size: int, bw: float, links: Links, stats: dict[str, Any]
) -> float:
    """Modelled time of what ran: the cost the algorithm registered, with the parameters
    the call used."""
    from optcc_mpi import algorithms

    alg = algorithms.get(name)
    params = {k: v for k, v in (stats.get("params") or {}).items() if k in alg.params}
    return alg.time(p, size, bw, links, **params)


def _time(comm: Any, fn: Any, iters: int, warmup: int) -> tuple[list[float], list[Any]]:
    from mpi4py import MPI

    times, outs = [], []
    for it in range(warmup + iters):
        comm.Barrier()
        t0 = time.perf_counter()
        out = fn()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if it >= warmup:
            times.append(dt)
            outs.append(out)
    return times, outs


def _gloo(comm: Any) -> Any:
    """A torch.distributed gloo group over the same ranks, or None without torch."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_initialized():
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
    return torch


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
    torch = _gloo(comm) if "gloo" in cfg.algorithms else None
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
            ).copy()

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
            times, outs = _time(
                comm, lambda a=alg, pr=prof, e=emu: call(a, pr, e), cfg.iters, cfg.warmup
            )
            wrong = sum(int(np.count_nonzero(o.astype(np.float64) != exact)) for o in outs)
            wrong = comm.allreduce(wrong, op=MPI.SUM)
            med = statistics.median(times)
            if label == "ring (fault-free)":
                ff = med
            chosen = last_stats().get("algorithm") if alg != "gloo" else "gloo"
            mod = bound = math.nan
            if net.bw and p > 1:
                mlinks = links if degraded else Links()
                mod = model_time(chosen or alg, p, size, net.bw, mlinks, last_stats())
                bound = model.lower_bound(p, size, net.bw, mlinks)
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
                    "iters": cfg.iters,
                    "warmup": cfg.warmup,
                    "command": cfg.command,
                }
            )
    net.degraded(True)
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as an aligned text table (nccl-tests' columns, then ours)."""
    header = [h for _, h, _ in COLUMNS]
    body = []
    for r in rows:
        cells = []
        for key, _, fmt in COLUMNS:
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
