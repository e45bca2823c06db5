"""The trainer's communication: the ranks that train together, and their counted AllReduce.

:class:`Group` is the run's ranks, whatever joins them: an mpi4py communicator (under
``mpiexec`` or ``srun``) or a ``torch.distributed`` process group (under ``torchrun``;
gloo for CPU tensors, NCCL for CUDA tensors). Everything the trainer sends goes through
the package's public collectives: the training AllReduces and the loss evaluations through
:func:`optcc_mpi.allreduce` (so NumPy arrays and torch tensors alike, on the device they
live on), the small exchanges (verdicts, shapes, the final weights) through
:func:`optcc_mpi.check.agreement.agree` on the group's transport (:func:`optcc_mpi.transports.of`).
No MPI library is needed where the group is torch's: nothing here imports mpi4py.

:class:`Reducer` is the training AllReduce the user chose:

* ``"native"`` (also spelled ``"mpi"``, the old name): the library's own AllReduce
  (``MPI_Allreduce``; gloo's or NCCL's ``all_reduce``), :func:`optcc_mpi.allreduce`'s
  ``native`` algorithm. A 16-bit payload (recipe D) is reduced as the package reduces it
  everywhere: every partial sum in float32, rounded back to the payload's format, as a
  NCCL bf16 AllReduce does;
* another :func:`optcc_mpi.allreduce` algorithm (``ring``, ``optcc``, ``r2ccl``,
  ``auto``), called with the user's ``links`` and ``emulate`` settings;
* a callable ``f(buf, comm) -> None`` that reduces ``buf`` in place.

Every call is counted (calls, payload bytes) and timed, which is where the trainer's
communication time comes from.

Network emulation for ``"native"`` and callables: with an
:class:`~optcc_mpi.emulation.Emulation` (or ``$OPTCC_EMULATE``) the real reduction runs
first, then the rank sleeps to the deadline of the call's modelled time, the one model of
the library's AllReduce (:func:`optcc_mpi.model.library_allreduce`), kept by the one pacer
(:meth:`optcc_mpi.emulation.Pacer.hold`). The other algorithms pace each of their messages
themselves.
"""

from __future__ import annotations

import os
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from .. import algorithms, transports
from ..check import agreement
from ..collectives import allreduce as _allreduce
from ..emulation import Emulation, Pacer
from ..errors import ArgumentError, ArgumentTypeError
from ..links import Links

__all__ = ["LIBRARY", "Group", "Reducer", "agree", "checksum", "default_comm"]

T = TypeVar("T")

#: The name of the library's own AllReduce, and the names that mean it.
LIBRARY = "native"
_LIBRARY_NAMES = ("native", "mpi", "library")


def default_comm() -> Any:
    """The job's world, what ``comm=None`` means: torch.distributed's default group when
    torch.distributed has been initialised in this process, else ``MPI.COMM_WORLD``.

    Raises
    ------
    ArgumentError
        The process was started as one of several by ``torchrun`` (``WORLD_SIZE`` > 1)
        and torch.distributed is not initialised: over MPI it would train alone.
    """
    dist = sys.modules.get("torch.distributed")  # initialised only if already imported
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    size = os.environ.get("WORLD_SIZE", "")
    if size.isdigit() and int(size) > 1:
        raise ArgumentError(
            f"this process was started as one of {size} (WORLD_SIZE={size}, as torchrun "
            "does) but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group('gloo') (CPU) or ('nccl') (GPU) first, "
            "or pass comm= a process group (or an MPI communicator under mpiexec)"
        )
    return None  # transports.of(None): MPI.COMM_WORLD


