"""The drop-in promise: mpi4py's kinds of Allreduce calls, through ``optcc_mpi.Comm``.

Written after the cases mpi4py's own suite exercises (its collective buffer tests and
array implementations): ``array.array`` and NumPy buffers of every type code, mpi4py
buffer specifications (``[buf, datatype]``, ``[buf, count, datatype]``,
``[buf, (count, displ), datatype]``), raw ``bytearray``/``memoryview`` buffers,
multi-dimensional arrays of either order, ``MPI.Op`` objects, the in-place forms
(``MPI.IN_PLACE``, ``None`` and ``sendbuf is recvbuf``), and COMM_WORLD, COMM_SELF, their
duplicates and a split communicator. The inputs differ per rank and the results are
checked exactly against a reference computed here (small integers keep every float
result exact), for every algorithm, bit-identical on every rank. Cases MPI itself refuses
(bool with arithmetic ops, complex with max/min) must fail with a clear error on every
rank.

Each test prints ``compat <algorithm> <comm>: <passed>/<cases>`` (run pytest with ``-s``).
"""

from __future__ import annotations

import array
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import optcc_mpi
from optcc_mpi.errors import ArgumentError

MPI = pytest.importorskip("mpi4py.MPI")
pytestmark = pytest.mark.mpi

ALGS = ["auto", "native", "ring", "optcc", "r2ccl"]
ARITH = ("SUM", "PROD", "MAX", "MIN")
LOGICAL = ("LAND", "LOR", "LXOR")
BITWISE = ("BAND", "BOR", "BXOR")
MODES = ("out-of-place", "IN_PLACE", "None", "same-object")

#: NumPy type code -> MPI datatype, as mpi4py maps them.
NUMPY_CODES = {
    "?": "C_BOOL",
    "b": "SIGNED_CHAR",
    "h": "SHORT",
    "i": "INT",
    "l": "LONG",
    "q": "LONG_LONG",
    "B": "UNSIGNED_CHAR",
    "H": "UNSIGNED_SHORT",
    "I": "UNSIGNED",
    "L": "UNSIGNED_LONG",
    "Q": "UNSIGNED_LONG_LONG",
    "e": None,  # float16: no predefined MPI type in MPI 4
    "f": "FLOAT",
    "d": "DOUBLE",
    "g": "LONG_DOUBLE",
    "F": "C_FLOAT_COMPLEX",
    "D": "C_DOUBLE_COMPLEX",
    "G": "C_LONG_DOUBLE_COMPLEX",
}
ARRAY_CODES = "bhilqBHILQfd"  # array.array has no bool, half, long double or complex


def ops_for(dt: np.dtype) -> tuple[str, ...]:
    if dt.kind == "b":
        return LOGICAL
    if dt.kind in "iu":
        return ARITH + LOGICAL + BITWISE
    if dt.kind == "c":
        return ("SUM", "PROD")
    return ARITH


def refused_ops(dt: np.dtype) -> tuple[str, ...]:
    """Ops MPI defines but not for this type: they must be refused on every rank."""
    if dt.kind == "b":
        return ARITH
    if dt.kind == "c":
        return ("MAX", "MIN")
    if dt.kind == "f" or dt == np.dtype(ml_dtypes.bfloat16):
        return BITWISE[:1] + LOGICAL[:1]
    return ()


def values(dt: np.dtype, op: str, n: int, rank: int) -> np.ndarray:
    """Small values, different per rank and element, whose every reduction is exact."""
    i = np.arange(n)
    if dt.kind == "b":
        return ((i + rank) % 3 == 0).astype(dt)
    if op == "PROD":
        v = 1 + (i + rank) % 2  # 1 or 2: products are powers of two
        if dt.kind in "if" or dt == np.dtype(ml_dtypes.bfloat16):
            v = v * np.where((i + 2 * rank) % 5 == 0, -1, 1)
    else:
        v = (3 * i + 5 * rank) % 7
        if dt.kind in "fc" or dt.kind == "i" or dt == np.dtype(ml_dtypes.bfloat16):
            v = v - 3
    if dt.kind == "c":
        return (v + 1j * ((i + rank) % 2)).astype(dt) if op == "SUM" else v.astype(dt)
    return v.astype(dt)


