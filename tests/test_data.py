"""Tests of ``optcc_mpi.data`` (HDF5 layout, partitioned loading, converters, generators)
and of the ``optcc-mpi data`` command.

Serial tests are plain; tests marked ``mpi`` need ``mpiexec -n N ... --with-mpi``. With
``--with-mpi`` pytest-mpi also runs unmarked tests on every rank, so the serial tests skip
under an MPI launcher with more than one rank: they already ran in the serial pass, and N
copies of them would only compete for the cores.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import tempfile
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
import pytest
import scipy.sparse as sp

from optcc_mpi import config, data
from optcc_mpi.cli import data as cli_data
from optcc_mpi.data import DatasetError

BF16 = np.dtype(ml_dtypes.bfloat16)


# scikit-learn is the independent reference parser and writer of svmlight text. It is
# imported on first use: importing it costs about a second, paid on every rank under mpiexec.
def dump_svmlight_file(*args, **kwargs):
    from sklearn.datasets import dump_svmlight_file as dump

    return dump(*args, **kwargs)


def load_svmlight_file(*args, **kwargs):
    from sklearn.datasets import load_svmlight_file as load

    return load(*args, **kwargs)


def _launcher_size() -> int:
    for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
        if key in os.environ:
            return int(os.environ[key])
    return 1


@pytest.fixture(autouse=True)
def _serial_once(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("mpi") is None and _launcher_size() > 1:
        pytest.skip("serial test: runs in the serial pass, not on every MPI rank")


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _random_sparse(m: int, n: int, density: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((m, n))
    X[rng.random((m, n)) >= density] = 0.0
    X[3] = 0.0  # a row without features
    X[:, n - 1] = 0.0  # and a column absent from the file ...
    X[5, n - 1] = 1.5  # ... except once, so the last index still appears
    return X


def _small_file(
    path: Path,
    *,
    dtype: str = "float32",
    csr: bool = False,
    m: int = 37,
    n: int = 13,
    seed: int = 0,
    csc: bool = True,
) -> np.ndarray:
    """Write a small dataset and return the X it holds (in float64)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((m, n))
    if csr:
        X[rng.random((m, n)) < 0.7] = 0.0
    y = (rng.random(m) < 0.5).astype(float)
    data.write_dataset(
        path,
        sp.csr_matrix(X) if csr else X,
        y,
        task="binary",
        origin="test",
        licence="CC0-1.0",
        dtype=dtype,
        chunk_cols=2 if not csr else None,
        csc=csc,
    )
    return X


# --------------------------------------------------------------------------------------------
# column_block and chunk_shape
# --------------------------------------------------------------------------------------------


def test_column_block_covers_every_column_once() -> None:
    for n in range(1, 41):
        for size in range(1, n + 1):
            blocks = [data.column_block(n, size, r) for r in range(size)]
            cols = np.concatenate([np.arange(b.start, b.stop) for b in blocks])
            assert np.array_equal(cols, np.arange(n)), (n, size)
            widths = [b.stop - b.start for b in blocks]
            q, extra = divmod(n, size)
            assert widths == [q + 1] * extra + [q] * (size - extra), (n, size)


def test_column_block_rejects_bad_arguments() -> None:
    with pytest.raises(DatasetError, match="cannot split 3 feature"):
        data.column_block(3, 4, 0)
    with pytest.raises(DatasetError, match="rank 4 is outside"):
        data.column_block(10, 4, 4)
    with pytest.raises(DatasetError, match="size must be at least 1"):
        data.column_block(10, 0, 0)


def test_chunk_shape_bounds() -> None:
    for m, n, dt in [
        (400_000, 2000, "float32"),
        (11_000_000, 28, "float32"),
        (569, 30, "float64"),
        (10**6, 10**5, "bfloat16"),
        (5, 3, "float64"),
    ]:
        ch, cw = data.chunk_shape(m, n, dt)
        item = np.dtype(BF16 if dt == "bfloat16" else dt).itemsize
        assert 1 <= ch <= m and 1 <= cw <= min(n, 8)
        assert ch * cw * item <= 1 << 20  # one chunk within 1 MiB
        assert ch * n * item <= 64 << 20 or ch == 1  # one row of chunks within 64 MiB
    assert data.chunk_shape(400_000, 2000, "float32") == (8192, 8)
    assert data.chunk_shape(11_000_000, 28, "float32") == (262144, 1)


