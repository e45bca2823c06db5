"""Message sizes by fabric (what joins the ranks, ``optcc_mpi.algorithms._policy.Fabric``):
one message per section in shared memory, pipelined messages over a network; and the
ranks per core a transport counts, which the network's model charges."""

from __future__ import annotations

import numpy as np
import pytest

from optcc_mpi import algorithms
from optcc_mpi.algorithms import optcc as optcc_alg
from optcc_mpi.algorithms._policy import (
    MIN_MESSAGE_BYTES,
    NETWORK,
    NETWORK_MESSAGE_BYTES,
    SHARED_MEMORY,
    Fabric,
    fabric_of,
    message_bytes,
)
from optcc_mpi.algorithms.ring import ring_time
from optcc_mpi.errors import ArgumentError
from optcc_mpi.schedule import SEND
from optcc_mpi.verify import verify


def _sends(sched) -> int:
    return int(np.count_nonzero(sched.kind == SEND))


def test_message_bytes() -> None:
    assert message_bytes(64 << 20, "network") == NETWORK_MESSAGE_BYTES
    assert message_bytes(64 << 20, "shared-memory") == 64 << 20
    assert message_bytes(0, "shared-memory") == 1
    with pytest.raises(ArgumentError, match="fabric must be one of"):
        message_bytes(1, "infiniband")


def test_default_network_model_gives_the_network_message_size() -> None:
    assert fabric_of("network") is NETWORK and fabric_of("shared-memory") is SHARED_MEMORY
    assert NETWORK.message_bytes(64 << 20) == NETWORK_MESSAGE_BYTES
    assert SHARED_MEMORY.message_bytes(64 << 20) == 64 << 20
    assert NETWORK.message_bytes(100_000) == 100_000  # never more than the section


def test_message_size_from_the_model() -> None:
    # beta * bw / eps = 100e-6 * 1e9 / 0.05 = 2e6 B, rounded up to a power of two.
    slow_start = Fabric("t", latency=0.0, message_cost=100e-6, rate=1e9)
    assert slow_start.message_bytes(1 << 30) == 1 << 21
    # alpha * bw / (window - 1): 4 ms at 1 GB/s with one companion = 4e6 B -> 4 MiB; a
    # deeper window covers the same reaction time with smaller messages.
    laggy = Fabric("t", latency=4e-3, message_cost=0.0, rate=1e9)
    assert laggy.message_bytes(1 << 30, window=2) == 1 << 22
    assert laggy.message_bytes(1 << 30, window=5) == 1 << 20
    # A slow network with cheap messages: the floor that the testbed measured.
    cheap = Fabric("t", latency=1e-6, message_cost=1e-6, rate=50e6)
    assert cheap.message_bytes(1 << 30) == MIN_MESSAGE_BYTES
    # Without overlap a section is one message, whatever the costs.
    shm = Fabric("t", latency=1e-6, message_cost=1e-6, rate=50e6, overlap=False)
    assert shm.message_bytes(12345) == 12345 and shm.messages(12345) == 1
    assert slow_start.messages(5 << 20) == 3 and slow_start.messages(0) == 0
    with pytest.raises(ArgumentError, match="rate > 0"):
        Fabric("t", latency=0.0, message_cost=0.0, rate=0.0)
    with pytest.raises(ArgumentError, match="message_cost >= 0"):
        Fabric("t", latency=0.0, message_cost=-1.0, rate=1.0)
    with pytest.raises(ArgumentError, match="eps"):
        NETWORK.message_bytes(1 << 30, eps=1.5)


def test_ring_takes_a_measured_fabric() -> None:
    p, count = 4, 4 * (8 << 20) // 4  # 8 MiB sections of float32
    fab = Fabric("calibrated", latency=0.0, message_cost=100e-6, rate=1e9)  # 2 MiB messages
    sched = algorithms.build("ring", p, count, itemsize=4, fabric=fab)
    verify(sched)
    assert _sends(sched) == 2 * (p - 1) * p * 4
    # Passed through allreduce's params, a Fabric is part of the plan's cache key.
    assert repr(fab) == repr(Fabric("calibrated", 0.0, 100e-6, 1e9, True))