def reference(dt: np.dtype, op: str, n: int, size: int) -> np.ndarray:
    xs = [values(dt, op, n, r) for r in range(size)]
    if size == 1:
        return xs[0]  # as in MPI: the reduction of one operand is that operand
    if op in LOGICAL:
        fn = {"LAND": np.logical_and, "LOR": np.logical_or, "LXOR": np.logical_xor}[op]
        return fn.reduce(np.stack([x != 0 for x in xs]), axis=0).astype(dt)
    if op in BITWISE:
        fn = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
        return fn.reduce(np.stack(xs), axis=0)
    if dt.kind in "iu" and op in ("SUM", "PROD"):
        # Exact, with the type's wrap-around (two's complement).
        acc = np.zeros(n, dtype=np.uint64) + (op == "PROD")
        for x in xs:
            u = x.astype(np.int64).view(np.uint64) if dt.kind == "i" else x.astype(np.uint64)
            acc = acc + u if op == "SUM" else acc * u
        return acc.astype(dt) if dt.kind == "u" else acc.view(np.int64).astype(dt)
    wide = np.stack([x.astype(np.clongdouble if dt.kind == "c" else np.longdouble) for x in xs])
    fn = {"SUM": np.sum, "PROD": np.prod, "MAX": np.max, "MIN": np.min}[op]
    return fn(wide, axis=0).astype(dt)


# -- the kinds of buffers -------------------------------------------------------------------------
@dataclass
class Kind:
    """One way of holding n elements: make an object, read it back as NumPy, and the
    buffer argument to pass (plain or an mpi4py specification)."""

    name: str
    make: Callable[[np.ndarray], Any]
    read: Callable[[Any, np.dtype], np.ndarray]
    spec: Callable[[Any, np.dtype, int], Any] = lambda obj, dt, n: obj


def _datatype(dt: np.dtype) -> Any:
    name = NUMPY_CODES.get(dt.char)
    return getattr(MPI, name) if name else None


def _numpy_kinds() -> list[Kind]:
    return [
        Kind("numpy", lambda v: v.copy(), lambda o, dt: o),
        Kind(
            "numpy [buf, datatype]",
            lambda v: v.copy(),
            lambda o, dt: o,
            lambda o, dt, n: [o, _datatype(dt)],
        ),
        Kind(
            "numpy [buf, count, datatype]",
            lambda v: np.concatenate([v, v[:2]]),  # two spare elements beyond the count
            lambda o, dt: o[:-2],
            lambda o, dt, n: [o, n, _datatype(dt)],
        ),
        Kind(
            "numpy [buf, (count, displ), datatype]",
            lambda v: np.concatenate([v[:1], v]),  # one element before the data
            lambda o, dt: o[1:],
            lambda o, dt, n: [o, (n, 1), _datatype(dt)],
        ),
        Kind(
            "numpy 2-D C order",
            lambda v: v.copy().reshape(-1, 1) if v.size % 2 else v.copy().reshape(2, -1),
            lambda o, dt: o.ravel(order="C"),
        ),
        Kind(
            "numpy 2-D Fortran order",
            lambda v: np.asfortranarray(
                v.copy().reshape(-1, 1) if v.size % 2 else v.copy().reshape(2, -1)
            ),
            lambda o, dt: o.ravel(order="C"),  # logical order: the reduction is by element
        ),
        Kind(
            "bytearray [buf, datatype]",
            lambda v: bytearray(v.tobytes()),
            lambda o, dt: np.frombuffer(bytes(o), dtype=dt),
            lambda o, dt, n: [o, _datatype(dt)],
        ),
        Kind(
            "memoryview",
            lambda v: memoryview(v.copy()),
            lambda o, dt: np.asarray(o),
        ),
    ]


def _as_numpy(o: Any, dt: np.dtype) -> np.ndarray:
    return np.asarray(o)


