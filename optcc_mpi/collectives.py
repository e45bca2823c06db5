"""The public AllReduce, in the style of mpi4py, over any transport.

``allreduce(sendbuf, recvbuf=None, *, op="sum", comm=None, algorithm="auto", links=None)``
reduces arrays, buffers and tensors over an mpi4py communicator or a ``torch.distributed``
process group with the chosen algorithm; see :mod:`optcc_mpi.dtypes` and
:mod:`optcc_mpi.reductions` for the element types, the reductions and their NaN and
signed-zero rules, and ``docs/api.md`` for the whole interface.

A call in five phases
---------------------
Each phase is a function of a few named arguments, shared by every transport; this module
holds the flow, the agreement, the run and the finish, and the parts named below:

1. **check** (:class:`optcc_mpi.arguments._Call`): this rank's arguments as flat arrays of
   one array library, the reduction, the link profile and the emulation; any error is kept, not
   raised;
2. **agree** (:func:`_agree_call`): one collective of fixed shape (:mod:`optcc_mpi.check.protocol`),
   after which every rank goes on, or raises the same error before any buffer changed;
3. **plan** (:func:`optcc_mpi.planning._plan_call`): the link profile (given, probed or
   watched), the link rate, and the schedule of the algorithm (``auto``: the fastest by
   the model, :func:`choose_algorithm`), cached per communicator;
4. **run** (:func:`_run_data`): the data already reduced in the check, the library's own
   AllReduce, every rank's data gathered and reduced in rank order, or the schedule on
   the executor over the communicator's transport (:mod:`optcc_mpi.transports`);
5. **finish** (:func:`_finish`): keys back to floats, canonical NaNs, the record of the
   call (:func:`last_stats`).

Every communicator's state, and the last call's record, are kept in one registry
(:data:`optcc_mpi.communicators._STATES`).

Short calls
-----------
When the library's collective is what ``auto`` would run (short messages), up to the
communicator's gather limit (:mod:`optcc_mpi.check.crossover`: measured once per communicator,
the size above which the check plus the library's AllReduce beats gathering p times the
bytes) the data travels in the check itself and every rank reduces every rank's
contribution in rank order: bit-identical on every rank by construction, one collective in
all. Above the limit the check carries only the header and the library's AllReduce
follows. The commonest short call over MPI (NumPy arrays, default arguments, a size seen
before) runs either in C (:mod:`optcc_mpi.compiled_path`, over
:mod:`optcc_mpi.check.fastcall`): the same header, the same collectives, the same
rank-order sums, at about the library's own latency.

Across machines over gloo (no board, no compiled path) a short sum *rides*
(:mod:`optcc_mpi.check.ride`): its data goes to the library's AllReduce with each rank's
flag of agreement as one more element, and a call of the signature every rank expects is
agreed by those flags alone (:func:`_guessed`, :meth:`Prepared.start`): one collective.

With ``check=False`` the check is skipped (then the ranks must pass the same arguments,
and ``check`` itself must be the same on every rank).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from time import perf_counter
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from optcc_mpi import algorithms, config, transports
from optcc_mpi.algorithms._policy import SMALL_BYTES
from optcc_mpi.arguments import _NDARRAY, _Call
from optcc_mpi.arrays import NUMPY, Array, ArrayOps, result_like
from optcc_mpi.check import crossover, protocol
from optcc_mpi.check.protocol import GATHER_MAX_P, Mismatch
from optcc_mpi.check.ride import RIDE_MAX
from optcc_mpi.check.state import FOLD_MIN, FOLD_TOTAL, room_for
from optcc_mpi.communicators import _STATES, CallRecord, CommState, Plan, _known
from optcc_mpi.compiled_path import _enable_compiled, _try_compiled
from optcc_mpi.dtypes import CATEGORY, NAME_OF
from optcc_mpi.emulation import Emulation, Pacer
from optcc_mpi.executor import ExecStats, execute
from optcc_mpi.links import Links
from optcc_mpi.planning import (
    _HEALTHY,
    WATCH,
    _plan,
    _plan_call,
    choose_algorithm,
    settle_ridden,
    watch_ridden,
)
from optcc_mpi.probe import ProbeResult, probe
from optcc_mpi.reductions import reduce_rows
from optcc_mpi.schedule import Params, Schedule
from optcc_mpi.transports import Communicator
from optcc_mpi.watch import MIN_BYTES, Stopwatch

if TYPE_CHECKING:
    from mpi4py import MPI

    #: "auto" and every registered algorithm (computed on use: module ``__getattr__``).
    ALGORITHMS: tuple[str, ...]
    #: mpi4py's ``MPI.IN_PLACE`` where mpi4py loads, else ours (module ``__getattr__``).
    IN_PLACE: MPI.InPlaceType | InPlaceType

__all__ = [
    "allreduce",
    "cached_probe",
    "choose_algorithm",
    "comm_state",
    "gather_limit",
    "last_stats",
    "CallRecord",
    "SMALL_BYTES",
    "GATHER_MAX_P",
]  # and IN_PLACE, ALGORITHMS (module __getattr__)


class InPlaceType:
    """The type of :data:`IN_PLACE` where mpi4py is not installed (a torch-only job)."""

    def __repr__(self) -> str:
        return "IN_PLACE"


def __getattr__(name: str) -> object:
    if name == "ALGORITHMS":
        # "auto" and every registered algorithm; computed on use, so that algorithms
        # registered later (entry points, tests) are included.
        return ("auto", *algorithms.names())
    if name == "IN_PLACE":
        # mpi4py's own marker where mpi4py loads (so MPI.IN_PLACE and optcc_mpi.IN_PLACE
        # are one object), else ours: both are recognised by their type's name.
        try:
            from mpi4py import MPI
        except (ImportError, RuntimeError):
            value: MPI.InPlaceType | InPlaceType = InPlaceType()
        else:
            value = MPI.IN_PLACE
        globals()["IN_PLACE"] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: What :func:`start_call` passes as the send buffer of an in-place call (recognised by its
#: type's name, as mpi4py's ``MPI.IN_PLACE`` is).
IN_PLACE_MARK = InPlaceType()


def last_stats() -> Mapping[str, object]:
    """What the last :func:`allreduce` on this process did, as a
    :class:`~optcc_mpi.communicators.CallRecord` (read by attribute or by key):
    ``algorithm`` (the one that ran), ``schedule``, ``stats``
    (:class:`~optcc_mpi.executor.ExecStats`), ``links``, ``emulate``, ``params``,
    ``inline`` (True when the data travelled with the argument check) and ``transport``
    (its library: ``mpi``, ``gloo``, ``nccl``). Empty before the first call."""
    rec = _STATES.last
    return rec if rec is not None else {}


def comm_state(comm: Communicator = None) -> CommState:
    """The collectives' state of ``comm`` (an mpi4py communicator, None for COMM_WORLD,
    a torch.distributed process group, or a transport), made on first use (collective
    then). For reading (the lab, tests): the collectives alone write it."""
    return _state(comm)


def cached_probe(
    comm: Communicator = None, *, emulate: Emulation | str | None = None, refresh: bool = False
) -> ProbeResult:
    """:func:`optcc_mpi.probe.probe` of ``comm``, once per communicator (kept with its
    state; collective when it measures)."""
    st = _state(comm)
    if refresh or st.probe is None:
        st.probe = probe(st.transport, emulate=emulate)
    return st.probe


def gather_limit(comm: Communicator = None) -> int:
    """The largest short message (bytes) that ``auto`` gathers from every rank and
    reduces in rank order on ``comm`` (an mpi4py communicator, None for COMM_WORLD, or a
    torch.distributed process group); above it the argument check carries only its
    header and the library's AllReduce follows (:mod:`optcc_mpi.check.crossover`).

    Measured (or read from ``$OPTCC_GATHER_LIMIT``) at the first call that needs it;
    asking here decides it now if needed, which is collective: ask on every rank."""
    return crossover.decide(_state(comm).check)


def allreduce(
    sendbuf: Any,  # a user's buffer, any of the kinds below: classified by the check
    recvbuf: Any = None,
    *,
    op: str | MPI.Op = "sum",
    comm: Communicator = None,
    algorithm: str = "auto",
    links: Links | str | None = None,
    emulate: Emulation | str | None = None,
    params: Params | None = None,
    check: bool = True,
) -> Any:  # recvbuf, or a new result of sendbuf's kind
    """Element-wise reduction of every rank's buffer, result on every rank.

    Parameters
    ----------
    sendbuf : array, buffer, tensor, IN_PLACE or None
        This rank's contribution: a NumPy or CuPy array (any shape, C or Fortran order,
        contiguous), a PyTorch tensor (CPU or CUDA), any object with the buffer protocol
        (``array.array``, ``bytearray``, ``memoryview``) or the CUDA array interface, or
        an mpi4py buffer specification (``[buf, MPI.DOUBLE]``, ``[buf, count,
        MPI.DOUBLE]``, ...). ``IN_PLACE`` or None reduces ``recvbuf`` in place, as does
        passing the same object (or the same memory) as ``recvbuf``.
    recvbuf : same kinds, optional
        Where the result goes: same element type and count as ``sendbuf``, writable. A
        new array (tensor for a tensor, NumPy array for other buffers) is returned when
        omitted.
    op : str or mpi4py.MPI.Op
        ``"sum"``, ``"prod"``, ``"max"``, ``"min"``, ``"land"``, ``"lor"``, ``"lxor"``,
        ``"band"``, ``"bor"``, ``"bxor"`` or the ``MPI.Op`` of the same name; each on the
        element types MPI defines it for. User-defined ops are refused.
    comm : mpi4py.MPI.Intracomm or torch.distributed.ProcessGroup, optional
        Communicator (default ``COMM_WORLD``); not an intercommunicator, not COMM_NULL.
        A process group runs the schedule over torch.distributed (gloo: CPU tensors and
        NumPy arrays; NCCL: CUDA tensors), with no MPI library needed.
    algorithm : str
        ``"auto"`` or a registered algorithm (``optcc_mpi.ALGORITHMS``). ``auto`` picks
        the fastest by the model for this size and link profile, and the library's
        collective for short messages.
    links : Links or str, optional
        Degraded ranks, ``"RANK:FRACTION,..."`` in ranks of ``comm``, ``"probe"`` to
        measure them (once per communicator, :mod:`optcc_mpi.probe`), or ``"watch"`` to
        learn them from the calls' own messages and follow them as they change
        (:mod:`optcc_mpi.watch`). Default ``$OPTCC_LINKS``, in the job's ranks (MPI's
        COMM_WORLD, torch's global ranks; translated to ``comm``), else healthy. Must be
        the same on every rank.
    emulate : Emulation or str, optional
        Pace every rank's messages like a NIC of this rate and latency (the profile's
        fractions apply); default ``$OPTCC_EMULATE``, else none.
    params : dict, optional
        Extra parameters for the algorithm's schedule function (e.g. ``{"k": 16}``).
    check : bool
        Agree on the arguments across ranks (module docstring). Turn off only when the
        arguments are known to agree; must be the same on every rank.

    Returns
    -------
    object
        ``recvbuf``, or the new result.

    Raises
    ------
    ArgumentError, ArgumentTypeError
        (ValueError, TypeError) on every rank, naming the offending rank and value,
        before any buffer is modified; also for a bad ``$OPTCC_LINKS``, ``$OPTCC_EMULATE``
        or ``$OPTCC_EMULATE_FRACTION`` on any rank.

    Notes
    -----
    Results are deterministic and bit-identical on every rank: every schedule fixes the
    order of every reduction. See :mod:`optcc_mpi.reductions` for NaN and signed zeros.

    Examples
    --------
    Under plain ``python`` ``COMM_WORLD`` is this one process, so the result is the input;
    under ``mpiexec -n 4 python -m mpi4py script.py`` the same lines give every rank the
    sum over the four ranks.

    >>> import numpy as np
    >>> import optcc_mpi
    >>> x = np.arange(4, dtype=np.float32)
    >>> optcc_mpi.allreduce(x)
    array([0., 1., 2., 3.], dtype=float32)

    Into a buffer of your own, with another reduction and a named algorithm; which one ran:

    >>> y = np.empty_like(x)
    >>> optcc_mpi.allreduce(x, y, op="max", algorithm="ring") is y
    True
    >>> optcc_mpi.collectives.last_stats()["algorithm"]
    'ring'

    OptCC told that rank 0's link runs at half rate, and in place:

    >>> optcc_mpi.allreduce(x, algorithm="optcc", links="0:0.5")
    array([0., 1., 2., 3.], dtype=float32)
    >>> optcc_mpi.allreduce(optcc_mpi.IN_PLACE, y) is y
    True

    A bad argument raises on every rank before any buffer is touched:

    >>> optcc_mpi.allreduce(x, links="1:0.5")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    optcc_mpi.errors.ArgumentError: link profile names rank 1, outside the communicator of size 1...
    """
    if (
        (check is True or check is False)
        and algorithm == "auto"
        and links is None
        and emulate is None
        and params is None
        and _STATES.fold is not None
    ):
        done = _try_compiled(sendbuf, recvbuf, op, comm, check)
        if done is not None:
            return done
    ordered = getattr(comm, "optcc_ordered", None)
    if ordered is not None:
        # A communicator with a queue of its own (a group of the optcc torch backend):
        # the call takes its place in that queue, whichever thread makes it.
        return ordered(
            lambda wire: allreduce(
                sendbuf, recvbuf, op=op, comm=wire, algorithm=algorithm, links=links,
                emulate=emulate, params=params, check=check,
            )
        )  # fmt: skip
    st = _state(comm)
    call = _Call(st, sendbuf, recvbuf, op, algorithm, links, emulate, params, check)
    return Started(st, call).wait()


class Started:
    """One call of :func:`allreduce` past its check, plan and posting: what a caller with
    a queue of its own (the ``optcc`` torch backend) holds while the library's AllReduce
    is in flight, so that the caller's thread can go on.

    Made by :func:`start_call` (and by :func:`allreduce`, which waits at once). Unless
    :attr:`request` is set, the call is complete; else :meth:`wait` completes it, or
    :meth:`finish` once the request completed.

    Parameters
    ----------
    st : CommState
        The communicator's state.
    call : _Call
        The call, checked on this rank.
    defer : bool
        Leave the library's AllReduce in flight (:attr:`request`) rather than waiting.
    guessed : bool
        The ride's round of this call was made already, and every rank dropped it
        (:meth:`Prepared.start`): the call goes on to the check.
    """

    __slots__ = ("st", "call", "request", "result")

    def __init__(
        self, st: CommState, call: _Call, defer: bool = False, guessed: bool = False
    ) -> None:
        self.st, self.call = st, call
        call.defer = defer
        #: The library's AllReduce still in flight (a request of the transport), or None.
        self.request: object | None = None
        self.result: Any = None  # what allreduce returns
        if not guessed and st.ride is not None and _guessed(st, call):
            self.result = _finish(st, call)
            return
        if _agree_call(st, call):
            self.result = _finish_inline(st, call)
            return
        _plan_call(st, call)
        _run_data(st, call)
        if call.request is None:
            self.result = _finish(st, call)
        else:
            self.request = call.request

    def wait(self) -> Any:  # what allreduce returns
        """Wait for the library's AllReduce (if in flight) and finish; the result."""
        if self.request is not None:
            self.st.transport.wait(self.request)
            self.finish()
        return self.result

    def finish(self) -> Any:  # what allreduce returns
        """Complete the call once :attr:`request` completed; the result."""
        if self.request is not None:
            self.request = None
            if self.call.clock is not None:
                self.call.clock.stop()
            self.result = _finish(self.st, self.call)
        return self.result

    @property
    def record(self) -> CallRecord | None:
        """What the call did, once complete."""
        return self.call.record


