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
    # 40 us moves 1 KB at 25 MB/s: the fabric's own floor applies.
    assert optcc.section_floor("network") == optcc.SECTION_BYTES
    assert [_k(p, 8 * MiB) for p in (4, 8, 16)] == [128, 73, 34]
    assert transport_of("shared-memory").rate != 25e6  # shared memory keeps its model


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
