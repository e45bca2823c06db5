"""The board under the ``optcc`` backend: destroying a group, and what a group leaves
behind (optcc_mpi.torch.process_group with optcc_mpi.transports.board).

Ranks as threads of one process on one HashStore (the board carries their exchanges:
ctypes lets the GIL go while a rank waits), each with its own :class:`OptccProcessGroup`,
as torch.distributed makes them. Every group here has a long timeout (10 minutes) and
every test a far shorter one: a wait that ends by the group's timeout fails the test by
its own timeout, and the errors must name the destroy or the rank at fault.
"""

from __future__ import annotations

import datetime
import gc
import os
import threading
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("this PyTorch has no torch.distributed", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

import optcc_mpi.torch  # noqa: E402, F401  (registers the backend)
from optcc_mpi.torch.process_group import OptccProcessGroup  # noqa: E402
from optcc_mpi.torch.worker import AbortedError  # noqa: E402
from optcc_mpi.transports import board  # noqa: E402

pytestmark = pytest.mark.skipif(not board.usable(), reason="no board: no C compiler here")

#: Longer than any test's own timeout.
LONG = datetime.timedelta(minutes=10)


def on_threads(
    size: int, body: Callable[[int, Callable[[], OptccProcessGroup]], object]
) -> list[object]:
    """``body(rank, make)`` on ``size`` threads, where ``make()`` makes the next optcc
    group of ``size`` ranks (collective: every rank calls it the same number of times);
    each one's result (an exception is returned, not raised)."""
    store = dist.HashStore()
    results: list[object] = [None] * size

    def rank_main(rank: int) -> None:
        made = 0

        def make() -> OptccProcessGroup:
            nonlocal made
            made += 1
            return OptccProcessGroup(dist.PrefixStore(f"g{made}", store), rank, size, LONG)

        try:
            results[rank] = body(rank, make)
        except BaseException as exc:  # reported to the test
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(240)
    assert not any(th.is_alive() for th in threads), "a rank hung"
    return results


@pytest.mark.timeout(300)
def test_a_destroy_ends_the_peers_waits_naming_the_rank() -> None:
    """Rank 0 destroys the group after one call; rank 1's next call (4 MiB: the check and
    the board's AllReduce) fails at once with an error naming rank 0's destroy, not at the
    group's timeout (10 minutes). The call both made before completed on both."""
    destroyed = threading.Event()

    def body(rank: int, make: Callable[[], OptccProcessGroup]) -> object:
        group = make()
        assert group.optcc_transport().board is not None
        # (the board's calls are cheaper than a round: they do not ride, check.ride)
        assert not group.optcc_transport().caps.ride
        t = torch.full((1 << 20,), float(rank + 1))
        group.allreduce([t]).wait()
        assert bool((t == 3.0).all())
        if rank == 0:
            group.shutdown()
            destroyed.set()
            return "destroyed"
        destroyed.wait(60)
        try:
            group.allreduce([t]).wait()
        except RuntimeError as exc:
            return str(exc)
        finally:
            group.shutdown()
        return "completed"

    first, second = on_threads(2, body)
    assert first == "destroyed", first
    assert isinstance(second, str) and "the group was destroyed on rank 0" in second, second


@pytest.mark.timeout(300)
def test_a_destroy_does_not_wait_for_a_call_of_its_own() -> None:
    """Rank 1 starts a call that rank 0 never makes, then destroys the group: the destroy
    returns (a 10-minute timeout would end the test first), the pending call fails saying
    the group was destroyed on this rank, and rank 0's next call fails naming rank 1."""
    destroyed = threading.Event()

    def body(rank: int, make: Callable[[], OptccProcessGroup]) -> object:
        group = make()
        t = torch.ones(1 << 20)
        group.allreduce([t]).wait()  # (connected)
        if rank == 1:
            work = group.allreduce([t])  # queued on the group's thread: rank 0 never comes
            group.shutdown()
            destroyed.set()
            with pytest.raises(AbortedError) as pending:
                work.wait()
            return str(pending.value)
        destroyed.wait(60)
        try:
            group.allreduce([t]).wait()
        except RuntimeError as exc:
            return str(exc)
        finally:
            group.shutdown()
        return "completed"

    first, second = on_threads(2, body)
    assert isinstance(second, str) and "destroyed on this rank (rank 1)" in second, second
    assert isinstance(first, str) and "the group was destroyed on rank 1" in first, first


def _held() -> tuple[int, int, int]:
    """This process's open files, threads (the kernel's, gloo's included) and mappings of
    /dev/shm files."""
    maps = sum(1 for line in open("/proc/self/maps") if "/dev/shm/" in line)
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")), maps


@pytest.mark.timeout(600)
def test_a_destroyed_group_leaves_nothing_behind() -> None:
    """200 optcc groups of 2 ranks, each made, used (a 1 MiB AllReduce, on the board) and
    destroyed (``shutdown``: what ``destroy_process_group`` calls, for the default group
    and a subgroup alike): the process's open files, threads and /dev/shm mappings end
    where they were after the first few groups (a small constant allowed, nothing that
    grows with the groups: each group holds four gloo groups, with sockets and threads,
    a worker thread and a mapping)."""
    groups = 200
    seen: list[tuple[int, int, int]] = []
    turn = threading.Barrier(2)

    def body(rank: int, make: Callable[[], OptccProcessGroup]) -> None:
        for i in range(groups):
            group = make()
            t = torch.full((1 << 18,), float(rank))  # 1 MiB of float32
            group.allreduce([t]).wait()
            assert bool((t == 1.0).all())
            group.shutdown()
            del group
            turn.wait(60)
            if rank == 0 and i in (4, groups - 1):
                gc.collect()
                seen.append(_held())
            turn.wait(60)

    assert on_threads(2, body) == [None, None]
    (files0, threads0, maps0), (files1, threads1, maps1) = seen
    assert files1 <= files0 + 8, (files0, files1)
    assert threads1 <= threads0 + 4, (threads0, threads1)
    assert maps1 <= maps0, (maps0, maps1)


@pytest.mark.timeout(300)
def test_a_group_beyond_the_budget_runs_on_gloo_and_its_stats_say_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/dev/shm's budget refuses the second group's board (rank 0 alone asks it, and the
    other rank learns the answer in the gather that would have carried the file): that
    group has no board on either rank, its calls (in the check, through gloo's AllReduce,
    long enough to be chunked on a board) give every rank the same, right bits, and every
    call's stats say the board was not used and why; the first group's say it was."""
    real = board.budget
    made: list[threading.Thread] = []
    first = 64 * 3 + 2 * 2 * board.slot_bytes(2, board.BLOCKS_FIRST)  # (a board's making)

    def budget(nbytes: int) -> str | None:
        if nbytes == first:
            made.append(threading.current_thread())
            if len(made) == 2:
                return "/dev/shm budget"
        return real(nbytes)

    monkeypatch.setattr(board, "budget", budget)
    sizes = [1, 1 << 14, 1 << 20]  # float32: 4 B, 64 KiB, 4 MiB

    def body(rank: int, make: Callable[[], OptccProcessGroup]) -> object:
        seen = []
        for _ in range(2):
            group = make()
            try:
                for n in sizes:
                    t = torch.arange(n, dtype=torch.float32) * (rank + 1) + 0.25
                    work = group.allreduce([t])
                    work.wait()
                    want = torch.arange(n, dtype=torch.float32) * 3 + 0.5
                    assert torch.equal(t, want), n
                    seen.append(
                        (n, work.stats["board"], work.stats["transport"], t.numpy().tobytes())
                    )
                has = group.optcc_transport().board is not None
            finally:
                group.shutdown()
            seen.append(has)
        return seen

    first, second = on_threads(2, body)
    assert first == second  # every rank: the same decisions, the same bits
    assert isinstance(first, list)
    assert [s[1] for s in first[:3]] == ["on"] * 3 and first[3] is True
    assert [s[1] for s in first[4:7]] == ["none: /dev/shm budget"] * 3 and first[7] is False
    assert {s[2] for s in first[:3] + first[4:7]} == {"gloo"}
    assert len(made) == 2 and made[0] is made[1]  # (asked on one rank, rank 0)