def start_call(
    buf: Any,
    *,
    comm: Communicator,
    op: str | MPI.Op = "sum",
    algorithm: str = "auto",
    links: Links | str | None = None,
    check: bool = True,
    sendbuf: Any = None,
    error: BaseException | None = None,
    label: tuple[str, str] | None = None,
    classified: ArrayOps | None = None,
) -> Started:
    """Start an in-place :func:`allreduce` of ``buf`` (from ``sendbuf`` if given) with the
    library's AllReduce left in flight: for callers that keep calls in order themselves
    (the ``optcc`` torch backend). ``error``: an error this rank already found in its own
    arguments (it is agreed like any other, so every rank raises). ``label``: a further
    argument that must agree across the ranks, as ``(name, value in words)`` (the
    ``optcc`` backend's average or pre-multiplied sum), named in the error if it differs.
    ``classified``: ``buf`` (and ``sendbuf``) are 1-D contiguous arrays of this library,
    of one type and length, classified by the caller already (the tensor path's views,
    :func:`optcc_mpi.torch.tensors.start_tensor`): they are not classified again.

    Returns
    -------
    Started
        Finish it with :meth:`Started.wait`, or, once :attr:`Started.request` completed,
        :meth:`Started.finish`.
    """
    st = _state(comm)
    call = _Call(
        st, IN_PLACE_MARK if sendbuf is None else sendbuf, buf, op, algorithm, links, None,
        None, check, label=label, classified=classified,
    )  # fmt: skip
    if error is not None:  # (before whatever the buffers' check found without it)
        call.err = error
        call.fold = False
    return Started(st, call, defer=True)


