"""The compiled call path of short AllReduces (``optcc_mpi.check.fastcall``) under MPI.

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
from optcc_mpi import collectives, communicators, config
from optcc_mpi.check import crossover, fastcall
from optcc_mpi.check.state import rooms
from optcc_mpi.collectives import last_stats

MPI = pytest.importorskip("mpi4py.MPI")
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


@pytest.fixture
def answers(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """What the compiled path answered, counted by name, during one test."""
    assert fastcall.available(), "the install builds optcc_mpi/check/_fastcall.c (make install)"
    seen: Counter = Counter()
    names = {fastcall.FALLBACK: "fallback", fastcall.DONE: "done", fastcall.GATHERED: "gathered"}
    names[fastcall.MISMATCH] = "mismatch"
    names[fastcall.LIBRARY] = "library"
    real = communicators._STATES.fold or fastcall.fold_function()

    def counted(*args: Any) -> int:
        answer = real(*args)
        seen[names.get(answer, "mpi error")] += 1
        return answer

    monkeypatch.setattr(communicators._STATES, "fold", counted)
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
    # Up to the communicator's gather limit (measured: asked here, on every rank).
    fits = n * np.dtype(dtype).itemsize <= collectives.gather_limit()
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
    if not fits:  # beyond the gather limit: the check, then the library's AllReduce
        assert taken == 0, answers
        # from C where the library reduces with one of MPI's own ops (not float16's)
        assert (answers["library"] >= 2) == (dtype != "float16"), answers
        assert answers["mismatch"] == answers["mpi error"] == 0
        return
    assert answers["library"] == 0
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


# -- the gather limit: gathered up to it, the check and the library's AllReduce above -----------
@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    """A communicator of its own (the limit is decided once per communicator), with
    ``$OPTCC_GATHER_LIMIT`` unset unless a test sets it."""
    monkeypatch.delenv("OPTCC_GATHER_LIMIT", raising=False)
    config.reload()
    comm = MPI.COMM_WORLD.Dup()
    yield comm
    comm.Free()


def test_gather_limit_is_measured_once_and_agreed(fresh: Any) -> None:
    p = fresh.Get_size()
    if p == 1 or p > collectives.GATHER_MAX_P:
        pytest.skip("gathering needs 2 to GATHER_MAX_P ranks")
    limit = collectives.gather_limit(fresh)
    assert limit in rooms(p)
    assert len(set(fresh.allgather(limit))) == 1
    assert collectives.gather_limit(fresh) == limit  # cached: no second measurement


def test_every_rank_takes_the_same_decision(fresh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank measures its own times (here: made up, different on every rank; only on
    rank 0 is the library faster above some size); all ranks decide alike, from the
    maximum over the ranks of every repetition."""
    rank, p = fresh.Get_rank(), fresh.Get_size()
    if p == 1 or p > collectives.GATHER_MAX_P:
        pytest.skip("gathering needs 2 to GATHER_MAX_P ranks")
    sizes = rooms(p)
    n = np.asarray(sizes, dtype=np.float64)

    def made_up(r: int) -> np.ndarray:
        gather = 1e-6 + n * 1e-10 * (1 + r) + (n * 5e-10 * p if r == 0 else 0)
        library = 2e-6 + n * 1e-10 * (1 + r)
        return np.concatenate([gather, library])

    monkeypatch.setattr(crossover, "_repetition", lambda cases: made_up(rank))
    limit = collectives.gather_limit(fresh)
    assert len(set(fresh.allgather(limit))) == 1
    # What every rank must have decided: on the element-wise maximum over the ranks.
    agreed = np.max([np.ceil(made_up(r) * 1e9) for r in range(p)], axis=0) * 1e-9
    times = np.repeat(agreed.reshape(1, 2, len(sizes)), crossover.FIRST, axis=0)
    ratio = crossover.verdicts(times)
    assert limit == crossover.choose(sizes, ratio, np.ones_like(ratio))
    assert limit < sizes[-1]  # (rank 0's times made the library win somewhere)


def _exact(dtype: str, n: int, rank: int) -> np.ndarray:
    """Small integers (exact in every type), NaN and signed zeros in floats."""
    x = ((np.arange(n) * 7 + rank * 5) % 11 - 5).astype(dtype)
    if np.dtype(dtype).kind in "fc":
        x[3::97] = np.nan
        x[5::89] = -0.0
    return x


