"""The transport contract's minimum: every collective of the package over a transport of
four methods whose ranks are threads of one process (:mod:`optcc_mpi.testing.local`).

No MPI library and no process group: the argument check, the gather limit, the schedules
of every algorithm, the watch and the probe run over ``isend``, ``irecv``, ``wait`` and
``allgather`` and the contract's defaults for everything else."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

import optcc_mpi
from optcc_mpi import algorithms, collectives
from optcc_mpi.errors import ArgumentError
from optcc_mpi.testing.local import LocalRequest, LocalTransport, LocalWorld
from optcc_mpi.transports import Completion, Transport


def _inputs(p: int, n: int, dtype: str, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype == "bfloat16":
        return [rng.standard_normal(n).astype(ml_dtypes.bfloat16) for _ in range(p)]
    if np.dtype(dtype).kind in "iu":
        return [rng.integers(0, 50, n).astype(dtype) for _ in range(p)]
    return [rng.standard_normal(n).astype(dtype) for _ in range(p)]


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("algorithm", ["auto", *algorithms.names()])
def test_every_algorithm(p: int, algorithm: str) -> None:
    """Every algorithm's result: the float64 sum of the inputs, the same bits on every
    rank, whatever the size (short calls travel in the check, long ones in schedules)."""
    world = LocalWorld(p)
    for n in (1, 300, 20_000):
        xs = _inputs(p, n, "float64", seed=n)
        ref = np.sum(np.array(xs, dtype=np.float64), axis=0)
        links = f"{p - 1}:0.5" if p > 1 else None
        out = world.run(
            lambda t, xs=xs, links=links: optcc_mpi.allreduce(
                xs[t.rank], comm=t, algorithm=algorithm, links=links
            )
        )
        for y in out:
            np.testing.assert_array_equal(y, out[0])
        np.testing.assert_allclose(out[0], ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "int32", "uint8", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_types_and_ops(dtype: str, op: str) -> None:
    world = LocalWorld(3)
    xs = _inputs(3, 5001, dtype, seed=7)
    wide = np.array([x.astype(np.float64) for x in xs])
    ref = {"sum": wide.sum(0), "max": wide.max(0), "min": wide.min(0)}[op]
    out = world.run(lambda t: optcc_mpi.allreduce(xs[t.rank], op=op, comm=t, algorithm="ring"))
    for y in out:
        assert y.dtype == xs[0].dtype
        np.testing.assert_array_equal(y.view(np.uint8), out[0].view(np.uint8))
    got = out[0].astype(np.float64)
    if dtype == "bfloat16" and op == "sum":
        np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2)
    elif dtype == "uint8" and op == "sum":
        np.testing.assert_array_equal(got, ref % 256)
    elif dtype == "float32" and op == "sum":  # two float32 roundings per element
        bound = 2 * np.finfo(np.float32).eps * np.abs(wide).sum(0)
        assert np.all(np.abs(got - ref) <= bound)
    else:
        np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_bad_input_is_the_same_error_on_every_rank() -> None:
    world = LocalWorld(3)

    def call(t: LocalTransport) -> str:
        x = np.ones(10 + t.rank)
        before = x.copy()
        try:
            optcc_mpi.allreduce(optcc_mpi.IN_PLACE, x, comm=t)
        except ArgumentError as exc:
            assert np.array_equal(x, before)  # nothing changed
            return str(exc)
        return "no error"

    said = world.run(call)
    assert len(set(said)) == 1 and "element count differs" in said[0], said


def test_watch_and_probe() -> None:
    """``links="watch"`` and ``"probe"`` over the minimum: the watch's observations ride
    in the check (the contract's default block gather), the probe's messages in schedules."""
    world = LocalWorld(4)
    xs = _inputs(4, 70_000, "float32", seed=3)
    for links in ("watch", "probe"):
        for _ in range(3):
            out = world.run(
                lambda t, links=links: optcc_mpi.allreduce(xs[t.rank], comm=t, links=links)
            )
        for y in out:
            np.testing.assert_array_equal(y, out[0])
    assert collectives.comm_state(world.transports[0]).watch is not None
    assert collectives.comm_state(world.transports[0]).probe is not None


def test_a_transport_must_implement_the_required_methods() -> None:
    with pytest.raises(TypeError, match="must implement irecv, wait, allgather"):

        class Half(Transport[object]):  # noqa: F841 - defined to fail
            def isend(self, data: object, peer: int, tag: int) -> object:
                return None

    class Base(Transport[object], abstract=True):  # declared abstract: allowed
        pass

    assert LocalTransport.caps.completion is Completion.ORDERED
    assert set(Transport.REQUIRED) == {"isend", "irecv", "wait", "allgather"}


def test_ordered_completions_are_timed_at_arrival() -> None:
    """Where a completion is seen only by waiting for it, in order, a message that arrived
    while the loop waited for another is timed at its arrival when asked (``stamp_from``:
    the watch's messages), not when the loop reached it (a healthy message queued behind
    a slow one looked slow, and the watch misread the slow ranks under OptCC's plan)."""
    from optcc_mpi.arrays import NumpyArrayOps
    from optcc_mpi.executor import execute
    from optcc_mpi.schedule import ScheduleBuilder

    b = ScheduleBuilder(3, 2, "two messages into rank 0")
    b.transfer(1, 0, 0, 1, reduce=True)  # first in rank 0's program: the loop waits for it
    b.transfer(2, 0, 1, 2, reduce=True)
    sched = b.build()
    world = LocalWorld(3, timeout=20.0)
    zero = world.transports[0]
    seen = threading.Event()  # rank 0 has seen rank 2's message arrive
    waits = zero.wait

    def wait(req: LocalRequest) -> None:
        sender = req.key[0] if req.key is not None else None
        waits(req)
        if sender == 2:
            seen.set()

    zero.wait = wait  # type: ignore[method-assign]

    def one(t: LocalTransport) -> list[tuple[int, float]]:
        if t.rank == 1:
            # Rank 1's message leaves only once rank 0 has seen rank 2's arrive (or after
            # a while: without arrival times nothing waits for it before rank 1's).
            seen.wait(5.0)
        x = np.full(2, float(t.rank + 1))
        stats = execute(sched, x, comm=t, op="sum", arrays=NumpyArrayOps(), stamp_from=1)
        if t.rank == 0:
            np.testing.assert_array_equal(x, [3.0, 4.0])
        return [(m.peer, m.completed) for m in stats.recvs]

    done = dict(world.run(one)[0])
    assert seen.is_set()
    assert done[2] < done[1], done
