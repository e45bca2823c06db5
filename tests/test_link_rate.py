"""``$OPTCC_LINK_RATE``: the network model at the links' rate (issue 36).

The network model's rate (a 10 Gbit/s NIC's by default) sets OptCC's smallest section,
``2 * message_cost * rate``; on slower links that floor held an 8 MiB message at 16 ranks
to 5 segments (1.52x the lower bound on the 200 Mbit/s testbed, where 34 took 1.15x).
"""

from __future__ import annotations

import pytest

from optcc_mpi import algorithms, config
from optcc_mpi.algorithms import optcc
from optcc_mpi.algorithms._policy import NETWORK, fabric_of, network
from optcc_mpi.errors import ArgumentError
from optcc_mpi.simulate import simulate

MiB = 1 << 20


def _k(p: int, nbytes: int) -> int:
    sched = algorithms.get("optcc").build(p, nbytes // 4, "0:0.5", itemsize=4, fabric="network")
    return int(sched.params["k"])


def test_default_network_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPTCC_LINK_RATE", raising=False)
    config.reload()
    assert network() is NETWORK and fabric_of("network") is NETWORK
    assert 100_000 <= optcc.section_floor("network") <= 100_001  # 2 * 40 us * 1.25 GB/s
    assert _k(16, 8 * MiB) == 5


def test_link_rate_sets_the_network_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTCC_LINK_RATE", "200mbit")
    config.reload()
    fab = fabric_of("network")
    assert fab.rate == 25e6
    assert (fab.latency, fab.message_cost, fab.overlap) == (
        NETWORK.latency,
        NETWORK.message_cost,
        NETWORK.overlap,
    )
    # 40 us moves 1 KB at 25 MB/s: two messages' worth is the floor, and the segments
    # are as many as the builder makes.
    assert optcc.section_floor("network") == 2001
    assert [_k(p, 8 * MiB) for p in (4, 8, 16)] == [128, 128, 128]
    assert fabric_of("shared-memory").rate != 25e6  # shared memory keeps its model


def _k_crowded(p: int, nbytes: int, crowding: float) -> int:
    sched = algorithms.get("optcc").build(
        p, nbytes // 4, "0:0.5", itemsize=4, fabric=network(crowding)
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
        sched = algorithms.get("optcc").build(16, 2 * MiB, "0:0.5", itemsize=4, fabric="network")
        times[rate] = simulate(sched, "0:0.5", bw=25e6, latency=40e-6).time / bound
    assert times["200mbit"] < times[None]
    assert times["200mbit"] < 1.01 < 1.05 < times[None]


def test_bad_link_rate_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTCC_LINK_RATE", "fast")
    config.reload()
    with pytest.raises(ArgumentError, match="OPTCC_LINK_RATE='fast'"):
        fabric_of("network")


# -- the rate learnt (issue 42) ---------------------------------------------------------------
@pytest.mark.parametrize("kind", ["network", "shared-memory"])
def test_told_no_rate_ranks_on_several_machines_learn_it(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no ``$OPTCC_LINK_RATE``, ranks that span machines measure a healthy link's
    rate once, at the first call whose schedule it sizes (collectively: every rank holds
    the same value), and size their schedules by it as by a rate told; ranks on one
    machine measure nothing, and short calls wait for a call that needs it."""
    import numpy as np

    import optcc_mpi
    from optcc_mpi import collectives, planning
    from optcc_mpi.testing.local import LocalTransport, LocalWorld

    monkeypatch.delenv("OPTCC_LINK_RATE", raising=False)
    monkeypatch.delenv("OPTCC_LINKS", raising=False)
    config.reload()
    measured: list[int] = []
    real = planning.link_rate

    def counted(comm: LocalTransport) -> float | None:
        measured.append(comm.rank)
        return real(comm)

    monkeypatch.setattr(planning, "link_rate", counted)
    p, links = 4, "0:0.5"
    world = LocalWorld(p)
    for t in world.transports:
        t.kind = kind
    xs = [np.arange(1 << 18, dtype=np.float32) * (r + 1) for r in range(p)]  # 1 MiB

    def job(t: LocalTransport) -> tuple[float | None, int, int]:
        small = optcc_mpi.allreduce(xs[t.rank][:256], comm=t, links=links)
        assert np.array_equal(small, sum(x[:256] for x in xs))
        before = collectives.comm_state(t).rate
        assert before is None  # (a short call: nothing sized by a rate, nothing measured)
        for _ in range(3):
            y = optcc_mpi.allreduce(xs[t.rank], comm=t, links=links, algorithm="optcc")
            assert np.array_equal(y, sum(xs))
        st = collectives.comm_state(t)
        (plan,) = [plan for plan in st.plans._items.values() if plan.algorithm == "optcc"]
        return st.rate, int(plan.schedule.params["k"]), len(st.plans._items)

    got = world.run(job)
    if kind == "network":
        rates = {rate for rate, _, _ in got}
        assert len(rates) == 1  # the same bits on every rank
        (rate,) = rates
        assert rate is not None and rate > 0
        assert sorted(measured) == list(range(p))  # once per rank, at one call
        # (threads of one process: a rate of GB/s, above what sizes a schedule, so the
        # default model's; test_a_watched_call_... takes a slow one)
        sized = rate if rate <= planning.LEARNT_RATE_MAX else None
        fabric = network(world.transports[0].crowding, sized)
        want = algorithms.get("optcc").build(p, xs[0].size, links, itemsize=4, fabric=fabric)
        assert {k for _, k, _ in got} == {int(want.params["k"])}
    else:
        assert [rate for rate, _, _ in got] == [None] * p
        assert measured == []


def test_a_rate_told_is_not_learnt(monkeypatch: pytest.MonkeyPatch) -> None:
    """``$OPTCC_LINK_RATE`` overrides: nothing is measured, the schedule is sized by it."""
    import numpy as np

    import optcc_mpi
    from optcc_mpi import collectives, planning
    from optcc_mpi.testing.local import LocalTransport, LocalWorld

    monkeypatch.setenv("OPTCC_LINK_RATE", "200mbit")
    config.reload()
    measured: list[int] = []
    monkeypatch.setattr(planning, "link_rate", lambda comm: measured.append(1))
    world = LocalWorld(3)
    for t in world.transports:
        t.kind = "network"
    x = np.ones(1 << 18, dtype=np.float32)

    def job(t: LocalTransport) -> float | None:
        y = optcc_mpi.allreduce(x, comm=t, links="1:0.5", algorithm="optcc")
        assert np.array_equal(y, 3 * x)
        return collectives.comm_state(t).rate

    assert world.run(job) == [None] * 3
    assert measured == []


def test_the_learnt_rate_sizes_the_segments() -> None:
    """The rate learnt sizes OptCC's smallest section as a rate told does: 50 Mbit/s
    (6.25 MB/s) gives an 8 MiB message at 16 ranks more segments than the default
    model's 10 Gbit/s, and the same as ``OPTCC_LINK_RATE=50mbit`` would."""
    slow = network(1.0, 6.25e6)
    assert slow.rate == 6.25e6 and slow.message_cost == NETWORK.message_cost
    build = algorithms.get("optcc").build
    k = int(build(16, 2 * MiB, "0:0.5", itemsize=4, fabric=slow).params["k"])
    assert k > _k(16, 8 * MiB)
    crowded = network(8.0, 6.25e6)
    assert crowded.message_cost == 8 * NETWORK.message_cost


def test_a_watched_call_keeps_its_messages_long_enough_to_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On slow links the learnt rate's floor cuts sections of a few KB, which the watch
    cannot time (it reads messages of ``watch.MIN_BYTES`` or more): a watched call's
    sections stay at least that long, a call told its links is cut as the model says."""
    import dataclasses

    import numpy as np

    import optcc_mpi
    from optcc_mpi import collectives, planning
    from optcc_mpi.testing.local import LocalTransport, LocalWorld
    from optcc_mpi.watch import MIN_BYTES

    monkeypatch.delenv("OPTCC_LINK_RATE", raising=False)
    monkeypatch.delenv("OPTCC_LINKS", raising=False)
    config.reload()
    monkeypatch.setattr(planning, "link_rate", lambda comm: 6.25e6)  # 50 Mbit/s
    p, count = 4, 1 << 20  # 4 MiB of float32
    world = LocalWorld(p)
    for t in world.transports:
        t.kind = "network"
    x = np.ones(count, dtype=np.float32)

    def job(t: LocalTransport) -> dict[str, int]:
        for links in ("watch", "healthy"):
            y = optcc_mpi.allreduce(x, comm=t, links=links, algorithm="optcc")
            assert np.array_equal(y, p * x)
        plans = collectives.comm_state(t).plans._items
        # (a plan's key ends with whether the call was watched)
        return {
            "watch" if key[-1] else "healthy": int(plan.schedule.params["k"])
            for key, plan in plans.items()
        }

    got = world.run(job)
    slow = network(world.transports[0].crowding, 6.25e6)
    assert optcc.section_floor(slow) < MIN_BYTES
    watched = dataclasses.replace(slow, section_min=MIN_BYTES)
    assert optcc.section_floor(watched) == MIN_BYTES
    build = algorithms.get("optcc").build

    def k(fabric: object) -> int:
        return int(build(p, count, "", itemsize=4, fabric=fabric).params["k"])

    assert k(watched) < k(slow)
    assert got == [{"watch": k(watched), "healthy": k(slow)}] * p


@pytest.mark.parametrize("learnt", [6.25e6, 37.4e6])
def test_a_fast_learnt_rate_leaves_the_default_model(
    learnt: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A learnt rate sizes the schedules up to ``LEARNT_RATE_MAX`` (200 Mbit/s); a faster
    one (37.4 MB/s: what 400 Mbit/s links measured on the 8-rank testbed, where the
    rate's 128 segments took 2.10 s a call against 1.47 s with the default's 37) leaves
    the default model's."""
    import numpy as np

    import optcc_mpi
    from optcc_mpi import collectives, planning
    from optcc_mpi.testing.local import LocalTransport, LocalWorld

    monkeypatch.delenv("OPTCC_LINK_RATE", raising=False)
    config.reload()
    monkeypatch.setattr(planning, "link_rate", lambda comm: learnt)
    p, count = 4, 1 << 20
    world = LocalWorld(p)
    for t in world.transports:
        t.kind = "network"
    x = np.ones(count, dtype=np.float32)

    def job(t: LocalTransport) -> int:
        optcc_mpi.allreduce(x, comm=t, links="1:0.5", algorithm="optcc")
        (plan,) = collectives.comm_state(t).plans._items.values()
        return int(plan.schedule.params["k"])

    crowding = world.transports[0].crowding
    sized = learnt if learnt <= planning.LEARNT_RATE_MAX else None
    assert (sized is None) == (learnt > 25e6)
    build = algorithms.get("optcc").build
    want = int(build(p, count, "1:0.5", itemsize=4, fabric=network(crowding, sized)).params["k"])
    assert world.run(job) == [want] * p
    default = int(build(p, count, "1:0.5", itemsize=4, fabric=NETWORK).params["k"])
    assert (want == default) == (sized is None)
