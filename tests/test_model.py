"""The fluid model and the lower bound against the oracles of the OptCC notes."""

from __future__ import annotations

import numpy as np
import pytest

from optcc_mpi import algorithms, model
from optcc_mpi.algorithms import optcc as optcc_alg
from optcc_mpi.algorithms import r2ccl as r2ccl_alg
from optcc_mpi.algorithms import ring as ring_alg

N, B = 1.0, 1.0


def ff(p: int) -> float:
    return model.fault_free(p, N, B)


def test_fault_free() -> None:
    assert model.fault_free(8, 256, 1) == pytest.approx(2 * 7 / 8 * 256)
    assert model.fault_free(1, 256, 1) == 0.0


def test_bound_oracles() -> None:
    # p = 5, l = 2: 1.25 x fault-free (the straggler's link).
    assert model.lower_bound(5, N, B, "0:0.5") / ff(5) == pytest.approx(1.25)
    # At l = 1 the bound is the fault-free optimum.
    assert model.lower_bound(8, N, B, "") == pytest.approx(ff(8))
    # The table of ratios (X = bandwidth lost).
    table = {
        5: [1.0256, 1.0526, 1.0811, 1.2500],
        8: [1.0159, 1.0323, 1.0492, 1.1429],
        16: [1.0079, 1.0159, 1.0240, 1.0667],
        32: [1.0039, 1.0079, 1.0119, 1.0323],
        64: [1.0020, 1.0039, 1.0059, 1.0159],
    }
    for p, row in table.items():
        for x, want in zip((1 / 8, 1 / 4, 3 / 8, 1 / 2), row):
            got = model.lower_bound(p, N, B, {0: 1 - x}) / ff(p)
            assert got == pytest.approx(want, abs=1e-4), (p, x)
    # At X = 1/2 the overhead is exactly 1/(p-1).
    for p in (5, 8, 16, 100):
        assert model.lower_bound(p, N, B, "0:0.5") / ff(p) == pytest.approx(1 + 1 / (p - 1))


def test_l_star() -> None:
    assert optcc_alg.l_star(5) == pytest.approx(1.75)
    assert optcc_alg.l_star(8) == pytest.approx(13 / 7)
    assert optcc_alg.l_star(16) == pytest.approx(29 / 15)


def test_pure_four_stage() -> None:
    # p = 5, l = 1: 1.75 n/B = 1.09375 x fault-free.
    assert 1.75 / ff(5) == pytest.approx(1.09375)
    # Beyond l* the straggler owns nothing (it is attached) and the others share equally:
    # the four-stage schedule, time max(l, (2p-3)/(p-1)).
    plan = optcc_alg.optcc_plan(8, "0:0.5")
    assert plan.attached == (0,)
    np.testing.assert_allclose(plan.weights[1:], 1 / 7)
    assert plan.time == pytest.approx(2.0)
    # Four-stage traffic per byte: n each way for the straggler, (2p-3)/(p-1) n for the
    # others (oracle 3 of the notes).
    np.testing.assert_allclose(plan.loads(), [1.0] + [13 / 7] * 7)


def bubble_fraction(p: int, l: float) -> float:
    """Share of the data the notes' bubble-filling split sends through a full ring, one
    straggler at rate B/l (derived): ``alpha = p[(2p-3) - l(p-1)] / [(p-2)(l(p-1) + 1)]``
    for ``1 <= l <= l*``; 0 beyond ``l*`` and 1 at ``l = 1``. An oracle the plan is held
    to: it gives the straggler the share ``alpha / p`` of every segment, which moves the
    same bytes."""
    if p < 3 or l >= optcc_alg.l_star(p):
        return 0.0
    return p * ((2 * p - 3) - l * (p - 1)) / ((p - 2) * (l * (p - 1) + 1))


