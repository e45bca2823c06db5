"""Tensors for the collectives: NumPy/CuPy views of tensors, and the checked, in-place
reduction of a tensor over a transport that :mod:`optcc_mpi.torch` (its ``allreduce``
and DDP hook) and the ``optcc`` backend (:mod:`optcc_mpi.torch.process_group`) share.

:func:`start_tensor` checks on this rank what only a tensor has (its kind, the average),
then starts :func:`optcc_mpi.allreduce` over the transport, whose one argument check
agrees on everything across the ranks (the same error on every rank, before anything
changes); the division of an average comes before the sum (into a copy the sum reads)
or after it. :func:`reduce_tensor` waits for it.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import torch

from optcc_mpi import collectives
from optcc_mpi.arrays import NUMPY, TORCH_DTYPES, get_cupy
from optcc_mpi.communicators import CallRecord
from optcc_mpi.dtypes import check_op
from optcc_mpi.errors import ArgumentError, ArgumentTypeError, as_ours

__all__ = [
    "as_array",
    "start_tensor",
    "reduce_tensor",
    "TensorCall",
    "Lane",
    "LaneCall",
    "lane",
    "check_average",
    "ours",
    "HALF",
]

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


def ours(exc: Exception) -> Exception:
    """``exc`` as one of optcc_mpi's error classes (same message)."""
    new = as_ours(exc)
    return new if isinstance(new, Exception) else exc


def _data(tensor: Any, op: Any, average: Any, mpi: bool) -> tuple[Any, str]:
    """This rank's checks of what only the tensor path knows (the tensor itself, the
    average); returns what :func:`optcc_mpi.allreduce` reduces and the op's name. Over
    MPI, and for CPU tensors everywhere, that is a NumPy (CuPy) view of the tensor's
    memory: on a process group the argument check then carries short messages itself
    (one collective per call); other tensors stay tensors."""
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(
            f"expected a torch.Tensor, got {type(tensor).__module__}.{type(tensor).__name__}"
        )
    opname = check_op(op)
    check_average(tensor, opname, average)
    if mpi:
        return as_array(tensor), opname
    if tensor.device.type == "cpu" and tensor.dtype in _VIEWED:
        return as_array(tensor), opname
    # (a dtype outside the tensors' set is refused by the library's check, by name)
    return tensor, opname


#: The tensor dtypes the package reduces (on every device), as torch's dtypes: a CPU
#: tensor of one of them is reduced through a NumPy view of its memory.
_VIEWED = frozenset(getattr(torch, name) for name in TORCH_DTYPES if hasattr(torch, name))


class TensorCall:
    """A started in-place reduction of one tensor (:func:`start_tensor`): the library's
    AllReduce may still be in flight (:attr:`request`); :meth:`finish` completes it once
    that request completed, :meth:`wait` waits for it first."""

    __slots__ = ("started", "tensor", "p", "divide_after", "cuda_mpi")

    def __init__(
        self,
        started: collectives.Started,
        tensor: torch.Tensor,
        p: int,
        divide_after: bool,
        cuda_mpi: bool,
    ) -> None:
        self.started, self.tensor, self.p = started, tensor, p
        self.divide_after, self.cuda_mpi = divide_after, cuda_mpi

    @property
    def request(self) -> object | None:
        """The library's AllReduce still in flight, or None."""
        return self.started.request

    def finish(self) -> CallRecord | None:
        """Complete the reduction (its request complete): the division of an average
        taken after the sum; the call's record."""
        self.started.finish()
        if self.cuda_mpi:
            # The result was written on CuPy's stream; PyTorch's stream must see it.
            cp = get_cupy()
            assert cp is not None  # (a CuPy view was made: _cuda_array)
            cp.cuda.get_current_stream().synchronize()
        if self.divide_after:
            self.tensor.detach().div_(self.p)  # detach: a parameter is divided like its .data
        return self.started.record

    def wait(self) -> CallRecord | None:
        """Wait for the library's AllReduce, then :meth:`finish`."""
        self.started.wait()  # (the collectives' own wait and finish; finish() is then a no-op)
        return self.finish()


