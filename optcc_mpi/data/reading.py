"""HDF5 datasets for CA-SGD: the file layout, partitioned loading, converters and generators.

A dataset is one HDF5 file holding a design matrix ``X`` (m samples by n features) and a label
vector ``y``; the layout (version 1) is specified in ``docs/data.md``. CA-SGD splits ``X`` by
columns (1D block-column layout): rank p of P owns the features ``column_block(n, P, p)`` for
all rows, so :func:`load_partition` reads only that column block, with plain serial h5py
(no parallel HDF5 needed) and about ``m * n / P`` elements of memory per rank.

Public API
----------
``column_block(n_features, size, rank)``  the column slice rank ``rank`` of ``size`` owns
``Partition``                            one rank's block of ``X``, the labels and metadata
``load_partition(path, comm=..., ...)``  read this rank's column block
``load_dense(path)``                     read the whole ``X`` and ``y`` on one process
``write_dataset(path, X, y, ...)``       write in-memory arrays in the layout
``convert_svmlight(src, dst, ...)``      stream LIBSVM/svmlight text to HDF5, bounded memory
``synth(kind, rows, cols, seed, path)``  write a synthetic GLM dataset, bounded memory
``default_dataset(comm=None)``           the synthetic set ``train`` uses by default (cached)
``shipped(name)``                        a real dataset shipped in the repository's ``data/``
``validate(path, ...)``                  check a file's structure (and optionally its values)
``check_labels(y, task)``                check and normalise labels for a GLM task
``DatasetError``                         raised for any bad input (a ``ValueError``)
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import re
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import h5py
import ml_dtypes
import numpy as np
import scipy.sparse as sp

from optcc_mpi.errors import DatasetError
from optcc_mpi.progress import Progress

__all__ = [
    "LAYOUT_VERSION",
    "TASKS",
    "DTYPES",
    "SHIPPED",
    "SYNTH_KINDS",
    "DEFAULT_SYNTH",
    "DatasetError",
    "Partition",
    "column_block",
    "chunk_shape",
    "load_partition",
    "load_dense",
    "write_dataset",
    "convert_svmlight",
    "synth",
    "default_dataset",
    "data_home",
    "shipped",
    "validate",
    "check_labels",
    "infer_task",
]

#: Version of the file layout this module writes (file attribute ``optcc_layout``).
LAYOUT_VERSION = 1
#: Tasks a dataset can declare (file attribute ``task``).
TASKS = ("binary", "regression", "counts")
#: Logical element types of ``X``.
DTYPES = ("float64", "float32", "bfloat16")
#: Real datasets shipped in ``data/``.
SHIPPED = ("breast_cancer", "diabetes", "randhie")
#: Synthetic generators and the task each one produces.
SYNTH_KINDS = {"logistic": "binary", "linear": "regression", "poisson": "counts"}
#: The synthetic set :func:`default_dataset` creates (and ``train`` uses without ``--data``).
DEFAULT_SYNTH: dict[str, Any] = {
    "kind": "logistic",
    "rows": 32768,
    "cols": 256,
    "seed": 0,
    "dtype": "float32",
}

# Generator version, stored with every synthetic file. Bump it whenever synth() would produce
# different numbers for the same arguments, so stale cached default datasets get rebuilt.
SYNTH_VERSION = 1
# Rows drawn from one independent random stream in synth(). Fixed, so the data depend only on
# (kind, rows, cols, seed, dtype) and not on how many rows are written at a time.
_SYNTH_BLOCK = 1024

# Chunk policy (see chunk_shape): target bytes of one chunk, and the most bytes a writer
# buffers for one full row of chunks.
_CHUNK_BYTES = 1 << 20
_WRITE_BUFFER_BYTES = 64 << 20
# Widest chunk, in columns. Measured on 200,000 x 256 float32 (docs/data.md): 8-column chunks
# read column blocks 2-5x faster than 1-column chunks, and wider ones waste I/O at block edges.
_MAX_CHUNK_COLS = 8
# Bytes of svmlight text parsed at a time; the parsed block takes a few times this in memory.
_TEXT_BLOCK_BYTES = 8 << 20
# Nonzeros read at a time when filtering a CSR file down to one column block.
_CSR_SLAB = 1 << 22
# Density at or above which layout='auto' stores X dense. Dense float32 costs 4 bytes per
# element and CSR about 8 per nonzero, and dense products are much faster than sparse ones at
# such densities; below it CSR wins on both counts.
_DENSE_MIN_DENSITY = 0.25

_BF16 = np.dtype(ml_dtypes.bfloat16)
_OPAQUE2 = np.dtype("V2")
_DTYPE_ALIASES = {
    "float64": "float64",
    "f8": "float64",
    "double": "float64",
    "float32": "float32",
    "f4": "float32",
    "single": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


# --------------------------------------------------------------------------------------------
# Small helpers: dtypes, partitioning, chunking
# --------------------------------------------------------------------------------------------


def _dtype_name(dtype: Any) -> str | None:
    """Return the canonical name (``DTYPES``) of ``dtype``, or None for None."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype.strip().lower())
        if name is None:
            raise DatasetError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
        return name
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise DatasetError(
            f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}"
        ) from None
    if dt == _BF16:
        return "bfloat16"
    if dt in (np.dtype(np.float64), np.dtype(np.float32)):
        return dt.name
    raise DatasetError(f"unknown dtype {dt.name!r}; expected one of {', '.join(DTYPES)}")


