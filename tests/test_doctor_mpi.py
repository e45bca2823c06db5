"""``optcc_mpi.doctor`` under MPI with emulated links (CI runs these at 3, 4, 5 and 8 ranks).

The emulation paces every message like a NIC of the emulated rate (the slower of the two
ends), so the verdicts must follow the emulated truth. Asserts on verdicts, fractions
(within 0.1 of the truth) and the doctor's own accounting of bytes and paced seconds,
never on wall-clock times.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from optcc_mpi import doctor as dr
from optcc_mpi import linkrates
from optcc_mpi.emulation import Emulation
from optcc_mpi.errors import ArgumentError
from optcc_mpi.links import Links

MPI = pytest.importorskip("mpi4py.MPI")
pytestmark = pytest.mark.mpi

BW = 50e6  # bytes/s per virtual NIC
SIZE = 1 << 20  # 21 ms per healthy message: scheduling noise on 2 cores stays small


def run(truth: str | None, **kw) -> dr.Diagnosis:
    spec = f"bw={BW:g}" + (f",degrade={truth}" if truth else "")
    comm = MPI.COMM_WORLD
    diag = dr.doctor(comm, size=SIZE, repeats=3, emulate=spec, **kw)
    # Every rank holds the same verdict.
    mine = json.dumps(diag.to_dict()["ranks"], sort_keys=True, default=str)
    assert len(set(comm.allgather(mine))) == 1
    return diag


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(300)
def test_healthy_emulated_network_flags_nothing() -> None:
    diag = run(None)
    assert diag.status == "healthy", diag.table()
    assert diag.flagged == [] and diag.exit_status == dr.EXIT_HEALTHY
    assert all(r.fraction >= linkrates.HEALTHY_ABOVE for r in diag.ranks)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(300)
def test_one_half_rate_rank_is_found_and_nothing_else() -> None:
    p = MPI.COMM_WORLD.Get_size()
    slow = p - 1
    diag = run(f"{slow}:0.5")
    assert diag.flagged == [slow], diag.table()
    assert diag.ranks[slow].fraction == pytest.approx(0.5, abs=0.1)
    assert diag.ranks[slow].verdict == "degraded"
    assert diag.status == "degraded" and diag.exit_status == dr.EXIT_DEGRADED
    # Under emulation every rank is a node of its own (a virtual NIC per rank).
    assert len(diag.nodes) == p and diag.nodes[0].ranks == [slow]
    assert list(diag.links.fractions) == [slow]


@pytest.mark.mpi(min_size=5)
@pytest.mark.timeout(300)
def test_two_ranks_at_different_fractions_are_both_found() -> None:
    """Two of at least five ranks (so that the median link is healthy): 0.5 and 0.7."""
    diag = run("1:0.5,3:0.7")
    assert diag.flagged == [1, 3], diag.table()
    assert diag.ranks[1].fraction == pytest.approx(0.5, abs=0.1)
    assert diag.ranks[3].fraction == pytest.approx(0.7, abs=0.1)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(300)
def test_bytes_and_duration_by_the_doctors_own_accounting() -> None:
    """What --help and the docs state, checked without a clock: every rank sends and
    receives size * repeats * partners bytes in as many messages (the executor's counts),
    and the paced seconds (the pacers' charges, the busiest virtual NIC per round) are
    the simulator's time for the plan on the emulated truth, which is rounds * size / bw
    with one slow rank stretching the rounds it takes part in."""
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    truth = Links({0: 0.5})
    diag = run(str(truth))
    k = min(dr.DEFAULT_PARTNERS, p - 1)
    per_rank = SIZE * 3 * k
    assert diag.bytes_sent == [per_rank] * p
    assert diag.bytes_received == [per_rank] * p
    assert diag.messages_sent == [3 * k] * p and diag.messages_received == [3 * k] * p
    the_plan = dr.plan(dr.Layout(("h",) * p, "rank"), size=SIZE, repeats=3)
    assert diag.rounds == len(the_plan.rounds) == 3 * k
    sim = dr.estimate(the_plan, BW, links=truth)["transfer_seconds"]
    assert diag.emulated_seconds == pytest.approx(sim, rel=1e-9)
    # Rank 0 takes part in every round (sending and receiving), at half rate.
    assert sim == pytest.approx(3 * k * SIZE / (0.5 * BW), rel=1e-9)
    assert diag.charged_seconds[0] == pytest.approx(sim, rel=1e-9)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(300)
def test_every_rank_refuses_parameters_that_differ() -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    with pytest.raises(ArgumentError, match="every rank must pass the same parameters"):
        dr.doctor(comm, size=SIZE, repeats=2 if rank == 1 else 3, emulate=f"bw={BW:g}")
    with pytest.raises(ArgumentError, match="rank 1: .*repeats must be a whole number"):
        dr.doctor(comm, size=SIZE, repeats=0 if rank == 1 else 3, emulate=f"bw={BW:g}")
    comm.Barrier()


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(300)
def test_the_verdict_goes_to_the_link_log() -> None:
    """Rank 0 alone appends the verdict (one folder for all ranks, made by rank 0)."""
    from optcc_mpi import linklog

    comm = MPI.COMM_WORLD
    folder = comm.bcast(tempfile.mkdtemp(prefix="doctorlog") if comm.Get_rank() == 0 else None)
    path = Path(folder) / "links.jsonl"
    try:
        diag = dr.doctor(comm, size=SIZE, repeats=1, emulate=Emulation(bw=BW), log=path)
        comm.Barrier()
        if comm.Get_rank() == 0:
            recs = linklog.read(path)
            assert [r["event"] for r in recs] == ["start", "doctor"]
            assert recs[1]["status"] == diag.status and recs[1]["p"] == comm.Get_size()
            fracs = [r.fraction for r in diag.ranks]
            assert np.allclose(recs[1]["fractions"], fracs, atol=1e-5)
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
