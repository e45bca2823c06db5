"""PyTorch: the torch.distributed backend ``optcc``, a DDP communication hook, and
in-place AllReduce of tensors.

Importing this module registers the backend ``"optcc"``
(:mod:`optcc_mpi.torch.process_group`): ``dist.init_process_group("optcc")`` and every
all-reduce of the job runs OptCC, asynchronously; everything else goes to gloo or NCCL.

Under ``torchrun`` (or ``srun`` with torch's variables) the schedules run over the
``torch.distributed`` process group itself: gloo on CPU tensors, NCCL on CUDA tensors,
no MPI library needed (:mod:`optcc_mpi.transports.distributed`). Under ``mpiexec`` they run over
MPI as before, when a communicator is given or torch.distributed is not initialised.

``allreduce(tensor, op="sum", *, group=None, comm=None, algorithm="auto", average=False)``
    Reduces a tensor in place over a process group (default: torch.distributed's default
    group) or an MPI communicator, with any of optcc_mpi's algorithms.
``comm_hook(algorithm="auto", links=None, comm=None, *, group=None, links_log=None)``
    A communication hook for ``DistributedDataParallel``: gradient buckets are averaged
    by optcc_mpi over DDP's process group (pass it as the hook's ``state``, or leave
    ``state=None`` for the default group); with ``links="watch"`` and ``links_log`` it
    records the link profiles it adopts::

        model = DistributedDataParallel(net)
        model.register_comm_hook(state=None, hook=comm_hook(links="1:0.5"))

``init_process_group_from_mpi(backend="gloo")``
    Starts ``torch.distributed``'s default process group from the ranks MPI already knows,
    so that a script launched by ``mpiexec`` or ``srun`` needs no ``torchrun``.

Where the collective runs
-------------------------
``group`` given, or neither ``group`` nor ``comm`` with torch.distributed initialised:
over that process group. ``comm`` given (an mpi4py communicator), or torch.distributed
not initialised: over MPI (CPU tensors as NumPy views, CUDA tensors through CuPy). A
process started by ``torchrun`` that did not initialise torch.distributed is refused
rather than left to reduce over an MPI world of its own (torchrun starts MPI singletons),
and a hook given an MPI communicator checks once that it holds the same processes as the
process group: gradients never silently stop being averaged.

Every rank must make the same calls with the same arguments, as for any collective. Bad
arguments raise the same error on every rank before any tensor is modified.

The torch side, one subpackage (docs/torch.md is its page)
----------------------------------------------------------
This package (``optcc_mpi.torch``) is the face; below it, from a call down to the wire::

    dist.all_reduce(t)            allreduce(t) / comm_hook()     (this face)
        |                              |
    process_group   the backend: options, its group's thread (jobs, turns), the short
        |           path per call, the host carrier
    work            a call's Work (torch's handle of it), its job queued in call order
        |           (the hook's calls too), NCCL's stream semantics for CUDA tensors
    tensors         one tensor call: its argument check, the short path's lane, the
        |           reduction into the caller's tensor
    streams         side streams and events per (group, device); devices: agreeing on
        |           CPU or CUDA across ranks
    optcc_mpi.collectives -> optcc_mpi.transports.distributed (gloo, NCCL) -> the wire

The transport stays with the other transports (:mod:`optcc_mpi.transports.distributed`: one
module behind the transport contract). This package imports the real PyTorch by absolute
import.

Examples
--------
The backend, on a world of one process (a ``HashStore`` stands in for the store torchrun
gives; under ``torchrun`` ``dist.init_process_group("optcc")`` is all it takes):

>>> import torch
>>> import torch.distributed as dist
>>> import optcc_mpi.torch  # registers the backend "optcc"
>>> dist.init_process_group("optcc", store=dist.HashStore(), rank=0, world_size=1)
>>> dist.get_backend()
'optcc'
>>> t = torch.arange(4.0)
>>> dist.all_reduce(t)  # any all_reduce of the job runs optcc_mpi's algorithms
>>> t
tensor([0., 1., 2., 3.])
>>> net = torch.nn.Linear(4, 2)
>>> model = torch.nn.parallel.DistributedDataParallel(net)  # no hook needed
>>> model(torch.ones(3, 4)).sum().backward()  # the gradient buckets too
>>> net.weight.grad
tensor([[3., 3., 3., 3.],
        [3., 3., 3., 3.]])
>>> dist.destroy_process_group()
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover - exercised only where torch is absent
    raise ImportError(
        f"optcc_mpi.torch needs PyTorch ({exc}); install it with: pip install 'optcc-mpi[torch]' "
        "(a CPU build is enough: pip install torch, from an index with PyTorch's CPU builds)"
    ) from exc

from optcc_mpi import algorithms, linklog, transports
from optcc_mpi.check import agreement
from optcc_mpi.errors import ArgumentError, ArgumentTypeError
from optcc_mpi.links import Links
from optcc_mpi.torch.process_group import OptccOptions, OptccProcessGroup, register
from optcc_mpi.torch.tensors import HALF, as_array, ours, reduce_tensor
from optcc_mpi.torch.work import OptccWork, submit
from optcc_mpi.torch.worker import worker_for

__all__ = ["allreduce", "comm_hook", "init_process_group_from_mpi", "as_array", "OptccOptions"]

# Importing this module makes "optcc" a torch.distributed backend (optcc_mpi.torch.process_group).
register()


def _communicator(comm: Any) -> Any:
    """An mpi4py communicator we can use (None: COMM_WORLD)."""
    from mpi4py import MPI  # the MPI path only: a torchrun job may have no MPI library

    if comm is None:
        return MPI.COMM_WORLD
    if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
        raise ArgumentTypeError(f"comm must be an mpi4py communicator, not {comm!r}")
    return comm


def _launched_by_torchrun() -> int:
    """``$WORLD_SIZE`` when torchrun (or torch's variables under srun) started this
    process as one of several, else 0."""
    text = os.environ.get("WORLD_SIZE", "")
    return int(text) if text.isdigit() and int(text) > 1 else 0


def _target(comm: Any, group: Any) -> tuple[Any, Any]:
    """Where the collective runs: ``(transport, mpi communicator or None)``; see the
    module docstring. Raises ArgumentError/ArgumentTypeError at once (there is nobody to
    agree with before the target is known)."""
    if comm is not None and group is not None:
        raise ArgumentError(
            "pass a process group (group=) or an MPI communicator (comm=), not both"
        )
    if group is not None or (comm is None and dist.is_available() and dist.is_initialized()):
        return transports.of(_torch_group(group)), None
    if comm is None:
        size = _launched_by_torchrun()
        if size:
            raise ArgumentError(
                f"this process was started as one of {size} (WORLD_SIZE={size}, as torchrun "
                "does) but torch.distributed is not initialised: call "
                "torch.distributed.init_process_group first (or pass comm= an MPI "
                "communicator under mpiexec)"
            )
    comm = _communicator(comm)
    return transports.of(comm), comm


def _torch_group(group: Any) -> Any:
    from optcc_mpi.transports.distributed import group_of

    return group_of(group)


def _same_processes(comm: Any, group: Any) -> None:
    """ArgumentError on every rank unless MPI communicator ``comm`` and process group
    ``group`` hold the same processes (host and process id), whatever their order."""
    me = (socket.gethostname(), os.getpid())
    ours = sorted(transports.of(_torch_group(group)).allgather(me))
    theirs = sorted(comm.allgather(me))
    if ours != theirs:
        raise ArgumentError(
            f"the MPI communicator holds {len(theirs)} process(es) but the process group "
            f"{len(ours)}, not the same ones: gradients would not be averaged over DDP's "
            "ranks (under torchrun, pass no comm: the hook uses the process group)"
        )


# -- the collective ----------------------------------------------------------------------------
def allreduce(
    tensor: torch.Tensor,
    op: str = "sum",
    *,
    group: Any = None,
    algorithm: str = "auto",
    links: Links | str | None = None,
    comm: Any = None,
    average: bool = False,
    check: bool = True,
) -> torch.Tensor:
    """Reduce ``tensor`` in place over every rank of a process group or communicator.

    Parameters
    ----------
    tensor : torch.Tensor
        Dense and contiguous. Over a process group: CPU tensors on gloo, CUDA tensors on
        NCCL, reduced by torch on their own device (on CUDA: on the current stream, no
        host copy). Over MPI: CPU tensors in their own memory (a NumPy view), CUDA
        tensors through DLPack and CuPy. Any dtype of bool, integers, float16, bfloat16,
        float32, float64 and complex. A tensor that requires grad is reduced like its
        ``.data`` (autograd does not see the change).
    op : str
        The reduction (``"sum"``, ``"max"``, ``"min"``, ...), as for
        :func:`optcc_mpi.allreduce`.
    group : torch.distributed.ProcessGroup, optional
        The process group (default: torch.distributed's default group, when it is
        initialised and no ``comm`` is given).
    algorithm : str
        ``"auto"`` or a registered algorithm name (``optcc_mpi.ALGORITHMS``).
    links : Links or str, optional
        Degraded ranks, e.g. ``"1:0.5"``, ``"probe"`` or ``"watch"``; default
        ``$OPTCC_LINKS``.
    comm : mpi4py.MPI.Comm, optional
        Reduce over this MPI communicator instead (default when torch.distributed is not
        initialised: ``COMM_WORLD``).
    average : bool
        Divide the sum by the number of ranks (floating-point tensors, ``op="sum"``).
        float32/float64 tensors are divided after the sum (one rounding); float16/bfloat16
        tensors before it, as DDP's default hook does, so that partial sums stay in range.
    check : bool
        Check arguments across ranks: two small collectives per call (this module's and
        :func:`optcc_mpi.allreduce`'s). Turn off only when the arguments are known to agree.

    Returns
    -------
    torch.Tensor
        ``tensor`` itself, holding the result (the same bits on every rank).

    Raises
    ------
    ArgumentError, ArgumentTypeError
        On every rank, before any tensor is modified, if any rank's arguments are bad or
        the ranks disagree (element count, dtype, op, algorithm, link profile, average);
        at once for a ``group`` and a ``comm`` together, or a process started by torchrun
        without torch.distributed initialised.

    Examples
    --------
    Under ``torchrun --nproc-per-node 4 script.py`` after ``dist.init_process_group("gloo")``:

    >>> g = torch.full((1000,), float(dist.get_rank()))  # doctest: +SKIP
    >>> optcc_mpi.torch.allreduce(g, average=True, links="1:0.5")  # doctest: +SKIP
    >>> g[0].item()  # doctest: +SKIP
    1.5
    """
    half = average and isinstance(tensor, torch.Tensor) and tensor.dtype in HALF
    wire, mpi_comm = _target(comm, group)
    if mpi_comm is not None:
        return reduce_tensor(tensor, op, algorithm, links, wire, mpi_comm, average, check, half)
    # Over a process group, in the group's order: after the hook's buckets and the optcc
    # backend's reductions already queued on it (their messages share its groups).
    work = _queue(
        group,
        wire,
        [tensor] if isinstance(tensor, torch.Tensor) else [],
        lambda w: reduce_tensor(tensor, op, algorithm, links, w, None, average, check, half),
    )
    work.wait()
    return tensor


def _queue(
    group: Any, wire: Any, tensors: list[torch.Tensor], job: Callable[[Any], object]
) -> OptccWork:
    """``job(transport)`` on the ordered thread of ``group`` (None: the default group):
    the ``optcc`` backend's own thread for its groups, else the thread of ``wire``."""
    pg = _torch_group(group)
    if isinstance(pg, OptccProcessGroup):
        return pg.run(tensors, job)
    return submit(worker_for(wire), tensors, lambda: job(wire), _NO_LIMIT)


#: How long a reduction over a process group not of the optcc backend may take: the
#: library underneath times out first (its group's timeout).
_NO_LIMIT = datetime.timedelta(days=365)


# -- DistributedDataParallel -------------------------------------------------------------------
def comm_hook(
    algorithm: str = "auto",
    links: Links | str | None = None,
    comm: Any = None,
    *,
    group: Any = None,
    check: bool = True,
    links_log: str | os.PathLike[str] | None = None,
) -> Callable[[Any, Any], torch.futures.Future[torch.Tensor]]:
    """A DDP communication hook that averages gradient buckets with optcc_mpi.

    Use it in place of DDP's default all-reduce::

        model = torch.nn.parallel.DistributedDataParallel(net)
        model.register_comm_hook(state=None, hook=comm_hook(links="1:0.5"))

    Each bucket is divided by the number of ranks in its own dtype and then summed in place,
    which is what DDP's default hook does (division first, so that float16 partial sums
    stay in range); float32, float64, float16 and bfloat16 buckets are reduced in their own
    dtype. The result is the same bits on every rank.

    Over which ranks: DDP's process group. Pass it as the hook's state
    (``register_comm_hook(state=model.process_group, ...)``) or as ``group``; with neither,
    the default group. Under mpiexec, ``comm`` may name an MPI communicator instead; it is
    checked once (at the first bucket) to hold the same processes as the process group.

    Parameters
    ----------
    algorithm : str
        ``"auto"`` or a registered algorithm name (``optcc_mpi.ALGORITHMS``).
    links : Links or str, optional
        Degraded ranks, e.g. ``"1:0.5"``, ``"probe"`` or ``"watch"``; default
        ``$OPTCC_LINKS``.
    comm : mpi4py.MPI.Comm, optional
        Average over this MPI communicator rather than over the process group.
    group : torch.distributed.ProcessGroup, optional
        The process group (default: the hook's ``state`` if it is one, else the default
        group).
    check : bool
        Check each bucket's arguments across ranks (two small collectives per bucket).
    links_log : str or path, optional
        With ``links="watch"``: append what the watch adopts and which algorithm each
        bucket ran to this JSON-lines file (rank 0 writes; :mod:`optcc_mpi.linklog`,
        ``optcc-mpi report --links FILE`` draws it). Default ``$OPTCC_LINKS_LOG``. The
        watch of a process group is made at its first watched call and keeps its log, so
        the record starts at the hook's first bucket (if nothing watched that group
        before).

    Returns
    -------
    callable
        ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``. Over a process
        group the bucket is reduced on the group's ordered thread (the ``optcc``
        backend's own, for a group of that backend) and the future completes when it is:
        the backward pass goes on meanwhile. Over an MPI communicator the bucket is
        reduced before the hook returns.

    Raises
    ------
    ArgumentError, ArgumentTypeError
        At once, for an unknown algorithm, a malformed link profile, a profile naming a
        rank outside the ranks averaged over, a bad ``comm``/``group``, or a
        ``links_log`` without ``links="watch"`` (or naming a folder); at the first
        bucket, on every rank, when ``comm`` and the process group are not the same
        processes.

    Examples
    --------
    On a gloo group of one process (under ``torchrun``, ``dist.init_process_group("gloo")``):

    >>> import torch
    >>> import torch.distributed as dist
    >>> import optcc_mpi
    >>> from optcc_mpi.torch import comm_hook
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> net = torch.nn.Linear(4, 2)
    >>> model = torch.nn.parallel.DistributedDataParallel(net)
    >>> model.register_comm_hook(state=None, hook=comm_hook(algorithm="ring"))
    >>> model(torch.ones(3, 4)).sum().backward()  # buckets averaged by the hook
    >>> optcc_mpi.collectives.last_stats()["algorithm"]
    'ring'
    >>> net.weight.grad
    tensor([[3., 3., 3., 3.],
            [3., 3., 3., 3.]])

    A profile naming a rank the group does not have fails at registration, not in the
    backward pass:

    >>> comm_hook(links="3:0.5")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    optcc_mpi.errors.ArgumentError: link profile names rank 3, outside the communicator...
    >>> dist.destroy_process_group()
    """
    if comm is not None and group is not None:
        raise ArgumentError(
            "pass a process group (group=) or an MPI communicator (comm=), not both"
        )
    if comm is not None:
        comm = _communicator(comm)
        size = comm.Get_size()
    elif group is not None or (dist.is_available() and dist.is_initialized()):
        size = dist.get_world_size(_torch_group(group))
    else:
        size = 0  # torch.distributed starts before DDP: sizes are checked at the first bucket
    # Fail at registration, not in the middle of the first backward pass.
    if not isinstance(algorithm, str):
        raise ArgumentTypeError(f"algorithm must be a string, not {type(algorithm).__name__}")
    if algorithm != "auto":
        algorithms.get(algorithm)
    if not (isinstance(links, str) and links.strip().lower() in ("probe", "watch")):
        try:
            link_obj = Links.coerce(links)
            if size:
                link_obj.check(size)
        except (ValueError, TypeError) as exc:
            raise ours(exc) from exc
    if links_log is not None:
        if not (isinstance(links, str) and links.strip().lower() == "watch"):
            raise ArgumentError(
                f"links_log records what links='watch' adopts; pass links='watch' (links is "
                f"{links!r})"
            )
        try:
            linklog.LinkLog(links_log)  # a bad name fails now, not in the backward pass
        except (ValueError, TypeError) as exc:
            raise ours(exc) from exc
    checked: list[Any] = []  # the (wire, mpi comm) of the first bucket, checked once

    def optcc_allreduce_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        if not checked:
            pg = group if group is not None else state if _is_group(state) else None
            if comm is not None and dist.is_available() and dist.is_initialized():
                _same_processes(comm, pg)
            checked.append((pg, *_target(comm, pg)))
            first = True
        else:
            first = False
        pg, wire, mpi_comm = checked[0]
        tensor = bucket.buffer()

        # Divide first, in the bucket's dtype, like DDP's default hook (after the checks,
        # so that a bad bucket is reported before anything changes). The first bucket's
        # call makes the group's watch, which takes the log in force and keeps it.
        def job(w: Any) -> None:
            with linklog.recording(links_log if first else None):
                reduce_tensor(tensor, "sum", algorithm, links, w, mpi_comm, True, check, True)

        if mpi_comm is None:
            # Off the backward pass: the future completes when the bucket is reduced.
            work = _queue(pg, wire, [tensor], job)
            return work.get_future().then(lambda fut: fut.value()[0])
        job(wire)  # MPI: reduced here (an MPI library's thread support is not assumed)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
            devices=[tensor.device] if tensor.is_cuda else None
        )
        fut.set_result(tensor)
        return fut

    # DDP inspects the hook's annotations and accepts only the real objects, not the
    # strings `from __future__ import annotations` leaves.
    optcc_allreduce_hook.__annotations__ = {
        "state": Any,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    optcc_allreduce_hook.algorithm = algorithm  # type: ignore[attr-defined]
    optcc_allreduce_hook.links = links  # type: ignore[attr-defined]
    optcc_allreduce_hook.links_log = links_log  # type: ignore[attr-defined]
    return optcc_allreduce_hook


def _is_group(obj: Any) -> bool:
    return dist.is_available() and isinstance(obj, dist.ProcessGroup)


def init_process_group_from_mpi(
    backend: str = "gloo",
    *,
    comm: Any = None,
    master_addr: str | None = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=5),
) -> Any:
    """Start ``torch.distributed``'s default process group with the ranks of an MPI job.

    Rank and world size come from ``comm``; rank 0 opens a ``TCPStore`` on a free port (or
    on ``$MASTER_PORT`` if set) and tells the others its address and port by an MPI
    broadcast, so no ``torchrun``, ``MASTER_PORT`` or shared file system is needed.

    Parameters
    ----------
    backend : str
        The process-group backend (``"gloo"`` on CPUs, ``"nccl"`` on GPUs).
    comm : mpi4py.MPI.Comm, optional
        Whose ranks to use (default ``COMM_WORLD``); process-group rank = MPI rank.
    master_addr : str, optional
        Address of rank 0 as the others reach it (rank 0's value counts). Default
        ``$MASTER_ADDR``, else ``127.0.0.1`` when every rank is on one host, else rank 0's
        host name.
    timeout : datetime.timedelta
        For the store and the process group's operations.

    Returns
    -------
    torch.distributed.ProcessGroup
        The default group (``torch.distributed.group.WORLD``).

    Raises
    ------
    ArgumentError
        On every rank: a bad backend or ``$MASTER_PORT``, torch.distributed unavailable,
        already initialised on some ranks only or with other ranks, or the store could not
        be opened or reached.
    """
    comm = _communicator(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    priv = comm.Dup()  # the bootstrap's messages never meet the user's
    try:
        # Every per-rank input is read before the first agreement, so that a bad one is an
        # error on every rank rather than a hang.
        error = None
        started = dist.is_available() and dist.is_initialized()
        port = 0
        if not isinstance(backend, str):
            error = f"backend must be a string such as 'gloo', not {type(backend).__name__}"
        elif not dist.is_available():
            error = "this PyTorch build has no torch.distributed"
        elif started and (dist.get_rank(), dist.get_world_size()) != (rank, size):
            error = (
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but this is MPI rank {rank} of {size}"
            )
        else:
            text = os.environ.get("MASTER_PORT", "0").strip() or "0"
            if not text.isdigit() or int(text) > 65535:
                error = f"MASTER_PORT={text!r} is not a port number (0..65535)"
            else:
                port = int(text)
        agreement.agree(priv, error, what="init_process_group_from_mpi")
        states = priv.allgather(started)
        if all(states):
            return dist.group.WORLD  # every rank already matches its MPI rank
        if any(states):
            raise ArgumentError(
                "init_process_group_from_mpi: torch.distributed is already initialised on "
                f"ranks {[r for r, s in enumerate(states) if s]} but not on the others"
            )

        # Rank 0 chooses the address and the port; the others take its choice.
        hosts = priv.allgather(socket.gethostname())
        if master_addr is None:
            master_addr = os.environ.get("MASTER_ADDR") or (
                "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
            )
        store = None
        if rank == 0:
            try:
                # Port 0: the store binds a free port and reports it, without a race.
                store = dist.TCPStore(
                    master_addr, port, size, True, timeout=timeout, wait_for_workers=False
                )
                port = store.port
            except Exception as exc:  # RuntimeError/DistStoreError from c10d
                error = f"rank 0 could not open a TCPStore on {master_addr}:{port}: {exc}"
        master_addr, port, root_error = priv.bcast((master_addr, port, error), root=0)
        if root_error is None and rank != 0:
            try:
                store = dist.TCPStore(master_addr, port, size, False, timeout=timeout)
            except Exception as exc:
                error = (
                    f"could not reach rank 0's TCPStore at {master_addr}:{port} ({exc}); "
                    "set MASTER_ADDR to an address of rank 0's host that this host can reach"
                )
        agreement.agree(priv, root_error or error, what="init_process_group_from_mpi")
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
        return dist.group.WORLD
    finally:
        priv.Free()
