"""The command line: info, model, simulate, bench and demo, as a user runs them.

Jobs start with the launcher of the MPI library in use (``optcc_mpi.lab.launch``), so the
same tests run under MPICH (``.venv``) and Open MPI (``.venv-ompi``; ``make test-ompi``).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from optcc_mpi.algorithms.r2ccl import r2ccl_time
from optcc_mpi.argtypes import parse_key_value
from optcc_mpi.cli import main
from optcc_mpi.errors import ArgumentError
from optcc_mpi.lab import launch

EXE = [sys.executable, "-m", "optcc_mpi"]
ENV = {**os.environ, "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"}


def mpiexec(ranks: int) -> list[str]:
    """The words that start ``ranks`` ranks with this Python's MPI library."""
    return launch.launcher_argv(ranks)


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
    assert {"python", "numpy", "mpi4py", "mpi_library", "cupy", "cuda_aware_mpi"} <= set(info)
    assert info["cupy"]["available"] in (True, False)
    # The library mpi4py really loads, named with its version, and the matching launcher.
    from mpi4py import MPI

    name, version = MPI.get_vendor()
    assert info["mpi_name"] == name and info["mpi_version"] == ".".join(map(str, version))
    assert info["mpi_vendor"] == f"{name} {info['mpi_version']}"
    family = {"MPICH": "mpich", "Open MPI": "openmpi"}[name]
    assert info["mpi_family"] == family
    lr = info["launcher"]
    assert lr["kind"] == "mpiexec", lr
    assert lr["flavour"] == {"mpich": "hydra", "openmpi": "openmpi"}[family]
    assert Path(lr["program"]).exists() and lr["argv_for_2"][1:3] == ["-n", "2"]
    assert name in lr["describe"]


