"""The transport boundary itself: :class:`Transport`, what every transport implements
(the package's docstring, :mod:`optcc_mpi.transports`, says what each part is for)."""

from __future__ import annotations

from typing import Any

import numpy as np

from optcc_mpi.backend import NUMPY
from optcc_mpi.links import Links

__all__ = ["Transport", "BY_HANDLE", "WORLD"]

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

    def scratch(self, nbytes: int) -> tuple[Any, Any]:
        """A buffer of ``nbytes`` bytes this transport moves, and its backend (the
        probe's and the doctor's messages): host memory unless the library needs device
        memory."""
        return np.zeros(nbytes, dtype=np.uint8), NUMPY

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

    def gather_rows(self, backend: Any, arr: Any) -> Any:
        """Every rank's ``arr`` (1-D, the same size everywhere) as the rows of a 2-D array
        of ``backend``, gathered where it lives (on the device for device memory); None
        where this transport gathers through the host only."""
        return None

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
