"""The rank-order reduction, written three times, held to the same bits (issue 44).

Every rank that reduces p ranks' contributions element-wise in rank order 0, 1, ..., p-1
gets the same bits. Three implementations do it: the Python paths'
:func:`optcc_mpi.reductions.reduce_rows` (the argument check's
:func:`~optcc_mpi.check.protocol.reduce_gathered` and the host gather of
:mod:`optcc_mpi.collectives`), the board's reduce-scatter
(:meth:`optcc_mpi.transports.board.Board.allreduce`, ranks as threads sharing one board)
and the compiled path's sum (``check/_fastcall.c``, through
:func:`optcc_mpi.check.fastcall.sum_rows` and ``reduce_gathered``). On random rows with
sums that cancel (so that another order rounds differently: checked), NaNs of different
payloads and signs (which NaN a sum returns depends on the order too) and infinities, each
must give exactly the bits of the rows folded in rank order by
:func:`optcc_mpi.reductions.reduce_with`, one step at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
from board_ranks import run_ranks

from optcc_mpi.check import fastcall, protocol
from optcc_mpi.check.state import HEADER_BYTES, CheckState
from optcc_mpi.reductions import reduce_rows, reduce_with
from optcc_mpi.transports import board

DTYPES = [
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.int32),
    np.dtype(np.int64),
    np.dtype(np.uint8),
]
OPS = ["sum", "prod", "min", "max"]
SIZES = range(2, 9)
N = 1501  # (odd: the board's parts are uneven)
#: Per float type, the exponent bits of a NaN and its quiet bit.
_NAN_BITS = {
    np.dtype(np.float16): (0x7C00, 0x0200),
    np.dtype(ml_dtypes.bfloat16): (0x7F80, 0x0040),
    np.dtype(np.float32): (0x7F800000, 0x00400000),
    np.dtype(np.float64): (0x7FF0000000000000, 0x0008000000000000),
}


def _rows(dtype: np.dtype, op: str, p: int, seed: int) -> np.ndarray:
    """``p`` rows of ``N`` elements: for floats, large values that cancel across ranks
    beside small ones, NaNs of several payloads and both signs, infinities, signed zeros;
    for integers, the whole range (sums and products wrap)."""
    rng = np.random.default_rng([seed, p, DTYPES.index(dtype), OPS.index(op)])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, (p, N), dtype=dtype, endpoint=True)
    if op == "prod":  # magnitudes around 1, so that products neither vanish nor overflow
        x = rng.uniform(0.5, 2.0, (p, N)) * rng.choice([-1.0, 1.0], (p, N))
    else:
        big = {2: 1e3, 4: 1e7, 8: 1e15}[dtype.itemsize]
        x = rng.choice([-big, big], (p, N)) * rng.uniform(0.5, 1.0, (p, N))
        x += rng.normal(0.0, 1.0, (p, N))
    rows = x.astype(dtype)
    width = np.dtype(f"u{dtype.itemsize}")
    bits = rows.view(width)
    # A NaN's bits: the exponent all ones, the quiet bit, a payload below it.
    exp, quiet = _NAN_BITS[dtype]
    sign = 1 << (8 * dtype.itemsize - 1)

    def nan(payload: int, negative: bool) -> np.integer:
        return width.type(exp | quiet | payload | (sign if negative else 0))

    # Special values in the first columns, on a rank or two each (the rest stay ordinary).
    for c in range(40):
        r = int(rng.integers(0, p))
        kind = c % 5
        if kind == 0:  # a NaN with a payload of its own, either sign
            bits[r, c] = nan(int(rng.integers(1, 8)), bool(c % 2))
        elif kind == 1:
            rows[r, c] = np.inf
        elif kind == 2:
            rows[r, c] = -np.inf
        elif kind == 3:
            rows[:, c] = dtype.type(-0.0)
        else:  # NaNs on two ranks: which one a sum keeps depends on the order
            a, b = rng.choice(p, 2, replace=False)
            bits[a, c] = nan(1, False)
            bits[b, c] = nan(2, True)
    return rows


def _fold(op: str, rows: np.ndarray, order: range | list[int]) -> np.ndarray:
    """The rows reduced one :func:`reduce_with` step at a time, in ``order``."""
    order = list(order)
    out = rows[order[0]].copy()
    with np.errstate(all="ignore"):
        for r in order[1:]:
            reduce_with(np, op, out, rows[r])
    return out


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


def _same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    bad = np.flatnonzero(_bits(got) != _bits(want))
    assert bad.size == 0, (
        f"{what}: {bad.size} elements differ from the rank-order fold, first at "
        f"{bad[0]}: {got[bad[0]]!r} ({_bits(got)[bad[0]]:#x}) != {want[bad[0]]!r} "
        f"({_bits(want)[bad[0]]:#x})"
    )


class _Transport:
    """What a CheckState reads of its transport."""

    def __init__(self, size: int) -> None:
        self.size, self.rank = size, 0


def _protocol(op: str, rows: np.ndarray, compiled: bool) -> np.ndarray:
    """The argument check's reduction of ``rows`` gathered as the check gathers them
    (with ``compiled``, the C sum where the compiled path has one)."""
    p, n = rows.shape
    nbytes = n * rows.dtype.itemsize
    st = CheckState(_Transport(p))  # type: ignore[arg-type]
    st.use_room(nbytes)
    st.gathered[:, HEADER_BYTES : HEADER_BYTES + nbytes] = rows.view(np.uint8).reshape(p, -1)
    out = np.empty(n, rows.dtype)
    if compiled:
        protocol.reduce_gathered(st, op, rows.dtype, nbytes, out)
    else:
        kind = fastcall.reduce_kind
        try:
            fastcall.reduce_kind = lambda name: 0  # type: ignore[assignment]
            protocol.reduce_gathered(st, op, rows.dtype, nbytes, out)
        finally:
            fastcall.reduce_kind = kind  # type: ignore[assignment]
    return out


def _c_sum(rows: np.ndarray) -> np.ndarray | None:
    """``_fastcall.c``'s rank-order sum of ``rows`` (None where it has none)."""
    kind = fastcall.reduce_kind(rows.dtype.name)
    if not kind:
        return None
    p, n = rows.shape
    offset = 96
    gathered = np.zeros((p, offset + rows.itemsize * n + 40), np.uint8)
    gathered[:, offset : offset + rows.itemsize * n] = rows.view(np.uint8).reshape(p, -1)
    out = np.empty(n, rows.dtype)
    fastcall.sum_rows(kind, out, gathered, offset)
    return out


