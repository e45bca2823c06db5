"""``links="watch"``: the estimator and the decision rule (serial; the MPI run is in
tests/test_watch_mpi.py)."""

from __future__ import annotations

import numpy as np
import pytest

from optcc_mpi import algorithms
from optcc_mpi.executor import ExecStats
from optcc_mpi.links import Links
from optcc_mpi.simulate import simulate
from optcc_mpi.watch import _TIME, LinkWatch, MessageLayout, send_rates, watch_length

MB = 1 << 20


def test_send_rates_union_of_busy_intervals() -> None:
    # Two back-to-back 1 MiB sends to peer 1 over 2 s: 1 MiB/s, however they overlap.
    recs = [(1, MB, 0.0, 1.0), (1, MB, 0.5, 2.0), (2, MB, 0.0, 0.25), (3, 100, 0.0, 9.0)]
    r = send_rates(recs, 4)
    assert r[1] == pytest.approx(2 * MB / 2.0)
    assert r[2] == pytest.approx(4 * MB)
    assert r[3] == 0.0 and r[0] == 0.0  # short sends are not timed; no send to self
    # Idle gaps between sends do not count as busy.
    r = send_rates([(1, MB, 0.0, 1.0), (1, MB, 5.0, 6.0)], 2)
    assert r[1] == pytest.approx(MB)


def simulated_call(
    name: str, truth: Links, p: int, plan: Links | None = None, slowdown: float = 1.0
) -> tuple[object, list[ExecStats]]:
    """One call of ``name`` (planned for ``plan``) on NICs at ``truth``: its schedule and
    each rank's side of every message, as the executor would record it, taken from the
    simulator's trace of the schedule (a send is posted when it is ready, a receive at
    the start, and completes when the data is in); every time ``slowdown`` times as
    late (a call that took that much longer or shorter, every message alike)."""
    # Over a network, as the collectives build it (OptCC's sections follow the fabric).
    params = {"fabric": "network"} if "fabric" in algorithms.get(name).params else {}
    count = (16 << 20) // 4
    sched = algorithms.build(name, p, count, plan or Links(), itemsize=4, **params)
    trace = simulate(sched, truth, bw=50 * MB, latency=50e-6, trace=True).trace
    stats = [ExecStats(start=10.0) for _ in range(p)]
    k = slowdown
    for gid, src, dst, nbytes, ready, *_, done in trace:
        gid, src, dst = int(gid), int(src), int(dst)
        mine = int(np.searchsorted(sched.op_ids(src), gid))
        theirs = int(np.searchsorted(sched.op_ids(dst), sched.partner[gid]))
        sent = k * (done - 0.3 * (done - ready))
        stats[src].sends.append((mine, dst, int(nbytes), k * ready, sent))
        stats[dst].recvs.append((theirs, src, int(nbytes), 0.0, k * done))
    return sched, stats


def observations(
    name: str, truth: Links, p: int, plan: Links | None = None
) -> tuple[np.ndarray, LinkWatch]:
    """The gathered contributions after one call of ``name`` (planned for ``plan``) on
    NICs at ``truth`` (:func:`simulated_call`), and rank 0's watch."""
    sched, stats = simulated_call(name, truth, p, plan)
    rows, watches = [], []
    for rank in range(p):
        w = LinkWatch(p)
        w.record_messages(rank, sched, 4, stats[rank], epoch=9.5)
        rows.append(w.contribution())
        watches.append(w)
    return np.array(rows), watches[0]


def estimate_after(name: str, truth: Links, p: int, plan: Links | None = None) -> Links | None:
    """What the watch estimates from one call of ``name`` on links ``truth``."""
    rows, w = observations(name, truth, p, plan)
    return w.estimate(w.observed(rows))


@pytest.mark.parametrize("p", [4, 8, 16])
def test_estimate_finds_the_slow_rank_from_ring_traffic(p: int) -> None:
    # A ring moves every link in lockstep at the slowest one's pace: only pairing each
    # message's two ends shows which link is slow.
    assert estimate_after("ring", Links({3: 0.5}), p) == Links({3: 0.5})
    assert estimate_after("ring", Links(), p) == Links()


def test_estimate_finds_a_degraded_server() -> None:
    # Half the ranks slow: the reference must still be a healthy rank.
    server = Links({r: 0.5 for r in range(8)})
    assert estimate_after("ring", server, 16) == server


@pytest.mark.parametrize("name", ["optcc", "r2ccl"])
def test_estimate_is_stable_under_the_plan_for_the_truth(name: str) -> None:
    # Once the plan follows the slow rank, its own traffic must not argue for another.
    truth = Links({3: 0.5})
    est = estimate_after(name, truth, 8, plan=truth)
    assert est is not None and est.degraded == (3,)
    assert abs(est.fractions[3] - 0.5) < 0.2


