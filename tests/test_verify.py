"""The symbolic verifier: every algorithm passes for p = 2..64; broken schedules fail."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from optcc_mpi import algorithms
from optcc_mpi.algorithms import optcc as optcc_alg
from optcc_mpi.algorithms import r2ccl as r2ccl_alg
from optcc_mpi.links import Links
from optcc_mpi.schedule import ScheduleBuilder
from optcc_mpi.verify import VerificationError, verify

#: Every p to 17, then the powers of two and their neighbours; the largest counts, which
#: take most of the file's time, run in ``make test-all`` (``slow``).
P_ALL = [*range(2, 18), 24, 32, 33] + [
    pytest.param(p, marks=pytest.mark.slow) for p in (31, 47, 63, 64)
]


def profiles(p: int) -> list[str]:
    out = ["", f"{p - 1}:0.5", "0:0.9"]
    if p >= 3:
        out += [f"0:0.5,{p // 2}:0.5", f"1:0.6,{p - 1}:0.8"]
    if p >= 4:
        # a degraded "server" (the lower half), two servers, a rank that the cut bound
        # attaches with others that still own shares, and a random vector
        out += [f"0-{p // 2 - 1}:0.5", f"0-{p // 4}:0.5,{p // 2}-{p - 1}:0.75", "0:0.05"]
        rng = np.random.default_rng(p)
        out.append(",".join(f"{i}:{v:.3f}" for i, v in enumerate(rng.uniform(0.3, 1, p))))
    return out


@pytest.mark.parametrize("p", P_ALL)
def test_ring_and_native(p: int) -> None:
    for count in (0, 1, p - 1, p + 1, 7 * p + 3):
        verify(algorithms.build("ring", p, count, chunk_bytes=8))
        verify(algorithms.build("native", p, count))


@pytest.mark.parametrize("p", P_ALL)
def test_optcc(p: int) -> None:
    big = p >= 24
    for links in profiles(p)[:: 3 if big else 1]:
        for k in (1, 4) if big else (1, 5):
            for pattern in ("fold",) if big else ("fold", "closer"):
                count = 3 * k * p + 5
                verify(algorithms.build("optcc", p, count, links, k=k, pattern=pattern))
    # count < p: most sections empty
    verify(algorithms.build("optcc", p, p - 1, f"{p - 1}:0.5", k=3))


@pytest.mark.parametrize(("p", "links"), [(6, ""), (9, "0:0.5"), (12, "0-5:0.5"), (16, "0-7:0.5")])
def test_optcc_grids(p: int, links: str) -> None:
    """Every grid the plan allows (rows of owners with equal shares), both patterns."""
    plan = optcc_alg.optcc_plan(p, links)
    h = len(plan.owners)
    rows = [a for a in range(1, h + 1) if h % a == 0]
    tried = 0
    for a in rows:
        try:
            optcc_alg._grid_shape(plan, a)
        except ValueError:
            continue
        tried += 1
        for pattern in ("fold", "closer"):
            for k in (1, 3):
                sched = algorithms.build(
                    "optcc", p, 4 * k * p + 3, links, k=k, grid=a, pattern=pattern
                )
                assert sched.params["grid"] == (a, h // a)
                verify(sched)
    assert tried >= 2
    with pytest.raises(ValueError, match="grid rows"):
        algorithms.build("optcc", p, 100, links, grid=h + 1)


def test_optcc_large_grid() -> None:
    """A two-dimensional grid chosen automatically (more owners than DIRECT_OWNERS)."""
    p = optcc_alg.DIRECT_OWNERS + 2  # 129 owners and one attached rank
    sched = algorithms.build("optcc", p, 5 * p, f"{p - 1}:0.5", k=2)
    a, b = sched.params["grid"]
    assert a > 1 and b > 1 and a * b == p - 1
    verify(sched)


@contextmanager
def _small_grids(monkeypatch: pytest.MonkeyPatch, budget: int) -> Iterator[None]:
    """Owners' grids at small p: the direct-exchange limit lowered to 6 owners and the
    operation budget to ``budget``; the cached plans cleared on the way in and out."""
    monkeypatch.setattr(optcc_alg, "DIRECT_OWNERS", 6)
    monkeypatch.setattr(optcc_alg, "MAX_AUTO_OPS", budget)
    optcc_alg._optcc_plan_cached.cache_clear()
    try:
        yield
    finally:
        optcc_alg._optcc_plan_cached.cache_clear()


@pytest.mark.parametrize(
    ("p", "links"),
    [
        (22, "0:0.8"),
        (26, "0-3:0.75"),
        (24, ",".join(f"{r}:{0.5 + 0.5 * ((r * 7) % 24) / 24:.4f}" for r in range(24))),
    ],
    ids=["one-rank", "server", "many-rates"],
)
def test_optcc_grid_plans(monkeypatch: pytest.MonkeyPatch, p: int, links: str) -> None:
    """The plans chosen for a grid (``_grid_plan``: slow owners attached, owners grouped
    by rate, fast owners attached for a squarer grid) make correct schedules; exercised at
    small p by lowering the direct-exchange limit and the operation budget."""
    with _small_grids(monkeypatch, budget=4000):
        sched = algorithms.build("optcc", p, 7 * p + 3, links, k=3)
        a, b = sched.params["grid"]
        assert a > 1 and b > 1
        verify(sched)


@pytest.mark.parametrize("p, links", [(28, "0-15:0.1"), (32, "0-19:0.1,25:0.5"), (27, "0-14:0.08")])
def test_optcc_column_fold(monkeypatch: pytest.MonkeyPatch, p: int, links: str) -> None:
    """Attached ranks folding whole column blocks into one owner per column (chosen where
    it at least doubles the segments the operation budget allows), at small p by lowering
    the direct-exchange limit and the budget; segments beyond the scratch slots."""
    with _small_grids(monkeypatch, budget=20_000):
        sched = algorithms.build("optcc", p, 11 * p + 3, links, k=12)
        a, b = sched.params["grid"]
        assert a > 1 and sched.params["fold"] == "column", sched.params
        verify(sched)
        # The budget that chose it also sizes the schedule: fewer operations per segment
        # than with a section into every owner.
        m = p - a * b
        assert m > a  # several attached ranks per owner of a column
        assert sched.n_ops <= 12 * optcc_alg._ops_per_segment(p, a, b, m) + 1
        assert optcc_alg._ops_per_segment(p, a, b, m) < optcc_alg._ops_per_segment(
            p, a, b, m, "closer"
        )


@pytest.mark.parametrize("p", P_ALL)
def test_r2ccl(p: int) -> None:
    for links in profiles(p)[:: 3 if p >= 24 else 1]:
        for chunks in (1, 4):
            verify(algorithms.build("r2ccl", p, 9 * p + 7, links, chunks=chunks, itemsize=4))
    for schedule in (0, 1, 2):  # each overlap schedule (the default, above, picks 1 or 2)
        verify(algorithms.build("r2ccl", p, 1000, f"0-{max(0, p // 2 - 1)}:0.5", schedule=schedule))
    with pytest.raises(ValueError, match="schedule"):
        algorithms.build("r2ccl", p, 1000, "0:0.5", schedule=3)


@pytest.mark.parametrize("p", [3, 5, 9, 17])
def test_r2ccl_rounds(p: int) -> None:
    """The finished tail goes round the healthy ring in RING_ROUNDS * fmin rounds or more
    (several chunks per helper; the reduce-scatter moves each helper's section in fewer
    messages than it has chunks)."""
    for links in ("0:0.25", f"0-{max(0, p // 2 - 1)}:0.5", "1:0.9"):
        sched = algorithms.build("r2ccl", p, 40 * p + 3, links, chunks=1)
        assert sched.params["broadcast"] == "ring"
        assert sched.params["rounds"] >= r2ccl_alg.RING_ROUNDS * Links.parse(links).vector(p).min()
        verify(sched)


@pytest.mark.parametrize("p", [9, 17])
@pytest.mark.parametrize("links", ["1:0.9", "0:0.875"])
def test_r2ccl_trees(p: int, links: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Binomial trees where the operation budget allows fewer than half the rounds."""
    monkeypatch.setattr(r2ccl_alg, "MAX_AUTO_OPS", 1)
    sched = r2ccl_alg.r2ccl(p, 40 * p + 3, Links.parse(links), chunks=1)
    assert sched.params["broadcast"] == "trees"
    verify(sched)