def test_ring_model_charges_a_measured_fabric() -> None:
    p, n, bw = 4, 64 << 20, 50e6
    ff = 2 * (p - 1) / p * n / bw
    # Named fabrics keep the plain model (their figures are defaults, not measurements).
    assert ring_time(p, n, bw, latency=1e-3) == pytest.approx(ff + 6 * 1e-3)
    assert ring_time(p, n, bw, fabric="shared-memory") == pytest.approx(ff)
    # With overlap: the delivered rate, and per step one latency and one exposed message.
    net = Fabric("c", latency=2e-4, message_cost=1e-4, rate=40e6)
    ff40 = 2 * (p - 1) / p * n / 40e6
    assert ring_time(p, n, bw, fabric=net) == pytest.approx(ff40 + 6 * (2e-4 + 1e-4))
    # The larger of the caller's latency and the fabric's.
    assert ring_time(p, n, bw, latency=1e-3, fabric=net) == pytest.approx(ff40 + 6 * (1e-3 + 1e-4))
    # Without overlap: every message of a section costs its fixed time (16 MiB sections
    # in 4 MiB messages: 4 per step); the rate above the link's is capped at the link's.
    shm = Fabric("c", latency=1e-5, message_cost=2e-4, rate=1e12, overlap=False)
    got = ring_time(p, n, bw, fabric=shm, chunk_bytes=4 << 20)
    assert got == pytest.approx(ff + 6 * (1e-5 + 4 * 2e-4))
    # The registry passes the builder's parameters to the cost.
    alg = algorithms.get("ring")
    assert alg.time(p, n, bw, fabric=shm) == pytest.approx(ff + 6 * (1e-5 + 2e-4))