def _on_a_board(p: int, body: Callable[[int, board.Board], object]) -> list[object]:
    """``body(rank, board)`` on ``p`` threads sharing one board; each one's result (a
    rank's exception raised)."""
    results = run_ranks(p, body, timeout=300)
    for res in results:
        if isinstance(res, BaseException):
            raise res
    return results


CASES = [(dt, op) for dt in DTYPES for op in OPS]


@pytest.mark.parametrize("p", SIZES)
def test_python_and_compiled_paths_reduce_in_rank_order(p: int) -> None:
    for seed in range(3):
        for dtype, op in CASES:
            rows = _rows(dtype, op, p, seed)
            want = _fold(op, rows, range(p))
            what = f"{dtype.name} {op} p={p} seed={seed}"
            _same(_protocol(op, rows, compiled=False), want, f"reduce_gathered, Python: {what}")
            _same(_protocol(op, rows, compiled=True), want, f"reduce_gathered: {what}")
            out = np.empty_like(want)
            reduce_rows(np, op, out, list(rows))
            _same(out, want, f"reduce_rows: {what}")
            if op == "sum":
                c = _c_sum(rows)
                if c is not None:
                    _same(c, want, f"_fastcall.c sum: {what}")


@pytest.mark.skipif(not board.usable(), reason="no board: no C compiler here")
@pytest.mark.parametrize("p", SIZES)
def test_the_boards_reduction_is_in_rank_order(p: int) -> None:
    """Every rank of the board holds the rank-order fold's bits (each element is reduced
    by one rank, from every rank's slot)."""
    seeds = range(2)
    data = {(dt, op, s): _rows(dt, op, p, s) for dt, op in CASES for s in seeds}

    def body(rank: int, b: board.Board) -> dict[tuple[np.dtype, str, int], np.ndarray]:
        out = {}
        for (dt, op, s), rows in data.items():
            mine = rows[rank].copy()
            b.allreduce(mine, op)
            out[(dt, op, s)] = mine
        return out

    got = _on_a_board(p, body)
    for key, rows in data.items():
        want = _fold(key[1], rows, range(p))
        for rank in range(p):
            res = got[rank]
            assert isinstance(res, dict)
            _same(res[key], want, f"Board.allreduce on rank {rank}: {key[0].name} {key[1]} p={p}")


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.kind == "f"])
@pytest.mark.parametrize("op", ["sum", "prod"])
def test_the_rows_make_the_order_matter(dtype: np.dtype, op: str) -> None:
    """The data can tell orders apart: folded in another order (reversed, or rank 0
    last) the float sums and products differ in some bits (at two ranks, one step: only
    the NaN two ranks meet with tells), so an implementation that reduced in another
    order would fail the tests above."""
    for p in SIZES:
        rows = _rows(dtype, op, p, 0)
        want = _fold(op, rows, range(p))
        for order in (range(p - 1, -1, -1), [*range(1, p), 0]):
            differ = _bits(_fold(op, rows, order)) != _bits(want)
            assert differ.any(), (p, list(order))
            if p > 2:  # (not only in the NaNs: the rounding too)
                assert differ[~np.isnan(want)].any(), (p, list(order))
