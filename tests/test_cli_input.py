"""Command-line input: bad values fail at once, quoting what the user typed; under MPI an
error on one rank ends the whole job instead of leaving the others hanging, and an error
every rank meets (a bad command line, a bad argument the ranks agree on) is printed once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from optcc_mpi.cli import main

EXE = [sys.executable, "-m", "optcc_mpi"]
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
ENV = {**os.environ, "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"}


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI; it must fail (argparse exit 2, or status 2). Returns stderr."""
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    assert status == 2, f"{argv} gave status {status}"
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["model", "--p", "0"], ["--p", "'0'", "at least 2"]),
        (["model", "--p", "0", "--degrade", "healthy"], ["--p", "'0'"]),
        (["model", "--p", "1"], ["--p", "'1'", "at least 2"]),
        (["model", "--p", "eight"], ["--p", "'eight'", "not a whole number"]),
        (["model", "--p", "4", "--degrade", "7:0.5"], ["--degrade 7:0.5", "names rank 7", "--p 4"]),
        (["model", "--degrade", "0:1.5"], ["--degrade", "outside (0, 1]"]),
        (["model", "--size", "0"], ["--size", "'0'", "at least 1 byte"]),
        (["model", "--size=-5M"], ["--size", "'-5M'"]),
        (["model", "--sweep", "--losses", "1.5"], ["--losses", "'1.5'", "outside [0, 1)"]),
        (["model", "--sweep", "--losses", "0.5,x"], ["--losses", "'x'", "not a number"]),
        (["model", "--sweep", "--losses", "1"], ["--losses", "'1'"]),
        (["model", "--sweep", "--ps", "1,8"], ["--ps", "'1'", "at least 2"]),
        (["simulate", "--p", "0"], ["--p", "'0'"]),
        (["bench", "-n", "0"], ["-n/--iters", "'0'", "at least 1"]),
        (["bench", "-w", "-1"], ["-w/--warmup", "'-1'", "at least 0"]),
        (["bench", "-b", "3", "-d", "float64"], ["-b/--begin 3", "float64", "8 bytes"]),
        (["bench", "-b", "0"], ["-b/--begin", "'0'"]),
        (["bench", "-b", "1M", "-e", "64K"], ["-e/--end 65536", "-b/--begin 1048576"]),
        (["bench", "-b", "64K", "-e", "1M", "-f", "1"], ["-f/--factor 1", "above 1"]),
        (["bench", "-f", "0"], ["-f/--factor", "'0'"]),
        (["bench", "--algorithms", "ring,tree"], ["--algorithms", "'tree'"]),
        (["bench", "--links", "0:2"], ["--links", "outside (0, 1]"]),
        (["bench", "--emulate", "bw=fast"], ["--emulate", "'fast'"]),
        (["bench", "-d", "complex64"], ["-d/--dtype", "complex64"]),
    ],
)
def test_bad_arguments_name_what_was_typed(
    argv: list[str], expect: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = fails(argv, capsys)
    for text in expect:
        assert text in err, f"{text!r} not in {err!r}"


def test_tiny_fraction_models(capsys: pytest.CaptureFixture[str]) -> None:
    """A valid fraction as small as 1e-9 plans (the LP used to fail on it)."""
    assert main(["model", "--p", "8", "--degrade", "0:1e-9"]) == 0
    out = capsys.readouterr().out
    assert "optcc plan:" in out and "lower bound" in out


def test_losses_and_ranks_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "--sweep", "--ps", "4,8", "--losses", "0,0.5", "--json"]) == 0
    assert "bound" in capsys.readouterr().out


@pytest.mark.timeout(240)
def test_error_on_one_rank_aborts_the_job() -> None:
    """A bad environment variable on one rank, read outside any agreement, ends the whole
    MPI job with an error instead of leaving the other rank waiting in a collective."""
    args = [*EXE, "bench", "-b", "4K", "-e", "4K", "-n", "1", "--algorithms", "ring"]
    cmd = [MPIEXEC, "-n", "1", *args, ":", "-n", "1", "-env", "OPTCC_LINKS", "0:zero", *args]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=ENV)
    except subprocess.TimeoutExpired:
        pytest.fail("the job hung: the healthy rank waited for the failed one")
    assert res.returncode != 0
    assert "aborting all ranks" in res.stderr
    assert "OPTCC_LINKS" in res.stderr or "zero" in res.stderr


