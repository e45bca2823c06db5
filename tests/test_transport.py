"""Message sizes by transport: one message per section in shared memory, pipelined
messages over a network (``optcc_mpi.algorithms._policy``)."""

from __future__ import annotations

import numpy as np
import pytest

from optcc_mpi import algorithms
from optcc_mpi.algorithms._policy import NETWORK_MESSAGE_BYTES, message_bytes
from optcc_mpi.errors import ArgumentError
from optcc_mpi.schedule import SEND
from optcc_mpi.verify import verify


def _sends(sched) -> int:
    return int(np.count_nonzero(sched.kind == SEND))


def test_message_bytes() -> None:
    assert message_bytes(64 << 20, "network") == NETWORK_MESSAGE_BYTES
    assert message_bytes(64 << 20, "shared-memory") == 64 << 20
    assert message_bytes(0, "shared-memory") == 1
    with pytest.raises(ArgumentError, match="transport must be one of"):
        message_bytes(1, "infiniband")


@pytest.mark.parametrize("p", [2, 3, 8])
def test_ring_sends_one_message_per_section_in_shared_memory(p: int) -> None:
    count = 3 * (NETWORK_MESSAGE_BYTES // 4) * p + 5  # three network messages per section
    shm = algorithms.build("ring", p, count, itemsize=4, transport="shared-memory")
    net = algorithms.build("ring", p, count, itemsize=4, transport="network")
    verify(shm)
    verify(net)
    # 2(p - 1) steps, p senders: one message per section and step, against about four.
    assert _sends(shm) == 2 * (p - 1) * p
    assert _sends(net) == 4 * _sends(shm)
    # The default is the network's; an explicit chunk size wins over the transport.
    assert _sends(algorithms.build("ring", p, count, itemsize=4)) == _sends(net)
    explicit = algorithms.build("ring", p, count, itemsize=4, chunk_bytes=1 << 30)
    assert _sends(explicit) == _sends(shm)


def test_unknown_transport_is_an_argument_error() -> None:
    with pytest.raises(ArgumentError, match="transport"):
        algorithms.build("ring", 4, 1000, transport="carrier-pigeon")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_allreduce_tells_the_ring_its_transport() -> None:
    from mpi4py import MPI

    import optcc_mpi
    from optcc_mpi.collectives import last_stats
    from optcc_mpi.comm import state_of

    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    # Every rank of this test suite runs on one node (mpiexec on this machine), as MPI sees.
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    on_one_node = local.Get_size() == p
    local.Free()
    expected = "shared-memory" if on_one_node else "network"
    assert state_of(comm).transport == expected
    count = 3 * (NETWORK_MESSAGE_BYTES // 4) * p
    x = np.arange(count, dtype=np.float32) % 7 * (comm.rank + 1)
    y = optcc_mpi.allreduce(x, algorithm="ring")
    np.testing.assert_array_equal(y, np.arange(count, dtype=np.float32) % 7 * (p * (p + 1) // 2))
    sends = _sends(last_stats()["schedule"])
    assert sends == (2 * (p - 1) * p if on_one_node else 6 * (p - 1) * p)
    # Emulated links are a network whatever the node: pipelined messages again.
    optcc_mpi.allreduce(x, algorithm="ring", emulate="bw=10GB/s")
    assert _sends(last_stats()["schedule"]) == 6 * (p - 1) * p
