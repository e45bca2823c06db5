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

import numpy as np

from optcc_mpi.errors import ArgumentTypeError
from optcc_mpi.links import Links

__all__ = ["Transport", "of", "BY_HANDLE", "WORLD"]

#: The MPI transports made so far, by communicator handle (:mod:`.mpi` fills it): the
#: short call's compiled path finds its communicator's state here without importing MPI.
BY_HANDLE: dict[int, Transport] = {}
#: ``[handle of MPI.COMM_WORLD]`` once the MPI transport is loaded.
WORLD: list[int] = []


class Transport:
    """One communicator or process group, as the schedule's readers see it (module
    docstring). Subclasses set the attributes and implement the methods."""

    #: The library: ``"mpi"``, ``"gloo"``, ``"nccl"``.
    name = "abstract"
    #: How completions are seen: ``"any"``, ``"ordered"`` or ``"grouped"``.
    observe = "any"
    #: Whether a device buffer needs the current stream synchronised before the library
    #: reads it (MPI: yes; NCCL orders itself after the current stream).
    sync_device = True
    #: Whether tensors stay tensors (:func:`optcc_mpi.backend.as_array`'s ``tensors``).
    tensors = False

    def __init__(self, rank: int, size: int, kind: str) -> None:
        self.rank = rank
        self.size = size
        #: What joins the ranks: ``"shared-memory"`` (every rank on one node) or
        #: ``"network"``; builders size their messages from it.
        self.kind = kind
        #: The collectives' per-communicator state (:mod:`optcc_mpi.state`), made there.
        self.state: Any = None

    # -- point-to-point ------------------------------------------------------------------
    def message(self, backend: Any, arr: Any) -> Any:
        """What :meth:`isend`/:meth:`irecv` take for the bytes of ``arr``."""
        return backend.byte_view(arr)

    def staging(self, backend: Any) -> bool:
        """Whether messages of ``backend``'s arrays go through host copies."""
        return False

    def isend(self, data: Any, peer: int, tag: int) -> Any:
        raise NotImplementedError

    def irecv(self, data: Any, peer: int, tag: int) -> Any:
        raise NotImplementedError

    def waitsome(self, reqs: list[Any]) -> list[int]:
        """Indices of completed requests, blocking until there is one (``observe="any"``)."""
        raise NotImplementedError

    def testsome(self, reqs: list[Any]) -> list[int]:
        """Indices of completed requests, without blocking (``observe="any"``)."""
        raise NotImplementedError

    def wait(self, req: Any) -> None:
        """Block until ``req`` completed (``observe="ordered"``)."""
        raise NotImplementedError

    def batch(self, posts: list[tuple[bool, Any, int, int]]) -> list[Any]:
        """Post ``(is_send, data, peer, tag)`` operations as one group; their requests."""
        return [(self.isend if s else self.irecv)(d, peer, tag) for s, d, peer, tag in posts]

    def check_backend(self, backend: Any) -> None:
        """ArgumentError if this transport cannot move ``backend``'s arrays."""

    # -- the library's own AllReduce -------------------------------------------------------
    def native(self, backend: Any, dtype_name: str, op: str) -> bool:
        """Whether :meth:`allreduce` reduces ``dtype_name`` with ``op`` exactly as this
        package does (else the caller gathers and reduces in rank order)."""
        return False

    def allreduce(self, backend: Any, arr: Any, dtype_name: str, op: str) -> Any:
        """Start the library's in-place AllReduce of ``arr``; a request (or None when it
        completed already)."""
        raise NotImplementedError

    def allreduce_now(self, backend: Any, arr: Any, dtype_name: str, op: str) -> None:
        """:meth:`allreduce`, completed before returning."""
        req = self.allreduce(backend, arr, dtype_name, op)
        if req is not None:
            self.wait(req)

    # -- control traffic -------------------------------------------------------------------
    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's (small, picklable) ``obj``, in rank order."""
        raise NotImplementedError

    def allgather_block(self, block: np.ndarray, out: np.ndarray) -> None:
        """Every rank's ``block`` (1-D uint8, the same size everywhere) into the rows of
        ``out``."""
        raise NotImplementedError

    def allreduce_max(self, vec: np.ndarray) -> None:
        """``vec`` (int64) replaced by its element-wise maximum over the ranks."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def quiet_barrier(self) -> None:
        """A barrier that leaves the CPU to others while it waits, and ends at about the
        same instant on every rank (measurements start from it)."""
        self.barrier()

    def job_links(self, links: Links) -> Links:
        """A profile in the job's numbering (``$OPTCC_LINKS``: MPI's COMM_WORLD, torch's
        global ranks) in this communicator's ranks; members only."""
        return links

    def describe(self) -> str:
        """One line for messages: the library and the size."""
        return f"{self.name} group of {self.size}"


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
