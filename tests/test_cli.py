"""The command line: info, model, simulate, bench and demo, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from optcc_mpi.algorithms.r2ccl import r2ccl_time
from optcc_mpi.cli import main

EXE = [sys.executable, "-m", "optcc_mpi"]
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
ENV = {**os.environ, "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"}


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=ENV)


def test_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("info", "model", "simulate", "bench", "demo", "testbed", "data", "train"):
        assert cmd in out


def test_info_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["mpi_vendor"].startswith("MPICH")
    assert {"python", "numpy", "mpi4py", "mpi_library", "cupy", "cuda_aware_mpi"} <= set(info)
    assert info["cupy"]["available"] in (True, False)


def test_model_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["model", "--p", "8", "--degrade", "0:0.5", "--size", "256M", "--bw", "25GB/s"]) == 0
    )
    out = capsys.readouterr().out
    assert "lower bound" in out and "1.143" in out
    assert main(["model", "--p", "8", "--degrade", "0:0.5", "--size", "256M", "--json"]) == 0
    t = json.loads(capsys.readouterr().out)
    assert t["p"] == 8 and t["size"] == 256 * 2**20
    assert t["algorithms"]["ring"]["ratio_fault_free"] == pytest.approx(2.0)
    # The r2ccl schedule pipelines its tail in K = 16 chunks: its model is (1 + 1/16) T3.
    k16 = r2ccl_time(8, 256 * 2**20, 25e9, "0:0.5", chunks=16) / t["fault_free_s"]
    assert t["algorithms"]["r2ccl"]["ratio_fault_free"] == pytest.approx(k16, rel=1e-9)
    assert t["bound_s"] / t["fault_free_s"] == pytest.approx(8 / 7)


def test_model_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "--p", "4", "--degrade", "7:0.5"]) == 2
    assert "names rank 7" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["model", "--degrade", "0:2"])


def test_simulate_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["simulate", "--p", "6", "--degrade", "0:0.5", "--size", "1M", "--verify", "--json"])
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert {r["algorithm"] for r in res} == {"ring", "optcc", "r2ccl", "native"}
    assert all(r["verified"] for r in res)
    t = {r["algorithm"]: r["sim_s"] for r in res}
    assert t["optcc"] < t["r2ccl"] < t["ring"]


def test_bench_under_mpiexec(tmp_path: Path) -> None:
    out = tmp_path / "rows.csv"
    res = run(
        MPIEXEC,
        "-n",
        "3",
        *EXE,
        "bench",
        "-b",
        "64K",
        "-e",
        "128K",
        "-n",
        "2",
        "--links",
        "1:0.5",
        "--emulate",
        "bw=50MB/s",
        "--out",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    assert "Out of bounds values : 0 OK" in res.stdout
    lines = out.read_text().splitlines()
    header = lines[0].split(",")
    for col in (
        "algorithm",
        "size",
        "p",
        "links",
        "time_us",
        "time_min_us",
        "time_max_us",
        "busbw",
        "wrong",
        "ratio_fault_free",
        "model_us",
        "bound_us",
    ):
        assert col in header
    assert len(lines) == 1 + 2 * 6  # 2 sizes x (reference + 5 algorithms)


def test_bench_reports_wrong_results(tmp_path: Path) -> None:
    """A corrupted result is counted and fails the run (exit status 1)."""
    script = tmp_path / "corrupt.py"
    script.write_text(
        "import numpy as np, optcc_mpi.collectives as c\n"
        "orig = c.allreduce\n"
        "def bad(*a, **k):\n"
        "    y = orig(*a, **k); y[0] += 1; return y\n"
        "import optcc_mpi; optcc_mpi.allreduce = bad\n"
        "import sys; from optcc_mpi.cli import main\n"
        "sys.exit(main(['bench', '-b', '4K', '-e', '4K', '-n', '1', '--algorithms', 'ring']))\n"
    )
    res = run(MPIEXEC, "-n", "2", sys.executable, str(script))
    assert res.returncode != 0
    assert "FAILED" in res.stdout


def test_demo_with_emulation(tmp_path: Path) -> None:
    res = run(
        *EXE,
        "demo",
        "--network",
        "emulation",
        "--ranks",
        "3",
        "--begin",
        "256K",
        "--end",
        "512K",
        "--iters",
        "1",
        "--out",
        str(tmp_path),
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "software emulation" in res.stdout
    assert (tmp_path / "time-vs-size.png").stat().st_size > 10_000
    rows = [json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert {r["algorithm"] for r in rows} >= {"ring", "optcc", "r2ccl", "native", "auto"}
    assert all(r["wrong"] == 0 for r in rows)


def test_bench_gloo_peer() -> None:
    """torch.distributed's gloo in the same table (optional: torch is an extra)."""
    pytest.importorskip("torch", reason="torch is an optional extra (pip install torch)")
    res = run(
        MPIEXEC,
        "-n",
        "2",
        *EXE,
        "bench",
        "-b",
        "1M",
        "-e",
        "1M",
        "-n",
        "2",
        "--algorithms",
        "ring,gloo",
    )
    assert res.returncode == 0, res.stderr
    assert "gloo" in res.stdout and "Out of bounds values : 0 OK" in res.stdout