def test_bubble_fraction_and_plan() -> None:
    """alpha(8, l) from the notes; the plan gives the straggler the share alpha / p of
    every segment (the same per-rank loads as sending alpha of the data round a full
    ring), and its time is the bound."""
    for l_, alpha in (
        (1.0, 1.0),
        (8 / 7, 20 / 27),
        (4 / 3, 44 / 93),
        (8 / 5, 12 / 61),
        (13 / 7, 0.0),
    ):
        assert bubble_fraction(8, l_) == pytest.approx(alpha, abs=1e-12)
        plan = optcc_alg.optcc_plan(8, {0: 1 / l_})
        assert plan.weights[0] * 8 == pytest.approx(alpha, abs=1e-9)
        # the bubble-filling split's straggler load: 1 + alpha (p-2)/p
        assert plan.loads()[0] == pytest.approx(1 + alpha * 6 / 8, abs=1e-9)
        bound = 2 * 7 * l_ / (7 * l_ + 1) if l_ < 13 / 7 else max(l_, 13 / 7)
        assert plan.time == pytest.approx(bound, rel=1e-6)


@pytest.mark.parametrize("profile", ["0:0.5,3:0.5", "0:0.5,3:0.75", "0:0.3", "1:0.9,2:0.6"])
def test_plan_never_below_bound_and_never_above_ring(profile: str) -> None:
    for p in (4, 8, 16):
        t = optcc_alg.optcc_time(p, N, B, profile)
        assert t >= model.lower_bound(p, N, B, profile) * (1 - 1e-9)
        assert t <= ring_alg.ring_time(p, N, B, profile) * (1 + 1e-9)


def test_plan_meets_bound_for_equal_stragglers() -> None:
    # Two ranks at half rate: attaching both reaches the bound exactly.
    assert optcc_alg.optcc_time(8, N, B, "0:0.5,3:0.5") == pytest.approx(
        model.lower_bound(8, N, B, "0:0.5,3:0.5")
    )


@pytest.mark.parametrize("seed", range(6))
def test_any_vector_plan_meets_the_bound(seed: int) -> None:
    """The shares' loads 1 + (p-2) w fit every rank's bandwidth in the bound's time and
    move exactly the combining minimum 2(p-1): the bound is always reached (derived)."""
    rng = np.random.default_rng(seed)
    for p in (3, 5, 12, 33, 100):
        f = rng.uniform(rng.uniform(0.05, 0.9), 1.0, p)
        # Odd seeds: no rank at the healthy rate (the plan must not assume one is).
        links = {i: float(v if seed % 2 else v / f.max()) for i, v in enumerate(f)}
        f = model.fractions(links, p)
        bound = model.lower_bound(p, N, B, links)
        t = bound * B / N
        # The water-filled shares with nobody attached by choice meet the bound exactly.
        w = optcc_alg._shares(f, t, np.zeros(p, dtype=bool))
        full = 1 + (p - 2) * w if p > 2 else np.ones(p)
        assert full.sum() == pytest.approx(2 * (p - 1))
        assert np.all(full <= t * f * (1 + 1e-9))
        # The plan may attach ranks whose share is tiny, at most ATTACH_TOL above it.
        plan = optcc_alg.optcc_plan(p, links)
        assert sum(plan.weights) == pytest.approx(1.0)
        assert min(plan.weights) >= 0
        assert bound * (1 - 1e-9) <= plan.time * N / B <= bound * (1 + optcc_alg.ATTACH_TOL)
        loads = plan.loads()
        assert loads.sum() == pytest.approx(2 * (p - 1))
        assert np.all(loads <= plan.time * f * (1 + 1e-9))
        # attached ranks: those the cut bound pins at one unit each way, or tiny shares
        for r in plan.attached:
            pinned = t * f[r] == pytest.approx(1.0, abs=1e-6)
            assert pinned or w[r] <= optcc_alg.TINY_SHARE * w.max()


