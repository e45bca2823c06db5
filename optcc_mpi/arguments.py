"""One call's arguments, checked on this rank, and the checks of its buffers.

Phase 1 of a call (:mod:`optcc_mpi.collectives`, its module docstring has the five):
:class:`_Call` makes of what the caller passed what the later phases use: the send and
receive buffers as flat arrays of one array library (NumPy, CuPy, torch) and whether the
call is in place, the reduction and the element type by name, the algorithm and its parameters,
the link profile and the emulation (read as :mod:`optcc_mpi.planning` says), the plan
where it is known before the agreement, whether the data may travel in the check
(``fold``), and the header this rank sends in it (:mod:`optcc_mpi.check.protocol`). Nothing
here raises: an error is kept in ``_Call.err``, for the agreement to tell every rank before
any of them raises.

Buffers
-------
A receive buffer checked against the send buffer (:func:`_recvbuf_for`,
:func:`_same_shape`), how two buffers share memory (:class:`Overlap`, :func:`_overlap`,
:func:`_address`), a NumPy array's flat view (:func:`_numpy_flat`), and the in-place
marker recognised by its type's name (:func:`_is_in_place`), as mpi4py's is.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import numpy as np

from optcc_mpi import algorithms, config
from optcc_mpi.arrays import NUMPY, Array, ArrayOps, buffer_of
from optcc_mpi.check import protocol
from optcc_mpi.check.protocol import GATHER_MAX_P, code
from optcc_mpi.communicators import CallRecord, CommState, Plan
from optcc_mpi.dtypes import OPS, VALID_PAIRS, dtype_name, op_name
from optcc_mpi.dtypes import check_op_dtype as _check_op_dtype
from optcc_mpi.emulation import Emulation, forced_fraction
from optcc_mpi.errors import ArgumentError, ArgumentTypeError, as_ours
from optcc_mpi.executor import ExecStats
from optcc_mpi.links import Links
from optcc_mpi.planning import (
    _HEALTHY,
    PROBE,
    WATCH,
    _emulation_from_env,
    _learns_rate,
    _links_of,
    _plan,
    _rate_of,
)
from optcc_mpi.schedule import Params
from optcc_mpi.transports import Transport

if TYPE_CHECKING:
    from mpi4py import MPI

    from optcc_mpi.watch import Stopwatch

__all__ = ["Overlap"]

_OPSET = frozenset(OPS)
_NDARRAY = np.ndarray
_PROBE_CODE = code("probe")
_WATCH_CODE = code("watch")
_AUTO_CODE = code("auto")
_NUMPY_CODE = code("numpy")


def _is_in_place(sendbuf: object) -> bool:
    return sendbuf is None or type(sendbuf).__name__ == "InPlaceType"


class _Call:
    """One call's arguments, checked on this rank (an error is kept in ``err``: every
    rank must hear of it in the agreement before anyone raises)."""

    __slots__ = (
        "sendbuf", "result", "flat_in", "flat_out", "arrays", "in_place", "opn", "name",
        "count", "nbytes", "algorithm", "link_obj", "emu", "params", "check", "plan",
        "fold", "fields", "seen", "err", "epoch", "stats", "work", "keyed", "watched",
        "library", "label", "defer", "request", "record", "learnt", "rides", "clock",
    )  # fmt: skip

    def __init__(
        self,
        st: CommState,
        sendbuf: Any,
        recvbuf: Any,
        op: str | MPI.Op,
        algorithm: str,
        links: Links | str | None,
        emulate: Emulation | str | None,
        params: Params | None,
        check: bool,
        label: tuple[str, str] | None = None,
        classified: ArrayOps | None = None,
        observe: bool = True,
    ) -> None:
        self.sendbuf, self.result = sendbuf, recvbuf
        self.label = label
        self.defer = False
        self.request: object | None = None
        self.clock: Stopwatch | None = None  # (a watched call's library AllReduce in flight)
        self.record: CallRecord | None = None
        self.algorithm, self.params, self.check = algorithm, params, check
        self.plan: Plan | None = None
        self.fold = False
        self.fields: tuple[int, ...] = ()
        self.seen: np.ndarray | None = None  # the watch's observations, riding the check
        self.err: BaseException | None = None
        self.epoch = 0.0
        self.stats: ExecStats | None = None
        self.work: Array | None = None
        self.keyed = self.watched = self.library = self.rides = False
        self.learnt: float | None = None  # the link rate learnt, where the header has it
        self.link_obj = _HEALTHY
        self.emu: Emulation | None = None
        self.opn = op if type(op) is str and op in _OPSET else ""
        # The buffers as flat arrays and their array library, set by _buffers; where this rank's
        # arguments are rejected they stay unset (the call ends in the agreement, whose
        # message reads the array library only if set: shown()).
        self.flat_in: Array
        self.flat_out: Array | None  # None until a result is made for it (_plan_call)
        self.arrays: ArrayOps
        self.in_place = False
        self.name = ""
        self.count = self.nbytes = 0
        try:
            self._buffers(st.transport, sendbuf, recvbuf, classified)
            self._settings(st, op, links, emulate, observe)
        except Exception as exc:  # anything at all: the other ranks must hear of it
            self.err = as_ours(exc)
            self.fold = False

    def _buffers(
        self, transport: Transport, sendbuf: Any, recvbuf: Any, classified: ArrayOps | None
    ) -> None:
        """The send and receive buffers as flat arrays of one array library (``classified``:
        they are already, the caller classified them: :func:`~optcc_mpi.collectives.start_call`)."""
        flat_in: Array
        flat_out: Array | None
        arrays: ArrayOps
        in_place = _is_in_place(sendbuf) or sendbuf is recvbuf
        if classified is not None:
            # Classified once, where the call began (a tensor's view): each classification
            # is Python time on every call, and the caller's already said all of it.
            arrays, flat_out = classified, recvbuf
            flat_in = recvbuf if in_place else sendbuf
        elif type(sendbuf) is _NDARRAY and not in_place:
            # The commonest calls, checked inline (buffer_of does the same, slower).
            flat_in, arrays = _numpy_flat(sendbuf, "sendbuf"), NUMPY
            if recvbuf is None:
                flat_out = None
            elif type(recvbuf) is _NDARRAY:
                flat_out = _numpy_flat(recvbuf, "recvbuf")
                if flat_out.dtype != flat_in.dtype or flat_out.size != flat_in.size:
                    _same_shape(flat_in, flat_out)
                if np.may_share_memory(flat_in, flat_out):
                    in_place = _overlap(flat_in, flat_out) is Overlap.SAME
                    if not in_place:
                        raise ArgumentError(
                            "sendbuf and recvbuf overlap; use IN_PLACE to reduce in place"
                        )
                if not flat_out.flags.writeable:
                    raise ArgumentError("recvbuf is read-only")
            else:
                flat_out, in_place = _recvbuf_for(transport, flat_in, recvbuf, arrays)
        elif in_place:
            if recvbuf is None:
                raise ArgumentError(
                    "sendbuf is IN_PLACE (or None) but no recvbuf was given: pass the "
                    "buffer to reduce in place as recvbuf"
                )
            flat_out, arrays = buffer_of(recvbuf, what="recvbuf", tensors=transport.caps.tensors)
            flat_in = flat_out
        else:
            flat_in, arrays = buffer_of(sendbuf, what="sendbuf", tensors=transport.caps.tensors)
            flat_out = None
            if recvbuf is not None:
                flat_out, in_place = _recvbuf_for(transport, flat_in, recvbuf, arrays)
        if in_place and not arrays.writable(flat_out):
            raise ArgumentError("recvbuf is read-only")
        if transport.caps.tensors:  # a library of its own kinds of memory (torch.distributed)
            transport.check_arrays(arrays)
        self.flat_in, self.flat_out, self.arrays = flat_in, flat_out, arrays
        self.in_place = in_place
        self.name = arrays.dtype_name(flat_in) or dtype_name(flat_in.dtype)
        self.count = int(flat_in.shape[0])
        self.nbytes = self.count * flat_in.dtype.itemsize

    def _settings(
        self,
        st: CommState,
        op: str | MPI.Op,
        links: Links | str | None,
        emulate: Emulation | str | None,
        observe: bool = True,
    ) -> None:
        """The reduction, the algorithm's parameters, the link profile, the emulation,
        the plan where it is known already, and the header this rank sends (``observe``:
        and, for a watched call, what the watch observed: False for a header made ahead
        of its calls, which must not touch the watch, :func:`~optcc_mpi.collectives.prepare`)."""
        if not self.opn:
            self.opn = op_name(op)
        if (self.opn, self.name) not in VALID_PAIRS:
            _check_op_dtype(self.opn, self.name)
        if type(self.algorithm) is not str:
            raise ArgumentTypeError(
                f"algorithm must be a string, not {type(self.algorithm).__name__}"
            )
        if self.algorithm != "auto":
            algorithms.get(self.algorithm).check_params(self.params or {})
        self.link_obj = _links_of(st, links, self.nbytes)
        if emulate is None:
            self.emu = _emulation_from_env(config.rc.emulate)
        else:
            self.emu = Emulation.coerce(emulate)
        if self.emu is not None:
            forced_fraction()  # a bad per-rank fraction fails here, before the agreement
        # The plan is a pure function of arguments that must agree, so computing it
        # before the agreement cannot make ranks diverge; "probe" and "watch" wait.
        # A schedule sized by a link rate not learnt yet waits too (the rate is measured
        # collectively, after the agreement: _plan_call).
        if self.link_obj is not WATCH and not (st.rate is None and _learns_rate(st, self)):
            known = st.probe.links if st.probe is not None else None
            profile = known if self.link_obj is PROBE else self.link_obj
            if profile is not None:
                self.plan = _plan(st, self, profile)
        p = st.size
        if self.check and p > 1:
            if observe and self.link_obj is WATCH:
                # What the last call measured rides in the check's data room (the data of
                # a watched call never does: its plan waits for the agreed profile).
                self.seen = st.watch_made().contribution()
            self.fields = self._header(st)
            # A short sum that rides (check.ride): its data goes with a flag in the
            # library's AllReduce, never in the check nor gathered.
            self.rides = st.ride is not None and st.ride.takes(self.fields)
        self.fold = (
            self.check
            and self.algorithm == "auto"
            and self.plan is not None
            and self.plan.library_only
            and self.arrays is NUMPY
            and self.emu is None
            and 1 < p <= GATHER_MAX_P
            and not self.rides
        )

    def _header(self, st: CommState) -> tuple[int, ...]:
        link, emu, params = self.link_obj, self.emu, self.params
        lcode = (
            _PROBE_CODE
            if link is PROBE
            else _WATCH_CODE
            if link is WATCH
            else code(repr(link.key()))
            if link.fractions
            else 0
        )
        rate = self._rate(st)
        if rate is not None:
            lcode = code(f"{lcode} at {rate}")
        if link is WATCH and lcode not in st.watch_codes:
            # (check.ride: a watched call the watch needs nothing of rides; a handful of
            # codes, one per link rate)
            st.watch_codes.add(lcode)
        return (
            protocol.PROTOCOL,
            0,
            self.count,
            protocol.DTYPE_CODE[self.name],
            protocol.OP_CODE[self.opn],
            _AUTO_CODE if self.algorithm == "auto" else code(self.algorithm),
            lcode,
            0 if emu is None else code(str(emu)),
            _NUMPY_CODE if self.arrays is NUMPY else code(self.arrays.name),
            _params_code(params, self.label),
            self.nbytes,
            0,
        )

    def _rate(self, st: CommState) -> str | None:
        """The link rate the call's schedule is built from, for the header: the value of
        ``$OPTCC_LINK_RATE`` in bytes/s, or the rate learnt (``learnt`` and its value, or
        None before it is), where the schedule is built from it (a schedule of ours, or
        one not planned yet: the profile or the rate is learnt); else None. Ranks that
        build from different rates would run different schedules, so the check agrees on
        it. A call the library alone serves does not depend on it (nor does the compiled
        path's header carry it)."""
        text = self._rate_text()
        if text is not None:
            return repr(_rate_of(text))
        if _learns_rate(st, self) and (self.plan is None or not self.plan.library_only):
            self.learnt = st.rate or 0.0  # (for shown(): another rank's error message)
            return f"learnt {st.rate!r}"
        return None

    def _rate_text(self) -> str | None:
        """``$OPTCC_LINK_RATE`` as set, where the call's schedule is built from it."""
        if self.plan is not None and self.plan.library_only:
            return None
        return config.rc.link_rate

    def shown(self) -> dict[str, str]:
        """What this rank passed, in words, for error messages on other ranks."""
        link = self.link_obj
        profile = "probe" if link is PROBE else "watch" if link is WATCH else str(link)
        rate = self._rate_text()
        if rate is not None:
            profile += f" at OPTCC_LINK_RATE={rate}"
        elif self.learnt is not None:
            profile += (
                " before the link rate was learnt"
                if self.learnt == 0.0
                else f" at the link rate learnt ({self.learnt / 1e6:.3g} MB/s)"
            )
        shown = {
            "element count": str(self.count),
            "dtype": self.name or "?",
            "op": self.opn or "?",
            "algorithm": repr(self.algorithm),
            "link profile": profile,
            "emulation": str(self.emu or "none"),
            "array library": getattr(getattr(self, "arrays", None), "name", "?"),
            "params": repr(self.params or {}),
        }
        if self.label is not None:
            # The caller's own argument rides in the params field, under its own name.
            shown["params name"], shown["params"] = self.label
        return shown


def _params_code(params: Params | None, label: tuple[str, str] | None) -> int:
    """The header's field of the algorithm's parameters and the caller's label."""
    text = repr(sorted(params.items())) if params else ""
    if label is not None:
        text += f"|{label[0]}={label[1]}"
    return code(text) if text else 0


# -- buffers ------------------------------------------------------------------------------------
def _recvbuf_for(
    transport: Transport, flat_in: Array, recvbuf: Any, arrays: ArrayOps
) -> tuple[Array, bool]:
    """``recvbuf`` as a flat array of ``sendbuf``'s kind, checked, and whether it is
    ``sendbuf``'s very memory (then the call is in place, as in mpi4py)."""
    flat_out, out_arrays = buffer_of(recvbuf, what="recvbuf", tensors=transport.caps.tensors)
    if out_arrays is not arrays:
        raise ArgumentTypeError(
            f"sendbuf is a {arrays.name} buffer but recvbuf a "
            f"{out_arrays.name} one; pass two of the same kind"
        )
    _same_shape(flat_in, flat_out)
    overlap = _overlap(flat_in, flat_out)
    if overlap is Overlap.PARTLY:
        raise ArgumentError("sendbuf and recvbuf overlap; use IN_PLACE to reduce in place")
    if not arrays.writable(flat_out):
        raise ArgumentError("recvbuf is read-only")
    return flat_out, overlap is Overlap.SAME


def _same_shape(flat_in: Array, flat_out: Array) -> None:
    """ArgumentError unless send and receive buffers have the same type and count."""
    if flat_out.dtype != flat_in.dtype:
        raise ArgumentError(
            f"recvbuf dtype {flat_out.dtype} differs from sendbuf dtype {flat_in.dtype}"
        )
    if flat_out.shape[0] != flat_in.shape[0]:
        raise ArgumentError(f"recvbuf has {flat_out.shape[0]} elements, sendbuf {flat_in.shape[0]}")


def _numpy_flat(arr: np.ndarray, what: str) -> np.ndarray:
    """``arr`` as a 1-D view, if contiguous in either order."""
    if arr.ndim == 1:
        if arr.flags.c_contiguous:
            return arr
    else:
        flags = arr.flags
        if flags.c_contiguous or flags.f_contiguous:
            return arr.ravel(order="K")
    buffer_of(arr, what=what)  # raises the error
    raise AssertionError("unreachable: buffer_of refuses non-contiguous")  # pragma: no cover


class Overlap(enum.Enum):
    """How two buffers of the same size share memory."""

    #: Not at all.
    NONE = 0
    #: They are the same memory (the call is in place).
    SAME = 1
    #: In part (an error).
    PARTLY = 2


def _overlap(a: Array, b: Array) -> Overlap:
    """How ``a`` and ``b`` (1-D, same size and type) share memory."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):  # (both, or neither)
        if not np.may_share_memory(a, b):
            return Overlap.NONE
        pa = a.__array_interface__["data"][0]
        pb = b.__array_interface__["data"][0]
        return Overlap.SAME if pa == pb else Overlap.PARTLY
    pa, pb = _address(a), _address(b)
    if pa is None or pb is None:
        return Overlap.NONE
    if pa == pb:
        return Overlap.SAME
    n = a.shape[0] * a.dtype.itemsize
    return Overlap.PARTLY if pa < pb + n and pb < pa + n else Overlap.NONE


def _address(arr: Array) -> int | None:
    """Where a tensor's or a CuPy array's memory starts (None for other arrays)."""
    data_ptr = getattr(arr, "data_ptr", None)
    if data_ptr is not None:  # torch
        return int(data_ptr())
    ptr = getattr(getattr(arr, "data", None), "ptr", None)  # CuPy
    return None if ptr is None else int(ptr)
