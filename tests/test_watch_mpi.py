"""``links="watch"`` under MPI, with emulated links that change between calls.

Asserts on what the ranks adopt and run (the profile, the algorithm ``auto`` chose, and
that every rank agrees), never on wall-clock times: the emulation paces the messages, the
watch measures them, and the decision must follow the emulated truth.
"""

from __future__ import annotations

import numpy as np
import pytest

import optcc_mpi
from optcc_mpi.check.protocol import extra_fits as _extra_fits
from optcc_mpi.check.protocol import gathered_extra as _gathered_extra
from optcc_mpi.collectives import choose_algorithm, comm_state, last_stats
from optcc_mpi.emulation import Emulation
from optcc_mpi.links import Links
from optcc_mpi.watch import _HEAD

MPI = pytest.importorskip("mpi4py.MPI")
pytestmark = pytest.mark.mpi


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("check", [True, False], ids=["in-the-check", "own-collective"])
def test_watch_follows_a_link_that_degrades_and_recovers(check: bool) -> None:
    """With the argument check the observations ride in its data room; without it they
    take one tiny collective of their own. Either way the same decisions."""
    comm = MPI.COMM_WORLD.Dup()  # a fresh communicator: a fresh watch
    rank, p = comm.Get_rank(), comm.Get_size()
    slow = p - 1
    size = 2 << 20
    x = np.full(size // 4, float(rank + 1), dtype=np.float32)
    expected = p * (p + 1) / 2
    truth_slow = Links({slow: 0.5})
    phases = [(Links(), 3), (truth_slow, 8), (Links(), 8)]
    seen: list[tuple[str, str, str]] = []
    rode = 0
    for truth, calls in phases:
        emu = Emulation(bw=100e6, degrade=truth)
        for _ in range(calls):
            mine = comm_state(comm).watch_made().contribution() if check else None
            y = optcc_mpi.allreduce(x, comm=comm, links="watch", emulate=emu, check=check)
            assert np.all(y == expected)
            if check and _extra_fits(comm_state(comm).check, mine.size):
                # What every rank brought is what the check's gathered room holds (from
                # the second call on: each call leaves the room the next one needs).
                rows = _gathered_extra(comm_state(comm).check, mine.size)
                np.testing.assert_array_equal(rows[rank], mine)
                np.testing.assert_array_equal(rows, np.array(comm.allgather(mine)))
                rode += 1
            st = last_stats()
            seen.append((str(truth), str(st["links"]), st["algorithm"]))
    if check:
        assert rode >= len(seen) - 1
    # Every rank took the same decisions at the same calls.
    assert len({repr(s) for s in comm.allgather(seen)}) == 1
    healthy, degraded, recovered = seen[:3], seen[3:11], seen[11:]
    assert all(adopted == "healthy" for _, adopted, _ in healthy)
    # Within a handful of calls the slow rank is found, at about its fraction ...
    adopted = [Links.parse(a) for _, a, _ in degraded]
    assert adopted[-1].degraded == (slow,), degraded
    assert adopted[-1].fractions[slow] == pytest.approx(0.5, abs=0.15)
    first = next(i for i, a in enumerate(adopted) if a.degraded == (slow,))
    assert first <= 4, degraded
    # ... auto re-plans for it ...
    assert degraded[-1][2] == choose_algorithm(p, size, adopted[-1])
    # ... and the recovery is noticed too.
    assert recovered[-1][1] == "healthy", recovered
    assert recovered[-1][2] == choose_algorithm(p, size, Links())
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_watch_is_an_agreed_setting() -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    x = np.ones(1000)
    # One rank watching while the others name a profile is a mismatch: an error on every
    # rank, never a hang.
    links = "watch" if rank == 0 else None
    with pytest.raises(ValueError, match="link profile"):
        optcc_mpi.allreduce(x, links=links)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("check", [True, False], ids=["in-the-check", "own-collective"])
def test_watch_pairs_both_ends_of_every_message_on_a_real_transport(check: bool) -> None:
    """No emulation: each rank records its side of every timed message, and from the
    gathered rows every rank pairs them into the same per-rank rates, none missing."""
    comm = MPI.COMM_WORLD.Dup()
    rank, p = comm.Get_rank(), comm.Get_size()
    x = np.full((4 << 20) // 4, float(rank + 1), dtype=np.float32)
    decided = []
    for _ in range(3):
        y = optcc_mpi.allreduce(x, comm=comm, links="watch", algorithm="ring", check=check)
        assert np.all(y == p * (p + 1) / 2)
        watch = comm_state(comm).watch_made()
        mine = watch.contribution()
        count = int(mine[p])
        assert count > 0 and np.all(mine[p + _HEAD : p + _HEAD + count] >= 0)  # every message timed
        if check:
            assert comm_state(comm).check.agreed >= 8 * mine.size  # rides on the next check
        rows = np.array(comm.allgather(mine))
        # Both ends of every message found (not asserted: that durations are positive;
        # in shared memory a message takes microseconds, less than the clock's skew).
        lo, hi = watch._layout.intervals(rows[:, p + _HEAD :])
        assert lo.size > 0 and np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))
        v = watch.observed(rows)
        assert np.all(v >= 0) and np.all(np.isfinite(v))
        assert all(np.array_equal(v, other) for other in comm.allgather(v))
        decided.append(str(last_stats()["links"]))
    assert len({repr(d) for d in comm.allgather(decided)}) == 1
    comm.Free()