@pytest.mark.parametrize(
    ("p", "profile"),
    [
        (256, "0:0.875"),
        (512, "0:0.625"),
        (1024, "0:0.75"),
        (1024, "0-7:0.75"),
        (512, "0-7:0.5,256-263:0.875"),
        (512, "random"),
        (1024, "random"),
    ],
)
def test_grid_plan_fits_a_square_grid(p: int, profile: str) -> None:
    """Beyond DIRECT_OWNERS owners the plan suits a grid of several rows (a single row of
    p owners would allow only a few segments), within GRID_TOL of the bound, and every
    load still fits its rank's rate and the loads sum to the combining minimum."""
    if profile == "random":
        rng = np.random.default_rng(p)
        links = {r: float(v) for r, v in enumerate(rng.uniform(0.4, 1.0, p))}
    else:
        links = profile
    f = model.fractions(links, p)
    bound = model.lower_bound(p, N, B, links) * B / N
    plan = optcc_alg.optcc_plan(p, links)
    a, b = optcc_alg._grid_shape(plan, "auto")
    assert a * b == len(plan.owners) and min(a, b) >= 4
    assert bound * (1 - 1e-9) <= plan.time <= bound * (1 + optcc_alg.GRID_TOL)
    loads = plan.loads()
    assert loads.sum() == pytest.approx(2 * (p - 1))
    assert np.all(loads <= plan.time * f * (1 + 1e-9))
    # Owners of one column have equal shares: every share level fills whole columns.
    counts = np.unique(np.round([plan.weights[r] for r in plan.owners], 9), return_counts=True)
    assert np.all(counts[1] % a == 0)


@pytest.mark.parametrize(
    "p, lo, column", [(1024, 0.1, True), (512, 0.1, True), (1024, 0.5, False), (256, 0.1, False)]
)
def test_column_fold_where_it_buys_segments(p: int, lo: float, column: bool) -> None:
    """Many attached ranks among a grid's owners fold one block per column when that at
    least doubles the segments the operation budget allows, and never otherwise (a
    degraded server or few attached ranks keep a section into every owner)."""
    links = {r: float(v) for r, v in enumerate(np.random.default_rng(4).uniform(lo, 1.0, p))}
    plan = optcc_alg.optcc_plan(p, links)
    a, b = optcc_alg._grid_shape(plan, "auto")
    m = len(plan.attached)
    assert optcc_alg.column_fold(a, "fold", m, b) is column
    per_owner = optcc_alg._ops_per_segment(p, a, b, m, "closer")  # a section per owner
    chosen = optcc_alg._ops_per_segment(p, a, b, m)
    k_owner = optcc_alg.MAX_AUTO_OPS // per_owner
    if column:
        assert min(128, optcc_alg.MAX_AUTO_OPS // chosen) >= 2 * k_owner and m > a
    else:
        assert chosen == per_owner
    for server in ("0-7:0.5", "0:0.625"):
        plan = optcc_alg.optcc_plan(p, server)
        a, b = optcc_alg._grid_shape(plan, "auto")
        assert not optcc_alg.column_fold(a, "fold", len(plan.attached), b)


def test_plan_explained() -> None:
    text = optcc_alg.explain_plan(16, "0-7:0.5")
    assert "0-7" in text and "8-15" in text and "grid" in text
    assert "attached" in optcc_alg.explain_plan(16, "3:0.5")


def test_ring_and_r2ccl_oracles() -> None:
    assert ring_alg.ring_time(8, N, B, "0:0.5") / ff(8) == pytest.approx(2.0)
    # R2CCL: p = 8, 50% loss: 1.5714 (K -> infinity), 1.7143 (K = 4).
    assert r2ccl_alg.r2ccl_time(8, N, B, "0:0.5") / ff(8) == pytest.approx(1.5714, abs=1e-4)
    assert r2ccl_alg.r2ccl_time(8, N, B, "0:0.5", chunks=4) / ff(8) == pytest.approx(
        1.7143, abs=1e-4
    )
    # p = 6, X = 1/3: the repository's K sweep.
    for k, want in ((1, 1.6), (2, 1.45), (4, 1.375), (8, 1.3375), (16, 1.31875)):
        got = r2ccl_alg.r2ccl_time(6, N, B, {0: 2 / 3}, chunks=k) / ff(6)
        assert got == pytest.approx(want, abs=1e-9)
    assert r2ccl_alg.r2ccl_time(6, N, B, {0: 2 / 3}) / ff(6) == pytest.approx(1.30)


def test_table_json_shape() -> None:
    t = algorithms.table(8, 256 * 2**20, 25e9, "0:0.5")
    assert {"p", "size", "fault_free_s", "bound_s", "algorithms"} <= set(t)
    for name in ("ring", "r2ccl", "optcc"):
        assert {"time_s", "ratio_fault_free"} <= set(t["algorithms"][name])
    assert t["algorithms"]["optcc"]["ratio_bound"] == pytest.approx(1.0)