def _array_kinds() -> list[Kind]:
    return [
        Kind("array.array", lambda v: array.array(v.dtype.char, v.tolist()), _as_numpy),
        Kind(
            "array.array [buf, datatype]",
            lambda v: array.array(v.dtype.char, v.tolist()),
            _as_numpy,
            lambda o, dt, n: [o, _datatype(dt)],
        ),
        Kind(
            "array.array [buf, count, datatype]",
            lambda v: array.array(v.dtype.char, v.tolist()),
            _as_numpy,
            lambda o, dt, n: [o, n, _datatype(dt)],
        ),
    ]


def _codes_for(kind: Kind) -> list[np.dtype]:
    if kind.name.startswith("array.array"):
        return [np.dtype(c) for c in ARRAY_CODES]
    codes = [np.dtype(c) for c in NUMPY_CODES]
    if "datatype" in kind.name:
        codes = [dt for dt in codes if _datatype(dt) is not None]
    else:
        codes.append(np.dtype(ml_dtypes.bfloat16))
    if kind.name.startswith("bytearray") or kind.name == "memoryview":
        codes = [dt for dt in codes if dt.kind in "biufc"]  # formats memoryview knows
    return codes


def _digest(a: np.ndarray) -> int:
    a = np.ascontiguousarray(a)
    raw = a.view(np.uint8)
    part = a.dtype if a.dtype.kind != "c" else np.dtype(f"f{a.dtype.itemsize // 2}")
    if part == np.dtype(np.longdouble) and np.finfo(np.longdouble).nmant == 63:
        raw = raw.reshape(-1, part.itemsize)[:, :10]  # x87: 6 bytes of padding
    return zlib.crc32(raw.tobytes())


class Tally:
    """Counts cases and collects failures; one allgather compares results across ranks."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.cases = 0
        self.failures: list[str] = []
        self.digests: list[int] = []
        self.labels: list[str] = []

    def run(self, label: str, fn: Callable[[], np.ndarray | None]) -> None:
        self.cases += 1
        try:
            got = fn()
        except Exception as exc:  # a wrong error counts as a failure, with its message
            self.failures.append(f"{label}: {type(exc).__name__}: {exc}")
            got = None
        self.labels.append(label)
        self.digests.append(-1 if got is None else _digest(got))

    def finish(self, title: str) -> None:
        every = self.comm.allgather(self.digests)
        for i, label in enumerate(self.labels):
            seen = {d[i] for d in every}
            if len(seen) > 1:
                self.failures.append(f"{label}: results differ across ranks")
        passed = self.cases - len({f.split(":")[0] for f in self.failures})
        if self.comm.Get_rank() == 0:
            print(f"\ncompat {title}: {passed}/{self.cases}")
        assert not self.failures, "\n".join(self.failures[:20])


def _one(
    face: Any, kind: Kind, dt: np.dtype, op: str, mode: str, n: int, rank: int, size: int
) -> np.ndarray:
    """Run one case; return this rank's result (raises AssertionError if wrong)."""
    mine = values(dt, op, n, rank)
    expect = reference(dt, op, n, size)
    mpi_op = getattr(MPI, op)
    if mode == "out-of-place":
        src = kind.make(mine)
        dst = kind.make(np.zeros_like(mine))
        face.Allreduce(kind.spec(src, dt, n), kind.spec(dst, dt, n), mpi_op)
        np.testing.assert_array_equal(kind.read(src, dt), mine)  # input untouched
    else:
        dst = kind.make(mine)
        rbuf = kind.spec(dst, dt, n)
        sbuf = {"IN_PLACE": MPI.IN_PLACE, "None": None, "same-object": rbuf}[mode]
        face.Allreduce(sbuf, rbuf, mpi_op)
    got = kind.read(dst, dt)
    assert got.dtype == dt, f"result type {got.dtype}"
    np.testing.assert_array_equal(got, expect)
    return got


