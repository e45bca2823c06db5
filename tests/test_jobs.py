"""Tests of the Slurm job scripts under ``jobs/``.

Without Slurm: the scripts parse, are strict (``set -euo pipefail``) and carry the site
hooks; ``submit-sweep.sh --dry-run`` sizes the array from the table; an array task script
runs outside Slurm (mpiexec) and records its result, or a "failed" record when Python
cannot even start; degraded rows go through ``degrade-wrapper.sh``.

With Slurm (``@pytest.mark.root``): ``jobs/local-cluster.sh up`` installs and starts a
single-node cluster (skipped, with the reason, when not root or when it cannot be
installed or started), the smoke sweep runs through ``submit-sweep.sh --wait`` in under two
minutes and ``optcc-mpi report`` finds every task's rows with #wrong 0; a table row that
fails on purpose leaves a failed record, makes the report fail, and is resubmitted alone
with ``--only-failed``. A cluster this module started is brought down at the end.

The commands are the real ``optcc-mpi bench`` under ``mpiexec`` or ``srun``, started by the
launcher of the MPI library in use (``optcc_mpi.lab.launch``): ``make test`` runs this module
under MPICH and under Open MPI (``srun --mpi=pmi2`` and ``--mpi=pmix`` respectively).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from optcc_mpi.lab import launch, sweep

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
JOBS = REPO / "jobs"
SMOKE = JOBS / "sweeps" / "smoke.csv"
SCRIPTS = sorted([*JOBS.glob("*.sh"), *JOBS.glob("*.sbatch")])
PY = sys.executable

pytestmark = pytest.mark.timeout(900)


def _under_mpi() -> str | None:
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            return var
    return None


def _env(**extra: str) -> dict[str, str]:
    """The environment for the scripts: this Python, no Slurm or sweep settings inherited."""
    env = dict(os.environ)
    for var in (
        "SLURM_JOB_ID",
        "SLURM_ARRAY_JOB_ID",
        "SLURM_ARRAY_TASK_ID",
        "OPTCC_RESULTS",
        "OPTCC_LAUNCHER",
        "OPTCC_MPIEXEC",
        "OPTCC_SRUN_MPI",
        "OPTCC_TABLE",
        "OPTCC_PROGRAM",
    ):
        env.pop(var, None)
    env["OPTCC_PYTHON"] = PY
    env.update(extra)
    return env


def _run(
    argv: list[str], env: dict[str, str], timeout: float = 600, **kw: object
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=kw.pop("cwd", REPO),
        **kw,
    )  # type: ignore[arg-type]


def _records(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


# ----------------------------------------------------------------------------- no Slurm


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_and_is_strict(script: Path) -> None:
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert "set -euo pipefail" in script.read_text()
    assert script.stat().st_mode & stat.S_IXUSR, f"{script.name} is not executable"
    # The sweep helper is the `optcc-mpi sweep` subcommand, not the module's old CLI.
    assert "optcc_mpi.lab.sweep" not in script.read_text()


def test_sweep_subcommand_and_its_old_name() -> None:
    r = _run([PY, "-m", "optcc_mpi", "sweep", "--help"], _env())
    assert r.returncode == 0
    for sub in ("plan", "run", "exec", "manifest", "status", "expand"):
        assert sub in r.stdout
    args = ["expand", "allreduce", "algorithm=ring,optcc", "loss=0,0.5"]
    new = _run([PY, "-m", "optcc_mpi", "sweep", *args], _env())
    assert new.returncode == 0, new.stderr
    assert new.stdout.count("\n") == 5
    # The old name cannot run the command any more (the lab never imports the CLI): it
    # says where the command went, and fails.
    old = _run([PY, "-m", "optcc_mpi.lab.sweep", *args], _env())
    assert old.returncode == 1 and "is now `optcc-mpi sweep`" in old.stderr
    assert not old.stdout
    bad = _run([PY, "-m", "optcc_mpi", "sweep", "plan", "/nonexistent.csv"], _env())
    assert bad.returncode == 2 and "optcc-mpi sweep: error:" in bad.stderr


@pytest.mark.parametrize(
    "name", ["allreduce.sbatch", "allreduce-sweep.sbatch", "casgd-sweep.sbatch", "doctor.sbatch"]
)
def test_sbatch_site_settings(name: str) -> None:
    text = (JOBS / name).read_text()
    # submittable on a real cluster once account and partition are set
    assert "##SBATCH --account=" in text and "##SBATCH --partition=" in text
    assert "#SBATCH --time=" in text
    assert "#SBATCH --output=%x_%" in text
    assert "OPTCC_VENV" in text and "module load" in text
    if "sweep" in name:
        assert "#SBATCH --output=%x_%A_%a.out" in text


def test_submit_dry_run_sizes_the_array(tmp_path: Path) -> None:
    res = tmp_path / "res"
    r = _run(
        ["bash", str(JOBS / "submit-sweep.sh"), str(SMOKE), "--dry-run", "--results", str(res)],
        _env(),
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "--array=0-3" in out and "--ntasks=4" in out
    assert "allreduce-sweep.sbatch" in out and str(SMOKE) in out
    assert f"--output={res}/logs/%x_%A_%a.out" in out
    # sizing the job yourself drops --ntasks; other options pass through
    r = _run(
        [
            "bash",
            str(JOBS / "submit-sweep.sh"),
            str(SMOKE),
            "--dry-run",
            "--results",
            str(res),
            "--ntasks-per-node=2",
            "--partition=gpu",
        ],
        _env(),
    )
    assert "--ntasks=" not in r.stdout and "--ntasks-per-node=2" in r.stdout
    assert "--partition=gpu" in r.stdout
    # the script follows the table's kind
    r = _run(
        [
            "bash",
            str(JOBS / "submit-sweep.sh"),
            str(JOBS / "sweeps" / "casgd-smoke.csv"),
            "--dry-run",
            "--results",
            str(res),
        ],
        _env(),
    )
    assert "casgd-sweep.sbatch" in r.stdout and "--ntasks=2" in r.stdout


def test_submit_rejects_bad_tables(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("kind,bogus\nallreduce,1\n")
    r = _run(["bash", str(JOBS / "submit-sweep.sh"), str(bad), "--dry-run"], _env())
    assert r.returncode == 2 and "unknown column" in r.stderr
    r = _run(["bash", str(JOBS / "submit-sweep.sh")], _env())
    assert r.returncode == 2 and "usage" in r.stderr


def _fake_results(tmp_path: Path) -> tuple[Path, Path]:
    """A results folder where task 1 of a 3-row table failed and task 2 never reported."""
    table = tmp_path / "t.csv"
    table.write_text(
        "kind,algorithm\nallreduce,ring\nallreduce,no-such-algorithm\nallreduce,optcc\n"
    )
    res = tmp_path / "res"
    sweep.write_manifest(res, table, "500", [0, 1, 2])
    for task, status in ((0, "ok"), (1, "failed")):
        head = {
            "record": "task",
            "array_job_id": "500",
            "array_task_id": task,
            "status": status,
            "exit_code": 0 if status == "ok" else 2,
            "sweep": str(table.resolve()),
            "table": "t",
        }
        rows = [{"record": "bench", "wrong": 0}] if status == "ok" else []
        (res / f"500_{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [head, *rows]))
    return table, res


def test_submit_only_failed_dry_run(tmp_path: Path) -> None:
    table, res = _fake_results(tmp_path)
    r = _run(
        ["bash", str(JOBS / "submit-sweep.sh"), str(table), "--only-failed", str(res), "--dry-run"],
        _env(),
    )
    assert r.returncode == 0, r.stderr
    assert "--array=1-2" in r.stdout
    # nothing left to do: no submission at all
    for task in (1, 2):
        (res / f"600_{task}.jsonl").write_text(
            json.dumps(
                {
                    "record": "task",
                    "array_job_id": "600",
                    "array_task_id": task,
                    "status": "ok",
                    "sweep": str(table.resolve()),
                }
            )
            + "\n"
        )
    r = _run(
        ["bash", str(JOBS / "submit-sweep.sh"), str(table), "--only-failed", str(res), "--dry-run"],
        _env(),
    )
    assert r.returncode == 0 and "nothing to submit" in r.stdout


def test_sweep_task_script_without_slurm(tmp_path: Path) -> None:
    """The array task script run by hand: mpiexec instead of srun, one record file."""
    table = tmp_path / "t.csv"
    table.write_text(
        "kind,algorithm,loss,size,ranks,iters,warmup,emulate\n"
        "allreduce,optcc,0.5,64K,2,2,1,bw=200MB/s\n"
    )
    res = tmp_path / "res"
    env = _env(
        SLURM_ARRAY_JOB_ID="9001",
        SLURM_ARRAY_TASK_ID="0",
        OPTCC_RESULTS=str(res),
        OPTCC_HOME=str(REPO),
    )
    r = _run(["bash", str(JOBS / "allreduce-sweep.sbatch"), str(table)], env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = _records(res / "9001_0.jsonl")
    head, rows = recs[0], recs[1:]
    assert head["status"] == "ok" and head["params"]["algorithm"] == "optcc"
    assert "mpiexec" in head["command"] and "--links 0:0.5" in head["command"]
    assert head["mpi"]["vendor"] and head["optcc_mpi"]["version"]
    # Launched with the mpiexec of the library in use, and the record says which.
    lib = launch.mpi_library()
    assert head["mpi"]["vendor"] == lib.name and head["mpi"]["family"] == lib.family
    assert head["launcher"]["kind"] == "mpiexec"
    assert head["command"].startswith(" ".join(launch.launcher_argv(2)))
    assert rows and all(int(x["wrong"]) == 0 for x in rows)
    assert "optcc" in {x["algorithm"] for x in rows}


def test_single_run_script_without_slurm(tmp_path: Path) -> None:
    """allreduce.sbatch by hand: `optcc-mpi sweep exec` launches the benchmark with the
    library's own launcher (3 ranks: oversubscribed on 2 cores) and records it as a task."""
    res = tmp_path / "res"
    env = _env(OPTCC_RESULTS=str(res), OPTCC_RANKS="3")
    env.pop("MPIR_CVAR_CH4_PROGRESS_THROTTLE", None)
    bench = ["-b", "64K", "-e", "64K", "-n", "2", "-w", "1", "--algorithms", "ring,optcc"]
    r = _run(["bash", str(JOBS / "allreduce.sbatch"), *bench, "--links", "1:0.5"], env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (path,) = res.glob("local*_0.jsonl")  # no Slurm: a local job id
    head, *rows = _records(path)
    assert head["status"] == "ok" and head["sweep"].startswith("run:local") and head["ranks"] == 3
    assert head["command"].startswith(" ".join(launch.launcher_argv(3)))
    assert head["mpi"]["family"] == launch.mpi_library().family
    if launch.local_cores() < 3:
        assert head["extra_env"]["MPIR_CVAR_CH4_PROGRESS_THROTTLE"] == "1"
    assert {x["algorithm"] for x in rows} >= {"ring", "optcc"}
    assert all(int(x["wrong"]) == 0 for x in rows)


#: The doctor's options for the job-script tests: emulated links (one machine, so every
#: rank is a node of its own), rank 1 at half rate, small and few messages.
DOCTOR_ARGS = ["--emulate", "bw=50MB/s,degrade=1:0.5", "--size", "1M", "--repeats", "2"]


def _doctor_result(out: Path, job: str) -> dict:
    data = json.loads((out / f"doctor-{job}.json").read_text())
    assert (out / f"doctor-{job}.png").stat().st_size > 10_000
    assert json.loads((out / "latest.json").read_text()) == data
    return data


def test_doctor_script_without_slurm(tmp_path: Path) -> None:
    """doctor.sbatch by hand: the library's own launcher, 3 ranks; the JSON, the plot and
    latest.json, and the doctor's exit status (3: a link is degraded)."""
    out = tmp_path / "doctor"
    env = _env(OPTCC_RANKS="3", OPTCC_DOCTOR_DIR=str(out))
    r = _run(["bash", str(JOBS / "doctor.sbatch"), *DOCTOR_ARGS], env)
    assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]
    assert "DEGRADED: node" in r.stdout and "(rank 1)" in r.stdout
    data = _doctor_result(out, "local")
    assert [x["rank"] for x in data["ranks"] if x["verdict"] != "healthy"] == [1]


