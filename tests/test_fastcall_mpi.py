"""The compiled call path of short AllReduces (``optcc_mpi.fastcall``) under MPI.

It must take the commonest short calls, give the same bits as the Python path (ranks on
either path together included), and decline everything else having touched nothing, so
that the Python path's errors stay what they were. Run under mpiexec at 2 to 8 ranks.
"""

from __future__ import annotations

import array
import zlib
from collections import Counter
from typing import Any

import numpy as np
import pytest

import optcc_mpi
from optcc_mpi import collectives, config, fastcall
from optcc_mpi.collectives import last_stats
from optcc_mpi.state import FOLD_MIN, FOLD_TOTAL

MPI = pytest.importorskip("mpi4py.MPI")
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


@pytest.fixture
def answers(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """What the compiled path answered, counted by name, during one test."""
    assert fastcall.available(), "the install builds optcc_mpi/_fastcall.c (make install)"
    seen: Counter = Counter()
    names = {fastcall.FALLBACK: "fallback", fastcall.DONE: "done", fastcall.GATHERED: "gathered"}
    names[fastcall.MISMATCH] = "mismatch"
    real = collectives._FOLD or fastcall.fold_function()

    def counted(*args: Any) -> int:
        answer = real(*args)
        seen[names.get(answer, "mpi error")] += 1
        return answer

    monkeypatch.setattr(collectives, "_FOLD", counted)
    monkeypatch.delenv("OPTCC_LINKS", raising=False)
    config.reload()
    monkeypatch.delenv("OPTCC_EMULATE", raising=False)
    config.reload()
    return seen


def _inputs(dtype: str, n: int, rank: int, p: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, n])
    if np.dtype(dtype).kind in "iu":
        return [rng.integers(-1000, 1000, n).astype(dtype) for _ in range(p)]
    if np.dtype(dtype).kind == "c":
        return [
            (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype) for _ in range(p)
        ]
    return [
        (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype) for _ in range(p)
    ]


def _same_everywhere(y: np.ndarray) -> None:
    """Bit-identical on every rank."""
    digest = zlib.crc32(np.ascontiguousarray(y).view(np.uint8).tobytes())
    assert len(set(MPI.COMM_WORLD.allgather(digest))) == 1


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "float16", "complex128"])
@pytest.mark.parametrize("n", [1, 7, 256, 4096])
def test_short_calls_take_the_compiled_path(answers: Counter, dtype: str, n: int) -> None:
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    if p == 1 or p > collectives.GATHER_MAX_P:
        pytest.skip("the compiled path serves 2 to GATHER_MAX_P ranks")
    fits = n * np.dtype(dtype).itemsize <= max(FOLD_MIN, FOLD_TOTAL // p)
    xs = _inputs(dtype, n, rank, p, seed=3)
    exact = np.sum(
        [x.astype(np.complex128 if dtype == "complex128" else np.float64) for x in xs], axis=0
    )
    for call in range(4):
        out = np.full(n, 7, dtype=dtype)
        got = optcc_mpi.allreduce(xs[rank], out) if call % 2 else optcc_mpi.allreduce(xs[rank])
        if call % 2:
            assert got is out
        assert got.dtype == np.dtype(dtype) and got.shape == (n,)
        if np.dtype(dtype).kind in "iu":
            np.testing.assert_array_equal(got, exact.astype(dtype))
        else:
            tol = {"float16": 2e-2, "float32": 1e-5}.get(dtype, 1e-12)
            np.testing.assert_allclose(got, exact, rtol=tol, atol=tol * np.abs(exact).max())
        _same_everywhere(got)
        # From the second call the room fits this size: the data travels in the check.
        if call or not fits:
            assert last_stats()["inline"] == fits
    # The first call of a size finds no context or the wrong room; from then on C takes it
    # (reducing in C for the four sums it has, else leaving the rows to NumPy).
    taken = answers["done"] + answers["gathered"]
    if not fits:  # beyond the check's room: the library's AllReduce, from Python
        assert taken == 0, answers
        return
    assert taken >= 2, answers
    assert answers["mismatch"] == answers["mpi error"] == 0
    if dtype in ("float32", "float64", "int32", "int64"):
        assert answers["gathered"] == 0


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_in_place_and_check_false(answers: Counter, op: str) -> None:
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    if p == 1 or p > collectives.GATHER_MAX_P:
        pytest.skip("the compiled path serves 2 to GATHER_MAX_P ranks")
    xs = _inputs("float64", 33, rank, p, seed=5)
    want = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}[op](xs, axis=0)
    for check in (True, False, True, False):
        buf = xs[rank].copy()
        assert optcc_mpi.allreduce(optcc_mpi.IN_PLACE, buf, op=op, check=check) is buf
        np.testing.assert_allclose(buf, want, rtol=1e-12)
        _same_everywhere(buf)
    assert answers["done"] + answers["gathered"] >= 2


