"""``links="watch"``: the estimator and the decision rule (serial; the MPI run is in
tests/test_watch_mpi.py)."""

from __future__ import annotations

import numpy as np
import pytest

from optcc_mpi.links import Links
from optcc_mpi.watch import MIN_BYTES, LinkWatch, send_rates

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


def ring_observations(fracs: np.ndarray, bw: float = 100 * MB) -> np.ndarray:
    """What every rank contributes after one ring call on NICs at ``fracs`` (a link runs
    at its slower end), reduced by elementwise maximum as the check collective does."""
    p = fracs.size
    reduced = np.zeros(p, dtype=np.int64)
    for rank in range(p):
        w = LinkWatch(p)
        peer = (rank + 1) % p
        rate = bw * min(fracs[rank], fracs[peer])
        t = MIN_BYTES / rate
        w.record(rank, [(peer, MIN_BYTES, 0.0, t), (peer, MIN_BYTES, t, 2 * t)])
        reduced = np.maximum(reduced, w.contribution())
    return reduced


@pytest.mark.parametrize("p", [4, 8, 16])
def test_estimate_finds_the_slow_rank_from_ring_traffic(p: int) -> None:
    fracs = np.ones(p)
    fracs[3] = 0.5
    w = LinkWatch(p)
    est = w.estimate(ring_observations(fracs).astype(float))
    assert est == Links({3: 0.5})


def test_adoption_needs_confirmation_and_is_deterministic() -> None:
    p = 8
    slow = np.ones(p)
    slow[3] = 0.5
    obs_slow, obs_ok = ring_observations(slow), ring_observations(np.ones(p))
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
