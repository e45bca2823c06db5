"""Transports: what a schedule needs from the wire, behind one small boundary.

A schedule (:mod:`optcc_mpi.schedule`) says which bytes go where and in which order; a
*transport* moves them. The executor, the argument check, the probe and the watch talk
to a :class:`Transport` and to nothing else, so one schedule runs over every library
that implements this page:

* :mod:`optcc_mpi.transports.mpi`: an mpi4py communicator (nonblocking point-to-point,
  ``MPI_Waitsome``, the library's ``MPI_Allreduce``);
* :mod:`optcc_mpi.transports.distributed`: a ``torch.distributed`` process group, gloo on CPU
  tensors or NCCL on CUDA tensors (``isend``/``irecv``, ``batch_isend_irecv``, the
  group's ``all_reduce``).

A third (CuPy's NCCL, UCC) is one more module implementing :class:`Transport`; tests use
an in-process one whose ranks are threads (:mod:`optcc_mpi.testing.local`).

The contract (:mod:`optcc_mpi.transports.base`, ``docs/transports.md``) fits on a page:
four required methods (``isend``, ``irecv``, ``wait``, ``allgather``), capabilities
declared as a typed record (:class:`Capabilities`: how completions are seen, device
streams, tensors), and defaults for everything else (the library's own AllReduce, fixed
blocks, barriers, ...). A transport keeps nothing of the layers above it: it says when
its communicator goes away (:meth:`Transport.on_close`), and the collectives' registry
(:mod:`optcc_mpi.communicators`) drops what it kept for it.

Each transport object belongs to one communicator or group and is made once (:func:`of`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Union

from optcc_mpi.errors import ArgumentTypeError
from optcc_mpi.transports.base import Capabilities, Completion, Post, Transport

if TYPE_CHECKING:
    from mpi4py import MPI
    from torch.distributed import ProcessGroup

__all__ = ["Transport", "Capabilities", "Completion", "Post", "of", "world_handle", "Communicator"]

#: What a collective runs over: an mpi4py communicator (None: ``COMM_WORLD``), a
#: ``torch.distributed`` process group, or a :class:`Transport` itself (:func:`of`).
Communicator = Union["MPI.Comm", "ProcessGroup", Transport, None]


def world_handle() -> int | None:
    """The handle of MPI's ``COMM_WORLD`` where the MPI transport is loaded, else None
    (then no MPI communicator has a transport yet). Read from that module, not imported:
    a job of torch alone never loads MPI."""
    mpi = sys.modules.get("optcc_mpi.transports.mpi")
    return None if mpi is None else int(mpi.WORLD_HANDLE)


def of(comm: Communicator) -> Transport:
    """The transport of ``comm``: an mpi4py communicator (None: ``COMM_WORLD``), a
    ``torch.distributed`` process group, or a :class:`Transport` itself. Made once per
    communicator and cached with it.

    Raises
    ------
    ArgumentTypeError
        ``comm`` is none of these.
    ArgumentError
        ``comm`` is unusable (``MPI.COMM_NULL``, an intercommunicator, a group this
        process is not a member of).
    """
    if isinstance(comm, Transport):
        return comm
    own = getattr(comm, "optcc_transport", None)
    if callable(own):  # a group that carries its own transport (the optcc backend's)
        transport: Transport = own()
        return transport
    root = type(comm).__module__.split(".")[0]
    # The libraries are imported only when their objects show up: a torch job needs no
    # MPI library, an MPI job no PyTorch.
    if comm is None or root == "mpi4py" or root == "optcc_mpi":
        from optcc_mpi.transports import mpi

        return mpi.transport(comm)
    if root == "torch":
        from optcc_mpi.transports import distributed

        return distributed.transport(comm)
    raise ArgumentTypeError(
        "comm must be an mpi4py communicator (e.g. MPI.COMM_WORLD) or a torch.distributed "
        f"process group, not {type(comm).__module__}.{type(comm).__name__}"
    )