def test_sweep_task_script_records_a_python_that_cannot_start(tmp_path: Path) -> None:
    table = tmp_path / "t.csv"
    table.write_text("kind,algorithm\nallreduce,ring\n")
    res = tmp_path / "res"
    env = _env(
        SLURM_ARRAY_JOB_ID="9002",
        SLURM_ARRAY_TASK_ID="0",
        OPTCC_RESULTS=str(res),
        OPTCC_PYTHON=str(tmp_path / "no-python"),
    )
    r = _run(["bash", str(JOBS / "allreduce-sweep.sbatch"), str(table)], env)
    assert r.returncode == 127
    (head,) = _records(res / "9002_0.jsonl")
    assert head["status"] == "failed" and head["exit_code"] == 127
    assert any("no-python" in ln for ln in head["log_tail"])
    st = sweep.collect(res)
    assert [(t.task, t.status) for t in st.tasks] == [(0, "failed")]


def test_kind_mismatch_is_refused(tmp_path: Path) -> None:
    table = tmp_path / "t.csv"
    table.write_text("kind,algorithm\nallreduce,ring\n")
    env = _env(
        SLURM_ARRAY_JOB_ID="9003", SLURM_ARRAY_TASK_ID="0", OPTCC_RESULTS=str(tmp_path / "res")
    )
    r = _run(["bash", str(JOBS / "casgd-sweep.sbatch"), str(table)], env)
    assert r.returncode == 2 and "allreduce-sweep.sbatch" in r.stdout + r.stderr
    (head,) = _records(tmp_path / "res" / "9003_0.jsonl")
    assert head["status"] == "failed"


