"""The file layout: format constants and versions, element types, blocks and chunks.

What a dataset file holds is specified in ``docs/data.md``; this module holds the names and
numbers that specification fixes (the layout version, the element types, the CSC copy's
name; the tasks a file may declare, :data:`TASKS`, come with their label rules from
:mod:`optcc_mpi.labels`) and the small pure helpers every other module of
:mod:`optcc_mpi.data` shares: dtype names and casts, the 1D block-column split
(:func:`column_block`) and the chunk policy (:func:`chunk_shape`).

Only ``__all__`` is re-exported by :mod:`optcc_mpi.data`. The other names without a leading
underscore (:func:`storage_dtype_name`, :func:`numpy_dtype`, :func:`cast_to`, :func:`storage_view`,
:func:`first_true` ...) are the helpers the package's modules share: public to them, not part
of the package's API.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from optcc_mpi.errors import DatasetError
from optcc_mpi.labels import TASKS

__all__ = [
    "LAYOUT_VERSION",
    "LAYOUT_MINOR",
    "TASKS",
    "DTYPES",
    "CSC_COPY",
    "column_block",
    "chunk_shape",
]

#: Major version of the file layout (file attribute ``optcc_layout``). Readers refuse a file
#: with a larger major version: it may store ``X`` or ``y`` in a way they would misread.
LAYOUT_VERSION = 1
#: Minor version this package writes (file attribute ``optcc_layout_minor``; absent = 0).
#: A minor version only adds what older readers of the same major version may ignore:
#: 1 adds the column-compressed copy ``X_csc`` of a CSR ``X`` and HDF5 fletcher32 checksums.
LAYOUT_MINOR = 1
#: Logical element types of ``X``.
DTYPES = ("float64", "float32", "bfloat16")
#: Name of the group holding the column-compressed (CSC) copy of a CSR ``X`` (layout 1.1).
CSC_COPY = "X_csc"

# Chunk policy (see chunk_shape): target bytes of one chunk, and the most bytes a writer
# buffers for one full row of chunks.
_CHUNK_BYTES = 1 << 20
WRITE_BUFFER_BYTES = 64 << 20
# Widest chunk, in columns. Measured on 200,000 x 256 float32 (docs/data.md): 8-column chunks
# read column blocks 2-5x faster than 1-column chunks, and wider ones waste I/O at block edges.
_MAX_CHUNK_COLS = 8
# Elements per chunk of the one-dimensional sparse arrays (indptr, indices, data). A rank
# reading a contiguous range reads at most two partly-used chunks per array, 256 KiB each for
# 4-byte elements: small against any block worth distributing.
SPARSE_CHUNK = 1 << 16

BF16 = np.dtype(ml_dtypes.bfloat16)
OPAQUE2 = np.dtype("V2")
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


def storage_dtype_name(dtype: Any) -> str | None:
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
    if dt == BF16:
        return "bfloat16"
    if dt in (np.dtype(np.float64), np.dtype(np.float32)):
        return dt.name
    raise DatasetError(f"unknown dtype {dt.name!r}; expected one of {', '.join(DTYPES)}")


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a canonical dtype name (bfloat16 from ml_dtypes)."""
    return BF16 if name == "bfloat16" else np.dtype(name)


def itemsize_of(name: str) -> int:
    """Bytes per element of a canonical dtype name."""
    return numpy_dtype(name).itemsize


def storage_view(a: np.ndarray) -> np.ndarray:
    """View a bf16 array as the opaque 2-byte type h5py writes; other arrays unchanged."""
    return a.view(OPAQUE2) if a.dtype == BF16 else a


def cast_to(a: np.ndarray, name: str) -> np.ndarray:
    """Cast to dtype ``name``. float64 -> bfloat16 rounds once, to nearest even (ml_dtypes).

    Overflow gives infinities without a warning: callers check finiteness and report it.
    """
    with np.errstate(over="ignore"):
        return a.astype(numpy_dtype(name), copy=False)


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
    item = itemsize_of(storage_dtype_name(dtype) or "float32")
    m, n = max(1, int(n_rows)), max(1, int(n_cols))
    if chunk_cols is None:
        cw = min(_MAX_CHUNK_COLS, _pow2_floor(n // 64))
    else:
        cw = int(chunk_cols)
        if cw < 1:
            raise DatasetError(f"chunk_cols must be at least 1, got {chunk_cols}")
    cw = min(cw, n)
    ch = _pow2_floor(min(_CHUNK_BYTES // (cw * item), WRITE_BUFFER_BYTES // (n * item)))
    return min(ch, m), cw


def first_true(mask: np.ndarray) -> int:
    """Index of the first True in a boolean array (the caller knows there is one)."""
    return int(np.flatnonzero(mask)[0])


def attr_value(v: Any) -> Any:
    """Decode an HDF5 attribute into a plain Python value."""
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.ndarray):
        if v.dtype.kind in "OSU":
            return [attr_value(x) for x in v.tolist()]
        return v
    if isinstance(v, np.generic):
        return v.item()
    return v


def largest_finite(name: str) -> float:
    """Largest finite value of dtype ``name``: values beyond it round to infinity."""
    return float(ml_dtypes.finfo(numpy_dtype(name)).max)
