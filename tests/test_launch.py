"""The one launcher lookup (``optcc_mpi.lab.launch``), under whichever MPI this Python has.

Serial tests: they start their own jobs. ``make test`` runs them under MPICH (``.venv``)
and under Open MPI (``.venv-ompi``), where the expectations differ only by library family.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from optcc_mpi import config
from optcc_mpi.errors import MPIUnavailableError
from optcc_mpi.lab import launch

HYDRA_VERSION = "HYDRA build details:\n    Version:                                 5.0.2\n"
OMPI_VERSION = "mpiexec (Open MPI) 5.0.11\n\nReport bugs to ...\n"
OPENMPI = launch.MPILibrary("Open MPI", "5.0.11", "openmpi", "3.1", "Open MPI v5.0.11")
MPICH = launch.MPILibrary("MPICH", "5.0.2", "mpich", "5.0", "MPICH Version: 5.0.2")


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher settings or batch allocation inherited from whoever runs the tests."""
    for var in (
        "OPTCC_LAUNCHER",
        "OPTCC_MPIEXEC",
        "OPTCC_SRUN_MPI",
        "SLURM_JOB_ID",
        "PBS_JOBID",
        "LSB_JOBID",
        "COBALT_JOBID",
        "FLUX_JOB_ID",
        "PMIX_MCA_psec",
    ):
        monkeypatch.delenv(var, raising=False)


