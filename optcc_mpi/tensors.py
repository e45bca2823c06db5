"""Tensors for the collectives: NumPy/CuPy views of tensors, and the checked, in-place
reduction of a tensor over a transport that :mod:`optcc_mpi.torch` (its ``allreduce``
and DDP hook) and the ``optcc`` backend (:mod:`optcc_mpi.process_group`) share.

:func:`reduce_tensor` checks its arguments on this rank, agrees on them across the ranks
in one small collective (the same error on every rank, before anything changes), then
runs :func:`optcc_mpi.allreduce` over the transport, with the division of an average
before or after the sum.
"""

from __future__ import annotations

import zlib
from typing import Any

import ml_dtypes
import torch

import optcc_mpi
from optcc_mpi import agreement, algorithms
from optcc_mpi.backend import as_array as backend_as_array
from optcc_mpi.backend import get_cupy
from optcc_mpi.dtypes import check_dtype, check_op
from optcc_mpi.errors import ArgumentError, ArgumentTypeError
from optcc_mpi.links import Links

__all__ = ["as_array", "reduce_tensor", "check_average", "ours", "HALF"]

#: Tensor dtypes reduced in their own precision after dividing, as DDP's default hook does.
HALF = (torch.float16, torch.bfloat16)


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


def check_average(tensor: torch.Tensor, op: str, average: bool) -> None:
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


_FIELDS = ("error", "element count", "dtype", "op", "algorithm", "link profile", "average")


def _code(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def ours(exc: Exception) -> Exception:
    """``exc`` as one of optcc_mpi's error classes (same message)."""
    if isinstance(exc, (ArgumentError, ArgumentTypeError)):
        return exc
    cls = ArgumentTypeError if isinstance(exc, TypeError) else ArgumentError
    new = cls(str(exc))
    new.__cause__ = exc
    return new


def _check_local(
    tensor: Any, op: Any, algorithm: Any, links: Any, average: Any, wire: Any, mpi: bool
) -> tuple[Any, list[int], dict[str, str]]:
    """This rank's checks. Returns what to reduce (a NumPy/CuPy view over MPI, the tensor
    over torch.distributed), the signature every rank must share (element count, dtype,
    op, algorithm, link profile, average) and its readable form."""
    opname = check_op(op)
    check_average(tensor, opname, average)
    if not isinstance(algorithm, str):
        raise ArgumentTypeError(f"algorithm must be a string, not {type(algorithm).__name__}")
    if algorithm != "auto":
        algorithms.get(algorithm)  # the error names the choices
    if links is None:
        # $OPTCC_LINKS is optcc_mpi.allreduce's to read and check (it may translate the
        # job's numbering to this communicator's).
        profile = "default"
    elif isinstance(links, str) and links.strip().lower() in ("probe", "watch"):
        profile = links.strip().lower()
    else:
        link_obj = Links.coerce(links)
        link_obj.check(wire.size)
        profile = str(link_obj)
    if mpi:
        arr = as_array(tensor)
        check_dtype(arr.dtype)
        count = arr.size
    else:
        if not isinstance(tensor, torch.Tensor):
            raise ArgumentTypeError(
                f"expected a torch.Tensor, got {type(tensor).__module__}.{type(tensor).__name__}"
            )
        arr, backend = backend_as_array(tensor, what="tensor", tensors=True)
        wire.check_backend(backend)
        arr = tensor
        count = tensor.numel()
    shown = {
        "dtype": str(tensor.dtype),
        "op": opname,
        "algorithm": algorithm,
        "link profile": profile,
    }
    sig = [count, *(_code(shown[f]) for f in _FIELDS[2:6]), int(average)]
    return arr, sig, shown


def _agree(
    wire: Any, sig: list[int], error: Exception | None, shown: dict[str, str], what: str
) -> None:
    """One small collective (:func:`optcc_mpi.agreement.agree_fields` over the signature):
    raise the same error on every rank if any rank found an error or the ranks disagree."""
    lo, hi = agreement.agree_fields(wire, sig)
    if hi[0]:
        # Somebody failed: share the words (a second collective, on the error path only).
        agreement.agree(
            wire, None if error is None else ours(error), what=f"{what}: arguments rejected"
        )
    for i in range(1, len(sig)):
        if hi[i] != lo[i]:
            field = _FIELDS[i]
            if field in ("element count", "average"):
                detail = f"{lo[i]} on some ranks, {hi[i]} on others (this rank: {sig[i]})"
            else:
                detail = f"this rank has {shown[field]}"
            raise ArgumentError(f"{what}: {field} differs across ranks: {detail}")


def reduce_tensor(
    tensor: Any,
    op: Any,
    algorithm: Any,
    links: Any,
    wire: Any,
    mpi_comm: Any,
    average: Any,
    check: bool,
    divide_first: bool,
    what: str = "optcc_mpi.torch.allreduce",
    *,
    refuse: Exception | None = None,
    premul: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The reduction behind ``optcc_mpi.torch.allreduce``, the hook and the ``optcc``
    backend, over ``wire`` (the transport; ``mpi_comm`` the MPI communicator when it is
    MPI's). With ``average``, the division by the number of ranks comes before the sum if
    ``divide_first``, else after it. ``refuse``: an error this rank found already (the
    ranks still agree, so every rank raises); ``premul``: a factor multiplied in before
    the sum (torch's ``PREMUL_SUM``), after the checks."""
    p = wire.size
    error: Exception | None = refuse
    sig = [0] * len(_FIELDS)
    shown: dict[str, str] = {}
    arr = None
    mpi = mpi_comm is not None
    if error is None:
        try:
            arr, sig[1:], shown = _check_local(tensor, op, algorithm, links, average, wire, mpi)
        except (ValueError, TypeError) as exc:
            error = exc
    if error is not None:
        sig[0] = 1
    if check and p > 1:
        # Everything optcc_mpi.allreduce would reject (bar $OPTCC_* variables) is rejected
        # here already, before a division first modifies the tensor.
        _agree(wire, sig, error, shown, what)
    elif error is not None:
        raise ours(error)
    if average and divide_first:
        tensor.detach().div_(p)  # detach: a parameter is divided like its .data
    if premul is not None:
        tensor.detach().mul_(premul)
    if mpi and tensor.is_cuda:
        # PyTorch's queued kernels (the division, the backward pass) must finish before
        # CuPy's stream reads the memory.
        torch.cuda.current_stream(tensor.device).synchronize()
    target = mpi_comm if mpi else wire
    optcc_mpi.allreduce(
        optcc_mpi.IN_PLACE, arr, op=op, comm=target, algorithm=algorithm, links=links, check=check
    )
    if mpi and tensor.is_cuda:
        # The result was written on CuPy's stream; PyTorch's stream must see it.
        get_cupy().cuda.get_current_stream().synchronize()
    if average and not divide_first:
        tensor.detach().div_(p)  # detach: a parameter is divided like its .data
    return tensor