def test_layout_subsamples_the_same_messages_everywhere() -> None:
    sched = algorithms.build("ring", 8, 64 << 20, Links())
    wide, narrow = MessageLayout(sched, 4, 10_000), MessageLayout(sched, 4, 8)
    assert wide.stride == 1 and narrow.stride > 1
    assert set(narrow.ids) <= set(wide.ids)
    assert int((narrow.sends + 2 * narrow.recvs).max()) <= 8
    assert watch_length(8) * 8 * 8 <= 256 * 1024 and watch_length(1024) == 1027


def ring_rates(fracs: np.ndarray, bw: float = 100 * MB) -> np.ndarray:
    """Per-rank rates a ring on NICs at ``fracs`` shows, as the estimator reduces them."""
    after = np.roll(fracs, -1)
    before = np.roll(fracs, 1)
    return bw * np.maximum(np.minimum(before, fracs), np.minimum(fracs, after))


def test_adoption_needs_confirmation_and_is_deterministic() -> None:
    p = 8
    slow = np.ones(p)
    slow[3] = 0.5
    obs_slow, obs_ok = ring_rates(slow), ring_rates(np.ones(p))
    a, b = LinkWatch(p, confirm=2), LinkWatch(p, confirm=2)
    seq = [obs_ok, obs_ok, obs_slow, obs_ok, obs_slow, obs_slow, obs_slow, obs_ok, obs_ok]
    got = [a.agree(o) for o in seq]
    assert got == [b.agree(o) for o in seq]  # same reduced input, same decisions
    # A single slow call is noise; two in a row switch; two healthy ones switch back.
    assert got[:5] == [Links()] * 5
    assert got[5] == Links({3: 0.5}) and got[6] == Links({3: 0.5})
    assert got[7] == Links({3: 0.5}) and got[8] == Links()
    assert [c for c, _ in a.changes] == [6, 9]


def test_no_observation_keeps_the_profile() -> None:
    w = LinkWatch(4, confirm=1)
    w.profile = Links({1: 0.5})
    assert w.agree(np.zeros(4, dtype=np.int64)) == Links({1: 0.5})
    # Fewer than half of the ranks observed: not enough to judge.
    assert w.agree(np.array([10 * MB, 0, 0, 0])) == Links({1: 0.5})


def test_bad_parameters() -> None:
    with pytest.raises(ValueError, match="threshold"):
        LinkWatch(4, threshold=0)
    with pytest.raises(ValueError, match="confirm"):
        LinkWatch(4, confirm=0)


def test_a_rank_measured_clearly_faster_counts_as_recovered() -> None:
    # Under a plan that spares rank 3 its rate is a lower bound (the testbed showed 0.66
    # for a recovered rank): clearly faster than the profile means healthy, and the ring
    # that follows measures it in full. A small rise is noise and changes nothing.
    p = 8
    w = LinkWatch(p, confirm=2)
    w.profile = Links({3: 0.41})
    faster = np.full(p, 100 * MB)
    faster[3] = 66 * MB
    assert w.agree(faster) == Links({3: 0.41})
    assert w.measured == Links({3: 0.66})
    assert w.agree(faster) == Links()
    w.profile = Links({3: 0.5})
    faster[3] = 60 * MB
    assert [w.agree(faster) for _ in range(3)] == [Links({3: 0.5})] * 3


def test_the_streak_adopts_what_its_calls_agree_on() -> None:
    p = 8
    w = LinkWatch(p, confirm=2)

    def rates(fracs: dict[int, float]) -> np.ndarray:
        v = np.full(p, 100 * MB)
        for r, f in fracs.items():
            v[r] = f * 100 * MB
        return v

    # Rates are lower bounds and noise only slows a rank down: two calls that agree only on
    # rank 3 adopt rank 3 alone, at the larger of its two measurements.
    assert w.agree(rates({1: 0.77, 2: 0.76, 3: 0.43})) == Links()
    assert w.agree(rates({0: 0.78, 3: 0.41, 4: 0.63})) == Links({3: 0.43})
    # Two departures that cancel out (a rank slow once, then another) change nothing.
    assert w.agree(rates({3: 0.43, 5: 0.5})) == Links({3: 0.43})
    assert w.agree(rates({3: 0.43, 6: 0.5})) == Links({3: 0.43})


