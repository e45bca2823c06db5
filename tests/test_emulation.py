"""Software link emulation under MPI: slow ranks slow each algorithm as the model says.

These are the only timing assertions in the suite, asked for by the emulation feature:
with virtual NICs far slower than this machine's shared memory, the measured ratios are
set by the emulated links, not by load, and are compared with the model at 15%.
"""

from __future__ import annotations

import numpy as np
import pytest

import optcc_mpi
from optcc_mpi.emulation import Emulation
from optcc_mpi.lab import bench

MPI = pytest.importorskip("mpi4py.MPI")
pytestmark = pytest.mark.mpi


def test_emulation_parsing() -> None:
    emu = Emulation.parse("bw=200MB/s,latency=20us,degrade=0:0.5,3:0.75")
    assert emu.bw == 200e6 and emu.latency == pytest.approx(20e-6)
    assert emu.degrade is not None and emu.degrade.degraded == (0, 3)
    for bad in ("bw=fast", "speed=1", "bw"):
        with pytest.raises(ValueError):
            Emulation.parse(bad)


@pytest.mark.mpi(min_size=4)
def test_ratios_follow_the_model() -> None:
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    if p not in (4, 8):
        pytest.skip("the emulation check runs at 4 and 8 ranks")
    cfg = bench.BenchConfig(
        sizes=[4 << 20],
        algorithms=["ring", "optcc", "r2ccl"],
        iters=2,
        warmup=1,
        links="1:0.5",
        emulate=Emulation(bw=20e6),
    )
    rows = {r["algorithm"]: r for r in bench.run(cfg, comm)}
    assert all(r["wrong"] == 0 for r in rows.values())
    ff = rows["ring (fault-free)"]
    for name in ("ring", "optcc"):
        measured = rows[name]["time_us"] / ff["time_us"]
        modelled = rows[name]["model_us"] / ff["model_us"]
        assert measured == pytest.approx(modelled, rel=0.15), (name, measured, modelled)
    t = {name: rows[name]["time_us"] for name in ("optcc", "r2ccl", "ring")}
    assert t["optcc"] < t["r2ccl"] < t["ring"], t


@pytest.mark.mpi(min_size=3)
def test_probe_finds_the_slow_rank() -> None:
    from optcc_mpi.probe import probe

    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    slow = p - 2
    res = probe(comm, nbytes=1 << 20, emulate=f"bw=20MB/s,degrade={slow}:0.5")
    assert res.links.degraded == (slow,)
    assert res.links.fractions[slow] == pytest.approx(0.5, abs=0.1)
    # And through the API: links="probe" runs it once per communicator.
    y = optcc_mpi.allreduce(np.ones(4096), links="probe", emulate=f"bw=20MB/s,degrade={slow}:0.5")
    np.testing.assert_array_equal(y, np.full(4096, float(p)))