# --------------------------------------------------------------------------------------------
# svmlight conversion
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["dense", "csr", "auto"])
@pytest.mark.parametrize("zero_based", [True, False])
def test_convert_matches_sklearn(tmp_path: Path, layout: str, zero_based: bool) -> None:
    X = _random_sparse(120, 17, 0.15, seed=1)
    if zero_based:
        X[7, 0] = 2.0  # index 0 must occur for 'auto' to detect a zero-based file
    y = np.where(np.random.default_rng(2).random(120) < 0.4, -1, 1)
    src = tmp_path / "in.svm"
    dump_svmlight_file(X, y, str(src), zero_based=zero_based)
    out = tmp_path / "out.h5"
    summary = data.convert_svmlight(src, out, dtype="float64", layout=layout, progress=False)

    ref_X, ref_y = load_svmlight_file(str(src), zero_based=zero_based, n_features=17)
    assert summary["zero_based"] is zero_based
    assert summary["rows"] == 120 and summary["n_features"] == 17
    assert summary["nnz"] == ref_X.nnz
    assert summary["task"] == "binary" and summary["label_encoding"] == "{-1,+1} -> {0,1}"
    # layout 'auto' at 15% density must choose CSR
    assert summary["layout"] == ("csr" if layout == "auto" else layout)
    got_X, got_y = data.load_dense(out)
    assert got_X.dtype == np.float64
    assert np.array_equal(got_X, ref_X.toarray())
    assert np.array_equal(got_y, (ref_y > 0).astype(float))
    with h5py.File(out, "r") as f:
        assert f.attrs["optcc_layout"] == 1
        assert isinstance(f["X"], h5py.Group) == (summary["layout"] == "csr")


def test_convert_across_many_blocks_and_chunks(tmp_path: Path, monkeypatch) -> None:
    # Tiny text blocks and chunks: rows straddle block ends and the dense writer flushes
    # many partial buffers; the result must not change.
    monkeypatch.setattr(data.svmlight, "_TEXT_BLOCK_BYTES", 97)
    monkeypatch.setattr(data.layout, "_CHUNK_BYTES", 8 * 5)
    X = _random_sparse(203, 11, 0.5, seed=3)
    y = np.arange(203) % 4  # counts
    src = tmp_path / "in.svm"
    dump_svmlight_file(X, y, str(src), zero_based=False)
    ref_X, ref_y = load_svmlight_file(str(src), zero_based=False, n_features=11)
    for layout in ("dense", "csr"):
        out = tmp_path / f"{layout}.h5"
        s = data.convert_svmlight(src, out, dtype="float64", layout=layout, progress=False)
        assert s["task"] == "counts"
        got_X, got_y = data.load_dense(out)
        assert np.array_equal(got_X, ref_X.toarray()), layout
        assert np.array_equal(got_y, ref_y), layout
    with h5py.File(tmp_path / "dense.h5", "r") as f:
        assert f["X"].chunks[0] < 203  # really several chunk rows


def test_convert_comments_qid_blank_lines_and_gzip(tmp_path: Path) -> None:
    text = (
        "# a header comment\n"
        "+1 qid:3 1:0.5 4:-2e-1  # trailing comment\n"
        "\n"
        "-1 2:1.25E+1\t3:7\r\n"  # a Windows line end
        "   \n"
        "1 qid:4\n"  # a row with no features
        "-1 1:1 2:2 3:3 4:4"  # no final newline
    )
    src = tmp_path / "in.svm.gz"
    with gzip.open(src, "wt") as fh:
        fh.write(text)
    s = data.convert_svmlight(
        src, tmp_path / "out.h5", dtype="float64", layout="csr", progress=False
    )
    X, y = data.load_dense(tmp_path / "out.h5")
    want = np.array([[0.5, 0, 0, -0.2], [0, 12.5, 7, 0], [0, 0, 0, 0], [1, 2, 3, 4]])
    assert np.array_equal(X, want)
    assert np.array_equal(y, [1, 0, 1, 0])
    assert s["rows"] == 4 and s["zero_based"] is False


BAD_LINES = [
    ("1 3:abc", "cannot parse value 'abc'"),
    ("1 3 4:5", "expected index:value, got '3'"),
    ("1,2 3:4", "multi-label"),
    ("1 3:4 2:5", "strictly increasing"),
    ("1 3:4 3:5", "strictly increasing"),
    ("1 3:nan", "feature value nan is not finite"),
    ("inf 1:2", "label inf is not finite"),
    ("1 1.5:2", "feature index 1.5 is not a non-negative integer"),
    ("1 -1:2", "bad feature index '-1'|not a non-negative integer"),
    ("1 3::4", "cannot parse value ':4'"),
    ("1 3 :4", "expected index:value"),
    ("1 3:", "cannot parse value ''"),
    ("abc 1:2", "cannot parse label 'abc'"),
]


@pytest.mark.parametrize("bad,why", BAD_LINES)
def test_convert_bad_line_names_its_number(tmp_path: Path, bad: str, why: str) -> None:
    src = tmp_path / "bad.svm"
    src.write_text(f"1 1:1 2:2\n# comment\n\n0 2:5\n{bad}\n1 1:3\n")
    dst = tmp_path / "out.h5"
    with pytest.raises(DatasetError, match=r"line 5: ") as info:
        data.convert_svmlight(src, dst, progress=False)
    assert re.search(why, str(info.value)), str(info.value)
    assert not dst.exists()
    assert list(tmp_path.iterdir()) == [src]  # no temporary file left behind


