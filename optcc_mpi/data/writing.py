"""Writing dataset files: atomic creation, filters and checksums, and :func:`write_dataset`.

Every writer (this module's :func:`write_dataset`, the svmlight converter, the synthetic
generator) creates its datasets through the helpers here, so every file gets the same
chunking, the same filters and, by default, an HDF5 fletcher32 checksum on every chunk of
every array. HDF5 verifies the checksum whenever a chunk is read; the readers turn a
mismatch into a :class:`~optcc_mpi.errors.DatasetError` naming the file and dataset.

Those helpers (:func:`atomic_h5`, :func:`h5_filters`, :func:`write_common_attrs`, the
``create_*`` functions and :class:`CSCBuilder`) are shared with the package's other writers;
only ``__all__`` is part of :mod:`optcc_mpi.data`'s API.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import scipy.sparse as sp

from optcc_mpi.errors import DatasetError
from optcc_mpi.labels import check_labels
from optcc_mpi.progress import Progress

from .layout import (
    CSC_COPY,
    LAYOUT_MINOR,
    LAYOUT_VERSION,
    OPAQUE2,
    SPARSE_CHUNK,
    TASKS,
    cast_to,
    chunk_shape,
    storage_dtype_name,
    storage_view,
)
from .validation import (
    SPARSE_SLAB,
    check_indptr,
    check_minor_indices,
    guard,
    open_dataset,
    read_header,
)

__all__ = ["add_csc", "write_dataset"]

# Bytes of spilled entries sorted at a time when building a CSC copy from a stream of rows
# (one column band); memory while sorting is about 2.5 times this.
_CSC_BAND_BYTES = 32 << 20
# Most column bands (and so spill files open at once).
_CSC_MAX_BANDS = 256

# Chunk length of a CSC copy's indptr (one entry per column): small, because a rank reads
# the slice for its columns, and a whole chunk is read whenever one entry of it is.
_CSC_PTR_CHUNK = 1 << 13


@contextmanager
def atomic_h5(path: Path, **kwargs: Any) -> Iterator[h5py.File]:
    """Open a temporary file beside ``path`` for writing; rename it over ``path`` on success.

    Readers therefore never see a half-written dataset, and concurrent writers of the same
    content (processes creating the default dataset) cannot corrupt each other.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh name per writer (not mkstemp, whose 0600 mode would make a shared cache file
    # unreadable to other users); h5py creates it with the usual umask-based mode.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        with h5py.File(tmp, "x", **kwargs) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def h5_filters(compression: str | None, checksum: bool = True) -> dict[str, Any]:
    """h5py filter arguments: optional compression, and the fletcher32 checksum.

    h5py applies fletcher32 after compression, so the checksum covers the stored bytes and a
    corrupt compressed chunk is reported as a checksum mismatch before it is decompressed.
    """
    filt: dict[str, Any] = {"fletcher32": True} if checksum else {}
    if compression is None or compression == "none":
        return filt
    if compression not in ("gzip", "lzf"):
        raise DatasetError(f"unknown compression {compression!r}; expected gzip, lzf or none")
    # Byte shuffling groups the exponent bytes of neighbouring floats, which compress well.
    return {**filt, "compression": compression, "shuffle": True}


def write_common_attrs(
    f: h5py.File,
    *,
    task: str,
    origin: str,
    licence: str,
    m: int,
    n: int,
    attrs: Mapping[str, Any],
) -> None:
    f.attrs["optcc_layout"] = LAYOUT_VERSION
    f.attrs["optcc_layout_minor"] = LAYOUT_MINOR
    f.attrs["task"] = task
    f.attrs["origin"] = origin
    f.attrs["licence"] = licence
    f.attrs["n_samples"] = m
    f.attrs["n_features"] = n
    for key, value in attrs.items():
        if value is None:
            continue
        f.attrs[key] = value


def _storage(dtype: str) -> np.dtype:
    return OPAQUE2 if dtype == "bfloat16" else np.dtype(dtype)


def create_dense(
    f: h5py.File,
    m: int,
    n: int,
    dtype: str,
    chunk_cols: int | None,
    compression: str | None,
    checksum: bool = True,
) -> h5py.Dataset:
    chunks = chunk_shape(m, n, dtype, chunk_cols)
    ds = f.create_dataset(
        "X", shape=(m, n), dtype=_storage(dtype), chunks=chunks, **h5_filters(compression, checksum)
    )
    ds.attrs["optcc_format"] = "dense"
    ds.attrs["optcc_dtype"] = dtype
    return ds


def _create_compressed(
    f: h5py.File,
    name: str,
    fmt: str,
    m: int,
    n: int,
    nnz: int,
    dtype: str,
    compression: str | None,
    checksum: bool = True,
) -> h5py.Group:
    """Create a CSR (``fmt='csr'``) or CSC group of empty arrays, to be filled by the caller."""
    g = f.create_group(name)
    g.attrs["optcc_format"] = fmt
    g.attrs["shape"] = np.array([m, n], dtype=np.int64)
    filt = h5_filters(compression, checksum)
    major, minor = (m, n) if fmt == "csr" else (n, m)
    ptr_chunk = SPARSE_CHUNK if fmt == "csr" else _CSC_PTR_CHUNK
    g.create_dataset(
        "indptr", shape=(major + 1,), dtype=np.int64, chunks=(min(major + 1, ptr_chunk),), **filt
    )
    idx_type = np.int32 if minor < 2**31 else np.int64
    chunk = (min(max(nnz, 1), SPARSE_CHUNK),)
    g.create_dataset("indices", shape=(nnz,), dtype=idx_type, chunks=chunk, maxshape=(nnz,), **filt)
    d = g.create_dataset(
        "data", shape=(nnz,), dtype=_storage(dtype), chunks=chunk, maxshape=(nnz,), **filt
    )
    d.attrs["optcc_dtype"] = dtype
    if fmt == "csc":
        g.attrs["copy_of"] = "X"
    return g


def create_csr(
    f: h5py.File,
    m: int,
    n: int,
    nnz: int,
    dtype: str,
    compression: str | None,
    checksum: bool = True,
) -> h5py.Group:
    return _create_compressed(f, "X", "csr", m, n, nnz, dtype, compression, checksum)


def create_csc(
    f: h5py.File,
    m: int,
    n: int,
    nnz: int,
    dtype: str,
    compression: str | None,
    checksum: bool = True,
) -> h5py.Group:
    return _create_compressed(f, CSC_COPY, "csc", m, n, nnz, dtype, compression, checksum)


def create_y(f: h5py.File, m: int, compression: str | None, checksum: bool = True) -> h5py.Dataset:
    return f.create_dataset(
        "y",
        shape=(m,),
        dtype=np.float64,
        chunks=(min(m, 1 << 16),),
        **h5_filters(compression, checksum),
    )


def write_dataset(
    path: str | os.PathLike,
    X: Any,
    y: Any,
    *,
    task: str,
    origin: str,
    licence: str,
    dtype: Any = None,
    chunk_cols: int | None = None,
    compression: str | None = None,
    checksum: bool = True,
    csc: bool = True,
    extra: Mapping[str, Any] | None = None,
    **attrs: Any,
) -> Path:
    """Write in-memory ``X`` and ``y`` as a dataset file (layout 1.1).

    Parameters
    ----------
    path : path-like
        Output file; written to a temporary name and renamed, so it appears complete or not
        at all.
    X : array_like of shape (m, n), or scipy.sparse matrix
        Dense arrays are stored dense, sparse matrices as CSR (duplicates summed, indices
        sorted).
    y : array_like of shape (m,)
        Labels, checked with :func:`optcc_mpi.labels.check_labels` (binary {-1, +1} are
        stored as {0, 1}).
    task : {'binary', 'regression', 'counts'}
    origin : str
        Where the data come from (citation, URL, generator).
    licence : str
        Licence of the data.
    dtype : {None, 'float64', 'float32', 'bfloat16'}
        Stored element type; None keeps ``X``'s type when it is one of these, else float64.
        bfloat16 is rounded to nearest even from ``X``'s values.
    chunk_cols : int, optional
        Chunk width in columns for dense ``X`` (see :func:`chunk_shape`).
    compression : {None, 'gzip', 'lzf'}
        HDF5 filter for every dataset (with byte shuffling).
    checksum : bool
        Store an HDF5 fletcher32 checksum with every chunk (verified on every read).
    csc : bool
        For sparse ``X``, also store the CSC copy (``X_csc``) from which each rank reads only
        its columns; without it every rank reads all of ``X/indices``. Doubles the bytes of
        a sparse ``X`` on disk.
    extra : mapping of str to array_like, optional
        Further datasets to store beside ``X`` and ``y`` (e.g. ``w_true``, feature scales).
    **attrs
        Further file attributes (strings, numbers, lists of strings); None values are skipped.

    Returns
    -------
    pathlib.Path
        The written file.

    Raises
    ------
    DatasetError
        Unknown task or dtype, shape mismatch, non-finite values (or values that overflow
        ``dtype``), labels outside the task.
    """
    if task not in TASKS:
        raise DatasetError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    for key, value in (("origin", origin), ("licence", licence)):
        if not isinstance(value, str) or not value.strip():
            raise DatasetError(f"{key} must be a non-empty string, got {value!r}")
    name = storage_dtype_name(dtype)
    sparse = sp.issparse(X)
    if sparse:
        X = sp.csr_matrix(X)
        X.sum_duplicates()
        X.sort_indices()
        values = X.data
    else:
        X = np.asarray(X)
        values = X
    if X.ndim != 2:
        raise DatasetError(f"X must be two-dimensional, got shape {X.shape}")
    m, n = X.shape
    if m < 1 or n < 1:
        raise DatasetError(f"X is empty (shape {m} x {n})")
    if name is None:
        try:
            name = storage_dtype_name(values.dtype)
        except DatasetError:
            name = "float64"
    y = np.asarray(y)
    if y.ndim != 1 or y.shape[0] != m:
        raise DatasetError(f"shape mismatch: X has {m} rows but y has shape {y.shape}")
    stored = cast_to(np.asarray(values), name)
    finite = np.isfinite(stored)
    if not finite.all():
        k = tuple(np.argwhere(~finite)[0])
        if sparse:
            row = int(np.searchsorted(X.indptr, k[0], side="right") - 1)
            where = f"row {row}, column {int(X.indices[k[0]])}"
        else:
            where = f"row {int(k[0])}, column {int(k[1])}"
        source = np.asarray(values)[k]
        note = f" (overflow: {source} does not fit {name})" if np.isfinite(source) else ""
        raise DatasetError(f"non-finite value {stored[k]} in X at {where}{note}")
    y = check_labels(y, task)
    path = Path(path)
    with atomic_h5(path) as f:
        if sparse:
            g = create_csr(f, m, n, X.nnz, name, compression, checksum)
            g["indptr"][...] = X.indptr.astype(np.int64)
            g["indices"][...] = X.indices.astype(g["indices"].dtype)
            g["data"][...] = storage_view(stored)
            if csc:
                # Entries in column order; the stable sort keeps rows increasing within a
                # column. Done on indices, not with SciPy, which has no bfloat16.
                order = np.argsort(X.indices, kind="stable")
                rows = np.repeat(np.arange(m, dtype=np.int64), np.diff(X.indptr))
                ptr = np.zeros(n + 1, dtype=np.int64)
                np.cumsum(np.bincount(X.indices, minlength=n), out=ptr[1:])
                g = create_csc(f, m, n, X.nnz, name, compression, checksum)
                g["indptr"][...] = ptr
                g["indices"][...] = rows[order].astype(g["indices"].dtype)
                g["data"][...] = storage_view(stored[order])
        else:
            ds = create_dense(f, m, n, name, chunk_cols, compression, checksum)
            ds[...] = storage_view(np.ascontiguousarray(stored))
        create_y(f, m, compression, checksum)[...] = y
        for key, value in (extra or {}).items():
            value = np.asarray(value)
            # Filters need a chunked dataset, which a scalar or empty array cannot be.
            filt = h5_filters(compression, checksum) if value.size and value.ndim else {}
            f.create_dataset(key, data=value, **filt)
        write_common_attrs(f, task=task, origin=origin, licence=licence, m=m, n=n, attrs=attrs)
    return path


class CSCBuilder:
    """Builds the CSC copy of a sparse matrix whose entries arrive in row order.

    The number of entries in each column is known beforehand (the converter's first pass),
    so each column's range in the copy is known. Columns are grouped into bands of about
    ``_CSC_BAND_BYTES`` of entries; :meth:`add` appends every entry (row, column, value
    bits) to its band's spill file in ``spill``; :meth:`finish` loads one band at a time,
    sorts it by column (stably, so rows stay increasing within a column) and writes it to
    its contiguous range of the copy. Memory: the counts (16 bytes per column), one band,
    and the caller's block; disk: one more copy of the entries, removed by the caller.
    """

    def __init__(self, counts: np.ndarray, m: int, dtype: str, spill: Path) -> None:
        self.n = n = counts.size
        self.ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=self.ptr[1:])
        self.storage = _storage(dtype)
        item = self.storage.itemsize
        self.rec = np.dtype(
            [
                ("row", np.int64),
                ("col", np.int32 if n < 2**31 else np.int64),
                ("val", f"u{item}"),
            ]
        )
        nnz = int(self.ptr[-1])
        bands = min(_CSC_MAX_BANDS, max(1, -(-nnz * self.rec.itemsize // _CSC_BAND_BYTES)))
        # Band edges: the first column whose entries start at or after each equal share.
        cuts = np.searchsorted(self.ptr, np.arange(1, bands) * (nnz / bands), side="left")
        self.edges = np.unique(np.concatenate(([0], np.clip(cuts, 0, n), [n])))
        self.files = [spill / f"band{b:04d}.bin" for b in range(self.edges.size - 1)]
        self.handles: dict[int, Any] = {}
        self.m = m

    def add(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray) -> None:
        """Append entries (in row order) given as global rows, columns and stored values."""
        if rows.size == 0:
            return
        rec = np.empty(rows.size, dtype=self.rec)
        bits = vals.view(self.rec["val"])
        nb = len(self.files)
        if nb == 1:
            rec["row"], rec["col"], rec["val"] = rows, cols, bits
            splits = np.array([0, rows.size])
        else:
            band = np.searchsorted(self.edges, cols, side="right") - 1
            order = np.argsort(band, kind="stable")
            rec["row"], rec["col"], rec["val"] = rows[order], cols[order], bits[order]
            splits = np.concatenate(([0], np.cumsum(np.bincount(band, minlength=nb))))
        for b in np.flatnonzero(np.diff(splits)):
            fh = self.handles.get(b)
            if fh is None:
                # Unbuffered: each write is a whole block already, and up to 256 files are
                # open at once, whose default 8 KiB buffers would add up.
                fh = self.handles[b] = open(self.files[b], "ab", buffering=0)  # noqa: SIM115
            fh.write(rec[splits[b] : splits[b + 1]].tobytes())

    def finish(self, g: h5py.Group, source: Path) -> None:
        """Write the copy's arrays into group ``g`` (created by :func:`create_csc`)."""
        for fh in self.handles.values():
            fh.close()
        self.handles.clear()
        g["indptr"][...] = self.ptr
        for b, file in enumerate(self.files):
            c0, c1 = int(self.edges[b]), int(self.edges[b + 1])
            lo, hi = int(self.ptr[c0]), int(self.ptr[c1])
            rec = np.fromfile(file, dtype=self.rec) if file.exists() else np.empty(0, self.rec)
            counts = np.bincount(rec["col"] - c0, minlength=c1 - c0)
            if rec.size != hi - lo or not np.array_equal(counts, np.diff(self.ptr[c0 : c1 + 1])):
                raise DatasetError(
                    f"{source}: the file changed during conversion (columns {c0}:{c1} have "
                    f"{rec.size} entries in the second pass, {hi - lo} in the first)"
                )
            order = np.argsort(rec["col"], kind="stable")
            g["indices"][lo:hi] = rec["row"][order]
            g["data"][lo:hi] = rec["val"][order].view(self.storage)
            del rec, order
            file.unlink(missing_ok=True)


def add_csc(path: str | os.PathLike, *, checksum: bool = True, progress: bool = True) -> bool:
    """Add the CSC copy ``X_csc`` to a CSR file that lacks it (a file of layout 1.0).

    Reads ``X`` twice in slabs (column counts, then the entries, which are spilled by column
    band beside the file and sorted band by band into the copy), checking its structure on
    the way, so memory stays bounded (16 bytes per column and one band) and the file is
    changed only at the end: the copy is written under a temporary name and renamed.

    Parameters
    ----------
    path : path-like
        A dataset file with a CSR ``X``.
    checksum : bool
        Store a fletcher32 checksum with every chunk of the copy.
    progress : bool
        Draw a progress bar on standard error.

    Returns
    -------
    bool
        True if the copy was added, False if the file already had one.

    Raises
    ------
    DatasetError
        ``X`` is dense, or its CSR arrays are malformed (the message names the position).
    """
    path = Path(path)
    with open_dataset(path) as f:
        info = read_header(f, path)
    if info["layout"] != "csr":
        raise DatasetError(f"{path}: X is dense; only a CSR X has a CSC copy")
    if info["csc"]:
        return False
    m, n, nnz, dtype = info["n_samples"], info["n_features"], info["nnz"], info["dtype"]
    partial = f"{CSC_COPY}.partial"
    spill = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".spill", dir=path.parent))
    try:
        with (
            h5py.File(path, "r+") as f,
            Progress(2 * nnz, "add CSC copy", enabled=progress, unit="entries") as bar,
        ):
            g = f["X"]
            counts = np.zeros(n, dtype=np.int64)
            for a in range(0, nnz, SPARSE_SLAB):
                b = min(nnz, a + SPARSE_SLAB)
                with guard(path, "X/indices", f"[{a}:{b}]"):
                    idx = g["indices"][a:b].astype(np.int64)
                bad = (idx < 0) | (idx >= n)
                if bad.any():
                    k = int(np.flatnonzero(bad)[0])
                    raise DatasetError(
                        f"{path}: X/indices[{a + k}] = {idx[k]} is outside 0..{n - 1}"
                    )
                counts += np.bincount(idx, minlength=n)
                bar.update(b - a)
            builder = CSCBuilder(counts, m, dtype, spill)
            rows_per_piece = 1 << 20
            prev = None
            for r0 in range(0, m, rows_per_piece):
                r1 = min(m, r0 + rows_per_piece)
                with guard(path, "X/indptr", f"[{r0}:{r1 + 1}]"):
                    ptr = g["indptr"][r0 : r1 + 1].astype(np.int64)
                check_indptr(ptr, r0, m + 1, nnz, path, "X/indptr")
                for a in range(int(ptr[0]), int(ptr[-1]), SPARSE_SLAB):
                    b = min(int(ptr[-1]), a + SPARSE_SLAB)
                    with guard(path, "X/indices", f"[{a}:{b}]"):
                        idx = g["indices"][a:b].astype(np.int64)
                    with guard(path, "X/data", f"[{a}:{b}]"):
                        vals = g["data"][a:b]
                    rows = np.searchsorted(ptr, np.arange(a, b), side="right") - 1 + r0
                    prev = check_minor_indices(idx, a, rows, n, prev, path, "X/indices", "row")
                    builder.add(rows, idx, vals)
                    bar.update(b - a)
            if partial in f:
                del f[partial]  # left by an interrupted earlier run
            comp = info["compression"] if info["compression"] in ("gzip", "lzf") else None
            c = _create_compressed(f, partial, "csc", m, n, nnz, dtype, comp, checksum)
            builder.finish(c, path)
            f.move(partial, CSC_COPY)
            f.attrs["optcc_layout_minor"] = max(1, int(f.attrs.get("optcc_layout_minor", 0)))
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    return True