def test_a_rank_that_measures_faster_climbs_back() -> None:
    # Degraded and still slow: OptCC's plan lets it show a little more than the profile
    # (0.51-0.58 on the testbed for 0.5), which changes nothing ...
    p = 8
    w = LinkWatch(p, confirm=2, explore=0)  # without explorations (next test)
    w.profile = Links({3: 0.5})
    v = np.full(p, 100 * MB)
    for seen in (0.56, 0.58, 0.55, 0.57):
        v[3] = seen * 100 * MB
        assert w.agree(v) == Links({3: 0.5})
    # ... recovered: it measures clearly more; the profile climbs to what two calls agree
    # on, and from there a plan that spares it less shows it healthy.
    got = []
    for seen in (0.66, 0.65, 0.9, 0.85):
        v[3] = seen * 100 * MB
        got.append(w.agree(v))
    assert got == [Links({3: 0.5}), Links({3: 0.66}), Links({3: 0.66}), Links()]


def test_exploration_measures_every_rank_alike() -> None:
    """Under a degraded profile that the calls keep confirming (a plan that loads a rank
    at its believed fraction shows that fraction, recovered or not), every ``explore``-th
    call runs on the healthy profile; a rank that call shows faster is adopted at once,
    and a profile it confirms waits twice as long for the next exploration."""
    p = 8
    w = LinkWatch(p, confirm=2, explore=3, explore_max=6)
    w.profile = Links({3: 0.74})
    v = np.full(p, 100 * MB)
    v[3] = 74 * MB  # what the plan for 0.74 lets it show
    got = [w.agree(v) for _ in range(3)]
    assert got == [Links({3: 0.74})] * 2 + [Links()]  # the third call explores
    # Still slow under the ring: the profile stays, the next exploration 6 calls on.
    v[3] = 50 * MB
    assert w.agree(v) == Links({3: 0.74})  # what the exploration measured: it stays
    v[3] = 74 * MB
    got = [w.agree(v) for _ in range(6)]
    assert got == [Links({3: 0.74})] * 5 + [Links()]
    assert w.changes == []
    # Recovered: the ring shows it in full, adopted on that one measurement; a dip of
    # another rank in the same call is not (it would need calls of its own).
    v[3] = 97 * MB
    v[5] = 60 * MB
    assert w.agree(v) == Links()
    assert w.changes == [(w.calls, Links())]
    v[5] = 100 * MB
    # A healthy profile never explores.
    assert [w.agree(v) for _ in range(10)] == [Links()] * 10
    with pytest.raises(ValueError, match="explore"):
        LinkWatch(4, explore=8, explore_max=4)


def test_busy_time_is_the_union_of_intervals() -> None:
    """The busy time of a side is the length of the union of its messages' intervals:
    against a unit-grid count on random integer intervals (overlapping, nested, empty)."""
    from optcc_mpi.watch import _busy

    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(1, 25))
        lo = rng.integers(0, 200, n)
        hi = lo + rng.integers(0, 40, n)
        grid = np.zeros(260, dtype=bool)
        for a, b in zip(lo, hi):
            grid[a:b] = True
        assert _busy(lo.astype(float), hi.astype(float)) == grid.sum()
    assert _busy(np.array([]), np.array([])) == 0.0


# -- issue 35: the traffic suspects, a probe decides ---------------------------------------


def _fake_probe(found: Links, p: int, calls: list[int]):
    """A stand-in for probe_ranks that finds ``found`` and counts its runs."""
    from optcc_mpi.probe import RankProbe

    def run(*_args: object, **_kw: object) -> RankProbe:
        calls.append(1)
        return RankProbe(found, found.vector(p), [], 1.0, "test", 0.0, [1], 1, 1)

    return run


