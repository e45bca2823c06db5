"""PyTorch: in-place AllReduce of tensors, and a DDP communication hook.

``allreduce(tensor, op="sum", *, algorithm="auto", links=None, comm=None, average=False)``
    Reduces a tensor in place over an MPI communicator with any of optcc_mpi's algorithms.
    CPU tensors are reduced in their own memory (a NumPy view, no copy); CUDA tensors are
    handed to CuPy through DLPack (no copy either).
``comm_hook(algorithm="auto", links=None, comm=None)``
    A communication hook for ``DistributedDataParallel``: gradient buckets are averaged
    over the communicator by optcc_mpi instead of by the process group::

        model = DistributedDataParallel(net)
        model.register_comm_hook(state=None, hook=comm_hook(links="1:0.5"))

``init_process_group_from_mpi(backend="gloo")``
    Starts ``torch.distributed``'s default process group from the ranks MPI already knows,
    so that a script launched by ``mpiexec`` or ``srun`` needs no ``torchrun``.

Every rank must make the same calls with the same arguments, as for any collective. Bad
arguments raise the same error on every rank before any tensor is modified.

This module is ``optcc_mpi.torch``; it imports the real PyTorch by absolute import.
"""

from __future__ import annotations

import datetime
import os
import socket
import zlib
from collections.abc import Callable
from typing import Any

import ml_dtypes

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover - exercised only where torch is absent
    raise ImportError(
        f"optcc_mpi.torch needs PyTorch ({exc}); install it with: pip install 'optcc-mpi[torch]' "
        "(a CPU build is enough: pip install torch, from an index with PyTorch's CPU builds)"
    ) from exc

import optcc_mpi
from optcc_mpi import agreement, algorithms
from optcc_mpi.errors import ArgumentError, ArgumentTypeError
from optcc_mpi.links import Links

__all__ = ["allreduce", "comm_hook", "init_process_group_from_mpi", "as_array"]

#: Tensor dtypes reduced in their own precision after dividing, as DDP's default hook does.
_HALF = (torch.float16, torch.bfloat16)


# -- tensors as arrays ---------------------------------------------------------------------------
def as_array(tensor: torch.Tensor) -> Any:
    """A 1-D NumPy (CPU) or CuPy (CUDA) array over the memory of ``tensor``, without a copy.

    Writing to the array writes to the tensor. bfloat16 tensors become
    ``ml_dtypes.bfloat16`` arrays (a reinterpretation of the same 16-bit words).

    Parameters
    ----------
    tensor : torch.Tensor
        Dense, contiguous, on the CPU or a CUDA device.

    Returns
    -------
    numpy.ndarray or cupy.ndarray

    Raises
    ------
    ArgumentTypeError
        ``tensor`` is not a tensor, or its dtype has no NumPy equivalent.
    ArgumentError
        The tensor is sparse, not contiguous, a lazy conjugate/negative view, or on a device
        other than the CPU and CUDA (or on CUDA where CuPy is not usable).
    """
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(
            f"expected a torch.Tensor, got {type(tensor).__module__}.{type(tensor).__name__}"
        )
    if tensor.layout != torch.strided:
        raise ArgumentError(f"{tensor.layout} tensors are not supported; pass a dense tensor")
    if not tensor.is_contiguous():
        # A copy would not be in place; the caller decides whether to make one.
        raise ArgumentError(
            f"tensor of shape {tuple(tensor.shape)} is not contiguous; "
            "reduce tensor.contiguous() and copy the result back"
        )
    if tensor.is_conj() or tensor.is_neg():
        raise ArgumentError("tensor is a lazy conjugate/negative view; call .resolve_conj() first")
    # detach(): same memory, but NumPy may then see a tensor that requires grad.
    flat = tensor.detach().reshape(-1)
    bf16 = tensor.dtype == torch.bfloat16
    if bf16:
        # NumPy has no bfloat16; the same bits as int16, then reinterpreted by ml_dtypes.
        flat = flat.view(torch.int16)
    if tensor.device.type == "cpu":
        try:
            arr = flat.numpy()
        except TypeError as exc:
            raise ArgumentTypeError(f"tensor dtype {tensor.dtype} is not supported: {exc}") from exc
        return arr.view(ml_dtypes.bfloat16) if bf16 else arr
    if tensor.device.type == "cuda":
        return _cuda_array(flat, bf16)
    raise ArgumentError(
        f"tensors on {tensor.device.type!r} are not supported; use a CPU or CUDA tensor"
    )


