"""Ranks as threads sharing one board (:mod:`optcc_mpi.transports.board`), for the tests
of the board and of the reductions that run on it: ctypes releases the GIL while a rank
waits, so threads stand in for processes."""

from __future__ import annotations

import threading
from collections.abc import Callable

from optcc_mpi.transports import board


def thread_allgather(size: int) -> Callable[[int], Callable[[object], list[object]]]:
    """An allgather among ``size`` threads: ``gather_of(rank)(obj)``."""
    slots: list[object] = [None] * size
    first, second = threading.Barrier(size), threading.Barrier(size)

    def gather_of(rank: int) -> Callable[[object], list[object]]:
        def gather(obj: object) -> list[object]:
            slots[rank] = obj
            first.wait()
            got = list(slots)
            second.wait()
            return got

        return gather

    return gather_of


def run_ranks(
    size: int, body: Callable[[int, board.Board], object], timeout: float = 120
) -> list[object]:
    """``body(rank, board)`` on ``size`` threads sharing one board; each one's result (an
    exception is returned, not raised). A rank still running after ``timeout`` seconds
    fails the test."""
    gather_of = thread_allgather(size)
    places = [board.place()] * size
    results: list[object] = [None] * size

    def rank_main(rank: int) -> None:
        try:
            b = board.Board.open(rank, size, places, gather_of(rank))
            assert b is not None
            results[rank] = body(rank, b)
        except BaseException as exc:  # reported to the test
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results
