"""Every ``OPTCC_*`` environment variable the package reads, in one table.

Code reads them only through :func:`get`, so this table is complete by construction:
asking for a name that is not in it is a programming error. ``optcc-mpi info`` prints the
values in force; ``docs/config.md`` is generated from :func:`markdown`.

Variables that only the shell scripts under ``jobs/`` read (``OPTCC_HOME``,
``OPTCC_VENV``, ``OPTCC_TC_*``, ...) are documented in ``docs/slurm.md`` beside them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Variable", "VARIABLES", "get", "is_set", "markdown"]


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, default (None: unset) and meaning."""

    name: str
    default: str | None
    meaning: str
    topic: str


_ALL = (
    # Collectives
    Variable(
        "OPTCC_LINKS",
        None,
        "Link profile used when `allreduce` gets no `links`: `RANK:FRACTION,...` in "
        "COMM_WORLD ranks, or `probe`.",
        "collectives",
    ),
    Variable(
        "OPTCC_EMULATE",
        None,
        "Software link emulation used when `allreduce` gets no `emulate`, e.g. "
        "`bw=200MB/s,latency=20us`.",
        "collectives",
    ),
    Variable(
        "OPTCC_EMULATE_FRACTION",
        None,
        "This process's own bandwidth fraction under emulation (set per rank by "
        "`jobs/degrade-wrapper.sh`).",
        "collectives",
    ),
    Variable(
        "OPTCC_LINKS_LOG",
        None,
        'JSON-lines file to which `links="watch"` and `optcc-mpi doctor` append the '
        "profiles they adopt or find (`optcc_mpi.linklog`; rank 0 writes).",
        "collectives",
    ),
    Variable(
        "OPTCC_FASTCALL",
        "1",
        "`0` turns off the compiled call path of short `allreduce` calls "
        "(`optcc_mpi.fastcall`; the Python path gives the same results).",
        "collectives",
    ),
    Variable(
        "OPTCC_CUDA_AWARE",
        None,
        "`1`/`0`: force whether the MPI library is taken as CUDA-aware (default: detected).",
        "collectives",
    ),
    # Simulator
    Variable(
        "OPTCC_SIM",
        None,
        "`python`: use the pure-Python simulator even where the compiled event loop exists.",
        "simulator",
    ),
    Variable(
        "OPTCC_CACHE",
        None,
        "Folder for files built at run time (default `~/.cache/optcc_mpi`).",
        "simulator",
    ),
    # Data and training
    Variable(
        "OPTCC_DATA_HOME",
        None,
        "Folder searched for dataset names before the shipped `data/` folder.",
        "data",
    ),
    Variable(
        "OPTCC_GLM_EXIT_AFTER",
        None,
        "Testing aid: exit with status 75 after this many CA-SGD rounds (kill-and-resume tests).",
        "training",
    ),
    # Lab: testbed, launching and sweeps
    Variable(
        "OPTCC_TESTBED_NAME",
        None,
        "Name of the namespace testbed a process runs in (set by `optcc-mpi testbed run`).",
        "lab",
    ),
    Variable(
        "OPTCC_TESTBED_STATE_DIR",
        None,
        "Folder holding testbed state files (default under /run or the cache folder).",
        "lab",
    ),
    Variable(
        "OPTCC_MPIEXEC",
        None,
        "The `mpiexec` to launch ranks with (default: the one beside the Python "
        "interpreter, then PATH).",
        "lab",
    ),
    Variable(
        "OPTCC_LAUNCHER",
        None,
        "Launching ranks (demo, sweeps): the launcher's words, `{ranks}` replaced (default: "
        "srun inside a Slurm allocation, else the MPI library's own mpiexec; docs/mpi.md).",
        "lab",
    ),
    Variable(
        "OPTCC_SRUN_MPI",
        None,
        "The `srun --mpi=` plugin (default `pmi2` for MPICH, `pmix` for Open MPI).",
        "lab",
    ),
    Variable("OPTCC_PROGRAM", None, "Sweeps: the program each task runs.", "lab"),
    Variable("OPTCC_HOME", None, "Sweeps and job scripts: the project checkout.", "lab"),
    Variable(
        "OPTCC_STRAGGLER_PROCIDS",
        None,
        "Job scripts: Slurm process ids to degrade.",
        "lab",
    ),
    Variable("OPTCC_STRAGGLER_NODEIDS", None, "Job scripts: Slurm node ids to degrade.", "lab"),
    Variable(
        "OPTCC_STRAGGLER_FRACTION",
        None,
        "Job scripts: bandwidth fraction of the degraded ranks.",
        "lab",
    ),
    Variable(
        "OPTCC_DEGRADE_METHOD",
        None,
        "Job scripts: `emulate` or `tc` (how `degrade-wrapper.sh` degrades a rank).",
        "lab",
    ),
)

#: Every variable by name.
VARIABLES: dict[str, Variable] = {v.name: v for v in _ALL}


def get(name: str) -> str | None:
    """The value of variable ``name`` (its default when unset or empty)."""
    var = VARIABLES[name]  # KeyError: read a variable that is not in the table
    value = os.environ.get(name, "")
    return value if value.strip() else var.default


def is_set(name: str) -> bool:
    """Whether variable ``name`` is set to something non-empty."""
    return get(name) is not None


def markdown() -> str:
    """The table of variables, as Markdown (``docs/config.md``)."""
    lines = ["| variable | topic | meaning |", "|---|---|---|"]
    for v in _ALL:
        lines.append(f"| `{v.name}` | {v.topic} | {v.meaning} |")
    return "\n".join(lines) + "\n"
