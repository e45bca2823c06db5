"""Loading scales: each rank reads about 1/P of the matrix, and the CSC copy is exact.

The bytes a rank reads are counted below HDF5: every file the loader opens is opened through
a Python file object that counts what HDF5 reads from it (h5py's ``fileobj`` driver), so
metadata, chunk edges and ``y`` are all counted. Serial tests load rank r of P in turn;
the MPI test loads on sub-communicators of 1, 2, ..., N ranks of one ``mpiexec -n N``.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import scipy.sparse as sp

from optcc_mpi import data
from optcc_mpi.data import writing

# Budget for HDF5 metadata (superblock, object headers, chunk B-trees) read per open; a
# load opens the file twice (header check, then data).
METADATA_BYTES = 256 << 10


class _CountingReader(io.RawIOBase):
    """A read-only binary file that counts the bytes read through it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._f = open(path, "rb")  # noqa: SIM115 - closed by close()
        self.nbytes = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # noqa: ANN001 - a writable buffer
        n = self._f.readinto(b)
        self.nbytes += n or 0
        return n

    def seek(self, pos: int, whence: int = 0) -> int:
        return self._f.seek(pos, whence)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.close()
        super().close()


class ReadCounter:
    """Patch ``h5py.File`` so read-only opens of paths count their bytes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.readers: list[_CountingReader] = []
        real = h5py.File

        def counting_file(name, mode="r", *args, **kwargs):  # noqa: ANN001, ANN202
            if mode == "r" and isinstance(name, (str, os.PathLike)):
                reader = _CountingReader(name)
                self.readers.append(reader)
                return real(reader, "r", *args, **kwargs)
            return real(name, mode, *args, **kwargs)

        monkeypatch.setattr(h5py, "File", counting_file)

    def take(self) -> int:
        """Bytes read since the last call."""
        total = sum(r.nbytes for r in self.readers)
        for r in self.readers:
            r.close()
        self.readers.clear()
        return total


def _sparse(m: int, n: int, nnz_per_row: int, seed: int) -> sp.csr_matrix:
    """Uniformly random columns, so every column block holds about its share of entries."""
    rng = np.random.default_rng(seed)
    idx = np.sort(np.stack([rng.choice(n, nnz_per_row, replace=False) for _ in range(m)]), axis=1)
    ptr = np.arange(0, m * nnz_per_row + 1, nnz_per_row)
    vals = rng.standard_normal(m * nnz_per_row).astype(np.float32)
    return sp.csr_matrix((vals, idx.ravel(), ptr), shape=(m, n))


def _expected(path: Path, cols: slice) -> tuple[int, int]:
    """(bytes of this column block in the CSC copy, bound on what else a rank may read)."""
    with h5py.File(path, "r") as f:
        g = f["X_csc"]
        ptr = g["indptr"]
        lo, hi = int(ptr[cols.start]), int(ptr[cols.stop])
        entry = g["indices"].dtype.itemsize + g["data"].dtype.itemsize
        share = (hi - lo) * entry + (cols.stop - cols.start + 1) * 8
        # Reading part of a chunk reads all of it: at most two partly used chunks per array.
        edges = 2 * (
            g["indices"].chunks[0] * g["indices"].dtype.itemsize
            + g["data"].chunks[0] * g["data"].dtype.itemsize
            + ptr.chunks[0] * 8
        )
        y = f["y"].shape[0] * 8
    return share, edges + y + METADATA_BYTES


@pytest.fixture(scope="module")
def sparse_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """The same 20,000 x 2,000 matrix with 100 entries per row, with and without the copy."""
    X = _sparse(20_000, 2_000, 100, seed=3)
    y = (np.arange(20_000) % 3 == 0).astype(float)
    folder = tmp_path_factory.mktemp("scaling")
    paths = []
    for csc in (True, False):
        path = folder / f"csc{int(csc)}.h5"
        data.write_dataset(path, X, y, task="binary", origin="t", licence="t", csc=csc)
        paths.append(path)
    return paths[0], paths[1], X.nnz


def test_each_rank_reads_its_share_of_a_sparse_file(monkeypatch, sparse_files) -> None:
    path, _, nnz = sparse_files
    with h5py.File(path, "r") as f:
        matrix = sum(f["X_csc"][k].id.get_storage_size() for k in ("indptr", "indices", "data"))
    counter = ReadCounter(monkeypatch)
    for size in range(1, 9):
        for rank in range(size):
            part = data.load_partition(path, rank=rank, size=size)
            got = counter.take()
            share, overhead = _expected(path, part.cols)
            assert share <= got <= share + overhead, (size, rank, got, share, overhead)
            # ... which is about 1/P of the matrix (columns are uniformly random)
            assert got <= matrix / size * 1.1 + overhead, (size, rank, got)
            assert part.X.nnz * 8 + (part.n_local + 1) * 8 == share


def test_without_the_copy_every_rank_reads_all_of_x(monkeypatch, sparse_files) -> None:
    # Layout 1.0 files (no copy) still load, but each rank reads all of X/indices and X/data:
    # the cost the copy removes.
    _, path, nnz = sparse_files
    counter = ReadCounter(monkeypatch)
    data.load_partition(path, rank=3, size=4)
    assert counter.take() >= nnz * 8


def test_each_rank_reads_its_share_of_a_dense_file(monkeypatch, tmp_path: Path) -> None:
    path = tmp_path / "d.h5"
    m, n = 8192, 512  # chunks of 8 columns
    data.synth("logistic", m, n, 0, path, progress=False)
    with h5py.File(path, "r") as f:
        cw = f["X"].chunks[1]
        matrix = f["X"].id.get_storage_size()
    counter = ReadCounter(monkeypatch)
    for size in (1, 2, 3, 4, 7):
        for rank in range(size):
            part = data.load_partition(path, rank=rank, size=size)
            got = counter.take()
            share = m * part.n_local * 4
            # Up to one partly used chunk column at each block edge, y, and metadata.
            overhead = 2 * (cw - 1) * m * 4 + m * 8 + METADATA_BYTES
            assert share <= got <= share + overhead, (size, rank, got, share)
            assert got <= matrix / size + overhead


def test_the_copy_gives_the_same_blocks_as_csr(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    X = sp.random(300, 37, density=0.1, random_state=rng, format="csr")
    y = rng.integers(0, 4, 300)
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    for dtype in ("float64", "float32", "bfloat16"):
        data.write_dataset(a, X, y, task="counts", origin="t", licence="t", dtype=dtype)
        data.write_dataset(b, X, y, task="counts", origin="t", licence="t", dtype=dtype, csc=False)
        for want in (None, "float32", "bfloat16"):
            for size in (1, 2, 5, 37):
                for r in range(size):
                    kw = {"rank": r, "size": size, "dtype": want, "rows": slice(17, 290)}
                    pa, pb = data.load_partition(a, **kw), data.load_partition(b, **kw)
                    assert pa.X.dtype == pb.X.dtype and pa.X.has_sorted_indices
                    assert np.array_equal(pa.X.indptr, pb.X.indptr)
                    assert np.array_equal(pa.X.indices, pb.X.indices)
                    assert np.array_equal(pa.X.data, pb.X.data)
        pi = data.load_partition(a, rank=3, size=4, intercept=True)
        assert pi.cols == slice(29, 38) and np.all(pi.X.toarray()[:, -1] == 1)


def test_converter_builds_the_copy_in_bands(tmp_path: Path, monkeypatch) -> None:
    from sklearn.datasets import dump_svmlight_file, load_svmlight_file

    rng = np.random.default_rng(4)
    X = sp.random(2000, 300, density=0.03, random_state=rng, format="lil")
    X[:, 7] = 1.5  # one dense column, larger than a band
    X = X.tocsr()
    src = tmp_path / "in.svm"
    dump_svmlight_file(X, rng.integers(0, 2, 2000), str(src), zero_based=False)
    ref, _ = load_svmlight_file(str(src), zero_based=False, n_features=300)
    monkeypatch.setattr(writing, "_CSC_BAND_BYTES", 4096)  # dozens of bands
    monkeypatch.setattr(data.svmlight, "_TEXT_BLOCK_BYTES", 5000)  # many text blocks
    out = tmp_path / "out.h5"
    s = data.convert_svmlight(src, out, dtype="float64", layout="csr", progress=False)
    assert s["csc"] is True
    with h5py.File(out, "r") as f:
        C = sp.csc_matrix(
            (f["X_csc/data"][...], f["X_csc/indices"][...], f["X_csc/indptr"][...]),
            shape=(2000, 300),
        )
    assert C.has_sorted_indices and (C != ref.tocsc()).nnz == 0
    data.validate(out, scan=True)  # CSR and copy agree entry for entry
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.svm", "out.h5"]  # spill removed
    s = data.convert_svmlight(src, out, layout="csr", csc=False, progress=False)
    assert s["csc"] is False and not data.validate(out)["csc"]


# --------------------------------------------------------------------------------------------
# MPI: P = 1 .. N ranks of one launch, each loading with its own communicator
# --------------------------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_mpi_each_rank_reads_its_share(monkeypatch) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    folder = Path(comm.bcast(tempfile.mkdtemp(prefix="optcc_scaling_") if comm.rank == 0 else None))
    path = folder / "s.h5"
    error = None
    if comm.rank == 0:
        try:
            X = _sparse(8000, 1000, 100, seed=5)
            y = np.arange(8000) % 2
            data.write_dataset(path, X, y, task="binary", origin="t", licence="t")
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank
            error = repr(exc)
    error = comm.bcast(error, root=0)
    assert error is None, error
    try:
        with h5py.File(path, "r") as f:
            nnz = f["X_csc/data"].shape[0]
        counter = ReadCounter(monkeypatch)
        for size in range(1, comm.size + 1):
            sub = comm.Split(0 if comm.rank < size else MPI.UNDEFINED, comm.rank)
            if sub != MPI.COMM_NULL:
                part = data.load_partition(path, comm=sub)
                got = counter.take()
                share, overhead = _expected(path, part.cols)
                # Every rank sees every rank's numbers and reaches the same verdict, so a
                # failure raises everywhere and no rank is left in a collective.
                report = sub.allgather((sub.rank, got, share, overhead, part.X.nnz))
                sub.Free()
                assert all(s <= g <= s + o for _, g, s, o, _ in report), (size, report)
                assert sum(r[-1] for r in report) == nnz
            comm.Barrier()
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


def test_add_csc_upgrades_a_layout_1_0_file(tmp_path: Path, monkeypatch, capsys) -> None:
    from optcc_mpi.cli import main

    rng = np.random.default_rng(9)
    X = sp.random(500, 90, density=0.05, random_state=rng, format="csr", dtype=np.float32)
    y = rng.integers(0, 2, 500)
    old, new = tmp_path / "old.h5", tmp_path / "new.h5"
    data.write_dataset(old, X, y, task="binary", origin="t", licence="t", csc=False)
    data.write_dataset(new, X, y, task="binary", origin="t", licence="t")
    with h5py.File(old, "r+") as f:
        del f.attrs["optcc_layout_minor"]  # as layout 1.0 wrote it
    monkeypatch.setattr(writing, "_CSC_BAND_BYTES", 2048)  # several bands
    assert main(["data", "add-csc", str(old), "-q"]) == 0
    assert "added the CSC copy" in capsys.readouterr().out
    with h5py.File(old, "r") as f, h5py.File(new, "r") as g:
        for key in ("indptr", "indices", "data"):
            assert np.array_equal(f["X_csc"][key][...], g["X_csc"][key][...]), key
        assert f.attrs["optcc_layout_minor"] == 1 and "X_csc.partial" not in f
    data.validate(old, scan=True)
    assert data.add_csc(old) is False  # already there
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.h5", "old.h5"]
    assert main(["data", "info", str(old)]) == 0
    assert re.search(
        r"^layout +csr, .* with CSC copy X_csc \(optcc_layout 1\.1\)$",
        capsys.readouterr().out,
        re.M,
    )


def test_add_csc_refuses_dense_and_malformed_files(tmp_path: Path) -> None:
    dense = tmp_path / "d.h5"
    data.synth("linear", 50, 4, 0, dense, progress=False)
    with pytest.raises(data.DatasetError, match="X is dense"):
        data.add_csc(dense)
    bad = tmp_path / "b.h5"
    X = sp.random(60, 10, density=0.3, random_state=1, format="csr")
    data.write_dataset(bad, X, np.zeros(60), task="regression", origin="t", licence="t", csc=False)
    with h5py.File(bad, "r+") as f:
        f["X/indices"][3] = 10
    with pytest.raises(data.DatasetError, match=r"X/indices\[3\] = 10 is outside 0..9"):
        data.add_csc(bad)
    with h5py.File(bad, "r") as f:
        assert "X_csc" not in f and "X_csc.partial" not in f  # nothing written
