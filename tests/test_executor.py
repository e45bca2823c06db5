"""The executor's per-message records, its per-call caches (plan, receive pool), and out of
place without a copy (results identical to in place on every driver, no more memory traffic).
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

import optcc_mpi
from optcc_mpi import algorithms, testing, transports
from optcc_mpi.arrays import NumpyArrayOps
from optcc_mpi.arrays import instance as _instance
from optcc_mpi.collectives import last_stats
from optcc_mpi.executor import execute
from optcc_mpi.links import Links
from optcc_mpi.schedule import RECV, RECV_REDUCE, SEND
from optcc_mpi.transports import Completion

MPI = pytest.importorskip("mpi4py.MPI")
pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(300)]


@pytest.mark.parametrize("name", ["ring", "optcc", "r2ccl"])
def test_records_every_message(name: str) -> None:
    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    count = 10_000 + 7
    # Many small messages: by message size where the algorithm takes one, else by segments.
    small = {"chunk_bytes": 4096} if "chunk_bytes" in algorithms.get(name).params else {"k": 16}
    sched = algorithms.build(name, p, count, Links({0: 0.5}), itemsize=8, **small)
    assert len(sched.program(rank).ops) > 4 * p
    x = np.arange(count, dtype=np.float64) * (rank + 1)
    stats = execute(sched, x, comm=comm, op="sum", arrays=NumpyArrayOps())
    np.testing.assert_array_equal(x, np.arange(count, dtype=np.float64) * (p * (p + 1) // 2))
    ops = sched.program(rank).ops
    sends = [i for i, o in enumerate(ops) if o[0] == SEND]
    recvs = [i for i, o in enumerate(ops) if o[0] in (RECV, RECV_REDUCE)]
    assert sorted(r[0] for r in stats.sends) == sends
    assert sorted(r[0] for r in stats.recvs) == recvs
    for recs in (stats.sends, stats.recvs):
        for op, peer, nbytes, posted, done in recs:
            assert peer == ops[op][1]
            assert nbytes == (ops[op][5] - ops[op][4]) * 8
            assert 0 <= posted <= done <= stats.seconds
    assert sum(r[2] for r in stats.sends) == stats.bytes_sent
    assert sum(r[2] for r in stats.recvs) == stats.bytes_received
    assert stats.start > 0


def test_repeated_calls_reuse_plan_and_temporaries() -> None:
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    sched = algorithms.build("ring", p, 4096, Links(), itemsize=4, chunk_bytes=1024)
    be = NumpyArrayOps()
    plan_pools = []
    for it in range(3):
        x = np.full(4096, it + 1.0, dtype=np.float32)
        execute(sched, x, comm=comm, op="max", arrays=be)
        np.testing.assert_array_equal(x, np.full(4096, it + 1.0, dtype=np.float32))
        plans = sched.__dict__["_exec_plans"]
        assert list(plans) == [(comm.Get_rank(), 4)]  # one plan per (rank, itemsize)
        pool = next(iter(plans.values())).temp_pool[("numpy", "<f4")]
        plan_pools.append({m: [id(t) for t in ts] for m, ts in pool.items()})
    # After the first call every temporary came from the pool and went back to it.
    assert plan_pools[1] and sorted(map(sorted, plan_pools[1].values())) == sorted(
        map(sorted, plan_pools[2].values())
    )


# -- out of place: the send buffer read where the input is first needed ---------------------------
def _profiles(p: int) -> list[str | None]:
    return [None, "0:0.5", f"{p - 1}:0.3", "0:0.5,1:0.25" if p > 2 else "1:0.7"]


def _inputs(dtype: str, n: int, rank: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, n, rank])
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-100, 100, n).astype(dtype)
    x = rng.standard_normal(n) * 4
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.standard_normal(n)
    x = x.astype(dtype)
    x[:: max(1, n // 5)] = np.nan  # NaN payloads must come out as in place too
    return x


@pytest.mark.parametrize("name", ["ring", "optcc", "r2ccl", "native", "auto"])
def test_out_of_place_is_in_place_bit_for_bit(name: str) -> None:
    """Every algorithm, several link profiles, sizes, types and ops: ``allreduce(x, out)``
    gives the bits of ``allreduce(IN_PLACE, buf)`` and leaves ``x`` as it was."""
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    cases = [("float32", "sum"), ("float64", "max"), ("int32", "bxor"), ("float16", "prod")]
    cases.append(("complex64", "sum"))
    for links in _profiles(p):
        for n in (1, p + 1, 4099, 70_001):
            for dtype, op in cases:
                x = _inputs(dtype, n, rank, seed=len(name))
                kept = x.copy()
                buf = x.copy()
                optcc_mpi.allreduce(optcc_mpi.IN_PLACE, buf, op=op, algorithm=name, links=links)
                out = np.full_like(x, 3)
                assert optcc_mpi.allreduce(x, out, op=op, algorithm=name, links=links) is out
                np.testing.assert_array_equal(out.view(np.uint8), buf.view(np.uint8))
                np.testing.assert_array_equal(x.view(np.uint8), kept.view(np.uint8))


@pytest.mark.parametrize("kind", ["numpy", "fake-device-aware", "fake-device-staged"])
def test_out_of_place_paced_and_on_devices(kind: str) -> None:
    """Under emulation (the library's AllReduce then runs on the executor, paced) and on
    device arrays (CUDA-aware and staged through the host), out of place gives the bits of
    in place."""
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    be = _instance(testing.FAKE_DEVICE)
    be.cuda_aware = kind.endswith("aware")
    be.queued = 0
    on_device = kind != "numpy"
    for name in ["ring", "optcc", "r2ccl", "native"]:
        for emulate in (None, "bw=4GB/s,latency=1us"):
            for n in (p + 1, 70_001):
                x = _inputs("float32", n, rank, seed=11)
                buf = x.copy()
                optcc_mpi.allreduce(
                    optcc_mpi.IN_PLACE, buf, algorithm=name, links="0:0.5", emulate=emulate
                )
                src = testing.device_array(x) if on_device else x.copy()
                dst = testing.device_array(np.zeros_like(x)) if on_device else np.zeros_like(x)
                optcc_mpi.allreduce(src, dst, algorithm=name, links="0:0.5", emulate=emulate)
                got = dst.host if on_device else dst
                np.testing.assert_array_equal(got.view(np.uint8), buf.view(np.uint8))
                np.testing.assert_array_equal((src.host if on_device else src), x)


@pytest.mark.parametrize("observe", ["any", "ordered", "grouped"])
def test_out_of_place_on_every_driver(observe: str) -> None:
    """``execute(..., source=x)`` on the MPI transport seen as each kind of library (every
    completion, gloo's lowest level first, NCCL's level-by-level groups): the bits of the
    in-place run, for every algorithm and for a program with every case of the analysis
    (``tests/test_sourcing.py``), on a result buffer that starts as garbage."""
    from test_sourcing import _awkward

    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    wire = copy.copy(transports.of(comm))
    wire.caps = dataclasses.replace(wire.caps, completion=Completion(observe))
    scheds = [
        algorithms.build(name, p, count, Links(links), itemsize=8, **small)
        for name in algorithms.names()
        for links in ({}, {0: 0.5}, {p - 1: 0.3})
        for count in (p + 1, 9001)
        for small in ([{"chunk_bytes": 4096}] if name in ("ring", "r2ccl") else [{}])
    ]
    if p == 2:
        scheds.append(_awkward())
    for sched in scheds:
        x = _inputs("float64", sched.count, rank, seed=5)
        ref = x.copy()
        execute(sched, ref, comm=wire, op="sum", arrays=NumpyArrayOps())
        out = np.full_like(x, np.inf)
        stats = execute(sched, out, comm=wire, op="sum", arrays=NumpyArrayOps(), source=x)
        np.testing.assert_array_equal(out.view(np.uint8), ref.view(np.uint8), err_msg=sched.name)
        if observe != "grouped":  # (the grouped driver keeps counts only, no records)
            assert len(stats.sends) == stats.messages_sent


class _Traffic:
    """Bytes NumPy's ArrayOps' element-wise work moves through memory: a copy reads and
    writes its elements once, a reduction reads two operands and writes one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        real = {k: getattr(NumpyArrayOps, k) for k in ("copyto", "reduce", "reduce_into")}
        passes = {"copyto": 2, "reduce": 3, "reduce_into": 3}
        for name, fn in real.items():

            def counted(be: object, *args: object, fn: object = fn, k: int = passes[name]) -> None:
                self.bytes += k * args[-1].nbytes
                fn(be, *args)

            monkeypatch.setattr(NumpyArrayOps, name, counted)


@pytest.mark.parametrize("name", ["ring", "optcc", "r2ccl", "auto"])
def test_out_of_place_moves_no_more_bytes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of place costs no extra pass over memory: the array library's copies and reductions
    move no more bytes than in place (and the messages are the same). (Not ``native``:
    the library's AllReduce runs in place on every rank, since ``MPI_IN_PLACE`` is all or
    none and ranks may differ, so out of place it is one copy first, as the library's own
    out-of-place call makes inside.)"""
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    traffic = _Traffic(monkeypatch)
    for links in _profiles(p):
        x = _inputs("float32", 300_000, rank, seed=2)  # 1.2 MB: past the short-call sizes
        buf = x.copy()
        traffic.bytes = 0
        optcc_mpi.allreduce(optcc_mpi.IN_PLACE, buf, algorithm=name, links=links)
        in_place, sent = traffic.bytes, last_stats()["stats"].bytes_sent
        traffic.bytes = 0
        out = np.empty_like(x)
        optcc_mpi.allreduce(x, out, algorithm=name, links=links)
        assert traffic.bytes <= in_place, (links, traffic.bytes, in_place)
        assert last_stats()["stats"].bytes_sent == sent
        np.testing.assert_array_equal(out.view(np.uint8), buf.view(np.uint8))
