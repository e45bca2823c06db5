"""The public AllReduce under MPI: correctness, determinism, bad input, device paths.

Run under mpiexec at 2, 3, 4, 5 and 8 ranks (``make test``).
"""

from __future__ import annotations

import sys
import warnings
import zlib

import ml_dtypes
import numpy as np
import pytest
from array_kinds import KIND_IDS, KINDS

import optcc_mpi
from optcc_mpi import arguments, collectives, config, planning, testing
from optcc_mpi.arrays import instance as _instance
from optcc_mpi.collectives import last_stats
from optcc_mpi.dtypes import DTYPES, check_op_dtype

MPI = pytest.importorskip("mpi4py.MPI")
pytestmark = pytest.mark.mpi

ALGS = ["ring", "optcc", "r2ccl", "native", "auto"]
OPS = {"sum": np.sum, "max": np.max, "min": np.min}
#: Every reduction, with the element types MPI defines it for.
ALL_OPS = ("sum", "prod", "max", "min", "land", "lor", "lxor", "band", "bor", "bxor")
#: Unit roundoff of each float type (the reduction error bound uses it).
UNIT = {
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float32": 2.0**-24,
    "float64": 2.0**-53,
    "longdouble": float(np.finfo(np.longdouble).eps) / 2,
    "complex64": 2.0**-24,
    "complex128": 2.0**-53,
    "clongdouble": float(np.finfo(np.longdouble).eps) / 2,
}


def ops_for(dtype: str) -> list[str]:
    """The reductions defined for ``dtype`` (MPI's table)."""
    out = []
    for op in ALL_OPS:
        try:
            check_op_dtype(op, dtype)
        except ValueError:
            continue
        out.append(op)
    return out


def world() -> tuple[object, int, int]:
    comm = MPI.COMM_WORLD
    return comm, comm.Get_rank(), comm.Get_size()


def counts(p: int) -> list[int]:
    return sorted({0, 1, max(p - 1, 0), p + 1, 97, 1009, 2**20 + 3})


def links_for(p: int) -> str:
    # A degraded rank that is not rank 0, so rank order and straggler order differ.
    return f"{p - 1}:0.5" if p > 1 else ""


