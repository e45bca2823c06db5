"""Bad data is caught: malformed sparse arrays, corrupt chunks, checksums, overflowing values.

Every check raises :class:`~optcc_mpi.errors.DatasetError` naming the file, the dataset inside
it and the position; the converter's errors name the text file and line, and the command
exits non-zero.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import h5py
import numpy as np
import pytest
import scipy.sparse as sp

from optcc_mpi import data
from optcc_mpi.cli import main
from optcc_mpi.errors import DatasetError


def _sparse_file(path: Path, *, csc: bool = True, compression: str | None = None) -> np.ndarray:
    """A 40 x 12 CSR file whose every row and column holds entries; returns X (float64)."""
    rng = np.random.default_rng(5)
    X = rng.standard_normal((40, 12))
    X[rng.random(X.shape) < 0.6] = 0.0
    X[np.arange(40), np.arange(40) % 12] = 1.0 + np.arange(40)  # no empty row or column
    X[:, 3] = 2.0  # a full column: every row has at least two entries
    data.write_dataset(
        path,
        sp.csr_matrix(X),
        np.arange(40) % 2,
        task="binary",
        origin="test",
        licence="CC0-1.0",
        dtype="float64",
        csc=csc,
        compression=compression,
    )
    return X


def _load_all(path: Path, size: int = 3) -> None:
    for r in range(size):
        data.load_partition(path, rank=r, size=size)


# --------------------------------------------------------------------------------------------
# CSR structure, checked at load (the copy-less path reads and checks all of X)
# --------------------------------------------------------------------------------------------


def test_indptr_not_monotone(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    _sparse_file(path, csc=False)
    with h5py.File(path, "r+") as f:
        ptr = f["X/indptr"][...]
        f["X/indptr"][7] = ptr[8] + 1  # indptr[8] < indptr[7]
    with pytest.raises(DatasetError, match=r"a\.h5: X/indptr is not monotone: X/indptr\[8\]"):
        _load_all(path)
    with pytest.raises(DatasetError, match=r"X/indptr is not monotone"):
        data.validate(path, scan=True)


def test_indptr_last_is_not_nnz(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    _sparse_file(path, csc=False)
    with h5py.File(path, "r+") as f:
        nnz = f["X/data"].shape[0]
        f["X/indptr"][40] = nnz - 1
    with pytest.raises(
        DatasetError, match=rf"a\.h5: X/indptr\[40\] = {nnz - 1} \(the last entry\) but {nnz}"
    ):
        data.load_partition(path)
    with h5py.File(path, "r+") as f:
        f["X/indptr"][0] = 1
        f["X/indptr"][40] = nnz
    with pytest.raises(DatasetError, match=r"X/indptr\[0\] = 1, but indptr must start at 0"):
        data.load_partition(path)


@pytest.mark.parametrize(
    "how,why",
    [("outside", "is outside 0..11"), ("duplicate", "duplicate index"), ("unsorted", "unsorted")],
)
def test_bad_indices(tmp_path: Path, how: str, why: str) -> None:
    path = tmp_path / "a.h5"
    _sparse_file(path, csc=False)
    with h5py.File(path, "r+") as f:
        ptr, idx = f["X/indptr"][...], f["X/indices"][...]
        k = int(ptr[9]) + 1  # the second entry of row 9
        idx[k] = {"outside": 12, "duplicate": idx[k - 1], "unsorted": idx[k - 1] - 1}[how]
        if how == "unsorted":
            assert idx[k] >= 0
        f["X/indices"][...] = idx
    pattern = rf"a\.h5: .*X/indices\[{k}\] = {idx[k]} .*row 9|row 9.*X/indices\[{k}\] = {idx[k]}"
    with pytest.raises(DatasetError, match=why) as info:
        _load_all(path)
    assert str(path) in str(info.value)
    assert re_search(pattern, str(info.value))


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


def test_the_csc_copy_is_checked_too(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    _sparse_file(path)
    with h5py.File(path, "r+") as f:
        ptr, rows = f["X_csc/indptr"][...], f["X_csc/indices"][...]
        k = int(ptr[5]) + 1
        f["X_csc/indices"][k] = rows[k - 1]  # a duplicate row in column 5
    # Column 5 is rank 1's (of 3: columns 4:8); the other ranks do not read it.
    data.load_partition(path, rank=0, size=3)
    with pytest.raises(
        DatasetError,
        match=rf"duplicate index in column 5: X_csc/indices\[{k}\] = {rows[k - 1]}",
    ):
        data.load_partition(path, rank=1, size=3)
    with h5py.File(path, "r+") as f:
        f["X_csc/indices"][k] = rows[k]
        f["X_csc/indptr"][9] = ptr[7]  # falls below indptr[8]
    with pytest.raises(DatasetError, match=r"X_csc/indptr is not monotone: X_csc/indptr\[9\]"):
        data.load_partition(path, rank=2, size=3)


def test_scan_finds_a_copy_that_does_not_match(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    X = _sparse_file(path)
    data.validate(path, scan=True)  # a fresh file is consistent
    with h5py.File(path, "r+") as f:
        f["X/data"][4] = 123.0  # change X but not its copy (a stale copy)
    assert X.ravel()[np.flatnonzero(X.ravel())[4]] != 123.0
    with pytest.raises(DatasetError, match="the CSC copy 'X_csc' does not match X"):
        data.validate(path, scan=True)


def test_header_rejects_a_copy_of_another_shape(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    _sparse_file(path)
    with h5py.File(path, "r+") as f:
        f["X_csc"].attrs["shape"] = np.array([40, 13])
    with pytest.raises(DatasetError, match="X_csc/indptr has shape"):
        data.validate(path)


# --------------------------------------------------------------------------------------------
# checksums and corrupt chunks
# --------------------------------------------------------------------------------------------


def _flip_byte_in_chunk(path: Path, dataset: str, chunk: int, at: int = 5) -> None:
    with h5py.File(path, "r") as f:
        info = f[dataset].id.get_chunk_info(chunk)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + at)
        b = fh.read(1)
        fh.seek(info.byte_offset + at)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_checksums_are_written_by_default(tmp_path: Path) -> None:
    dense, sparse, syn = tmp_path / "d.h5", tmp_path / "s.h5", tmp_path / "y.h5"
    data.write_dataset(
        dense,
        np.ones((5, 3)),
        np.zeros(5),
        task="regression",
        origin="o",
        licence="l",
        extra={"w": np.arange(3.0), "scalar": 2.0},
    )
    _sparse_file(sparse)
    data.synth("linear", 100, 4, 0, syn, progress=False)
    src = tmp_path / "t.svm"
    src.write_text("1 1:2 3:4\n0 2:1\n")
    data.convert_svmlight(src, tmp_path / "c.h5", progress=False, layout="csr")
    for path in (dense, sparse, syn, tmp_path / "c.h5"):
        with h5py.File(path, "r") as f:
            arrays = _datasets(f)
            for ds in arrays:
                if ds.shape:  # scalars cannot carry filters
                    assert ds.fletcher32, (path.name, ds.name)
            assert f.attrs["optcc_layout"] == 1 and f.attrs["optcc_layout_minor"] == 1
        assert data.validate(path)["checksums"] is True
    data.write_dataset(
        tmp_path / "n.h5",
        np.ones((5, 3)),
        np.zeros(5),
        task="regression",
        origin="o",
        licence="l",
        checksum=False,
    )
    assert data.validate(tmp_path / "n.h5")["checksums"] is False


def _datasets(f: h5py.File) -> list[h5py.Dataset]:
    found: list[h5py.Dataset] = []
    f.visititems(lambda _, obj: found.append(obj) if isinstance(obj, h5py.Dataset) else None)
    return found


@pytest.mark.parametrize("layout", ["dense", "csr", "csc"])
def test_a_corrupt_byte_fails_its_checksum(tmp_path: Path, layout: str) -> None:
    path = tmp_path / "a.h5"
    if layout == "dense":
        data.synth("linear", 3000, 16, 1, path, progress=False)  # chunks (..., 1) columns
        target, chunk, rank = "X", 9, 2  # chunk 9 holds column 9: rank 2's of 4
    else:
        _sparse_file(path, csc=(layout == "csc"))
        target = "X/data" if layout == "csr" else "X_csc/data"
        chunk, rank = 0, 1
    _flip_byte_in_chunk(path, target, chunk)
    with pytest.raises(DatasetError) as info:
        data.load_partition(path, rank=rank, size=4)
    msg = str(info.value)
    assert msg.startswith(f"{path}: cannot read dataset {target}")
    assert "corrupt" in msg and "checksum" in msg
    if layout == "dense":
        data.load_partition(path, rank=0, size=4)  # other ranks' chunks are fine


def test_a_corrupt_gzip_chunk_names_file_and_dataset(tmp_path: Path) -> None:
    path = tmp_path / "g.h5"
    data.write_dataset(
        path,
        np.random.default_rng(0).standard_normal((4000, 3)),
        np.zeros(4000),
        task="regression",
        origin="o",
        licence="l",
        compression="gzip",
        checksum=False,
    )
    with h5py.File(path, "r") as f:
        assert f["X"].compression == "gzip" and not f["X"].fletcher32
        info = f["X"].id.get_chunk_info(1)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset)
        fh.write(b"\x00" * 16)  # an invalid zlib header: inflate must fail
    with pytest.raises(DatasetError, match=rf"{path}: cannot read dataset X\[0:4000, 0:3\]"):
        data.load_dense(path)
    with pytest.raises(DatasetError, match="cannot read dataset X"):
        data.validate(path, scan=True)


def test_corrupt_y_names_y(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    _sparse_file(path)
    _flip_byte_in_chunk(path, "y", 0)
    with pytest.raises(DatasetError, match=rf"{path}: cannot read dataset y\[0:40\]"):
        data.load_partition(path)


# --------------------------------------------------------------------------------------------
# the converter rejects values that overflow the stored type
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,value,ok",
    [
        ("float32", "1e39", False),
        ("float32", "-3.5e38", False),
        ("float32", "3.4e38", True),
        ("bfloat16", "1e39", False),
        ("bfloat16", "3.4e38", False),  # above bfloat16's largest, 3.39e38
        ("bfloat16", "3.38e38", True),
        ("float64", "1e39", True),
    ],
)
def test_convert_rejects_overflow_with_the_line(
    tmp_path: Path, dtype: str, value: str, ok: bool
) -> None:
    src = tmp_path / "o.svm"
    src.write_text(f"1 1:1 2:2\n0 2:5\n# comment\n1 1:3 4:{value}\n0 1:1\n")
    dst = tmp_path / "o.h5"
    if ok:
        data.convert_svmlight(src, dst, dtype=dtype, progress=False)
        X, _ = data.load_dense(dst, dtype="float64")
        assert np.isfinite(X).all() and abs(X[2, 3]) > 1e38
        return
    with pytest.raises(DatasetError, match=rf"o\.svm: line 4: feature value .* overflows {dtype}"):
        data.convert_svmlight(src, dst, dtype=dtype, progress=False)
    assert not dst.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["o.svm"]


def test_convert_overflow_exits_nonzero(tmp_path: Path, capsys) -> None:
    src = tmp_path / "o.svm"
    src.write_text("1 1:1\n0 1:1e39\n")
    assert main(["data", "convert", str(src), str(tmp_path / "o.h5"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "o.svm: line 2: feature value 1e+39 overflows float32" in err
    assert (
        main(["data", "convert", str(src), str(tmp_path / "o.h5"), "-q", "--dtype", "float64"]) == 0
    )


def test_convert_names_a_corrupt_compressed_input(tmp_path: Path) -> None:
    src = tmp_path / "t.svm.gz"
    with gzip.open(src, "wb") as fh:
        fh.write(b"".join(b"1 1:%d 2:3\n" % i for i in range(20000)))
    raw = bytearray(src.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = b"\xff" * 64
    src.write_bytes(bytes(raw))
    with pytest.raises(DatasetError, match=r"t\.svm\.gz: cannot decompress the text"):
        data.convert_svmlight(src, tmp_path / "t.h5", progress=False)


# --------------------------------------------------------------------------------------------
# versions
# --------------------------------------------------------------------------------------------


def test_files_of_layout_1_0_still_load(tmp_path: Path) -> None:
    # As layout 1.0 wrote them: no minor version, no checksums, CSR without its copy.
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    X = _sparse_file(a, csc=False)
    data.write_dataset(
        a,
        sp.csr_matrix(X),
        np.arange(40) % 2,
        task="binary",
        origin="t",
        licence="t",
        dtype="float64",
        csc=False,
        checksum=False,
    )
    with h5py.File(a, "r+") as f:
        del f.attrs["optcc_layout_minor"]
    info = data.validate(a, scan=True)
    assert info["layout_minor"] is None and not info["checksums"] and not info["csc"]
    _sparse_file(b, csc=True)
    for r in range(5):
        pa = data.load_partition(a, rank=r, size=5, rows=slice(3, 31))
        pb = data.load_partition(b, rank=r, size=5, rows=slice(3, 31))
        assert (pa.X != pb.X).nnz == 0 and pa.X.dtype == pb.X.dtype
        assert np.array_equal(pa.X.indptr, pb.X.indptr)
        assert np.array_equal(pa.X.indices, pb.X.indices)


def test_a_newer_major_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    _sparse_file(path)
    with h5py.File(path, "r+") as f:
        f.attrs["optcc_layout_minor"] = 7  # a newer minor version: still read
    data.load_partition(path)
    with h5py.File(path, "r+") as f:
        f.attrs["optcc_layout"] = 2
    with pytest.raises(DatasetError, match="optcc_layout = 2 is newer"):
        data.load_partition(path)


def test_help_teaches_checks_copies_and_checksums(capsys) -> None:
    from optcc_mpi.cli import build_parser

    parser = build_parser()
    data_parser = next(a for a in parser._actions if a.dest == "command").choices["data"]
    subs = next(a for a in data_parser._actions if a.dest == "data_command").choices
    convert = subs["convert"].format_help()
    for text in ("--no-csc", "--no-checksum", "1e39", "line number", "X_csc", "220 MB"):
        assert text in convert, text
    info = subs["info"].format_help()
    assert "strictly" in info and "checksum" in info and "status 2" in info
    assert "examples:" in subs["add-csc"].format_help()
    assert "layout 1.1" in data_parser.format_help()
