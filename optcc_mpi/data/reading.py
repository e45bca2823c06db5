"""Reading dataset files: describe and validate them, and load one rank's column block.

CA-SGD splits ``X`` by columns (1D block-column layout): rank p of P owns the features
``column_block(n, P, p)`` for all rows, so :func:`load_partition` reads only that column
block, with plain serial h5py (no parallel HDF5 needed) and about ``m * n / P`` elements of
memory per rank. What each rank reads from disk:

* dense ``X``: its column block, in row slabs of whole chunks (chunks are at most 8 columns
  wide, so at most two partly-used chunk columns beyond the block);
* CSR ``X`` with its CSC copy (layout 1.1): its columns' slice of the copy's ``indptr``,
  ``indices`` and ``data``, about ``1/P`` of the matrix;
* CSR ``X`` without the copy (files of layout 1.0): all of ``X/indices`` (the entries of its
  columns are scattered over every row), keeping only its own.

Every rank also reads all of ``y`` (``8 m`` bytes). The sparse arrays read are checked as
they arrive (:mod:`optcc_mpi.data.validation`), and a chunk that fails its checksum or does
not decompress raises a :class:`~optcc_mpi.errors.DatasetError` naming file and dataset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import scipy.sparse as sp

from optcc_mpi import transports
from optcc_mpi.check import agreement
from optcc_mpi.errors import DatasetError
from optcc_mpi.labels import binary_to_01, check_labels, infer_task

from .layout import (
    BF16,
    CSC_COPY,
    WRITE_BUFFER_BYTES,
    cast_to,
    column_block,
    first_true,
    numpy_dtype,
    storage_dtype_name,
    storage_view,
)
from .validation import (
    SPARSE_SLAB,
    check_indptr,
    check_minor_indices,
    guard,
    nonfinite_message,
    open_dataset,
    read_header,
    scan_sparse,
)

__all__ = ["Partition", "load_dense", "load_partition", "validate"]


def validate(
    path: str | os.PathLike,
    *,
    size: int | None = None,
    dtype: Any = None,
    scan: bool = False,
) -> dict[str, Any]:
    """Check a dataset file and a loading request; return a description of the file.

    Checks run in this order, each raising before any data is read: the requested ``dtype``
    is known; the file exists and is HDF5; ``X`` and ``y`` exist with matching lengths and a
    supported layout and type (and a CSC copy, if present, matches ``X``'s shape); the
    file's ``task`` is known; ``size`` ranks do not exceed the number of features. With
    ``scan=True`` every value is then read, in bounded slabs: ``X`` and ``y`` must be
    finite, ``y`` must fit the file's task, a CSR ``X`` must be well formed, and its CSC
    copy must hold exactly the same entries. Checksums are verified on every read.

    Parameters
    ----------
    path : path-like
        The HDF5 file.
    size : int, optional
        Number of ranks that will load it.
    dtype : str, optional
        The dtype a load will request (float64, float32, bfloat16).
    scan : bool
        Also check all values (reads the whole file).

    Returns
    -------
    dict
        ``path``, ``layout`` ('dense' or 'csr'), ``csc`` (a CSR file with its CSC copy),
        ``n_samples``, ``n_features``, ``dtype`` (stored), ``nnz`` (CSR only), ``chunks``,
        ``compression``, ``checksums`` (fletcher32 on ``X`` and ``y``), ``task``,
        ``origin``, ``licence``, ``layout_version``, ``layout_minor``, ``attrs`` (all file
        attributes), ``extra`` (other datasets in the file).

    Raises
    ------
    FileNotFoundError
        The file does not exist.
    DatasetError
        Anything else wrong, with the file, dataset and offending position named.
    """
    storage_dtype_name(dtype)
    path = Path(path)
    with open_dataset(path) as f:
        info = read_header(f, path)
        if scan:
            m, n = info["n_samples"], info["n_features"]
            y = _read_y(f, path, 0, m, 0, slice(0, n))
            if info["layout"] == "csr":
                scan_sparse(f, path, m, n)
            else:
                # Column pieces of at most ~256 MiB: every value is read and checked once,
                # in bounded memory.
                pieces = min(n, max(1, -(-(m * n * 8) // (256 << 20))))
                for p in range(pieces):
                    cols = column_block(n, pieces, p)
                    _read_dense_block(f["X"], info["dtype"], info["dtype"], 0, m, cols, p, path)
            task = info["task"] or infer_task(y)
            check_labels(y, task)
    if size is not None:
        column_block(info["n_features"], int(size), 0)
    return info


@dataclass
class Partition:
    """One rank's share of a dataset in the 1D block-column layout.

    Attributes
    ----------
    X : numpy.ndarray or scipy.sparse.csr_matrix
        Shape ``(n_samples, cols.stop - cols.start)``: every loaded row, this rank's columns.
        Dense files give an ndarray in the requested dtype (``ml_dtypes.bfloat16`` for
        bfloat16); CSR files give a csr_matrix with column indices local to the block
        (0 = global column ``cols.start``). SciPy has no bfloat16 arithmetic, so a CSR load
        with ``dtype='bfloat16'`` holds bfloat16-rounded values in float32 (``dtype`` below
        still says bfloat16).
    y : numpy.ndarray
        float64 labels of the loaded rows, shape ``(n_samples,)``, replicated on every rank.
        Binary labels are in {0, 1}.
    n_features : int
        Number of columns of the whole ``X`` (all ranks together).
    n_samples : int
        Number of rows loaded (the file's row count unless ``rows`` was given).
    cols : slice
        The global columns this rank holds.
    task : str
        'binary', 'regression' or 'counts' (from the file, or inferred from ``y`` for files
        without a task attribute).
    attrs : dict
        The file's attributes (origin, licence, generator parameters, ...).
    dtype : str
        Logical element type of the values in ``X``.
    rows : slice
        The global rows loaded.
    layout : str
        'dense' or 'csr'.
    """

    X: Any
    y: np.ndarray
    n_features: int
    n_samples: int
    cols: slice
    task: str
    attrs: dict = field(default_factory=dict)
    dtype: str = "float64"
    rows: slice = field(default_factory=lambda: slice(0, 0))
    layout: str = "dense"

    @property
    def n_local(self) -> int:
        """Number of columns this rank holds."""
        return self.cols.stop - self.cols.start


def _rank_and_size(comm: Any, rank: int | None, size: int | None) -> tuple[int, int]:
    if comm is not None:
        t = transports.of(comm)  # an mpi4py communicator or a torch.distributed group
        crank, csize = t.rank, t.size
        if (rank is not None and rank != crank) or (size is not None and size != csize):
            raise DatasetError(
                f"rank={rank}, size={size} contradict the communicator (rank {crank} of {csize})"
            )
        return crank, csize
    if (rank is None) != (size is None):
        raise DatasetError("give both rank and size, or a communicator, or neither")
    if rank is None:
        return 0, 1
    size = int(size)
    rank = int(rank)
    if size < 1 or not 0 <= rank < size:
        raise DatasetError(f"rank {rank} is outside 0..{size - 1}")
    return rank, size


def _row_range(rows: slice | None, m: int, path: Path) -> tuple[int, int]:
    if rows is None:
        return 0, m
    if not isinstance(rows, slice):
        raise DatasetError(f"rows must be a slice, got {type(rows).__name__}")
    start, stop, step = rows.indices(m)
    if step != 1:
        raise DatasetError(f"rows must be a contiguous slice (step 1), got step {rows.step}")
    if stop <= start:
        raise DatasetError(f"{path}: rows={rows} selects no rows of {m}")
    return start, stop


def _read_dense_block(
    ds: h5py.Dataset,
    stored: str,
    target: str,
    r0: int,
    r1: int,
    cols: slice,
    rank: int,
    path: Path,
    ones: bool = False,
) -> np.ndarray:
    """Read X[r0:r1, cols] in row slabs aligned to chunks, converting and checking as it goes.

    With ``ones`` the result has one more column, of ones (the intercept column).
    """
    c0, c1 = cols.start, cols.stop
    width = c1 - c0
    out = np.empty((r1 - r0, width + int(ones)), dtype=numpy_dtype(target))
    if ones:
        out[:, width] = 1
    if width == 0:
        return out
    ch = ds.chunks[0] if ds.chunks else 1
    # Slabs of whole chunk rows, about 64 MiB of output each: bounded transient memory when
    # converting, and every chunk is read exactly once.
    per_row = max(1, (c1 - c0) * out.itemsize)
    slab = max(ch, (WRITE_BUFFER_BYTES // per_row) // ch * ch)
    a = r0
    while a < r1:
        b = min(r1, (a // ch) * ch + slab)
        dest = out[a - r0 : b - r0, :width]
        with guard(path, "X", f"[{a}:{b}, {c0}:{c1}]"):
            if stored == target or {stored, target} == {"float32", "float64"}:
                # Same type, or float64 <-> float32 which HDF5 converts while reading.
                dsel, osel = np.s_[a:b, c0:c1], np.s_[a - r0 : b - r0, :width]
                ds.read_direct(storage_view(out), dsel, osel)
            elif stored == "bfloat16":
                dest[...] = ds[a:b, c0:c1].view(BF16).astype(out.dtype)
            else:
                dest[...] = cast_to(ds[a:b, c0:c1], target)
        finite = np.isfinite(dest)
        if not finite.all():
            i, j = np.argwhere(~finite)[0]
            src = ds[a + i, c0 + j]
            src_val = src.view(BF16) if stored == "bfloat16" else src
            raise DatasetError(
                nonfinite_message(
                    path,
                    "X",
                    dest[i, j],
                    a + int(i),
                    c0 + int(j),
                    rank,
                    cols,
                    source_finite=bool(np.isfinite(np.float64(src_val))),
                )
            )
        a = b
    return out


def _empty_block(r: int, target: str) -> sp.csr_matrix:
    return sp.csr_matrix((r, 0), dtype=np.float64 if target == "float64" else np.float32)


def _values(vals: np.ndarray, stored: str, target: str) -> np.ndarray:
    """Stored sparse values in the dtype a Partition holds them in.

    SciPy cannot compute with bfloat16, so bf16 values are rounded to bf16 and kept in
    float32 (exactly representable).
    """
    if stored == "bfloat16":
        vals = vals.view(BF16)
    vals = cast_to(vals, target)
    return vals.astype(np.float32) if target == "bfloat16" else vals


def _read_csr_block(
    g: h5py.Group,
    stored: str,
    target: str,
    r0: int,
    r1: int,
    cols: slice,
    rank: int,
    path: Path,
    n: int,
) -> sp.csr_matrix:
    """Filter the CSR rows r0:r1 down to this rank's columns, reading nonzeros in slabs.

    Without a CSC copy a rank's entries are scattered over every row, so it reads all of
    ``X/indices`` and ``X/data`` for its rows. The arrays are checked as they arrive.
    """
    c0, c1 = cols.start, cols.stop
    if c1 == c0:
        return _empty_block(r1 - r0, target)
    m, nnz = g["indptr"].shape[0] - 1, g["data"].shape[0]
    with guard(path, "X/indptr", f"[{r0}:{r1 + 1}]"):
        indptr = g["indptr"][r0 : r1 + 1].astype(np.int64)
    check_indptr(indptr, r0, m + 1, nnz, path, "X/indptr")
    base = int(indptr[0])
    indptr -= base
    total = int(indptr[-1])
    counts = np.zeros(r1 - r0, dtype=np.int64)
    idx_parts, val_parts = [], []
    hold = "float32" if target == "bfloat16" else target
    prev = None
    for a in range(0, total, SPARSE_SLAB):
        b = min(total, a + SPARSE_SLAB)
        where = f"[{base + a}:{base + b}]"
        with guard(path, "X/indices", where):
            idx = g["indices"][base + a : base + b].astype(np.int64)
        row = np.searchsorted(indptr, np.arange(a, b), side="right") - 1
        prev = check_minor_indices(idx, base + a, row + r0, n, prev, path, "X/indices", "row")
        keep = (idx >= c0) & (idx < c1)
        with guard(path, "X/data", where):
            vals = _values(g["data"][base + a : base + b][keep], stored, target)
        row = row[keep]
        finite = np.isfinite(vals)
        if not finite.all():
            k = first_true(~finite)
            col = int(idx[keep][k])
            raise DatasetError(
                nonfinite_message(path, "X", vals[k], r0 + int(row[k]), col, rank, cols)
            )
        counts += np.bincount(row, minlength=r1 - r0)
        idx_parts.append((idx[keep] - c0).astype(np.int32 if c1 - c0 < 2**31 else np.int64))
        val_parts.append(vals.astype(numpy_dtype(hold), copy=False))
    local_ptr = np.zeros(r1 - r0 + 1, dtype=np.int64)
    np.cumsum(counts, out=local_ptr[1:])
    indices = np.concatenate(idx_parts) if idx_parts else np.zeros(0, np.int32)
    data = np.concatenate(val_parts) if val_parts else np.zeros(0, numpy_dtype(hold))
    return sp.csr_matrix((data, indices, local_ptr), shape=(r1 - r0, c1 - c0))


def _read_csc_block(
    g: h5py.Group,
    stored: str,
    target: str,
    r0: int,
    r1: int,
    cols: slice,
    rank: int,
    path: Path,
    m: int,
) -> sp.csr_matrix:
    """Read this rank's columns from the CSC copy: one contiguous range of each array.

    The rank reads ``indptr[c0 : c1 + 1]`` and the entries it points to, about ``1/P`` of
    the matrix, checks them, keeps the rows ``r0:r1``, and returns the block as CSR (what
    the trainer's row sampling needs).
    """
    c0, c1 = cols.start, cols.stop
    if c1 == c0:
        return _empty_block(r1 - r0, target)
    name = CSC_COPY
    n, nnz = g["indptr"].shape[0] - 1, g["data"].shape[0]
    with guard(path, f"{name}/indptr", f"[{c0}:{c1 + 1}]"):
        ptr = g["indptr"][c0 : c1 + 1].astype(np.int64)
    check_indptr(ptr, c0, n + 1, nnz, path, f"{name}/indptr")
    base = int(ptr[0])
    ptr -= base
    total = int(ptr[-1])
    width = c1 - c0
    counts = np.zeros(width, dtype=np.int64)
    row_parts, val_parts = [], []
    hold = "float32" if target == "bfloat16" else target
    all_rows = r0 == 0 and r1 == m
    prev = None
    for a in range(0, total, SPARSE_SLAB):
        b = min(total, a + SPARSE_SLAB)
        where = f"[{base + a}:{base + b}]"
        with guard(path, f"{name}/indices", where):
            rows = g["indices"][base + a : base + b].astype(np.int64)
        col = np.searchsorted(ptr, np.arange(a, b), side="right") - 1
        prev = check_minor_indices(
            rows, base + a, col + c0, m, prev, path, f"{name}/indices", "column"
        )
        with guard(path, f"{name}/data", where):
            vals = _values(g["data"][base + a : base + b], stored, target)
        finite = np.isfinite(vals)
        if not finite.all():
            k = first_true(~finite)
            raise DatasetError(
                nonfinite_message(path, "X", vals[k], int(rows[k]), c0 + int(col[k]), rank, cols)
            )
        if not all_rows:
            keep = (rows >= r0) & (rows < r1)
            rows, col, vals = rows[keep] - r0, col[keep], vals[keep]
        counts += np.bincount(col, minlength=width)
        row_parts.append(rows.astype(np.int32 if r1 - r0 < 2**31 else np.int64))
        val_parts.append(vals.astype(numpy_dtype(hold), copy=False))
    colptr = np.zeros(width + 1, dtype=np.int64)
    np.cumsum(counts, out=colptr[1:])
    indices = np.concatenate(row_parts) if row_parts else np.zeros(0, np.int32)
    data = np.concatenate(val_parts) if val_parts else np.zeros(0, numpy_dtype(hold))
    return sp.csc_matrix((data, indices, colptr), shape=(r1 - r0, width)).tocsr()


def _read_y(f: h5py.File, path: Path, r0: int, r1: int, rank: int, cols: slice) -> np.ndarray:
    y = np.empty(r1 - r0, dtype=np.float64)
    with guard(path, "y", f"[{r0}:{r1}]"):
        f["y"].read_direct(y, np.s_[r0:r1])
    bad = ~np.isfinite(y)
    if bad.any():
        i = first_true(bad)
        raise DatasetError(nonfinite_message(path, "y", y[i], r0 + i, None, rank, cols))
    return y


def load_partition(
    path: str | os.PathLike,
    *,
    comm: Any = None,
    rank: int | None = None,
    size: int | None = None,
    dtype: Any = None,
    rows: slice | None = None,
    intercept: bool = False,
) -> Partition:
    """Read this rank's column block of ``X`` and the labels.

    Every rank opens the file read-only with serial h5py and reads the hyperslab
    ``X[rows, column_block(n, size, rank)]``: dense files in row slabs of whole chunks, CSR
    files from their CSC copy (one contiguous range per array, about ``1/size`` of the
    matrix) or, for files without the copy (layout 1.0), by filtering all of ``X/indices``.
    Memory is about ``m * n / size`` elements (dense) or the block's nonzeros (twice, while
    the CSC block is turned into CSR), plus one slab.

    Parameters
    ----------
    path : path-like
        Dataset file in the layout of ``docs/data.md``.
    comm : mpi4py communicator or torch.distributed.ProcessGroup, optional
        Gives rank and size. With a communicator, a failure on any rank (say a NaN in one
        block) raises on every rank, so no rank is left waiting in a later collective.
    rank, size : int, optional
        Explicit position when there is no communicator (both or neither; default 0 of 1).
    dtype : {None, 'float64', 'float32', 'bfloat16'}
        Element type of ``X`` in memory; None keeps the stored type. Conversion to bfloat16
        rounds to nearest even, once, from the stored values.
    rows : slice, optional
        Contiguous subset of rows to read (e.g. a train split); default all rows.
    intercept : bool
        Treat ``X`` as having one more, last, column of ones, so a GLM without a bias term
        fits one (as its last weight). ``n_features`` then counts it, the blocks are cut
        from ``n + 1`` columns, the last rank's block ends with it, and
        ``attrs['intercept_column']`` gives its global index ``n``.

    Returns
    -------
    Partition

    Raises
    ------
    FileNotFoundError
        The file does not exist.
    DatasetError
        Unknown dtype, missing ``X`` or ``y``, mismatched lengths, more ranks than features,
        a bad ``rows`` slice, a NaN or infinity in the block (the message names the rank,
        the row and the column), a malformed sparse array (non-monotone ``indptr``,
        ``indptr[-1] != nnz``, an index out of range, duplicate or unsorted: the message
        names the dataset and position), or a chunk that fails its checksum or does not
        decompress (the message names the dataset).
    """
    target = storage_dtype_name(dtype)
    rank, size = _rank_and_size(comm, rank, size)
    path = Path(path)
    part: Partition | None = None
    error: BaseException | None = None
    # Everything that can fail is inside the try, so that with a communicator every rank
    # reaches the allgather below even if, say, only some nodes can see the file.
    try:
        info = validate(path, dtype=target)
        m, n_file = info["n_samples"], info["n_features"]
        n = n_file + int(bool(intercept))
        cols = column_block(n, size, rank)
        # The part of the block stored in the file (all but a final intercept column).
        fcols = slice(cols.start, min(cols.stop, n_file))
        ones = bool(intercept) and cols.stop == n
        r0, r1 = _row_range(rows, m, path)
        stored = info["dtype"]
        target = target or stored
        with h5py.File(path, "r") as f:
            y = _read_y(f, path, r0, r1, rank, cols)
            if info["layout"] == "csr":
                if info["csc"]:
                    X = _read_csc_block(f[CSC_COPY], stored, target, r0, r1, fcols, rank, path, m)
                else:
                    X = _read_csr_block(f["X"], stored, target, r0, r1, fcols, rank, path, n_file)
                if ones:
                    col = sp.csr_matrix(np.ones((r1 - r0, 1), dtype=X.dtype))
                    X = sp.hstack([X, col], format="csr")
            else:
                X = _read_dense_block(f["X"], stored, target, r0, r1, fcols, rank, path, ones)
        task = info["task"] or infer_task(y)
        if task == "binary":
            # Files from other tools may hold {-1, +1}; the trainer expects {0, 1}. Any other
            # domain problem is left to the trainer's check_labels().
            y = binary_to_01(y)
        attrs = dict(info["attrs"])
        if intercept:
            attrs["intercept_column"] = n_file
        part = Partition(
            X=X,
            y=y,
            n_features=n,
            n_samples=r1 - r0,
            cols=cols,
            task=task,
            attrs=attrs,
            dtype=target,
            rows=slice(r0, r1),
            layout=info["layout"],
        )
    except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the other ranks
        error = exc
    if comm is not None:
        # One collective so that a rank whose block is bad does not leave the others waiting.
        agreement.agree(
            transports.of(comm), error, what="could not load every rank's block", cls=DatasetError
        )
    if error is not None:
        raise error
    assert part is not None
    return part


def load_dense(
    path: str | os.PathLike, dtype: Any = None, *, intercept: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Read the whole ``X`` (densified if stored as CSR) and ``y`` into one process.

    Meant for tests, small data and single-process baselines; use :func:`load_partition` for
    training.

    Parameters
    ----------
    path : path-like
        Dataset file.
    dtype : {None, 'float64', 'float32', 'bfloat16'}
        Element type of the returned ``X``; None keeps the stored type.
    intercept : bool
        Append a last column of ones (as :func:`load_partition`).

    Returns
    -------
    X : numpy.ndarray, shape (m, n) (n + 1 with ``intercept``)
    y : numpy.ndarray of float64, shape (m,)
    """
    part = load_partition(path, rank=0, size=1, dtype=dtype, intercept=intercept)
    X = part.X
    if sp.issparse(X):
        X = X.toarray()
        if part.dtype == "bfloat16":
            X = X.astype(BF16)
    return X, part.y