def test_convert_task_detection_and_override(tmp_path: Path) -> None:
    def convert(labels, **kw):
        src = tmp_path / "t.svm"
        src.write_text("".join(f"{v} 1:1 2:{k + 1}\n" for k, v in enumerate(labels)))
        return data.convert_svmlight(src, tmp_path / "t.h5", progress=False, **kw)

    assert convert([0, 1, 1])["task"] == "binary"
    assert convert([-1, 1])["label_encoding"] == "{-1,+1} -> {0,1}"
    assert convert([0, 3, 7])["task"] == "counts"
    assert convert([0.5, -2.25])["task"] == "regression"
    assert convert([0, 1], task="regression")["task"] == "regression"
    _, y = data.load_dense(tmp_path / "t.h5")
    assert np.array_equal(y, [0, 1])
    with pytest.raises(DatasetError, match=r"line 2 has label 2"):
        convert([0, 2, 1], task="binary")
    with pytest.raises(DatasetError, match=r"mix|line 1 has label -1, line 2 has label 0"):
        convert([-1, 0, 1], task="binary")
    with pytest.raises(DatasetError, match=r"line 3 has 1.5"):
        convert([1, 2, 1.5], task="counts")


def test_convert_n_features_and_index_base(tmp_path: Path) -> None:
    src = tmp_path / "t.svm"
    src.write_text("1 1:1 3:2\n0 2:5\n1 5:1\n")
    s = data.convert_svmlight(src, tmp_path / "a.h5", n_features=9, progress=False)
    assert s["n_features"] == 9
    X, _ = data.load_dense(tmp_path / "a.h5")
    assert X.shape == (3, 9) and X[2, 4] == 1 and X[:, 5:].sum() == 0
    (tmp_path / "b.h5").write_bytes(b"previous")
    with pytest.raises(DatasetError, match=r"n_features=4 .* line 3 has feature index 5"):
        data.convert_svmlight(src, tmp_path / "b.h5", n_features=4, progress=False)
    assert (tmp_path / "b.h5").read_bytes() == b"previous"  # a failed run changes nothing
    s = data.convert_svmlight(src, tmp_path / "c.h5", zero_based=True, progress=False)
    assert s["n_features"] == 6
    src.write_text("1 0:1 3:2\n0 2:5\n")
    with pytest.raises(DatasetError, match=r"line 1: feature index 0 in a file declared one"):
        data.convert_svmlight(src, tmp_path / "d.h5", zero_based=False, progress=False)
    with pytest.raises(FileNotFoundError, match="nope.svm"):
        data.convert_svmlight(tmp_path / "nope.svm", tmp_path / "e.h5", progress=False)
    with pytest.raises(DatasetError, match="unknown dtype 'float16'"):
        data.convert_svmlight(src, tmp_path / "e.h5", dtype="float16", progress=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_convert_rounds_once_to_dtype(tmp_path: Path, dtype: str) -> None:
    # 1 + 2^-8 + 2^-33 rounds to 1 + 2^-7 in bf16 directly, but to 1 via float32 (a tie).
    vals = [1 + 2**-8 + 2**-33, 0.1, -3.3e-5, 1234.5678]
    src = tmp_path / "t.svm"
    src.write_text("".join(f"1 1:{v!r} 2:1\n" for v in vals))
    data.convert_svmlight(src, tmp_path / "t.h5", dtype=dtype, progress=False)
    X, _ = data.load_dense(tmp_path / "t.h5")
    want = np.array(vals).astype(BF16 if dtype == "bfloat16" else np.float32)
    assert X.dtype == want.dtype
    assert np.array_equal(
        X[:, 0].view(np.uint16 if dtype == "bfloat16" else np.uint32),
        want.view(np.uint16 if dtype == "bfloat16" else np.uint32),
    )
    if dtype == "bfloat16":
        assert float(X[0, 0]) == 1 + 2**-7


# --------------------------------------------------------------------------------------------
# bf16 storage, dtypes and partitioned loads
# --------------------------------------------------------------------------------------------


def test_bf16_storage_round_trip_is_bit_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 1 << 16, size=(64, 24), dtype=np.uint16)
    special = [0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFF7F, 0x3F80, 0x0080]
    bits[0, : len(special)] = special  # zeros, subnormals, extremes, one, smallest normal
    exponent = (bits >> 7) & 0xFF
    bits[exponent == 0xFF] &= 0x80FF  # NaN and inf are rejected by design; keep them finite
    X = bits.view(BF16)
    data.write_dataset(
        tmp_path / "b.h5", X, np.zeros(64), task="regression", origin="t", licence="t"
    )
    with h5py.File(tmp_path / "b.h5", "r") as f:
        assert f["X"].dtype == np.dtype("V2")  # opaque 2-byte type ...
        assert f["X"].attrs["optcc_dtype"] == "bfloat16"  # ... labelled as bfloat16
    got, _ = data.load_dense(tmp_path / "b.h5")
    assert got.dtype == BF16
    assert np.array_equal(got.view(np.uint16), bits)
    for size in (1, 3, 5):
        parts = [data.load_partition(tmp_path / "b.h5", rank=r, size=size) for r in range(size)]
        assert np.array_equal(np.hstack([p.X for p in parts]).view(np.uint16), bits)
    up, _ = data.load_dense(tmp_path / "b.h5", dtype="float32")
    assert np.array_equal(up, X.astype(np.float32))