def inputs(kind: str, dtype: str, n: int, p: int, seed: int, op: str = "sum") -> list[np.ndarray]:
    """Every rank's input, computable on every rank (no communication needed)."""
    dt = DTYPES[dtype]
    out = []
    for r in range(p):
        g = np.random.default_rng([seed, r, n])
        if dt.kind == "b":
            out.append(g.integers(0, 2, n).astype(bool))
        elif dt.kind in "iu":
            if kind == "random":
                info = np.iinfo(dt)
                x = g.integers(info.min, info.max, n, endpoint=True, dtype=dt)
            elif kind == "exact":
                x = g.integers(-8, 9, n)
            else:  # wrap-around near the limits of the type
                info = np.iinfo(dt)
                x = g.integers(info.max // 2, info.max, n) * (1 if r % 2 else -1)
            out.append(np.asarray(x).astype(dt))
        elif kind == "exact":
            # Small integers (powers of two and zero for products): every partial result
            # is exact in every float type.
            vals = [-2, -1, 0, 1, 2] if op == "prod" else list(range(-8, 9))
            x = g.choice(vals, n).astype(np.float64)
            if dt.kind == "c":
                x = x + 1j * g.choice(vals, n)
            out.append(x.astype(dt))
        elif kind == "random":
            if op == "prod":  # magnitudes near 1: no overflow, no underflow
                x = g.uniform(0.5, 2.0, n) * g.choice([-1.0, 1.0], n)
            else:
                x = g.standard_normal(n)
            if dt.kind == "c":
                x = x + 1j * (g.uniform(0.5, 2.0, n) if op == "prod" else g.standard_normal(n))
            out.append(x.astype(dt))
        else:  # adversarial: large values of alternating sign plus small ones
            big = 2.0 ** (8 if dt.itemsize == 2 else 40)
            x = (-1) ** r * big * (1 + g.random(n)) + g.standard_normal(n)
            out.append(x.astype(dt))
    return out


def _wide(dt: np.dtype) -> np.dtype:
    """The reference type: float64, or long double / complex for those types."""
    if dt.kind == "c":
        return np.dtype(np.clongdouble) if dt.itemsize > 16 else np.dtype(np.complex128)
    if dt == np.dtype(np.longdouble):
        return dt
    return np.dtype(np.float64)


def reference(xs: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    """The exact result for integers and logical/bitwise ops (with the type's
    wrap-around), float64 (or wider) for floats."""
    dt = DTYPES[dtype]
    stack = np.stack(xs)
    if op in ("land", "lor", "lxor"):
        fn = {"land": np.logical_and, "lor": np.logical_or, "lxor": np.logical_xor}[op]
        return fn.reduce(stack != 0, axis=0).astype(dt)
    if op in ("band", "bor", "bxor"):
        fn = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
        return fn.reduce(stack, axis=0)
    if dt.kind in "iu":
        if op in ("sum", "prod"):
            # Unsigned 64-bit arithmetic wraps modulo 2**64; casting back to the type
            # wraps modulo its width: exactly two's-complement overflow.
            acc = np.zeros(xs[0].size, dtype=np.uint64) + (op == "prod")
            for x in xs:
                u = x.astype(np.int64).view(np.uint64) if dt.kind == "i" else x.astype(np.uint64)
                acc = acc + u if op == "sum" else acc * u
            return acc.astype(dt) if dt.kind == "u" else acc.view(np.int64).astype(dt)
        return OPS[op](stack, axis=0)
    wide = stack.astype(_wide(dt))
    return {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}[op](wide, axis=0)


def check_result(y: np.ndarray, xs: list[np.ndarray], op: str, dtype: str, exact: bool) -> None:
    ref = reference(xs, op, dtype)
    dt = DTYPES[dtype]
    if dt.kind in "biu" or op not in ("sum", "prod"):
        np.testing.assert_array_equal(y, ref.astype(dt) if dt.kind in "biu" else ref)
        return
    got = y.astype(_wide(dt))
    if exact:
        np.testing.assert_array_equal(got, ref)
        return
    p = len(xs)
    absx = np.stack([np.abs(x.astype(_wide(dt))) for x in xs])
    if op == "sum":
        # Each of the p-1 additions rounds once (twice for 16-bit types: float32, then
        # the type), so |error| <= 2 (p-1) u sum|x| per element.
        scale = np.sum(absx, axis=0)
    else:
        # Each multiplication has a relative error of at most u (2u for 16-bit types,
        # sqrt(5) u for complex): |error| <= 3 (p-1) u prod|x|.
        scale = 1.5 * np.prod(absx, axis=0)
    tol = 2 * (p - 1) * UNIT[dtype] * scale + 1e-300
    bad = np.abs(got - ref) > tol
    assert not bad.any(), f"{bad.sum()} elements beyond the error bound"


def value_bytes(y: np.ndarray) -> np.ndarray:
    """The bytes that hold values: x87 long doubles leave 6 of every 16 bytes unused (and
    undefined), which a bitwise comparison must skip."""
    y = np.ascontiguousarray(y)
    dt = y.dtype
    part = dt if dt.kind != "c" else np.dtype(f"f{dt.itemsize // 2}")
    raw = y.view(np.uint8)
    if part == np.dtype(np.longdouble) and np.finfo(np.longdouble).nmant == 63:
        return raw.reshape(-1, part.itemsize)[:, :10].copy()
    return raw


def digest(y: np.ndarray) -> int:
    return zlib.crc32(value_bytes(y).tobytes())


def same_everywhere(comm: object, y: np.ndarray) -> None:
    digests = comm.allgather(digest(y))
    assert len(set(digests)) == 1, f"results differ across ranks: {digests}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matrix(algorithm: str, dtype: str) -> None:
    """Every algorithm x dtype x op x count, in place and out of place, against a
    float64 (or wider) reference, bit-identical on every rank."""
    comm, rank, p = world()
    links = links_for(p)
    for op in ops_for(dtype):
        for n in counts(p):
            if n == 2**20 + 3 and (op != "sum" or dtype not in ("float32", "bfloat16", "int64")):
                continue  # the largest count once per representative type keeps this quick
            # out of place, small integers: exact in every type
            xs = inputs("exact", dtype, n, p, 1, op)
            x = xs[rank].copy()
            y = optcc_mpi.allreduce(x, op=op, algorithm=algorithm, links=links)
            np.testing.assert_array_equal(x, xs[rank])  # input untouched
            check_result(y, xs, op, dtype, exact=True)
            same_everywhere(comm, y)
            # in place, random data: within the rounding bound
            xs = inputs("random", dtype, n, p, 2, op)
            buf = xs[rank].copy()
            out = optcc_mpi.allreduce(
                optcc_mpi.IN_PLACE, buf, op=op, algorithm=algorithm, links=links
            )
            assert out is buf
            check_result(buf, xs, op, dtype, exact=False)
            same_everywhere(comm, buf)


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "int32"])
def test_adversarial(algorithm: str, dtype: str) -> None:
    """Cancellation of large values (floats) and wrap-around (integers)."""
    comm, rank, p = world()
    for n in (1, p + 1, 1009):
        xs = inputs("adversarial", dtype, n, p, 3)
        y = optcc_mpi.allreduce(xs[rank], algorithm=algorithm, links=links_for(p))
        check_result(y, xs, "sum", dtype, exact=False)
        same_everywhere(comm, y)


@pytest.mark.parametrize(
    "links",
    ["0:0.5", "0:0.75", "0:0.9", "0:0.5,1:0.5", "0:0.5,2:0.7", "vector"],
)
@pytest.mark.parametrize("algorithm", ["optcc", "r2ccl"])
def test_link_profiles(algorithm: str, links: str) -> None:
    """One, several and arbitrary degraded ranks (bubble filling included)."""
    comm, rank, p = world()
    if links == "vector":
        prof: object = optcc_mpi.Links.from_vector(
            [0.4 + 0.6 * ((7 * r) % p) / p for r in range(p)]
        )
    else:
        prof = ",".join(item for item in links.split(",") if int(item.split(":")[0]) < p)
    for n in (p + 1, 1009, 100003):
        xs = inputs("exact", "float32", n, p, 4)
        y = optcc_mpi.allreduce(xs[rank], algorithm=algorithm, links=prof)
        check_result(y, xs, "sum", "float32", exact=True)
        same_everywhere(comm, y)


