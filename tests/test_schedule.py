"""The schedule representation: builder checks, matching, queues, windows, traffic."""

from __future__ import annotations

import numpy as np
import pytest

from optcc_mpi import algorithms
from optcc_mpi.schedule import RECV, RECV_REDUCE, SEND, Schedule, ScheduleBuilder, split


def test_split_is_deterministic_and_balanced() -> None:
    b = split(0, 10, 4)
    np.testing.assert_array_equal(b, [0, 3, 6, 8, 10])
    b = split(np.array([0, 5]), np.array([5, 7]), 3)
    np.testing.assert_array_equal(b, [[0, 2, 4, 5], [5, 6, 7, 7]])
    assert (np.diff(split(0, 2, 5)) >= 0).all()


def test_empty_ranges_are_dropped_on_both_sides() -> None:
    b = ScheduleBuilder(2, 3, "t")
    s, r = b.transfer([0, 0], [1, 1], [0, 2], [2, 2])
    assert s[1] == -1 and r[1] == -1
    sched = b.build()
    assert sched.n_ops == 2


def test_builder_rejects_bad_operations() -> None:
    b = ScheduleBuilder(2, 4, "t")
    b.send(0, 0, 0, 4)
    with pytest.raises(ValueError, match="invalid peer"):
        b.build()
    b = ScheduleBuilder(2, 4, "t")
    b.send(0, 1, 0, 5)
    with pytest.raises(ValueError, match="out of bounds"):
        b.build()
    b = ScheduleBuilder(2, 4, "t")
    first = b.send(0, 1, 0, 4)
    b.recv(1, 0, 0, 4, deps=first)
    with pytest.raises(ValueError, match="dependencies are per rank"):
        b.build()


def test_matching_errors() -> None:
    b = ScheduleBuilder(2, 4, "t")
    b.send(0, 1, 0, 4)
    with pytest.raises(ValueError, match="1 sends from rank 0 to rank 1 on channel 0 but 0"):
        _ = b.build().partner
    b = ScheduleBuilder(2, 4, "t")
    b.send(0, 1, 0, 4)
    b.recv(1, 0, 0, 3)
    with pytest.raises(ValueError, match="send of 4 elements meets receive of 3"):
        _ = b.build().partner


def test_window_bounds_messages_per_queue() -> None:
    b = ScheduleBuilder(2, 8, "t", window=2)
    ids = [b.send(0, 1, i, i + 1) for i in range(5)]
    for i in range(5):
        b.recv(1, 0, i, i + 1)
    sched = b.build()
    # the third send waits for the first, the fourth for the second ...
    assert list(sched.deps(int(ids[2]))) == [int(ids[0])]
    assert list(sched.deps(int(ids[4]))) == [int(ids[2])]
    assert sched.deps(int(ids[1])).size == 0


def test_program_view() -> None:
    sched = algorithms.build("ring", 4, 100, itemsize=4)
    prog = sched.program(2)
    assert len(prog.ops) == sched.op_ids(2).size
    for i, deps in enumerate(prog.deps):
        assert all(d < i for d in deps)
    kinds = {op[0] for op in prog.ops}
    assert kinds == {SEND, RECV_REDUCE, 1}


def traffic(sched: Schedule) -> dict[str, np.ndarray]:
    """Elements and messages sent and received per rank (``COLL`` not counted)."""
    send = sched.kind == SEND
    recv = (sched.kind == RECV) | (sched.kind == RECV_REDUCE)
    n = sched.length
    return {
        "sent": np.bincount(sched.rank[send], weights=n[send], minlength=sched.p),
        "received": np.bincount(sched.rank[recv], weights=n[recv], minlength=sched.p),
        "messages_sent": np.bincount(sched.rank[send], minlength=sched.p),
        "messages_received": np.bincount(sched.rank[recv], minlength=sched.p),
    }


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_ring_traffic_is_optimal(p: int) -> None:
    n = 1000 * p
    t = traffic(algorithms.build("ring", p, n, itemsize=4))
    np.testing.assert_allclose(t["sent"], 2 * (p - 1) / p * n)
    np.testing.assert_allclose(t["received"], 2 * (p - 1) / p * n)


@pytest.mark.parametrize("p", [3, 5, 8, 13])
def test_optcc_traffic_oracle(p: int) -> None:
    """Four-stage traffic: healthy ranks move (2p-3)/(p-1) n each way, the straggler n;
    per segment the straggler exchanges one chunk each way with every healthy rank."""
    n = 5040 * (p - 1) * 8
    k = 8
    sched = algorithms.build("optcc", p, n, "0:0.5", k=k, itemsize=4, ramp=0)  # equal segments
    t = traffic(sched)
    assert t["sent"][0] == n and t["received"][0] == n
    np.testing.assert_allclose(t["sent"][1:], (2 * p - 3) / (p - 1) * n)
    np.testing.assert_allclose(t["received"][1:], (2 * p - 3) / (p - 1) * n)
    assert t["messages_sent"][0] == k * (p - 1)
    assert t["messages_received"][0] == k * (p - 1)
    # per segment a healthy rank sends 2(h-1) ring chunks and 1 chunk to the straggler
    np.testing.assert_array_equal(t["messages_sent"][1:], k * (2 * (p - 2) + 1))


def test_algorithms_registry() -> None:
    assert set(algorithms.names()) >= {"ring", "optcc", "r2ccl", "native"}
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        algorithms.get("tree")