def test_the_first_exploration_after_a_probe_waits_eight_times_explore(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A profile the probe decided is followed by calls on its own plan, the first
    exploring call (the healthy profile) coming 8 x explore steady calls later (the
    probe has just measured every rank alike), then explore_max apart at most."""
    import optcc_mpi.watch as watch_mod

    p = 4
    truth = Links({1: 0.5})
    monkeypatch.setattr(watch_mod, "probe_ranks", _fake_probe(truth, p, []))
    w = LinkWatch(p, confirm=2, explore=4, explore_max=64)
    seen = ring_rates(truth.vector(p))
    wire = object()
    got = [w.agree(seen, wire) for _ in range(60)]
    assert w.changes == [(2, truth)]
    explored = [i for i, g in enumerate(got) if i > 1 and g == Links()]
    assert explored and explored[0] == 1 + 2 * w.confirm + 8 * w.explore


def test_a_suspicion_is_decided_by_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Far-apart slow ranks in a 4-rank ring: the traffic shows 0.6 as the fastest rate
    (ranks 1 and 3 only exchange with the slow ranks) and blames rank 2 alone at 0.67;
    the probe finds the truth, which is adopted once, and the same suspicion is not
    probed again until the wait (explore calls, doubling) is over."""
    import optcc_mpi.watch as watch_mod

    p = 4
    truth = Links({0: 0.6, 2: 0.4})
    ran: list[int] = []
    monkeypatch.setattr(watch_mod, "probe_ranks", _fake_probe(truth, p, ran))
    w = LinkWatch(p, confirm=2, explore=4, explore_max=16)
    ring = ring_rates(truth.vector(p))
    wire = object()  # only handed to the (fake) probe
    assert w.agree(ring, wire) == Links() and ran == []  # one departing call: noise
    assert w.agree(ring, wire) == truth and len(ran) == 1  # confirmed: probed, adopted
    assert w.changes == [(2, truth)] and "probe found" in (w.why or "")
    # Under the new plan the traffic may repeat its suspicion: what it reads in the calls
    # right after the probe is this plan's reading of the truth, and the watch departs only
    # from that (issue 42: no probe again while nothing changes, the estimate reads the
    # profile).
    noisy = [ring.copy() for _ in range(100)]
    for i, v in enumerate(noisy):
        v[2] *= 1 + 0.03 * (i % 4)  # the same suspicion, not the same numbers
    got, read = [], []
    for v in noisy:
        explored = w._exploring  # (this call reads an exploring call, the healthy plan's)
        got.append(w.agree(v, wire))
        if not explored and w.calls > 2:
            read.append(np.abs(w.measured.vector(p) - truth.vector(p)).max())
    assert all(g in (truth, Links()) for g in got) and w.changes == [(2, truth)]  # (explore)
    # The probe measured every rank as an exploring call does: the first exploration is
    # the 8 x explore-th steady call (at most explore_max: 16 here), after the 2 x confirm
    # calibrating ones.
    first = min(8 * w.explore, w.explore_max)
    assert first > w.explore
    assert got.index(Links()) == 2 * w.confirm + first - 1  # (7 before: explore - 1 + 4)
    assert [(call, adopted) for call, *_, adopted in w.probes] == [(2, True)]
    assert max(read) <= 0.1
    # A real change is still adopted within ten calls: rank 3 slows (the plan's traffic
    # reads it at 0.5), then every link recovers.
    for moved in (Links({0: 0.6, 2: 0.4, 3: 0.3}), Links()):
        monkeypatch.setattr(watch_mod, "probe_ranks", _fake_probe(moved, p, ran))
        start = w.calls
        for _ in range(10):
            w.agree(ring_rates(moved.vector(p)), wire)
        call, adopted = w.changes[-1]
        assert adopted == moved and call - start <= 10, w.changes
    # Healthy traffic never probes.
    h = LinkWatch(p, confirm=2)
    monkeypatch.setattr(watch_mod, "probe_ranks", _fake_probe(Links(), p, ran))
    before = len(ran)
    assert [h.agree(ring_rates(np.ones(p)), wire) for _ in range(8)] == [Links()] * 8
    assert len(ran) == before and h.changes == []


def test_after_a_cleared_probe_no_other_suspicion_is_probed_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Noisy traffic (8 ranks on 2 shared cores on the testbed) blames a different healthy
    rank every other call: after a probe found nothing, those suspicions wait (explore
    calls, at most probe_gap_max), and a real change after that wait is adopted at once."""
    import optcc_mpi.watch as watch_mod

    p = 8
    found = [Links()]
    ran: list[int] = []

    def probe(*_a: object, **_k: object):
        return _fake_probe(found[0], p, ran)()

    monkeypatch.setattr(watch_mod, "probe_ranks", probe)
    # (confirm_max=1: streaks that never grow, so that the quiet wait alone is tested)
    w = LinkWatch(p, confirm=1, confirm_max=1, explore=4, explore_max=64, probe_gap_max=6)
    wire = object()
    healthy = ring_rates(np.ones(p))

    def blaming(r: int) -> np.ndarray:
        v = healthy.copy()
        v[r] *= 0.5
        return v

    assert w.agree(blaming(1), wire) == Links() and len(ran) == 1  # probed: cleared
    # Calls 2-4: other ranks blamed, within the quiet wait (explore = 4 calls): no probe.
    assert [w.agree(blaming(r), wire) for r in (3, 5, 7)] == [Links()] * 3 and len(ran) == 1
    assert w.agree(blaming(2), wire) == Links() and len(ran) == 2  # call 5: probed again
    # The second clearing doubles the wait to 8, bounded here by probe_gap_max = 6: a
    # real change from call 6 on is probed at call 11 and adopted.
    found[0] = Links({4: 0.5})
    got = [w.agree(blaming(4), wire) for _ in range(6)]
    assert got == [Links()] * 5 + [Links({4: 0.5})] and len(ran) == 3
    assert w.changes == [(11, Links({4: 0.5}))]


def test_noisy_timings_need_longer_streaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timings of oversubscribed ranks (8 on 2 cores on the testbed) blame a healthy rank
    for two calls in a row now and then, another each time: each streak the probe finds
    wrong makes the next suspicion need one more departing call (up to confirm_max), so
    such noise stops costing a probe every few calls, and a slow link, which departs
    every call, is still adopted within a few calls of appearing."""
    import optcc_mpi.watch as watch_mod

    p = 8
    found = [Links()]
    ran: list[int] = []
    monkeypatch.setattr(watch_mod, "probe_ranks", lambda *a, **k: _fake_probe(found[0], p, ran)())
    healthy = ring_rates(np.ones(p))
    probes = {}
    for confirm_max in (2, 5):  # (2: the streak never grows)
        found[0], ran[:] = Links(), []
        w = LinkWatch(p, confirm=2, confirm_max=confirm_max, probe_gap_max=4)
        rng = np.random.default_rng(7)
        for call in range(200):
            v = healthy.copy()
            if call % 2 == 0:
                blamed = int(rng.integers(p))
            if rng.random() < 0.6:  # blamed in runs of up to two calls, one rank at a time
                v[blamed] *= 0.45
            assert w.agree(v, object()) == Links()
        probes[confirm_max] = len(ran)
        found[0] = Links({3: 0.5})
        start = w.calls
        for _ in range(8):
            w.agree(ring_rates(found[0].vector(p)), object())
        assert w.changes and w.changes[-1][1] == found[0] and w.changes[-1][0] - start <= 6
    assert probes[5] * 4 <= probes[2], probes  # (22 and 5 here)


def test_on_healthy_links_every_other_call_is_observed_and_a_streak_spans_the_others() -> None:
    """What the watch costs on healthy links: the first call and one call in ``sample``
    run a schedule of ours (the others the library's AllReduce, which times nothing);
    while a departure is being confirmed, and under a degraded profile, every call does.
    A call that observed nothing neither breaks nor extends a streak of departing
    calls."""
    p = 4
    w = LinkWatch(p, confirm=2, sample=3)
    healthy = ring_rates(np.ones(p))
    got = []
    for _ in range(6):
        w.agree(healthy)
        got.append(w.observes())
    assert got == [True, False, False, True, False, False]
    slow = ring_rates(Links({1: 0.5}).vector(p))
    assert w.agree(slow) == Links()  # call 7: one departing call
    assert w.observes()  # (the next call is observed: the streak goes on)
    assert w.agree(np.zeros(p)) == Links()  # call 8: nothing observed after all
    assert w.agree(slow) == Links({1: 0.5})  # call 9: the second, adopted (no probe here)
    assert w.observes() and w.changes == [(9, Links({1: 0.5}))]


def test_on_healthy_links_a_departure_needs_a_slower_call() -> None:
    """On links held healthy a slow link slows the ring's whole call; noise in a
    message's stamps does not. A call whose messages read a slow rank but whose span is
    its schedule's usual one is not a departure (no streak, no probe, nothing adopted);
    once the calls are as slow as that rank would make them, it is."""
    p = 4
    w = LinkWatch(p, confirm=2, sample=1)  # (every call observed)

    def call(truth: Links, slowdown: float = 1.0) -> Links:
        sched, stats = simulated_call("ring", truth, p, slowdown=slowdown)
        rows = []
        for rank in range(p):
            other = LinkWatch(p)
            other.record_messages(rank, sched, 4, stats[rank], epoch=9.5)
            rows.append(other.contribution())
        w.record_messages(0, sched, 4, stats[0], epoch=9.5)
        return w.agree(np.array(rows))

    for _ in range(4):
        assert call(Links()) == Links()
    # Rank 1 read at half its rate by every message, in a call no longer than usual
    # (the slow call's times, each half as late):
    for _ in range(4):
        assert call(Links({1: 0.5}), slowdown=0.5) == Links()
        assert w.measured == Links({1: 0.5})  # (what the traffic read)
    assert w.changes == []
    # The same reading in calls that took twice as long: two of them, adopted.
    assert call(Links({1: 0.5})) == Links()
    assert call(Links({1: 0.5})) == Links({1: 0.5})
    assert w.changes == [(10, Links({1: 0.5}))]


def test_calls_too_short_to_time_are_left_to_the_library_and_not_sampled() -> None:
    """On healthy links a call whose ring messages are under MIN_BYTES shows the watch
    nothing: it is never observed and may ride, and it does not count for the sample,
    so the longer calls between short ones are still observed one in ``sample``."""
    from optcc_mpi.watch import MIN_BYTES

    p = 4
    w = LinkWatch(p, sample=2)
    short, long = p * MIN_BYTES - 4, p * MIN_BYTES
    assert not w.timeable(short) and w.timeable(long)
    observed = []
    for i in range(12):
        size = short if i % 2 else long  # (a pattern the sample would otherwise alias)
        ok = w.timeable(size)
        assert w.quiet(ok) is (not ok or i % 4 != 0)
        w.agree(np.zeros(p), timeable=ok)
        observed.append(w.observes(ok))
    assert observed == [i % 4 == 0 for i in range(12)]
    assert not any(observed[1::2])


def test_a_healthy_rank_named_just_under_the_threshold_is_probed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A probe that names a rank the profile holds healthy at 0.79 (under 0.8 by noise, as
    once on the 8-rank testbed) runs again; a rank is adopted only if both name it, and a
    slow rank well under the threshold needs no second probe."""
    import optcc_mpi.watch as watch_mod

    p = 4
    results = [Links({3: 0.79}), Links()]
    ran: list[int] = []

    def probe(*_a: object, **_k: object):
        found = results[min(len(ran), len(results) - 1)]
        return _fake_probe(found, p, ran)()

    monkeypatch.setattr(watch_mod, "probe_ranks", probe)
    w = LinkWatch(p, confirm=1)
    wire = object()
    slow3 = ring_rates(Links({3: 0.5}).vector(p))
    assert w.agree(slow3, wire) == Links() and len(ran) == 2  # the second probe cleared it
    assert w.changes == []
    # Both name it: adopted, at the larger of the two fractions.
    results[:] = [Links({3: 0.72}), Links({3: 0.76})]
    ran.clear()
    w = LinkWatch(p, confirm=1)
    assert w.agree(slow3, wire) == Links({3: 0.76}) and len(ran) == 2
    # Well under the threshold: one probe.
    results[:] = [Links({3: 0.5})]
    ran.clear()
    w = LinkWatch(p, confirm=1)
    assert w.agree(slow3, wire) == Links({3: 0.5}) and len(ran) == 1
    # A slow rank the traffic now shows recovered, named just under the threshold (over
    # MPI once 0.73 for a healed rank): probed again, and healthy if the second says so.
    results[:] = [Links({3: 0.73}), Links()]
    ran.clear()
    w = LinkWatch(p, confirm=1, profile=Links({3: 0.3}))
    healed = ring_rates(Links().vector(p))
    assert w.agree(healed, wire) == Links() and len(ran) == 2
    assert w.changes == [(1, Links())]


def test_linkrates_tell_far_apart_slow_ranks_from_their_neighbours() -> None:
    """The shared estimator: from a ring's links alone the neighbours of two far-apart
    slow ranks are unresolved (every partner as slow), from the probe's spread shifts
    every rank meets a fast partner and exactly the slow ones are named."""
    from optcc_mpi import linkrates

    p, bw = 8, 100.0
    f = Links({2: 0.6, 5: 0.4}).vector(p)

    def links(shifts: list[int]) -> dict[tuple[int, int], float]:
        return {(r, (r + s) % p): bw * min(f[r], f[(r + s) % p]) for s in shifts for r in range(p)}

    prof, unresolved, _ = linkrates.named(links(linkrates.spread(p, 3)), p, bw, 0.8)
    assert prof == Links({2: 0.6, 5: 0.4}) and unresolved == []
    # Two slow ranks next to each other, at 4 ranks: still told apart.
    p = 4
    f = Links({1: 0.6, 2: 0.4}).vector(p)
    prof, unresolved, _ = linkrates.named(links(linkrates.spread(p, 3)), p, bw, 0.8)
    assert prof == Links({1: 0.6, 2: 0.4}) and unresolved == []
    # A ring's links only, far apart at 4 ranks: ranks 1 and 3 never meet a fast partner.
    f = Links({0: 0.6, 2: 0.4}).vector(p)
    prof, unresolved, _ = linkrates.named(links([1]), p, bw, 0.8)
    assert 1 in unresolved and 3 in unresolved


@pytest.mark.parametrize("p", [2, 4, 8])
def test_probe_ranks_over_the_minimal_transport(p: int) -> None:
    """The watch's probe over a transport of the four required methods only (threads in
    one process): every rank finds the same, and under emulation exactly the truth, two
    slow ranks far apart and one next to them included."""
    from optcc_mpi.emulation import Emulation
    from optcc_mpi.probe import probe_ranks
    from optcc_mpi.testing.local import LocalWorld

    truth = Links({0: 0.6, p // 2: 0.4}) if p > 2 else Links({1: 0.5})
    emu = Emulation(bw=2e9, degrade=truth)
    world = LocalWorld(p)
    found = world.run(lambda t: probe_ranks(t, nbytes=1 << 16, emulate=emu))
    assert len({str(f.links) for f in found}) == 1
    if p > 2:
        assert found[0].links == truth and found[0].unresolved == []
    else:  # two ranks: one link, whose slow end no measurement can name
        assert found[0].links == Links() and found[0].unresolved == [0, 1]


@pytest.mark.parametrize("kind", ["network", "shared-memory"])
def test_told_nothing_ranks_on_several_machines_learn_their_links(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 42: with no ``links`` and no ``$OPTCC_LINKS``, ranks that span machines
    (a transport of kind "network") watch their links and adopt the slow rank, on every
    rank alike; calls too short to time, and ranks on one machine, take the links as
    healthy (no watch is made)."""
    import optcc_mpi
    from optcc_mpi import collectives, config
    from optcc_mpi.emulation import Emulation
    from optcc_mpi.testing.local import LocalTransport, LocalWorld

    monkeypatch.delenv("OPTCC_LINKS", raising=False)
    config.reload()
    p, truth = 4, Links({1: 0.5})
    emu = Emulation(bw=2e9, degrade=truth)
    world = LocalWorld(p)
    for t in world.transports:
        t.kind = kind
    xs = [np.arange(1 << 16, dtype=np.float32) * (r + 1) for r in range(p)]  # 256 KiB

    def job(t: LocalTransport) -> tuple[str | None, bool]:
        small = optcc_mpi.allreduce(xs[t.rank][:256], comm=t)  # 1 KiB
        assert np.array_equal(small, sum(x[:256] for x in xs))
        unwatched = collectives.comm_state(t).watch is None
        for _ in range(12):  # (the ring: this transport has no AllReduce of its own)
            y = optcc_mpi.allreduce(xs[t.rank], comm=t, emulate=emu, algorithm="ring")
            assert np.array_equal(y, sum(xs))
        watch = collectives.comm_state(t).watch
        return (None if watch is None else str(watch.profile)), unwatched

    got = world.run(job)
    assert all(unwatched for _, unwatched in got)  # the short call: healthy, no watch
    if kind == "network":
        assert [profile for profile, _ in got] == [str(truth)] * p
    else:
        assert [profile for profile, _ in got] == [None] * p


