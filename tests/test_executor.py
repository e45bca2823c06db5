"""The executor's per-message records and its per-call caches (plan, receive pool)."""

from __future__ import annotations

import numpy as np
import pytest

from optcc_mpi import algorithms
from optcc_mpi.backend import NumpyBackend
from optcc_mpi.executor import execute
from optcc_mpi.links import Links
from optcc_mpi.schedule import RECV, RECV_REDUCE, SEND

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
    stats = execute(sched, x, comm=comm, op="sum", backend=NumpyBackend())
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
    be = NumpyBackend()
    plan_pools = []
    for it in range(3):
        x = np.full(4096, it + 1.0, dtype=np.float32)
        execute(sched, x, comm=comm, op="max", backend=be)
        np.testing.assert_array_equal(x, np.full(4096, it + 1.0, dtype=np.float32))
        plans = sched.__dict__["_exec_plans"]
        assert list(plans) == [(comm.Get_rank(), 4)]  # one plan per (rank, itemsize)
        pool = next(iter(plans.values())).temp_pool[("numpy", "<f4")]
        plan_pools.append({m: [id(t) for t in ts] for m, ts in pool.items()})
    # After the first call every temporary came from the pool and went back to it.
    assert plan_pools[1] and sorted(map(sorted, plan_pools[1].values())) == sorted(
        map(sorted, plan_pools[2].values())
    )