class Prepared:
    """In-place calls of one signature on one communicator, checked and planned on this
    rank once (:func:`prepare`): each later call goes from the check straight to the
    wire, through the same steps as :func:`start_call` takes for it (the same header, the same
    gather, the same library AllReduce), so that a rank on this path and a rank on
    :func:`start_call` run the same collectives and get the same bits.

    What it serves: NumPy arrays of a type and op the transport reduces exactly as we do,
    on healthy links, ``auto``, no emulation, on a transport whose AllReduce is
    bandwidth-optimal and gives the same bits on every rank (gloo's ring): the calls of
    the ``optcc`` torch backend on CPU tensors. Also watched calls (the links learnt, as
    across machines by default) where calls ride (:mod:`optcc_mpi.check.ride`): a call
    the ride expects and the watch needs nothing of (:meth:`Ride.expected
    <optcc_mpi.check.ride.Ride.expected>`) is one round and the watch's bookkeeping;
    any other goes the whole way (:func:`start_call`'s steps, waited for).
    """

    __slots__ = ("st", "fields", "fold", "opn", "name", "dtype", "count", "nbytes",
                 "short", "check", "shown", "records", "env", "rides", "watched",
                 "schedule", "rate", "args")  # fmt: skip

    def __init__(
        self,
        st: CommState,
        call: _Call,
        env: tuple[object, object],
        plan: Plan,
        args: tuple[str, str, Links | str | None, tuple[str, str] | None],
    ) -> None:
        flat = cast(np.ndarray, call.flat_in)
        self.st, self.fields, self.fold, self.check = st, call.fields, call.fold, call.check
        self.opn, self.name, self.dtype = call.opn, call.name, flat.dtype
        self.count, self.nbytes = call.count, call.nbytes
        p = st.size
        self.short = 1 < p <= GATHER_MAX_P  # (auto, the library alone, no emulation)
        self.rides = call.rides
        self.shown = call.shown()
        self.env = env
        self.watched = call.link_obj is WATCH
        #: The plan's schedule (a watched call's: the one the library's AllReduce runs),
        #: the link rate the header was made with (a watched call's header names it),
        #: and the arguments of the whole path (op, algorithm, links, label).
        self.schedule, self.rate, self.args = plan.schedule, st.rate, args
        name, on = st.transport.name, st.transport.board_state
        #: The record of a call whose data travelled in the check, and of one that did not.
        self.records = tuple(
            CallRecord(
                plan.algorithm, plan.schedule, ExecStats(), _HEALTHY, None, {}, inline, name, on
            )
            for inline in (False, True)
        )

    def current(self) -> bool:
        """Whether the settings it was prepared under still hold (``$OPTCC_LINKS`` and
        ``$OPTCC_EMULATE`` as read now; a watched call's link rate, which its header
        names)."""
        rc = config.rc
        return (
            self.env[0] is rc.links
            and self.env[1] is rc.emulate
            and (not self.watched or self.rate == self.st.rate)
        )

    def start(self, flat: np.ndarray) -> tuple[CallRecord, object | None]:
        """Reduce ``flat`` (an array of the signature) in place: ``(record, request)``,
        the library's AllReduce left in flight as ``request`` (None: complete). Raises
        the same :class:`~optcc_mpi.errors.ArgumentError` on every rank if the ranks'
        arguments differ (then ``flat`` is unchanged)."""
        st = self.st
        ride = st.ride
        if self.watched:
            return self._start_watched(flat)
        if ride is not None and ride.guess(self.fields if self.rides else None, flat, flat):
            _STATES.last = record = self.records[0]
            return record, None
        if self.check and st.size > 1:
            inline = _agree_checked(
                st, self.fields, None, self.fold, flat, None, lambda: self.shown
            )
            if inline:
                protocol.reduce_gathered(st.check, self.opn, self.dtype, self.nbytes, flat)
                _STATES.last = record = self.records[1]
                return record, None
        elif ride is not None:
            ride.reset()  # (nothing agreed: every rank skips the check alike)
        _STATES.last = record = self.records[0]
        if st.size == 1:
            return record, None
        if self.rides:
            assert ride is not None  # (self.rides: the call's)
            ride.reduce(flat, flat, self.name)
            return record, None
        if self.short and self.nbytes and _gathered(st, self.nbytes):
            _gather_reduce(st, self.opn, flat, flat, NUMPY)  # (as _run: rank order)
            return record, None
        return record, st.transport.allreduce(NUMPY, flat, self.name, self.opn)

    def _start_watched(self, flat: np.ndarray) -> tuple[CallRecord, object | None]:
        """:meth:`start` of a watched call: where the ride expects this signature (then
        the watch needs nothing of the call), its round, carrying what the last call
        observed, and the watch's bookkeeping (:func:`~optcc_mpi.planning.settle_ridden`'s);
        else, or where every rank dropped the round, :func:`start_call`'s steps from
        where the round left them, waited for (a call the watch observes, a probe, the
        first calls of a pattern)."""
        st = self.st
        ride = st.ride
        assert ride is not None  # (prepare: a watched call is prepared where calls ride)
        sig = ride.expects(self.fields)
        guessed = sig is not None
        if guessed:
            # (what the last call observed, where it has anything to tell: the round
            # carries nothing else, ride.Ride.guess)
            watch = st.watch_made()
            contribution = watch.contribution() if watch.carried_size() else None
            if ride.guess(self.fields, flat, flat, contribution, expected=sig):
                watch_ridden(st, self.schedule, self.nbytes, ride.carried)
                _STATES.last = record = self.records[0]
                return record, None
        op, algorithm, links, label = self.args
        call = _Call(
            st, IN_PLACE_MARK, flat, op, algorithm, links, None, None, True, label=label,
            classified=NUMPY,
        )  # fmt: skip
        started = Started(st, call, guessed=guessed)
        started.wait()
        assert call.record is not None  # (complete)
        return call.record, None


