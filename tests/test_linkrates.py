"""The one estimator of a rank's rate from timed messages (optcc_mpi.linkrates), shared by
the watch's traffic, the watch's probe (``probe_ranks``) and ``links="probe"`` (issue 44).

The watch sees one call's messages as one group (messages in flight together share a NIC:
bytes over the union of their intervals); the probe sees rounds of one message each way per
rank (the fastest). For one round both must give every rank the same fraction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from optcc_mpi import linkrates, probe
from optcc_mpi.links import Links
from optcc_mpi.schedule import ScheduleBuilder
from optcc_mpi.watch import LinkWatch, MessageLayout

MB = 1 << 20


def _round(p: int, size: int, shift: int, f: np.ndarray, rng: np.random.Generator | None):
    """One round of a shift (rank r sends ``size`` bytes to r + shift, all posted at the
    same instant) on NICs at fractions ``f`` of 50 MB/s, with up to 5% noise that only
    slows a message: each message's microseconds, indexed by its sender."""
    bw = 50e6
    dst = (np.arange(p) + shift) % p
    secs = size / (bw * np.minimum(f, f[dst]))
    if rng is not None:
        secs = secs * rng.uniform(1.0, 1.05, p)
    return np.round(secs * 1e6)  # (the watch's values are whole microseconds)


def _watch_and_probe(p: int, size: int, shift: int, us: np.ndarray):
    """The same timed messages (``us``: per sender, its message's microseconds) through the
    watch's path (its layout's values, its rates, its estimate) and the probe's (its
    records, :func:`optcc_mpi.probe.rank_fractions`)."""
    b = ScheduleBuilder(p, size, f"shift{shift}")
    r = np.arange(p)
    b.transfer(r, (r + shift) % p, 0, size)
    lay = MessageLayout(b.build(), 1, 10_000)
    assert lay.ids.size == p and lay.width == 3  # one message each way per rank
    # Rank r's values: its send's post time, then its receive's (post, done), from an
    # instant every rank shares (the end of the check; here, of the probe's barrier).
    rows = np.zeros((p, 3), dtype=np.int64)
    src = (r - shift) % p
    rows[:, 2] = us[src]
    v = lay.rates(rows)
    watched = LinkWatch(p).estimate(v)
    records = [[(0, int(src[q]), q, float(us[src[q]]) * 1e-6)] for q in range(p)]
    found = probe.rank_fractions(records, size, p)
    return watched, found


def _judged(frac: np.ndarray, healthy_above: float = linkrates.HEALTHY_ABOVE) -> Links:
    """Fractions as the watch's estimate states them (healthy at or above the cut,
    two places, at least 0.01)."""
    frac = np.where(frac >= healthy_above, 1.0, np.maximum(np.round(frac, 2), 0.01))
    return Links({q: float(x) for q, x in enumerate(frac) if x < 1.0})


def test_watch_and_probe_rate_a_rank_alike_in_a_ring() -> None:
    """The neighbours of a slow rank: one direction slow (to or from it), the other fast.
    Both paths rate them healthy and the slow ranks at their fractions; the estimator that
    took the slower direction would blame the neighbours (ranks 1, 3, 5 and 7 at 0.5 and
    0.4) in the probe's path and not in the watch's."""
    p, size = 8, 4 * MB
    f = Links({2: 0.5, 6: 0.4}).vector(p)
    watched, (named, unresolved, frac, ref) = _watch_and_probe(
        p, size, 1, _round(p, size, 1, f, None)
    )
    assert watched == Links({2: 0.5, 6: 0.4})
    assert _judged(frac) == watched
    np.testing.assert_allclose(frac, f)
    # One round cannot show that ranks 2 and 6 are the slow ends (each partner of theirs
    # was as slow in that direction): the probe names nobody and leaves them unresolved.
    assert named == Links() and unresolved == [2, 6]
    assert ref == pytest.approx(50e6)


