"""Synthetic GLM problems of any size, in memory, for tests and benchmarks.

The generator is :func:`optcc_mpi.data.synth_arrays` (ours; see its docstring): the same
seed gives the same problem on every rank, and exactly the data ``optcc-mpi data synth``
writes to a file.
"""

from __future__ import annotations

import numpy as np

from ..data import DatasetError, synth_arrays
from ..errors import ArgumentError

__all__ = ["make_glm_data"]


def make_glm_data(
    model: str, m: int, n: int, seed: int = 0, *, dtype: str = "float32"
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(X, y)``: an ``(m, n)`` matrix in ``dtype`` and float64 labels.

    Parameters
    ----------
    model : str
        ``logistic``, ``linear`` or ``poisson``.
    m, n : int
        Rows and columns.
    seed : int
        Seed; the same seed gives the same problem on every rank.
    dtype : str
        dtype of X.
    """
    try:
        X, y, _ = synth_arrays(model, m, n, seed, dtype=dtype)
    except DatasetError as exc:
        raise ArgumentError(str(exc)) from None
    return X, y
