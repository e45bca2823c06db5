"""The simulator against closed forms, and its two engines against each other."""

from __future__ import annotations

import numpy as np
import pytest

from optcc_mpi import algorithms, model, simulate
from optcc_mpi.algorithms import native as native_alg
from optcc_mpi.algorithms import optcc as optcc_alg
from optcc_mpi.algorithms import r2ccl as r2ccl_alg
from optcc_mpi.algorithms import ring as ring_alg

N = 64 * 2**20  # bytes per rank
BW = 25e9


def sim(name: str, p: int, links: str = "", **params: object) -> float:
    s = algorithms.build(name, p, N // 4, links, **params)
    return simulate.simulate(s, links, bw=BW).time


@pytest.mark.parametrize("p", [2, 3, 8, 33])
@pytest.mark.parametrize("links", ["", "0:0.5", "1:0.8,2:0.6"])
def test_ring_matches_closed_form_exactly(p: int, links: str) -> None:
    links = ",".join(x for x in links.split(",") if x and int(x.split(":")[0]) < p)
    got = sim("ring", p, links)
    # exact up to the one-element imbalance of uneven sections
    assert got == pytest.approx(ring_alg.ring_time(p, N, BW, links), rel=1e-5)


@pytest.mark.parametrize(("p", "l"), [(5, 2.0), (8, 2.0), (8, 2.5), (16, 2.0)])
def test_four_stage_pipeline_matches_closed_form(p: int, l: float) -> None:
    """Beyond l* the schedule is the pure four-stage one: between the fluid time and
    (1 + 1/k) x fluid (one segment of head and tail), so within 1% for large k."""
    links = f"0:{1 / l}"
    fluid = optcc_alg.optcc_time(p, N, BW, links)
    for k in (32, 128):
        got = sim("optcc", p, links, k=k)
        assert fluid <= got <= optcc_alg.optcc_time(p, N, BW, links, k=k) * (1 + 1e-3)
    assert got / fluid < 1.01


def test_two_equal_stragglers_near_bound() -> None:
    links = "0:0.5,3:0.5"
    got = sim("optcc", 8, links, k=64)
    bound = model.lower_bound(8, N, BW, links)
    assert bound <= got < 1.10 * bound


@pytest.mark.parametrize(("p", "x"), [(8, 0.125), (8, 0.25), (16, 0.25)])
def test_bubble_filling_regime_is_close_to_bound(p: int, x: float) -> None:
    """l < l*: the measured gap to the fluid bound, recorded in docs/optcc.md."""
    links = f"0:{1 - x}"
    got = sim("optcc", p, links)
    bound = model.lower_bound(p, N, BW, links)
    assert bound <= got < 1.15 * bound
    assert got < r2ccl_alg.r2ccl_time(p, N, BW, links) and got < ring_alg.ring_time(p, N, BW, links)


def test_r2ccl_near_its_model() -> None:
    got = sim("r2ccl", 8, "0:0.5")
    assert got == pytest.approx(r2ccl_alg.r2ccl_time(8, N, BW, "0:0.5"), rel=0.05)


def test_native_is_library_model() -> None:
    got = sim("native", 8, "0:0.5")
    assert got == pytest.approx(native_alg.native_time(8, N, BW, "0:0.5"), rel=1e-9)


def test_ordering_optcc_r2ccl_ring() -> None:
    t = {a: sim(a, 8, "0:0.5") for a in ("optcc", "r2ccl", "ring")}
    assert t["optcc"] < t["r2ccl"] < t["ring"]


def test_latency_adds_per_step() -> None:
    s = algorithms.build("ring", 4, 4000)
    base = simulate.simulate(s, bw=1e9).time
    lat = simulate.simulate(s, bw=1e9, latency=1e-3).time
    # 2(p-1) = 6 dependent steps, each paying the latency once
    assert lat - base == pytest.approx(6e-3, rel=1e-6)


def test_engines_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled event loop is a translation of the Python one: identical traces."""
    if simulate._core() is None:
        pytest.skip("no C compiler: only the Python engine exists")
    cases = [
        ("ring", 8, "0:0.5", {}),
        ("optcc", 7, "0:0.5,3:0.6", {"k": 5}),
        ("optcc", 8, "0:0.75", {"k": 8}),
        ("r2ccl", 6, "0:0.5", {}),
        ("native", 5, "", {}),
    ]
    for name, p, links, params in cases:
        s = algorithms.build(name, p, 100003, links, **params)
        kw = dict(bw=1e9, latency=3e-6, reduce_bw=5e9, trace=True)
        fast = simulate.simulate(s, links, **kw)
        monkeypatch.setenv("OPTCC_SIM", "python")
        slow = simulate.simulate(s, links, **kw)
        monkeypatch.delenv("OPTCC_SIM")
        assert fast.params["engine"] == "c" and slow.params["engine"] == "python"
        assert fast.time == slow.time
        np.testing.assert_array_equal(fast.trace, slow.trace)


def test_deadlock_is_reported() -> None:
    from optcc_mpi.schedule import ScheduleBuilder

    b = ScheduleBuilder(2, 4, "dl")
    r0 = b.recv(0, 1, 0, 4)
    r1 = b.recv(1, 0, 0, 4)
    b.send(0, 1, 0, 4, deps=r0)
    b.send(1, 0, 0, 4, deps=r1)
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate.simulate(b.build(), bw=1e9)


@pytest.mark.slow
def test_ring_at_1024_ranks() -> None:
    """The simulator handles p = 1024 (4 million operations) and stays exact."""
    got = sim("ring", 1024, "0:0.5")
    assert got == pytest.approx(2 * model.fault_free(1024, N, BW), rel=1e-9)
