"""The emulated network of the GLM trainer and the benchmark's projection (serial).

One cost model of the library's AllReduce (``optcc_mpi.model.library_allreduce``) and one
pacer (``optcc_mpi.emulation.Pacer``) serve the OptCC executor, the trainer and the
benchmark. Nothing here reads a wall clock: the pacer runs on a fake clock whose sleeps
overshoot by a known amount, and the tests assert on what the pacer charged and slept.
"""

from __future__ import annotations

import ast
import inspect
import math

import numpy as np
import pytest

from optcc_mpi import emulation, model
from optcc_mpi.algorithms import native as native_alg
from optcc_mpi.emulation import Emulation, Pacer
from optcc_mpi.errors import ArgumentError
from optcc_mpi.glm import comm as glm_comm
from optcc_mpi.links import Links
from optcc_mpi.model import library_allreduce, recursive_doubling_rounds


class FakeClock:
    """A clock that only moves when told; each sleep overshoots by ``overshoot``."""

    def __init__(self, overshoot: float = 0.0) -> None:
        self.t = 100.0
        self.overshoot = overshoot
        self.requests: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.requests.append(seconds)
        self.t += seconds + self.overshoot

    def advance(self, seconds: float) -> None:
        self.t += seconds


def paced(p: int, latency: float, bw: float | None, clock: FakeClock) -> Pacer:
    pacer = Emulation(latency=latency, bw=bw).pacer(0, p, Links())
    pacer.sleep, pacer.clock = clock.sleep, clock
    return pacer


def test_one_model_of_the_library_allreduce():
    # The case: p = 8, 1 MB, 1 GB/s, 5 us. A library runs Rabenseifner's algorithm
    # at 1 MB: 2(p-1)/p n/B + 2 log2(p) alpha = 1.75 ms + 30 us. Recursive doubling would
    # be 3 (5 us + 1 ms) = 3.015 ms, a schedule no library runs for 1 MB.
    assert library_allreduce(8, 1e6, 1e9, latency=5e-6) == pytest.approx(1.78e-3)
    # Short messages: recursive doubling's log2(p) latencies, not Rabenseifner's 2 log2(p).
    assert library_allreduce(8, 128, 1e9, latency=5e-6) == pytest.approx(3 * (5e-6 + 128e-9))
    # The native algorithm's declared cost, the executor's pacer and the trainer's are it.
    for n in (8, 4096, 1e6, 1e8):
        for lat in (0.0, 5e-6, 50e-6):
            want = library_allreduce(8, n, 1e9, "0:0.5", latency=lat)
            assert native_alg.native_time(8, n, 1e9, "0:0.5", latency=lat) == want
            pacer = Emulation(bw=1e9, latency=lat).pacer(3, 8, Links({0: 0.5}))
            assert pacer.coll_done(1.0, n) == pytest.approx(1.0 + want)
    # Without latency it is the bandwidth-optimal time held back by the slowest NIC.
    assert library_allreduce(8, 1e6, 1e9, "0:0.5") == pytest.approx(
        model.fault_free(8, 1e6, 1e9) / 0.5
    )
    # The trainer's former model and pacer are gone from glm.comm: this model is the one.
    for former in ("PATHS", "allreduce_path", "allreduce_cost", "NetworkPacer"):
        assert not hasattr(glm_comm, former)


@pytest.mark.parametrize(
    "p, rounds", [(2, 1), (4, 2), (8, 3), (1024, 10), (3, 3), (6, 4), (1000, 11)]
)
def test_short_messages_pay_recursive_doubling_rounds(p, rounds):
    assert recursive_doubling_rounds(p) == rounds
    alpha, beta = 50e-6, 25e9
    assert library_allreduce(p, 128, beta, latency=alpha) == pytest.approx(
        rounds * (alpha + 128 / beta)
    )
    # Long ones the faster of the two: Rabenseifner's 2 ceil(log2 p) latencies and
    # 2(p-1)/p n / B (which wins from p = 3 on; at p = 2 both move n bytes once).
    n = 64e6
    rab = 2 * (p - 1) / p * n / beta + 2 * math.ceil(math.log2(p)) * alpha
    rd = rounds * (alpha + n / beta)
    assert library_allreduce(p, n, beta, latency=alpha) == pytest.approx(min(rab, rd))
    assert (rab < rd) == (p > 2)


def test_cost_without_bandwidth_and_on_one_rank():
    assert library_allreduce(8, 10**9, None, latency=5e-6) == pytest.approx(3 * 5e-6)
    assert library_allreduce(1, 10**9, 1e9, latency=5e-6) == 0.0