def test_ranks_on_either_path_agree(answers: Counter) -> None:
    """Rank 0 passes NumPy arrays (compiled path), the others array.array buffers (Python
    path): the same header, the same bits."""
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    if p == 1 or p > collectives.GATHER_MAX_P:
        pytest.skip("the compiled path serves 2 to GATHER_MAX_P ranks")
    special = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-300, -1e300, 3.0], dtype=np.float64)
    xs = _inputs("float64", 64, rank, p, seed=9)
    mine = xs[rank].copy()
    mine[: special.size] = np.roll(special, rank)
    for _ in range(4):
        if rank == 0:
            got = optcc_mpi.allreduce(mine, np.empty_like(mine))
        else:
            got = optcc_mpi.allreduce(array.array("d", mine.tobytes()))
        _same_everywhere(np.asarray(got))
    if rank == 0:
        assert answers["done"] >= 2, answers
    else:
        assert answers["done"] == 0


@pytest.mark.parametrize("what", ["dtype", "op", "count"])
def test_disagreement_on_the_compiled_path(answers: Counter, what: str) -> None:
    """Ranks whose calls both take the compiled path but differ: the same error on every
    rank, nothing hangs, the next call works."""
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    if p == 1 or p > collectives.GATHER_MAX_P:
        pytest.skip("needs two ranks to disagree")
    # Warm every variant up on every rank, so that each is compiled-path eligible.
    f32, i32 = np.ones(16, np.float32), np.ones(16, np.int32)
    short = np.ones(15, np.float32)
    for _ in range(2):
        for x in (f32, i32, short):
            optcc_mpi.allreduce(x, np.empty_like(x))
            optcc_mpi.allreduce(x, np.empty_like(x), op="max")
    before = answers["done"]
    x, op = f32, "sum"
    if rank == 0:
        x, op = {"dtype": (i32, "sum"), "op": (f32, "max"), "count": (short, "sum")}[what]
    out = np.full(x.size, 5, dtype=x.dtype)
    with pytest.raises(ValueError, match=f"{'element count' if what == 'count' else what} differs"):
        optcc_mpi.allreduce(x, out, op=op)
    np.testing.assert_array_equal(out, 5)  # nothing written
    if what != "count":  # a count that differs changes the room: that rank declines
        assert answers["mismatch"] == 1
    assert answers["done"] == before
    y = optcc_mpi.allreduce(f32, np.empty_like(f32))
    np.testing.assert_array_equal(y, float(p))


def test_it_declines_what_it_does_not_handle(
    answers: Counter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Non-contiguous, read-only and overlapping buffers, a type it has no format for and
    an environment that changes the call go to the Python path, with its errors."""
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    if p == 1 or p > collectives.GATHER_MAX_P:
        pytest.skip("the compiled path serves 2 to GATHER_MAX_P ranks")
    x = np.ones(8)
    for _ in range(2):
        optcc_mpi.allreduce(x, np.empty_like(x))
    taken = answers["done"]
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(8)
        ro.flags.writeable = False
        optcc_mpi.allreduce(x, ro)
    with pytest.raises(ValueError, match="overlap"):
        big = np.ones(12)
        optcc_mpi.allreduce(big[:8], big[4:])
    with pytest.raises(ValueError, match="not contiguous"):
        optcc_mpi.allreduce(np.ones(16)[::2], np.empty(8))
    with pytest.raises(ValueError, match="native byte order"):
        be = np.ones(8, dtype=">f8")
        optcc_mpi.allreduce(be, np.empty_like(be))
    assert answers["done"] == taken
    monkeypatch.setenv("OPTCC_LINKS", f"{p - 1}:0.5")
    config.reload()
    calls = sum(answers.values())
    y = optcc_mpi.allreduce(x, np.empty_like(x))
    np.testing.assert_array_equal(y, float(p))
    assert sum(answers.values()) == calls  # not even asked


def test_a_loop_without_the_check(answers: Counter) -> None:
    """A fresh communicator that only ever sees ``check=False``: after the first call of
    a size, the compiled path takes every call."""
    comm = MPI.COMM_WORLD.Dup()
    try:
        p = comm.Get_size()
        if p == 1 or p > collectives.GATHER_MAX_P:
            pytest.skip("the compiled path serves 2 to GATHER_MAX_P ranks")
        x = np.arange(300, dtype=np.float32)
        for _ in range(6):
            y = optcc_mpi.allreduce(x, comm=comm, check=False)
            np.testing.assert_array_equal(y, x * p)
        assert answers["done"] >= 4, answers
    finally:
        comm.Free()