class Group:
    """The ranks of a run and the collectives the trainer needs from them.

    Parameters
    ----------
    comm : mpi4py communicator, torch.distributed.ProcessGroup or None
        None: :func:`default_comm`.

    Raises
    ------
    ArgumentTypeError, ArgumentError
        ``comm`` is neither kind, or unusable (this process is not a member); raised at
        once, on the ranks that passed it (there is nobody to agree with yet).
    """

    def __init__(self, comm: Any = None) -> None:
        if isinstance(comm, Group):
            comm = comm.comm
        comm = default_comm() if comm is None else comm
        try:
            self.transport = transports.of(comm)
        except ArgumentTypeError:
            raise ArgumentTypeError(
                "comm must be an mpi4py communicator (e.g. MPI.COMM_WORLD) or a "
                f"torch.distributed process group, not {type(comm).__name__}"
            ) from None
        self.comm = comm
        self.rank: int = self.transport.rank
        self.size: int = self.transport.size
        #: The library that joins the ranks: ``"mpi"``, ``"gloo"`` or ``"nccl"``.
        self.library: str = self.transport.name

    @property
    def is_torch(self) -> bool:
        """Whether the ranks are a torch.distributed process group."""
        return self.library in ("gloo", "nccl")

    def describe(self) -> str:
        """``"MPI, 4 ranks"``, ``"gloo, 8 ranks"``."""
        name = "MPI" if self.library == "mpi" else self.library
        return f"{name}, {self.size} rank{'s' if self.size != 1 else ''}"

    # -- small exchanges -----------------------------------------------------------------

    def agree(self, error: BaseException | str | None, payload: Any = None) -> list[Any]:
        """:func:`agree` over this group."""
        return agree(self, error, payload)

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's small picklable ``obj``, in rank order (one collective)."""
        if self.size == 1:
            return [obj]
        return agreement.agree(self.transport, None, obj)

    def barrier(self) -> None:
        """Wait for every rank, leaving the CPU to others meanwhile (the transport's quiet
        barrier: a rank with nothing to do does not spin)."""
        if self.size > 1:
            self.transport.quiet_barrier()

    def run_everywhere(self, step: Callable[[], T], what: str) -> T:
        """``step()`` on every rank; if it raised on any rank, raise on every rank
        (:func:`optcc_mpi.check.agreement.run_everywhere`)."""
        return agreement.run_everywhere(self.transport, step, what=what)

    # -- reductions of the trainer's own (not the training AllReduce) ---------------------

    def sum(self, buf: Any) -> Any:
        """``buf`` (a contiguous NumPy array or tensor) SUM-reduced in place: the
        library's AllReduce, unpaced (loss evaluations are not part of training)."""
        if self.size > 1:
            _allreduce(None, buf, op="sum", comm=self.comm, algorithm=LIBRARY, emulate="",
                       check=False)  # fmt: skip
        return buf


def agree(group: Group | Any, error: BaseException | str | None, payload: Any = None) -> list[Any]:
    """Share each rank's verdict (and a small payload); raise on every rank if any failed.

    The trainer's use of :func:`optcc_mpi.check.agreement.agree` (one gather of a small Python
    object), so ranks whose own checks passed do not wait forever in the next collective
    while another rank has bailed out.

    Parameters
    ----------
    group : Group, mpi4py communicator or torch.distributed.ProcessGroup
        All ranks that must agree.
    error : BaseException, str or None
        This rank's error (an exception is re-raised unchanged on this rank), or None.
    payload : object, optional
        Anything small to share at the same time (shapes, checksums).

    Returns
    -------
    list
        Every rank's payload, in rank order.

    Raises
    ------
    ArgumentError
        (a ``ValueError``) on every rank, when at least one rank reported an error.
        Identical messages from several ranks are listed once with their ranks.
    """
    group = group if isinstance(group, Group) else Group(group)
    return agreement.agree(group.transport, error, payload)


def checksum(a: Any) -> int:
    """CRC-32 of an array's bytes: a cheap check that replicated arrays agree."""
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).ravel())


def _as_group(group: Any) -> Group:
    """``group`` as a :class:`Group`: a communicator or process group (the argument before
    :class:`Group` existed) is wrapped, at once, rather than failing at the first reduce."""
    if isinstance(group, Group):
        return group
    try:
        return Group(group)
    except ArgumentTypeError:
        raise ArgumentTypeError(
            "group must be an optcc_mpi.glm.Group, an mpi4py communicator (e.g. "
            "MPI.COMM_WORLD) or a torch.distributed process group, not "
            f"{type(group).__name__}"
        ) from None