@pytest.mark.parametrize("seed", range(12))
def test_watch_and_probe_give_the_same_fractions(seed: int) -> None:
    """Random profiles (fewer than half the ranks slow), shifts and noise: the probe's
    fractions, stated as the watch states them, are the watch's estimate, and every rank
    the probe names is the watch's at the same fraction."""
    rng = np.random.default_rng(seed)
    p = int(rng.integers(4, 13))
    slow = rng.choice(p, size=int(rng.integers(1, (p - 1) // 2 + 1)), replace=False)
    f = np.ones(p)
    f[slow] = rng.uniform(0.2, 0.7, slow.size)
    shift = int(rng.integers(1, p))
    size = 2 * MB
    watched, (named, _unresolved, frac, _ref) = _watch_and_probe(
        p, size, shift, _round(p, size, shift, f, rng)
    )
    assert watched is not None
    assert _judged(frac) == watched, (f.round(2).tolist(), shift)
    assert all(watched.fractions.get(q) == x for q, x in named.fractions.items())


def test_message_rates_busy_time_within_a_group_fastest_over_groups() -> None:
    # Rank 0 sends two overlapping 1 MiB messages in group 0 (busy 2 s: 1 MiB/s) and one
    # in group 1 (0.25 s: 4 MiB/s); a message with no interval counts for nothing.
    sender = np.array([0, 0, 0, 2, 2])
    receiver = np.array([1, 1, 3, 3, 3])
    nbytes = np.full(5, MB)
    lo = np.array([0.0, 0.5, 10.0, 0.0, 1.0])
    hi = np.array([1.0, 2.0, 10.25, math.nan, 1.0])
    group = np.array([0, 0, 1, 0, 0])
    eg, ing = linkrates.message_rates(sender, receiver, nbytes, lo, hi, 4, group)
    assert eg[0] == pytest.approx(4 * MB)
    assert ing[1] == pytest.approx(MB) and ing[3] == pytest.approx(4 * MB)
    assert np.isnan(eg[[1, 2, 3]]).all() and np.isnan(ing[[0, 2]]).all()
    # One group (a call): the union of all three, 2.25 s.
    eg, _ = linkrates.message_rates(sender, receiver, nbytes, lo, hi, 4)
    assert eg[0] == pytest.approx(3 * MB / 2.25)
    # A rank's rate is the faster direction; NaN only where neither was measured.
    rates = linkrates.rank_rates(
        np.array([1.0, math.nan, math.nan]), np.array([2.0, 3.0, math.nan])
    )
    np.testing.assert_array_equal(rates, [2.0, 3.0, math.nan])
    assert linkrates.upper_quartile(np.array([math.nan, 0.0, 1.0, 2.0, 3.0])) == 2.5
    assert linkrates.upper_quartile(np.array([math.nan, 0.0])) is None


def test_bounds_are_message_rates_of_single_messages() -> None:
    pair = {(0, 1): 5.0, (0, 2): 7.0, (2, 1): 9.0, (1, 0): 0.0}
    eg, ing = linkrates.bounds(pair, 4)
    np.testing.assert_array_equal(eg, [7.0, math.nan, 9.0, math.nan])
    np.testing.assert_array_equal(ing, [math.nan, 9.0, 7.0, math.nan])


def test_one_shot_probe_spares_the_rank_before_two_slow_ones() -> None:
    """``links="probe"`` over the minimal transport: ranks 1 and 2 slow; rank 0 sends only
    to them (shifts 1 and 2) and receives only from healthy ranks. Its rate is the faster
    direction, so it is not named (the slower direction named it at about 0.5)."""
    from optcc_mpi.emulation import Emulation
    from optcc_mpi.testing.local import LocalWorld

    p, truth = 6, Links({1: 0.5, 2: 0.5})
    emu = Emulation(bw=20e6, degrade=truth)
    world = LocalWorld(p)
    found = world.run(lambda t: probe.probe(t, nbytes=1 << 20, repeats=2, emulate=emu))
    assert len({str(res.links) for res in found}) == 1
    assert found[0].links.degraded == (1, 2), str(found[0])
