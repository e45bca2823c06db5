"""What a run ran with: one provenance record for sweep tasks, benchmarks and ``info``.

:func:`record` is what every sweep task writes on its first line (host, Slurm job, MPI
library and launcher, versions, git revision, the environment variables that change what
MPI and the transports do); ``optcc-mpi info`` prints the same facts with the parts that
need MPI initialised (ranks, CUDA-awareness). None of it may fail the run it describes:
what cannot be found is recorded as such.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import h5py

from optcc_mpi import __version__, config
from optcc_mpi.errors import OptccError
from optcc_mpi.lab import launch

__all__ = [
    "ENV_PREFIXES", "git", "launcher_record", "load_average", "mpi", "record", "slurm", "versions",
]  # fmt: skip

#: Environment variables worth recording with every run: the knobs that change what MPI,
#: UCX, libfabric, PMI and NCCL do, and our own.
ENV_PREFIXES = (
    "OPTCC_",
    "UCX_",
    "NCCL_",
    "MPIR_CVAR_",
    "MPICH_",
    "OMPI_MCA_",
    "PRTE_MCA_",
    "PMIX_MCA_",
    "FI_",
    "PMI_",
    "MPI4PY_",
)

_REPO = Path(__file__).resolve().parent.parent.parent


def git() -> dict[str, Any]:
    """Package version, git revision and whether the checkout has uncommitted changes
    (None when it is not a git checkout: an installed wheel)."""

    home = config.get("OPTCC_HOME") or str(_REPO)

    def run(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", home, *args], capture_output=True, text=True, timeout=20, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    dirty = run("status", "--porcelain", "--untracked-files=no")
    return {
        "version": __version__,
        "git_rev": run("rev-parse", "HEAD"),
        "git_dirty": None if dirty is None else bool(dirty),
    }


def mpi() -> dict[str, Any]:
    """The MPI library mpi4py loads here (:func:`optcc_mpi.lab.launch.mpi_library`), with
    mpi4py's version; read without initialising MPI."""

    out = launch.mpi_library().to_dict()
    try:
        import mpi4py

        out["mpi4py"] = mpi4py.__version__
    except ImportError as exc:  # recorded, never raised: see the module docstring
        out["mpi4py"] = None
        out.setdefault("error", str(exc))
    return out


def load_average() -> float:
    """The machine's one-minute load average (what else competed for its cores), NaN
    where the platform has none: recorded beside every measurement."""
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - platforms without getloadavg
        return float("nan")


def launcher_record() -> dict[str, Any]:
    """The launcher :func:`optcc_mpi.lab.launch.launcher` picks here, or why there is none."""

    try:
        chosen = launch.launcher()
    except (OptccError, OSError) as exc:
        return {"error": str(exc)}
    return {**chosen.to_dict(), "describe": chosen.describe()}


def slurm() -> dict[str, str]:
    """The Slurm job this process runs in (empty outside Slurm)."""
    keys = {
        "job_id": "SLURM_JOB_ID",
        "array_job_id": "SLURM_ARRAY_JOB_ID",
        "array_task_id": "SLURM_ARRAY_TASK_ID",
        "array_task_count": "SLURM_ARRAY_TASK_COUNT",
        "array_task_min": "SLURM_ARRAY_TASK_MIN",
        "array_task_max": "SLURM_ARRAY_TASK_MAX",
        "job_name": "SLURM_JOB_NAME",
        "nodelist": "SLURM_JOB_NODELIST",
        "nnodes": "SLURM_JOB_NUM_NODES",
        "ntasks": "SLURM_NTASKS",
        "partition": "SLURM_JOB_PARTITION",
        "account": "SLURM_JOB_ACCOUNT",
        "cluster": "SLURM_CLUSTER_NAME",
        "submit_dir": "SLURM_SUBMIT_DIR",
    }
    return {k: os.environ[v] for k, v in keys.items() if os.environ.get(v)}


def versions() -> dict[str, Any]:
    """Versions of Python, the platform and the packages the results depend on."""
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    for name in ("numpy", "ml_dtypes", "h5py", "mpi4py", "scipy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["hdf5"] = h5py.version.hdf5_version  # h5py is a dependency of the package
    return out


def record() -> dict[str, Any]:
    """Where and with what a run ran: host, Slurm, MPI and launcher, versions, git, env.

    The keys ``host``, ``slurm``, ``mpi`` (``vendor``, ``version``, ``family``,
    ``standard``, ``library``, ``mpi4py``), ``python`` and ``optcc_mpi`` (``version``,
    ``git_rev``, ``git_dirty``) are what ``optcc-mpi report`` reads.
    """
    return {
        "host": socket.gethostname(),
        "slurm": slurm(),
        "mpi": mpi(),
        "launcher": launcher_record(),
        "python": sys.version.split()[0],
        "versions": versions(),
        "optcc_mpi": git(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
    }
