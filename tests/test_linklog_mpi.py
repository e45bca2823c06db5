"""The link log of a watched run under MPI: ``allreduce(links="watch")`` on emulated links
that degrade and recover; rank 0's file holds exactly the changes every rank adopted."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import optcc_mpi
from optcc_mpi import linklog
from optcc_mpi.collectives import comm_state
from optcc_mpi.emulation import Emulation
from optcc_mpi.links import Links

MPI = pytest.importorskip("mpi4py.MPI")
pytestmark = pytest.mark.mpi


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(600)
def test_a_watched_run_leaves_a_record_of_what_it_adopted() -> None:
    world = MPI.COMM_WORLD
    rank, p = world.Get_rank(), world.Get_size()
    folder = world.bcast(tempfile.mkdtemp(prefix="linklog") if rank == 0 else None)
    path = Path(folder) / "links.jsonl"
    slow = p - 1
    x = np.full((2 << 20) // 4, float(rank + 1), dtype=np.float32)
    try:
        with linklog.recording(path):
            comm = world.Dup()  # a fresh communicator: its watch is made in the block
            for truth, calls in ((Links(), 3), (Links({slow: 0.5}), 6), (Links(), 8)):
                emu = Emulation(bw=100e6, degrade=truth)
                for _ in range(calls):
                    y = optcc_mpi.allreduce(x, comm=comm, links="watch", emulate=emu)
                    assert np.all(y == p * (p + 1) / 2)
        changes = comm_state(comm).watch_made().changes
        comm.Free()
        world.Barrier()
        if rank == 0:
            recs = linklog.read(path)
            adopted = [(r["call"], r["links"]) for r in recs if r["event"] == "adopt"]
            assert adopted == [(call, str(prof)) for call, prof in changes]
            # The slow rank was found while it was slow (the same run as
            # tests/test_watch_mpi.py asserts in detail).
            assert any(prof.degraded == (slow,) for _, prof in changes), changes
            assert recs[0]["event"] == "start" and recs[0]["p"] == p
    finally:
        world.Barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