@pytest.mark.parametrize("algorithm", ALGS)
def test_deterministic(algorithm: str) -> None:
    """The same inputs give bit-identical results on every run, not only every rank."""
    comm, rank, p = world()
    xs = inputs("random", "float32", 100003, p, 5)
    first = optcc_mpi.allreduce(xs[rank], algorithm=algorithm, links=links_for(p))
    for _ in range(3):
        again = optcc_mpi.allreduce(xs[rank], algorithm=algorithm, links=links_for(p))
        np.testing.assert_array_equal(again.view(np.uint32), first.view(np.uint32))


def test_shapes_and_orders() -> None:
    """Multi-dimensional C- and Fortran-ordered arrays reduce element by element."""
    comm, rank, p = world()
    for order in ("C", "F"):
        x = np.asarray(np.arange(60, dtype=np.float64).reshape(3, 4, 5) * (rank + 1), order=order)
        y = optcc_mpi.allreduce(x, algorithm="ring")
        assert y.shape == x.shape
        np.testing.assert_array_equal(y, x / (rank + 1) * p * (p + 1) / 2)
        out = np.zeros_like(x, order=order)
        assert optcc_mpi.allreduce(x, out, algorithm="optcc", links=links_for(p)) is out
        np.testing.assert_array_equal(out, y)


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("algorithm", ALGS)
def test_array_libraries(kind: object, algorithm: str) -> None:
    """Device arrays (fake: CUDA-aware and staged; CuPy when a GPU is present) give the
    same bits as NumPy, and every MPI call sees a synchronised stream."""
    comm, rank, p = world()
    kind.setup()
    for dtype in ("float32", "bfloat16", "int64"):
        for n in (1, p + 1, 4099):
            xs = inputs("random", dtype, n, p, 6)
            ref = optcc_mpi.allreduce(xs[rank], algorithm=algorithm, links=links_for(p))
            dev = kind.make(xs[rank])
            got = optcc_mpi.allreduce(dev, algorithm=algorithm, links=links_for(p))
            np.testing.assert_array_equal(kind.host(got).view(np.uint8), ref.view(np.uint8))
            buf = kind.make(xs[rank])
            optcc_mpi.allreduce(optcc_mpi.IN_PLACE, buf, algorithm=algorithm, links=links_for(p))
            np.testing.assert_array_equal(kind.host(buf).view(np.uint8), ref.view(np.uint8))


def test_fake_device_paths_are_exercised() -> None:
    """The staged path stages and the CUDA-aware path does not; both synchronise."""
    comm, rank, p = world()
    if p < 2:
        pytest.skip("needs messages")
    be = _instance(testing.FAKE_DEVICE)
    x = np.arange(4099, dtype=np.float32)
    for aware in (True, False):
        be.cuda_aware = aware
        be.staged = be.syncs = be.mpi_calls = 0
        optcc_mpi.allreduce(testing.device_array(x), algorithm="ring")
        assert be.mpi_calls > 0 and be.syncs >= be.mpi_calls
        assert (be.staged > 0) == (not aware)


def test_forgotten_sync_is_caught() -> None:
    """The fake stream really checks: queued work at an MPI call raises."""
    be = _instance(testing.FAKE_DEVICE)
    a = testing.device_array(np.ones(4, np.float32))
    be.queued = 0
    be.copyto(a, a)
    with pytest.raises(testing.UnsynchronizedError):
        be.byte_view(a)
    be.synchronize()
    be.byte_view(a)


# -- bad input: a clear error on every rank, nothing modified, nothing hangs ---------------------
def _expect_everywhere(fn: object, match: str) -> None:
    comm, rank, p = world()
    with pytest.raises((ValueError, TypeError), match=match):
        fn()
    # Still usable afterwards: nobody was left inside a collective.
    y = optcc_mpi.allreduce(np.ones(5), algorithm="ring")
    np.testing.assert_array_equal(y, np.full(5, float(p)))