def test_catches_deadlock() -> None:
    b = ScheduleBuilder(2, 4, "dl")
    r0 = b.recv(0, 1, 0, 4)
    r1 = b.recv(1, 0, 0, 4, reduce=True)
    b.send(0, 1, 0, 4, deps=r0)
    b.send(1, 0, 0, 4, deps=r1)
    with pytest.raises(VerificationError, match="deadlock"):
        verify(b.build())


def test_catches_race() -> None:
    b = ScheduleBuilder(2, 4, "race")
    b.transfer(0, 1, 0, 4, reduce=True)
    b.transfer(1, 0, 0, 4)  # overwrites rank 0's buffer while its send may be in flight
    with pytest.raises(VerificationError, match="race on rank 0"):
        verify(b.build())


def test_catches_double_count_and_missing() -> None:
    b = ScheduleBuilder(3, 4, "twice")
    _, r = b.transfer(0, 1, 0, 4, reduce=True)
    _, r2 = b.transfer(1, 2, 0, 4, reduce=True, send_deps=r)
    b.transfer(0, 2, 0, 4, reduce=True, recv_deps=r2)
    with pytest.raises(VerificationError, match="count a contribution twice"):
        verify(b.build())
    rep = verify(b.build(), raise_on_error=False)
    assert any("ends without the contributions" in e for e in rep.errors)


def test_catches_dropped_dependency() -> None:
    """Removing the hazard dependency of the ring's all-gather is caught."""
    good = algorithms.build("ring", 4, 40)
    assert verify(good).ok
    b = ScheduleBuilder(4, 40, "bad-ring")
    import numpy as np

    from optcc_mpi.algorithms.ring import all_gather, reduce_scatter

    m = np.arange(4)
    sec = np.array([0, 10, 20, 30, 40])
    clo, chi = sec[:-1, None], sec[1:, None]
    sends, final = reduce_scatter(b, m, clo, chi, chan=0)
    all_gather(
        b, m, clo, chi, chan=0, first_deps=final, rs_sends=[np.full_like(s, -1) for s in sends]
    )
    with pytest.raises(VerificationError, match="race"):
        verify(b.build())
