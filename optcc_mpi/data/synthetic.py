"""Synthetic GLM datasets: a deterministic generator, in memory or written in row chunks.

The generator is ours (not from a paper): ``X_ij ~ N(0, 1/n)`` i.i.d. dense,
``w* ~ N(0, I_n)``, and logistic, linear or Poisson labels drawn from the stored (rounded)
``X``. :func:`synth_arrays` returns the arrays; :func:`synth` writes exactly the same numbers
to a file in bounded memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from optcc_mpi.errors import DatasetError
from optcc_mpi.progress import Progress

from .layout import (
    WRITE_BUFFER_BYTES,
    cast_to,
    chunk_shape,
    itemsize_of,
    numpy_dtype,
    storage_dtype_name,
    storage_view,
)
from .writing import atomic_h5, create_dense, create_y, h5_filters, write_common_attrs

__all__ = ["SYNTH_KINDS", "SYNTH_VERSION", "synth", "synth_arrays"]

#: Synthetic generators and the task each one produces.
SYNTH_KINDS = {"logistic": "binary", "linear": "regression", "poisson": "counts"}
# Generator version, stored with every synthetic file. Bump it whenever synth() would produce
# different numbers for the same arguments, so stale cached default datasets get rebuilt.
SYNTH_VERSION = 1
# Rows drawn from one independent random stream in synth(). Fixed, so the data depend only on
# (kind, rows, cols, seed, dtype) and not on how many rows are written at a time.
_SYNTH_BLOCK = 1024


def _synth_block(
    kind: str, seed: int, block: int, rows: int, n: int, w: np.ndarray, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of generator block ``block``: X in dtype ``name`` and y from the stored X."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(1, block))))
    X = cast_to(rng.standard_normal((rows, n)) / np.sqrt(n), name)
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
    name = storage_dtype_name(dtype)
    m, n, seed = int(rows), int(cols), int(seed)
    w = _synth_weights(seed, n)
    X = np.empty((m, n), dtype=numpy_dtype(name))
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
    checksum: bool = True,
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
    checksum : bool
        Store a fletcher32 checksum with every chunk (verified on every read).

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    if kind not in SYNTH_KINDS:
        raise DatasetError(f"unknown kind {kind!r}; expected one of {', '.join(SYNTH_KINDS)}")
    name = storage_dtype_name(dtype)
    m, n, seed = int(rows), int(cols), int(seed)
    if m < 1 or n < 1:
        raise DatasetError(f"rows and cols must be positive, got {m} x {n}")
    if seed < 0:
        raise DatasetError(f"seed must be non-negative, got {seed}")
    h5_filters(compression)
    w = _synth_weights(seed, n)
    path = Path(path)
    ch = chunk_shape(m, n, name)[0]
    # Rows per write: whole generator blocks and whole chunk rows (both powers of two, so
    # max() is a multiple of the other), within chunk_rows and the 64 MiB write buffer.
    unit = max(ch, _SYNTH_BLOCK)
    limit = min(int(chunk_rows), WRITE_BUFFER_BYTES // (n * itemsize_of(name)))
    batch = min(max(unit, limit // unit * unit), -(-m // _SYNTH_BLOCK) * _SYNTH_BLOCK)
    buf = np.empty((batch, n), dtype=numpy_dtype(name))
    ybuf = np.empty(batch)
    with (
        atomic_h5(path, rdcc_nbytes=16 << 20) as f,
        Progress(m, f"synth {kind}", enabled=progress, unit="rows") as bar,
    ):
        ds = create_dense(f, m, n, name, None, compression, checksum)
        ydset = create_y(f, m, compression, checksum)
        for r0 in range(0, m, batch):
            rows_here = min(batch, m - r0)
            # Each 1024-row block is drawn in float64 and rounded straight into the buffer,
            # so the float64 temporaries stay at one block.
            for a in range(0, rows_here, _SYNTH_BLOCK):
                k = min(_SYNTH_BLOCK, rows_here - a)
                block = (r0 + a) // _SYNTH_BLOCK
                buf[a : a + k], ybuf[a : a + k] = _synth_block(kind, seed, block, k, n, w, name)
            ds[r0 : r0 + rows_here] = storage_view(buf[:rows_here])
            ydset[r0 : r0 + rows_here] = ybuf[:rows_here]
            bar.update(rows_here)
        f.create_dataset("w_true", data=w, **h5_filters(compression, checksum))
        write_common_attrs(
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