def test_load_converts_dtypes(tmp_path: Path) -> None:
    X = _small_file(tmp_path / "d.h5", dtype="float64")
    X[0, 0] = 1 + 2**-8 + 2**-33  # the double-rounding trap again
    data.write_dataset(
        tmp_path / "d.h5",
        X,
        np.zeros(len(X)),
        task="regression",
        origin="t",
        licence="t",
        chunk_cols=3,
    )
    for name, want in [
        ("float32", X.astype(np.float32)),
        ("bfloat16", X.astype(BF16)),
        (None, X),
        ("float64", X),
    ]:
        got, _ = data.load_dense(tmp_path / "d.h5", dtype=name)
        assert got.dtype == want.dtype and np.array_equal(got, want), name
    assert float(data.load_dense(tmp_path / "d.h5", dtype="bfloat16")[0][0, 0]) == 1 + 2**-7


@pytest.mark.parametrize(
    "stored,csr", [("float32", False), ("bfloat16", False), ("float64", True), ("bfloat16", True)]
)
def test_partitions_reassemble_the_full_matrix(tmp_path: Path, stored: str, csr: bool) -> None:
    path = tmp_path / "p.h5"
    _small_file(path, dtype=stored, csr=csr)
    full, y = data.load_dense(path)
    for size in (1, 2, 3, 5, 8, 13):
        parts = [data.load_partition(path, rank=r, size=size) for r in range(size)]
        for r, p in enumerate(parts):
            assert p.cols == data.column_block(13, size, r)
            assert p.X.shape == (37, p.n_local) and p.n_features == 13 and p.n_samples == 37
            assert p.dtype == stored and p.layout == ("csr" if csr else "dense")
            assert np.array_equal(p.y, y)
        if csr:
            assert all(sp.isspmatrix_csr(p.X) for p in parts)
            got = sp.hstack([p.X for p in parts]).toarray()
            assert np.array_equal(got, full.astype(np.float32 if stored == "bfloat16" else None))
        else:
            assert np.array_equal(np.hstack([p.X for p in parts]), full)
    # a row subset, as for a train/test split
    parts = [data.load_partition(path, rank=r, size=3, rows=slice(5, -7)) for r in range(3)]
    block = sp.hstack([p.X for p in parts]).toarray() if csr else np.hstack([p.X for p in parts])
    assert block.shape == (25, 13) and np.array_equal(block, np.asarray(full[5:30], block.dtype))
    assert parts[0].rows == slice(5, 30) and parts[0].n_samples == 25


def test_intercept_column(tmp_path: Path) -> None:
    for csr in (False, True):
        path = tmp_path / f"i{csr}.h5"
        _small_file(path, dtype="float64", csr=csr)
        full, _ = data.load_dense(path)
        Xi, _ = data.load_dense(path, intercept=True)
        assert Xi.shape == (37, 14) and np.array_equal(Xi[:, :13], full)
        assert np.all(Xi[:, 13] == 1)
        parts = [data.load_partition(path, rank=r, size=14, intercept=True) for r in range(14)]
        assert parts[-1].cols == slice(13, 14) and parts[-1].n_features == 14
        assert parts[-1].attrs["intercept_column"] == 13
        blocks = [p.X.toarray() if csr else p.X for p in parts]
        assert np.array_equal(np.hstack(blocks), Xi)


# --------------------------------------------------------------------------------------------
# synthetic data
# --------------------------------------------------------------------------------------------


