"""The gather limit's decision (``optcc_mpi.check.crossover``), without MPI: which limit the
measured times give, what ``$OPTCC_GATHER_LIMIT`` gives, and where nothing is measured.
Decisions only, never times: the times here are made up. The collective side (every rank
decides alike, both paths on either side of the limit) is ``tests/test_fastcall_mpi.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from optcc_mpi import config
from optcc_mpi.check import crossover, protocol
from optcc_mpi.check.state import FOLD_MIN, FOLD_TOTAL, CheckState, room_for, rooms, served
from optcc_mpi.errors import ArgumentError

SIZES = list(rooms(2))  # 256 B to 128 KiB


def test_rooms() -> None:
    assert SIZES[0] == FOLD_MIN and SIZES[-1] == FOLD_TOTAL // 2
    assert all(b == 2 * a for a, b in zip(SIZES, SIZES[1:]))
    assert rooms(64) == tuple(FOLD_MIN << k for k in range(5))  # to 4 KiB
    assert rooms(4096) == (FOLD_MIN,)
    assert rooms(2, 4096) == (256, 512, 1024, 2048, 4096)
    assert crossover.static(2) == FOLD_TOTAL // 2
    # The measurement's block is the check's: header as protocol's.
    assert crossover.HEADER_BYTES == protocol.HEADER_BYTES


def _times(cross: int, spike: dict[int, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Gathering costs p times the bytes: cheaper below ``cross`` bytes, dearer above."""
    n = np.asarray(SIZES, dtype=float)
    gather = 2e-6 + n * 4e-10
    library = 2e-6 + 4e-10 * cross + (n - cross) * 2e-10
    for size, factor in (spike or {}).items():
        gather[SIZES.index(size)] *= factor
    return gather, library


@pytest.mark.parametrize("cross", [1024, 16384, 65536])
def test_limit_at_the_crossover(cross: int) -> None:
    gather, library = _times(cross)
    assert crossover.choose(SIZES, gather, library) == cross


def test_one_way_always_faster() -> None:
    n = np.asarray(SIZES, dtype=float)
    assert crossover.choose(SIZES, n, 2 * n) == SIZES[-1]  # gather everything
    assert crossover.choose(SIZES, 2 * n, n) == SIZES[0]  # the least room: 256 bytes


def test_a_spike_at_one_size_does_not_move_the_limit() -> None:
    """One size measured slow for gathering (disturbed, or a library's own threshold)
    costs a little at that size; a limit below it would cost more at every size above."""
    gather, library = _times(65536, spike={8192: 4.5})
    assert gather[SIZES.index(8192)] > 1.3 * library[SIZES.index(8192)]
    assert crossover.choose(SIZES, gather, library) == 65536


def test_near_ties_go_to_gathering() -> None:
    """Within the tolerance the larger limit wins (one collective, rank order)."""
    n = np.asarray(SIZES, dtype=float)
    gather = 1e-6 + n * 1e-10
    library = gather / 1.03  # 3% faster everywhere: within TOLERANCE
    assert crossover.choose(SIZES, gather, library) == SIZES[-1]
    assert crossover.choose(SIZES, gather, gather / 1.2) == SIZES[0]
    # Faster by 10% from 16 KiB on: the library from there.
    library = np.where(n >= 16384, gather / 1.1, gather * 1.5)
    assert crossover.choose(SIZES, gather, library) == 8192


def test_choose_refuses_mismatched_times() -> None:
    with pytest.raises(ArgumentError, match="one time per size"):
        crossover.choose(SIZES, [1.0], [1.0, 2.0])