class Reducer:
    """A counted, timed, pluggable in-place SUM AllReduce (module docstring).

    Parameters
    ----------
    group : Group, mpi4py communicator, torch.distributed.ProcessGroup or None
        The ranks that hold the column blocks; a communicator or process group (what
        this argument took before :class:`Group`), or None, is wrapped in a
        :class:`Group` here.
    allreduce : str or callable
        ``"native"`` (or ``"mpi"``), an ``optcc_mpi.allreduce`` algorithm name, or
        ``f(buf, comm) -> None``.
    links : object, optional
        Link profile passed to ``optcc_mpi.allreduce`` (``Links`` or its string form).
    emulate : Emulation or str, optional
        Network emulation (``"latency=50us"``; None: ``$OPTCC_EMULATE`` if set). Passed
        to ``optcc_mpi.allreduce``; for ``"native"`` and callables it is paced here.

    Attributes
    ----------
    calls, nbytes : int
        AllReduce calls made and payload bytes reduced.
    seconds : float
        Wall time spent inside the calls (emulated latency included).
    emulated_seconds : float
        Part of ``seconds`` spent sleeping for the emulated network.
    pacer : Pacer or None
        The emulated network's accounting (None when nothing is emulated here).
    """

    def __init__(
        self,
        group: Group | Any,
        allreduce: str | Callable[[Any, Any], None] = LIBRARY,
        *,
        links: Any = None,
        emulate: Emulation | str | None = None,
    ) -> None:
        self.group = _as_group(group)
        self.links = links
        self.calls = 0
        self.nbytes = 0
        self.seconds = 0.0
        self.emulated_seconds = 0.0
        self._fn: Callable[[Any, Any], None] | None = None
        if callable(allreduce):
            self.name = getattr(allreduce, "__name__", "callable")
            self._fn = allreduce
            self.algorithm = LIBRARY
        elif not isinstance(allreduce, str):
            raise ArgumentTypeError(
                f"allreduce must be an algorithm name or a callable, not {allreduce!r}"
            )
        elif allreduce.lower() in _LIBRARY_NAMES:
            self.name = self.algorithm = LIBRARY
        elif allreduce == "auto" or allreduce in algorithms.names():
            self.name = self.algorithm = allreduce
        else:
            raise ArgumentError(
                f"unknown AllReduce {allreduce!r}; choose native (the library's own, also "
                f"spelled mpi), auto or one of {', '.join(algorithms.names())}, or pass a "
                "callable f(buf, comm)"
            )
        self._pace_here = self._fn is not None or self.algorithm == LIBRARY
        if links is not None and self._pace_here:
            raise ArgumentError(
                f"a link profile needs an optcc_mpi.allreduce algorithm (optcc, ring, "
                f"auto, ...), not {self.name!r}"
            )
        self.emulate: Emulation | None = Emulation.coerce(emulate)
        self.pacer: Pacer | None = None
        if self._pace_here and self.emulate and (self.emulate.latency or self.emulate.bw):
            self.pacer = self.emulate.pacer(self.group.rank, self.group.size, Links())

    def __call__(self, buf: Any) -> Any:
        """SUM-reduce ``buf`` (a contiguous 1-D array or tensor) over the group."""
        t0 = time.perf_counter()
        group = self.group
        if self._fn is not None:
            self._fn(buf, group.comm)
        elif group.size > 1:
            _allreduce(
                None,
                buf,
                op="sum",
                comm=group.comm,
                algorithm=self.algorithm,
                links=self.links,
                # Paced here (or not at all): "" keeps $OPTCC_EMULATE from pacing twice.
                emulate="" if self._pace_here else (self.emulate or ""),
                # Every rank passes the same size, dtype and settings by construction, so
                # the per-call argument check (one more small collective) is skipped.
                check=False,
            )
        nbytes = int(buf.nbytes)
        if self.pacer is not None:
            # The real reduction counts towards the modelled time; sleep for the rest.
            t1 = time.perf_counter()
            self.pacer.hold(t0, nbytes)
            self.emulated_seconds += time.perf_counter() - t1
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.nbytes += nbytes
        return buf

    def stats(self) -> dict[str, Any]:
        """Counters as a JSON-ready dict; with a pacer its accounting as ``net_*``."""
        out: dict[str, Any] = {
            "allreduce": self.name,
            "allreduce_calls": self.calls,
            "allreduce_bytes": self.nbytes,
            "comm_s": self.seconds,
            "emulated_wait_s": self.emulated_seconds,
        }
        pacer = self.pacer
        if pacer is not None:
            out.update(
                net_model="library",
                net_latency_s=pacer.latency,
                net_bw=pacer.bw,
                net_calls=pacer.held,
                net_charged_s=pacer.charged_seconds["coll"],
                net_slept_s=pacer.slept_s,
                net_sleeps=pacer.sleeps,
                net_overshoot_s=pacer.overshoot_s,
                net_overrun_s=pacer.overrun_s,
            )
        return out