def _read(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    X, y = data.load_dense(path, dtype="float64")
    with h5py.File(path, "r") as f:
        return X, y, f["w_true"][...]


def test_synth_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    a = _read(data.synth("poisson", 3000, 20, 7, tmp_path / "a.h5", progress=False))
    b = _read(
        data.synth("poisson", 3000, 20, 7, tmp_path / "b.h5", progress=False, chunk_rows=1024)
    )
    c = _read(data.synth("poisson", 3000, 20, 8, tmp_path / "c.h5", progress=False))
    for u, v in zip(a, b, strict=True):
        assert np.array_equal(u, v)  # same seed, any chunking: identical bits
    assert not np.array_equal(a[0], c[0]) and not np.array_equal(a[2], c[2])
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert f.attrs["task"] == "counts" and f.attrs["synth_seed"] == 7
        assert "CC0" in f.attrs["licence"] and "N(0, 1/n)" in f.attrs["origin"]


def test_synth_has_the_stated_statistics(tmp_path: Path) -> None:
    m, n = 8192, 64
    X, y, w = _read(
        data.synth("linear", m, n, 1, tmp_path / "l.h5", dtype="float64", progress=False)
    )
    # X_ij ~ N(0, 1/n): mean 0, variance 1/n (8192*64 samples: 1% relative error is ~8 SE)
    assert abs(X.mean()) < 5 / np.sqrt(X.size * n)
    assert abs(X.var() * n - 1) < 0.01
    assert abs(w.mean()) < 5 / np.sqrt(n) and 0.5 < w.var() < 1.5  # w* ~ N(0, I)
    resid = y - X @ w
    assert abs(resid.std() - 0.1) < 0.005 and abs(resid.mean()) < 5 * 0.1 / np.sqrt(m)

    X, y, w = _read(data.synth("logistic", m, n, 2, tmp_path / "g.h5", progress=False))
    p = 1 / (1 + np.exp(-(X @ w)))
    assert set(np.unique(y)) <= {0.0, 1.0}
    se = np.sqrt(np.sum(p * (1 - p))) / m
    assert abs(y.mean() - p.mean()) < 5 * se
    # labels follow the margin: the rows with p > 0.9 are mostly ones
    assert y[p > 0.9].mean() > 0.85 and y[p < 0.1].mean() < 0.15

    X, y, w = _read(
        data.synth("poisson", m, n, 3, tmp_path / "p.h5", dtype="bfloat16", progress=False)
    )
    lam = np.exp(0.5 * (X @ w))  # X as stored (bf16-rounded): labels were drawn from it
    assert np.all(y >= 0) and np.all(y == np.floor(y))
    assert abs(y.mean() - lam.mean()) < 5 * np.sqrt(lam.sum()) / m
    assert abs(np.mean((y - lam) ** 2) / lam.mean() - 1) < 0.1  # Poisson: variance = mean


def test_synth_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="unknown kind 'probit'"):
        data.synth("probit", 10, 3, 0, tmp_path / "x.h5", progress=False)
    with pytest.raises(DatasetError, match="rows and cols must be positive"):
        data.synth("linear", 0, 3, 0, tmp_path / "x.h5", progress=False)
    with pytest.raises(DatasetError, match="unknown dtype 'int8'"):
        data.synth("linear", 10, 3, 0, tmp_path / "x.h5", dtype="int8", progress=False)
    assert not (tmp_path / "x.h5").exists()


def test_default_dataset_is_made_once_in_the_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OPTCC_DATA_HOME", str(tmp_path / "cache"))
    config.reload()
    monkeypatch.setitem(data.DEFAULT_SYNTH, "rows", 1500)
    monkeypatch.setitem(data.DEFAULT_SYNTH, "cols", 12)
    path = data.default_dataset()
    assert path.parent == tmp_path / "cache" and path.is_file()
    stamp = path.stat().st_mtime_ns
    assert data.default_dataset() == path and path.stat().st_mtime_ns == stamp  # reused
    part = data.load_partition(path)
    assert part.X.shape == (1500, 12) and part.task == "binary" and part.dtype == "float32"
    ref = data.synth("logistic", 1500, 12, 0, tmp_path / "ref.h5", progress=False)
    assert np.array_equal(data.load_dense(ref)[0], part.X)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files
    path.write_bytes(b"not hdf5")  # a damaged cache file is rebuilt
    assert data.load_dense(data.default_dataset())[0].shape == (1500, 12)


# --------------------------------------------------------------------------------------------
# shipped real datasets
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,shape,task",
    [
        ("breast_cancer", (569, 30), "binary"),
        ("diabetes", (442, 10), "regression"),
        ("randhie", (20190, 9), "counts"),
    ],
)
def test_shipped_datasets(name: str, shape: tuple[int, int], task: str) -> None:
    path = data.shipped(name)
    assert path.parent.name == "data" and path.name == f"{name}.h5"
    part = data.load_partition(path)
    assert part.X.shape == shape and part.task == task and part.dtype == "float64"
    assert data.check_labels(part.y, task).shape == (shape[0],)
    # stored standardised: every column has mean 0 and (population) std 1
    assert np.allclose(part.X.mean(axis=0), 0, atol=1e-12)
    assert np.allclose(part.X.std(axis=0), 1, atol=1e-12)
    assert part.attrs["standardized"] and len(part.attrs["feature_names"]) == shape[1]
    assert part.attrs["licence"] and part.attrs["origin"]
    with h5py.File(path, "r") as f:
        raw = part.X * f["feature_scale"][...] + f["feature_mean"][...]
    if name == "breast_cancer":
        from sklearn.datasets import load_breast_cancer

        ref = load_breast_cancer()
        assert np.allclose(raw, ref.data, rtol=1e-12, atol=1e-12)
        assert np.array_equal(part.y, ref.target)
    elif name == "diabetes":
        from sklearn.datasets import load_diabetes

        ref = load_diabetes(scaled=False)
        assert np.allclose(raw, ref.data, rtol=1e-12, atol=1e-12)
        assert np.array_equal(part.y, ref.target)
    else:
        assert part.y.sum() == 57752 and part.y.max() == 77  # mdvis, statsmodels' randhie
        assert np.array_equal(np.unique(raw[:, 1].round(12)), [0, 1])  # idp is 0/1


def test_shipped_rejects_unknown_names() -> None:
    with pytest.raises(DatasetError, match="unknown shipped dataset 'iris'"):
        data.shipped("iris")


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------