def _cuda_array(flat: torch.Tensor, bf16: bool) -> Any:
    """A CuPy view of a CUDA tensor, after PyTorch's queued work on it has finished."""
    from optcc_mpi.backend import get_cupy

    cp = get_cupy()
    if cp is None:
        raise ArgumentError(
            "CUDA tensors need CuPy with a usable GPU (pip install 'optcc-mpi[gpu]'); "
            "or move the tensor to the CPU"
        )
    # optcc_mpi works on CuPy's stream: kernels PyTorch queued on its own stream (the
    # backward pass that produced a gradient) must be complete before we read the memory.
    torch.cuda.current_stream(flat.device).synchronize()
    with cp.cuda.Device(flat.device.index):
        arr = cp.from_dlpack(flat)
    return arr.view(ml_dtypes.bfloat16) if bf16 else arr


def _check_average(tensor: torch.Tensor, op: str, average: bool) -> None:
    if not isinstance(average, bool):
        raise ArgumentTypeError(f"average must be True or False, not {average!r}")
    if not average:
        return
    if op != "sum":
        raise ArgumentError(f"average=True averages a sum; it cannot be used with op={op!r}")
    if not (tensor.is_floating_point() or tensor.is_complex()):
        raise ArgumentError(
            f"average=True needs a floating-point tensor, not {tensor.dtype}; "
            "reduce with op='sum' and divide yourself"
        )


def _communicator(comm: Any) -> Any:
    from mpi4py import MPI

    if comm is None:
        return MPI.COMM_WORLD
    if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
        raise ArgumentTypeError(f"comm must be an mpi4py communicator, not {comm!r}")
    return comm


# -- our own traffic never matches the user's --------------------------------------------------
_KEYVAL: list[Any] = []


def _private(comm: Any) -> Any:
    """A duplicate of ``comm`` cached on it (freed with it), for this module's messages."""
    from mpi4py import MPI

    if not _KEYVAL:
        _KEYVAL.append(MPI.Comm.Create_keyval(delete_fn=lambda obj, key, val: val.Free()))
    dup = comm.Get_attr(_KEYVAL[0])
    if dup is None:
        dup = comm.Dup()
        comm.Set_attr(_KEYVAL[0], dup)
    return dup


_FIELDS = ("error", "element count", "dtype", "op", "algorithm", "link profile", "average")


