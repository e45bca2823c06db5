"""The compiled call path: the commonest short AllReduce over MPI, in C.

A call of NumPy arrays with default arguments (``auto``, healthy links, no emulation, no
parameters) of a size and type whose earlier call over this communicator folded into the
check, or went to the library's AllReduce after it, is run by
:mod:`optcc_mpi.check.fastcall` (``_fastcall.c``): the same header, the same collectives,
the same rank-order sums as the Python path of :mod:`optcc_mpi.collectives`, at about the
library's own latency (the "Short calls" of that module's docstring). Here: enabling it
after such a call (:func:`_enable_compiled`; the records of its calls made once,
:func:`_fold_entry`; its context over the check's buffers, :func:`_compiled_context`),
and taking a call, or declining it having touched nothing (:func:`_try_compiled`,
:func:`_compiled`).

Not part of :mod:`optcc_mpi.check.fastcall`, which binds the C extension in a layer below
what this path reads: the communicators' state (:class:`~optcc_mpi.communicators.CommState`,
its plans and records, the registry).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from optcc_mpi import config
from optcc_mpi.arguments import _AUTO_CODE, _NDARRAY, _NUMPY_CODE, _is_in_place, _numpy_flat
from optcc_mpi.arrays import NUMPY
from optcc_mpi.check import fastcall, protocol
from optcc_mpi.check.protocol import Mismatch
from optcc_mpi.check.state import FOLD_MIN, CheckState, served
from optcc_mpi.communicators import _STATES, CallRecord, CommState, Fold, Plan, _known
from optcc_mpi.dtypes import NAME_OF
from optcc_mpi.errors import ExecutionError
from optcc_mpi.executor import ExecStats
from optcc_mpi.planning import _HEALTHY
from optcc_mpi.transports import Communicator

if TYPE_CHECKING:
    from mpi4py import MPI

#: The header of a short call on the compiled path, with the call's own fields zero.
_COMPILED_HEADER = (
    protocol.PROTOCOL, 0, 0, 0, 0, _AUTO_CODE, 0, 0, _NUMPY_CODE, 0, 0, 0
)  # fmt: skip
#: Per transport class, whether it offers the compiled path (asked once per class: a
#: check against a runtime protocol costs tens of microseconds a call).
_COMPILABLE: dict[type, bool] = {}


def _enable_compiled(st: CommState, dtype: np.dtype, nbytes: int, plan: Plan) -> None:
    """After a short call whose data travelled in the check with default arguments:
    let the next such calls of this size and type take the compiled path."""
    transport = st.transport
    known = _COMPILABLE.get(type(transport))
    if known is None:
        known = _COMPILABLE[type(transport)] = isinstance(transport, fastcall.Compilable)
    if not known:
        return
    if _STATES.fold is None:
        # Bound at the first MPI call that could use it (binding it loads MPI, which a
        # torch-only job never does).
        _STATES.fold = fastcall.fold_function()
        if _STATES.fold is None:
            return
    key = (nbytes, dtype)
    if key not in st.folds:
        st.folds.put(key, _fold_entry(st, plan))
    compilable = cast(fastcall.Compilable, transport)  # (known above)
    st.check.make_compiled(functools.partial(_compiled_context, compilable))


def _fold_entry(st: CommState, plan: Plan) -> Fold:
    """The records of this plan's calls on the compiled path, made once: a call there
    costs no allocation for its record."""
    name, on = st.transport.name, st.transport.board_state

    def record(inline: bool) -> CallRecord:
        return CallRecord(
            plan.algorithm, plan.schedule, ExecStats(), _HEALTHY, None, {}, inline, name, on
        )

    return Fold(plan, record(True), record(False))


def _compiled_context(transport: fastcall.Compilable, chk: CheckState) -> object | None:
    """The compiled path's context over the check buffers of ``chk``. Until the gather
    limit is decided: the least room, and nothing for the library (the Python path
    decides the limit at the first call that needs it)."""
    limit = chk.limit_known
    handles = transport.predefined if chk.gather_limit is not None else None
    return fastcall.context(
        chk.transport,
        chk.block,
        chk.gathered,
        chk.room,
        _COMPILED_HEADER,
        served(chk.size, chk.room, limit),
        FOLD_MIN,
        limit,
        handles,
    )


def _try_compiled(
    sendbuf: Any, recvbuf: Any, op: str | MPI.Op, comm: Communicator, check: bool
) -> np.ndarray | None:
    """The result if the compiled path took the call, else None (it declined, having
    touched nothing, and the Python path runs the call)."""
    if type(sendbuf) is _NDARRAY:
        if type(recvbuf) is _NDARRAY:
            return recvbuf if _compiled(sendbuf, recvbuf, op, comm, check) else None
        if recvbuf is None:
            out = np.empty_like(sendbuf)
            return out if _compiled(sendbuf, out, op, comm, check) else None
    elif _is_in_place(sendbuf) and type(recvbuf) is _NDARRAY:
        return recvbuf if _compiled(recvbuf, recvbuf, op, comm, check) else None
    return None


_OP_CODE = protocol.OP_CODE


def _compiled(
    sendbuf: np.ndarray, recvbuf: np.ndarray, op: str | MPI.Op, comm: Communicator, check: bool
) -> bool:
    """Run the call on the compiled path (:mod:`optcc_mpi.check.fastcall`) if it can take it;
    False when it declined, having touched nothing.

    The caller checked the arguments that must be at their defaults. Here: the
    communicator's state exists with a context for its current check room, which the
    ranks agreed for this call (every rank derives it from the previous call's headers),
    no setting changes the call, and an earlier call of this size and type was one whose
    data travels in that room, or (above the gather limit, once decided) one that went to
    the library's AllReduce after the check (``auto`` hands it to the library). With
    ``check=False`` the same collectives run without comparing the headers: up to the limit
    the room is the one the Python path's gather uses for this size
    (:func:`~optcc_mpi.check.state.room_for`), so ranks on either path move blocks of one
    shape; above it, the library's AllReduce alone.

    A loop over one communicator skips the lookup (:attr:`Registry.recent`). Holding the
    communicator object keeps its identity from being reused; a freed communicator's state
    has no compiled context (the registry drops it when the transport closes), so its
    calls go to Python."""
    recent_comm, st = _STATES.recent
    if comm is not recent_comm or st is None:
        st = _known(comm)
        if st is None:
            return False
        _STATES.recent = (comm, st)
    chk = st.check
    fast = chk.compiled
    if fast is None or (check and not chk.ready):
        return False  # (without the check, the room is room_for()'s: the C side checks it)
    if type(op) is not str:
        return False
    opc = _OP_CODE.get(op)
    rc = config.rc
    if opc is None or rc.links is not None or rc.emulate is not None:
        return False
    dtype = sendbuf.dtype
    nbytes = sendbuf.nbytes
    entry = st.folds.get((nbytes, dtype))
    if entry is None:
        return False
    # allreduce() comes here only once fold is bound (not None): no check on this path.
    answer = _STATES.fold(fast, sendbuf, recvbuf, opc, check)  # type: ignore[misc]
    if answer == fastcall.FALLBACK:
        return False
    inline = bool(check)
    if answer == fastcall.GATHERED:  # agreed; a reduction the C path leaves to NumPy
        protocol.reduce_gathered(chk, op, dtype, nbytes, _numpy_flat(recvbuf, "recvbuf"))
    elif answer == fastcall.LIBRARY:  # the check, then the library's AllReduce
        inline = False
    elif answer == fastcall.MISMATCH:
        # As the Python path: every rank saw the same headers, so the same next room and
        # the same error (the ranks on the Python path raise it from the check).
        table = chk.heads.copy().view("<i8")
        chk.agree_next(FOLD_MIN)
        shown = {
            "element count": str(sendbuf.size),
            "dtype": NAME_OF[dtype],
            "op": op,
            "algorithm": "'auto'",
            "link profile": str(_HEALTHY),
            "emulation": "none",
            "array library": NUMPY.name,
            "params": "{}",
        }
        protocol.disagreement(chk, None, Mismatch(table=table), shown)
    elif answer != fastcall.DONE:
        raise ExecutionError(f"the compiled call path failed (code {answer})")
    _STATES.last = entry.gathered if inline else entry.library
    return True
