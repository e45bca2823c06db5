"""The MPI transport: schedules over an mpi4py communicator.

The first use of a communicator makes its :class:`MpiTransport` and caches it as an MPI
attribute of the communicator, so MPI frees it with the communicator. It holds a
*private duplicate* on which all our traffic travels (the argument check, the schedules'
messages, the probe), so that none of it can ever match a message or a collective of
the user's, even one posted with ``MPI.ANY_SOURCE`` and ``MPI.ANY_TAG``. Making it is
collective (``MPI_Comm_dup``); every rank reaches it at its first call.

Messages are bytes (``uint8`` views, :meth:`~optcc_mpi.arrays.ArrayOps.byte_view`): no
MPI datatype is needed for bfloat16, and no reduction happens inside MPI, so results do
not depend on how the library reduces. Only the library's own AllReduce (the ``COLL``
operation, :func:`mpi_datatype_and_op`) asks MPI to reduce. Device memory goes to MPI
directly when the library is CUDA-aware (:func:`cuda_aware_mpi`), through host copies
otherwise.

``$OPTCC_LINKS`` names ranks of ``COMM_WORLD``: on any other communicator the profile is
translated through the groups (``MPI_Group_translate_ranks``), and ranks that are not
members are dropped.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
from mpi4py import MPI

from optcc_mpi import config
from optcc_mpi.arrays import Array, ArrayOps
from optcc_mpi.dtypes import ALIASES, CATEGORY, DTYPES, LOW_PRECISION, check_op_dtype, op_name
from optcc_mpi.errors import ArgumentError, ArgumentTypeError
from optcc_mpi.links import Links
from optcc_mpi.reductions import reduce_with
from optcc_mpi.transports.base import (
    Capabilities,
    Completion,
    T,
    Transport,
    cpu_placement,
    crowding_of,
)

if TYPE_CHECKING:
    from mpi4py.typing import Buffer, BufSpec
__all__ = [
    "MpiTransport",
    "transport",
    "check_comm",
    "cuda_aware_mpi",
    "mpi_datatype_and_op",
    "IN_PLACE",
]

IN_PLACE: MPI.InPlaceType = MPI.IN_PLACE
#: The handle of ``MPI.COMM_WORLD`` (:func:`optcc_mpi.transports.world_handle`).
WORLD_HANDLE: int = MPI.COMM_WORLD.handle
_KEYVAL: list[int] = []
#: The transports made so far, by communicator handle: found with one lookup.
_BY_HANDLE: dict[int, MpiTransport] = {}


class MpiTransport(Transport[MPI.Request]):
    """An mpi4py intracommunicator and its private duplicate (module docstring)."""

    name = "mpi"
    caps = Capabilities(completion=Completion.ANY, sync_device=True, tensors=False)
    handle: int

    def __init__(self, comm: MPI.Comm) -> None:
        size = comm.Get_size()
        # A plain mpi4py communicator: a Dup of optcc_mpi.Comm would be a Comm again, whose
        # Allreduce is ours. With one rank nothing travels: no duplicate needed.
        plain = MPI.Intracomm(comm)
        private = plain.Dup() if size > 1 else plain
        # What joins the ranks, as the MPI library sees it: all on one node (it moves
        # messages through shared memory) or not. Builders size messages from it.
        kind = "shared-memory"
        if size > 1:
            local = private.Split_type(MPI.COMM_TYPE_SHARED)
            if local.Get_size() != size:
                kind = "network"
            local.Free()
        super().__init__(comm.Get_rank(), size, kind)
        # How many ranks share each core (the same value on every rank): builders weigh a
        # message's fixed cost by it.
        self.crowding = crowding_of(private.allgather(cpu_placement()) if size > 1 else [])
        self.comm = comm
        self.handle = comm.handle
        self.private = private
        # The library's calls themselves, bound on the instance over the methods below: a
        # message costs no extra Python frame. (Their signatures are MPI's: a buffer
        # specification for the data, and None for no completed request where the
        # methods say []; the executor takes both.)
        self.isend = private.Isend  # type: ignore[method-assign, assignment]
        self.irecv = private.Irecv  # type: ignore[method-assign, assignment]
        self.waitsome = MPI.Request.Waitsome  # type: ignore[method-assign, assignment]
        self.testsome = MPI.Request.Testsome  # type: ignore[method-assign, assignment]

    def isend(self, data: object, peer: int, tag: int) -> MPI.Request:
        return self.private.Isend(cast("BufSpec", data), peer, tag)  # a message() view

    def irecv(self, data: object, peer: int, tag: int) -> MPI.Request:
        return self.private.Irecv(cast("BufSpec", data), peer, tag)

    def waitsome(self, reqs: Sequence[MPI.Request]) -> list[int]:
        return MPI.Request.Waitsome(reqs) or []

    def testsome(self, reqs: Sequence[MPI.Request]) -> list[int]:
        return MPI.Request.Testsome(reqs) or []

    def free(self) -> None:
        """Free the private duplicate (called by MPI when the communicator is freed)."""
        # None marks it freed (fastcall.context checks).
        priv, self.private = self.private, None  # type: ignore[assignment]
        if priv is not None and self.size > 1:
            try:
                priv.Free()
            except Exception:  # pragma: no cover - MPI already finalising
                pass

    def staging(self, arrays: ArrayOps) -> bool:
        if not arrays.device:
            return False
        aware = arrays.cuda_aware if arrays.cuda_aware is not None else cuda_aware_mpi()
        return not aware

    def native(self, arrays: ArrayOps, dtype_name: str, op: str) -> bool:
        return True  # mpi_datatype_and_op gives every pair this package's semantics

    def allreduce(self, arrays: ArrayOps, arr: Array, dtype_name: str, op: str) -> MPI.Request:
        datatype, mpi_op = mpi_datatype_and_op(dtype_name, op)
        arr = cast(np.ndarray, arr)  # NumPy's API: no tensors here (caps.tensors is False)
        if arr.dtype in LOW_PRECISION:
            arr = arr.view(np.uint16)
        return self.private.Iallreduce(IN_PLACE, [arr, datatype], mpi_op)

    def predefined(self, dtype_name: str, op: str) -> tuple[MPI.Datatype, MPI.Op] | None:
        """The MPI datatype and op :meth:`allreduce` uses for this pair when both are
        MPI's own (the compiled call path may then call ``MPI_Allreduce`` itself), else
        None (a reduction MPI calls back into Python for)."""
        datatype, mpi_op = mpi_datatype_and_op(dtype_name, op)
        return (datatype, mpi_op) if mpi_op.is_predefined else None

    def wait(self, req: MPI.Request) -> None:
        req.Wait()

    def allreduce_now(self, arrays: ArrayOps, arr: Array, dtype_name: str, op: str) -> None:
        datatype, mpi_op = mpi_datatype_and_op(dtype_name, op)
        arr = cast(np.ndarray, arr)  # NumPy's API: no tensors here (caps.tensors is False)
        if arr.dtype in LOW_PRECISION:
            arr = arr.view(np.uint16)
        self.private.Allreduce(IN_PLACE, [arr, datatype], mpi_op)

    def allgather(self, obj: T) -> list[T]:
        return self.private.allgather(obj)

    def allgather_block(self, block: np.ndarray, out: np.ndarray) -> None:
        self.private.Allgather(block, out)

    def allreduce_max(self, vec: np.ndarray) -> None:
        self.private.Allreduce(IN_PLACE, vec, op=MPI.MAX)

    def barrier(self) -> None:
        self.private.Barrier()

    def quiet_barrier(self) -> None:
        # A nonblocking barrier polled with short sleeps first, so that ranks with nothing
        # to do leave the CPU to those that move bytes (on a shared machine a spinning
        # rank slows the transfers it waits for); then a blocking one, whose end is
        # nearly the same instant on every rank.
        req = self.private.Ibarrier()
        while not req.Test():
            time.sleep(2e-4)
        self.private.Barrier()

    def job_links(self, links: Links) -> Links:
        if links.healthy:
            return links
        world = MPI.COMM_WORLD
        wsize = world.Get_size()
        bad = [r for r in links.fractions if r >= wsize]
        if bad:
            raise ArgumentError(
                f"names rank {bad[0]}, outside COMM_WORLD of size {wsize} (OPTCC_LINKS uses "
                "COMM_WORLD ranks)"
            )
        if self.comm == world:
            return links
        wgroup, group = world.Get_group(), self.comm.Get_group()
        try:
            ranks = list(links.fractions)
            mine = MPI.Group.Translate_ranks(wgroup, ranks, group)
        finally:
            wgroup.Free()
            group.Free()
        return Links({m: links.fractions[w] for w, m in zip(ranks, mine) if m != MPI.UNDEFINED})

    def describe(self) -> str:
        return f"MPI communicator of {self.size}"


def _delete(comm: MPI.Comm, keyval: int, t: MpiTransport) -> None:
    _BY_HANDLE.pop(t.handle, None)
    t.close()  # whoever keeps state for it drops it: nothing may reach the duplicate
    t.free()


def check_comm(comm: object) -> MPI.Comm:
    """``comm`` (None: COMM_WORLD) if it is an mpi4py intracommunicator we can use.

    Raises
    ------
    ArgumentTypeError
        ``comm`` is not an mpi4py communicator.
    ArgumentError
        ``comm`` is ``MPI.COMM_NULL`` or an intercommunicator.
    """
    if comm is None:
        return MPI.COMM_WORLD
    if not isinstance(comm, MPI.Comm):
        raise ArgumentTypeError(
            f"comm must be an mpi4py communicator (e.g. MPI.COMM_WORLD), not "
            f"{type(comm).__module__}.{type(comm).__name__}"
        )
    if comm == MPI.COMM_NULL:
        raise ArgumentError(
            "comm is MPI.COMM_NULL: this process is not a member of that communicator "
            "(e.g. Split with color MPI.UNDEFINED); call only on members"
        )
    if comm.Is_inter():
        raise ArgumentError(
            "intercommunicators are not supported; reduce within each group, or over "
            "comm.Merge() (an intracommunicator of both groups)"
        )
    return comm


def transport(comm: object) -> MpiTransport:
    """The cached :class:`MpiTransport` of ``comm`` (None: COMM_WORLD), made on first use
    (collective then: it duplicates the communicator). Errors as :func:`check_comm`."""
    if comm is None:
        comm = MPI.COMM_WORLD
    elif not isinstance(comm, MPI.Comm):
        comm = check_comm(comm)  # raises: not a communicator
    t = _BY_HANDLE.get(comm.handle)
    if t is not None:
        return t
    check_comm(comm)
    if not _KEYVAL:
        _KEYVAL.append(MPI.Comm.Create_keyval(delete_fn=_delete))
    t = cast("MpiTransport | None", comm.Get_attr(_KEYVAL[0]))  # what Set_attr stored
    if t is None:
        t = MpiTransport(comm)
        comm.Set_attr(_KEYVAL[0], t)
    _BY_HANDLE[t.handle] = t
    return t


@functools.lru_cache(maxsize=1)
def cuda_aware_mpi() -> bool:
    """Best guess whether the MPI library accepts device pointers.

    mpi4py offers no portable query, so this follows the usual signals: Open MPI with
    ``OMPI_MCA_opal_cuda_support=true``, Cray MPICH with ``MPICH_GPU_SUPPORT_ENABLED=1``,
    MVAPICH with ``MV2_USE_CUDA=1``, an MPICH whose configure line mentions CUDA (unless
    ``MPIR_CVAR_ENABLE_GPU=0``). ``OPTCC_CUDA_AWARE=0|1`` overrides the guess; when in
    doubt the answer is no, and messages are staged through host memory, which is always
    correct.
    """
    forced = config.rc.cuda_aware
    if forced is not None:
        return forced
    version = MPI.Get_library_version()
    if "Open MPI" in version:
        return os.environ.get("OMPI_MCA_opal_cuda_support", "").lower() in ("1", "true")
    if os.environ.get("MPICH_GPU_SUPPORT_ENABLED") == "1":  # Cray MPICH
        return True
    if os.environ.get("MV2_USE_CUDA") == "1":  # MVAPICH
        return True
    if "MPICH" in version:
        if os.environ.get("MPIR_CVAR_ENABLE_GPU") == "0":
            return False
        return "cuda" in version.lower()
    return False


@functools.cache
def mpi_datatype_and_op(dtype_name: str, op: str) -> tuple[MPI.Datatype, MPI.Op]:
    """MPI datatype and op for ``MPI_Allreduce`` on ``dtype_name`` (the ``native`` path).

    ``dtype_name`` is a key of :data:`DTYPES` or NumPy's name (``float128``). Predefined
    types and ops are used where MPI's reduction has our semantics. A user-defined
    commutative op reduces with :func:`_reduce_with` instead for 16-bit floats (no MPI
    reduction, or not one in float32; they travel as 2-byte ``MPI.UINT16_T`` elements)
    and for ``max``/``min`` on floats (MPI's compare-and-select returns whichever operand
    comes second for NaN or equal zeros, so ranks could disagree). Callers that map floats
    to keys first (:func:`to_keys`) reduce integers and never need that op.
    """
    name = ALIASES.get(dtype_name, dtype_name)
    if name not in DTYPES:
        raise ArgumentError(f"unsupported dtype {dtype_name!r}; supported: {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    op = op_name(op)
    check_op_dtype(op, name)
    predefined = {
        "bool": MPI.C_BOOL,
        "float32": MPI.FLOAT,
        "float64": MPI.DOUBLE,
        "longdouble": MPI.LONG_DOUBLE,
        "complex64": MPI.C_FLOAT_COMPLEX,
        "complex128": MPI.C_DOUBLE_COMPLEX,
        "clongdouble": MPI.C_LONG_DOUBLE_COMPLEX,
    }
    for bits in (8, 16, 32, 64):
        predefined[f"int{bits}"] = getattr(MPI, f"INT{bits}_T")
        predefined[f"uint{bits}"] = getattr(MPI, f"UINT{bits}_T")
    float_maxmin = CATEGORY[name] == "float" and op in ("max", "min")
    if name in predefined and not float_maxmin:
        mpi_op = getattr(MPI, op.upper())
        if CATEGORY[name] != "int" or op not in ("sum", "prod"):
            return predefined[name], mpi_op
        if _library_wraps(predefined[name], mpi_op, dtype, op == "prod"):
            return predefined[name], mpi_op
        # The library's integer sum or product saturates on overflow (Open MPI's
        # vectorised 8- and 16-bit kernels clamp, a behaviour its developers keep), while
        # NumPy, C on real machines and our own schedules wrap modulo 2**bits: reduce with
        # NumPy so that native agrees with every other algorithm.

    def combine(inbuf: Buffer, inoutbuf: Buffer, datatype: MPI.Datatype) -> None:
        # mpi4py hands a user-defined op its MPI.buffer objects.
        a = np.frombuffer(cast(MPI.buffer, inbuf), dtype=dtype)
        b = np.frombuffer(cast(MPI.buffer, inoutbuf), dtype=dtype)
        # No warning or exception from inside MPI (and not on some ranks only).
        with np.errstate(all="ignore"):
            reduce_with(np, op, b, a)

    datatype = MPI.UINT16_T if dtype in LOW_PRECISION else predefined[name]
    return datatype, MPI.Op.Create(combine, commute=True)


def _library_wraps(datatype: MPI.Datatype, mpi_op: MPI.Op, dtype: np.dtype, prod: bool) -> bool:
    """Whether the MPI library's ``mpi_op`` on integers of ``datatype`` wraps on overflow.

    Asked of the library itself with ``MPI_Reduce_local`` (the same reduction kernels its
    collectives call) on a vector long enough for a vectorised kernel: every element
    overflows, and the result is compared with NumPy's modular arithmetic. Local, so
    every rank of a job gets the same answer without talking to the others.
    """
    info = np.iinfo(dtype)
    n = 256
    a = np.full(n, info.max, dtype=dtype)
    b = np.full(n, 2 if prod else 1, dtype=dtype)
    with np.errstate(over="ignore"):
        expected = a * b if prod else a + b
    mpi_op.Reduce_local([a, datatype], [b, datatype])
    return bool(np.array_equal(b, expected))
