"""Checks of a dataset file: its structure, its sparse arrays, and reads that fail.

Everything here raises :class:`~optcc_mpi.errors.DatasetError` naming the file, the dataset
inside it and the position of the offending entry:

* :func:`read_header` checks the layout (datasets present, shapes agree, supported types,
  version) without reading any values;
* :func:`check_indptr` and :func:`check_minor_indices` check the arrays of a compressed
  sparse matrix (CSR ``X`` or its CSC copy) slab by slab, as the readers load them:
  ``indptr`` starts at 0, never decreases and ends at ``nnz``; indices lie in range and
  strictly increase within each row (column);
* :func:`guard` turns the ``OSError`` HDF5 raises for an unreadable chunk (a fletcher32
  checksum mismatch, a corrupt compressed chunk) into a ``DatasetError`` naming the file and
  dataset;
* :func:`scan_sparse` reads both sparse structures of a file and checks that the CSC copy
  holds exactly the entries of the CSR matrix.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from optcc_mpi.errors import DatasetError, FileMissingError

from .layout import (
    BF16,
    CSC_COPY,
    LAYOUT_VERSION,
    OPAQUE2,
    TASKS,
    attr_value,
    first_true,
)

# Entries read at a time when checking or filtering a compressed sparse array.
SPARSE_SLAB = 1 << 22


def open_dataset(path: str | os.PathLike) -> h5py.File:
    p = Path(path)
    if not p.exists():
        raise FileMissingError(f"dataset file not found: {p}")
    if not p.is_file():
        raise DatasetError(f"{p} is not a file")
    try:
        return h5py.File(p, "r")
    except OSError as exc:
        raise DatasetError(f"{p} is not a readable HDF5 file ({exc})") from None


@contextmanager
def guard(path: Path, name: str, where: str = "") -> Iterator[None]:
    """Turn an HDF5 read failure inside the block into a DatasetError naming ``name``.

    HDF5 reports a chunk whose fletcher32 checksum does not match, or whose compressed bytes
    do not decompress, as a bare ``OSError`` ("filter returned failure during read") that
    names neither the file nor the dataset.
    """
    try:
        yield
    except OSError as exc:
        raise DatasetError(
            f"{path}: cannot read dataset {name}{where}: the stored bytes are corrupt (a "
            f"checksum or decompression filter failed) or unreadable; HDF5 said: {exc}"
        ) from None


def _stored_dtype(obj: h5py.Dataset, path: Path, what: str) -> str:
    """Logical dtype of a stored X (or X/data) dataset."""
    dt = obj.dtype
    if dt == OPAQUE2:
        tag = attr_value(obj.attrs.get("optcc_dtype", ""))
        if tag != "bfloat16":
            raise DatasetError(
                f"{path}: {what} is an opaque 2-byte type without the attribute "
                f"optcc_dtype = 'bfloat16' (found {tag!r})"
            )
        return "bfloat16"
    if dt in (np.dtype(np.float64), np.dtype(np.float32)):
        return dt.name
    raise DatasetError(
        f"{path}: {what} has unsupported type {dt}; expected float64, float32 or "
        "bfloat16 (opaque 2-byte with optcc_dtype = 'bfloat16')"
    )


def _sparse_group(g: h5py.Group, path: Path, name: str, kind: str) -> tuple[int, int, int]:
    """Check the datasets and shapes of a compressed sparse group; return (m, n, nnz)."""
    missing = [k for k in ("indptr", "indices", "data") if k not in g]
    if missing:
        raise DatasetError(
            f"{path}: group {name!r} is not a {kind} matrix: missing dataset(s) {missing}"
        )
    shape = g.attrs.get("shape")
    if shape is None or len(shape) != 2:
        raise DatasetError(f"{path}: {kind} group {name!r} lacks a 2-element 'shape' attribute")
    m, n = (int(s) for s in shape)
    nnz = g["data"].shape[0]
    major = m if kind == "CSR" else n
    if g["indptr"].shape != (major + 1,):
        raise DatasetError(
            f"{path}: {name}/indptr has shape {g['indptr'].shape}, expected ({major + 1},) for "
            f"a {kind} matrix of shape {m} x {n}"
        )
    if g["indices"].shape != (nnz,):
        raise DatasetError(
            f"{path}: {name}/indices has {g['indices'].shape[0]} entries but {name}/data has {nnz}"
        )
    return m, n, int(nnz)


def read_header(f: h5py.File, path: Path) -> dict[str, Any]:
    """Describe the layout of an open file, checking structure but reading no values."""
    names = sorted(f.keys())
    for key in ("X", "y"):
        if key not in f:
            raise DatasetError(
                f"{path}: missing dataset {key!r} (a dataset file needs 'X' and 'y'; "
                f"found {names or 'nothing'})"
            )
    attrs = {k: attr_value(v) for k, v in f.attrs.items()}
    version = attrs.get("optcc_layout")
    if version is not None and int(version) > LAYOUT_VERSION:
        raise DatasetError(
            f"{path}: optcc_layout = {version} is newer than this version of optcc_mpi "
            f"understands ({LAYOUT_VERSION})"
        )
    X = f["X"]
    info: dict[str, Any] = {
        "path": str(path),
        "layout_version": version,
        "layout_minor": attrs.get("optcc_layout_minor"),
        "attrs": attrs,
        "csc": False,
    }
    if isinstance(X, h5py.Group):
        m, n, nnz = _sparse_group(X, path, "X", "CSR")
        data = X["data"]
        info.update(
            layout="csr",
            dtype=_stored_dtype(data, path, "X/data"),
            nnz=nnz,
            chunks=data.chunks,
            compression=data.compression,
            checksums=bool(data.fletcher32),
        )
        copy = f.get(CSC_COPY)
        if copy is not None:
            if not isinstance(copy, h5py.Group):
                raise DatasetError(f"{path}: {CSC_COPY!r} is not a group (a CSC copy of X)")
            cm, cn, cnnz = _sparse_group(copy, path, CSC_COPY, "CSC")
            if (cm, cn, cnnz) != (m, n, nnz):
                raise DatasetError(
                    f"{path}: the CSC copy {CSC_COPY!r} is {cm} x {cn} with {cnnz} entries but "
                    f"X is {m} x {n} with {nnz}: the copy does not match X"
                )
            cdtype = _stored_dtype(copy["data"], path, f"{CSC_COPY}/data")
            if cdtype != info["dtype"]:
                raise DatasetError(
                    f"{path}: {CSC_COPY}/data holds {cdtype} but X/data holds {info['dtype']}"
                )
            info["csc"] = True
    else:
        if X.ndim != 2:
            raise DatasetError(f"{path}: X must be two-dimensional, got shape {X.shape}")
        m, n = (int(s) for s in X.shape)
        info.update(
            layout="dense",
            dtype=_stored_dtype(X, path, "X"),
            nnz=None,
            chunks=X.chunks,
            compression=X.compression,
            checksums=bool(X.fletcher32),
        )
    y = f["y"]
    if not isinstance(y, h5py.Dataset) or y.ndim != 1:
        raise DatasetError(f"{path}: y must be a one-dimensional dataset")
    if y.shape[0] != m:
        raise DatasetError(f"{path}: shape mismatch: X has {m} rows but y has {y.shape[0]} entries")
    if m < 1 or n < 1:
        raise DatasetError(f"{path}: X is empty (shape {m} x {n})")
    task = attrs.get("task")
    if task is not None and task not in TASKS:
        raise DatasetError(f"{path}: task attribute {task!r} is not one of {', '.join(TASKS)}")
    info["checksums"] = info["checksums"] and bool(y.fletcher32)
    info.update(
        n_samples=m,
        n_features=n,
        task=task,
        origin=attrs.get("origin"),
        licence=attrs.get("licence"),
        extra=[k for k in names if k not in ("X", "y", CSC_COPY)],
    )
    return info


def check_indptr(ptr: np.ndarray, start: int, length: int, nnz: int, path: Path, name: str) -> None:
    """Check ``ptr = name[start : start + len(ptr)]`` of a compressed sparse matrix.

    ``indptr`` must start at 0, never decrease, stay within 0..nnz and end at ``nnz``; each
    caller checks the part it read (ranks read overlapping parts, so together they check
    all of it).

    Parameters
    ----------
    ptr : numpy.ndarray of int64
        The entries read.
    start : int
        Position of ``ptr[0]`` in the whole array.
    length : int
        Length of the whole array (rows or columns + 1).
    nnz : int
        Number of stored entries.
    path : pathlib.Path
        The file, for messages.
    name : str
        The dataset (``X/indptr``), for messages.
    """
    if ptr.size == 0:
        return
    if start == 0 and ptr[0] != 0:
        raise DatasetError(f"{path}: {name}[0] = {ptr[0]}, but indptr must start at 0")
    if start + ptr.size == length and ptr[-1] != nnz:
        raise DatasetError(
            f"{path}: {name}[{length - 1}] = {ptr[-1]} (the last entry) but {nnz} entries are "
            "stored: indptr must end at the number of stored entries"
        )
    down = ptr[1:] < ptr[:-1]
    if down.any():
        k = first_true(down)
        raise DatasetError(
            f"{path}: {name} is not monotone: {name}[{start + k + 1}] = {ptr[k + 1]} is less "
            f"than {name}[{start + k}] = {ptr[k]}"
        )
    outside = (ptr < 0) | (ptr > nnz)
    if outside.any():
        k = first_true(outside)
        raise DatasetError(
            f"{path}: {name}[{start + k}] = {ptr[k]} is outside 0..{nnz} (the number of "
            "stored entries)"
        )


def check_minor_indices(
    idx: np.ndarray,
    pos0: int,
    seg: np.ndarray,
    bound: int,
    prev: tuple[int, int] | None,
    path: Path,
    name: str,
    seg_name: str,
) -> tuple[int, int] | None:
    """Check indices ``name[pos0 : pos0 + len(idx)]`` of a compressed sparse matrix.

    Each index must lie in ``0..bound-1`` and strictly increase within its segment (a CSR
    row, a CSC column): an equal index is a duplicate entry, a smaller one an unsorted row.

    Parameters
    ----------
    idx : numpy.ndarray of int64
        The indices read.
    pos0 : int
        Position of ``idx[0]`` in the whole array.
    seg : numpy.ndarray of int64
        The segment (row or column) of each index.
    bound : int
        Number of columns (CSR) or rows (CSC).
    prev : (segment, index) or None
        The last index of the previous slab and its segment, to check across slab edges.
    path, name, seg_name :
        The file, the dataset (``X/indices``) and what a segment is (``row``), for messages.

    Returns
    -------
    (segment, index) or None
        The last index checked, to pass as ``prev`` with the next slab.
    """
    if idx.size == 0:
        return prev
    outside = (idx < 0) | (idx >= bound)
    if outside.any():
        k = first_true(outside)
        raise DatasetError(
            f"{path}: {name}[{pos0 + k}] = {idx[k]} is outside 0..{bound - 1} ({seg_name} {seg[k]})"
        )
    if prev is not None:
        idx = np.concatenate(([prev[1]], idx))
        seg = np.concatenate(([prev[0]], seg))
        pos0 -= 1
    bad = (idx[1:] <= idx[:-1]) & (seg[1:] == seg[:-1])
    if bad.any():
        k = first_true(bad) + 1
        what = "duplicate" if idx[k] == idx[k - 1] else "unsorted"
        raise DatasetError(
            f"{path}: {what} index in {seg_name} {seg[k]}: {name}[{pos0 + k}] = {idx[k]} "
            f"follows {name}[{pos0 + k - 1}] = {idx[k - 1]} (indices must be strictly "
            f"increasing within a {seg_name})"
        )
    return int(seg[-1]), int(idx[-1])


def nonfinite_message(
    path: Path,
    what: str,
    value: Any,
    row: int,
    col: int | None,
    rank: int,
    cols: slice,
    source_finite: bool | None = None,
) -> str:
    where = f"row {row}" + (f", column {col}" if col is not None else "")
    msg = f"{path}: non-finite value {value} in {what} at {where}"
    if col is not None:
        msg += f" (block of rank {rank}, columns {cols.start}:{cols.stop})"
    if source_finite:
        msg += " after conversion (the stored value overflows the requested dtype)"
    return msg


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit mixing function (the splitmix64 finaliser), elementwise, wrapping."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _entry_hash(rows: np.ndarray, cols: np.ndarray, values: np.ndarray) -> int:
    """Order-independent 64-bit fingerprint of entries (row, column, value bits).

    The sum (mod 2**64) of a mixed hash of each entry: the same entries in any order, CSR or
    CSC, give the same number, and a moved, changed, lost or added entry changes it (up to
    a 2**-64 chance).
    """
    bits = values.view(f"u{values.dtype.itemsize}").astype(np.uint64)
    r = rows.astype(np.uint64)
    c = cols.astype(np.uint64)
    h = _mix(_mix(r * np.uint64(0x9E3779B97F4A7C15) + c) ^ bits)
    return int(h.sum(dtype=np.uint64))


def _scan_compressed(
    g: h5py.Group, path: Path, name: str, csr: bool, m: int, n: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Check every entry of one compressed sparse group; return its per-row and per-column
    entry counts and the entries' fingerprint."""
    major, minor = (m, n) if csr else (n, m)
    seg_name = "row" if csr else "column"
    nnz = g["data"].shape[0]
    with guard(path, f"{name}/indptr"):
        ptr = g["indptr"][...].astype(np.int64)
    check_indptr(ptr, 0, major + 1, nnz, path, f"{name}/indptr")
    minor_counts = np.zeros(minor, dtype=np.int64)
    digest = 0
    prev = None
    for a in range(0, nnz, SPARSE_SLAB):
        b = min(nnz, a + SPARSE_SLAB)
        with guard(path, f"{name}/indices", f"[{a}:{b}]"):
            idx = g["indices"][a:b].astype(np.int64)
        with guard(path, f"{name}/data", f"[{a}:{b}]"):
            vals = g["data"][a:b]
        seg = np.searchsorted(ptr, np.arange(a, b), side="right") - 1
        prev = check_minor_indices(idx, a, seg, minor, prev, path, f"{name}/indices", seg_name)
        minor_counts += np.bincount(idx, minlength=minor)
        rows, cols = (seg, idx) if csr else (idx, seg)
        numbers = vals.view(BF16) if vals.dtype == OPAQUE2 else vals
        finite = np.isfinite(numbers)
        if not finite.all():
            k = first_true(~finite)
            raise DatasetError(
                f"{path}: non-finite value {numbers[k]} in X at row {rows[k]}, column "
                f"{cols[k]} ({name}/data[{a + k}])"
            )
        digest = (digest + _entry_hash(rows, cols, vals)) % (1 << 64)
    major_counts = np.diff(ptr)
    return (major_counts, minor_counts, digest) if csr else (minor_counts, major_counts, digest)


def scan_sparse(f: h5py.File, path: Path, m: int, n: int) -> None:
    """Check all of a CSR ``X`` and, if present, that its CSC copy holds the same entries.

    Reads each structure once, in slabs; memory is one slab plus one count per row and
    column.
    """
    rows, cols, digest = _scan_compressed(f["X"], path, "X", True, m, n)
    if CSC_COPY not in f:
        return
    crows, ccols, cdigest = _scan_compressed(f[CSC_COPY], path, CSC_COPY, False, m, n)
    for what, a, b in (("row", rows, crows), ("column", cols, ccols)):
        diff = a != b
        if diff.any():
            k = first_true(diff)
            raise DatasetError(
                f"{path}: the CSC copy {CSC_COPY!r} does not match X: {what} {k} has {a[k]} "
                f"entries in X but {b[k]} in the copy"
            )
    if digest != cdigest:
        raise DatasetError(
            f"{path}: the CSC copy {CSC_COPY!r} does not match X: same entry counts but "
            "different positions or values (fingerprints differ)"
        )