@pytest.mark.parametrize(
    "args, kw, message",
    [
        ((8, -1, 1e9), {}, "payload must be >= 0"),
        ((8, 8, 1e9), {"latency": -1e-6}, "latency must be"),
        ((8, 8, math.inf), {}, "bandwidth must be"),
    ],
)
def test_cost_rejects_bad_arguments(args, kw, message):
    with pytest.raises(ArgumentError, match=message):
        library_allreduce(*args, **kw)


def test_pacer_charges_the_model_per_call():
    clock = FakeClock()
    pacer = paced(8, 50e-6, 25e9, clock)
    sizes = [128, 524288, 128, 4]
    for nbytes in sizes:
        t0 = clock()
        clock.advance(1e-6)  # the real reduction
        charged = pacer.hold(t0, nbytes)
        assert charged == pytest.approx(library_allreduce(8, nbytes, 25e9, latency=50e-6))
        assert clock() == pytest.approx(t0 + charged)  # no overshoot: exactly on the deadline
    assert pacer.held == 4 and pacer.charged_bytes["coll"] == sum(sizes)
    total = sum(library_allreduce(8, n, 25e9, latency=50e-6) for n in sizes)
    assert pacer.charged_seconds["coll"] == pytest.approx(total)
    # The real reduction's microsecond counted towards each charge.
    assert pacer.slept_s == pytest.approx(total - 4e-6)
    assert pacer.overrun_s == 0.0


def test_pacer_repays_sleep_overshoot_at_the_next_deadline():
    overshoot = 80e-6
    clock = FakeClock(overshoot)
    pacer = paced(4, 100e-6, None, clock)
    start = clock()
    n = 50
    for _ in range(n):
        clock.advance(30e-6)  # compute between AllReduces
        pacer.hold(clock(), 8)
    cost = 2 * 100e-6
    # Deadline scheduling: after the first call each sleep is shortened by the overshoot
    # owed, so the total is n * (compute + cost) plus one overshoot, not n overshoots.
    assert clock.requests[0] == pytest.approx(cost)
    assert all(r == pytest.approx(cost - overshoot) for r in clock.requests[1:])
    assert clock() - start == pytest.approx(n * (30e-6 + cost) + overshoot)
    assert pacer.charged_seconds["coll"] == pytest.approx(n * cost)
    assert pacer.overshoot_s == pytest.approx(n * overshoot)
    assert pacer.debt_s == pytest.approx(overshoot)


def test_pacer_records_overrun_and_does_not_sleep_when_the_reduction_was_slow():
    clock = FakeClock()
    pacer = paced(2, 10e-6, None, clock)
    t0 = clock()
    clock.advance(25e-6)
    assert pacer.hold(t0, 8) == pytest.approx(10e-6)
    assert clock.requests == [] and pacer.sleeps == 0
    assert pacer.overrun_s == pytest.approx(15e-6)


def test_pacer_sleeps_through_time_sleep_and_never_spins(monkeypatch):
    calls: list[float] = []
    monkeypatch.setattr(emulation.time, "sleep", calls.append)
    pacer = Emulation(latency=1e-3).pacer(0, 8, Links())
    # A clock that stands still and counts its readings, in place of the wall clock (a
    # loaded machine must not fail this test): a pacer that looped on the clock to make
    # up the difference would read it without end, as the patched sleep returns at once.
    reads: list[float] = []
    t0 = 0.0

    def clock() -> float:
        reads.append(t0)
        if len(reads) > 10:
            raise AssertionError("the pacer loops on the clock")
        return t0

    pacer.clock = clock
    pacer.hold(t0, 8)
    # One sleep, for (almost all of) the 3 ms charged, and the clock read once before it
    # and once after (to learn the overshoot): no loop on the clock.
    assert len(calls) == 1 and 2.5e-3 < calls[0] <= 3e-3
    assert len(reads) == 2
    # No loop at all in the pacing code: a spin would need one.
    for fn in (Pacer.hold, glm_comm.Reducer.__call__):
        tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(fn)))
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.While | ast.For)]