def test_missing_file_and_datasets(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nothere.h5"):
        data.load_partition(tmp_path / "nothere.h5")
    (tmp_path / "text.h5").write_text("hello")
    with pytest.raises(DatasetError, match="not a readable HDF5 file"):
        data.load_partition(tmp_path / "text.h5")
    with h5py.File(tmp_path / "noX.h5", "w") as f:
        f["y"] = np.zeros(3)
    with pytest.raises(DatasetError, match="missing dataset 'X'"):
        data.load_partition(tmp_path / "noX.h5")
    with h5py.File(tmp_path / "noy.h5", "w") as f:
        f["X"] = np.zeros((3, 2))
    with pytest.raises(DatasetError, match="missing dataset 'y'"):
        data.load_dense(tmp_path / "noy.h5")
    with h5py.File(tmp_path / "mismatch.h5", "w") as f:
        f["X"] = np.zeros((10, 2))
        f["y"] = np.zeros(9)
    with pytest.raises(DatasetError, match="X has 10 rows but y has 9 entries"):
        data.load_partition(tmp_path / "mismatch.h5")
    with h5py.File(tmp_path / "v2.h5", "w") as f:
        f["X"] = np.zeros((3, 2), dtype="V2")
        f["y"] = np.zeros(3)
    with pytest.raises(DatasetError, match="without the attribute optcc_dtype"):
        data.load_partition(tmp_path / "v2.h5")
    with h5py.File(tmp_path / "int.h5", "w") as f:
        f["X"] = np.zeros((3, 2), dtype=np.int32)
        f["y"] = np.zeros(3)
    with pytest.raises(DatasetError, match="unsupported type int32"):
        data.load_partition(tmp_path / "int.h5")


def test_foreign_file_without_attributes_loads(tmp_path: Path) -> None:
    with h5py.File(tmp_path / "plain.h5", "w") as f:
        f["X"] = np.arange(12.0).reshape(4, 3)
        f["y"] = np.array([-1.0, 1, 1, -1])
    part = data.load_partition(tmp_path / "plain.h5", rank=1, size=2)
    assert part.task == "binary" and np.array_equal(part.y, [0, 1, 1, 0])
    assert np.array_equal(part.X, [[2.0], [5], [8], [11]])


def test_nonfinite_values_name_the_rank_and_position(tmp_path: Path) -> None:
    path = tmp_path / "nan.h5"
    X = _small_file(path, dtype="float64")
    with h5py.File(path, "r+") as f:
        f["X"][21, 11] = np.nan  # column 11 is in rank 2's block of 3 (columns 9:13)
    with pytest.raises(
        DatasetError,
        match=r"nan in X at row 21, column 11 \(block of rank 2, "
        r"columns 9:13\)",
    ):
        data.load_partition(path, rank=2, size=3)
    part = data.load_partition(path, rank=0, size=3)  # other blocks are clean
    assert np.array_equal(part.X, X[:, :5])
    with h5py.File(path, "r+") as f:
        f["X"][21, 11] = 1e300  # finite in float64, overflows float32
    with pytest.raises(DatasetError, match="inf in X at row 21, column 11.*overflows"):
        data.load_partition(path, rank=2, size=3, dtype="float32")
    with h5py.File(path, "r+") as f:
        f["X"][21, 11] = 0
        f["y"][4] = np.inf
    with pytest.raises(DatasetError, match="non-finite value inf in y at row 4"):
        data.load_partition(path, rank=0, size=3)
    # CSR without its CSC copy (layout 1.0): the loader filters X itself.
    csr = tmp_path / "nan_csr.h5"
    _small_file(csr, dtype="float64", csr=True, csc=False)
    with h5py.File(csr, "r+") as f:
        idx, ptr = f["X/indices"][...], f["X/indptr"][...]
        k = int(np.flatnonzero(idx >= 9)[0])
        f["X/data"][k] = -np.inf
        row = int(np.searchsorted(ptr, k, side="right") - 1)
    with pytest.raises(
        DatasetError,
        match=rf"-inf in X at row {row}, column {idx[k]} "
        r"\(block of rank 2",
    ):
        data.load_partition(csr, rank=2, size=3)
    # CSR with its CSC copy: ranks read the copy.
    _small_file(csr, dtype="float64", csr=True)
    with h5py.File(csr, "r+") as f:
        rows, ptr = f["X_csc/indices"][...], f["X_csc/indptr"][...]
        k = int(ptr[11]) + 1  # the second entry of column 11, in rank 2's block
        f["X_csc/data"][k] = -np.inf
    with pytest.raises(
        DatasetError,
        match=rf"-inf in X at row {rows[k]}, column 11 \(block of rank 2",
    ):
        data.load_partition(csr, rank=2, size=3)


def test_bad_requests(tmp_path: Path) -> None:
    path = tmp_path / "ok.h5"
    _small_file(path)
    with pytest.raises(DatasetError, match="cannot split 13 feature.* over 14 ranks"):
        data.load_partition(path, rank=0, size=14)
    with pytest.raises(DatasetError, match="unknown dtype 'float16'"):
        data.load_partition(path, dtype="float16")
    # the dtype is checked before the file is even looked at
    with pytest.raises(DatasetError, match="unknown dtype 'half'"):
        data.load_partition(tmp_path / "absent.h5", dtype="half")
    with pytest.raises(DatasetError, match="selects no rows"):
        data.load_partition(path, rows=slice(30, 30))
    with pytest.raises(DatasetError, match="step 1"):
        data.load_partition(path, rows=slice(0, 30, 2))
    with pytest.raises(DatasetError, match="give both rank and size"):
        data.load_partition(path, rank=1)
    with pytest.raises(DatasetError, match=r"needs at least|cannot split"):
        data.validate(path, size=20)


def test_write_dataset_validates(tmp_path: Path) -> None:
    X = np.ones((4, 3))
    kw = {"origin": "o", "licence": "l"}
    with pytest.raises(DatasetError, match="unknown task 'ordinal'"):
        data.write_dataset(tmp_path / "a.h5", X, np.zeros(4), task="ordinal", **kw)
    with pytest.raises(DatasetError, match=r"X has 4 rows but y has shape \(5,\)"):
        data.write_dataset(tmp_path / "a.h5", X, np.zeros(5), task="regression", **kw)
    X[2, 1] = np.nan
    with pytest.raises(DatasetError, match="nan in X at row 2, column 1"):
        data.write_dataset(tmp_path / "a.h5", X, np.zeros(4), task="regression", **kw)
    X[2, 1] = 1e39
    with pytest.raises(DatasetError, match="overflow"):
        data.write_dataset(
            tmp_path / "a.h5", X, np.zeros(4), task="regression", dtype="float32", **kw
        )
    with pytest.raises(DatasetError, match=r"y\[1\] = 2"):
        data.write_dataset(tmp_path / "a.h5", np.ones((4, 3)), [0, 2, 1, 0], task="binary", **kw)
    with pytest.raises(DatasetError, match="licence must be a non-empty string"):
        data.write_dataset(
            tmp_path / "a.h5",
            np.ones((4, 3)),
            np.zeros(4),
            task="regression",
            origin="o",
            licence="",
        )
    assert not (tmp_path / "a.h5").exists()
    p = data.write_dataset(
        tmp_path / "b.h5",
        np.ones((4, 3)),
        [-1, 1, 1, -1],
        task="binary",
        extra={"w_true": np.arange(3.0)},
        note="hi",
        **kw,
    )
    _, y = data.load_dense(p)
    assert np.array_equal(y, [0, 1, 1, 0])
    with h5py.File(p, "r") as f:
        assert f.attrs["note"] == "hi" and np.array_equal(f["w_true"][...], [0, 1, 2])


def test_check_labels() -> None:
    assert np.array_equal(data.check_labels([-1, 1, 1], "binary"), [0, 1, 1])
    assert np.array_equal(data.check_labels([0, 1, 1], "binary"), [0, 1, 1])
    with pytest.raises(DatasetError, match=r"y\[2\] = 2"):
        data.check_labels([0, 1, 2], "binary")
    with pytest.raises(DatasetError, match=r"mix .* y\[2\] = 0"):
        data.check_labels([1, -1, 0], "binary")
    assert np.array_equal(data.check_labels([0, 4, 7], "counts"), [0, 4, 7])
    with pytest.raises(DatasetError, match=r"y\[1\] = -1"):
        data.check_labels([0, -1], "counts")
    with pytest.raises(DatasetError, match=r"y\[0\] = 0.5"):
        data.check_labels([0.5], "counts")
    assert np.array_equal(data.check_labels([-3.5, 2], "regression"), [-3.5, 2])
    with pytest.raises(DatasetError, match=r"y\[1\] = nan is not finite"):
        data.check_labels([0, np.nan], "regression")
    with pytest.raises(DatasetError, match="unknown task"):
        data.check_labels([0], "multiclass")
    assert data.infer_task([0, 1]) == "binary" and data.infer_task([-1, 1]) == "binary"
    assert data.infer_task([0, 2]) == "counts" and data.infer_task([0.5]) == "regression"


# --------------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------------


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="optcc-mpi")
    cli_data.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_synth_convert_info(tmp_path: Path, capsys) -> None:
    out = tmp_path / "s.h5"
    assert (
        _cli(
            [
                "data",
                "synth",
                "--kind",
                "linear",
                "--rows",
                "300",
                "--cols",
                "9",
                "--seed",
                "5",
                "-q",
                str(out),
            ]
        )
        == 0
    )
    assert "300 x 9" in capsys.readouterr().out
    X, y = data.load_dense(out)
    svm = tmp_path / "s.svm"
    dump_svmlight_file(X.astype(np.float64), y, str(svm), zero_based=False)
    assert (
        _cli(
            [
                "data",
                "convert",
                str(svm),
                str(tmp_path / "c.h5"),
                "--dtype",
                "float64",
                "--task",
                "regression",
                "--licence",
                "CC0-1.0",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "300 x 9 dense float64" in captured.out
    assert "convert 2/2 write" in captured.err  # the progress bar goes to stderr
    X2, y2 = data.load_dense(tmp_path / "c.h5")
    assert np.allclose(X2, X, rtol=1e-6) and np.allclose(y2, y, rtol=1e-12)
    assert _cli(["data", "info", str(tmp_path / "c.h5"), "--check", "--ranks", "4"]) == 0
    text = capsys.readouterr().out
    for pattern in (
        r"^shape +300 x 9$",
        r"^dtype +X float64, y float64$",
        r"^layout +dense, chunks \(300, 1\)",
        r"^task +regression$",
        r"^licence +CC0-1.0$",
        r"^ranks +4: rank 0 holds columns 0:3$",
        r"^check +all values finite",
    ):
        assert re.search(pattern, text, re.M), (pattern, text)
    assert _cli(["data", "list"]) == 0
    assert "randhie" in capsys.readouterr().out


def test_cli_errors_exit_2_with_the_reason(tmp_path: Path, capsys) -> None:
    from optcc_mpi.cli import main

    bad = tmp_path / "bad.svm"
    bad.write_text("1 1:2\n1 1:x\n")
    assert main(["data", "convert", str(bad), str(tmp_path / "o.h5"), "-q"]) == 2
    assert "line 2" in capsys.readouterr().err
    assert main(["data", "info", str(tmp_path / "none.h5")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["data"]) == 2  # no sub-command: usage


@pytest.mark.parametrize("sub", ["convert", "synth", "info"])
def test_cli_help_has_examples(sub: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _cli(["data", sub, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "examples:" in text and f"optcc-mpi data {sub}" in text


# --------------------------------------------------------------------------------------------
# MPI
# --------------------------------------------------------------------------------------------


@pytest.fixture
def shared_dir():
    """A temporary folder made by rank 0 and known to every rank (removed at the end)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    path = tempfile.mkdtemp(prefix="optcc_data_test_") if comm.rank == 0 else None
    path = Path(comm.bcast(path, root=0))
    yield path
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _write_on_rank0(comm, fn) -> None:
    error = None
    if comm.rank == 0:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank
            error = repr(exc)
    error = comm.bcast(error, root=0)
    assert error is None, error


@pytest.mark.mpi
@pytest.mark.parametrize(
    "stored,csr,want",
    [
        ("float32", False, None),
        ("bfloat16", False, None),
        ("float64", True, "float32"),
        ("float32", False, "bfloat16"),
    ],
)
def test_mpi_partitions_reassemble(shared_dir: Path, stored, csr, want) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    path = shared_dir / f"p_{stored}_{csr}.h5"
    n = 19  # not a multiple of 2, 3, 4, 5 or 8: blocks of unequal width
    _write_on_rank0(comm, lambda: _small_file(path, dtype=stored, csr=csr, m=41, n=n))
    part = data.load_partition(path, comm=comm, dtype=want)
    assert part.cols == data.column_block(n, comm.size, comm.rank)
    assert part.dtype == (want or stored)
    blocks = comm.allgather(part.X.toarray() if csr else part.X)
    full, y = data.load_dense(path, dtype=want)
    assert np.array_equal(np.hstack(blocks), np.asarray(full, dtype=blocks[0].dtype))
    assert np.array_equal(part.y, y)


@pytest.mark.mpi
def test_mpi_bad_block_raises_on_every_rank(shared_dir: Path) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    path = shared_dir / "nan.h5"
    last = comm.size - 1
    col = data.column_block(19, comm.size, last).start  # owned by the last rank

    def write() -> None:
        _small_file(path, dtype="float64", m=23, n=19)
        with h5py.File(path, "r+") as f:
            f["X"][7, col] = np.nan

    _write_on_rank0(comm, write)
    with pytest.raises(DatasetError) as info:
        data.load_partition(path, comm=comm)
    msg = str(info.value)
    assert f"row 7, column {col} (block of rank {last}" in msg
    if comm.rank != last:
        assert msg.startswith("could not load every rank's block") and f"(rank {last})" in msg
    comm.Barrier()


@pytest.mark.mpi
def test_mpi_more_ranks_than_features(shared_dir: Path) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    path = shared_dir / "narrow.h5"
    _write_on_rank0(comm, lambda: _small_file(path, m=5, n=1))
    with pytest.raises(DatasetError, match=f"cannot split 1 feature.* over {comm.size} ranks"):
        data.load_partition(path, comm=comm)
    comm.Barrier()


@pytest.mark.mpi
def test_mpi_default_dataset_made_once(shared_dir: Path, monkeypatch) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    monkeypatch.setenv("OPTCC_DATA_HOME", str(shared_dir / "cache"))
    config.reload()
    monkeypatch.setitem(data.DEFAULT_SYNTH, "rows", 2000)
    monkeypatch.setitem(data.DEFAULT_SYNTH, "cols", 16)
    path = data.default_dataset(comm)
    assert comm.allgather(str(path)) == [str(path)] * comm.size
    part = data.load_partition(path, comm=comm)
    assert part.n_samples == 2000 and part.n_features == 16
    stamps = comm.allgather(path.stat().st_mtime_ns)
    assert len(set(stamps)) == 1
    comm.Barrier()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left
    comm.Barrier()