def _fake(tmp_path: Path, name: str, version_text: str) -> str:
    """An executable that prints ``version_text`` for ``--version``."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{version_text}EOF\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_library_is_the_one_mpi4py_loads() -> None:
    lib = launch.mpi_library()
    # Asked independently, in a child that initialises MPI for real.
    code = "from mpi4py import MPI; print(MPI.get_vendor()[0])"
    name = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()
    assert lib.name == name and lib.error is None
    assert lib.family == {"MPICH": "mpich", "Open MPI": "openmpi"}[name]
    assert lib.version.count(".") >= 1 and lib.text
    assert str(lib) == f"{lib.name} {lib.version}"


def test_library_that_cannot_load_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MPI4PY_LIBMPI", "/nonexistent/libmpi.so")
    lib = launch.mpi_library(sys.executable)  # a child, whatever this process loaded
    assert lib.family == "none" and lib.error
    assert "no MPI" in str(lib)


def test_default_launcher_matches_the_library() -> None:
    lib = launch.mpi_library()
    chosen = launch.launcher()
    assert chosen.kind == "mpiexec"
    assert chosen.program == str(Path(sys.executable).parent / "mpiexec")
    assert chosen.flavour == {"mpich": "hydra", "openmpi": "openmpi"}[lib.family]
    argv = chosen.argv(3)
    assert argv[:3] == [chosen.program, "-n", "3"]
    if lib.family == "openmpi":
        assert "--oversubscribe" in argv  # no batch allocation here
        assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)
    else:
        assert argv == [chosen.program, "-n", "3"]
    assert lib.name in chosen.describe()


@pytest.mark.timeout(120)
def test_launched_ranks_form_one_job() -> None:
    """The real check: the ranks it starts see each other (a mismatched launcher would
    start N singletons of size 1)."""
    code = (
        "from mpi4py import MPI; c = MPI.COMM_WORLD; "
        "seen = c.gather((c.Get_rank(), c.Get_size(), MPI.get_vendor()[0])); "
        "print(seen if c.Get_rank() == 0 else '', end='')"
    )
    chosen = launch.launcher()
    env = {**launch.clean_env(), **chosen.env(3)}
    done = subprocess.run(
        [*chosen.argv(3), sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    name = launch.mpi_library().name
    assert done.stdout.strip() == repr([(r, 3, name) for r in range(3)])


@pytest.mark.slow
def test_gpu_check_script_runs_its_rank_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``scripts/gpu_check.py --cpu`` (what ``make gpu-check`` runs, with NumPy arrays):
    it starts its ranks with the project's launcher, every algorithm passes at 1 and 4
    ranks; with an mpiexec that does not exist it reports a failure instead of a traceback.
    Only the checks it launches with mpiexec: its torch checks are tests/test_gpu_check.py's."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    argv = [sys.executable, str(script), "--cpu", "--timeout", "200"]
    mpi_checks = ["--only", "allreduce,gram,training"]
    done = subprocess.run(
        argv + mpi_checks, capture_output=True, text=True, timeout=500, env=launch.clean_env()
    )
    assert done.returncode == 0, done.stdout + done.stderr
    from optcc_mpi import algorithms

    lines = [x for x in done.stdout.splitlines() if x.startswith("PASS")]
    for name in algorithms.names():
        for p in (1, 4):
            want = (f"allreduce {name} (numpy)", f"p={p} ")
            assert any(all(w in x for w in want) for x in lines), (name, p, done.stdout)
    env = {**launch.clean_env(), "OPTCC_MPIEXEC": "/nonexistent/mpiexec"}
    # Only the MPI check: the torch checks need no mpiexec (tests/test_gpu_check.py).
    argv += ["--only", "allreduce"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "FAIL  allreduce, 1 ranks" in done.stdout and "/nonexistent/mpiexec" in done.stdout


@pytest.mark.parametrize(
    ("version_text", "library", "flavour"),
    [(HYDRA_VERSION, OPENMPI, "hydra"), (OMPI_VERSION, MPICH, "openmpi")],
)
def test_mismatched_mpiexec_is_refused(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    version_text: str,
    library: launch.MPILibrary,
    flavour: str,
) -> None:
    fake = _fake(tmp_path, "mpiexec", version_text)
    monkeypatch.setenv("OPTCC_MPIEXEC", fake)
    config.reload()
    assert launch.mpiexec_flavour(fake) == flavour
    with pytest.raises(MPIUnavailableError, match="every rank would start alone") as err:
        launch.launcher(library=library)
    assert fake in str(err.value) and str(library) in str(err.value)


def test_open_mpi_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake(tmp_path, "mpiexec", OMPI_VERSION)
    monkeypatch.setenv("OPTCC_MPIEXEC", fake)
    config.reload()
    monkeypatch.setattr(launch, "_is_root", lambda: True)
    argv = launch.launcher(library=OPENMPI).argv(4)
    assert argv == [fake, "-n", "4", "--oversubscribe", "--allow-run-as-root"]
    monkeypatch.setattr(launch, "_is_root", lambda: False)
    assert "--allow-run-as-root" not in launch.launcher(library=OPENMPI).argv(4)
    # Inside a batch allocation the slots are the allocation's: no oversubscription.
    monkeypatch.setenv("PBS_JOBID", "12.server")
    assert launch.launcher(library=OPENMPI).argv(4) == [fake, "-n", "4"]


def test_srun_inside_slurm_picks_the_plugin_of_the_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "srun", "slurm 22.05.8\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setattr(launch, "_is_root", lambda: True)
    mpich = launch.launcher(library=MPICH)
    assert mpich.argv(8) == ["srun", "--mpi=pmi2", "-n", "8", "--kill-on-bad-exit=1"]
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in mpich.env(8) and "PMIX_MCA_psec" not in mpich.env(8)
    ompi = launch.launcher(library=OPENMPI)
    assert ompi.argv(8) == ["srun", "--mpi=pmix", "-n", "8", "--kill-on-bad-exit=1"]
    env = ompi.env(8)
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["PMIX_MCA_psec"] == "native"
    assert "Slurm job 77" in ompi.describe()
    monkeypatch.setenv("OPTCC_SRUN_MPI", "pmix_v4")
    config.reload()
    assert launch.launcher(library=MPICH).argv(2)[1] == "--mpi=pmix_v4"


def test_custom_launcher_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("OPTCC_LAUNCHER", "env OPTCC_FAKE_RANKS={ranks} --")
    config.reload()
    chosen = launch.launcher(library=MPICH)
    assert chosen.kind == "custom"
    assert chosen.argv(5) == ["env", "OPTCC_FAKE_RANKS=5", "--"]
    with pytest.raises(ValueError, match="at least 1"):
        chosen.argv(0)


def test_find_mpiexec_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert launch.find_mpiexec() == str(Path(sys.executable).parent / "mpiexec")
    monkeypatch.setenv("OPTCC_MPIEXEC", "/opt/site/bin/mpiexec")
    config.reload()
    assert launch.find_mpiexec() == "/opt/site/bin/mpiexec"
    monkeypatch.delenv("OPTCC_MPIEXEC")
    config.reload()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MPIUnavailableError, match="pip install mpich"):
        launch.find_mpiexec()


def test_oversubscription_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MPIR_CVAR_CH4_PROGRESS_THROTTLE", raising=False)
    cores = launch.local_cores()
    assert launch.oversubscription_env(cores) == {}
    assert launch.oversubscription_env(cores + 1) == {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"}
    assert launch.oversubscription_env(2 * cores, nodes=2) == {}
    monkeypatch.setenv("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "0")  # the user's choice is kept
    assert launch.oversubscription_env(cores + 1) == {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "0"}


def test_clean_env_drops_what_a_launcher_set() -> None:
    env = {"PMI_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "PMIX_NAMESPACE": "x", "HOME": "/h"}
    assert launch.clean_env(env) == {"HOME": "/h"}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(60)
def test_stop_group_ends_the_whole_group() -> None:
    # A launcher-like parent with a child that ignores SIGTERM: both must end, the child
    # by the SIGKILL that follows the grace period.
    proc = subprocess.Popen(
        ["sh", "-c", "sh -c 'trap \"\" TERM; echo $$; sleep 60' & wait"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    assert _alive(child)
    launch.stop_group(proc, grace=0.5)
    assert proc.returncode is not None
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    launch.stop_group(proc)  # already gone: nothing to do, no error