BAD_CASES = {
    "count differs": (lambda r, p: dict(sendbuf=np.ones(10 + (r == 0))), "element count differs"),
    "dtype differs": (
        lambda r, p: dict(sendbuf=np.ones(4, np.float32 if r == 0 else np.float64)),
        "dtype differs",
    ),
    "op differs": (
        lambda r, p: dict(sendbuf=np.ones(4), op="max" if r == 0 else "sum"),
        "op differs",
    ),
    "algorithm differs": (
        lambda r, p: dict(sendbuf=np.ones(4), algorithm="ring" if r == 0 else "optcc"),
        "algorithm differs",
    ),
    "links differ": (
        lambda r, p: dict(sendbuf=np.ones(4), links="0:0.5" if r == 0 else ""),
        "link profile differs",
    ),
    "non-contiguous": (
        lambda r, p: dict(sendbuf=np.ones((4, 4))[:, 0] if r == p - 1 else np.ones(4)),
        "not contiguous",
    ),
    "read-only": (
        lambda r, p: dict(sendbuf=np.ones(4), recvbuf=_readonly(4) if r == 0 else np.ones(4)),
        "read-only",
    ),
    "unsupported dtype": (
        lambda r, p: dict(sendbuf=np.ones(4, ml_dtypes.float8_e4m3fn)),
        "unsupported dtype",
    ),
    "dtype differs on one rank only": (
        lambda r, p: dict(sendbuf=np.ones(4, np.int8 if r == p - 1 else np.uint8)),
        "dtype differs",
    ),
    "unsupported op": (lambda r, p: dict(sendbuf=np.ones(4), op="avg"), "unsupported op 'avg'"),
    "op not defined for the type": (
        lambda r, p: dict(sendbuf=np.ones(4), op="band"),
        "'band' is not defined for float64",
    ),
    "op not defined for bool": (
        lambda r, p: dict(sendbuf=np.ones(4, bool), op="sum"),
        "for bool use land, lor or lxor",
    ),
    "MPI.MAXLOC": (lambda r, p: dict(sendbuf=np.ones(4), op=MPI.MAXLOC), "MPI.MAXLOC"),
    "user-defined op": (
        lambda r, p: dict(sendbuf=np.ones(4), op=MPI.Op.Create(lambda a, b, t: None)),
        "user-defined MPI ops",
    ),
    "list of numbers": (lambda r, p: dict(sendbuf=[1.0, 2.0]), "np.array"),
    "bad datatype in spec": (
        lambda r, p: dict(sendbuf=[np.ones(4), MPI.DOUBLE_INT]),
        "not supported",
    ),
    "count beyond the buffer": (
        lambda r, p: dict(sendbuf=[np.ones(4), 5, MPI.DOUBLE]),
        "exceed the buffer",
    ),
    "buffer kinds differ": (
        lambda r, p: dict(sendbuf=np.ones(4), recvbuf=testing.device_array(np.ones(4))),
        "pass two of the same kind",
    ),
    "params differ": (
        lambda r, p: dict(sendbuf=np.ones(4), algorithm="ring", params={"chunk_bytes": 64 + r}),
        "params differs",
    ),
    "bad links on one rank": (
        lambda r, p: dict(sendbuf=np.ones(4), links="0:zero" if r == p - 1 else None),
        "fraction 'zero'",
    ),
    "unknown algorithm": (
        lambda r, p: dict(sendbuf=np.ones(4), algorithm="tree"),
        "unknown algorithm 'tree'",
    ),
    "rank outside": (lambda r, p: dict(sendbuf=np.ones(4), links=f"{p}:0.5"), "names rank"),
    "fraction zero": (lambda r, p: dict(sendbuf=np.ones(4), links="0:0"), "outside \\(0, 1\\]"),
    "fraction above one": (
        lambda r, p: dict(sendbuf=np.ones(4), links="0:1.5"),
        "outside \\(0, 1\\]",
    ),
    "size mismatch": (lambda r, p: dict(sendbuf=np.ones(4), recvbuf=np.ones(5)), "recvbuf has 5"),
    "in place without recvbuf": (lambda r, p: dict(sendbuf=optcc_mpi.IN_PLACE), "no recvbuf"),
    "None without recvbuf": (lambda r, p: dict(sendbuf=None), "no recvbuf"),
    "overlap": (lambda r, p: _overlapping(), "overlap"),
    "not a communicator": (lambda r, p: dict(sendbuf=np.ones(4), comm=42), "mpi4py communicator"),
}


def _overlapping() -> dict[str, np.ndarray]:
    a = np.ones(8)
    return dict(sendbuf=a[:4], recvbuf=a[2:6])


def _readonly(n: int) -> np.ndarray:
    a = np.ones(n)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input(case: str) -> None:
    comm, rank, p = world()
    if p < 2 and "differ" in case:
        pytest.skip("needs two ranks to disagree")
    make, match = BAD_CASES[case]
    kwargs = make(rank, p)
    snapshot = {k: np.array(v, copy=True) for k, v in kwargs.items() if isinstance(v, np.ndarray)}
    _expect_everywhere(lambda: optcc_mpi.allreduce(**kwargs), match)
    for k, before in snapshot.items():
        np.testing.assert_array_equal(kwargs[k], before)


@pytest.mark.parametrize("op", ["sum", "prod"])
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "int32", "uint64"])
def test_native_integer_ops_wrap(dtype: str, op: str) -> None:
    """The op native hands MPI wraps modulo 2**bits on overflow, as NumPy and every
    other algorithm do, whichever MPI library this is (Open MPI's vectorised 8- and
    16-bit sums saturate; the library is asked, and a NumPy op replaces its op if so)."""
    from optcc_mpi.transports.mpi import mpi_datatype_and_op

    datatype, mpi_op = mpi_datatype_and_op(dtype, op)
    dt = np.dtype(dtype)
    rng = np.random.default_rng(7)
    info = np.iinfo(dt)
    a = rng.integers(info.min, info.max, 1000, endpoint=True, dtype=dt)
    b = rng.integers(info.min, info.max, 1000, endpoint=True, dtype=dt)
    with np.errstate(over="ignore"):
        want = a * b if op == "prod" else a + b
    mpi_op.Reduce_local([a, datatype], [b, datatype])
    np.testing.assert_array_equal(b, want)


