"""Software link emulation: the virtual NICs charge what the link model says.

No wall-clock assertions: every check is on the pacer's own accounting (bytes and seconds
of service it charged per direction and per peer), computed independently from the
executor's per-message records, and on the algorithms' cost models.
"""

from __future__ import annotations

import numpy as np
import pytest

import optcc_mpi
from optcc_mpi import algorithms, config, model
from optcc_mpi.arrays import NumpyArrayOps
from optcc_mpi.emulation import ENV_FRACTION, Emulation, Pacer
from optcc_mpi.executor import execute
from optcc_mpi.links import Links

MPI = pytest.importorskip("mpi4py.MPI")


def test_emulation_parsing() -> None:
    emu = Emulation.parse("bw=200MB/s,latency=20us,degrade=0:0.5,3:0.75")
    assert emu.bw == 200e6 and emu.latency == pytest.approx(20e-6)
    assert emu.degrade is not None and emu.degrade.degraded == (0, 3)
    for bad in ("bw=fast", "speed=1", "bw"):
        with pytest.raises(ValueError):
            Emulation.parse(bad)


def test_send_runs_at_the_slower_end() -> None:
    # Rank 0 healthy, rank 2 at a quarter: 0 -> 2 is paced at the quarter rate.
    pacer = Emulation(bw=100.0).pacer(0, 4, Links({2: 0.25, 3: 0.5}))
    assert pacer.send_rate(1) == 100.0
    assert pacer.send_rate(2) == 25.0
    assert pacer.send_rate(3) == 50.0
    t = pacer.send_release(0.0, 100, 2)  # 4 s at 25 B/s
    assert t == pytest.approx(4.0)
    t = pacer.send_release(0.0, 100, 1)  # queued behind the first: FIFO send side
    assert t == pytest.approx(5.0)
    assert pacer.charged_bytes["send"] == 200
    assert pacer.charged_seconds["send"] == pytest.approx(5.0)
    assert pacer.charged_to == pytest.approx({2: 4.0, 1: 1.0})
    # Receives stay paced at this rank's own rate.
    assert pacer.recv_done(0.0, 0.0, 100) == pytest.approx(1.0)
    assert pacer.charged_seconds["recv"] == pytest.approx(1.0)


def test_slow_sender_is_slow_to_everybody() -> None:
    pacer = Emulation(bw=100.0).pacer(2, 4, Links({2: 0.25}))
    assert [pacer.send_rate(q) for q in (0, 1, 3)] == [25.0, 25.0, 25.0]
    assert pacer.coll_rate == 25.0


def test_forced_fraction_replaces_only_this_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_FRACTION, "0.5")
    config.reload()
    pacer = Emulation(bw=100.0).pacer(1, 3, Links({2: 0.25}))
    assert pacer.fraction == 0.5
    assert pacer.fractions == [1.0, 0.5, 0.25]
    assert [pacer.send_rate(q) for q in (0, 2)] == [50.0, 25.0]
    monkeypatch.setenv(ENV_FRACTION, "1.5")
    config.reload()
    with pytest.raises(ValueError, match=ENV_FRACTION):
        Emulation(bw=100.0).pacer(1, 3, Links())


def test_pacer_without_profile_uses_own_fraction() -> None:
    pacer = Pacer(Emulation(bw=10.0), 0.5, 0.5, 2)
    assert pacer.send_rate(1) == 5.0
    unpaced = Emulation(latency=1e-3).pacer(0, 2, Links())
    assert unpaced.send_release(3.0, 10**6, 1) == 3.0
    assert unpaced.charged_bytes["send"] == 0
    assert unpaced.recv_done(0.0, 1.0, 10) == pytest.approx(1.001)


def _run_paced(name: str, p: int, count: int, links: Links, emu: Emulation) -> tuple:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    sched = algorithms.build(name, p, count, links, itemsize=4)
    x = np.full(count, rank + 1, dtype=np.float32)
    pacer = emu.pacer(rank, p, links)
    stats = execute(sched, x, comm=comm, op="sum", arrays=NumpyArrayOps(), pacer=pacer)
    np.testing.assert_array_equal(x, np.full(count, p * (p + 1) / 2, dtype=np.float32))
    return pacer, stats


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["ring", "optcc", "r2ccl"])
def test_pacer_charges_the_model(name: str) -> None:
    """Per rank, the pacer charged every byte the executor moved, each send at the rate of
    the slower end; the busiest virtual NIC's charged time is at least the lower bound, the
    ring's modelled time for the ring, and at most OptCC's modelled time for OptCC."""
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    bw, count = 1e9, 1 << 16  # fast virtual NICs: pacing is cheap, accounting is exact
    links = Links({1: 0.5})
    emu = Emulation(bw=bw)
    pacer, stats = _run_paced(name, p, count, links, emu)
    assert pacer.charged_bytes["send"] == stats.bytes_sent
    assert pacer.charged_bytes["recv"] == stats.bytes_received
    f = links.vector(p)
    rank = comm.Get_rank()
    expect = sum(nb / (bw * min(f[rank], f[peer])) for _, peer, nb, _, _ in stats.sends)
    assert pacer.charged_seconds["send"] == pytest.approx(expect, rel=1e-9)
    assert pacer.charged_seconds["recv"] == pytest.approx(
        stats.bytes_received / (bw * f[rank]), rel=1e-9
    )
    busiest = comm.allreduce(
        max(pacer.charged_seconds["send"], pacer.charged_seconds["recv"]), op=MPI.MAX
    )
    nbytes = count * 4
    # No NIC can be charged less than the bound's share of the traffic.
    assert busiest >= model.lower_bound(p, nbytes, bw, links) * (1 - 1e-6)
    modelled = algorithms.get(name).time(p, nbytes, bw, links)
    if name == "ring":
        assert busiest == pytest.approx(modelled, rel=1e-4)  # whole elements
    elif name == "optcc":
        # Sections are whole elements: the plan's split rounds by a few bytes.
        assert busiest <= modelled * (1 + 1e-4)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(300)
def test_messages_into_the_slow_rank_are_charged_slow() -> None:
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    slow = p - 1
    links = Links({slow: 0.25})
    pacer, stats = _run_paced("ring", p, 1 << 14, links, Emulation(bw=1e9))
    # The ring's left neighbour of the slow rank sends only to it: every byte at 1/4 rate.
    if comm.Get_rank() == slow - 1:
        assert set(pacer.charged_to) == {slow}
        assert pacer.charged_seconds["send"] == pytest.approx(stats.bytes_sent / 0.25e9)


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
