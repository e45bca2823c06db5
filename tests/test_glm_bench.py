"""The emulated network of the GLM trainer and the benchmark's projection (serial).

Nothing here reads a wall clock: the pacer runs on a fake clock whose sleeps overshoot
by a known amount, and the tests assert on what the pacer charged and slept.
"""

from __future__ import annotations

import ast
import inspect
import math

import numpy as np
import pytest

from optcc_mpi.errors import ArgumentError
from optcc_mpi.glm import comm as glm_comm
from optcc_mpi.glm.comm import NetworkPacer, allreduce_cost, allreduce_path


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


@pytest.mark.parametrize(
    "p, rounds", [(2, 1), (4, 2), (8, 3), (1024, 10), (3, 3), (6, 4), (1000, 11)]
)
def test_recursive_doubling_path_counts_whole_payload_messages(p, rounds):
    messages, each = allreduce_path(p, 4096, "recursive-doubling")
    assert (messages, each) == (rounds, 4096.0)
    alpha, beta = 50e-6, 25e9
    assert allreduce_cost(p, 4096, alpha, beta) == pytest.approx(rounds * (alpha + 4096 / beta))


def test_ring_path_sends_two_p_minus_one_slices():
    messages, each = allreduce_path(8, 4096, "ring")
    assert (messages, each) == (14, 512.0)
    assert allreduce_cost(8, 4096, 5e-6, 1e9, "ring") == pytest.approx(14 * (5e-6 + 512 / 1e9))


def test_cost_without_bandwidth_and_on_one_rank():
    assert allreduce_cost(8, 10**9, 5e-6, None) == pytest.approx(3 * 5e-6)
    assert allreduce_cost(1, 10**9, 5e-6, 1e9) == 0.0


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 8, 1e-6, 1e9), "ranks must be >= 1"),
        ((8, -1, 1e-6, 1e9), "payload must be >= 0"),
        ((8, 8, -1e-6, 1e9), "latency must be"),
        ((8, 8, 1e-6, math.inf), "bandwidth must be"),
        ((8, 8, 1e-6, 1e9, "tree"), "unknown AllReduce critical path 'tree'"),
    ],
)
def test_cost_rejects_bad_arguments(args, message):
    with pytest.raises(ArgumentError, match=message):
        allreduce_cost(*args)


def test_pacer_charges_alpha_plus_bytes_over_beta_per_message():
    clock = FakeClock()
    pacer = NetworkPacer(8, 50e-6, 25e9, sleep=clock.sleep, clock=clock)
    sizes = [128, 524288, 128, 4]
    for nbytes in sizes:
        t0 = clock()
        clock.advance(1e-6)  # the real reduction
        charged = pacer.finish(t0, nbytes)
        assert charged == pytest.approx(3 * (50e-6 + nbytes / 25e9))
        assert clock() == pytest.approx(t0 + charged)  # no overshoot: exactly on the deadline
    assert pacer.calls == 4 and pacer.messages == 12
    assert pacer.wire_bytes == 3 * sum(sizes)
    assert pacer.charged_s == pytest.approx(sum(3 * (50e-6 + n / 25e9) for n in sizes))
    # The real reduction's microsecond counted towards each charge.
    assert pacer.slept_s == pytest.approx(pacer.charged_s - 4e-6)
    assert pacer.overrun_s == 0.0
    st = pacer.stats()
    assert st["net_charged_s"] == pacer.charged_s and st["net_messages"] == 12


def test_pacer_repays_sleep_overshoot_at_the_next_deadline():
    overshoot = 80e-6
    clock = FakeClock(overshoot)
    pacer = NetworkPacer(4, 100e-6, None, sleep=clock.sleep, clock=clock)
    start = clock()
    n = 50
    for _ in range(n):
        clock.advance(30e-6)  # compute between AllReduces
        pacer.finish(clock(), 8)
    cost = 2 * 100e-6
    # Deadline scheduling: after the first call each sleep is shortened by the overshoot
    # owed, so the total is n * (compute + cost) plus one overshoot, not n overshoots.
    assert clock.requests[0] == pytest.approx(cost)
    assert all(r == pytest.approx(cost - overshoot) for r in clock.requests[1:])
    assert clock() - start == pytest.approx(n * (30e-6 + cost) + overshoot)
    assert pacer.charged_s == pytest.approx(n * cost)
    assert pacer.overshoot_s == pytest.approx(n * overshoot)
    assert pacer.debt_s == pytest.approx(overshoot)


def test_pacer_records_overrun_and_does_not_sleep_when_the_reduction_was_slow():
    clock = FakeClock()
    pacer = NetworkPacer(2, 10e-6, None, sleep=clock.sleep, clock=clock)
    t0 = clock()
    clock.advance(25e-6)
    assert pacer.finish(t0, 8) == pytest.approx(10e-6)
    assert clock.requests == [] and pacer.sleeps == 0
    assert pacer.overrun_s == pytest.approx(15e-6)


def test_pacer_sleeps_through_time_sleep_and_never_spins(monkeypatch):
    calls: list[float] = []
    monkeypatch.setattr(glm_comm.time, "sleep", calls.append)
    pacer = NetworkPacer(8, 1e-3, None)
    t0 = pacer.now()
    pacer.finish(t0, 8)
    # One sleep, for (almost all of) the 3 ms charged; the patched sleep returns at once
    # and the pacer does not loop on the clock to make up the difference.
    assert len(calls) == 1 and 2.5e-3 < calls[0] <= 3e-3
    assert pacer.now() - t0 < 2.5e-3
    # No loop at all in the pacing code: a spin would need one.
    for fn in (NetworkPacer.finish, glm_comm.Reducer.__call__):
        tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(fn)))
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.While | ast.For)]
    assert not hasattr(glm_comm, "_pause")


def test_reducer_paces_mpi_allreduce_on_one_rank_without_charge():
    from mpi4py import MPI

    red = glm_comm.Reducer(MPI.COMM_SELF, "mpi", emulate="latency=50us,bw=25GB/s")
    assert red.pacer is not None and red.pacer.bw == 25e9
    buf = np.arange(4, dtype=np.float32)
    red(buf)
    st = red.stats()
    assert st["net_calls"] == 1 and st["net_charged_s"] == 0.0 and st["net_sleeps"] == 0
    np.testing.assert_array_equal(buf, np.arange(4, dtype=np.float32))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_reducer_charges_the_formula_under_mpi():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p = comm.size
    red = glm_comm.Reducer(comm, "mpi", emulate="latency=20us,bw=1GB/s")
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
    messages, _ = allreduce_path(p, 1, "recursive-doubling")
    expected = sum(messages * (20e-6 + 4 * n / 1e9) for n in sizes)
    assert st["net_charged_s"] == pytest.approx(expected)
    assert st["net_messages"] == 3 * messages and st["net_sleeps"] <= 3
    assert st["net_wire_bytes"] == messages * 4 * sum(sizes)


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
            rounds = {8: 3, 16: 4, 1024: 10}[p]
            t = (compute[label][p] + rounds * (50e-6 + nbytes[label] / 25e9)) / steps[label]
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