def test_saturating_library_op_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Told that the library saturates, native gets a user-defined op that wraps."""
    from mpi4py import MPI

    from optcc_mpi.transports import mpi as mpi_transport

    mpi_transport.mpi_datatype_and_op.cache_clear()
    monkeypatch.setattr(mpi_transport, "_library_wraps", lambda *args: False)
    try:
        datatype, mpi_op = mpi_transport.mpi_datatype_and_op("int8", "sum")
        assert mpi_op != MPI.SUM and datatype == MPI.INT8_T
        a = np.full(64, 100, dtype=np.int8)
        b = np.full(64, 100, dtype=np.int8)
        mpi_op.Reduce_local([a, datatype], [b, datatype])
        np.testing.assert_array_equal(b, np.full(64, -56, dtype=np.int8))
    finally:
        mpi_transport.mpi_datatype_and_op.cache_clear()


def test_bfloat16_type_is_ml_dtypes() -> None:
    assert DTYPES["bfloat16"] == np.dtype(ml_dtypes.bfloat16)


def test_links_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    comm, rank, p = world()
    monkeypatch.setenv("OPTCC_LINKS", links_for(p))
    config.reload()
    x = np.arange(1009, dtype=np.float64)
    y = optcc_mpi.allreduce(x, algorithm="optcc")
    np.testing.assert_array_equal(y, x * p)
    stats = optcc_mpi.collectives.last_stats()
    assert str(stats["links"]) == (links_for(p) or "healthy")


# -- issue 11: NaN and signed zeros, per-rank inputs, communicators --------------------------------
FLOATS = ["float16", "bfloat16", "float32", "float64", "longdouble"]


def _nan_with_payload(dtype: np.dtype, payload: int, negative: bool) -> np.ndarray:
    """A one-element array holding a quiet NaN with the given payload bits and sign."""
    x = np.array([np.nan], dtype=dtype)
    if dtype.itemsize <= 8:
        it = np.dtype(f"i{dtype.itemsize}")
        bits = x.view(it)
        bits |= it.type(payload)
        if negative:
            bits |= it.type(np.iinfo(it).min)
    elif negative:
        x = -x
    return x


@pytest.mark.timeout(600)
@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_and_signed_zero_agree(algorithm: str, dtype: str) -> None:
    """max/min propagate NaN and order -0.0 < +0.0, with the same bits on every rank for
    every algorithm, the MPI library's included; at 300,001 elements too."""
    comm, rank, p = world()
    dt = DTYPES[dtype]
    canon = value_bytes(np.array([np.nan], dtype=dt))
    for n in (4, 1009, 300_001):
        x = np.full(n, 2.0 + rank, dtype=dt)
        x[0] = np.nan if rank == 0 else 1.0  # NaN on one rank only
        x[1] = -0.0 if rank % 2 else 0.0  # zeros of both signs
        x[2] = 0.0 if rank == p - 1 else -0.0  # one +0.0 among -0.0
        # NaNs of different signs and payloads on different ranks
        x[3] = _nan_with_payload(dt, rank + 1, negative=rank % 2 == 1)[0]
        for op in ("max", "min"):
            y = optcc_mpi.allreduce(x, op=op, algorithm=algorithm)
            same_everywhere(comm, y)
            if p == 1:  # as in MPI: the reduction of one operand is that operand
                np.testing.assert_array_equal(value_bytes(y), value_bytes(x))
                continue
            assert np.isnan(y[0]) and np.isnan(y[3])
            for i in (0, 3):  # the canonical quiet NaN
                assert (value_bytes(y[i : i + 1]) == canon).all()
            assert y[1] == 0 and y[2] == 0
            if op == "max":
                assert not np.signbit(y[1]) and not np.signbit(y[2])
                np.testing.assert_array_equal(y[4:].astype(np.float64), float(p + 1))
            else:
                assert np.signbit(y[1]) and np.signbit(y[2])
                np.testing.assert_array_equal(y[4:].astype(np.float64), 2.0)


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "complex128", "longdouble"])
def test_sum_with_nans_agrees(algorithm: str, dtype: str) -> None:
    """A NaN in a sum or product is NaN on every rank, with the same bits, even when the
    ranks' NaNs differ in sign and payload and the MPI library combines them in a
    rank-dependent order."""
    comm, rank, p = world()
    dt = DTYPES[dtype]
    real = np.dtype(f"f{dt.itemsize // 2}") if dt.kind == "c" else dt
    for n in (5, 1009, 70_001):
        x = np.ones(n, dtype=dt)
        nan = _nan_with_payload(real, rank + 1, negative=rank % 2 == 1)[0]
        x[0] = nan
        x[1] = np.inf if rank == 0 else (-np.inf if rank == p - 1 else 1.0)
        for op in ("sum", "prod"):
            y = optcc_mpi.allreduce(x, op=op, algorithm=algorithm)
            same_everywhere(comm, y)
            assert np.isnan(y[0])
            if p > 1 and op == "sum":
                assert np.isnan(y[1])  # inf + -inf
            np.testing.assert_array_equal(y[2:].real.astype(np.float64), p if op == "sum" else 1)


@pytest.mark.parametrize("errors", ["raise", "warn"])
@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "complex64", "longdouble"])
def test_finite_sum_past_the_maximum_is_quiet(algorithm: str, dtype: str, errors: str) -> None:
    """A sum whose elements are all finite, but add up past the type's maximum, returns
    without a NumPy warning or exception whatever the user's np.seterr. Looking for NaNs
    after the library's AllReduce added the result's elements up under the user's settings:
    a RuntimeWarning, or a FloatingPointError on every rank, from a finished reduction."""
    comm, rank, p = world()
    dt = DTYPES[dtype]
    real = np.dtype(f"f{dt.itemsize // 2}") if dt.kind == "c" else dt
    half = real.type(np.finfo(real).max) / real.type(2)
    part = half / real.type(p)  # every partial sum of positives stays at or under the result
    want = part * real.type(p)  # (in the type itself: max/2 of a long double is no float)
    for n in (5, 1009, 70_001):
        x = np.full(n, part, dtype=dt)
        with warnings.catch_warnings(), np.errstate(all=errors):
            warnings.simplefilter("error")
            y = optcc_mpi.allreduce(x, algorithm=algorithm)
        same_everywhere(comm, y)
        assert np.isfinite(y).all() and (np.abs(y.real - want) <= want / 100).all()


