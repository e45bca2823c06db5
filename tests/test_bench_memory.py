"""The benchmark's exact check fits in memory at any rank count (issue 36).

The exact result is a closed form of 17 values (``bench.exact_period``), compared chunk by
chunk (``bench.count_wrong``): a rank needs its message, the result and a constant, not
every rank's input. Checked here against the reduction of every rank's input built out in
full, for each type and reduction the benchmark checks, and at 16 ranks with 32 MiB per
rank under mpiexec, where building every input (the check before issue 36) needed 1.7 GB
per rank and was killed by the kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from optcc_mpi.cli.bench import BENCH_DTYPES, BENCH_OPS
from optcc_mpi.dtypes import DTYPES
from optcc_mpi.lab import bench, launch

MiB = 1 << 20


def _every_rank(count: int, p: int) -> np.ndarray:
    """Every rank's input as integers, one row per rank: what the closed form replaces."""
    i = np.arange(count, dtype=np.int64)
    return np.stack([(i * 7 + r * 13) % 17 - 8 for r in range(p)])


@pytest.mark.parametrize("p", [1, 2, 3, 8, 16, 17, 18, 34, 35, 100, 256])
@pytest.mark.parametrize("op", BENCH_OPS)
def test_exact_period_is_the_reduction_of_every_input(p: int, op: str) -> None:
    count = 3 * bench.PERIOD + 5  # not a whole number of periods
    vals = _every_rank(count, p)
    exact = {"sum": vals.sum(0), "max": vals.max(0), "min": vals.min(0)}[op]
    period = bench.exact_period(p, op)
    np.testing.assert_array_equal(period[np.arange(count) % bench.PERIOD], exact)


@pytest.mark.parametrize("dtype", BENCH_DTYPES)
def test_inputs_and_check_in_every_type(dtype: str) -> None:
    p, count = 20, 2 * bench.PERIOD + 3
    vals = _every_rank(count, p)
    for rank in (0, 7, p - 1):
        x = bench._inputs(count, rank, DTYPES[dtype])
        assert x.dtype == DTYPES[dtype] and x.nbytes == count * DTYPES[dtype].itemsize
        np.testing.assert_array_equal(x.astype(np.int64), vals[rank])
    for op in BENCH_OPS:
        period = bench.exact_period(p, op)
        # The reduction in the type itself, rank by rank, as an algorithm would compute it.
        acc = bench._inputs(count, 0, DTYPES[dtype])
        for rank in range(1, p):
            x = bench._inputs(count, rank, DTYPES[dtype])
            acc = {"sum": acc + x, "max": np.maximum(acc, x), "min": np.minimum(acc, x)}[op]
        assert bench.count_wrong(acc, period) == 0, (dtype, op)
        acc[count - 1] = acc[count - 1] + 1
        assert bench.count_wrong(acc, period) == 1, (dtype, op)


def test_check_counts_across_chunks() -> None:
    period = bench.exact_period(16, "sum")
    n = 2 * bench.CHECK_CHUNK + 5
    out = np.resize(period.astype(np.float32), n)
    assert bench.count_wrong(out, period) == 0
    out[bench.CHECK_CHUNK - 1] += 1  # last element of the first chunk
    out[bench.CHECK_CHUNK] += 1  # first of the second
    out[-1] = np.nan  # NaN is never right
    assert bench.count_wrong(out, period) == 3
    assert bench.count_wrong(out.reshape(3, -1), period) == 3  # any shape, flattened


def test_inputs_and_check_need_no_memory_per_rank() -> None:
    """At 256 ranks and 32 MiB, building the input and checking a result allocate the
    message and a few MB (NumPy reports its buffers to tracemalloc), where the check
    before issue 36 built 256 int64 inputs (16 GiB)."""
    count = 32 * MiB // 4
    out = np.resize(bench.exact_period(256, "sum").astype(np.float32), count)
    tracemalloc.start()
    try:
        x = bench._inputs(count, 255, DTYPES["float32"])
        period = bench.exact_period(256, "sum")
        wrong = bench.count_wrong(out, period)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert wrong == 0 and x.nbytes == 32 * MiB
    assert peak < 32 * MiB + 24 * MiB, f"peak {peak / MiB:.1f} MiB for a 32 MiB input"


@pytest.mark.timeout(300)
def test_bench_at_16_ranks_with_32_mib(tmp_path: Path) -> None:
    """16 ranks on this machine, 32 MiB per rank, every result checked: each rank's peak
    memory at 32 MiB stays within a few messages of its peak at 4 KiB (the interpreter,
    NumPy, MPI). One timed call per row, no warm-up and no fault-free reference, to keep
    it to a few tens of seconds on 2 cores."""
    out = tmp_path / "rows.jsonl"
    argv = [
        *launch.launcher_argv(16),
        sys.executable,
        "-m",
        "optcc_mpi",
        "bench",
        "-b",
        "4K",
        "-e",
        "32M",
        "-f",
        "8192",
        "-n",
        "1",
        "-w",
        "0",
        "--no-reference",
        "--algorithms",
        "ring,optcc",
        "--out",
        str(out),
    ]
    env = {**os.environ, "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"}
    res = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["algorithm"], r["size"]) for r in rows] == [
        ("ring", 4096),
        ("optcc", 4096),
        ("ring", 32 * MiB),
        ("optcc", 32 * MiB),
    ]
    assert all(r["wrong"] == 0 and r["p"] == 16 for r in rows)
    small, large = rows[1]["rss_peak_mib_ranks"], rows[3]["rss_peak_mib_ranks"]
    assert len(large) == 16
    grown = [b - a for a, b in zip(small, large)]
    # Input, output and the algorithm's buffers: measured 88-111 MiB (2.8-3.5 messages).
    assert max(grown) <= 5 * 32, f"peak RSS grew by {max(grown):.0f} MiB for 32 MiB messages"
    # Where the time went, per rank: CPU per call and messages per call (what each
    # algorithm's schedule sent and received), and OptCC's segment count.
    for r in rows[2:]:
        assert len(r["cpu_s_ranks"]) == 16 and all(c >= 0 for c in r["cpu_s_ranks"])
        assert r["cpu_over_wall"] >= 0
        assert len(r["messages_ranks"]) == 16 and min(r["messages_ranks"]) >= 2 * 15
    assert rows[3]["schedule_params"]["k"] >= 1