def prepare(
    buf: np.ndarray,
    *,
    comm: Communicator,
    op: str = "sum",
    algorithm: str = "auto",
    links: Links | str | None = None,
    check: bool = True,
    label: tuple[str, str] | None = None,
    classified: bool = False,
) -> Prepared | None:
    """The :class:`Prepared` calls of ``buf``'s signature (its dtype and length, in
    place) with these arguments, or None where such a call is not one it serves (then
    :func:`start_call` each). Checks on this rank only: nothing is communicated.
    ``classified``: ``buf`` is a 1-D contiguous writable array, as the caller found
    (:func:`~optcc_mpi.torch.tensors.lane`): not classified again."""
    if type(buf) is not _NDARRAY:
        return None
    st = _state(comm)
    rc = config.rc
    env = (rc.links, rc.emulate)
    call = _Call(
        st, IN_PLACE_MARK, buf, op, algorithm, links, None, None, check, label=label,
        classified=NUMPY if classified else None, observe=False,
    )  # fmt: skip
    transport = st.transport
    plan = call.plan
    # A watched signature only where it may ride: the others' calls take the whole path,
    # where the library's AllReduce stays in flight as the group's thread goes on.
    watched = (
        call.link_obj is WATCH
        and call.err is None
        and st.ride is not None
        and bool(call.fields)
        and call.nbytes <= RIDE_MAX
    )
    if watched:
        # (what a watched call the watch needs nothing of runs: settle_ridden)
        plan = _plan(st, call, _HEALTHY)
    if (
        call.err is not None
        or call.arrays is not NUMPY
        or not call.in_place
        or call.algorithm != "auto"
        or not (call.link_obj is _HEALTHY or watched)
        or call.emu is not None
        or plan is None
        or not (plan.library_only or st.size == 1)
        or call.opn != "sum"
        or not (transport.caps.library_optimal and transport.caps.library_identical)
        or not transport.native(NUMPY, call.name, call.opn)
    ):
        return None
    return Prepared(st, call, env, plan, (call.opn, algorithm, links, label))