@pytest.mark.timeout(120)
def test_probe_ignores_user_wildcard_receive() -> None:
    """links="probe" works while the user has a wildcard receive pending on the same
    communicator: none of our messages may match it."""
    comm, rank, p = world()
    if p < 2:
        pytest.skip("the probe sends nothing on one rank")
    user = comm.Dup()  # a fresh communicator: the probe runs (it is cached per communicator)
    got = np.full(4, -1.0)
    req = user.Irecv(got, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    try:
        y = optcc_mpi.allreduce(np.ones(64), comm=user, links="probe", algorithm="optcc")
        np.testing.assert_array_equal(y, np.full(64, float(p)))
        assert not req.Test(), "one of our messages matched the user's wildcard receive"
        send = user.Isend(np.full(4, float(rank)), dest=rank, tag=7)
        req.Wait()
        send.Wait()
        np.testing.assert_array_equal(got, np.full(4, float(rank)))
    finally:
        user.Free()


@pytest.mark.timeout(120)
def test_bad_emulate_fraction_on_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad $OPTCC_EMULATE_FRACTION on one rank is an error on every rank (it used to
    raise on that rank after the agreement while the others waited)."""
    comm, rank, p = world()
    for bad in ("2.5", "half", "0"):
        if rank == p - 1:
            monkeypatch.setenv("OPTCC_EMULATE_FRACTION", bad)
            config.reload()
        x = np.arange(1009, dtype=np.float64)
        _expect_everywhere(
            lambda x=x: optcc_mpi.allreduce(x, algorithm="ring", emulate="bw=1GB/s"),
            "OPTCC_EMULATE_FRACTION",
        )
        np.testing.assert_array_equal(x, np.arange(1009))
        monkeypatch.delenv("OPTCC_EMULATE_FRACTION", raising=False)
        config.reload()
    # A good value on one rank is that rank's own business.
    if rank == 0:
        monkeypatch.setenv("OPTCC_EMULATE_FRACTION", "0.5")
        config.reload()
    y = optcc_mpi.allreduce(np.ones(1009), algorithm="ring", emulate="bw=10GB/s")
    np.testing.assert_array_equal(y, np.full(1009, float(p)))


@pytest.mark.timeout(120)
def test_bad_environment_on_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """$OPTCC_LINKS and $OPTCC_EMULATE are per-rank inputs too."""
    comm, rank, p = world()
    for name, value, match in (
        ("OPTCC_LINKS", "0:zero", "OPTCC_LINKS"),
        ("OPTCC_EMULATE", "bw=fast", "cannot parse bandwidth"),
    ):
        if rank == p - 1:
            monkeypatch.setenv(name, value)
            config.reload()
        with pytest.raises(ValueError, match=match):
            optcc_mpi.allreduce(np.ones(8))
        monkeypatch.delenv(name, raising=False)
        config.reload()
        y = optcc_mpi.allreduce(np.ones(5), algorithm="ring")
        np.testing.assert_array_equal(y, np.full(5, float(p)))


@pytest.mark.timeout(120)
def test_link_rate_is_agreed(monkeypatch: pytest.MonkeyPatch) -> None:
    """$OPTCC_LINK_RATE sizes the schedules (issue 42): ranks whose rates differ would
    build different ones, so the check agrees on it (the same error on every rank, the
    buffer unchanged); a bad rate on one rank is an error on every rank; the same rate
    everywhere runs."""
    comm, rank, p = world()
    if p < 2:
        pytest.skip("a disagreement needs two ranks")
    x = np.arange(100_003, dtype=np.float64)
    for value, match in (("100mbit" if rank == 0 else "200mbit", "link profile differs"),
                         ("fast" if rank == p - 1 else "100mbit", "OPTCC_LINK_RATE")):  # fmt: skip
        monkeypatch.setenv("OPTCC_LINK_RATE", value)
        config.reload()
        with pytest.raises(ValueError, match=match):
            optcc_mpi.allreduce(x, algorithm="optcc", links=f"{p - 1}:0.5")
        np.testing.assert_array_equal(x, np.arange(100_003))
    monkeypatch.setenv("OPTCC_LINK_RATE", "100mbit")
    config.reload()
    y = optcc_mpi.allreduce(x, algorithm="optcc", links=f"{p - 1}:0.5")
    np.testing.assert_array_equal(y, p * x)


@pytest.mark.parametrize("fraction", ["1e-9", "1e-12", "1e-300"])
@pytest.mark.parametrize("algorithm", ALGS)
def test_tiny_fractions(algorithm: str, fraction: str) -> None:
    """Any fraction in (0, 1] plans and runs (1e-9 used to make OptCC's LP fail)."""
    comm, rank, p = world()
    links = f"{p - 1}:{fraction}"
    for n in (p + 1, 1009, 100_003):
        xs = inputs("exact", "float32", n, p, 9)
        y = optcc_mpi.allreduce(xs[rank], algorithm=algorithm, links=links)
        check_result(y, xs, "sum", "float32", exact=True)
        same_everywhere(comm, y)


@pytest.mark.timeout(120)
def test_intercommunicator_rejected() -> None:
    """An intercommunicator is refused clearly on every rank, with or without the check,
    and by the mpi4py face."""
    comm, rank, p = world()
    if p < 2:
        pytest.skip("an intercommunicator needs two groups")
    local = comm.Split(rank % 2, rank)
    inter = local.Create_intercomm(0, comm, 1 - rank % 2)
    try:
        for check in (True, False):
            with pytest.raises(ValueError, match="intercommunicators are not supported"):
                optcc_mpi.allreduce(np.ones(4), comm=inter, check=check)
        with pytest.raises(ValueError, match="intercommunicators"):
            optcc_mpi.Comm(inter)
    finally:
        inter.Free()
        local.Free()
    y = optcc_mpi.allreduce(np.ones(5))
    np.testing.assert_array_equal(y, np.full(5, float(p)))


def test_comm_null_and_non_communicators() -> None:
    """COMM_NULL and things that are not communicators: clear errors, no MPI exception."""
    with pytest.raises(ValueError, match="COMM_NULL"):
        optcc_mpi.allreduce(np.ones(2), comm=MPI.COMM_NULL)
    with pytest.raises(TypeError, match="mpi4py communicator"):
        optcc_mpi.allreduce(np.ones(2), comm="world")
    with pytest.raises(TypeError, match="mpi4py communicator"):
        optcc_mpi.Comm(3)
    with pytest.raises(ValueError, match="COMM_NULL"):
        optcc_mpi.Comm(MPI.COMM_NULL)


@pytest.mark.timeout(120)
def test_env_links_are_world_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """$OPTCC_LINKS names COMM_WORLD ranks; on another communicator it is translated to
    that communicator's ranks, and ranks that are not members drop out."""
    comm, rank, p = world()
    monkeypatch.setenv("OPTCC_LINKS", f"{p - 1}:0.5")
    config.reload()
    x = np.arange(1009, dtype=np.float64)
    # Reversed order: COMM_WORLD rank p-1 is rank 0 here.
    rev = comm.Split(0, p - 1 - rank)
    try:
        y = optcc_mpi.allreduce(x, comm=rev, algorithm="optcc")
        np.testing.assert_array_equal(y, x * p)
        assert str(last_stats()["links"]) == "0:0.5"
    finally:
        rev.Free()
    # Without COMM_WORLD rank p-1: healthy (with it alone: rank 0 of one).
    sub = comm.Split(int(rank == p - 1), rank)
    try:
        y = optcc_mpi.allreduce(x, comm=sub, algorithm="optcc")
        np.testing.assert_array_equal(y, x * sub.Get_size())
        expect = "0:0.5" if rank == p - 1 else "healthy"
        assert str(last_stats()["links"]) == expect
    finally:
        sub.Free()
    # A rank beyond COMM_WORLD is an error on every rank.
    monkeypatch.setenv("OPTCC_LINKS", f"{p}:0.5")
    config.reload()
    with pytest.raises(ValueError, match="outside COMM_WORLD"):
        optcc_mpi.allreduce(np.ones(4))
    # An explicit profile stays in the given communicator's ranks.
    monkeypatch.delenv("OPTCC_LINKS")
    config.reload()
    y = optcc_mpi.allreduce(x, algorithm="optcc", links=links_for(p))
    assert str(last_stats()["links"]) == (links_for(p) or "healthy")


@pytest.mark.timeout(300)
def test_agreement_carries_small_messages() -> None:
    """Short messages ride in the argument agreement from the second call of a size on:
    the results stay exact and identical whatever the sequence of sizes."""
    comm, rank, p = world()
    if p < 2:
        pytest.skip("no agreement on one rank")
    calls = [("float64", "sum"), ("int16", "bxor"), ("float32", "max"), ("float64", "sum")]
    for i, n in enumerate([1, 8, 300, 5000, 1, 70_000, 3, 0, 2, 40_000]):
        inline = []
        for j, (dtype, op) in enumerate(calls):
            xs = inputs("exact", dtype, n, p, 20 + i * 10 + j, op)
            y = optcc_mpi.allreduce(xs[rank], op=op)
            check_result(y, xs, op, dtype, exact=True)
            same_everywhere(comm, y)
            inline.append(last_stats()["inline"])
        # The last call repeats the first's type at the size of the call before it: it
        # travels with the agreement when the room agreed then holds it (an empty
        # message has nothing to carry).
        nbytes = n * 8
        room = optcc_mpi.check.state.room_for(p, n * 4)
        if n * 4 > room:
            room = 0  # the call before could not travel with the check: no room kept
        expect = 0 < nbytes <= room and p <= optcc_mpi.collectives.GATHER_MAX_P
        assert inline[-1] == expect, (n, inline)
    # Repeated calls of one short size travel with the agreement from the second on.
    optcc_mpi.allreduce(np.ones(100))
    assert not last_stats()["inline"]  # after a large call: no room kept
    for _ in range(3):
        y = optcc_mpi.allreduce(np.ones(100))
        assert last_stats()["inline"]
        np.testing.assert_array_equal(y, np.full(100, float(p)))


@pytest.mark.timeout(300)
def test_agreement_by_allreduce_above_gather_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above GATHER_MAX_P ranks the agreement is an MPI_Allreduce of the headers:
    results and errors as with the gather."""
    comm, rank, p = world()
    # Where the collectives read it: the flow (the short path, the gather), and the call
    # checked on its rank (whether its data may travel in the check).
    for module in (optcc_mpi.collectives, arguments):
        monkeypatch.setattr(module, "GATHER_MAX_P", 0)
    for n in (1, 1009, 70_000):
        xs = inputs("exact", "float64", n, p, 30)
        y = optcc_mpi.allreduce(xs[rank])
        check_result(y, xs, "sum", "float64", exact=True)
        same_everywhere(comm, y)
        assert not last_stats()["inline"]
    if p > 1:
        _expect_everywhere(
            lambda: optcc_mpi.allreduce(np.ones(10 + (rank == 0))), "element count differs"
        )
        _expect_everywhere(
            lambda: optcc_mpi.allreduce(np.ones(4), recvbuf=_readonly(4) if rank else None),
            "read-only",
        )


# -- objects exposing only the CUDA array interface --------------------------------------------
class _DeviceOnly:
    """Device memory as Numba or mpi4py's GPU test wrappers present it: nothing but
    ``__cuda_array_interface__`` (here over host memory, which the fake CuPy reads)."""

    def __init__(self, host: np.ndarray) -> None:
        self.host = host

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": self.host.shape,
            "typestr": self.host.dtype.str,
            "data": (self.host.__array_interface__["data"][0], False),
            "version": 3,
            "strides": None,
        }


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch):
    """A CuPy over host memory, enough for ``CupyArrayOps``: ``asarray`` wraps the CUDA
    array interface's pointer without a copy, as CuPy does with device memory."""
    import ctypes
    import types

    from optcc_mpi import arrays

    class FakeArray(np.ndarray):
        def set(self, host: np.ndarray) -> None:
            np.copyto(self, host)

    def asarray(obj: object) -> FakeArray:
        face = obj.__cuda_array_interface__
        dtype = np.dtype(face["typestr"])
        n = int(np.prod(face["shape"]))
        raw = (ctypes.c_char * (n * dtype.itemsize)).from_address(face["data"][0])
        return np.frombuffer(raw, dtype=dtype).reshape(face["shape"]).view(FakeArray)

    cp = types.ModuleType("cupy")
    cp.__getattr__ = lambda name: getattr(np, name)  # type: ignore[attr-defined]
    cp.ndarray = FakeArray
    cp.is_available = lambda: True
    cp.asarray = asarray
    cp.empty = lambda n, dtype: np.empty(n, dtype=dtype).view(FakeArray)
    cp.empty_like = lambda a: np.empty_like(a).view(FakeArray)
    cp.asnumpy = lambda a: np.array(a)
    stream = types.SimpleNamespace(synchronize=lambda: None)
    cp.cuda = types.SimpleNamespace(get_current_stream=lambda: stream)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    arrays._cupy_factory.cache_clear()
    before = list(arrays._FACTORIES)
    yield cp
    arrays._FACTORIES[:] = before
    for factory in [f for f in arrays._INSTANCES if f is arrays.CupyArrayOps]:
        del arrays._INSTANCES[factory]
    arrays._cupy_factory.cache_clear()


@pytest.mark.parametrize("algorithm", ALGS)
def test_cuda_array_interface_objects(fake_cupy: object, algorithm: str) -> None:
    """Issue 23: objects with only ``__cuda_array_interface__`` were refused as an
    "unsupported sendbuf type"; mpi4py takes them. They are viewed through CuPy without
    a copy (staged through host memory for an MPI that is not CUDA-aware): the same bits
    as NumPy's, in place and out of place."""
    comm, rank, p = world()
    for n in (1, 1009, 70001):
        xs = inputs("exact", "float32", n, p, 3)
        want = optcc_mpi.allreduce(xs[rank], algorithm=algorithm, links=links_for(p))
        src, dst = _DeviceOnly(xs[rank].copy()), _DeviceOnly(np.zeros(n, np.float32))
        optcc_mpi.allreduce(src, dst, algorithm=algorithm, links=links_for(p))
        np.testing.assert_array_equal(dst.host.view(np.uint8), want.view(np.uint8))
        np.testing.assert_array_equal(src.host, xs[rank])  # the send buffer is untouched
        buf = _DeviceOnly(xs[rank].copy())
        optcc_mpi.allreduce(optcc_mpi.IN_PLACE, buf, algorithm=algorithm, links=links_for(p))
        np.testing.assert_array_equal(buf.host.view(np.uint8), want.view(np.uint8))


def test_cuda_array_interface_without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a usable CuPy the object is refused, saying what it needs."""
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(TypeError, match="CUDA array interface.*needs CuPy"):
        optcc_mpi.allreduce(_DeviceOnly(np.ones(4, np.float32)))


@pytest.mark.timeout(120)
def test_healthy_links_told_take_the_paths_of_links_not_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A healthy profile told (``Links()``, ``{}``, ``$OPTCC_LINKS=healthy``) is the
    default's own object, so that its calls take the paths of calls told nothing (the
    short path, the ride, the compiled path all test for it)."""
    comm, _, _ = world()
    st = collectives.comm_state(comm)
    for links in (optcc_mpi.Links(), {}, "healthy"):
        assert planning._links_of(st, links, 1 << 20) is planning._HEALTHY
    monkeypatch.setenv("OPTCC_LINKS", "healthy")
    config.reload()
    assert planning._links_of(st, None, 1 << 20) is planning._HEALTHY
    monkeypatch.setenv("OPTCC_LINKS", "0:0.5")
    config.reload()
    assert not planning._links_of(st, None, 1 << 20).healthy