ABORT_LONG = """
import sys
from mpi4py import MPI
from optcc_mpi.cli._common import _abort
if MPI.COMM_WORLD.Get_rank() == 1:
    _abort(3, "x" * 60000 + " the last words")
MPI.COMM_WORLD.Barrier()
"""


@pytest.mark.timeout(300)
def test_an_abort_s_last_lines_reach_the_log() -> None:
    """The abort goes to the launcher on another channel than the output: a launcher that
    takes it first ended the job with the rank's last lines unread, and the job failed
    with no word of why (about 1 run in 5 with a 60 KB message under MPICH's Hydra before
    the abort waited for its lines to be read). Ten runs, every one must say it."""
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-c", ABORT_LONG]
    for _ in range(10):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
        assert res.returncode == 3, res.stderr[-300:]
        assert "the last words\n[rank 1] aborting all ranks" in res.stderr, res.stderr[-300:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("args", "once"),
    [
        # found before MPI starts, from the command line every rank was given
        (["-b", "8M", "-e", "1M"], "-e/--end 1048576 is smaller than -b/--begin 8388608"),
        # argparse's own usage error
        (["--bogus"], "unrecognized arguments: --bogus"),
        # found inside the collective, on every rank alike (an agreement)
        (["-b", "4K", "-e", "4K", "-n", "1", "--links", "3:0.5", "--algorithms", "ring"],
         "link profile names rank 3, outside the communicator of size 2"),
    ],
)  # fmt: skip
def test_an_error_every_rank_meets_is_printed_once(args: list[str], once: str) -> None:
    """Every rank raises it by design: rank 0 prints it, every rank exits with status 2,
    and nothing is aborted (no rank waits for another)."""
    from optcc_mpi.lab import launch

    cmd = [*launch.launcher_argv(2), *EXE, "bench", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count(once) == 1, res.stderr
    assert res.stderr.count("usage:") == (1 if "--bogus" in args else 0), res.stderr
    # Nothing aborted (Open MPI's launcher still reports the non-zero exit in a box).
    assert "aborting all ranks" not in res.stderr and "MPI_Abort" not in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["-b", "8M", "-e", "1M"], "-e/--end 1048576 is smaller than -b/--begin 8388608"),
    ],
)  # fmt: skip
@pytest.mark.parametrize(
    "launcher",
    [
        {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_KILL_BAD_EXIT": "1"},
        {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"},
        {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
    ],
    ids=["srun-kill-on-bad-exit", "torchrun", "openmpi"],
)
def test_an_error_found_first_by_another_rank_is_not_lost(
    args: list[str], says: str, launcher: dict[str, str]
) -> None:
    """Launchers that end the job at the first non-zero exit (srun --kill-on-bad-exit,
    torchrun, Open MPI's mpirun) stop rank 0 the moment another rank leaves: when rank 1
    finds the error first and rank 0 is still starting, rank 1's exit alone must carry
    the line. Here rank 0 never starts at all (the slowest it can be). A launcher that
    waits for every rank (plain srun) gets nothing from rank 1: rank 0 says it."""
    from optcc_mpi.cli._common import _RANK_VARIABLES

    clean = {k: v for k, v in ENV.items() if k not in {"HYDI_CONTROL_FD", *_RANK_VARIABLES}}
    clean = {k: v for k, v in clean.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    cmd = [*EXE, "bench", *args]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=100, env={**clean, **launcher}
    )
    assert res.returncode == 2, res.stderr
    assert f"[rank 1] optcc-mpi bench: error: {says}" in res.stderr, res.stderr
    assert res.stderr.count(says) == 1 and "usage:" not in res.stderr, res.stderr
    plain = {**clean, "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=plain)
    assert res.returncode == 2 and res.stderr == "", res.stderr