def _state(comm: Communicator) -> CommState:
    """The communicator's state (:func:`_known`, else made or found by its transport)."""
    st = _known(comm)
    return st if st is not None else _STATES.state(transports.of(comm))


# -- phase 2: agree -----------------------------------------------------------------------------
def _agree_call(st: CommState, call: _Call) -> bool:
    """The check (:mod:`optcc_mpi.check.protocol`); True when the data travelled in it. Raises
    the same error on every rank if any rank failed or the ranks disagree."""
    if call.check and st.size > 1:
        # (Only NumPy arrays travel in the check: _settings decides fold.)
        data = cast("np.ndarray | None", call.flat_in if call.fold else None)
        inline = _agree_checked(st, call.fields, call.err, call.fold, data, call.seen, call.shown)
        call.epoch = perf_counter()  # a collective just ended: about the same instant everywhere
        return inline
    if st.ride is not None:
        st.ride.reset()  # (nothing agreed: every rank skips the check alike)
    if call.err is not None:
        raise call.err
    return False


def _agree_checked(
    st: CommState,
    fields: tuple[int, ...],
    err: BaseException | None,
    fold: bool,
    data: np.ndarray | None,
    extra: np.ndarray | None,
    shown: Callable[[], dict[str, str]],
) -> bool:
    """:func:`~optcc_mpi.check.protocol.agree_header`, the same error on every rank if it
    finds a mismatch (``shown``: this rank's arguments in words, asked for then), and
    the ride's record of what every rank agreed (or of an error, after which nothing is
    expected)."""
    ride = st.ride
    try:
        inline = protocol.agree_header(st.check, fields, err, fold, data, extra)
    except Mismatch as mismatch:
        if ride is not None:
            ride.reset()
        protocol.disagreement(st.check, err, mismatch, shown())
    if ride is not None:
        ride.agreed(fields)
    return inline


