"""The board: the shared-memory allgather of ranks on one machine
(optcc_mpi.transports.board).

Ranks as threads of one process (ctypes releases the GIL while a rank waits, so they
wait on each other for real) and as processes (a rank that exits). Under torchrun the
board carries the optcc backend's checks: tests/test_torch_backend.py.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from board_ranks import run_ranks, thread_allgather

from optcc_mpi import config
from optcc_mpi.errors import ArgumentError, ExecutionError
from optcc_mpi.transports import board

pytestmark = pytest.mark.skipif(not board.usable(), reason="no board: no C compiler here")


@pytest.mark.parametrize("size", [2, 3, 5])
def test_every_rank_gets_every_block_in_rank_order(size: int) -> None:
    """Blocks of changing sizes (the same size on every rank within a call, as the
    contract says), many calls back to back: each call's rows are exactly each rank's
    block, whatever the ranks' relative speed (the slots of two parities in turn)."""
    sizes = [0, 1, 96, 352, 4096, 65_536 // size, 96 + board.BLOCKS_TOTAL // size // 8, 1 << 30]
    calls = 200

    def body(rank: int, b: board.Board) -> int:
        gen = np.random.default_rng(rank)
        for i in range(calls):
            n = min(sizes[i % len(sizes)], b.slot)
            block = np.frombuffer(np.random.default_rng([i, rank]).bytes(n), np.uint8)
            out = np.full((size, n), 0xAB, dtype=np.uint8)
            b.allgather_block(block, out)
            for r in range(size):
                want = np.frombuffer(np.random.default_rng([i, r]).bytes(n), np.uint8)
                assert np.array_equal(out[r], want), (i, r)
            if gen.random() < 0.1:  # one rank late now and then
                time.sleep(0.002)
        return calls

    assert run_ranks(size, body) == [calls] * size


@pytest.mark.parametrize("size", [2, 3, 5])
def test_allreduce_in_rank_order_and_the_same_bits_everywhere(size: int) -> None:
    """The board's AllReduce: every op the torch transport sends it, sizes from one
    element to several chunks (not multiples of p), checked against the rank-order
    reduction in NumPy (the bits, not a tolerance: the order is the contract) and against
    a float64 reference; mixed with gathers on the same board, as the check and the data
    alternate on a group."""
    from optcc_mpi.reductions import reduce_with

    cases = [("sum", np.float32), ("sum", np.float64), ("sum", np.int64), ("prod", np.float64),
             ("max", np.int32), ("min", np.int8), ("bxor", np.int64)]  # fmt: skip

    def inputs(case: int, r: int, n: int, dtype: type) -> np.ndarray:
        gen = np.random.default_rng([case, r, n])
        if np.issubdtype(dtype, np.floating):
            return gen.standard_normal(n).astype(dtype)
        return gen.integers(-100, 100, n).astype(dtype)

    def body(rank: int, b: board.Board) -> int:
        checked = 0
        counts = [1, size - 1, 1001, (b.slot // 4) * 2 + 7]
        for case, (op, dtype) in enumerate(cases):
            for n in counts:
                x = inputs(case, rank, n, dtype)
                b.allreduce(x, op)
                want = inputs(case, 0, n, dtype)
                for r in range(1, size):
                    reduce_with(np, op, want, inputs(case, r, n, dtype))
                assert x.tobytes() == want.tobytes(), (op, dtype, n)
                if op == "sum" and dtype is np.float32:
                    ref = sum(inputs(case, r, n, dtype).astype(np.float64) for r in range(size))
                    assert np.allclose(x, ref, rtol=1e-5, atol=1e-5)
                rows = np.zeros((size, 8), np.uint8)  # a gather between the reductions
                b.allgather_block(np.full(8, rank, np.uint8), rows)
                assert rows[:, 0].tolist() == list(range(size))
                checked += 1
        return checked

    assert run_ranks(size, body) == [28] * size


@pytest.mark.parametrize("size", [2, 4, 32])
def test_the_checks_largest_block_travels_on_the_board(size: int) -> None:
    """The argument check's block (its header and the largest room it gives short
    messages, optcc_mpi.check.state) fits a slot, so that every check of a group on one
    machine takes the board."""
    from optcc_mpi.check.state import HEADER_BYTES, rooms

    largest = HEADER_BYTES + max(rooms(size, total=board.GATHER_TOTAL))
    assert run_ranks(size, lambda rank, b: b.fits(largest)) == [True] * size


def test_no_board_where_the_ranks_cannot_share_one() -> None:
    """Another machine, another namespace, or a rank with no board: None on every rank,
    decided before anything is made."""
    here = board.place()
    assert here is not None
    other = (here[0], here[1], here[2], "net:[1]")
    gather_of = thread_allgather(2)
    for places in ([here, other], [here, None], [None, None]):
        for rank in (0, 1):
            assert board.Board.open(rank, 2, places, gather_of(rank)) is None


def open_on_threads(size: int) -> list[board.Board | None]:
    """:meth:`Board.open` on ``size`` threads named ``rank-R``; each one's result."""
    gather_of = thread_allgather(size)
    got: list[board.Board | None] = [None] * size

    def rank_main(rank: int) -> None:
        got[rank] = board.Board.open(rank, size, [board.place()] * size, gather_of(rank))

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank-{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def test_no_room_in_dev_shm_leaves_every_rank_on_the_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 cannot reserve the file (a full /dev/shm), or another rank cannot map it:
    None on every rank (the exchange stays on the library), and nothing is left open (the
    file, nameless, went with its last descriptor)."""
    real_mmap = board.mmap.mmap
    files = len(os.listdir("/proc/self/fd"))

    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    def map_but_rank_1(fd: int, n: int) -> object:
        if threading.current_thread().name == "rank-1":
            raise OSError(12, "Cannot allocate memory")
        return real_mmap(fd, n)

    with monkeypatch.context() as m:
        m.setattr(board.os, "posix_fallocate", no_room)
        assert open_on_threads(3) == [None, None, None]
    with monkeypatch.context() as m:
        m.setattr(board.mmap, "mmap", map_but_rank_1)
        assert open_on_threads(3) == [None, None, None]
    assert len(os.listdir("/proc/self/fd")) == files
    # and with room, every rank has it
    assert all(b is not None for b in open_on_threads(3))


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTCC_BOARD", "0")
    config.reload()
    try:
        assert board.place() is None and not board.usable()
    finally:
        monkeypatch.undo()
        config.reload()
    assert board.usable()


def test_a_rank_that_never_comes_times_out_and_breaks_the_board() -> None:
    """Rank 1 stops after the first call: rank 0's second call raises within the timeout,
    naming rank 1, and a later call of rank 1 raises too (the board is broken), so no rank
    waits for one that will not come; its error names the rank at fault too (the mark on
    the board says who), not only the rank that saw it."""
    gone = threading.Event()

    def body(rank: int, b: board.Board) -> str:
        empty = np.zeros(0, np.uint8)
        rows = np.zeros((2, 0), np.uint8)
        b.allgather_block(empty, rows)
        if rank == 1:
            gone.wait(60)
            with pytest.raises(
                ExecutionError,
                match=r"rank 1 did not join an exchange within the group's timeout "
                r"\(seen by rank 0\)",
            ):
                b.allgather_block(empty, rows)
            return "raised"
        b.timeout = 0.6
        try:
            with pytest.raises(ExecutionError, match="rank 1 did not join .* 0.6 s"):
                b.allgather_block(empty, rows)
        finally:
            gone.set()
        return "timed out"

    first, second = run_ranks(2, body)
    assert second == "raised", second
    assert first == "timed out", first


def test_an_abort_wakes_the_waiting_rank() -> None:
    """The group aborted on this rank while it waits: the wait raises at its next look
    (within the slice), not at the timeout."""
    aborted = threading.Event()

    def body(rank: int, b: board.Board) -> str:
        empty, rows = np.zeros(0, np.uint8), np.zeros((2, 0), np.uint8)
        if rank == 1:
            aborted.set()
            return "away"
        threading.Timer(0.1, aborted.set).start()
        b.aborted = aborted.is_set
        with pytest.raises(ArgumentError, match="was aborted"):
            b.allgather_block(empty, rows)
        return "raised"

    assert run_ranks(2, body) == ["raised", "away"]


def _child(conn: object) -> None:  # pragma: no cover (runs in the child)
    def gather(obj: object) -> list[object]:
        conn.send(obj)  # type: ignore[attr-defined]
        return [conn.recv(), obj]  # type: ignore[attr-defined]

    b = board.Board.open(1, 2, [board.place()] * 2, gather)
    assert b is not None
    rows = np.zeros((2, 8), np.uint8)
    b.allgather_block(np.ones(8, np.uint8), rows)
    # and exits without the next call


def _joined_by_a_child_that_exits() -> tuple[
    multiprocessing.process.BaseProcess, board.Board, np.ndarray
]:
    """Rank 0 here, rank 1 a forked child that makes one exchange and exits: the child,
    the board after that exchange, and its rows."""
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_child, args=(there,))
    child.start()

    def gather(obj: object) -> list[object]:
        here.send(obj)
        return [obj, here.recv()]

    b = board.Board.open(0, 2, [board.place()] * 2, gather)
    assert b is not None
    rows = np.zeros((2, 8), np.uint8)
    b.allgather_block(np.zeros(8, np.uint8), rows)
    assert rows[1].tolist() == [1] * 8
    return child, b, rows


def test_a_rank_that_exited_is_named_within_seconds() -> None:
    child, b, rows = _joined_by_a_child_that_exits()
    child.join(60)
    with pytest.raises(ExecutionError, match=rf"rank 1 \(process {child.pid}\) exited"):
        b.allgather_block(np.zeros(8, np.uint8), rows)


def _state(pid: int) -> str:
    """The state letter of process ``pid`` (``/proc/PID/stat``, after the command's name)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


@pytest.mark.timeout(180)
def test_a_rank_that_exited_unreaped_is_named_too() -> None:
    """A rank that exited but that its parent has not reaped yet (a zombie, which
    ``kill(pid, 0)`` still finds) counts as gone: the waiting rank names it at its next
    look, not at the group's timeout. The child's parent here is the test, which reaps
    it only at the end."""
    child, b, rows = _joined_by_a_child_that_exits()
    try:
        # Reached only where the zombie is taken for a rank that is alive but late.
        b.timeout = 30.0
        with pytest.raises(ExecutionError, match=rf"rank 1 \(process {child.pid}\) exited"):
            b.allgather_block(np.zeros(8, np.uint8), rows)
        assert _state(child.pid) == "Z"  # the case under test: not reaped all along
    finally:
        child.join(60)


def test_one_abort_poll_for_the_board_and_the_torch_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """How often a wait looks whether its group was aborted is one value
    (``transports.base.ABORT_POLL``), read by the board's sleep and by the torch
    transport's polled gloo wait alike."""
    import datetime

    from optcc_mpi.transports import base
    from optcc_mpi.transports import distributed as torch_transport

    monkeypatch.setattr(base, "ABORT_POLL", 0.125)
    slices: list[float] = []

    def body(rank: int, b: board.Board) -> None:
        real = b._lib

        class Spy:  # the C library, with the wait's slice recorded
            def __getattr__(self, name: str) -> object:
                return getattr(real, name)

            def optcc_board_wait(self, *args: object) -> int:
                slices.append(cast(float, args[7]))
                return cast(int, real.optcc_board_wait(*args))

        b._lib = Spy()  # type: ignore[assignment]
        b.allgather_block(np.zeros(0, np.uint8), np.zeros((2, 0), np.uint8))

    run_ranks(2, body)
    assert slices and set(slices) == {0.125}

    polls: list[datetime.timedelta] = []

    class Work:  # a gloo collective that completes at its third look
        def wait(self, timeout: datetime.timedelta) -> None:
            polls.append(timeout)
            if len(polls) < 3:
                raise RuntimeError("Timed out")

        def is_completed(self) -> bool:
            return False

    t = object.__new__(torch_transport.TorchTransport)
    t._closed, t._abortable, t._aborted = False, True, False
    t._poll(Work())
    assert polls == [datetime.timedelta(seconds=0.125)] * 3


@pytest.mark.parametrize("fails", [False, True])
def test_a_collective_that_completes_as_its_timed_wait_expires_has_succeeded(
    fails: bool,
) -> None:
    """torch's timed wait raises "Operation timed out!" when the work is not complete at
    the deadline; the work may complete a moment later, before the poll asks. That is a
    success (the poll once re-raised the timeout: one rank's call failed and the others
    waited); a work that failed still raises its own error."""
    import datetime

    pytest.importorskip("torch")
    from optcc_mpi.transports import distributed as torch_transport

    class Work:  # completes just after the first timed wait gives up
        done = False

        def wait(self, timeout: datetime.timedelta | None = None) -> None:
            if not self.done:
                self.done = True
                raise RuntimeError("Operation timed out!")
            if fails:
                raise RuntimeError("Connection closed by peer")

        def is_completed(self) -> bool:
            return self.done

    t = object.__new__(torch_transport.TorchTransport)
    t._closed, t._abortable, t._aborted = False, True, False
    if fails:
        with pytest.raises(RuntimeError, match="closed by peer"):
            t._poll(Work())
    else:
        t._poll(Work())


def test_an_exception_inside_an_exchange_breaks_the_board_for_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exception that leaves an exchange between a post and the next (here a
    MemoryError in rank 1's reduction of its part, after it posted its chunk and before
    it posted the part) leaves rank 1 a block behind the others. Rank 1 goes on (it
    caught the error) with another AllReduce, whose first post would be taken by rank 0
    for rank 1's part of the first call: a wrong sum, silently. Instead the board is
    marked broken as the exception leaves, and both ranks raise, rank 0 naming rank 1."""
    victim: list[threading.Thread] = []
    real_reduce = board.reduce_rows

    def reduce_rows(*args: object) -> object:
        if victim and threading.current_thread() is victim[0]:
            victim.clear()
            raise MemoryError("injected between the post of the chunk and of the part")
        return real_reduce(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(board, "reduce_rows", reduce_rows)

    def body(rank: int, b: board.Board) -> object:
        b.timeout = 20.0  # (before the fix rank 1's second call waits for a part never posted)
        x = np.full(8, rank + 1.0)
        if rank == 0:
            try:
                b.allreduce(x, "sum")
            except ExecutionError as exc:
                return str(exc)
            return x.tolist()  # a result, right or wrong: the test fails on it
        victim.append(threading.current_thread())
        with pytest.raises(MemoryError):
            b.allreduce(x, "sum")
        y = np.full(8, 100.0)
        with pytest.raises(ExecutionError) as second:
            b.allreduce(y, "sum")
        return str(second.value)

    first, second = run_ranks(2, body)
    assert isinstance(first, str) and "an exception left an exchange on rank 1" in first, first
    assert isinstance(second, str) and "on rank 1" in second, second


def test_every_rank_names_the_rank_that_exited() -> None:
    """Three ranks; rank 2 exits after the first exchange. Only rank 0 can see it (rank
    1's view of rank 2's process is made to look alive), and rank 0 marks the board: rank
    1's error names rank 2 and its process too, from the mark, rather than "seen on
    another rank"."""
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()  # a process number that has exited (and was reaped)

    def body(rank: int, b: board.Board) -> str:
        empty, rows = np.zeros(0, np.uint8), np.zeros((3, 0), np.uint8)
        b.allgather_block(empty, rows)
        if rank == 2:
            return "exited"
        b.timeout = 60.0
        b.pids[2] = dead.pid if rank == 0 else os.getpid()
        with pytest.raises(ExecutionError) as err:
            b.allgather_block(empty, rows)
        return str(err.value)

    first, second, _ = run_ranks(3, body)
    assert f"rank 2 (process {dead.pid}) exited while this rank waited" in first, first
    # (rank 1's own record of rank 2's process number, which the test changed, in words)
    assert re.search(r"rank 2 \(process \d+\) exited \(seen by rank 0\)", second), second


def _rank_0_stopped_at_the_offer(conn: object) -> None:  # pragma: no cover (the child)
    def gather(obj: object) -> list[object]:
        conn.send(obj)  # type: ignore[attr-defined]  # (the file made, no peer has it yet)
        time.sleep(600)  # killed here
        return [obj]

    board.Board.open(0, 2, [board.place()] * 2, gather)


@pytest.mark.timeout(120)
def test_no_file_outlives_a_rank_0_killed_before_its_peers_mapped_it() -> None:
    """Rank 0 (a forked child) made the board's file and is killed (SIGKILL) before any
    peer mapped it: nothing is left in /dev/shm (the file never had a name), and the peer
    that then tries to open what rank 0 offered gets no board, not an error or a hang."""
    import signal

    before = set(os.listdir(board.SHM))
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_rank_0_stopped_at_the_offer, args=(there,))
    child.start()
    try:
        assert here.poll(60), "rank 0 never offered its file"
        offer = here.recv()
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(60)
    assert offer is not None  # (the file was made: the moment under test)
    left = {n for n in set(os.listdir(board.SHM)) - before if n.startswith("optcc-board-")}
    assert not left, left
    answers = iter([[offer, None], [(True, child.pid), (True, os.getpid())]])
    assert board.Board.open(1, 2, [board.place()] * 2, lambda obj: next(answers)) is None


@pytest.mark.parametrize("size", [3, 5])
def test_one_wake_up_per_exchange(size: int) -> None:
    """Only the post that completes an exchange wakes the sleepers (once), not every
    post: ranks that never spin (as where ranks outnumber the cores) sleep in every wait,
    and the wake-ups the process issued (_board.c counts its FUTEX_WAKE calls) are at
    most one per exchange, not up to one per rank's post."""
    calls = 300

    def body(rank: int, b: board.Board) -> None:
        b.spin = 0.0
        rows = np.zeros((size, 8), np.uint8)
        for i in range(calls):
            b.allgather_block(np.full(8, rank, np.uint8), rows)
            assert rows[:, 0].tolist() == list(range(size)), i

    start = board.wakes()
    assert run_ranks(size, body) == [None] * size
    assert board.wakes() - start <= calls


# -- its size and the /dev/shm budget (issue 43) ---------------------------------------------
def open_states(size: int, groups: int) -> list[list[tuple[board.Board | None, str]]]:
    """``groups`` boards of ``size`` ranks opened one after another on ``size`` threads
    (:meth:`Board.opened`); per rank, each one's ``(board, state)``."""
    got: list[list[tuple[board.Board | None, str]]] = [[] for _ in range(size)]
    gathers = [thread_allgather(size) for _ in range(groups)]

    def rank_main(rank: int) -> None:
        for g in range(groups):
            places = [board.place()] * size
            got[rank].append(board.Board.opened(rank, size, places, gathers[g](rank)))

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank-{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return got


@pytest.fixture
def shm64(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    """A real 64 MiB tmpfs (Docker's default /dev/shm), mounted for the test (root only)
    and made the boards' directory; unmounted after (every board on it let go first)."""
    import gc
    import subprocess

    where = tmp_path / "shm"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)],
        capture_output=True,
        timeout=30,
    )
    if mounted.returncode != 0:
        pytest.skip("a 64 MiB tmpfs cannot be mounted here (needs root)")
    monkeypatch.setattr(board, "SHM", where)
    # The process's count of what its boards hold starts from nothing on this new file
    # system: boards of earlier tests that something still holds (a stored error's frames)
    # are in /dev/shm, not here.
    gc.collect()
    monkeypatch.setattr(board, "_held", 0)
    try:
        yield where
    finally:
        gc.collect()  # (the boards' mappings, so that the file system is not busy)
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def _used(where: Path) -> int:
    st = os.statvfs(where)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.mark.timeout(240)
def test_thirty_groups_leave_a_64_mib_dev_shm_room_for_a_32_mib_file(shm64: Path) -> None:
    """In a 64 MiB /dev/shm (a real tmpfs), 30 groups of 2 ranks each get a board, the
    boards together within the budget (a quarter of it: 30 x 516 KiB), and their long
    AllReduces, which would grow them, are refused the room and stay correct in more
    chunks; a 32 MiB file can then still be written there (the DataLoader that failed
    with 'No space left on device' beside 8 MiB boards). Boards beyond the budget are
    none, on every rank, saying why; the process's count of what it holds goes back to
    where it was once the boards are let go."""
    import gc

    gc.collect()  # (boards of earlier tests let go now, not during this one)
    start = board.held()
    got = open_states(2, 34)
    states = [[state for _, state in rank] for rank in got]
    assert states[0] == states[1]  # every rank decides the same, group by group
    on = states[0].count("on")
    assert on >= 30, states[0]
    assert set(states[0][on:]) <= {"none: /dev/shm budget"}, states[0]
    assert states[0][:on] == ["on"] * on  # (refused only once the budget is spent)
    per = -(-(64 * 3 + 2 * 2 * (131_072 + 512)) // 4096) * 4096  # 516 KiB: whole pages
    assert _used(shm64) == on * per
    assert board.held() - start == on * per
    assert _used(shm64) <= board.SHARE * (64 << 20)

    # A long AllReduce on the first group: growing it would pass the budget, so it runs
    # in 128 KiB chunks, and is right to the bit on both ranks.
    boards = [got[r][0][0] for r in range(2)]
    n = (1 << 20) + 3  # float32: 4 MiB, 32 chunks

    def reduce_on(rank: int) -> bytes:
        b = boards[rank]
        assert b is not None
        x = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
        b.allreduce(x, "sum")
        assert b.total == board.BLOCKS_FIRST and not b.growing  # (refused: not tried again)
        return x.tobytes()

    results = _on_threads(2, reduce_on)
    want = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    want += np.random.default_rng(1).standard_normal(n).astype(np.float32)
    assert results[0] == results[1] == want.tobytes()
    assert _used(shm64) == on * per  # (no file left by the refused growth)

    big = shm64 / "dataloader"
    with open(big, "wb") as f:  # 32 MiB written, page by page, in a 64 MiB /dev/shm
        for _ in range(32):
            f.write(b"\1" * (1 << 20))
    big.unlink()
    del got
    boards.clear()
    gc.collect()
    assert _used(shm64) == 0
    assert board.held() == start


def _on_threads(size: int, body: Callable[[int], object]) -> list[object]:
    """``body(rank)`` on ``size`` threads; each one's result (raised again here)."""
    results: list[object] = [None] * size

    def rank_main(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as exc:  # reported to the test
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank-{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.mark.timeout(240)
def test_a_board_grows_once_into_a_file_of_the_size_designed(shm64: Path) -> None:
    """A board's files are the size designed (asserted against the tmpfs's own count of
    its pages): 516 KiB at its making, then, for a 16 MiB AllReduce, a second file of
    slots of 4 MiB in all per parity (the most); its result the rank-order sum on every
    rank, to the bit; a later call grows it no more."""
    n = 4 << 20  # float32: 16 MiB per rank
    first = 64 * 3 + 2 * 2 * (131_072 + 512)

    def pages(nbytes: int) -> int:
        return -(-nbytes // 4096) * 4096

    grown = 2 * 2 * ((4 << 20) // 2 + 512)

    def body(rank: int, b: board.Board) -> bytes:
        assert b.nbytes == first and b.slot == 131_072 + 512 and b.total == board.BLOCKS_FIRST
        x = np.random.default_rng([7, rank]).standard_normal(n).astype(np.float32)
        b.allreduce(x, "sum")
        assert (b.total, b.slot, b.nbytes) == (board.BLOCKS_TOTAL, (2 << 20) + 512, first + grown)
        assert not b.growing
        assert _used(shm64) == pages(first) + pages(grown)  # (the file system's own count)
        y = np.full(n, float(rank), np.float32)
        b.allreduce(y, "sum")
        assert b.nbytes == first + grown and bool((y == 1.0).all())
        return x.tobytes()

    results = run_ranks(2, body)
    want = np.random.default_rng([7, 0]).standard_normal(n).astype(np.float32)
    want += np.random.default_rng([7, 1]).standard_normal(n).astype(np.float32)
    assert results[0] == results[1] == want.tobytes()
    import gc

    gc.collect()
    assert _used(shm64) == 0


@pytest.mark.parametrize("size", [2, 3, 4])
def test_the_board_grows_to_the_least_size_that_holds_the_call(size: int) -> None:
    """Sizes as designed, on /dev/shm: the first file holds the control line, every
    rank's sequence number and two parities of 256 KiB of slots; an AllReduce longer than
    a slot grows them to the least power of two times 256 KiB whose slot holds it (here
    1 MiB per rank: 4 MiB of slots at 3 and 4 ranks, 2 MiB at 2), and one longer than the
    largest chunk to 4 MiB, and chunks it; every result the rank-order reduction, the
    same bits on every rank."""
    from optcc_mpi.reductions import reduce_with

    def inputs(r: int, n: int) -> np.ndarray:
        return np.random.default_rng([r, n]).standard_normal(n)  # float64

    seen: list[tuple[int, int, int]] = []

    def body(rank: int, b: board.Board) -> list[bytes]:
        slot = -(-((256 << 10) // size + 512) // 64) * 64
        assert (b.total, b.slot, b.nbytes) == (256 << 10, slot, 64 * (1 + size) + 2 * size * slot)
        out = []
        for n in (100, (1 << 20) // 8, (24 << 20) // 8 // size):
            x = inputs(rank, n)
            b.allreduce(x, "sum")
            out.append(x.tobytes())
            if rank == 0:
                seen.append((n * 8, b.total, b.slot))
        return out

    results = run_ranks(size, body)
    for i, n in enumerate((100, (1 << 20) // 8, (24 << 20) // 8 // size)):
        want = inputs(0, n)
        for r in range(1, size):
            reduce_with(np, "sum", want, inputs(r, n))
        assert all(cast(list, res)[i] == want.tobytes() for res in results), (size, n)
    mib = 1 << 20
    grown = 2 * mib if size == 2 else 4 * mib
    assert [total for _, total, _ in seen] == [256 << 10, grown, 4 * mib]
    assert all(slot == board.slot_bytes(size, total) for _, total, slot in seen)


def test_a_growth_refused_keeps_the_board_and_its_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget refuses the larger file (rank 0 asks it; here it would allow it on rank
    1, which is never asked): every rank keeps the board as it is, the call runs in 128
    KiB chunks, right and the same on both ranks, and no later call asks again."""
    asked: list[str] = []

    def budget(nbytes: int) -> str | None:
        asked.append(threading.current_thread().name)
        if len(asked) == 1:
            return None  # (the board's own making)
        return "/dev/shm budget" if threading.current_thread().name == "rank-0" else None

    monkeypatch.setattr(board, "budget", budget)
    got = open_states(2, 1)
    boards = [got[r][0][0] for r in range(2)]
    n = 300_001

    def body(rank: int) -> bytes:
        b = boards[rank]
        assert b is not None
        x = np.arange(n, dtype=np.int64) * (rank + 1)
        b.allreduce(x, "sum")
        b.allreduce(x, "sum")  # (not asked again)
        assert b.total == board.BLOCKS_FIRST and not b.growing
        return x.tobytes()

    results = _on_threads(2, body)
    assert results[0] == results[1] == (np.arange(n, dtype=np.int64) * 6).tobytes()
    assert asked == ["rank-0", "rank-0"]


def test_a_board_beyond_the_budget_is_none_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm (a fake statvfs: 64 MiB, as good as full) leaves no room: rank 0 refuses
    the board and every rank gets none, saying why, though the other ranks would find
    room (they are never asked); and the two rules of the budget, each alone."""
    real = os.statvfs

    def statvfs_of(free_mib: float) -> Callable[[object], object]:
        def statvfs(path: object) -> object:
            st = real(path)  # type: ignore[arg-type]
            if threading.current_thread().name != "rank-0" or Path(str(path)) != board.SHM:
                return st

            class Fake:
                f_frsize = 4096
                f_blocks = (64 << 20) // 4096
                f_bavail = f_bfree = int(free_mib * (1 << 20)) // 4096

            return Fake()

        return statvfs

    monkeypatch.setattr(board, "_held", 0)  # (as a process with no other board)
    monkeypatch.setattr(board.os, "statvfs", statvfs_of(32.4))
    got = open_states(3, 1)
    assert [got[r][0] for r in range(3)] == [(None, "none: /dev/shm budget")] * 3
    monkeypatch.setattr(board.os, "statvfs", statvfs_of(40))  # (room for half and more)
    got = open_states(3, 1)
    assert [got[r][0][1] for r in range(3)] == ["on"] * 3
    del got
    # The process's share, a quarter of 64 MiB, spent: none, however much is free.
    monkeypatch.setattr(board, "_held", 16 << 20)
    got = open_states(3, 1)
    assert [got[r][0] for r in range(3)] == [(None, "none: /dev/shm budget")] * 3
