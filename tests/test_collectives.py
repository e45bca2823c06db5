"""The public AllReduce under MPI: correctness, determinism, bad input, device paths.

Run under mpiexec at 2, 3, 4, 5 and 8 ranks (``make test``).
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest
from array_kinds import KIND_IDS, KINDS

import optcc_mpi
from optcc_mpi import testing
from optcc_mpi.backend import DTYPES, _instance

MPI = pytest.importorskip("mpi4py.MPI")
pytestmark = pytest.mark.mpi

ALGS = ["ring", "optcc", "r2ccl", "native", "auto"]
OPS = {"sum": np.sum, "max": np.max, "min": np.min}
#: Unit roundoff of each float type (the reduction error bound uses it).
UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}


def world() -> tuple[object, int, int]:
    comm = MPI.COMM_WORLD
    return comm, comm.Get_rank(), comm.Get_size()


def counts(p: int) -> list[int]:
    return sorted({0, 1, max(p - 1, 0), p + 1, 97, 1009, 2**20 + 3})


def links_for(p: int) -> str:
    # A degraded rank that is not rank 0, so rank order and straggler order differ.
    return f"{p - 1}:0.5" if p > 1 else ""


def inputs(kind: str, dtype: str, n: int, p: int, seed: int) -> list[np.ndarray]:
    """Every rank's input, computable on every rank (no communication needed)."""
    dt = DTYPES[dtype]
    out = []
    for r in range(p):
        g = np.random.default_rng([seed, r, n])
        if dt.kind in "iu":
            if kind == "random":
                x = g.integers(-1000, 1000, n)
            else:  # wrap-around near the limits of the type
                info = np.iinfo(dt)
                x = g.integers(info.max // 2, info.max, n) * (1 if r % 2 else -1)
            out.append(x.astype(dt))
        elif kind == "random":
            out.append(g.standard_normal(n).astype(dt))
        elif kind == "exact":
            # Small integers: every partial sum is exact in every float type.
            out.append(g.integers(-8, 9, n).astype(dt))
        else:  # adversarial: large values of alternating sign plus small ones
            big = 2.0 ** (8 if dt.itemsize == 2 else 40)
            x = (-1) ** r * big * (1 + g.random(n)) + g.standard_normal(n)
            out.append(x.astype(dt))
    return out


def reference(xs: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    """The exact result for integers (with the type's wrap-around), float64 for floats."""
    dt = DTYPES[dtype]
    if dt.kind in "iu":
        if op == "sum":
            # Unsigned 64-bit addition wraps modulo 2**64; casting back to the type
            # wraps modulo its width: exactly two's-complement overflow.
            total = np.zeros(xs[0].size, dtype=np.uint64)
            for x in xs:
                total += x.astype(np.int64).view(np.uint64)
            return total.view(np.int64).astype(dt)
        return OPS[op](np.stack(xs), axis=0)
    return OPS[op](np.stack([x.astype(np.float64) for x in xs]), axis=0)


def check_result(y: np.ndarray, xs: list[np.ndarray], op: str, dtype: str, exact: bool) -> None:
    ref = reference(xs, op, dtype)
    if DTYPES[dtype].kind in "iu":
        np.testing.assert_array_equal(y, ref)
        return
    got = y.astype(np.float64)
    if exact or op != "sum":
        np.testing.assert_array_equal(got, ref)
    else:
        # Each of the p-1 additions rounds once (twice for 16-bit types: float32, then
        # the type), so |error| <= 2 (p-1) u sum|x| per element.
        scale = np.sum(np.stack([np.abs(x.astype(np.float64)) for x in xs]), axis=0)
        tol = 2 * (len(xs) - 1) * UNIT[dtype] * scale + 1e-300
        bad = np.abs(got - ref) > tol
        assert not bad.any(), f"{bad.sum()} elements beyond the error bound"


def digest(y: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(y).view(np.uint8).tobytes())


def same_everywhere(comm: object, y: np.ndarray) -> None:
    digests = comm.allgather(digest(y))
    assert len(set(digests)) == 1, f"results differ across ranks: {digests}"


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matrix(algorithm: str, dtype: str) -> None:
    """Every algorithm x dtype x op x count, in place and out of place, against a
    float64 reference, bit-identical on every rank."""
    comm, rank, p = world()
    links = links_for(p)
    for op in OPS:
        for n in counts(p):
            if n == 2**20 + 3 and (op != "sum" or dtype not in ("float32", "bfloat16", "int64")):
                continue  # the largest count once per representative type keeps this quick
            # out of place, small integers: exact in every type
            xs = inputs("exact", dtype, n, p, 1)
            x = xs[rank].copy()
            y = optcc_mpi.allreduce(x, op=op, algorithm=algorithm, links=links)
            np.testing.assert_array_equal(x, xs[rank])  # input untouched
            check_result(y, xs, op, dtype, exact=True)
            same_everywhere(comm, y)
            # in place, random data: within the rounding bound
            xs = inputs("random", dtype, n, p, 2)
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
def test_array_backends(kind: object, algorithm: str) -> None:
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
        be.mpi_buffer(a)
    be.synchronize()
    be.mpi_buffer(a)


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
    "unsupported dtype": (lambda r, p: dict(sendbuf=np.ones(4, np.complex64)), "unsupported dtype"),
    "unsupported op": (lambda r, p: dict(sendbuf=np.ones(4), op="prod"), "unsupported op 'prod'"),
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
}


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


def test_bfloat16_type_is_ml_dtypes() -> None:
    assert DTYPES["bfloat16"] == np.dtype(ml_dtypes.bfloat16)


def test_links_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    comm, rank, p = world()
    monkeypatch.setenv("OPTCC_LINKS", links_for(p))
    x = np.arange(1009, dtype=np.float64)
    y = optcc_mpi.allreduce(x, algorithm="optcc")
    np.testing.assert_array_equal(y, x * p)
    stats = optcc_mpi.collectives.last_stats()
    assert str(stats["links"]) == (links_for(p) or "healthy")
