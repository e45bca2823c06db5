"""The compiled call path's pieces that need no second rank (``optcc_mpi.check.fastcall``)."""

from __future__ import annotations

import numpy as np
import pytest

from optcc_mpi import communicators, config, dtypes
from optcc_mpi.check import fastcall, protocol


def test_the_install_built_it() -> None:
    assert fastcall.available(), "make install builds optcc_mpi/check/_fastcall.c"
    assert callable(fastcall.fold_function())
    # Bound once, at the first call over MPI that can use it (test_fastcall_mpi.py).
    assert communicators._STATES.fold in (None, fastcall.fold_function())


def test_off_switch_declines_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """``OPTCC_FASTCALL=0``: no compiled call, and nothing for the caller to bind."""
    monkeypatch.setenv("OPTCC_FASTCALL", "0")
    config.reload()
    fastcall._extension.cache_clear()
    fastcall._module.cache_clear()
    try:
        assert not fastcall.available() and fastcall.fold_function() is None
    finally:
        monkeypatch.undo()
        config.reload()
        fastcall._extension.cache_clear()
        fastcall._module.cache_clear()
    assert fastcall.available()


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("p", [2, 3, 8])
def test_c_sum_gives_numpys_bits(dtype: str, p: int) -> None:
    """The rank-order sum in C against NumPy's, bit for bit: NaNs with payloads, infinities,
    signed zeros, subnormals, integers that wrap."""
    rng = np.random.default_rng(p)
    n, offset, width = 301, 96, 96 + 8 * 301 + 40
    gathered = np.zeros((p, width), np.uint8)
    rows = [
        gathered[r, offset : offset + n * np.dtype(dtype).itemsize].view(dtype) for r in range(p)
    ]
    for r, row in enumerate(rows):
        if np.dtype(dtype).kind == "i":
            info = np.iinfo(dtype)
            row[:] = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        else:
            bits = rng.integers(0, 2 ** (8 * np.dtype(dtype).itemsize) - 1, n, dtype=np.uint64)
            row[:] = bits.astype(f"u{np.dtype(dtype).itemsize}").view(dtype)  # any pattern
            row[:20] = [np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 1.0, -1.0] * 2 + [
                r,
                -r,
                0.5,
                2,
            ]
    want = rows[0].copy()
    with np.errstate(all="ignore"):
        np.add(rows[0], rows[1], out=want)
        for row in rows[2:]:
            np.add(want, row, out=want)
    got = np.empty(n, dtype)
    fastcall.sum_rows(fastcall.reduce_kind(dtype), got, gathered, offset)
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{got.itemsize}"))


def test_format_table_matches_the_header_codes() -> None:
    """Every buffer format the C path accepts stands for exactly one of our types, with the
    header code and op mask the Python path would use."""
    table = fastcall._formats()
    assert {"f", "d"} <= {row[0] for row in table}
    for fmt, code, itemsize, mask, _ in table:
        name = list(dtypes.DTYPES)[code]
        dt = dtypes.DTYPES[name]
        assert memoryview(np.empty(1, dt)).format == fmt and dt.itemsize == itemsize
        assert protocol.DTYPE_CODE[name] == code
        for i, op in enumerate(dtypes.OPS):
            assert bool(mask >> i & 1) == ((op, name) in dtypes.VALID_PAIRS)