def _guessed(st: CommState, call: _Call) -> bool:
    """The round of the signature every rank expects (check.ride), where there is one;
    True if every rank flagged it: the call is complete but for its record."""
    ride = st.ride
    assert ride is not None  # (the caller's test)
    # (A call that rides has NumPy data and, healthy and auto, its plan, or is watched
    # and planned once the watch has agreed: the header says.)
    mine = call.err is None and call.rides and (call.plan is not None or call.link_obj is WATCH)

    def out() -> np.ndarray:
        if call.flat_out is None:
            call.result, call.flat_out = result_like(call.sendbuf, call.flat_in, call.arrays)
        call.work = call.flat_out
        return cast(np.ndarray, call.flat_out)

    if not ride.guess(
        call.fields if mine else None,
        cast(np.ndarray, call.flat_in) if mine else None,
        out,
        call.seen if mine else None,
    ):
        return False
    if call.link_obj is WATCH:  # (every rank's: the flags say every header was the same)
        settle_ridden(st, call, ride.carried)
    return True


# -- phase 4: run -------------------------------------------------------------------------------
def _run_data(st: CommState, call: _Call) -> None:
    """The data phase: gathered and reduced in rank order, the library's AllReduce, or
    the schedule on the executor."""
    p, arrays, flat_out, plan = st.size, call.arrays, call.flat_out, call.plan
    assert flat_out is not None and plan is not None  # made by now (_settings, _plan_call)
    coll_only = plan.library_only
    # (agreed: every rank's call rides; a watched one only if the watch, having agreed,
    # left it to the library as it foresaw)
    if call.rides and plan.library_only:
        assert st.ride is not None  # (call.rides: _settings)
        st.ride.reduce(cast(np.ndarray, call.flat_in), cast(np.ndarray, flat_out), call.name)
        call.work = flat_out
        if call.watched:
            st.watch_made().served(st.rank, plan.schedule, call.nbytes, st.ride.took)
        return
    short = call.algorithm == "auto" and coll_only and call.emu is None and 1 < p <= GATHER_MAX_P
    if short and 0 < call.nbytes and _gathered(st, call.nbytes):
        # A short message that did not travel in the check (the first call of a size, a
        # device array, a tensor): gathered and reduced in rank order all the same, so
        # that what auto returns never depends on which calls came before.
        _gather_reduce(st, call.opn, call.flat_in, flat_out, arrays)
        if call.watched:  # (as a call the library served: nothing timed, the log told)
            st.watch_made().unobserved(st.rank, plan.schedule)
        return
    # Out of place, the send buffer is read where the input is first needed (by the
    # executor, by the keys' conversion) rather than copied into recvbuf first: one pass
    # over memory less. A read-only one is copied: not every library sends from it.
    source = None if call.in_place or not arrays.writable(call.flat_in) else call.flat_in
    if source is None and not call.in_place:
        arrays.copyto(flat_out, call.flat_in)
    work = flat_out
    call.keyed = p > 1 and call.opn in ("max", "min") and arrays.has_keys(flat_out.dtype)
    if call.keyed:
        # max/min on floats reduce order-preserving integer keys (optcc_mpi.reductions).
        work = arrays.to_keys(flat_out, call.opn, source)
        source = None
    call.work = work
    if p == 1:
        if source is not None:
            arrays.copyto(flat_out, source)
        return
    pacer = call.emu.pacer(st.rank, p, call.link_obj) if call.emu is not None else None
    transport = st.transport
    wname = arrays.dtype_name(work) or NAME_OF[cast(np.dtype, work.dtype)]
    if coll_only and pacer is None and not transport.native(arrays, wname, call.opn):
        # A library that cannot reduce this type as we do: every rank's data, reduced in
        # rank order on every rank.
        _gather_reduce(st, call.opn, work if source is None else source, work, arrays)
        return
    if coll_only and pacer is None and not (arrays.device and transport.caps.sync_device):
        # A schedule that is only the library's collective: call it directly (in place,
        # as every rank must: MPI_IN_PLACE is all or none).
        if source is not None:
            arrays.copyto(work, source)
        # (a watched call is timed: on links held healthy the tripwire, LinkWatch._timed)
        clock = Stopwatch() if call.watched else None
        if call.defer:
            call.request = transport.allreduce(arrays, work, wname, call.opn)
            call.clock = clock  # (stopped when the request completes: Started.finish)
        else:
            transport.allreduce_now(arrays, work, wname, call.opn)
            if clock is not None:
                clock.stop()
        call.library = short and not call.keyed  # (the compiled path can take the next)
        if clock is not None:
            st.watch_made().served(st.rank, plan.schedule, call.nbytes, clock)
        return
    # Each rank reduces different parts: a floating-point warning or exception
    # (np.seterr) on one rank alone would leave the others waiting.
    sched = plan.schedule
    # (a watched call's messages are timed at their arrival: watch.MIN_BYTES)
    stamp_from = MIN_BYTES if call.watched and pacer is None else 0
    with np.errstate(all="ignore"):
        stats = call.stats = execute(
            sched, work, comm=transport, op=call.opn, arrays=arrays, pacer=pacer,
            source=source, stamp_from=stamp_from,
        )  # fmt: skip
    if call.watched:
        _record_watch(st, sched, work.dtype.itemsize, stats, call.epoch, pacer)


