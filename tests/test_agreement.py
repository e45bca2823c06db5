"""optcc_mpi.check.agreement: one collective, the same outcome on every rank."""

from __future__ import annotations

import numpy as np
import pytest

from optcc_mpi.check import agreement
from optcc_mpi.errors import ArgumentError, ArgumentTypeError, DatasetError

MPI = pytest.importorskip("mpi4py.MPI")


def test_describe_ranks() -> None:
    assert agreement.describe_ranks([2]) == "rank 2"
    assert agreement.describe_ranks([0, 1, 2, 5]) == "ranks 0-2,5"
    assert agreement.describe_ranks([0, 1, 2], 3) == "all ranks"
    assert agreement.describe_ranks([0], 1) == "rank 0"


def test_single_process() -> None:
    comm = MPI.COMM_SELF
    assert agreement.agree(comm, None, {"a": 1}) == [{"a": 1}]
    with pytest.raises(ArgumentError, match="^broken$"):
        agreement.agree(comm, "broken")
    with pytest.raises(KeyError):  # an exception is re-raised unchanged
        agreement.agree(comm, KeyError("k"))
    assert agreement.run_everywhere(comm, lambda: 7) == 7
    lo, hi = agreement.agree_fields(comm, [3, -4])
    assert lo.tolist() == [3, -4] and hi.tolist() == [3, -4]


def test_errors_raised_everywhere_are_marked_and_shown_without_the_check() -> None:
    """What agree raises is marked as raised on every rank (a command prints it once),
    with the words of every failed rank; a bad argument's traceback starts at agree, with
    no chained exception of the library's own handling in front of it."""
    import traceback

    from optcc_mpi.errors import everywhere

    comm = MPI.COMM_SELF

    def check() -> None:
        raise ValueError("rank 3 is outside 2 ranks")

    try:
        check()
    except ValueError as exc:
        found = exc
    try:
        try:
            raise KeyError("internal signal")
        except KeyError:
            agreement.agree(comm, found, what="allreduce")
    except ValueError as exc:
        assert exc is found
        assert everywhere(exc) == "rank 3 is outside 2 ranks"  # the only failure: its words
        text = "".join(traceback.format_exception(exc))
        assert "internal signal" not in text and "in check" not in text
    with pytest.raises(ArgumentError) as info:
        agreement.agree(comm, "broken")
    assert everywhere(info.value) == "broken"
    assert everywhere(ValueError("not agreed")) is None


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_one_rank_fails() -> None:
    comm = MPI.COMM_WORLD
    rank, p = comm.rank, comm.size
    last = p - 1
    assert agreement.agree(comm, None, rank * 10) == [r * 10 for r in range(p)]
    # A message: the same class and words on every rank, the rank named.
    with pytest.raises(DatasetError) as info:
        agreement.agree(comm, "bad block" if rank == last else None, what="load", cls=DatasetError)
    assert str(info.value) == f"load: bad block (rank {last})"
    # An exception: its own rank re-raises it; the others name it; a TypeError stays one.
    error = TypeError("wrong kind") if rank == last else None
    with pytest.raises(TypeError) as info:
        agreement.agree(comm, error, what="call")
    if rank == last:
        assert info.value is error
    else:
        assert isinstance(info.value, ArgumentTypeError)
        assert f"TypeError: wrong kind (rank {last})" in str(info.value)
    # The same words from every rank are listed once.
    with pytest.raises(ArgumentError, match=r"^same \(all ranks\)$"):
        agreement.agree(comm, "same")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_run_everywhere_and_fields() -> None:
    comm = MPI.COMM_WORLD
    rank, p = comm.rank, comm.size

    def step() -> int:
        if rank == 0:
            raise ValueError("zero")
        return rank

    with pytest.raises(ValueError) as info:
        agreement.run_everywhere(comm, step, what="fit")
    if rank:
        assert isinstance(info.value, ArgumentError)
        assert str(info.value) == "fit: ValueError: zero (rank 0)"
    assert agreement.run_everywhere(comm, lambda: rank + 1) == rank + 1
    lo, hi = agreement.agree_fields(comm, np.array([5, rank, -rank]))
    assert lo.tolist() == [5, 0, -(p - 1)]
    assert hi.tolist() == [5, p - 1, 0]