def _np_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a canonical dtype name (bfloat16 from ml_dtypes)."""
    return _BF16 if name == "bfloat16" else np.dtype(name)


def _itemsize(name: str) -> int:
    return _np_dtype(name).itemsize


def _to_storage(a: np.ndarray) -> np.ndarray:
    """View a bf16 array as the opaque 2-byte type h5py writes; other arrays unchanged."""
    return a.view(_OPAQUE2) if a.dtype == _BF16 else a


def _cast(a: np.ndarray, name: str) -> np.ndarray:
    """Cast to dtype ``name``. float64 -> bfloat16 rounds once, to nearest even (ml_dtypes).

    Overflow gives infinities without a warning: callers check finiteness and report it.
    """
    with np.errstate(over="ignore"):
        return a.astype(_np_dtype(name), copy=False)


def column_block(n_features: int, size: int, rank: int) -> slice:
    """Return the columns rank ``rank`` of ``size`` owns in the 1D block-column layout.

    Columns are split into ``size`` contiguous blocks in rank order; the first
    ``n_features % size`` blocks get one extra column, so block sizes differ by at most one.

    Parameters
    ----------
    n_features : int
        Number of columns of ``X``.
    size : int
        Number of ranks.
    rank : int
        This rank, ``0 <= rank < size``.

    Returns
    -------
    slice
        ``slice(start, stop)`` with ``step`` None; never empty.

    Raises
    ------
    DatasetError
        If ``size < 1``, ``rank`` is out of range, or there are more ranks than columns.

    Examples
    --------
    >>> [column_block(10, 3, r) for r in range(3)]
    [slice(0, 4, None), slice(4, 7, None), slice(7, 10, None)]
    """
    n, size, rank = int(n_features), int(size), int(rank)
    if size < 1:
        raise DatasetError(f"size must be at least 1, got {size}")
    if not 0 <= rank < size:
        raise DatasetError(f"rank {rank} is outside 0..{size - 1}")
    if n < size:
        raise DatasetError(
            f"cannot split {n} feature(s) over {size} ranks: the block-column layout needs "
            f"at least one column per rank (use at most {n} ranks)"
        )
    q, r = divmod(n, size)
    start = rank * q + min(rank, r)
    return slice(start, start + q + (1 if rank < r else 0))


def _pow2_floor(x: float) -> int:
    x = max(1, int(x))
    return 1 << (x.bit_length() - 1)


def chunk_shape(
    n_rows: int, n_cols: int, dtype: Any = "float32", chunk_cols: int | None = None
) -> tuple[int, int]:
    """Return the HDF5 chunk shape used for a dense ``X`` of this size.

    Chunks are narrow in columns so a column-block read touches few columns it does not need,
    and tall in rows so each chunk is a long contiguous read:

    * width ``chunk_cols``: by default the largest power of two <= ``n_cols / 64``, clipped to
      1..8, so at up to 64 ranks a block's two partly-used edge chunks stay small against the
      block itself;
    * height: the largest power of two keeping one chunk within 1 MiB and one full row of
      chunks (what a streaming writer buffers) within 64 MiB, and no more than ``n_rows``.

    Parameters
    ----------
    n_rows, n_cols : int
        Shape of ``X``.
    dtype : str or dtype
        Logical element type (float64, float32, bfloat16).
    chunk_cols : int, optional
        Chunk width in columns, overriding the default.

    Returns
    -------
    tuple of int
        ``(chunk_rows, chunk_cols)``.
    """
    item = _itemsize(_dtype_name(dtype) or "float32")
    m, n = max(1, int(n_rows)), max(1, int(n_cols))
    if chunk_cols is None:
        cw = min(_MAX_CHUNK_COLS, _pow2_floor(n // 64))
    else:
        cw = int(chunk_cols)
        if cw < 1:
            raise DatasetError(f"chunk_cols must be at least 1, got {chunk_cols}")
    cw = min(cw, n)
    ch = _pow2_floor(min(_CHUNK_BYTES // (cw * item), _WRITE_BUFFER_BYTES // (n * item)))
    return min(ch, m), cw


# --------------------------------------------------------------------------------------------
# Labels
# --------------------------------------------------------------------------------------------


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_labels(y: Any, task: str) -> np.ndarray:
    """Check labels against a task's domain and return them normalised, as float64.

    Parameters
    ----------
    y : array_like, shape (m,)
        Labels.
    task : {'binary', 'regression', 'counts'}
        ``binary``: every label in {0, 1}, or every label in {-1, +1} (then mapped to {0, 1});
        ``counts``: non-negative integers; ``regression``: any finite value.

    Returns
    -------
    numpy.ndarray
        A float64 copy of ``y``; {-1, +1} labels become {0, 1}.

    Raises
    ------
    DatasetError
        Naming the first offending label and its index, or an unknown task.
    """
    if task not in TASKS:
        raise DatasetError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    y = np.array(y, dtype=np.float64, copy=True)
    if y.ndim != 1:
        raise DatasetError(f"labels must be one-dimensional, got shape {y.shape}")
    bad = ~np.isfinite(y)
    if bad.any():
        i = _first_bad(bad)
        raise DatasetError(f"label y[{i}] = {y[i]} is not finite")
    if task == "binary":
        not01 = (y != 0) & (y != 1)
        if not not01.any():
            return y
        notpm1 = (y != -1) & (y != 1)
        if not notpm1.any():
            return (y > 0).astype(np.float64)
        i = _first_bad(not01 & notpm1) if (not01 & notpm1).any() else _first_bad(not01)
        j = _first_bad(notpm1)
        if (not01 & notpm1).any():
            raise DatasetError(
                f"binary labels must be all in {{0, 1}} or all in {{-1, +1}}; y[{i}] = {y[i]:g}"
            )
        raise DatasetError(
            f"binary labels mix {{0, 1}} and {{-1, +1}}: y[{j}] = {y[j]:g} but y[{i}] = {y[i]:g}"
        )
    if task == "counts":
        bad = (y < 0) | (y != np.floor(y))
        if bad.any():
            i = _first_bad(bad)
            raise DatasetError(f"count labels must be non-negative integers; y[{i}] = {y[i]:g}")
    return y


def infer_task(y: Any) -> str:
    """Guess the task from label values.

    ``binary`` if every label is in {0, 1} or every label is in {-1, +1}; otherwise ``counts``
    if every label is a non-negative integer; otherwise ``regression``. Multi-class integer
    labels therefore read as counts: pass the task explicitly when that is wrong.
    """
    y = np.asarray(y, dtype=np.float64)
    if np.all((y == 0) | (y == 1)) or np.all((y == -1) | (y == 1)):
        return "binary"
    if np.all((y >= 0) & (y == np.floor(y))):
        return "counts"
    return "regression"


# --------------------------------------------------------------------------------------------
# Reading: headers, validation, partitioned loads
# --------------------------------------------------------------------------------------------


def _attr_value(v: Any) -> Any:
    """Decode an HDF5 attribute into a plain Python value."""
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.ndarray):
        if v.dtype.kind in "OSU":
            return [_attr_value(x) for x in v.tolist()]
        return v
    if isinstance(v, np.generic):
        return v.item()
    return v


def _open(path: str | os.PathLike) -> h5py.File:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"dataset file not found: {p}")
    if not p.is_file():
        raise DatasetError(f"{p} is not a file")
    try:
        return h5py.File(p, "r")
    except OSError as exc:
        raise DatasetError(f"{p} is not a readable HDF5 file ({exc})") from None


def _stored_dtype(obj: h5py.Dataset, path: Path, what: str) -> str:
    """Logical dtype of a stored X (or X/data) dataset."""
    dt = obj.dtype
    if dt == _OPAQUE2:
        tag = _attr_value(obj.attrs.get("optcc_dtype", ""))
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


def _header(f: h5py.File, path: Path) -> dict[str, Any]:
    """Describe the layout of an open file, checking structure but reading no values."""
    names = sorted(f.keys())
    for key in ("X", "y"):
        if key not in f:
            raise DatasetError(
                f"{path}: missing dataset {key!r} (a dataset file needs 'X' and 'y'; "
                f"found {names or 'nothing'})"
            )
    attrs = {k: _attr_value(v) for k, v in f.attrs.items()}
    version = attrs.get("optcc_layout")
    if version is not None and int(version) > LAYOUT_VERSION:
        raise DatasetError(
            f"{path}: optcc_layout = {version} is newer than this version of optcc_mpi "
            f"understands ({LAYOUT_VERSION})"
        )
    X = f["X"]
    info: dict[str, Any] = {"path": str(path), "layout_version": version, "attrs": attrs}
    if isinstance(X, h5py.Group):
        missing = [k for k in ("indptr", "indices", "data") if k not in X]
        if missing:
            raise DatasetError(
                f"{path}: group 'X' is not a CSR matrix: missing dataset(s) {missing}"
            )
        shape = X.attrs.get("shape")
        if shape is None or len(shape) != 2:
            raise DatasetError(f"{path}: CSR group 'X' lacks a 2-element 'shape' attribute")
        m, n = (int(s) for s in shape)
        nnz = X["data"].shape[0]
        if X["indptr"].shape != (m + 1,):
            raise DatasetError(
                f"{path}: X/indptr has shape {X['indptr'].shape}, expected ({m + 1},) for "
                f"shape {m} x {n}"
            )
        if X["indices"].shape != (nnz,):
            raise DatasetError(
                f"{path}: X/indices has {X['indices'].shape[0]} entries but X/data has {nnz}"
            )
        info.update(
            layout="csr",
            dtype=_stored_dtype(X["data"], path, "X/data"),
            nnz=int(nnz),
            chunks=X["data"].chunks,
            compression=X["data"].compression,
        )
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
    info.update(
        n_samples=m,
        n_features=n,
        task=task,
        origin=attrs.get("origin"),
        licence=attrs.get("licence"),
        extra=[k for k in names if k not in ("X", "y")],
    )
    return info


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
    supported layout and type; the file's ``task`` is known; ``size`` ranks do not exceed
    the number of features. With ``scan=True`` every value of ``X`` and ``y`` is then read
    (in bounded slabs) and checked to be finite, and ``y`` to fit the file's task.

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
        ``path``, ``layout`` ('dense' or 'csr'), ``n_samples``, ``n_features``, ``dtype``
        (stored), ``nnz`` (CSR only), ``chunks``, ``compression``, ``task``, ``origin``,
        ``licence``, ``layout_version``, ``attrs`` (all file attributes), ``extra`` (other
        datasets in the file).

    Raises
    ------
    FileNotFoundError
        The file does not exist.
    DatasetError
        Anything else wrong, with the offending value named.
    """
    _dtype_name(dtype)
    path = Path(path)
    with _open(path) as f:
        info = _header(f, path)
    if size is not None:
        column_block(info["n_features"], int(size), 0)
    if scan:
        part = load_partition(path, rank=0, size=1)
        if part.task in TASKS:
            check_labels(part.y, part.task)
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