def test_the_library_calls_times_are_a_tripwire_that_thins_the_sample() -> None:
    """On healthy links a call that rode carries, in the next round, each rank's time of
    it; the fastest rank's is the ring's own. Once five calls of a size are timed, one
    call in ``sample_armed`` is sampled instead of one in ``sample``; and where the ring
    turns slow (at least ``1 / (1 - threshold)`` its size's median, as any slow link makes
    it), the second call after it is observed, whatever the sample (the first rode before
    the slow time was agreed)."""
    from optcc_mpi.watch import MIN_BYTES

    p, size = 4, 4 * MIN_BYTES
    w = LinkWatch(p, sample=4, sample_armed=16)
    ring = algorithms.build("ring", p, size // 4, Links())  # (what the library's runs)
    last = [12.5]

    def call(ms: float) -> bool:
        """One timeable call whose ring took ``ms`` on the fastest rank: whether it was
        observed (it rode if the watch was quiet)."""
        quiet = w.quiet(True, size)
        rows = np.tile(w.contribution(), (p, 1))
        if rows[0, p + _TIME]:  # (the last call rode and was timed: every rank's time)
            rows[:, p + _TIME] = np.round(last[0] * 1e6 * np.array([1.0, 1.1, 1.2, 1.3]))
        w.agree(rows, timeable=True)
        if quiet:
            w.served(0, ring, size, last[0] / 1e3)
            last[0] = ms
            return False
        return w.observes(True, size)

    early = [call(12.5) for _ in range(8)]
    assert early == [i % 4 == 0 for i in range(8)]  # (the sample, not yet armed)
    assert w.armed(size)
    steady = [call(12.5 + 0.3 * (i % 3)) for i in range(32)]
    assert sum(steady) == 2, steady  # (one in sixteen)
    assert w.profile == Links() and not w.probes
    # One slow call (a rank at 0.6: the ring 1.63x) rides; the next rides too, before its
    # round's agreement finds the slow time; the trip stands until a call observes.
    assert not call(20.3)
    assert not call(12.5)
    assert call(12.5)


def test_a_degraded_plan_too_short_to_time_explores_when_its_call_time_moves() -> None:
    """Under a degraded profile a plan whose messages are all under MIN_BYTES shows the
    watch nothing (OptCC's at 1 MiB over 8 ranks). Its calls count toward the next
    exploring call, and one that took longer or less than the plan's calls usually do
    (every rank's time of it, the fastest's) makes the next call explore: the healthy
    ring, whose messages are timed."""
    p = 4
    w = LinkWatch(p, explore=4, explore_max=64)
    w._adopt(np.array([0.5, 1.0, 1.0, 1.0]))
    w._gap = 64  # (long after an adoption: no periodic exploration soon)
    sched = algorithms.build("ring", p, 4096, Links())  # (messages of 1 KiB: never timed)

    def call(seconds: float) -> Links:
        """One blind call of the plan that took ``seconds``: the profile its successor
        runs (what agree returns for it)."""
        rows = np.tile(w.contribution(), (p, 1))
        if rows[0, p + _TIME]:
            rows[:, p + _TIME] = np.round(last[0] * 1e9 * np.array([1.0, 1.05, 1.1, 1.2]))
        got = w.agree(rows, timeable=True)
        stats = [ExecStats(start=10.0, seconds=seconds) for _ in range(p)]
        w.record_messages(0, sched, 4, stats[0], epoch=9.5)
        last[0] = seconds
        return got

    last = [0.0]
    assert all(call(0.05 + 0.002 * (i % 3)) == Links({0: 0.5}) for i in range(10))
    assert not w._exploring
    assert call(0.03) == Links({0: 0.5})  # (its time travels with the next call)
    assert call(0.03) == Links() and w._exploring  # (rank 0 recovered: the call explores)


def _state(w: LinkWatch) -> dict[str, object]:
    """Everything a watch holds, comparable (arrays as lists)."""
    return {
        k: v.tolist() if isinstance(v, np.ndarray) else v
        for k, v in vars(w).items()
        if k not in ("log", "_prober")
    }


def test_a_quiet_call_agreed_without_arrays_leaves_what_zero_rows_leave() -> None:
    """agree of nothing (None: a call that rode carrying nothing) leaves the watch as agree
    of every rank's contribution of zeros does, over a run of short and timeable calls that ride
    (timed, carried), observed calls, a measurement left from an earlier call, and the
    tripwire's trips (some standing over a short call); where something is carried or the
    links are not held healthy, it is agree itself."""
    from optcc_mpi.watch import MIN_BYTES

    p, big = 4, 4 * MIN_BYTES
    full, fast = LinkWatch(p, sample=4, sample_armed=8), LinkWatch(p, sample=4, sample_armed=8)
    ring = algorithms.build("ring", p, MIN_BYTES, Links())
    sizes = [big, big, 4, big, 4096, big, big, 4, 4, big, 4, big, 4096]
    last, quiet_trips, quiet_measured = 12.5, 0, 0
    for i in range(260):
        nbytes = sizes[i % len(sizes)]
        timeable = full.timeable(nbytes)
        quiet = full.quiet(timeable, nbytes)
        assert quiet == fast.quiet(timeable, nbytes), i
        rows = np.tile(full.contribution(), (p, 1))
        assert np.array_equal(rows, np.tile(fast.contribution(), (p, 1)))
        if rows[0, p + _TIME]:  # (the last call was timed: every rank's time of it)
            rows[:, p + _TIME] = np.round(last * 1e6 * np.array([1.0, 1.1, 1.2, 1.3]))
        if quiet and not full.carried_size():
            if i % 5 == 0:  # (what an earlier call measured, as agree leaves it)
                full.measured = fast.measured = Links({1: 0.5})
                quiet_measured += 1
            quiet_trips += full._trip_pending
            full.agree(np.zeros((p, full.contribution_size()), dtype=np.int64), timeable=timeable)
            fast.agree(None, timeable=timeable)
        else:
            full.agree(rows.copy(), timeable=timeable)
            fast.agree(rows.copy(), timeable=timeable)
        if quiet:  # (it rode: the library served it)
            for w in (full, fast):
                w.served(1, ring, nbytes, last / 1e3)
        # (now and then a slow ring: the next call carries it and trips, the short calls
        # after it ride with the trip standing)
        last = 20.3 if i % len(sizes) == 5 else 12.5 + 0.3 * (i % 3)
        assert _state(full) == _state(fast), i
    assert full.armed(big) and full.calls == 260
    assert quiet_trips and quiet_measured, (quiet_trips, quiet_measured)
