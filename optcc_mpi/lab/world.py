"""Who this process runs with: the ranks of an MPI job or of a ``torchrun`` job.

A command that measures (``optcc-mpi bench``, ``optcc-mpi doctor``, ``optcc-mpi lab
ddp``) runs on every rank of a job, and the job may have been started in two ways:

* by an MPI launcher (``mpiexec``, ``srun --mpi=...``, ``optcc-mpi testbed run``), which
  tells each process who it is through its own variables (``PMI_RANK``,
  ``OMPI_COMM_WORLD_RANK``, ``PMIX_RANK``, ...);
* by ``torchrun`` (or ``srun`` with torch's variables set), which sets ``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` and nothing of MPI's.

Its collectives then travel over a *transport* (:mod:`optcc_mpi.transports`): ``mpi``
(MPI point-to-point on ``MPI.COMM_WORLD``) or ``gloo`` (torch.distributed's default
process group on the gloo backend). Any launcher can carry the gloo transport: under
``torchrun`` the group starts from torch's variables, under an MPI launcher from the MPI
ranks (:func:`optcc_mpi.torch.init_process_group_from_mpi`: rank 0's host and a free
port, told to the others over MPI). Only an MPI launcher can carry the MPI transport:
``torchrun`` starts every process as an MPI job of its own, so a command asked for MPI
there is refused rather than left to run ``WORLD_SIZE`` separate one-rank jobs.

:func:`start` gives a command what its collectives run over; :func:`end` ends a process
group that :func:`start` (or :func:`torch_group`) started.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from optcc_mpi.errors import ArgumentError

__all__ = ["TRANSPORTS", "MPI_VARIABLES", "started_by", "default_transport", "start", "end"]

#: The transports a command can run over.
TRANSPORTS = ("mpi", "gloo")
#: Variables MPI launchers give their ranks (MPICH's hydra and PMI-1/2, Open MPI, PMIx,
#: Slurm's PMI plugins): any of them means an MPI launcher started this process.
MPI_VARIABLES = (
    "PMI_RANK",
    "PMI_SIZE",
    "PMI_FD",
    "PMIX_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "MPI_LOCALNRANKS",
)


def started_by(env: Mapping[str, str] | None = None) -> str:
    """How this process was started: ``"mpi"`` (an MPI launcher's variables are set),
    ``"torchrun"`` (torch's ``RANK`` and ``WORLD_SIZE`` are, and no MPI launcher's), or
    ``"none"`` (a plain process)."""
    env = os.environ if env is None else env
    if any(k in env for k in MPI_VARIABLES):
        return "mpi"
    if env.get("RANK", "").isdigit() and env.get("WORLD_SIZE", "").isdigit():
        return "torchrun"
    return "none"


def default_transport(env: Mapping[str, str] | None = None) -> str:
    """``"gloo"`` under ``torchrun``, else ``"mpi"``."""
    return "gloo" if started_by(env) == "torchrun" else "mpi"


def start(transport: str | None = None) -> tuple[Any, bool]:
    """What a command's collectives run over, started if needed.

    Parameters
    ----------
    transport : {"mpi", "gloo"}, optional
        Default :func:`default_transport`.

    Returns
    -------
    wire : mpi4py communicator or torch.distributed.ProcessGroup
        ``MPI.COMM_WORLD``, or torch.distributed's default group.
    started : bool
        Whether this call started the process group (pass it to :func:`end`).

    Raises
    ------
    ArgumentError
        An unknown transport, or the MPI transport in a process that ``torchrun`` started
        (no MPI launcher): every process would be a job of its own.
    """
    transport = default_transport() if transport is None else transport
    if transport not in TRANSPORTS:
        raise ArgumentError(f"unknown transport {transport!r}; choose from {', '.join(TRANSPORTS)}")
    if transport == "mpi":
        if started_by() == "torchrun":
            raise ArgumentError(
                f"started by torchrun (RANK={os.environ['RANK']}, WORLD_SIZE="
                f"{os.environ['WORLD_SIZE']}) without an MPI launcher: over MPI every "
                "process would be a job of one rank. Use --transport gloo (the default "
                "under torchrun), or launch with mpiexec/srun"
            )
        from mpi4py import MPI

        return MPI.COMM_WORLD, False
    return torch_group()


def torch_group() -> tuple[Any, bool]:
    """torch.distributed's default group, started on gloo if it is not yet: from torch's
    variables under ``torchrun``, from the MPI ranks under an MPI launcher, as a group of
    one in a plain process. Returns the group and whether this call started it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.group.WORLD, False
    how = started_by()
    if how == "torchrun":
        dist.init_process_group("gloo")
    elif how == "mpi":
        from optcc_mpi.torch import init_process_group_from_mpi

        init_process_group_from_mpi("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD, True


def end(started: bool) -> None:
    """End the default process group if :func:`start` started it (after a barrier, so
    that no rank tears its connections down while another still uses them: gloo's
    threads still running at exit abort the process)."""
    if not started:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