def _rank_size(comm: Any, rank: int | None, size: int | None) -> tuple[int, int]:
    if comm is not None:
        crank, csize = comm.Get_rank(), comm.Get_size()
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


def _nonfinite_message(
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
    out = np.empty((r1 - r0, width + int(ones)), dtype=_np_dtype(target))
    if ones:
        out[:, width] = 1
    if width == 0:
        return out
    ch = ds.chunks[0] if ds.chunks else 1
    # Slabs of whole chunk rows, about 64 MiB of output each: bounded transient memory when
    # converting, and every chunk is read exactly once.
    per_row = max(1, (c1 - c0) * out.itemsize)
    slab = max(ch, (_WRITE_BUFFER_BYTES // per_row) // ch * ch)
    a = r0
    while a < r1:
        b = min(r1, (a // ch) * ch + slab)
        dest = out[a - r0 : b - r0, :width]
        if stored == target or {stored, target} == {"float32", "float64"}:
            # Same type, or float64 <-> float32 which HDF5 converts while reading.
            ds.read_direct(_to_storage(out), np.s_[a:b, c0:c1], np.s_[a - r0 : b - r0, :width])
        elif stored == "bfloat16":
            dest[...] = ds[a:b, c0:c1].view(_BF16).astype(out.dtype)
        else:
            dest[...] = _cast(ds[a:b, c0:c1], target)
        finite = np.isfinite(dest)
        if not finite.all():
            i, j = np.argwhere(~finite)[0]
            src = ds[a + i, c0 + j]
            src_val = src.view(_BF16) if stored == "bfloat16" else src
            raise DatasetError(
                _nonfinite_message(
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
    """Filter the CSR rows r0:r1 down to this rank's columns, reading nonzeros in slabs."""
    c0, c1 = cols.start, cols.stop
    if c1 == c0:
        return sp.csr_matrix((r1 - r0, 0), dtype=np.float64 if target == "float64" else np.float32)
    indptr = g["indptr"][r0 : r1 + 1].astype(np.int64)
    base = int(indptr[0])
    indptr -= base
    total = int(indptr[-1])
    counts = np.zeros(r1 - r0, dtype=np.int64)
    idx_parts, val_parts = [], []
    # SciPy cannot compute with bfloat16, so bf16 values are kept in float32.
    hold = "float32" if target == "bfloat16" else target
    for a in range(0, total, _CSR_SLAB):
        b = min(total, a + _CSR_SLAB)
        idx = g["indices"][base + a : base + b].astype(np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            bad = (idx < 0) | (idx >= n)
            k = a + _first_bad(bad)
            raise DatasetError(
                f"{path}: X/indices[{base + k}] = {idx[k - a]} is outside 0..{n - 1}"
            )
        keep = (idx >= c0) & (idx < c1)
        vals = g["data"][base + a : base + b][keep]
        if stored == "bfloat16":
            vals = vals.view(_BF16)
        vals = _cast(vals, target)
        if target == "bfloat16":
            vals = vals.astype(np.float32)
        pos = np.flatnonzero(keep) + a
        row = np.searchsorted(indptr, pos, side="right") - 1
        finite = np.isfinite(vals)
        if not finite.all():
            k = _first_bad(~finite)
            raise DatasetError(
                _nonfinite_message(
                    path, "X", vals[k], r0 + int(row[k]), int(idx[pos[k] - a]), rank, cols
                )
            )
        counts += np.bincount(row, minlength=r1 - r0)
        idx_parts.append((idx[keep] - c0).astype(np.int32 if c1 - c0 < 2**31 else np.int64))
        val_parts.append(vals.astype(_np_dtype(hold), copy=False))
    local_ptr = np.zeros(r1 - r0 + 1, dtype=np.int64)
    np.cumsum(counts, out=local_ptr[1:])
    indices = np.concatenate(idx_parts) if idx_parts else np.zeros(0, np.int32)
    data = np.concatenate(val_parts) if val_parts else np.zeros(0, _np_dtype(hold))
    return sp.csr_matrix((data, indices, local_ptr), shape=(r1 - r0, c1 - c0))


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
    ``X[rows, column_block(n, size, rank)]``, in row slabs of whole chunks, so memory is about
    ``m * n / size`` elements plus one slab. CSR files are read in slabs of nonzeros and
    filtered to the block (each rank reads all of ``X/indices``, but keeps only its part).

    Parameters
    ----------
    path : path-like
        Dataset file in the layout of ``docs/data.md``.
    comm : mpi4py communicator, optional
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
        a bad ``rows`` slice, or a NaN or infinity in the block (the message names the rank,
        the row and the column).
    """
    target = _dtype_name(dtype)
    rank, size = _rank_size(comm, rank, size)
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
            y = np.empty(r1 - r0, dtype=np.float64)
            f["y"].read_direct(y, np.s_[r0:r1])
            bad = ~np.isfinite(y)
            if bad.any():
                i = _first_bad(bad)
                raise DatasetError(_nonfinite_message(path, "y", y[i], r0 + i, None, rank, cols))
            if info["layout"] == "csr":
                X = _read_csr_block(f["X"], stored, target, r0, r1, fcols, rank, path, n_file)
                if ones:
                    col = sp.csr_matrix(np.ones((r1 - r0, 1), dtype=X.dtype))
                    X = sp.hstack([X, col], format="csr")
            else:
                X = _read_dense_block(f["X"], stored, target, r0, r1, fcols, rank, path, ones)
        task = info["task"] or infer_task(y)
        if task == "binary" and np.all((y == -1) | (y == 1)):
            # Files from other tools may hold {-1, +1}; the trainer expects {0, 1}. Any other
            # domain problem is left to the trainer's check_labels().
            y = (y > 0).astype(np.float64)
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
        errors = comm.allgather(None if error is None else f"{error}")
        failed = [r for r, e in enumerate(errors) if e is not None]
        if error is None and failed:
            who = failed[0]
            raise DatasetError(f"rank {who} failed to load its block: {errors[who]}")
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
            X = X.astype(_BF16)
    return X, part.y


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


@contextmanager
def _atomic_h5(path: Path, **kwargs: Any) -> Iterator[h5py.File]:
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


def _filters(compression: str | None) -> dict[str, Any]:
    if compression is None or compression == "none":
        return {}
    if compression not in ("gzip", "lzf"):
        raise DatasetError(f"unknown compression {compression!r}; expected gzip, lzf or none")
    # Byte shuffling groups the exponent bytes of neighbouring floats, which compress well.
    return {"compression": compression, "shuffle": True}


def _write_common_attrs(
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
    f.attrs["task"] = task
    f.attrs["origin"] = origin
    f.attrs["licence"] = licence
    f.attrs["n_samples"] = m
    f.attrs["n_features"] = n
    for key, value in attrs.items():
        if value is None:
            continue
        f.attrs[key] = value


def _create_dense(
    f: h5py.File, m: int, n: int, dtype: str, chunk_cols: int | None, compression: str | None
) -> h5py.Dataset:
    chunks = chunk_shape(m, n, dtype, chunk_cols)
    storage = _OPAQUE2 if dtype == "bfloat16" else np.dtype(dtype)
    ds = f.create_dataset("X", shape=(m, n), dtype=storage, chunks=chunks, **_filters(compression))
    ds.attrs["optcc_format"] = "dense"
    ds.attrs["optcc_dtype"] = dtype
    return ds


def _create_csr(
    f: h5py.File, m: int, n: int, nnz: int, dtype: str, compression: str | None
) -> h5py.Group:
    g = f.create_group("X")
    g.attrs["optcc_format"] = "csr"
    g.attrs["shape"] = np.array([m, n], dtype=np.int64)
    filt = _filters(compression)
    g.create_dataset(
        "indptr", shape=(m + 1,), dtype=np.int64, chunks=(min(m + 1, 1 << 16),), **filt
    )
    idx_type = np.int32 if n < 2**31 else np.int64
    chunk = (min(max(nnz, 1), 1 << 16),)
    g.create_dataset("indices", shape=(nnz,), dtype=idx_type, chunks=chunk, maxshape=(nnz,), **filt)
    storage = _OPAQUE2 if dtype == "bfloat16" else np.dtype(dtype)
    d = g.create_dataset("data", shape=(nnz,), dtype=storage, chunks=chunk, maxshape=(nnz,), **filt)
    d.attrs["optcc_dtype"] = dtype
    return g


def _create_y(f: h5py.File, m: int, compression: str | None) -> h5py.Dataset:
    return f.create_dataset(
        "y", shape=(m,), dtype=np.float64, chunks=(min(m, 1 << 16),), **_filters(compression)
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
    extra: Mapping[str, Any] | None = None,
    **attrs: Any,
) -> Path:
    """Write in-memory ``X`` and ``y`` as a dataset file (layout version 1).

    Parameters
    ----------
    path : path-like
        Output file; written to a temporary name and renamed, so it appears complete or not
        at all.
    X : array_like of shape (m, n), or scipy.sparse matrix
        Dense arrays are stored dense, sparse matrices as CSR.
    y : array_like of shape (m,)
        Labels, checked with :func:`check_labels` (binary {-1, +1} are stored as {0, 1}).
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
        Unknown task or dtype, shape mismatch, non-finite values, labels outside the task.
    """
    if task not in TASKS:
        raise DatasetError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    for key, value in (("origin", origin), ("licence", licence)):
        if not isinstance(value, str) or not value.strip():
            raise DatasetError(f"{key} must be a non-empty string, got {value!r}")
    name = _dtype_name(dtype)
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
            name = _dtype_name(values.dtype)
        except DatasetError:
            name = "float64"
    y = np.asarray(y)
    if y.ndim != 1 or y.shape[0] != m:
        raise DatasetError(f"shape mismatch: X has {m} rows but y has shape {y.shape}")
    stored = _cast(np.asarray(values), name)
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
    with _atomic_h5(path) as f:
        if sparse:
            g = _create_csr(f, m, n, X.nnz, name, compression)
            g["indptr"][...] = X.indptr.astype(np.int64)
            g["indices"][...] = X.indices.astype(g["indices"].dtype)
            g["data"][...] = _to_storage(stored)
        else:
            ds = _create_dense(f, m, n, name, chunk_cols, compression)
            ds[...] = _to_storage(np.ascontiguousarray(stored))
        _create_y(f, m, compression)[...] = y
        for key, value in (extra or {}).items():
            f.create_dataset(key, data=np.asarray(value), **_filters(compression))
        _write_common_attrs(f, task=task, origin=origin, licence=licence, m=m, n=n, attrs=attrs)
    return path


# --------------------------------------------------------------------------------------------
# LIBSVM / svmlight text
# --------------------------------------------------------------------------------------------

_QID = re.compile(rb"(?<!\S)qid:\S*")


@dataclass
class _Block:
    labels: np.ndarray  # float64, one per row
    counts: np.ndarray  # int64, nonzeros per row
    idx: np.ndarray  # int64 feature indices as written in the file
    val: np.ndarray  # float64 values
    lines: np.ndarray  # int64 line number (1-based) of each row


def _open_text(src: Path) -> tuple[IO[bytes], IO[bytes]]:
    """Open a possibly compressed text file; return (raw file, decompressed stream)."""
    raw = open(src, "rb")  # noqa: SIM115 - closed by the caller
    suffix = src.suffix.lower()
    if suffix == ".gz":
        return raw, gzip.GzipFile(fileobj=raw)
    if suffix == ".bz2":
        return raw, bz2.BZ2File(raw)
    if suffix in (".xz", ".lzma"):
        return raw, lzma.LZMAFile(raw)
    return raw, raw


def _text_blocks(src: Path) -> Iterator[tuple[bytes, int, int]]:
    """Yield (block of whole lines, number of its first line, raw bytes consumed so far)."""
    raw, stream = _open_text(src)
    try:
        carry = b""
        line = 1
        while True:
            chunk = stream.read(_TEXT_BLOCK_BYTES)
            if not chunk:
                break
            chunk = carry + chunk
            cut = chunk.rfind(b"\n")
            if cut < 0:
                carry = chunk
                continue
            block, carry = chunk[: cut + 1], chunk[cut + 1 :]
            yield block, line, raw.tell()
            line += block.count(b"\n")
        if carry:
            yield carry + b"\n", line, raw.tell()
    finally:
        if stream is not raw:
            stream.close()
        raw.close()


def _line_error(src: Path, lineno: int, line: bytes, why: str) -> DatasetError:
    text = line.decode("utf-8", "replace").rstrip("\r\n")
    if len(text) > 120:
        text = text[:117] + "..."
    return DatasetError(f"{src}: line {lineno}: {why}: {text!r}")


def _find_bad_line(block: bytes, first_line: int, src: Path) -> DatasetError:
    """Parse a block line by line, strictly, to name the line the fast parser choked on."""
    number = re.compile(
        r"[+-]?(\d+\.?\d*([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?|inf|nan)", re.IGNORECASE
    )
    for k, line in enumerate(block.split(b"\n")):
        lineno = first_line + k
        body = line.split(b"#", 1)[0]
        try:
            tokens = body.decode("ascii").split()
        except UnicodeDecodeError:
            return _line_error(src, lineno, line, "non-ASCII bytes")
        if not tokens:
            continue
        label = tokens[0]
        if "," in label:
            return _line_error(src, lineno, line, "multi-label lines are not supported")
        if not number.fullmatch(label):
            return _line_error(src, lineno, line, f"cannot parse label {label!r}")
        for tok in tokens[1:]:
            if tok.startswith("qid:"):
                continue
            key, sep, value = tok.partition(":")
            if not sep:
                return _line_error(src, lineno, line, f"expected index:value, got {tok!r}")
            if not key.isdigit():
                return _line_error(src, lineno, line, f"bad feature index {key!r}")
            if not number.fullmatch(value):
                return _line_error(src, lineno, line, f"cannot parse value {value!r}")
    last = first_line + block.count(b"\n") - 1
    return DatasetError(f"{src}: lines {first_line}-{last}: could not parse this svmlight text")


def _parse_block(block: bytes, first_line: int, src: Path) -> _Block:
    """Parse whole lines of svmlight text with vectorised NumPy, validating as it goes.

    Lines are ``label [qid:q] index:value ... [# comment]``. The text is classified byte by
    byte to count tokens and colons per line, every number is parsed in one C call
    (``np.fromstring``), and the label / index / value roles follow from the counts. Anything
    that does not fit sends the block to a strict line-by-line parser that names the line.
    """
    text = block
    if b"#" in text:
        text = b"\n".join(line.split(b"#", 1)[0] for line in text.split(b"\n"))
    if b"qid:" in text:
        text = _QID.sub(b"", text)
    buf = np.frombuffer(text, dtype=np.uint8)
    # Space and every control byte separate tokens (a lookup table is 10x slower). Control
    # bytes other than C's isspace() set then fail np.fromstring and reach the strict parser.
    ws = buf <= 32
    colon = buf == ord(":")
    # Tokens are runs of bytes that are neither space nor colon; a well-formed line has a
    # label and one index and one value per colon, each colon glued to both of them.
    nonsep = ~ws
    nonsep &= ~colon
    starts = np.empty_like(nonsep)
    starts[0] = nonsep[0]
    np.greater(nonsep[1:], nonsep[:-1], out=starts[1:])  # token starts: separator -> byte
    del ws
    cpos = np.flatnonzero(colon)
    if cpos.size and (cpos[0] == 0 or not (nonsep[cpos - 1].all() and nonsep[cpos + 1].all())):
        raise _find_bad_line(block, first_line, src)
    del nonsep
    # Every line, the last included, ends with a newline, so each segment is non-empty and
    # reduceat counts per line without a full-length cumulative sum.
    begins = np.concatenate(([0], np.flatnonzero(buf == ord("\n"))[:-1] + 1))
    ntok = np.add.reduceat(starts, begins, dtype=np.int32).astype(np.int64)
    ncol = np.add.reduceat(colon, begins, dtype=np.int32).astype(np.int64)
    del starts, colon
    rows = ntok > 0
    bad = rows & (ntok != 1 + 2 * ncol)
    if bad.any():
        raise _find_bad_line(block, first_line, src)
    ntok, ncol = ntok[rows], ncol[rows]
    lines = np.flatnonzero(rows).astype(np.int64) + first_line
    expected = int(ntok.sum())
    if expected == 0:
        empty = np.zeros(0)
        return _Block(empty, np.zeros(0, np.int64), empty, empty, lines)
    try:
        numbers = np.fromstring(text.replace(b":", b" "), dtype=np.float64, sep=" ")
    except ValueError:
        raise _find_bad_line(block, first_line, src) from None
    if numbers.size != expected:
        raise _find_bad_line(block, first_line, src)
    label_pos = np.concatenate(([0], np.cumsum(ntok)[:-1]))
    labels = numbers[label_pos]
    is_pair = np.ones(expected, dtype=bool)
    is_pair[label_pos] = False
    pairs = numbers[is_pair].reshape(-1, 2)
    del numbers, is_pair
    counts = ncol
    idx, val = pairs[:, 0], pairs[:, 1]
    row_start = np.cumsum(counts) - counts  # position of each row's first pair

    def fail(pair: int | None, why: str, row: int | None = None) -> DatasetError:
        if row is None:
            row = int(np.searchsorted(row_start, pair, side="right") - 1)
        k = int(lines[row]) - first_line
        return _line_error(src, int(lines[row]), block.split(b"\n")[k], why)

    badlab = ~np.isfinite(labels)
    if badlab.any():
        r = _first_bad(badlab)
        raise fail(None, f"label {labels[r]} is not finite", row=r)
    badidx = (idx < 0) | (idx != np.floor(idx)) | (idx >= 2**62)
    if badidx.any():
        k = _first_bad(badidx)
        raise fail(k, f"feature index {idx[k]:g} is not a non-negative integer")
    badval = ~np.isfinite(val)
    if badval.any():
        k = _first_bad(badval)
        raise fail(k, f"feature value {val[k]} is not finite")
    if idx.size > 1:
        unsorted = idx[1:] <= idx[:-1]
        first = row_start[(row_start > 0) & (counts > 0)]
        unsorted[first - 1] = False  # a row's first index is not compared with the last row
        if unsorted.any():
            k = _first_bad(unsorted) + 1
            raise fail(
                k,
                f"feature indices must be strictly increasing (index {idx[k]:g} follows "
                f"{idx[k - 1]:g})",
            )
    return _Block(labels, counts, idx.astype(np.int64), val, lines)


@dataclass
class _Scan:
    rows: int = 0
    nnz: int = 0
    min_idx: int | None = None
    max_idx: int | None = None
    zero_line: int | None = None
    max_line: int | None = None
    not01: tuple[int, float] | None = None
    notpm1: tuple[int, float] | None = None
    notcount: tuple[int, float] | None = None
    bytes_text: int = 0

    def add(self, blk: _Block) -> None:
        self.rows += blk.labels.size
        self.nnz += blk.idx.size
        if blk.idx.size:
            lo, hi = int(blk.idx.min()), int(blk.idx.max())
            row_of = np.repeat(np.arange(blk.counts.size), blk.counts)
            if lo == 0 and self.zero_line is None:
                self.zero_line = int(blk.lines[row_of[_first_bad(blk.idx == 0)]])
            if self.max_idx is None or hi > self.max_idx:
                self.max_idx = hi
                self.max_line = int(blk.lines[row_of[int(np.argmax(blk.idx))]])
            self.min_idx = lo if self.min_idx is None else min(self.min_idx, lo)
        y = blk.labels
        for attr, bad in (
            ("not01", (y != 0) & (y != 1)),
            ("notpm1", (y != -1) & (y != 1)),
            ("notcount", (y < 0) | (y != np.floor(y))),
        ):
            if getattr(self, attr) is None and bad.any():
                r = _first_bad(bad)
                setattr(self, attr, (int(blk.lines[r]), float(y[r])))


def _check_unchanged(src: Path, rows: int, expected: int, final: bool = False) -> None:
    """Stop if the second pass sees other rows than the first (the file changed meanwhile)."""
    if rows > expected or (final and rows != expected):
        raise DatasetError(
            f"{src}: the file changed during conversion ({expected} rows in the first pass, "
            f"{'at least ' if not final else ''}{rows} in the second)"
        )


def _decide_task(scan: _Scan, task: str | None, src: Path) -> tuple[str, str | None]:
    """Return (task, label encoding note), checking forced tasks against the labels seen."""
    if task is None:
        if scan.not01 is None or scan.notpm1 is None:
            task = "binary"
        elif scan.notcount is None:
            task = "counts"
        else:
            task = "regression"
    elif task not in TASKS:
        raise DatasetError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if task == "binary":
        if scan.not01 is None:
            return task, None
        if scan.notpm1 is None:
            return task, "{-1,+1} -> {0,1}"
        (l1, v1), (l2, v2) = scan.not01, scan.notpm1
        raise DatasetError(
            f"{src}: task 'binary' needs labels all in {{0, 1}} or all in {{-1, +1}}: line "
            f"{l1} has label {v1:g}, line {l2} has label {v2:g}"
        )
    if task == "counts" and scan.notcount is not None:
        line, v = scan.notcount
        raise DatasetError(
            f"{src}: task 'counts' needs non-negative integer labels: line {line} has {v:g}"
        )
    return task, None


def convert_svmlight(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype: Any = "float32",
    layout: str = "auto",
    task: str | None = None,
    zero_based: bool | str = "auto",
    n_features: int | None = None,
    progress: bool = True,
    compression: str | None = None,
    chunk_cols: int | None = None,
    origin: str | None = None,
    licence: str | None = None,
) -> dict[str, Any]:
    """Convert LIBSVM/svmlight text to a dataset file, streaming in bounded memory.

    Two passes over the text. The first parses and validates every line and collects the row
    count, feature index range, nonzero count and label set, so errors surface before the
    output is created. The second parses again and writes ``X`` in whole chunk rows (dense) or
    appends to the CSR arrays, into a temporary file renamed to ``dst`` at the end. Memory is
    a few times the 8 MiB text block plus, for dense output, one row of chunks (at most
    64 MiB; :func:`chunk_shape`), whatever the file size.

    Parameters
    ----------
    src : path-like
        Text file, optionally compressed (``.gz``, ``.bz2``, ``.xz``). Lines are
        ``label [qid:n] index:value ...`` with strictly increasing indices; ``#`` starts a
        comment; blank lines are skipped; ``qid`` is ignored.
    dst : path-like
        Output HDF5 file.
    dtype : {'float32', 'float64', 'bfloat16'}
        Stored type of ``X``; bfloat16 is rounded to nearest even from the parsed float64.
    layout : {'auto', 'dense', 'csr'}
        'auto' stores dense when at least 25% of the entries are nonzero, else CSR.
    task : {None, 'binary', 'regression', 'counts'}
        None detects it: binary if labels are all in {0, 1} or all in {-1, +1} (the latter
        stored as {0, 1}), counts if all are non-negative integers, else regression.
    zero_based : {'auto', True, False}
        Whether index 0 is the first feature. 'auto': zero-based if any index 0 occurs, else
        one-based (LIBSVM's usual convention).
    n_features : int, optional
        Number of columns, at least the largest index seen (a test set may lack the last
        features of its training set).
    progress : bool
        Draw a progress bar on standard error.
    compression : {None, 'gzip', 'lzf'}
        HDF5 compression filter.
    chunk_cols : int, optional
        Chunk width for dense output (:func:`chunk_shape`).
    origin, licence : str, optional
        File attributes; default to the source file name and 'unknown (not recorded)'.

    Returns
    -------
    dict
        ``path``, ``rows``, ``n_features``, ``nnz``, ``density``, ``layout``, ``dtype``,
        ``task``, ``zero_based``, ``label_encoding``, ``seconds``, ``text_bytes``,
        ``rows_per_second``.

    Raises
    ------
    FileNotFoundError
        ``src`` does not exist.
    DatasetError
        A line that does not parse (its line number and text are in the message), labels that
        do not fit a forced task, an ``n_features`` smaller than the indices, unknown options.
    """
    t0 = time.perf_counter()
    name = _dtype_name(dtype)
    if layout not in ("auto", "dense", "csr"):
        raise DatasetError(f"unknown layout {layout!r}; expected auto, dense or csr")
    if zero_based not in ("auto", True, False):
        raise DatasetError(f"zero_based must be 'auto', True or False, got {zero_based!r}")
    if task is not None and task not in TASKS:
        raise DatasetError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    _filters(compression)
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise FileNotFoundError(f"svmlight file not found: {src}")
    total = src.stat().st_size

    scan = _Scan()
    with Progress(total, "convert 1/2 scan", enabled=progress, unit="B") as bar:
        done = 0
        for block, line, pos in _text_blocks(src):
            scan.add(_parse_block(block, line, src))
            scan.bytes_text += len(block)
            bar.update(pos - done, postfix=f"{scan.rows} rows")
            done = pos
    if scan.rows == 0:
        raise DatasetError(f"{src}: no data lines")
    task, encoding = _decide_task(scan, task, src)
    if zero_based == "auto":
        zero_based = scan.zero_line is not None
    elif zero_based is False and scan.zero_line is not None:
        raise DatasetError(
            f"{src}: line {scan.zero_line}: feature index 0 in a file declared one-based"
        )
    shift = 0 if zero_based else 1
    needed = 0 if scan.max_idx is None else scan.max_idx + 1 - shift
    if n_features is None:
        n = needed
    else:
        n = int(n_features)
        if n < needed:
            raise DatasetError(
                f"n_features={n} is smaller than the file needs: line {scan.max_line} has "
                f"feature index {scan.max_idx} ({'zero' if zero_based else 'one'}-based), "
                f"so at least {needed} columns"
            )
    if n < 1:
        raise DatasetError(f"{src}: no features (every line has only a label)")
    m, nnz = scan.rows, scan.nnz
    density = nnz / (m * n)
    if layout == "auto":
        layout = "dense" if density >= _DENSE_MIN_DENSITY else "csr"

    def labels(blk: _Block) -> np.ndarray:
        return (blk.labels > 0).astype(np.float64) if encoding else blk.labels

    attrs = {
        "source_file": src.name,
        "zero_based": bool(zero_based),
        "label_encoding": encoding,
    }
    with (
        _atomic_h5(dst, rdcc_nbytes=16 << 20) as f,
        Progress(m, "convert 2/2 write", enabled=progress, unit="rows") as bar,
    ):
        ydset = _create_y(f, m, compression)
        r = 0
        if layout == "dense":
            ds = _create_dense(f, m, n, name, chunk_cols, compression)
            ch = ds.chunks[0]
            buf = np.zeros((min(ch, m), n), dtype=_np_dtype(name))
            filled = 0  # rows of buf in use; buf holds global rows r - filled .. r
            for block, line, _ in _text_blocks(src):
                blk = _parse_block(block, line, src)
                _check_unchanged(src, r + blk.labels.size, m)
                ydset[r : r + blk.labels.size] = labels(blk)
                offsets = np.concatenate(([0], np.cumsum(blk.counts)))
                i = 0
                while i < blk.labels.size:
                    take = min(blk.labels.size - i, buf.shape[0] - filled)
                    a, b = offsets[i], offsets[i + take]
                    local = np.repeat(np.arange(filled, filled + take), blk.counts[i : i + take])
                    buf[local, blk.idx[a:b] - shift] = _cast(blk.val[a:b], name)
                    filled += take
                    i += take
                    r += take
                    if filled == buf.shape[0] or r == m:
                        ds[r - filled : r] = _to_storage(buf[:filled])
                        buf[:filled] = 0
                        filled = 0
                bar.update(blk.labels.size)
        else:
            g = _create_csr(f, m, n, nnz, name, compression)
            k = 0
            g["indptr"][0] = 0
            for block, line, _ in _text_blocks(src):
                blk = _parse_block(block, line, src)
                size = blk.labels.size
                _check_unchanged(src, r + size, m)
                ydset[r : r + size] = labels(blk)
                g["indptr"][r + 1 : r + 1 + size] = k + np.cumsum(blk.counts)
                g["indices"][k : k + blk.idx.size] = blk.idx - shift
                g["data"][k : k + blk.idx.size] = _to_storage(_cast(blk.val, name))
                k += blk.idx.size
                r += size
                bar.update(size)
        _check_unchanged(src, r, m, final=True)
        _write_common_attrs(
            f,
            task=task,
            origin=origin or f"converted from svmlight file {src.name}",
            licence=licence or "unknown (not recorded at conversion)",
            m=m,
            n=n,
            attrs=attrs,
        )
    seconds = time.perf_counter() - t0
    return {
        "path": str(dst),
        "rows": m,
        "n_features": n,
        "nnz": nnz,
        "density": density,
        "layout": layout,
        "dtype": name,
        "task": task,
        "zero_based": bool(zero_based),
        "label_encoding": encoding,
        "seconds": seconds,
        "text_bytes": scan.bytes_text,
        "rows_per_second": m / seconds if seconds > 0 else float("inf"),
    }


# --------------------------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------------------------


def _synth_block(
    kind: str, seed: int, block: int, rows: int, n: int, w: np.ndarray, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of generator block ``block``: X in dtype ``name`` and y from the stored X."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(1, block))))
    X = _cast(rng.standard_normal((rows, n)) / np.sqrt(n), name)
    # Labels come from the values as stored (rounded), so w_true is exactly the parameter
    # that generated the data a trainer reads.
    z = X.astype(np.float64) @ w
    if kind == "logistic":
        y = (rng.random(rows) < 1.0 / (1.0 + np.exp(-z))).astype(np.float64)
    elif kind == "linear":
        y = z + 0.1 * rng.standard_normal(rows)
    else:
        y = rng.poisson(np.exp(0.5 * z)).astype(np.float64)
    return X, y


def _synth_weights(seed: int, n: int) -> np.ndarray:
    """``w*`` of the synthetic generator: its own random stream, independent of the rows."""
    return np.random.Generator(
        np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(0,)))
    ).standard_normal(n)


def synth_arrays(
    kind: str, rows: int, cols: int, seed: int, *, dtype: Any = "float32"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The synthetic dataset of :func:`synth`, in memory: ``(X, y, w_true)``.

    The same (kind, rows, cols, seed, dtype) give exactly the arrays that :func:`synth`
    writes, so benchmarks can work on data of any size without files.
    """
    if kind not in SYNTH_KINDS:
        raise DatasetError(f"unknown kind {kind!r}; expected one of {', '.join(SYNTH_KINDS)}")
    name = _dtype_name(dtype)
    m, n, seed = int(rows), int(cols), int(seed)
    w = _synth_weights(seed, n)
    X = np.empty((m, n), dtype=_np_dtype(name))
    y = np.empty(m)
    for a in range(0, m, _SYNTH_BLOCK):
        k = min(_SYNTH_BLOCK, m - a)
        X[a : a + k], y[a : a + k] = _synth_block(kind, seed, a // _SYNTH_BLOCK, k, n, w, name)
    return X, y, w


def synth(
    kind: str,
    rows: int,
    cols: int,
    seed: int,
    path: str | os.PathLike,
    *,
    dtype: Any = "float32",
    chunk_rows: int = 65536,
    progress: bool = True,
    compression: str | None = None,
) -> Path:
    """Write a synthetic GLM dataset, generated and written in row chunks.

    The generator is ours (not from a paper): ``X_ij ~ N(0, 1/n)`` i.i.d. dense,
    ``w* ~ N(0, I_n)``, and

    * ``logistic``: ``y_i ~ Bernoulli(sigmoid(x_i . w*))`` (task binary, labels {0, 1});
    * ``linear``: ``y_i = x_i . w* + 0.1 * N(0, 1)`` (task regression);
    * ``poisson``: ``y_i ~ Poisson(exp(0.5 * x_i . w*))`` (task counts).

    With this scaling the margins ``x_i . w*`` are about N(0, 1). Labels are drawn from the
    stored (rounded) ``X``; ``w*`` is stored as dataset ``w_true`` (float64). ``w*`` comes from
    one random stream and each block of 1024 rows from its own stream (NumPy ``SeedSequence``
    with ``spawn_key``), so the file depends on (kind, rows, cols, seed, dtype) only, not on
    ``chunk_rows``.

    Parameters
    ----------
    kind : {'logistic', 'linear', 'poisson'}
    rows, cols : int
        Shape of ``X``.
    seed : int
        Non-negative seed.
    path : path-like
        Output file (written to a temporary name and renamed).
    dtype : {'float32', 'float64', 'bfloat16'}
        Stored type of ``X``; values are drawn in float64 and rounded once.
    chunk_rows : int
        Most rows generated per write; rounded to whole chunk rows and 1024-row blocks, and
        capped so the write buffer stays within 64 MiB (memory is that buffer plus one
        1024-row block in float64).
    progress : bool
        Draw a progress bar on standard error.
    compression : {None, 'gzip', 'lzf'}

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    if kind not in SYNTH_KINDS:
        raise DatasetError(f"unknown kind {kind!r}; expected one of {', '.join(SYNTH_KINDS)}")
    name = _dtype_name(dtype)
    m, n, seed = int(rows), int(cols), int(seed)
    if m < 1 or n < 1:
        raise DatasetError(f"rows and cols must be positive, got {m} x {n}")
    if seed < 0:
        raise DatasetError(f"seed must be non-negative, got {seed}")
    _filters(compression)
    w = _synth_weights(seed, n)
    path = Path(path)
    ch = chunk_shape(m, n, name)[0]
    # Rows per write: whole generator blocks and whole chunk rows (both powers of two, so
    # max() is a multiple of the other), within chunk_rows and the 64 MiB write buffer.
    unit = max(ch, _SYNTH_BLOCK)
    limit = min(int(chunk_rows), _WRITE_BUFFER_BYTES // (n * _itemsize(name)))
    batch = min(max(unit, limit // unit * unit), -(-m // _SYNTH_BLOCK) * _SYNTH_BLOCK)
    buf = np.empty((batch, n), dtype=_np_dtype(name))
    ybuf = np.empty(batch)
    with (
        _atomic_h5(path, rdcc_nbytes=16 << 20) as f,
        Progress(m, f"synth {kind}", enabled=progress, unit="rows") as bar,
    ):
        ds = _create_dense(f, m, n, name, None, compression)
        ydset = _create_y(f, m, compression)
        for r0 in range(0, m, batch):
            rows_here = min(batch, m - r0)
            # Each 1024-row block is drawn in float64 and rounded straight into the buffer,
            # so the float64 temporaries stay at one block.
            for a in range(0, rows_here, _SYNTH_BLOCK):
                k = min(_SYNTH_BLOCK, rows_here - a)
                block = (r0 + a) // _SYNTH_BLOCK
                buf[a : a + k], ybuf[a : a + k] = _synth_block(kind, seed, block, k, n, w, name)
            ds[r0 : r0 + rows_here] = _to_storage(buf[:rows_here])
            ydset[r0 : r0 + rows_here] = ybuf[:rows_here]
            bar.update(rows_here)
        f.create_dataset("w_true", data=w)
        _write_common_attrs(
            f,
            task=SYNTH_KINDS[kind],
            origin=(
                f"synthetic, optcc_mpi.data.synth(kind={kind!r}, rows={m}, cols={n}, "
                f"seed={seed}, dtype={name!r}); generator v{SYNTH_VERSION} (ours): X_ij ~ "
                "N(0, 1/n), w* ~ N(0, I), see docs/data.md"
            ),
            licence="CC0-1.0 (synthetic data, no rights reserved)",
            m=m,
            n=n,
            attrs={"synth_kind": kind, "synth_seed": seed, "synth_version": SYNTH_VERSION},
        )
    return path


# --------------------------------------------------------------------------------------------
# Default and shipped datasets
# --------------------------------------------------------------------------------------------


def data_home() -> Path:
    """Cache folder for generated datasets: ``$OPTCC_DATA_HOME`` or ``~/.cache/optcc_mpi``."""
    env = os.environ.get("OPTCC_DATA_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "optcc_mpi"


def _default_path() -> Path:
    s = DEFAULT_SYNTH
    return data_home() / (
        f"synth-{s['kind']}-{s['rows']}x{s['cols']}-seed{s['seed']}-{s['dtype']}"
        f"-v{SYNTH_VERSION}.h5"
    )


def _is_current(path: Path) -> bool:
    """True if ``path`` is a readable default dataset made by this generator version."""
    try:
        with h5py.File(path, "r") as f:
            a = f.attrs
            return int(a.get("synth_version", -1)) == SYNTH_VERSION and f["X"].shape == (
                DEFAULT_SYNTH["rows"],
                DEFAULT_SYNTH["cols"],
            )
    except (OSError, KeyError):
        return False


def _ensure_default(path: Path) -> None:
    if not _is_current(path):
        s = DEFAULT_SYNTH
        synth(s["kind"], s["rows"], s["cols"], s["seed"], path, dtype=s["dtype"], progress=False)


def default_dataset(comm: Any = None) -> Path:
    """Return the default synthetic dataset, creating it in the cache on first use.

    The set is ``synth(**DEFAULT_SYNTH)`` (logistic, 32768 x 256, seed 0, float32; 32 MiB) in
    :func:`data_home`. With a communicator, rank 0 creates it (under a temporary name, then an
    atomic rename) while the others wait for rank 0's broadcast of the outcome; a rank that
    still cannot see the file afterwards (a node-local cache folder) creates its own copy,
    which is identical because the generator is deterministic.

    Parameters
    ----------
    comm : mpi4py communicator, optional
        Collective over ``comm`` when given.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    RuntimeError
        Rank 0 could not create the file (raised on every rank).
    """
    path = _default_path()
    if comm is None:
        _ensure_default(path)
        return path
    error = None
    if comm.Get_rank() == 0:
        try:
            _ensure_default(path)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = f"{type(exc).__name__}: {exc}"
    error = comm.bcast(error, root=0)
    if error is not None:
        raise RuntimeError(f"rank 0 could not create the default dataset {path}: {error}")
    if not path.exists():
        _ensure_default(path)
    return path


def _repo_data_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "data"


def shipped(name: str) -> Path:
    """Return the path of a real dataset shipped in the repository's ``data/`` folder.

    Parameters
    ----------
    name : {'breast_cancer', 'diabetes', 'randhie'}

    Returns
    -------
    pathlib.Path

    Raises
    ------
    DatasetError
        Unknown name.
    FileNotFoundError
        The file is absent (e.g. optcc_mpi installed from a wheel, which does not carry
        ``data/``).
    """
    if name not in SHIPPED:
        known = ", ".join(SHIPPED)
        raise DatasetError(f"unknown shipped dataset {name!r}; expected one of {known}")
    path = _repo_data_dir() / f"{name}.h5"
    if not path.is_file():
        raise FileNotFoundError(
            f"shipped dataset {name!r} not found at {path}; the files live in the source "
            "repository's data/ folder (regenerate with data/make_datasets.py)"
        )
    return path