def test_reducer_paces_the_library_allreduce_on_one_rank_without_charge():
    from mpi4py import MPI

    red = glm_comm.Reducer(glm_comm.Group(MPI.COMM_SELF), "mpi", emulate="latency=50us,bw=25GB/s")
    assert red.pacer is not None and red.pacer.bw == 25e9
    buf = np.arange(4, dtype=np.float32)
    red(buf)
    st = red.stats()
    assert st["net_calls"] == 1 and st["net_charged_s"] == 0.0 and st["net_sleeps"] == 0
    np.testing.assert_array_equal(buf, np.arange(4, dtype=np.float32))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_reducer_charges_the_model_under_mpi():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p = comm.size
    red = glm_comm.Reducer(glm_comm.Group(comm), "native", emulate="latency=20us,bw=1GB/s")
    sizes = [8, 1000, 65536]
    for n in sizes:
        buf = np.random.default_rng([comm.rank, n]).standard_normal(n).astype(np.float32)
        ref = np.zeros(n)
        for r in range(p):  # float64 reference of the sum
            ref += np.random.default_rng([r, n]).standard_normal(n).astype(np.float32)
        red(buf)
        np.testing.assert_allclose(buf, ref, rtol=1e-5, atol=1e-5)
        assert comm.allgather(glm_comm.checksum(buf)) == [glm_comm.checksum(buf)] * p
    st = red.stats()
    expected = sum(library_allreduce(p, 4 * n, 1e9, latency=20e-6) for n in sizes)
    assert st["net_charged_s"] == pytest.approx(expected)
    assert st["net_calls"] == 3 and st["net_sleeps"] <= 3


# -- the benchmark's arithmetic (optcc_mpi.lab.glm_projection, glm_measure) ---------------


def test_projection_follows_the_formula_for_synthetic_timings():
    from optcc_mpi.lab.glm_projection import project

    p_values = [8, 16, 1024]
    compute = {"sgd": {8: 1e-5, 16: 6e-6, 1024: 2e-6}, "ca": {8: 4e-4, 16: 2e-4, 1024: 5e-6}}
    nbytes = {"sgd": 128, "ca": 528384}
    steps = {"sgd": 1, "ca": 16}
    proj = project(p_values, compute, nbytes, steps, 5e-5, 50e-6, 25e9)
    for label in compute:
        for i, p in enumerate(p_values):
            cost = library_allreduce(p, nbytes[label], 25e9, latency=50e-6)
            t = (compute[label][p] + cost) / steps[label]
            assert proj.per_step[label][i] == pytest.approx(t)
            assert proj.speedup[label][i] == pytest.approx(5e-5 / t)
    # At P = 1024 and 50 us, SGD pays 10 * 50 us per step; CA-SGD a sixteenth plus bytes.
    assert proj.speedup["ca"][2] > proj.speedup["sgd"][2]


def test_critical_path_takes_the_slowest_rank_per_call_plus_the_charge():
    from optcc_mpi.lab.glm_measure import critical_path_times

    segments = np.array([[1.0, 0.1, 0.5, 0.2], [0.2, 0.3, 0.1, 0.4]])
    costs = [0.01, 0.01, 0.02, 0.02]
    times = critical_path_times(segments, costs, [0, 2, 4])
    assert times == pytest.approx([0.0, 1.0 + 0.3 + 0.02, 1.32 + 0.5 + 0.4 + 0.04])


def test_call_recorder_charges_each_call_and_excludes_evaluations():
    from mpi4py import MPI

    from optcc_mpi.lab.glm_measure import CallRecorder

    rec = CallRecorder(8, 5e-6, 1e9)
    rec.mark({})
    buf = np.ones(250, dtype=np.float32)
    rec(buf, MPI.COMM_SELF)
    rec(buf, MPI.COMM_SELF)
    rec.mark({})
    assert rec.records == [0, 2] and len(rec.segments) == 2
    assert rec.costs == pytest.approx([3 * (5e-6 + 1000 / 1e9)] * 2)
    assert all(s >= 0 for s in rec.segments)
    np.testing.assert_array_equal(buf, 1.0)  # one rank: the sum is the input


@pytest.mark.parametrize("model", ["logistic", "linear", "poisson"])
def test_sklearn_baselines_reach_a_loose_target_for_every_model(model):
    pytest.importorskip("sklearn")
    from optcc_mpi.glm import get_model, make_glm_data
    from optcc_mpi.lab.glm_baselines import sklearn_baselines

    X, y = make_glm_data(model, 512, 6, seed=2, dtype="float64")
    start = float(np.mean(get_model(model).loss(np.zeros(512), y)))  # the loss at w = 0
    rows = sklearn_baselines(model, X, y, 0.0, 0.5, 16, start, 0, max_epochs=5, budget_s=30)
    names = {"logistic": 2, "linear": 1, "poisson": 1}
    assert len(rows) == names[model] and all("error" not in r for r in rows), rows
    for r in rows:
        assert r["time_to_target_s"] is not None and r["final_loss"] <= start, r