def _code(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _ours(exc: Exception) -> Exception:
    """``exc`` as one of optcc_mpi's error classes (same message)."""
    if isinstance(exc, (ArgumentError, ArgumentTypeError)):
        return exc
    cls = ArgumentTypeError if isinstance(exc, TypeError) else ArgumentError
    new = cls(str(exc))
    new.__cause__ = exc
    return new


def _check_local(
    tensor: Any, op: Any, algorithm: Any, links: Any, average: Any, p: int
) -> tuple[Any, list[int], dict[str, str]]:
    """This rank's checks. Returns the array view of ``tensor``, the signature every rank
    must share (element count, dtype, op, algorithm, link profile, average) and its
    readable form."""
    from optcc_mpi.dtypes import check_dtype, check_op

    opname = check_op(op)
    _check_average(tensor, opname, average)
    if not isinstance(algorithm, str):
        raise ArgumentTypeError(f"algorithm must be a string, not {type(algorithm).__name__}")
    if algorithm != "auto":
        algorithms.get(algorithm)  # the error names the choices
    if links is None:
        # $OPTCC_LINKS is optcc_mpi.allreduce's to read and check (it may translate the
        # job's numbering to this communicator's).
        profile = "default"
    elif isinstance(links, str) and links.strip().lower() == "probe":
        profile = "probe"
    else:
        link_obj = Links.coerce(links)
        link_obj.check(p)
        profile = str(link_obj)
    arr = as_array(tensor)
    check_dtype(arr.dtype)
    shown = {
        "dtype": str(tensor.dtype),
        "op": opname,
        "algorithm": algorithm,
        "link profile": profile,
    }
    sig = [arr.size, *(_code(shown[f]) for f in _FIELDS[2:6]), int(average)]
    return arr, sig, shown


def _agree(comm: Any, sig: list[int], error: Exception | None, shown: dict[str, str]) -> None:
    """One small collective (:func:`optcc_mpi.agreement.agree_fields` over the signature):
    raise the same error on every rank if any rank found an error or the ranks disagree."""
    priv = _private(comm)
    lo, hi = agreement.agree_fields(priv, sig)
    what = "optcc_mpi.torch.allreduce"
    if hi[0]:
        # Somebody failed: share the words (a second collective, on the error path only).
        agreement.agree(
            priv, None if error is None else _ours(error), what=f"{what}: arguments rejected"
        )
    for i in range(1, len(sig)):
        if hi[i] != lo[i]:
            field = _FIELDS[i]
            if field in ("element count", "average"):
                detail = f"{lo[i]} on some ranks, {hi[i]} on others (this rank: {sig[i]})"
            else:
                detail = f"this rank has {shown[field]}"
            raise ArgumentError(f"{what}: {field} differs across ranks: {detail}")


# -- the collective ----------------------------------------------------------------------------
def allreduce(
    tensor: torch.Tensor,
    op: str = "sum",
    *,
    algorithm: str = "auto",
    links: Links | str | None = None,
    comm: Any = None,
    average: bool = False,
    check: bool = True,
) -> torch.Tensor:
    """Reduce ``tensor`` in place over every rank of ``comm``.

    Parameters
    ----------
    tensor : torch.Tensor
        Dense and contiguous, on the CPU (reduced in its own memory, no copy) or a CUDA
        device (through DLPack and CuPy). Any dtype :func:`optcc_mpi.allreduce` accepts:
        float32, float64, float16, bfloat16 and integers. A tensor that requires grad is
        reduced like its ``.data`` (autograd does not see the change).
    op : str
        The reduction (``"sum"``, ``"max"``, ``"min"``, ...), as for
        :func:`optcc_mpi.allreduce`.
    algorithm : str
        ``"auto"`` or a registered algorithm name (``optcc_mpi.ALGORITHMS``).
    links : Links or str, optional
        Degraded ranks, e.g. ``"1:0.5"``, or ``"probe"``; default ``$OPTCC_LINKS``.
    comm : mpi4py.MPI.Comm, optional
        The communicator (default ``COMM_WORLD``).
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
        the ranks disagree (element count, dtype, op, algorithm, link profile, average).

    Examples
    --------
    Under ``mpiexec -n 4 python -m mpi4py script.py``:

    >>> g = torch.full((1000,), float(rank))  # doctest: +SKIP
    >>> optcc_mpi.torch.allreduce(g, average=True, links="1:0.5")  # doctest: +SKIP
    >>> g[0].item()  # doctest: +SKIP
    1.5
    """
    half = average and isinstance(tensor, torch.Tensor) and tensor.dtype in _HALF
    return _reduce(tensor, op, algorithm, links, comm, average, check, divide_first=half)


def _reduce(
    tensor: Any,
    op: Any,
    algorithm: Any,
    links: Any,
    comm: Any,
    average: Any,
    check: bool,
    *,
    divide_first: bool,
) -> torch.Tensor:
    """The reduction behind :func:`allreduce` and the hook. With ``average``, the division
    by the number of ranks comes before the sum if ``divide_first``, else after it."""
    # Without a valid communicator there is nobody to agree with: raise at once.
    comm = _communicator(comm)
    p = comm.Get_size()
    error: Exception | None = None
    sig = [0] * len(_FIELDS)
    shown: dict[str, str] = {}
    arr = None
    try:
        arr, sig[1:], shown = _check_local(tensor, op, algorithm, links, average, p)
    except (ValueError, TypeError) as exc:
        error = exc
        sig[0] = 1
    if check and p > 1:
        # Everything optcc_mpi.allreduce would reject (bar $OPTCC_* variables) is rejected
        # here already, before a division first modifies the tensor.
        _agree(comm, sig, error, shown)
    elif error is not None:
        raise _ours(error)
    if average and divide_first:
        tensor.detach().div_(p)  # detach: a parameter is divided like its .data
    if tensor.is_cuda:
        # PyTorch's queued kernels (the division, the backward pass) must finish before
        # CuPy's stream reads the memory.
        torch.cuda.current_stream(tensor.device).synchronize()
    optcc_mpi.allreduce(
        optcc_mpi.IN_PLACE, arr, op=op, comm=comm, algorithm=algorithm, links=links, check=check
    )
    if tensor.is_cuda:
        # The result was written on CuPy's stream; PyTorch's stream must see it.
        from optcc_mpi.backend import get_cupy

        get_cupy().cuda.get_current_stream().synchronize()
    if average and not divide_first:
        tensor.detach().div_(p)  # detach: a parameter is divided like its .data
    return tensor


# -- DistributedDataParallel -------------------------------------------------------------------
def comm_hook(
    algorithm: str = "auto",
    links: Links | str | None = None,
    comm: Any = None,
    *,
    check: bool = True,
) -> Callable[[Any, Any], torch.futures.Future[torch.Tensor]]:
    """A DDP communication hook that averages gradient buckets with optcc_mpi.

    Use it in place of DDP's default all-reduce::

        model = torch.nn.parallel.DistributedDataParallel(net)
        model.register_comm_hook(state=None, hook=comm_hook(links="1:0.5"))

    Each bucket is divided by the number of ranks in its own dtype and then summed in place
    over ``comm``, which is what DDP's default hook does (division first, so that float16
    partial sums stay in range); float32, float64, float16 and bfloat16 buckets are reduced
    in their own dtype. The result is the same bits on every rank.

    Parameters
    ----------
    algorithm : str
        ``"auto"`` or a registered algorithm name (``optcc_mpi.ALGORITHMS``).
    links : Links or str, optional
        Degraded ranks, e.g. ``"1:0.5"``, or ``"probe"``; default ``$OPTCC_LINKS``.
    comm : mpi4py.MPI.Comm, optional
        The ranks to average over (default ``COMM_WORLD``). It must hold the same processes
        as DDP's process group; :func:`init_process_group_from_mpi` makes the two match.
    check : bool
        Check each bucket's arguments across ranks (two small collectives per bucket).

    Returns
    -------
    callable
        ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``; ``state`` is ignored
        (pass ``state=None``). The future is already complete: the reduction runs when DDP
        calls the hook, on the thread running the backward pass.

    Raises
    ------
    ArgumentError, ArgumentTypeError
        At once, for an unknown algorithm, a malformed link profile, a profile naming a
        rank outside ``comm``, or a non-communicator.
    """
    comm = _communicator(comm)
    p = comm.Get_size()
    # Fail at registration, not in the middle of the first backward pass.
    if not isinstance(algorithm, str):
        raise ArgumentTypeError(f"algorithm must be a string, not {type(algorithm).__name__}")
    if algorithm != "auto":
        algorithms.get(algorithm)
    if not (isinstance(links, str) and links.strip().lower() == "probe"):
        try:
            Links.coerce(links).check(p)
        except (ValueError, TypeError) as exc:
            raise _ours(exc) from exc

    def optcc_allreduce_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        tensor = bucket.buffer()
        # Divide first, in the bucket's dtype, like DDP's default hook (after the checks,
        # so that a bad bucket is reported before anything changes).
        _reduce(tensor, "sum", algorithm, links, comm, True, check, divide_first=True)
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
    return optcc_allreduce_hook


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
