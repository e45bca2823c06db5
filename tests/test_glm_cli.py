"""Tests of ``optcc-mpi train`` and ``optcc-mpi bench-glm`` (serial; one test starts mpiexec)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from optcc_mpi.cli import build_parser, main
from optcc_mpi.glm.solvers import EXIT_AFTER_ENV, EXIT_AFTER_STATUS
from optcc_mpi.lab import launch
from optcc_mpi.model import library_allreduce

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


@pytest.fixture
def shipped():
    data = pytest.importorskip("optcc_mpi.data")
    try:
        data.shipped("breast_cancer")
    except FileNotFoundError:
        pytest.skip("shipped datasets are not in data/")
    return data


def _help(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[command].format_help()


def test_help_teaches_with_examples():
    text = _help("train")
    for needle in (
        "--recipe",
        "--slot",
        "--checkpoint-every",
        "--resume",
        "mpiexec -n 4",
        "--emulate",
        "examples:",
        "--max-iter",
        "--tol",
        "--early-stopping",
        "torchrun --standalone",
        "--s auto",
    ):
        assert needle in text
    bench = _help("bench-glm")
    for needle in ("mpiexec -n 8 optcc-mpi bench-glm", "--bw 25GB/s", "PROJECTION", "t_crit"):
        assert needle in bench


def test_train_writes_json_with_final_loss(tmp_path, shipped, capsys):
    out = tmp_path / "run.json"
    argv = "train --data breast_cancer --intercept --s 4 --b 16 --max-iter 2 --tol none --recipe C"
    status = main([*argv.split(), "--slot", "comm=bf16", "--no-progress", "--out", str(out)])
    assert status == 0
    printed = capsys.readouterr().out
    assert "epoch 2  loss" in printed and "compute" in printed
    assert "AllReduce (native over mpi)" in printed
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("mpiexec -n 1 optcc-mpi train --data breast_cancer")
    assert doc["final_loss"] == doc["epoch_losses"][-1] < 0.69
    assert doc["config"]["recipe"]["comm"] == "bf16" and doc["config"]["model"] == "logistic"
    st = doc["stats"]
    assert st["allreduce_calls"] == 2 * -(-(569 // 16) // 4)
    assert st["compute_s"] + st["comm_s"] == pytest.approx(st["train_s"])
    # The last line: the accuracy on the training rows, the epochs run and why it stopped.
    last = printed.strip().splitlines()[-1]
    assert last.startswith(f"result: accuracy {doc['train_score']:.4f} on the 569 training rows")
    assert last.endswith("2 epochs, stopped because max_iter epochs were run")
    assert doc["n_iter"] == 2 and doc["stop_reason"] == "max_iter" and 0.9 < doc["train_score"]


def test_train_stops_by_itself_and_says_why(shipped, capsys):
    argv = "train --data diabetes --intercept --b 32 --lr 0.05 --no-progress --tol 1e-2"
    assert main(argv.split()) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    # R^2 for linear regression; the tolerance and the plateau length in words.
    assert last.startswith("result: R^2 0.") and "on the 442 training rows" in last
    assert "stopped because the training loss improved by less than tol=0.01 for 5 epochs" in last


def test_train_early_stopping_and_the_deprecated_epochs(shipped, capsys):
    argv = "train --data breast_cancer --intercept --b 16 --no-progress --early-stopping"
    assert main([*argv.split(), "--validation-fraction", "0.2"]) == 0
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    # Stratified: a fifth of each class (42 of 212, 71 of 357) held out.
    assert "on the 456 training rows" in last and "on the 113 held out" in last
    assert "stopped because the validation score improved by less than tol=0.001" in last
    assert "validation 0." in out  # every epoch line shows the held-out accuracy
    assert main(["train", "--data", "breast_cancer", "--epochs", "1", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "--epochs is deprecated" in captured.err and "--max-iter 1 --tol none" in captured.err
    assert captured.out.strip().endswith("1 epoch, stopped because max_iter epochs were run")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "no-such-file.h5"], "no such dataset file"),
        (["--data", "diabetes", "--model", "logistic"], "binary labels"),
        (["--data", "diabetes", "--s", "64", "--b", "32"], "exceeds the 442 training rows"),
        (["--data", "diabetes", "--recipe", "Z"], "unknown recipe"),
        (["--data", "diabetes", "--slot", "comm=fp8"], "unknown precision"),
        (["--data", "diabetes", "--emulate", "latency"], "KEY=VALUE"),
    ],
)
def test_train_rejects_bad_input(argv, message, shipped, capsys):
    assert main(["train", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def test_train_rejects_a_file_without_X(tmp_path, shipped, capsys):
    bad = tmp_path / "bad.h5"
    with h5py.File(bad, "w") as f:
        f["y"] = np.zeros(10)
    assert main(["train", "--no-progress", "--data", str(bad)]) == 2
    assert "missing dataset 'X'" in capsys.readouterr().err


def test_train_killed_under_mpiexec_resumes_bit_for_bit(tmp_path, shipped):
    # A new job with the launcher of the MPI library in use (its flags included), without
    # the variables of any job this test itself may run in.
    env = {k: v for k, v in launch.clean_env().items() if k != EXIT_AFTER_ENV}

    def train(checkpoint, extra=None):
        args = (
            "train --data breast_cancer --s 4 --b 16 --max-iter 2 --tol none --recipe C "
            "--lambda 0.01 "
            "--no-progress --checkpoint-every 3 --resume --checkpoint"
        )
        cmd = [*launch.launcher_argv(2), sys.executable, "-m", "optcc_mpi"]
        cmd += [*args.split(), str(checkpoint)]
        return subprocess.run(
            cmd, env={**env, **(extra or {})}, cwd=REPO, capture_output=True, text=True, timeout=180
        )

    full = train(tmp_path / "full.h5")
    assert full.returncode == 0, full.stderr
    killed = train(tmp_path / "ck.h5", {EXIT_AFTER_ENV: "10"})
    assert killed.returncode == EXIT_AFTER_STATUS, killed.stderr
    resumed = train(tmp_path / "ck.h5")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    with h5py.File(tmp_path / "full.h5") as a, h5py.File(tmp_path / "ck.h5") as b:
        np.testing.assert_array_equal(a["w"][...], b["w"][...])
        assert a.attrs["steps"] == b.attrs["steps"] == 2 * (569 // 16)


def test_bench_glm_smoke(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    argv = "bench-glm --m 1024 --n 16 --b 16 --epochs 1 --s 2,4 --recipes fp32,C --repeats 1"
    status = main([*argv.split(), "--latency", "0,20us", "--quiet", "--out", str(out)])
    assert status == 0
    table = capsys.readouterr().out
    assert "t_crit(s)" in table and "SGDClass" in table and "Logistic" in table
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # per latency: sgd, casgd x (2 recipes x 2 s), SGDClassifier, LogisticRegression
    assert len(rows) == 2 * (1 + 2 * 2 + 2)
    for row in rows:
        assert row["command"].startswith("mpiexec -n 1 optcc-mpi bench-glm")
        # The options as given (not the lists they are parsed into), defaults left out.
        assert "--s 2,4 " in row["command"] and "--latency 0,20us " in row["command"]
        assert "[" not in row["command"] and "--recipes" not in row["command"]
    ours = [r for r in rows if r["solver"] != "sklearn"]
    assert all(r["loss_gap"] <= 0.005 for r in ours)
    assert all(r["time_to_target_s"] is not None for r in ours)
    casgd = [r for r in ours if r["solver"] == "casgd"]
    assert {r["allreduce_calls"] for r in casgd if r["s"] == 4} == {1024 // 16 // 4}
    # One rank: the network charges nothing; the critical path is compute alone.
    assert all(r["net_charged_s"] == 0.0 and r["critical_s"] is not None for r in ours)
    est = {r["estimator"] for r in rows if r["solver"] == "sklearn"}
    assert est == {"SGDClassifier(log_loss)", "LogisticRegression(lbfgs)"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bw", "fast"], "cannot parse bandwidth 'fast'"),
        (["--bw", "25Gbps"], "ambiguous"),
        (["--bw", ""], "--bw needs at least one bandwidth"),
        (["--latency=-5us"], "cannot parse duration"),
        (["--latency", "5 parsecs"], "cannot parse duration"),
        (["--s", "4,x"], "--s needs a comma list of integers"),
        (["--s", "0"], "--s needs integers >= 1"),
        (["--P", "1,8"], "--P needs integers >= 2"),
        (["--recipes", "Z"], "unknown recipe"),
        (["--m", "100", "--s", "16"], "exceeds the 100 rows"),
        (["--tolerance", "2"], "--tolerance must be in (0, 1)"),
        (["--plot", "x.png"], "add --project"),
        (["--lr", "-1"], "--lr must be a positive number"),
    ],
)
def test_bench_glm_rejects_bad_options_with_the_fix(argv, message, capsys):
    assert main(["bench-glm", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("optcc-mpi bench-glm: error:") and message in err


def test_bench_glm_projection_writes_plot_and_follows_the_model(tmp_path, capsys):
    out, png = tmp_path / "proj.json", tmp_path / "proj.png"
    argv = "bench-glm --project --n 64 --b 8 --s 4 --recipes C --P 8,64 --quiet"
    assert (
        main([*argv.split(), "--latency", "5us,50us", "--plot", str(png), "--out", str(out)]) == 0
    )
    assert "PROJECTION" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(out.read_text())
    assert doc["projection"] is True and len(doc["networks"]) == 2
    net = doc["networks"][1]
    assert net["latency_s"] == pytest.approx(50e-6) and net["bw"] == 25e9
    comp, nb = doc["compute_s_per_call"], doc["bytes_per_call"]
    label = "casgd C s=4"
    assert nb["sgd"] == 8 * 4 and nb[label] > 8 * 4  # b fp32 margins; margins + Gram
    for i, p in enumerate((8, 64)):
        cost = library_allreduce(p, nb[label], 25e9, latency=50e-6)
        t = (comp[label][str(p)] + cost) / 4
        assert net["per_step_s"][label][i] == pytest.approx(t)
        assert net["speedup"][label][i] == pytest.approx(doc["baseline_s_per_step"] / t)