class Lane:
    """The short path of one signature of in-place tensor reductions (a CPU tensor's
    dtype and size, a sum or an average, one transport): :func:`lane` checks it on this
    rank once, then each call is the check and the library's AllReduce of a NumPy view
    of the tensor (:class:`~optcc_mpi.collectives.Prepared`), with nothing else between
    the caller and the wire. The same collectives and bits as :func:`start_tensor`'s.
    """

    __slots__ = ("prepared", "average", "p", "transport")

    def __init__(self, prepared: collectives.Prepared, average: bool, transport: Any) -> None:
        self.prepared, self.average, self.transport = prepared, average, transport
        self.p = transport.size

    def takes(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (of the lane's dtype and size) is one this lane reduces:
        dense, contiguous, on the CPU, not a lazy view; and the settings hold."""
        return (
            tensor.layout is torch.strided
            and not tensor.is_cuda
            and tensor.is_contiguous()
            and not tensor.is_conj()
            and not tensor.is_neg()
            and self.prepared.current()
        )

    def run(self, tensor: torch.Tensor) -> CallRecord | None:
        """Reduce ``tensor`` in place and wait: the call's record; None, with nothing
        communicated, where the tensor is not one this lane takes (:meth:`takes`: the
        caller takes the whole path). The one classification of the call's tensor; a
        mismatch raises here, on every rank, with the tensor unchanged."""
        if not self.takes(tensor):
            return None
        record, request = self.prepared.start(tensor.detach().reshape(-1).numpy())
        if request is not None:
            self.transport.wait(request)
        if self.average:
            tensor.detach().div_(self.p)
        return record

    def start(self, tensor: torch.Tensor) -> LaneCall:
        """Start reducing ``tensor`` in place (the check is done when this returns: a
        mismatch raises here, on every rank, with the tensor unchanged)."""
        record, request = self.prepared.start(tensor.detach().reshape(-1).numpy())
        return LaneCall(self, tensor, record, request)


class LaneCall:
    """A started call of a :class:`Lane` (its library's AllReduce may be in flight:
    :attr:`request`); :meth:`wait` completes it and returns its record."""

    __slots__ = ("lane", "tensor", "record", "request")

    def __init__(self, lane: Lane, tensor: torch.Tensor, record: CallRecord, request: Any) -> None:
        self.lane, self.tensor, self.record, self.request = lane, tensor, record, request

    def wait(self) -> CallRecord:
        """Wait for the library's AllReduce, divide an average; the call's record."""
        if self.request is not None:
            request, self.request = self.request, None
            self.lane.transport.wait(request)
        if self.lane.average:
            self.tensor.detach().div_(self.lane.p)
        return self.record


def lane(
    tensor: torch.Tensor,
    op: str,
    average: bool,
    wire: Any,
    algorithm: str,
    links: Any,
    check: bool,
) -> Lane | None:
    """The :class:`Lane` of ``tensor``'s signature, or None where its calls take
    :func:`start_tensor` (a device tensor, a dtype NumPy lacks or the transport does not
    reduce as we do, an op other than a sum, an average of half precision, links not
    healthy, another algorithm than ``auto``, emulation). Nothing is communicated."""
    if (
        type(tensor) not in (torch.Tensor, torch.nn.Parameter)
        or tensor.is_cuda
        or tensor.layout is not torch.strided
        or tensor.dtype not in _VIEWED
        or tensor.dtype is torch.bfloat16
        or (average and (tensor.dtype in HALF or not tensor.is_floating_point()))
        or not tensor.is_contiguous()
    ):
        return None
    label = ("average", str(bool(average)))
    flat = tensor.detach().reshape(-1).numpy()
    prepared = collectives.prepare(
        flat, comm=wire, op=op, algorithm=algorithm, links=links, check=check, label=label,
        classified=True,
    )  # fmt: skip
    return None if prepared is None else Lane(prepared, bool(average), wire)


def start_tensor(
    tensor: Any,
    op: Any,
    algorithm: Any,
    links: Any,
    wire: Any,
    mpi_comm: Any,
    average: Any,
    check: bool,
    divide_first: bool,
    *,
    refuse: Exception | None = None,
    premul: float | torch.Tensor | None = None,
    label: tuple[str, str] | None = None,
) -> TensorCall:
    """Start the reduction behind ``optcc_mpi.torch.allreduce``, the hook and the
    ``optcc`` backend, over ``wire`` (the transport; ``mpi_comm`` the MPI communicator when
    it is MPI's), with one argument check across the ranks (:func:`optcc_mpi.allreduce`'s,
    which also agrees on ``average``). With ``average``, the division by the number of
    ranks comes before the sum if ``divide_first``, else after it; ``premul``: a factor
    multiplied in before the sum (torch's ``PREMUL_SUM``). Whatever comes before the sum
    is computed into a scaled copy that the reduction reads, so that the tensor is
    unchanged until every rank agreed. ``refuse``: an error this rank found already (the
    ranks still agree, so every rank raises). ``label``: what must agree besides the
    arguments, as ``(name, value in words)`` (default: the average)."""
    p = wire.size
    mpi = mpi_comm is not None
    error: Exception | None = refuse
    arr: Any = None
    send: Any = None
    opname: Any = op
    if error is None:
        try:
            arr, opname = _data(tensor, op, average, mpi)
            scaled = None
            if average and divide_first:
                scaled = tensor.detach() / p
            elif premul is not None:
                scaled = tensor.detach() * premul
            if scaled is not None:
                send = scaled if arr is tensor else as_array(scaled)
                if mpi and tensor.is_cuda:
                    # The scaling was queued on PyTorch's stream; CuPy's reads it.
                    torch.cuda.current_stream(tensor.device).synchronize()
        except (ValueError, TypeError) as exc:
            error = exc
    if label is None and isinstance(average, bool):
        label = ("average", str(average))
    # NumPy views made here (as_array: the tensor's kind, layout, contiguity, dtype) are
    # classified: the collectives take them as they are, not classifying them again.
    classified = (
        NUMPY if type(arr) is np.ndarray and (send is None or type(send) is np.ndarray) else None
    )
    started = collectives.start_call(
        arr, comm=mpi_comm if mpi else wire, op=opname, algorithm=algorithm, links=links,
        check=check, sendbuf=send, error=None if error is None else ours(error), label=label,
        classified=classified,
    )  # fmt: skip
    return TensorCall(
        started,
        tensor,
        p,
        bool(average) and not divide_first,
        mpi and isinstance(tensor, torch.Tensor) and tensor.is_cuda,
    )


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
    *,
    refuse: Exception | None = None,
    premul: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`start_tensor`, waited for: ``tensor``, reduced in place."""
    start_tensor(
        tensor, op, algorithm, links, wire, mpi_comm, average, check, divide_first,
        refuse=refuse, premul=premul,
    ).wait()  # fmt: skip
    return tensor