def test_info_table_names_library_and_launcher(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    lib = launch.mpi_library()
    rows = {line[:18].strip(): line[18:].strip() for line in out.splitlines()}
    assert rows["MPI library"].startswith(f"{lib.name} {lib.version} (MPI ")
    assert rows["launcher"] == launch.launcher().describe()


@pytest.mark.parametrize(
    ("text", "typed", "expected"),
    [
        ("k=64", True, ("k", 64)),
        ("fill=False", True, ("fill", False)),
        ("x=0.5", True, ("x", 0.5)),
        (" pattern = closer ", True, ("pattern", "closer")),
        ("a=b=c", True, ("a", "b=c")),  # only the first = splits
        ("N=1", False, ("N", "1")),  # untyped: environment values stay text
        ("E=", False, ("E", "")),
    ],
)
def test_key_value_parser(text: str, typed: bool, expected: tuple) -> None:
    assert parse_key_value(text, typed=typed) == expected


def test_key_value_errors_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("novalue", "=3", ""):
        with pytest.raises(ArgumentError, match="expected KEY=VALUE"):
            parse_key_value(bad)
    # The commands that take KEY=VALUE all use it and say the same thing.
    for argv in (
        ["simulate", "--p", "4", "--param", "k"],
        ["report", "--simulate", "--param", "fill"],
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert "expected KEY=VALUE, got" in capsys.readouterr().err
    assert main(["testbed", "run", "--env", "NOPE", "--", "true"]) == 2
    assert "expected --env KEY=VALUE, got 'NOPE'" in capsys.readouterr().err
    assert main(["sweep", "expand", "allreduce", "loss"]) == 2
    assert "expected COLUMN=V1,V2,..., got 'loss'" in capsys.readouterr().err


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
        *mpiexec(3),
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
    res = run(*mpiexec(2), sys.executable, str(script))
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
    # It says which launcher and library ran the ranks, and used that launcher.
    assert f"launcher: {launch.launcher().describe()}" in res.stdout
    assert f"$ {launch.launcher_argv(3)[0]} -n 3" in res.stdout
    assert (tmp_path / "time-vs-size.png").stat().st_size > 10_000
    rows = [json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert {r["algorithm"] for r in rows} >= {"ring", "optcc", "r2ccl", "native", "auto"}
    assert all(r["wrong"] == 0 for r in rows)
    # Every command it echoes can be pasted: the benchmark with its interpreter, and the
    # model of this run (its ranks, largest size, links and rate), which gives the table.
    echoed = [shlex.split(x[2:]) for x in res.stdout.splitlines() if x.startswith("$ ")]
    (bench,) = [w for w in echoed if "bench" in w]
    i = bench.index("bench")
    assert bench[i - 3 : i] == [sys.executable, "-m", "optcc_mpi"]
    (model,) = [w for w in echoed if "model" in w]
    assert model[model.index("model") :] == [
        *("model", "--ranks", "3", "--links", "0:0.5", "--size", "512K", "--bw", "400mbit")
    ]
    assert "p=3  size=524288 B  bw=0.05 GB/s  degraded: 0:0.5" in res.stdout
    pasted = subprocess.run(
        shlex.join(model), shell=True, capture_output=True, text=True, timeout=120, env=ENV
    )
    assert pasted.returncode == 0, pasted.stderr
    table = pasted.stdout.strip()
    assert table.startswith("p=3  size=524288 B") and table in res.stdout
    assert "25 GB/s" not in res.stdout and "size=268435456" not in res.stdout


def test_demo_plot_says_what_it_draws() -> None:
    """The degraded network's bound is labelled as such, the fault-free ring as the
    healthy reference with a model line of its own (every measured line has one, as the
    title says), and the axes read in human units."""
    from optcc_mpi.lab import demo

    rows = []
    for size in (4 << 20, 8 << 20, 16 << 20):
        for label, t, model in (
            ("ring (fault-free)", 150.0, 130.0),
            ("ring", 300.0, 260.0),
            ("optcc", 200.0, 170.0),
        ):
            scale = size / (4 << 20)
            rows.append(
                {
                    "algorithm": label,
                    "chosen": "ring" if label == "ring (fault-free)" else label,
                    "size": size,
                    "p": 8,
                    "network": "emulation",
                    "links": "" if label == "ring (fault-free)" else "0:0.5",
                    "time_us": 1e3 * t * scale,
                    "time_min_us": 1e3 * t * scale * 0.9,
                    "time_max_us": 1e3 * t * scale * 1.1,
                    "model_us": 1e3 * model * scale,
                    "bound_us": 1e3 * (130.0 if label == "ring (fault-free)" else 170.0) * scale,
                }
            )
    fig = demo.figure(rows, rate="400mbit")
    try:
        ax = fig.axes[0]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend == [
            "ring, every link healthy (reference)",
            "ring",
            "optcc",
            "lower bound, degraded network",
        ]
        # The bound drawn is the degraded network's (170 ms at 4 MiB), not the healthy one's.
        bound = [ln for ln in ax.get_lines() if ln.get_label() == legend[-1]][0]
        assert list(bound.get_ydata()) == [170.0, 340.0, 680.0]
        dotted = [ln for ln in ax.get_lines() if ln.get_linestyle() == ":"]
        assert len(dotted) == 3  # a model line for each measured line, the reference's too
        assert [130.0, 260.0, 520.0] in [list(ln.get_ydata()) for ln in dotted]
        fig.canvas.draw()
        assert [t.get_text() for t in ax.get_xticklabels()] == ["4 MiB", "8 MiB", "16 MiB"]
        ticks = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert "200 ms" in ticks and "1 s" in ticks and not any("^" in t for t in ticks)
        title = ax.get_title()
        assert "8 ranks" in title and "400 Mbit/s links" in title
        assert "rank 0 at 50% of the rate" in title and "dotted: model" in title
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_demo_labels_and_shell_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    from optcc_mpi.lab import demo

    assert demo.size_label(4 << 20) == "4 MiB" and demo.size_label(512 << 10) == "512 KiB"
    assert demo.time_label(200) == "200 ms" and demo.time_label(1500) == "1.5 s"
    assert demo.time_label(0.05) == "50 us"
    assert demo.rate_label("400mbit") == "400 Mbit/s" and demo.rate_label("1gbit") == "1 Gbit/s"
    assert demo.links_label("3:0.25,0:0.5") == "rank 0 at 50%, rank 3 at 25% of the rate"
    monkeypatch.setenv("SAME", "1")
    monkeypatch.delenv("NEW", raising=False)
    line = demo.shell_line(["/a b/python", "-m", "x"], {"SAME": "1", "NEW": "2 3"})
    assert line == "env 'NEW=2 3' '/a b/python' -m x"
    assert shlex.split(line) == ["env", "NEW=2 3", "/a b/python", "-m", "x"]
    assert demo.shell_line(["ls"], {"SAME": "1"}) == "ls"
    words = demo.cli_argv()
    assert (
        words == ["optcc-mpi"]
        or Path(words[0]).name == "optcc-mpi"
        or words[1:]
        == [
            "-m",
            "optcc_mpi",
        ]
    )


def test_bench_gloo_peer() -> None:
    """torch.distributed's gloo in the same table (optional: torch is an extra)."""
    pytest.importorskip("torch", reason="torch is an optional extra (pip install torch)")
    res = run(
        *mpiexec(2),
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