@pytest.mark.parametrize("p", [2, 3, 8])
def test_ring_sends_one_message_per_section_in_shared_memory(p: int) -> None:
    count = 3 * (NETWORK_MESSAGE_BYTES // 4) * p + 5  # three network messages per section
    shm = algorithms.build("ring", p, count, itemsize=4, fabric="shared-memory")
    net = algorithms.build("ring", p, count, itemsize=4, fabric="network")
    verify(shm)
    verify(net)
    # 2(p - 1) steps, p senders: one message per section and step, against about four.
    assert _sends(shm) == 2 * (p - 1) * p
    assert _sends(net) == 4 * _sends(shm)
    # The default is the network's; an explicit chunk size wins over the fabric.
    assert _sends(algorithms.build("ring", p, count, itemsize=4)) == _sends(net)
    explicit = algorithms.build("ring", p, count, itemsize=4, chunk_bytes=1 << 30)
    assert _sends(explicit) == _sends(shm)


def test_unknown_fabric_is_an_argument_error() -> None:
    with pytest.raises(ArgumentError, match="fabric"):
        algorithms.build("ring", 4, 1000, fabric="carrier-pigeon")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_allreduce_tells_the_ring_its_fabric() -> None:
    from mpi4py import MPI

    import optcc_mpi
    from optcc_mpi.collectives import comm_state, last_stats

    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    # Every rank of this test suite runs on one node (mpiexec on this machine), as MPI sees.
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    on_one_node = local.Get_size() == p
    local.Free()
    expected = "shared-memory" if on_one_node else "network"
    # (the kind of fabric the communicator's transport reports)
    assert comm_state(comm).transport.kind == expected
    count = 3 * (NETWORK_MESSAGE_BYTES // 4) * p
    x = np.arange(count, dtype=np.float32) % 7 * (comm.rank + 1)
    y = optcc_mpi.allreduce(x, algorithm="ring")
    np.testing.assert_array_equal(y, np.arange(count, dtype=np.float32) % 7 * (p * (p + 1) // 2))
    sends = _sends(last_stats()["schedule"])
    assert sends == (2 * (p - 1) * p if on_one_node else 6 * (p - 1) * p)
    # Emulated links are a network whatever the node: pipelined messages again.
    optcc_mpi.allreduce(x, algorithm="ring", emulate="bw=10GB/s")
    assert _sends(last_stats()["schedule"]) == 6 * (p - 1) * p


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_allreduce_with_a_measured_fabric() -> None:
    from mpi4py import MPI

    import optcc_mpi
    from optcc_mpi.collectives import last_stats

    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    count = 4 * (MIN_MESSAGE_BYTES // 4) * p  # sections of 4 minimal messages
    fab = Fabric("calibrated", latency=0.0, message_cost=0.0, rate=1e9)  # the floor
    x = np.arange(count, dtype=np.float32) % 5 * (comm.rank + 1)
    want = np.arange(count, dtype=np.float32) % 5 * (p * (p + 1) // 2)
    for _ in range(2):  # the second call takes the cached plan
        y = optcc_mpi.allreduce(x, algorithm="ring", params={"fabric": fab})
        np.testing.assert_array_equal(y, want)
        assert _sends(last_stats()["schedule"]) == 2 * (p - 1) * p * 4
    # A rank with another model is an error on every rank, not a hang.
    other = Fabric("calibrated", latency=0.0, message_cost=0.0, rate=2e9)
    mine = other if comm.rank == p - 1 else fab
    with pytest.raises(ArgumentError, match="params"):
        optcc_mpi.allreduce(x, algorithm="ring", params={"fabric": mine})


def test_optcc_section_floor_by_fabric() -> None:
    from optcc_mpi.algorithms.optcc import SECTION_BYTES, SECTION_MIN, section_floor

    assert section_floor(None) == SECTION_BYTES
    # Over the network default: the bytes 2 * message cost would have moved at its rate.
    net = section_floor("network")
    assert net == pytest.approx(2 * NETWORK.message_cost * NETWORK.rate, abs=1)
    assert net > SECTION_BYTES
    # A fabric whose messages cost nothing: the smallest section there is.
    free = Fabric("free", latency=1e-6, message_cost=0.0, rate=NETWORK.rate)
    assert section_floor(free) == SECTION_MIN < SECTION_BYTES
    # Without overlap the floor never binds a real size: the fewest segments.
    assert section_floor("shared-memory") > 1 << 50


@pytest.mark.parametrize("p", [4, 8])
def test_optcc_segments_follow_the_fabric(p: int) -> None:
    from optcc_mpi.algorithms.optcc import optcc_plan, section_floor

    count = (16 << 20) // 4
    links = {0: 0.5}
    k = {
        fab: algorithms.build("optcc", p, count, itemsize=4, links=links, fabric=fab).params["k"]
        for fab in (None, "network", "shared-memory")
    }
    # The simulator's fabric cuts the most segments, shared memory the fewest (4).
    assert k[None] >= k["network"] > k["shared-memory"] == 4
    # An owner's section of a segment is on average at least the network's floor.
    owners = len(optcc_plan(p, links).owners)
    assert count * 4 // (k["network"] * owners) >= section_floor("network")
    for fab in ("network", "shared-memory"):
        verify(algorithms.build("optcc", p, count, itemsize=4, links=links, fabric=fab))
    # Over the network the ramp stays short (its last sections are small messages).
    ramps = {
        fab: algorithms.build("optcc", p, count * 8, itemsize=4, links=links, fabric=fab).params
        for fab in (None, "network")
    }
    assert ramps["network"]["ramp"] == min(
        optcc_alg.RAMP_MAX_NETWORK, round(ramps["network"]["k"] / 7)
    )
    assert ramps[None]["ramp"] == optcc_alg.auto_ramp(ramps[None]["k"])
    # An explicit k wins over the fabric.
    explicit = algorithms.build("optcc", p, count, itemsize=4, links=links, fabric="network", k=7)
    assert explicit.params["k"] == 7


def test_crowding_counts_the_ranks_that_share_cpus() -> None:
    from optcc_mpi.transports.base import cpu_placement, crowding_of

    machine, cpus = cpu_placement()
    assert machine and cpus and all(isinstance(c, int) for c in cpus)
    two = ("a", (0, 1))
    assert crowding_of([two] * 16) == 8.0  # the 16-rank testbed on 2 cores
    assert crowding_of([two] * 3 + [("b", (0, 1))]) == 1.5  # the most crowded machine
    # Ranks pinned to cores of their own, or fewer ranks than cores: no crowding.
    assert crowding_of([("a", (i,)) for i in range(8)]) == 1.0
    assert crowding_of([("a", tuple(range(64)))] * 8) == 1.0
    assert crowding_of([]) == 1.0


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_every_rank_knows_the_same_ranks_per_core() -> None:
    """The MPI transport counts the ranks sharing each CPU set at set-up, and every rank
    holds the same value (the ranks build their schedules from it)."""
    from mpi4py import MPI

    from optcc_mpi.collectives import comm_state
    from optcc_mpi.transports.base import cpu_placement, crowding_of

    comm = MPI.COMM_WORLD
    crowding = comm_state(comm).transport.crowding
    assert crowding == crowding_of(comm.allgather(cpu_placement()))
    assert comm.allgather(crowding) == [crowding] * comm.Get_size()
    assert crowding >= 1.0
