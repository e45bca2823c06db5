"""The svmlight converter streams: its peak memory does not grow with the input.

Peak memory is measured with :mod:`tracemalloc` (Python objects and NumPy arrays; HDF5's own
chunk cache is fixed at 16 MiB and not traced). The converter's block sizes are made tiny so
that the bounded parts (a text block, one column band of the CSC copy) are small and any
part growing with the input would dominate: a 4x larger input must not need more than a few
percent more memory (the dense write buffer, one row of chunks, is made small too).
``docs/data.md`` has the resident-set measurements at full block sizes.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from optcc_mpi import data
from optcc_mpi.data import svmlight, writing


def _text(path: Path, rows: int, n: int = 1000, k: int = 20, seed: int = 0) -> int:
    """Write ``rows`` lines of k nonzeros over n features; return the file size."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as fh:
        for a in range(0, rows, 1000):
            r = min(1000, rows - a)
            idx = np.sort(rng.random((r, n)).argpartition(k, axis=1)[:, :k], axis=1) + 1
            val = rng.standard_normal((r, k))
            lab = rng.integers(0, 2, r)
            fh.write(
                "".join(
                    f"{lab[i]} " + " ".join(f"{j}:{v:.6g}" for j, v in zip(idx[i], val[i])) + "\n"
                    for i in range(r)
                )
            )
    return path.stat().st_size


def _peak(src: Path, dst: Path, layout: str) -> tuple[int, dict]:
    tracemalloc.start()
    try:
        summary = data.convert_svmlight(src, dst, layout=layout, progress=False)
        return tracemalloc.get_traced_memory()[1], summary
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    folder = tmp_path_factory.mktemp("memory")
    small, large = folder / "small.svm", folder / "large.svm"
    _text(small, 4000)
    size = _text(large, 16000, seed=1)
    return small, large, size


@pytest.mark.parametrize("layout", ["csr", "dense"])
def test_converter_peak_memory_is_flat_in_input_size(
    tmp_path: Path, monkeypatch, inputs, layout: str
) -> None:
    monkeypatch.setattr(svmlight, "_TEXT_BLOCK_BYTES", 64 << 10)
    monkeypatch.setattr(writing, "_CSC_BAND_BYTES", 64 << 10)
    # The dense writer buffers one row of chunks (at most 64 MiB); make it 1 MiB, so both
    # inputs have many chunk rows.
    monkeypatch.setattr(data.layout, "WRITE_BUFFER_BYTES", 1 << 20)
    small, large, size = inputs
    # Import everything the converter imports before measuring, so both runs start equal.
    _peak(small, tmp_path / "warm.h5", layout)
    p_small, s_small = _peak(small, tmp_path / "small.h5", layout)
    p_large, s_large = _peak(large, tmp_path / "large.h5", layout)
    assert s_large["rows"] == 4 * s_small["rows"] == 64000 // 4
    if layout == "csr":
        assert s_large["csc"] is True  # the CSC copy is built, in bands, from a spill
        # The whole input never is in memory: the peak is a small part of it.
        assert p_large < size / 4, (p_large, size)
    assert p_large <= 1.15 * p_small + (64 << 10), (p_small, p_large)
    # and the output is complete
    X, _ = data.load_dense(tmp_path / "large.h5")
    assert X.shape == (16000, 1000) and np.count_nonzero(X) == 16000 * 20