def test_room_for_and_served_are_one_rule() -> None:
    """The room a message asks for, and the sizes a room serves (what the compiled path
    is given instead of a copy of the rule), agree for every size and limit."""
    for p in (2, 3, 8, 32):
        for limit in (0, FOLD_MIN, 1000, 4096, FOLD_TOTAL // p):
            table = rooms(p, limit) if limit else (FOLD_MIN,)
            for n in range(1, 2 * table[-1] + 3, 37):
                room = room_for(p, n, limit)
                assert room in table
                for r in table:
                    lo, hi = served(p, r, limit)
                    assert (lo < n <= hi) == (room == r and n <= r), (p, limit, n, r)
    assert served(2, 8192, 4096) == (0, 0)  # a room above the limit serves nothing


class _Wire:
    """A transport of one rank pretending to be ``size`` (max over ranks: itself); with
    ``compiled``, one the compiled path could drive (as MPI's), whose limit is measured."""

    gather_total: int | None = None

    def __init__(self, compiled: bool = True, size: int = 2) -> None:
        self.name, self.size, self.rank = "mpi" if compiled else "gloo", size, 0
        self.maxed = 0
        if compiled:
            self.private = None
            self.predefined = lambda dtype_name, op: None

    def allreduce_max(self, vec: np.ndarray) -> None:
        self.maxed += 1


def _state(wire: _Wire) -> CheckState:
    st = CheckState(wire)  # type: ignore[arg-type]
    st.make_compiled(lambda chk: object())
    return st


@pytest.fixture
def setting(monkeypatch: pytest.MonkeyPatch):
    def set_to(text: str | None) -> None:
        if text is None:
            monkeypatch.delenv("OPTCC_GATHER_LIMIT", raising=False)
        else:
            monkeypatch.setenv("OPTCC_GATHER_LIMIT", text)
        config.reload()

    return set_to


def _made_up(monkeypatch: pytest.MonkeyPatch, repetitions: list[np.ndarray]) -> list[int]:
    """The measurement's repetitions replaced by ``repetitions`` (each (2, sizes)), in
    turn; returns the list the number of repetitions taken is appended to."""
    taken: list[int] = []
    monkeypatch.setattr(crossover, "_cases", lambda transport, sizes: [None] * len(sizes))

    def one(cases: list[Any]) -> np.ndarray:
        taken.append(1)
        return repetitions[(len(taken) - 1) % len(repetitions)].ravel()

    monkeypatch.setattr(crossover, "_repetition", one)
    return taken


def test_decide_measures_once(setting: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    setting(None)
    taken = _made_up(monkeypatch, [np.stack(_times(8192))])
    st = _state(_Wire())
    assert st.compiled is not None
    assert st.limit_known == FOLD_MIN  # not decided yet: the least room
    assert crossover.decide(st) == 8192
    assert len(taken) == crossover.FIRST  # every repetition agreed: no more taken
    assert st.transport.maxed == 1 + crossover.FIRST  # the setting, then each repetition
    assert st.compiled is None  # the compiled path's context is made again with the limit
    assert crossover.decide(st) == 8192 and len(taken) == crossover.FIRST
    assert st.limit_known == 8192
    assert "8KiB" in crossover.describe(st)


def test_repetitions_that_disagree_leave_sizes_to_gathering(
    setting: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Load that makes the repetitions disagree (here: from 2 KiB up the faster way
    alternates) gives those sizes no verdict: they are gathered, as before any
    measurement; more repetitions were tried first."""
    setting(None)
    a = np.stack(_times(1024))  # the library faster from 2 KiB
    b = np.stack(_times(1 << 20))  # gathering faster everywhere
    taken = _made_up(monkeypatch, [a, b])
    assert crossover.decide(_state(_Wire())) == crossover.static(2)
    assert crossover.FIRST < len(taken) <= crossover.MOST  # (or until the budget ran out)
    # Three of four repetitions agreeing is a verdict.
    taken = _made_up(monkeypatch, [a, a, a, b])
    assert crossover.decide(_state(_Wire())) == 1024


def test_the_budget_bounds_the_measurement(setting: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine so loaded that one repetition takes the whole budget, measuring stops
    there, and with too few repetitions for any verdict every size is gathered."""
    setting(None)
    slow = np.stack(_times(1024)) * (crossover.BUDGET / 1e-4)
    taken = _made_up(monkeypatch, [slow])
    assert crossover.decide(_state(_Wire())) == crossover.static(2)
    assert len(taken) == 1


def test_verdicts() -> None:
    """The median of the per-repetition ratios where at least AGREE of the repetitions
    agree on the faster way (or the two are within TOLERANCE), else a tie."""
    g = np.array([[1.0, 1.0, 2.0], [1.0, 3.0, 2.0], [1.0, 1.0, 2.0], [1.0, 3.0, 0.5]])
    times = np.stack([g, np.full_like(g, 2.0)], axis=1)  # library: 2.0 everywhere
    v = crossover.verdicts(times)
    np.testing.assert_allclose(v, [0.5, 1.0, 1.0])  # 0.5: all agree; then 2 of 4; then 3
    # of 4 agree on "tie" (1.0): a tie
    assert crossover.verdicts(times[:2]).tolist() == [1.0, 1.0, 1.0]  # too few to judge


@pytest.mark.parametrize(
    "text, limit", [("0", FOLD_MIN), ("3000", 2048), ("16K", 16384), ("1G", FOLD_TOTAL // 2)]
)
def test_setting_fixes_the_limit(
    setting: Any, monkeypatch: pytest.MonkeyPatch, text: str, limit: int
) -> None:
    setting(text)
    monkeypatch.setattr(crossover, "_cases", lambda *a: pytest.fail("measured"))
    assert crossover.decide(_state(_Wire())) == limit


def test_bad_setting(setting: Any) -> None:
    setting("lots")
    wire = _Wire()
    with pytest.raises(ArgumentError, match="OPTCC_GATHER_LIMIT='lots'"):
        crossover.decide(_state(wire))
    assert wire.maxed == 1  # the other ranks heard of it in the same collective


def test_nothing_measured_over_torch(setting: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    setting(None)
    monkeypatch.setattr(crossover, "_cases", lambda *a: pytest.fail("measured"))
    assert crossover.decide(_state(_Wire(compiled=False, size=4))) == FOLD_TOTAL // 4


def test_a_cheap_gather_gathers_longer_messages(setting: Any) -> None:
    """A transport whose gather is cheap (the board of ranks on one machine) declares
    how much every rank's block together may hold: the limit is its share, a power of two
    (and the rooms the check can have go that far)."""
    setting(None)
    wire = _Wire(compiled=False, size=3)
    wire.gather_total = 3 << 20
    assert crossover.decide(_state(wire)) == 1 << 20
    assert rooms(3, total=wire.gather_total)[-1] == 1 << 20
    assert room_for(3, (1 << 20) - 1, 1 << 20) == 1 << 20
