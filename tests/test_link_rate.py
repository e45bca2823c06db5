"""``$OPTCC_LINK_RATE``: the network model at the links' rate (issue 36).

The network model's rate (a 10 Gbit/s NIC's by default) sets OptCC's smallest section,
``2 * message_cost * rate``; on slower links that floor held an 8 MiB message at 16 ranks
to 5 segments (1.52x the lower bound on the 200 Mbit/s testbed, where 34 took 1.15x).
"""

from __future__ import annotations

import pytest

from optcc_mpi import algorithms, config
from optcc_mpi.algorithms import optcc
from optcc_mpi.algorithms._policy import NETWORK, network, transport_of
from optcc_mpi.errors import ArgumentError
from optcc_mpi.simulate import simulate

MiB = 1 << 20


def _k(p: int, nbytes: int) -> int:
    sched = algorithms.get("optcc").build(p, nbytes // 4, "0:0.5", itemsize=4, transport="network")
    return int(sched.params["k"])


def test_default_network_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPTCC_LINK_RATE", raising=False)
    config.reload()
    assert network() is NETWORK and transport_of("network") is NETWORK
    assert 100_000 <= optcc.section_floor("network") <= 100_001  # 2 * 40 us * 1.25 GB/s
    assert _k(16, 8 * MiB) == 5


def test_link_rate_sets_the_network_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTCC_LINK_RATE", "200mbit")
    config.reload()
    tr = transport_of("network")
    assert tr.rate == 25e6
    assert (tr.latency, tr.message_cost, tr.overlap) == (
        NETWORK.latency,
        NETWORK.message_cost,
        NETWORK.overlap,
    )
    # 40 us moves 1 KB at 25 MB/s: two messages' worth is the floor, and the segments
    # are as many as the builder makes.
    assert optcc.section_floor("network") == 2001
    assert [_k(p, 8 * MiB) for p in (4, 8, 16)] == [128, 128, 128]
    assert transport_of("shared-memory").rate != 25e6  # shared memory keeps its model


def _k_crowded(p: int, nbytes: int, crowding: float) -> int:
    sched = algorithms.get("optcc").build(
        p, nbytes // 4, "0:0.5", itemsize=4, transport=network(crowding)
    )
    return int(sched.params["k"])


def test_ranks_per_core_weigh_each_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the rate told, a message's fixed cost is charged once per rank sharing a core:
    16 ranks on 2 cores (the testbed) get the segments that came nearest the bound there,
    34 at 200 Mbit/s and 128 at 50 (docs/testbed.md 1.6j)."""
    monkeypatch.setenv("OPTCC_LINK_RATE", "200mbit")
    config.reload()
    crowded = network(8.0)
    assert crowded.message_cost == pytest.approx(8 * NETWORK.message_cost)
    assert crowded.rate == 25e6
    assert optcc.section_floor(crowded) == 16_001
    assert _k_crowded(16, 8 * MiB, 8.0) == 34
    assert network(0.25) == network(1.0)  # fewer ranks than cores: no discount
    monkeypatch.setenv("OPTCC_LINK_RATE", "50mbit")
    config.reload()
    assert optcc.section_floor(network(8.0)) == 4001
    assert _k_crowded(16, 8 * MiB, 8.0) == 128
    # Without a rate the default model's sections are already the largest: unchanged.
    monkeypatch.delenv("OPTCC_LINK_RATE")
    config.reload()
    assert network(8.0) is NETWORK


def test_more_segments_come_closer_to_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the simulator, 16 ranks on 200 Mbit/s links, rank 0 at half rate: the schedule
    built for the links' rate is nearer the lower bound than the 10 Gbit/s model's."""
    from optcc_mpi import model

    bound = model.lower_bound(16, 8 * MiB, 25e6, "0:0.5")
    times = {}
    for rate in (None, "200mbit"):
        if rate is None:
            monkeypatch.delenv("OPTCC_LINK_RATE", raising=False)
        else:
            monkeypatch.setenv("OPTCC_LINK_RATE", rate)
        config.reload()
        sched = algorithms.get("optcc").build(16, 2 * MiB, "0:0.5", itemsize=4, transport="network")
        times[rate] = simulate(sched, "0:0.5", bw=25e6, latency=40e-6).time / bound
    assert times["200mbit"] < times[None]
    assert times["200mbit"] < 1.01 < 1.05 < times[None]


def test_bad_link_rate_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTCC_LINK_RATE", "fast")
    config.reload()
    with pytest.raises(ArgumentError, match="OPTCC_LINK_RATE='fast'"):
        transport_of("network")