def test_degraded_rows_go_through_the_wrapper(tmp_path: Path) -> None:
    """degrade=ucx: every rank starts through degrade-wrapper.sh, which restricts the
    straggler's UCX devices (here one fake 'rank' 0, launched without MPI)."""
    prog = tmp_path / "envbench.py"
    prog.write_text(
        "import json, os, sys\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "row = {'algorithm': 'ring', 'wrong': 0, 'p': 1, 'size': 1, 'time_us': 1.0,\n"
        "       'ucx': os.environ.get('UCX_NET_DEVICES'),\n"
        "       'straggler': os.environ.get('OPTCC_STRAGGLER')}\n"
        "open(out, 'w').write(json.dumps(row) + '\\n')\n"
    )
    table = tmp_path / "t.csv"
    table.write_text("kind,algorithm,loss,stragglers,degrade,ranks\nallreduce,ring,0.5,0,ucx,1\n")
    env = _env(
        OPTCC_PROGRAM=f"{PY} {prog}",
        OPTCC_LAUNCHER="env SLURM_PROCID=0",
        OPTCC_STRAGGLER_NET_DEVICES="mlx5_0:1",
        OPTCC_HOME=str(REPO),
        OPTCC_DEGRADE_QUIET="1",
    )
    r = _run(
        [
            PY,
            "-m",
            "optcc_mpi",
            "sweep",
            "run",
            str(table),
            "0",
            "--results",
            str(tmp_path / "res"),
            "--job",
            "9004",
        ],
        env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    head, row = _records(tmp_path / "res" / "9004_0.jsonl")
    assert "degrade-wrapper.sh" in head["command"]
    assert head["extra_env"]["OPTCC_STRAGGLER_FRACTION"] == "0.5"
    assert row["ucx"] == "mlx5_0:1" and row["straggler"] == "1"


# ----------------------------------------------------------------------------- Slurm


def _cluster(cmd: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return _run(["bash", str(JOBS / "local-cluster.sh"), cmd], _env(), timeout=timeout)


@pytest.fixture(scope="module")
def slurm() -> Iterator[None]:
    """A running single-node Slurm; brought down at the end if this module started it."""
    if os.geteuid() != 0:
        pytest.skip("local Slurm needs root (it installs Debian packages and starts daemons)")
    var = _under_mpi()
    if var:
        pytest.skip(f"running under an MPI launcher ({var} is set); run serially")
    if not (shutil.which("slurmctld") or shutil.which("apt-get")):
        pytest.skip("no Slurm installed and no apt-get to install it")
    was_up = _cluster("status", timeout=60).returncode == 0
    if not was_up:
        r = _cluster("up")
        if r.returncode != 0:
            _cluster("down", timeout=120)
            tail = (r.stdout + r.stderr).strip().splitlines()[-5:]
            pytest.skip("Slurm could not be installed or started: " + " | ".join(tail))
    try:
        yield
    finally:
        if not was_up:
            _cluster("down", timeout=120)


def _csv(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


@pytest.mark.root
@pytest.mark.slow
def test_smoke_sweep_on_slurm(slurm: None, tmp_path: Path) -> None:
    res = tmp_path / "results"
    t0 = time.monotonic()
    r = _run(
        ["bash", str(JOBS / "submit-sweep.sh"), str(SMOKE), "--wait", "--results", str(res)],
        _env(OPTCC_POLL_S="1"),
        timeout=600,
    )
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "4 ok, 0 failed, 0 missing" in r.stdout
    print(f"smoke sweep: {wall:.1f} s wall")  # a measurement, not a test (no wall-clock asserts)
    job = r.stdout.split("as job ")[1].split(";")[0].strip()
    assert (res / f"manifest-{job}.json").exists()
    assert sorted(p.name for p in (res / "logs").iterdir()) == [
        f"optcc-allreduce_{job}_{t}.out" for t in range(4)
    ]

    out = tmp_path / "all.csv"
    r = _run(
        [
            PY,
            "-m",
            "optcc_mpi",
            "report",
            str(res),
            "--csv",
            str(out),
            "--plots",
            str(tmp_path / "plots"),
        ],
        _env(),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _csv(out)
    tasks = sweep.read_table(SMOKE).rows
    assert {row["array_task_id"] for row in rows} == {str(t) for t in range(len(tasks))}
    lib = launch.mpi_library()
    for row in rows:
        assert row["array_job_id"] == job and row["status"] == "ok"
        assert row["wrong"] == "0"
        assert row["mpi_vendor"] == lib.name and row["nodelist"]
    # srun with the PMI plugin of the library: pmi2 for MPICH, pmix for Open MPI.
    plugin = "pmix" if lib.family == "openmpi" else "pmi2"
    for path in res.glob(f"{job}_*.jsonl"):
        head = _records(path)[0]
        assert head["command"].startswith(f"srun --mpi={plugin} -n "), head["command"]
        assert head["launcher"]["kind"] == "srun"
    for t, params in enumerate(tasks):
        mine = [row for row in rows if row["array_task_id"] == str(t)]
        assert params["algorithm"] in {row["algorithm"] for row in mine}
    assert (tmp_path / "plots" / "overhead_vs_loss.png").exists()


@pytest.mark.root
@pytest.mark.slow
def test_failed_task_is_recorded_and_resubmitted(slurm: None, tmp_path: Path) -> None:
    table = tmp_path / "fail.csv"
    table.write_text(
        "kind,algorithm,loss,size,ranks,iters,warmup,emulate\n"
        "allreduce,ring,0.5,64K,2,2,1,bw=200MB/s\n"
        "allreduce,no-such-algorithm,0.5,64K,2,2,1,bw=200MB/s\n"
    )
    res = tmp_path / "results"
    submit = ["bash", str(JOBS / "submit-sweep.sh"), str(table), "--wait", "--results", str(res)]
    r = _run(submit, _env(OPTCC_POLL_S="1"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 ok, 1 failed, 0 missing" in r.stdout

    out = tmp_path / "all.csv"
    r = _run([PY, "-m", "optcc_mpi", "report", str(res), "--csv", str(out)], _env())
    assert r.returncode == 1 and "failed" in r.stdout
    rows = _csv(out)
    failed = [row for row in rows if row["array_task_id"] == "1"]
    assert len(failed) == 1 and failed[0]["status"] == "failed"
    assert failed[0]["exit_code"] not in ("", "0") and failed[0]["wrong"] == ""
    assert "algorithm" in failed[0]["error_line"]
    (rec_file,) = [p for p in res.glob("*_1.jsonl")]
    head = _records(rec_file)[0]
    assert head["status"] == "failed" and head["log_tail"]

    # One command resubmits just the failed task, once the table is corrected.
    r = _run(
        ["bash", str(JOBS / "submit-sweep.sh"), str(table), "--only-failed", str(res), "--dry-run"],
        _env(),
    )
    assert "--array=1 " in r.stdout + " "
    table.write_text(table.read_text().replace("no-such-algorithm", "optcc"))
    r = _run(
        ["bash", str(JOBS / "submit-sweep.sh"), str(table), "--only-failed", str(res), "--wait"],
        _env(OPTCC_POLL_S="1"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 of 2 tasks: --array=1" in r.stdout

    r = _run([PY, "-m", "optcc_mpi", "report", str(res), "--csv", str(out)], _env())
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _csv(out)
    assert {row["status"] for row in rows} == {"ok"}
    assert {row["array_task_id"] for row in rows} == {"0", "1"}
    assert {row["attempts"] for row in rows if row["array_task_id"] == "1"} == {"2"}


@pytest.mark.root
@pytest.mark.slow
def test_doctor_script_on_slurm(slurm: None, tmp_path: Path) -> None:
    """sbatch --wait jobs/doctor.sbatch on the local cluster: srun starts the ranks, and the
    job's exit code is the doctor's (3: rank 1 degraded)."""
    out = tmp_path / "doctor"
    r = _run(
        ["sbatch", "--wait", "-N", "1", "-n", "3", "--ntasks-per-node=3",
         f"--output={tmp_path}/%x_%j.out", str(JOBS / "doctor.sbatch"), *DOCTOR_ARGS],
        _env(OPTCC_DOCTOR_DIR=str(out), OPTCC_HOME=str(REPO)),
        timeout=600,
    )  # fmt: skip
    assert r.returncode == 3, r.stdout + r.stderr
    job = r.stdout.split()[-1]
    log = (tmp_path / f"optcc-doctor_{job}.out").read_text()
    assert "DEGRADED: node" in log, log[-3000:]
    data = _doctor_result(out, job)
    assert [x["rank"] for x in data["ranks"] if x["verdict"] != "healthy"] == [1]
