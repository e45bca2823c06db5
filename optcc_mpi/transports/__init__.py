"""Transports: what a schedule needs from the wire, behind one small boundary.

A schedule (:mod:`optcc_mpi.schedule`) says which bytes go where and in which order; a
*transport* moves them. The executor, the argument check, the probe and the watch talk
to a :class:`Transport` and to nothing else, so one schedule runs over every library
that implements this page:

* :mod:`optcc_mpi.transports.mpi`: an mpi4py communicator (nonblocking point-to-point,
  ``MPI_Waitsome``, the library's ``MPI_Allreduce``);
* :mod:`optcc_mpi.transports.torch`: a ``torch.distributed`` process group, gloo on CPU
  tensors or NCCL on CUDA tensors (``isend``/``irecv``, ``batch_isend_irecv``, the
  group's ``all_reduce``).

A third (CuPy's NCCL, UCC) is one more module implementing :class:`Transport`.

What a transport offers
-----------------------
Point-to-point
    ``isend(data, peer, tag)`` and ``irecv(data, peer, tag)`` return a request; ``data``
    is what :meth:`Transport.message` made of a backend's array. Requests complete in one
    of two ways, which the transport declares with :attr:`Transport.observe`:

    ``"any"``
        :meth:`Transport.waitsome` blocks until at least one request completed and names
        them (MPI).
    ``"ordered"``
        A completion is seen only by waiting for that request (gloo's ``Work.wait``);
        the executor then always waits for the outstanding operation of lowest *level*
        (:func:`optcc_mpi.executor.levels`), which can never deadlock for a schedule the
        verifier accepts.
    ``"grouped"``
        Nothing is waited for on the host: the operations of each level are posted as one
        group (``batch_isend_irecv``: ``ncclGroupStart``/``End``) and everything after
        them is ordered by the device stream (NCCL).
The library's own AllReduce
    :meth:`Transport.allreduce` (the ``COLL`` operation of ``native``), with this
    package's semantics or not at all (:meth:`Transport.native`).
Control traffic
    Small collectives for the argument check, the probe and the watch: objects
    (:meth:`Transport.allgather`), fixed-size byte blocks (:meth:`Transport.allgather_block`),
    an element-wise maximum of integers (:meth:`Transport.allreduce_max`) and a barrier.
    They travel apart from the user's traffic (a private duplicate of the communicator, a
    private process group), so that nothing of ours ever matches a message of theirs.

Each transport object belongs to one communicator or group and is made once
(:func:`of`); the per-communicator state of the collectives hangs on it
(:attr:`Transport.state`, :mod:`optcc_mpi.state`).
"""

from __future__ import annotations

from typing import Any

from optcc_mpi.errors import ArgumentTypeError
from optcc_mpi.transports.base import BY_HANDLE, WORLD, Transport

__all__ = ["Transport", "of", "BY_HANDLE", "WORLD"]


def of(comm: Any) -> Transport:
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
    root = type(comm).__module__.split(".")[0]
    # The libraries are imported only when their objects show up: a torch job needs no
    # MPI library, an MPI job no PyTorch.
    if comm is None or root == "mpi4py" or root == "optcc_mpi":
        from optcc_mpi.transports import mpi

        return mpi.transport(comm)
    if root == "torch":
        from optcc_mpi.transports import torch

        return torch.transport(comm)
    raise ArgumentTypeError(
        "comm must be an mpi4py communicator (e.g. MPI.COMM_WORLD) or a torch.distributed "
        f"process group, not {type(comm).__module__}.{type(comm).__name__}"
    )