@pytest.mark.parametrize("check", [True, False])
def test_both_sides_of_a_set_limit(
    fresh: Any, answers: Counter, monkeypatch: pytest.MonkeyPatch, check: bool
) -> None:
    """``$OPTCC_GATHER_LIMIT=1K``: 1 KiB messages travel in the check (from the second
    call of a size, in C), 4 KiB ones go to the library's AllReduce after the check (in C
    from the second call, without a check when ``check=False``); the results are exact
    and the same bits on every rank, in place and out of place."""
    rank, p = fresh.Get_rank(), fresh.Get_size()
    if p == 1 or p > collectives.GATHER_MAX_P:
        pytest.skip("gathering needs 2 to GATHER_MAX_P ranks")
    monkeypatch.setenv("OPTCC_GATHER_LIMIT", "1K")
    config.reload()
    assert collectives.gather_limit(fresh) == 1024
    for dtype, op in [
        ("float32", "sum"),
        ("float64", "prod"),
        ("int64", "max"),
        ("complex64", "sum"),
    ]:
        for nbytes in (1024, 4096):
            n = nbytes // np.dtype(dtype).itemsize
            xs = [_exact(dtype, n, r) for r in range(p)]
            want = collectives.allreduce(xs[rank], comm=fresh, op=op, check=check)
            for call in range(4):
                before = Counter(answers)
                if call % 2:
                    got = xs[rank].copy()
                    collectives.allreduce(collectives.IN_PLACE, got, op=op, comm=fresh, check=check)
                else:
                    got = collectives.allreduce(
                        xs[rank], np.empty_like(xs[rank]), op=op, comm=fresh, check=check
                    )
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
                _same_everywhere(got)
                taken = answers - before
                gathered = nbytes <= 1024
                assert last_stats()["inline"] == (gathered and check), (dtype, nbytes, call)
                if call == 0 and check:
                    continue  # the first call after a change of size agrees the new room
                assert taken["library"] == (not gathered), (dtype, nbytes, call, taken)
                assert taken["done"] + taken["gathered"] == gathered, (dtype, nbytes, taken)
        ref = np.sum([x.astype(np.complex128) for x in xs], axis=0) if op == "sum" else None
        if ref is not None and dtype == "float32":
            finite = ~np.isnan(ref)
            np.testing.assert_array_equal(want[finite], ref[finite].real.astype(dtype))


def test_library_calls_agree_across_paths(fresh: Any, answers: Counter, monkeypatch) -> None:
    """Above the limit, rank 0 on the compiled path (NumPy arrays) and the others on the
    Python path (``array.array``): the same collectives, the same bits, NaNs canonical."""
    rank, p = fresh.Get_rank(), fresh.Get_size()
    if p == 1 or p > collectives.GATHER_MAX_P:
        pytest.skip("gathering needs 2 to GATHER_MAX_P ranks")
    monkeypatch.setenv("OPTCC_GATHER_LIMIT", "512")
    config.reload()
    x = _exact("float64", 1000, rank)
    x[7] = np.frombuffer(np.uint64(0x7FF8_0000_0000_0ABC + rank).tobytes(), np.float64)[0]
    for check in (True, False, True, False, True):
        if rank == 0:
            got = collectives.allreduce(x, np.empty_like(x), comm=fresh, check=check)
        else:
            got = np.asarray(
                collectives.allreduce(array.array("d", x.tobytes()), comm=fresh, check=check)
            )
        _same_everywhere(got)
        assert got.view(np.uint64)[7] == 0x7FF8_0000_0000_0000  # the canonical NaN
    if rank == 0:
        assert answers["library"] >= 3, answers
    else:
        assert answers["library"] == 0


def test_gather_limit_setting_must_agree(fresh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$OPTCC_GATHER_LIMIT`` set differently on one rank: the same error on every rank
    at the first call that needs it, nothing hangs, and a fresh communicator with it alike
    works."""
    rank, p = fresh.Get_rank(), fresh.Get_size()
    if p == 1 or p > collectives.GATHER_MAX_P:
        pytest.skip("needs two ranks to disagree")
    monkeypatch.setenv("OPTCC_GATHER_LIMIT", "2K" if rank == 0 else "4K")
    config.reload()
    out = np.full(1000, 5.0)
    with pytest.raises(ValueError, match="OPTCC_GATHER_LIMIT differs across ranks"):
        collectives.allreduce(np.ones(1000), out, comm=fresh)
    np.testing.assert_array_equal(out, 5.0)  # nothing written
    monkeypatch.setenv("OPTCC_GATHER_LIMIT", "4K")
    config.reload()
    other = fresh.Dup()
    try:
        y = collectives.allreduce(np.ones(1000), comm=other)
        np.testing.assert_array_equal(y, float(p))
        assert collectives.gather_limit(other) == 4096
    finally:
        other.Free()


def test_a_freed_communicator_is_refused(answers: Counter) -> None:
    """The compiled path remembers the last communicator it served; once that one is
    freed its calls go to the Python path, which refuses ``COMM_NULL`` (nothing reaches
    the freed duplicate)."""
    comm = MPI.COMM_WORLD.Dup()
    p = comm.Get_size()
    if p == 1 or p > collectives.GATHER_MAX_P:
        comm.Free()
        pytest.skip("the compiled path serves 2 to GATHER_MAX_P ranks")
    x = np.ones(4)
    for _ in range(4):
        np.testing.assert_array_equal(optcc_mpi.allreduce(x, comm=comm), float(p))
    assert answers["done"] >= 2
    comm.Free()
    with pytest.raises(ValueError, match="COMM_NULL"):
        optcc_mpi.allreduce(x, np.empty_like(x), comm=comm)
    np.testing.assert_array_equal(optcc_mpi.allreduce(x), float(p))  # others still work