def _gathered(st: CommState, nbytes: int) -> bool:
    """Whether a short message of ``nbytes`` is gathered and reduced in rank order (else
    the library's AllReduce reduces it): up to the communicator's gather limit, decided
    now if this is the first call that needs it (collective: every rank makes the same
    call, agreed by the check or, without it, by the caller)."""
    if nbytes <= FOLD_MIN:
        return True
    return nbytes <= room_for(st.size, nbytes, crossover.decide(st.check))


def _record_watch(
    st: CommState,
    sched: Schedule,
    itemsize: int,
    stats: ExecStats,
    epoch: float,
    pacer: Pacer | None,
) -> None:
    """What this watched call (``sched`` on elements of ``itemsize`` bytes, which
    recorded ``stats`` from ``epoch`` on) measured, for the next call's check."""
    watch = st.watch_made()
    if pacer is None:
        watch.record_messages(st.rank, sched, itemsize, stats, epoch)
    else:
        watch.record(st.rank, _timed_sends(stats, pacer), schedule=sched)
    # Room for what the next check carries (the same on every rank: it depends on the
    # schedule all of them ran).
    need = 8 * watch.contribution_size()
    p = st.size
    if p <= GATHER_MAX_P and need <= FOLD_TOTAL // p:
        room = room_for(p, need)
        if need <= room:
            st.check.agree_next(room)


def _timed_sends(stats: ExecStats, pacer: Pacer | None) -> list[tuple[int, int, float, float]]:
    """This call's paced sends as ``(peer, nbytes, busy from, busy until)`` for the watch.

    Under emulation the virtual NIC is what is slow, and its service time is what the pacer
    charged: per peer, all bytes sent over the seconds charged for them (the pacing wait
    happens before a paced send is handed to the library, so the records alone would not
    show it). A pacer that charged nothing leaves the executor's records.
    """
    if pacer is None or not pacer.charged_to:
        return [(m.peer, m.nbytes, m.posted, m.completed) for m in stats.sends]
    sent: dict[int, int] = {}
    for m in stats.sends:
        sent[m.peer] = sent.get(m.peer, 0) + m.nbytes
    return [(q, sent[q], 0.0, secs) for q, secs in pacer.charged_to.items() if q in sent]


