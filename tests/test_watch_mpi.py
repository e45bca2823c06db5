"""``links="watch"`` under MPI, with emulated links that change between calls.

Asserts on what the ranks adopt and run (the profile, the algorithm ``auto`` chose, and
that every rank agrees), never on wall-clock times: the emulation paces the messages, the
watch measures them, and the decision must follow the emulated truth.
"""

from __future__ import annotations

import numpy as np
import pytest

import optcc_mpi
from optcc_mpi.collectives import choose_algorithm, last_stats
from optcc_mpi.emulation import Emulation
from optcc_mpi.links import Links

MPI = pytest.importorskip("mpi4py.MPI")
pytestmark = pytest.mark.mpi


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(600)
def test_watch_follows_a_link_that_degrades_and_recovers() -> None:
    comm = MPI.COMM_WORLD.Dup()  # a fresh communicator: a fresh watch
    rank, p = comm.Get_rank(), comm.Get_size()
    slow = p - 1
    size = 2 << 20
    x = np.full(size // 4, float(rank + 1), dtype=np.float32)
    expected = p * (p + 1) / 2
    truth_slow = Links({slow: 0.5})
    phases = [(Links(), 3), (truth_slow, 8), (Links(), 8)]
    seen: list[tuple[str, str, str]] = []
    for truth, calls in phases:
        emu = Emulation(bw=100e6, degrade=truth)
        for _ in range(calls):
            y = optcc_mpi.allreduce(x, comm=comm, links="watch", emulate=emu)
            assert np.all(y == expected)
            st = last_stats()
            seen.append((str(truth), str(st["links"]), st["algorithm"]))
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