def _refused(face: Any, dt: np.dtype, op: str, n: int, rank: int) -> np.ndarray | None:
    x = np.zeros(n, dtype=dt)
    try:
        face.Allreduce(MPI.IN_PLACE, x, getattr(MPI, op))
    except ValueError as exc:
        assert "not defined" in str(exc), str(exc)
        return None
    raise AssertionError(f"{op} on {dt} was not refused")


def _comm(kind: str) -> tuple[Any, bool]:
    """The communicator of a test, and whether to free it afterwards."""
    world = MPI.COMM_WORLD
    if kind == "world":
        return world, False
    if kind == "self":
        return MPI.COMM_SELF, False
    if kind == "world-dup":
        return world.Dup(), True
    if kind == "self-dup":
        return MPI.COMM_SELF.Dup(), True
    return world.Split(world.Get_rank() % 2, world.Get_size() - world.Get_rank()), True


@pytest.mark.timeout(900)
@pytest.mark.parametrize("algorithm", ALGS)
def test_world_every_kind_type_op_and_mode(algorithm: str) -> None:
    """Every type code x op x in-place form, the buffer kinds taking turns, on
    COMM_WORLD; and the ops MPI refuses for a type, refused on every rank."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    face = optcc_mpi.Comm(comm, algorithm=algorithm)
    tally = Tally(comm)
    for family in (_numpy_kinds(), _array_kinds()):
        codes: list[np.dtype] = []
        for kind in family:
            codes += [dt for dt in _codes_for(kind) if dt not in codes]
        for dt in codes:
            # Every op and in-place form of this type, the buffer kinds taking turns:
            # each kind meets each type, and the suite stays quick at 8 ranks.
            usable = [kind for kind in family if dt in _codes_for(kind)]
            turn = 0
            for op in ops_for(dt):
                for mode in MODES:
                    kind = usable[turn % len(usable)]
                    turn += 1
                    n = size + 3
                    tally.run(
                        f"{kind.name} {dt} {op} {mode}",
                        lambda kind=kind, dt=dt, op=op, mode=mode, n=n: _one(
                            face, kind, dt, op, mode, n, rank, size
                        ),
                    )
            if family[0].name == "numpy":
                for op in refused_ops(dt):
                    tally.run(
                        f"refused {dt} {op}",
                        lambda dt=dt, op=op: _refused(face, dt, op, size + 3, rank),
                    )
    # A 0-d array and an empty buffer.
    tally.run(
        "0-d array",
        lambda: _one(
            face,
            Kind("0-d", lambda v: v[:1].reshape(()).copy(), lambda o, dt: np.atleast_1d(o)),
            np.dtype("d"),
            "SUM",
            "IN_PLACE",
            1,
            rank,
            size,
        ),
    )
    tally.run(
        "empty",
        lambda: _one(face, _numpy_kinds()[0], np.dtype("f"), "MAX", "out-of-place", 0, rank, size),
    )
    tally.finish(f"{algorithm} world")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("comm_kind", ["self", "world-dup", "self-dup", "split"])
@pytest.mark.parametrize("algorithm", ALGS)
def test_other_communicators(algorithm: str, comm_kind: str) -> None:
    """One type code per category, every op and in-place form, on COMM_SELF, duplicates
    and a split communicator (in reversed rank order)."""
    comm, free = _comm(comm_kind)
    try:
        rank, size = comm.Get_rank(), comm.Get_size()
        face = optcc_mpi.Comm(comm, algorithm=algorithm)
        tally = Tally(comm)
        kinds = _numpy_kinds()
        for j, dt in enumerate(np.dtype(c) for c in "?ilQfdgD"):
            for op in ops_for(dt):
                for mode in MODES:
                    kind = kinds[j % 4]
                    if _datatype(dt) is None and "datatype" in kind.name:
                        kind = kinds[0]
                    tally.run(
                        f"{kind.name} {dt} {op} {mode}",
                        lambda kind=kind, dt=dt, op=op, mode=mode: _one(
                            face, kind, dt, op, mode, size + 2, rank, size
                        ),
                    )
        tally.finish(f"{algorithm} {comm_kind}")
    finally:
        if free:
            comm.Free()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ALGS)
def test_torch_tensors(algorithm: str) -> None:
    """PyTorch CPU tensors, reduced in place through a NumPy view (no copy)."""
    torch = pytest.importorskip("torch")
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    face = optcc_mpi.Comm(comm, algorithm=algorithm)
    tally = Tally(comm)
    types = {
        torch.bool: np.dtype("?"),
        torch.int8: np.dtype("b"),
        torch.uint8: np.dtype("B"),
        torch.int16: np.dtype("h"),
        torch.int32: np.dtype("i"),
        torch.int64: np.dtype("q"),
        torch.float16: np.dtype("e"),
        torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
        torch.float32: np.dtype("f"),
        torch.float64: np.dtype("d"),
        torch.complex64: np.dtype("F"),
        torch.complex128: np.dtype("D"),
    }
    for tdt, dt in types.items():

        def make(v: np.ndarray, tdt: Any = tdt) -> Any:
            if v.dtype == np.dtype(ml_dtypes.bfloat16):
                return torch.from_numpy(v.view(np.int16).copy()).view(tdt)
            return torch.from_numpy(v.copy())

        def read(t: Any, dt: np.dtype) -> np.ndarray:
            if t.dtype == torch.bfloat16:
                return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
            return t.numpy()

        kind = Kind("torch", make, read)
        for op in ops_for(dt):
            for mode in MODES:
                tally.run(
                    f"torch {tdt} {op} {mode}",
                    lambda kind=kind, dt=dt, op=op, mode=mode: _one(
                        face, kind, dt, op, mode, size + 3, rank, size
                    ),
                )
    # In place without a copy: the tensor's own storage holds the result.
    t = torch.ones(5, dtype=torch.float32)
    ptr = t.data_ptr()
    face.Allreduce(MPI.IN_PLACE, t, MPI.SUM)
    assert t.data_ptr() == ptr and t.tolist() == [float(size)] * 5
    tally.finish(f"{algorithm} torch")


def test_face_delegates_everything_else() -> None:
    """Comm is the communicator for everything but Allreduce, and a one-line change."""
    comm = MPI.COMM_WORLD
    face = optcc_mpi.Comm(comm, algorithm="ring", links=None)
    assert isinstance(face, MPI.Intracomm)
    assert face == comm and face.Get_size() == comm.Get_size()
    assert face.Get_rank() == comm.Get_rank()
    x = np.full(3, float(comm.Get_rank()))
    face.Bcast(x, root=0)  # mpi4py's
    np.testing.assert_array_equal(x, np.zeros(3))
    assert face.allreduce(2, op=MPI.SUM) == 2 * comm.Get_size()  # mpi4py's pickle path
    face.algorithm = "optcc"
    face.links = "0:0.5"
    y = np.ones(1009)
    assert face.Allreduce(MPI.IN_PLACE, y, MPI.SUM) is None
    np.testing.assert_array_equal(y, np.full(1009, float(comm.Get_size())))
    assert optcc_mpi.collectives.last_stats()["algorithm"] == "optcc"
    again = optcc_mpi.Comm(face)  # keeps the settings it wraps
    assert again.algorithm == "optcc" and again.links == "0:0.5"
    dup = face.Dup()  # mpi4py makes the same class: default settings
    try:
        assert isinstance(dup, optcc_mpi.Comm) and dup.algorithm == "auto"
        z = np.ones(4)
        dup.Allreduce(MPI.IN_PLACE, z, MPI.MAX)
        np.testing.assert_array_equal(z, np.ones(4))
    finally:
        dup.Free()
    with pytest.raises(ValueError, match="needs a recvbuf"):
        face.Allreduce(np.ones(2), None)


@pytest.mark.timeout(300)
def test_a_list_that_is_no_buffer_specification_is_named() -> None:
    """A plain list of numbers is neither an array nor an mpi4py buffer specification:
    the error says how many items it had (the count, not a placeholder)."""
    with pytest.raises(ArgumentError, match=r"has 2 to 4 items .*got 8$"):
        optcc_mpi.allreduce([1.0] * 8)