def _gather_reduce(st: CommState, opn: str, flat_in: Array, out: Array, arrays: ArrayOps) -> None:
    """Every rank's data gathered (through host memory) and reduced in rank order.

    ``out`` may be ``flat_in`` itself (the call is then in place). A transport that can
    gather where the data lives (NCCL: on the device) does, and the rows are reduced there."""
    rows = st.transport.gather_rows(arrays, flat_in)
    if rows is not None:
        arrays.copyto(out, rows[0])
        for r in range(1, st.size):
            arrays.reduce(opn, out, rows[r])
        return
    host = arrays.to_host(flat_in)  # (NumPy's: the array itself)
    if arrays.device and st.transport.caps.sync_device:
        arrays.synchronize()
    dtype = host.dtype
    nbytes = host.size * dtype.itemsize
    if st.size <= GATHER_MAX_P:
        # The check's buffers, with the room for this call only: the next check restores
        # the one every rank agreed on (CheckState.agreed).
        chk = st.check
        cap = room_for(st.size, nbytes, chk.limit_known)
        chk.use_room(cap)
        if nbytes <= cap:
            np.copyto(chk.views(dtype, nbytes)[0], host)
            st.transport.allgather_block(chk.block, chk.gathered)
            _reduce_into(st, opn, dtype, nbytes, out, arrays)
            return
    rows = np.empty((st.size, nbytes), dtype=np.uint8)
    st.transport.allgather_block(np.ascontiguousarray(host).view(np.uint8), rows)
    total = np.empty(host.size, dtype=dtype)
    reduce_rows(np, opn, total, [rows[r].view(dtype) for r in range(st.size)])
    _put(out, total, arrays)


def _reduce_into(
    st: CommState, opn: str, dtype: np.dtype, nbytes: int, out: Array, arrays: ArrayOps
) -> None:
    if arrays is NUMPY:
        protocol.reduce_gathered(st.check, opn, dtype, nbytes, cast(np.ndarray, out))
        return
    host = np.empty(nbytes // dtype.itemsize, dtype=dtype)
    protocol.reduce_gathered(st.check, opn, dtype, nbytes, host)
    _put(out, host, arrays)


def _put(out: Array, host: np.ndarray, arrays: ArrayOps) -> None:
    if arrays is NUMPY:
        np.copyto(cast(np.ndarray, out), host)
    else:
        arrays.from_host(out, host)
        if arrays.device and arrays.name != "torch":
            arrays.synchronize()


# -- phase 5: finish ----------------------------------------------------------------------------
def _finish(st: CommState, call: _Call) -> Any:  # what allreduce returns
    arrays, work, plan, flat_out = call.arrays, call.work, call.plan, call.flat_out
    assert plan is not None and flat_out is not None  # made by now (_settings, _plan_call)
    if call.keyed:
        arrays.from_keys(work, flat_out.dtype, call.opn)
    elif (
        plan.library_only
        and work is not None
        and st.size > 1
        and not st.transport.caps.library_identical
        and call.opn in ("sum", "prod")
        and CATEGORY[call.name] in ("float", "complex")
    ):
        # Which NaN an addition returns depends on operand order, which the library may
        # vary by rank (MPI's recursive doubling: a + b here, b + a there): make every NaN
        # the canonical one. A ring's results are one element's one sum, copied.
        arrays.canonical_nans(call.flat_out)
    _STATES.last = call.record = CallRecord(
        plan.algorithm,
        plan.schedule,
        call.stats if call.stats is not None else ExecStats(),
        call.link_obj,
        call.emu,
        dict(call.params or {}),
        False,
        st.transport.name,
        st.transport.board_state,
    )
    if (
        (work is None or call.library)
        and call.link_obj is _HEALTHY
        and not call.params
        and arrays is NUMPY
    ):
        _enable_compiled(st, cast(np.ndarray, call.flat_in).dtype, call.nbytes, plan)
    return call.result if call.result is not None else call.flat_out


def _finish_inline(st: CommState, call: _Call) -> Any:  # what allreduce returns
    """The data travelled in the check: reduce every rank's rows in rank order."""
    # Only NumPy arrays travel in the check (_settings: fold), and only with a plan.
    flat_in, flat_out = cast(np.ndarray, call.flat_in), cast("np.ndarray | None", call.flat_out)
    if flat_out is None:
        result, made = result_like(call.sendbuf, flat_in, call.arrays)
        call.result, call.flat_out = result, made
        flat_out = cast(np.ndarray, made)
    protocol.reduce_gathered(st.check, call.opn, flat_in.dtype, call.nbytes, flat_out)
    plan = call.plan
    assert plan is not None
    _STATES.last = call.record = CallRecord(
        plan.algorithm,
        plan.schedule,
        ExecStats(),
        call.link_obj,
        call.emu,
        dict(call.params or {}),
        True,
        st.transport.name,
        st.transport.board_state,
    )
    if call.link_obj is _HEALTHY and call.emu is None and not call.params:
        _enable_compiled(st, flat_in.dtype, call.nbytes, plan)
    return call.result
