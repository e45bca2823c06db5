"""The public AllReduce, in the style of mpi4py.

``allreduce(sendbuf, recvbuf=None, *, op="sum", comm=None, algorithm="auto", links=None)``
reduces arrays, buffers and tensors over a communicator with the chosen algorithm; see
:mod:`optcc_mpi.backend` for the element types, the reductions and their NaN and
signed-zero rules, and ``docs/api.md`` for the whole interface.

The argument check
------------------
A collective whose ranks disagree (counts, types, ops, algorithms, link profiles) would
hang or produce garbage, and a per-rank error (a bad buffer, a bad environment variable on
one node) raised on one rank alone leaves the others waiting in the next collective. So
every call first *agrees*: each rank checks its own arguments, environment variables
included, then one collective of fixed shape tells every rank what every other rank has,
and every rank takes the same decision: go on, or raise the same clear error before any
buffer is modified.

The agreement is one ``MPI_Allgather`` of a fixed-size block per rank on the private
duplicate of the communicator (:mod:`optcc_mpi.comm`): a 96-byte header (error flag,
element count, type, op, and checksums of the algorithm, link profile, emulation, array
backend and parameters) followed by ``C`` bytes of room for data. ``C`` is the same on
every rank because every rank derives it from the headers of the previous call on that
communicator (the largest message then, rounded up to a power of two, between 256 bytes
and ``256 KiB / p``); the block's shape therefore never depends on the arguments of the
current call, and the agreement can never mismatch, whatever the ranks pass.

When the MPI library's collective is what ``auto`` would run (short messages) and the
data fits in ``C``, the data travels in the agreement itself: every rank then holds every
rank's contribution and reduces them locally in rank order, so the result is bit-identical
on every rank by construction and the call costs one collective, about what
``MPI_Allreduce`` costs. In a loop over the same sizes this is every call after the first.
Otherwise the data phase follows (the library's ``MPI_Allreduce`` or a point-to-point
schedule). Nothing else travels with the data: a checksum riding in the reduced buffer
would change what the reduction sees.

Above 32 ranks the gathered headers would grow with p, so the agreement is instead one
``MPI_Allreduce`` (max) of the header and its negation: still one small collective of
fixed shape, without the data fold. On an error the ranks exchange their messages in one
more collective, so that every rank's exception names the rank and value at fault.

With ``check=False`` the agreement is skipped (then the ranks must pass the same
arguments, and ``check`` itself must be the same on every rank).

The commonest short call (NumPy arrays, default arguments, a size that already travelled
in the check) runs all of the above in C (:mod:`optcc_mpi.fastcall`): the same header,
the same collective, the same rank-order sums, at about the library's own latency.
"""

from __future__ import annotations

import os
import struct
import zlib
from functools import lru_cache
from time import perf_counter
from typing import Any

import numpy as np
from mpi4py import MPI

from optcc_mpi import agreement, algorithms, config, fastcall
from optcc_mpi.algorithms._policy import SMALL_BYTES
from optcc_mpi.backend import (
    _CATEGORY,
    _LOW_PRECISION,
    _NAME_OF,
    _NUMPY,
    DTYPES,
    OPS,
    _reduce_with,
    as_array,
    canonical_nans,
    check_op_dtype,
    dtype_name,
    from_keys,
    key_dtype,
    mpi_datatype_and_op,
    op_name,
    result_like,
    to_keys,
)
from optcc_mpi.comm import _BY_HANDLE, FOLD_MIN, FOLD_TOTAL, CommState, state_of
from optcc_mpi.emulation import ENV_EMULATE, Emulation, forced_fraction
from optcc_mpi.errors import ArgumentError, ArgumentTypeError
from optcc_mpi.executor import ExecStats, execute
from optcc_mpi.links import ENV_LINKS, Links
from optcc_mpi.schedule import COLL

__all__ = [
    "allreduce",
    "IN_PLACE",
    "choose_algorithm",
    "last_stats",
    "SMALL_BYTES",
    "GATHER_MAX_P",
]  # and ALGORITHMS

IN_PLACE: Any = MPI.IN_PLACE
#: Marker for ``links="probe"``: measure the profile (once per communicator).
PROBE = Links({})
#: Marker for ``links="watch"``: learn the profile from the calls' own messages
#: (:mod:`optcc_mpi.watch`).
WATCH = Links({})
#: Largest communicator whose agreement gathers the headers (and can carry data).
GATHER_MAX_P = 32

_HEADER = struct.Struct("<12q")
HEADER_BYTES = _HEADER.size
#: Identifies this version of the agreement protocol (first header field).
_PROTOCOL = 0x0C7CC0002
_FIELDS = (
    "protocol",
    "error",
    "element count",
    "dtype",
    "op",
    "algorithm",
    "link profile",
    "emulation",
    "backend",
    "params",
    "bytes",
    "capacity",
)
_DTYPE_NAMES = tuple(DTYPES)
_DTYPE_CODE = {name: i for i, name in enumerate(_DTYPE_NAMES)}
_OP_CODE = {name: i for i, name in enumerate(OPS)}
_OPSET = frozenset(OPS)
_VALID: frozenset[tuple[str, str]] = frozenset()
_last: list[Any] = [None]


def _valid_pairs() -> frozenset[tuple[str, str]]:
    pairs = set()
    for op in OPS:
        for name in DTYPES:
            try:
                check_op_dtype(op, name)
            except ArgumentError:
                continue
            pairs.add((op, name))
    return frozenset(pairs)


_VALID = _valid_pairs()


def last_stats() -> dict[str, Any]:
    """What the last :func:`allreduce` on this process did: ``algorithm`` (the one that
    ran), ``schedule``, ``stats`` (:class:`~optcc_mpi.executor.ExecStats`), ``links``,
    ``emulate``, ``params``, and ``inline`` (True when the data travelled with the
    argument agreement)."""
    rec = _last[0]
    if rec is None:
        return {}
    name, sched, stats, links, emu, params, inline = rec
    return {
        "algorithm": name,
        "schedule": sched,
        "stats": stats if stats is not None else ExecStats(),
        "links": links,
        "emulate": emu,
        "params": dict(params or {}),
        "inline": inline,
    }


def __getattr__(name: str) -> Any:
    if name == "ALGORITHMS":
        # "auto" and every registered algorithm; computed on use, so that algorithms
        # registered later (entry points, tests) are included.
        return ("auto", *algorithms.names())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def choose_algorithm(p: int, nbytes: int, links: Links) -> str:
    """What ``algorithm="auto"`` runs: of the registered algorithms that declare
    themselves eligible for this call (the MPI library's AllReduce for short messages,
    the point-to-point schedules for long ones), the one with the smallest modelled
    time; ties go to the one listed first (the ring before OptCC on healthy links)."""
    best, best_t = None, float("inf")
    for alg in algorithms.all_algorithms():
        if not alg.eligible(p, nbytes, links):
            continue
        t = alg.time(p, nbytes, 1.0, links)
        # A relative margin keeps rounding in the cost models from breaking ties.
        if best is None or t < best_t * (1 - 1e-9):
            best, best_t = alg.name, t
    if best is None:
        raise ArgumentError(f"no registered algorithm is eligible for p={p}, {nbytes} bytes")
    return best


@lru_cache(maxsize=512)
def _code(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


_PROBE_CODE = _code("probe")
_WATCH_CODE = _code("watch")
_AUTO_CODE = _code("auto")
_NUMPY_CODE = _code("numpy")


_ENV_DATA: Any = getattr(os.environ, "_data", None)
_ENV_CACHE: dict[str, tuple[Any, str | None]] = {}


def _env(name: str) -> str | None:
    """``config.get(name)``, asked again only when the process environment's entry for
    ``name`` changed: reading ``os.environ`` costs a microsecond or two per variable,
    a large share of a short AllReduce."""
    if _ENV_DATA is None:  # pragma: no cover - an os.environ without its mapping
        return config.get(name)
    hit = _ENV_CACHE.get(name)
    if hit is None:
        key = os.environ.encodekey(name)
        _ENV_CACHE[name] = hit = (_ENV_DATA.get(key), config.get(name))
        _ENV_KEYS[name] = key
        return hit[1]
    raw = _ENV_DATA.get(_ENV_KEYS[name])
    if raw is hit[0] or raw == hit[0]:
        return hit[1]
    _ENV_CACHE[name] = hit = (raw, config.get(name))
    return hit[1]


_ENV_KEYS: dict[str, Any] = {}
_HEALTHY = Links()


@lru_cache(maxsize=64)
def _emulation_from_env(text: str | None) -> Emulation | None:
    text = (text or "").strip()
    return Emulation.parse(text) if text else None


def _links_of(st: CommState, links: Any) -> Links:
    """This rank's link profile (PROBE for "probe"), in the communicator's ranks."""
    if links is None:
        text = _env(ENV_LINKS)
        if text is None:
            return _HEALTHY
        if text.strip().lower() == "probe":
            return PROBE
        if text.strip().lower() == "watch":
            return WATCH
        return st.links_from_env(text)
    if isinstance(links, str) and links.strip().lower() == "probe":
        return PROBE
    if isinstance(links, str) and links.strip().lower() == "watch":
        return WATCH
    link_obj = Links.coerce(links)
    link_obj.check(st.size)
    return link_obj


def _plan(
    st: CommState,
    algorithm: str,
    count: int,
    itemsize: int,
    links: Links,
    params: Any,
    emulated: bool = False,
) -> tuple[str, Any, bool]:
    """(algorithm that runs, its schedule, whether the schedule is only the MPI library's
    collective); cached per communicator.

    A builder that declares a ``transport`` parameter (and was not given one) is told the
    communicator's: ``"network"`` under emulation, else what MPI reports
    (:class:`~optcc_mpi.comm.CommState`)."""
    pkey = repr(sorted(params.items())) if params else ""
    key = (algorithm, count, itemsize, links.key(), pkey, emulated)
    hit = st.plans.get(key)
    if hit is not None:
        return hit
    p = st.size
    name = choose_algorithm(p, count * itemsize, links) if algorithm == "auto" else algorithm
    given = dict(params or {})
    if "transport" in algorithms.get(name).params and "transport" not in given:
        given["transport"] = "network" if emulated else st.transport
    sched = algorithms.build(name, p, count, links, itemsize=itemsize, **given)
    coll_only = bool(sched.n_ops) and bool(np.all(sched.kind == COLL))
    return st.remember(st.plans, key, (name, sched, coll_only))


def _capacity(p: int, nbytes: int) -> int:
    """Data room of the check for a message of ``nbytes``: the power of two from FOLD_MIN
    up that holds it, or FOLD_MIN if none up to FOLD_TOTAL / p does."""
    limit = max(FOLD_MIN, FOLD_TOTAL // max(p, 1))
    cap = FOLD_MIN
    while cap < nbytes and cap * 2 <= limit:
        cap *= 2
    return cap if nbytes <= cap else FOLD_MIN


def allreduce(
    sendbuf: Any,
    recvbuf: Any = None,
    *,
    op: Any = "sum",
    comm: Any = None,
    algorithm: str = "auto",
    links: Links | str | None = None,
    emulate: Emulation | str | None = None,
    params: dict[str, Any] | None = None,
    check: bool = True,
) -> Any:
    """Element-wise reduction of every rank's buffer, result on every rank.

    Parameters
    ----------
    sendbuf : array, buffer, tensor, IN_PLACE or None
        This rank's contribution: a NumPy or CuPy array (any shape, C or Fortran order,
        contiguous), a PyTorch tensor (CPU or CUDA), any object with the buffer protocol
        (``array.array``, ``bytearray``, ``memoryview``), or an mpi4py buffer
        specification (``[buf, MPI.DOUBLE]``, ``[buf, count, MPI.DOUBLE]``, ...).
        ``MPI.IN_PLACE`` or None reduces ``recvbuf`` in place, as does passing the same
        object (or the same memory) as ``recvbuf``.
    recvbuf : same kinds, optional
        Where the result goes: same element type and count as ``sendbuf``, writable. A
        new array (tensor for a tensor, NumPy array for other buffers) is returned when
        omitted.
    op : str or mpi4py.MPI.Op
        ``"sum"``, ``"prod"``, ``"max"``, ``"min"``, ``"land"``, ``"lor"``, ``"lxor"``,
        ``"band"``, ``"bor"``, ``"bxor"`` or the ``MPI.Op`` of the same name; each on the
        element types MPI defines it for. User-defined ops are refused.
    comm : mpi4py.MPI.Intracomm, optional
        Communicator (default ``COMM_WORLD``); not an intercommunicator, not COMM_NULL.
    algorithm : str
        ``"auto"`` or a registered algorithm (``optcc_mpi.ALGORITHMS``). ``auto`` picks
        the fastest by the model for this size and link profile, and the MPI library's
        collective for short messages.
    links : Links or str, optional
        Degraded ranks, ``"RANK:FRACTION,..."`` in ranks of ``comm``, ``"probe"`` to
        measure them (once per communicator, :mod:`optcc_mpi.probe`), or ``"watch"`` to
        learn them from the calls' own messages and follow them as they change
        (:mod:`optcc_mpi.watch`). Default
        ``$OPTCC_LINKS``, in ranks of COMM_WORLD (translated to ``comm``), else healthy.
        Must be the same on every rank.
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
    order of every reduction. See :mod:`optcc_mpi.backend` for NaN and signed zeros.
    """
    if (
        (check is True or check is False)
        and algorithm == "auto"
        and links is None
        and emulate is None
        and params is None
    ):
        # The compiled path (optcc_mpi.fastcall) for NumPy arrays: it takes the call, or
        # declines having touched nothing.
        if type(sendbuf) is _NDARRAY:
            if type(recvbuf) is _NDARRAY:
                if _compiled(sendbuf, recvbuf, op, comm, check):
                    return recvbuf
            elif recvbuf is None:
                out = np.empty_like(sendbuf)
                if _compiled(sendbuf, out, op, comm, check):
                    return out
        elif (sendbuf is IN_PLACE or sendbuf is None) and type(recvbuf) is _NDARRAY:
            if _compiled(recvbuf, recvbuf, op, comm, check):
                return recvbuf
    st = state_of(comm)
    p = st.size
    err: BaseException | None = None
    fields: tuple[int, ...] = ()
    seen: np.ndarray | None = None  # the watch's observations, when they ride the check
    try:
        # -- this rank's arguments -----------------------------------------------------
        if type(op) is str and op in _OPSET:
            opn = op
        else:
            opn = op_name(op)
        in_place = sendbuf is IN_PLACE or sendbuf is None or sendbuf is recvbuf
        result = recvbuf
        if type(sendbuf) is np.ndarray and not in_place:
            # The commonest calls, checked inline (as_array does the same, slower).
            flat_in = _numpy_flat(sendbuf, "sendbuf")
            backend = _NUMPY
            if recvbuf is None:
                flat_out = None
            elif type(recvbuf) is np.ndarray:
                flat_out = _numpy_flat(recvbuf, "recvbuf")
                if flat_out.dtype != flat_in.dtype or flat_out.size != flat_in.size:
                    _same_shape(flat_in, flat_out)
                if np.may_share_memory(flat_in, flat_out):
                    in_place = _overlap(flat_in, flat_out, backend) == "same"
                    if not in_place:
                        raise ArgumentError(
                            "sendbuf and recvbuf overlap; use IN_PLACE to reduce in place"
                        )
                if not flat_out.flags.writeable:
                    raise ArgumentError("recvbuf is read-only")
            else:
                flat_out, in_place = _recvbuf_for(flat_in, recvbuf, backend)
        elif in_place:
            if recvbuf is None:
                raise ArgumentError(
                    "sendbuf is IN_PLACE (or None) but no recvbuf was given: pass the "
                    "buffer to reduce in place as recvbuf"
                )
            flat_out, backend = as_array(recvbuf, what="recvbuf")
            flat_in = flat_out
        else:
            flat_in, backend = as_array(sendbuf, what="sendbuf")
            if recvbuf is None:
                flat_out = None
            else:
                flat_out, in_place = _recvbuf_for(flat_in, recvbuf, backend)
        if in_place and not backend.writable(flat_out):
            raise ArgumentError("recvbuf is read-only")
        dtype = flat_in.dtype
        name = _NAME_OF.get(dtype) or dtype_name(dtype)
        if (opn, name) not in _VALID:
            check_op_dtype(opn, name)
        if algorithm != "auto":
            algorithms.get(algorithm).check_params(params or {})  # errors name the choices
        link_obj = _links_of(st, links)
        if emulate is None:
            emu = _emulation_from_env(_env(ENV_EMULATE))
        else:
            emu = Emulation.coerce(emulate)
        if emu is not None:
            forced_fraction()  # a bad per-rank fraction fails here, before the agreement
        count = flat_in.size
        nbytes = count * dtype.itemsize
        # The plan is a pure function of arguments that must agree, so computing it
        # before the agreement cannot make ranks diverge; "probe" has to wait for it.
        plan = None
        if link_obj is WATCH:
            pass  # the profile is agreed below, after the check
        elif link_obj is not PROBE:
            plan = _plan(st, algorithm, count, dtype.itemsize, link_obj, params, emu is not None)
        elif st.probe is not None:
            plan = _plan(
                st, algorithm, count, dtype.itemsize, st.probe.links, params, emu is not None
            )
        fold = (
            check
            and algorithm == "auto"
            and plan is not None
            and plan[2]
            and backend is _NUMPY
            and emu is None
            and 1 < p <= GATHER_MAX_P
        )
        if check and p > 1:
            if link_obj is WATCH:
                # What the last call measured rides in the check's data room (the data of
                # a watched call never does: its plan waits for the agreed profile).
                seen = _watch_of(st).contribution()
            if link_obj is PROBE:
                lcode = _PROBE_CODE
            elif link_obj is WATCH:
                lcode = _WATCH_CODE
            elif link_obj.fractions:
                lcode = _code(repr(link_obj.key()))
            else:
                lcode = 0
            fields = (
                _PROTOCOL,
                0,
                count,
                _DTYPE_CODE[name],
                _OP_CODE[opn],
                _AUTO_CODE if algorithm == "auto" else _code(algorithm),
                lcode,
                0 if emu is None else _code(str(emu)),
                _NUMPY_CODE if backend is _NUMPY else _code(backend.name),
                _code(repr(sorted(params.items()))) if params else 0,
                nbytes,
                0,
            )
    except Exception as exc:  # anything at all: the other ranks must hear of it
        err = exc
        fold = False
    if check and p > 1:
        try:
            inline = _agree(st, fields, err, fold, flat_in if fold else None, seen)
        except _Mismatch as mismatch:
            _disagreement(st, err, mismatch.table, mismatch.bounds, locals())
        epoch = perf_counter()  # a collective just ended: nearly the same instant everywhere
    elif err is not None:
        raise err
    else:
        inline = False

    # -- every rank agreed: the data phase ------------------------------------------------
    if inline:
        if flat_out is None:
            result, flat_out = result_like(sendbuf, flat_in, backend)
        _reduce_gathered(st, opn, dtype, nbytes, flat_out)
        _last[0] = (plan[0], plan[1], None, link_obj, emu, params, True)
        if link_obj is _HEALTHY and emu is None and not params and backend is _NUMPY:
            _enable_compiled(st, dtype, nbytes, plan)
        return result
    watch = None
    if link_obj is PROBE:
        # Every rank agreed on "probe" above, so all of them take part in it.
        link_obj = _probe(st, emu).links
        plan = _plan(st, algorithm, count, dtype.itemsize, link_obj, params, emu is not None)
    elif link_obj is WATCH:
        # Every rank agreed on "watch": each brings its side of what its last call
        # measured, and every rank reads the same gathered rows, hence decides the same
        # profile at the same call (optcc_mpi.watch).
        watch = _watch_of(st)
        if seen is not None and _extra_fits(st, seen.size):
            rows = _gathered_extra(st, seen.size)
        else:  # no check ran, or its room was too small: one small collective more
            seen = watch.contribution()
            rows = np.empty((p, seen.size), dtype=np.int64)
            st.private.Allgather(seen, rows)
            epoch = perf_counter()
        link_obj = watch.agree(rows)
        plan = _plan(st, algorithm, count, dtype.itemsize, link_obj, params, emu is not None)
    name_run, sched, coll_only = plan
    if flat_out is None:
        result, flat_out = result_like(sendbuf, flat_in, backend)
    if (
        algorithm == "auto"
        and coll_only
        and emu is None
        and 1 < p <= GATHER_MAX_P
        and 0 < nbytes <= _capacity(p, nbytes)
    ):
        # A short message that did not fit the check's room (the first call of a size,
        # a device array): gathered and reduced in rank order all the same, so that
        # what auto returns never depends on which calls came before.
        _gather_reduce(st, opn, flat_in, flat_out, backend)
        _last[0] = (name_run, sched, None, link_obj, emu, params, False)
        if link_obj is _HEALTHY and not params and backend is _NUMPY:
            _enable_compiled(st, dtype, nbytes, plan)
        return result
    if not in_place:
        backend.copyto(flat_out, flat_in)
    xp = backend.xp
    work = flat_out
    keyed = p > 1 and opn in ("max", "min") and xp is not None and key_dtype(dtype) is not None
    if keyed:
        # max/min on floats reduce order-preserving integer keys (optcc_mpi.backend).
        work = to_keys(xp, flat_out, opn)
    pacer = emu.pacer(st.rank, p, link_obj) if emu is not None else None
    stats = None
    if p > 1:
        if coll_only and pacer is None and backend is _NUMPY:
            # A schedule that is only the library's collective: call it directly.
            datatype, mpi_op = mpi_datatype_and_op(_NAME_OF[work.dtype], opn)
            arg = work.view(np.uint16) if work.dtype in _LOW_PRECISION else work
            st.private.Allreduce(IN_PLACE, [arg, datatype], mpi_op)
        else:
            # Each rank reduces different parts: a floating-point warning or exception
            # (np.seterr) on one rank alone would leave the others waiting.
            with np.errstate(all="ignore"):
                stats = execute(
                    sched,
                    work,
                    comm=st.private,
                    op=opn,
                    backend=backend,
                    staging=backend.staging(),
                    pacer=pacer,
                )
            if watch is not None:
                if pacer is None:
                    watch.record_messages(st.rank, sched, work.dtype.itemsize, stats, epoch)
                else:
                    watch.record(st.rank, _timed_sends(stats, pacer))
                # Room for what the next check carries (the same on every rank: it
                # depends on the schedule all of them ran).
                room = 8 * watch.contribution_size()
                if p <= GATHER_MAX_P and room <= FOLD_TOTAL // p:
                    st.next_capacity = max(FOLD_MIN, 1 << (room - 1).bit_length())
    if keyed:
        from_keys(xp, work, dtype, opn)
    elif coll_only and p > 1 and xp is not None and opn in ("sum", "prod"):
        if _CATEGORY[name] in ("float", "complex"):
            # Which NaN an addition returns depends on operand order, which the library
            # may vary by rank: make every NaN the canonical one.
            canonical_nans(xp, flat_out)
    _last[0] = (name_run, sched, stats, link_obj, emu, params, False)
    return result


# -- the compiled call path ----------------------------------------------------------------------
_NDARRAY = np.ndarray
_MPI_COMM = MPI.Comm
_WORLD_HANDLE = MPI.COMM_WORLD.handle
_ENV_KEY_LINKS = os.environ.encodekey(ENV_LINKS)
_ENV_KEY_EMULATE = os.environ.encodekey(ENV_EMULATE)
#: The header of a short call on the compiled path, with the call's own fields zero.
_COMPILED_HEADER = (_PROTOCOL, 0, 0, 0, 0, _AUTO_CODE, 0, 0, _NUMPY_CODE, 0, 0, 0)


def _enable_compiled(st: CommState, dtype: np.dtype, nbytes: int, plan: Any) -> None:
    """After a short call whose data travelled in the check with default arguments:
    let the next such calls of this size and type take the compiled path."""
    if _ENV_DATA is None or not fastcall.available():
        return
    key = (nbytes, dtype)
    if key not in st.folds:
        st.remember(st.folds, key, plan)
    if st.fast is None:
        limit = max(FOLD_MIN, FOLD_TOTAL // st.size)
        st.fast = fastcall.context(st, _COMPILED_HEADER, FOLD_MIN, limit)


def _compiled(sendbuf: np.ndarray, recvbuf: np.ndarray, op: Any, comm: Any, check: bool) -> bool:
    """Run the call on the compiled path (:mod:`optcc_mpi.fastcall`) if it can take it;
    False when it declined, having touched nothing (the Python path then runs the call).

    The caller checked the arguments that must be at their defaults. Here: the
    communicator's state exists with a context for its current check room, which the
    ranks agreed for this call (every rank derives it from the previous call's headers),
    no environment variable changes the call, and an earlier call of this size and type
    was one whose data travels in that room (``auto`` hands it to the MPI library). With
    ``check=False`` the same gather runs without comparing the headers: the room is the
    one the Python path's gather uses for this size (``_capacity``), so ranks on either
    path move blocks of one shape."""
    if comm is None:
        st = _BY_HANDLE.get(_WORLD_HANDLE)
    elif isinstance(comm, _MPI_COMM):
        st = _BY_HANDLE.get(comm.handle)
    else:
        return False
    if st is None or st.fast is None or (check and st.next_capacity != st.capacity):
        return False  # (without the check, the room is _capacity's: the C side checks it)
    opc = _OP_CODE.get(op) if type(op) is str else None
    if (
        opc is None
        or _ENV_DATA.get(_ENV_KEY_LINKS) is not None
        or _ENV_DATA.get(_ENV_KEY_EMULATE) is not None
    ):
        return False
    dtype = sendbuf.dtype
    nbytes = sendbuf.nbytes
    plan = st.folds.get((nbytes, dtype))
    if plan is None:
        return False
    answer = _FOLD(st.fast, sendbuf, recvbuf, opc, check)
    if answer == fastcall.FALLBACK:
        return False
    if answer == fastcall.GATHERED:  # agreed; a reduction the C path leaves to NumPy
        _reduce_gathered(st, op, dtype, nbytes, _numpy_flat(recvbuf, "recvbuf"))
    elif answer == fastcall.MISMATCH:
        # As the Python path: every rank saw the same headers, so the same next room and
        # the same error (the ranks on the Python path raise it from _agree).
        table = st.heads.copy().view("<i8")
        st.next_capacity = FOLD_MIN
        scope = {
            "count": sendbuf.size,
            "name": _NAME_OF[dtype],
            "opn": op,
            "algorithm": "auto",
            "link_obj": _HEALTHY,
            "emu": None,
            "backend": _NUMPY,
            "params": None,
        }
        _disagreement(st, None, table, None, scope)
    elif answer != fastcall.DONE:
        raise MPI.Exception(-1000 - answer)
    _last[0] = (plan[0], plan[1], None, _HEALTHY, None, None, bool(check))
    return True


_FOLD = fastcall.fold_function()


def _watch_of(st: CommState) -> Any:
    """The communicator's :class:`~optcc_mpi.watch.LinkWatch`, made on first use."""
    if st.watch is None:
        from optcc_mpi.watch import LinkWatch

        st.watch = LinkWatch(st.size)
    return st.watch


def _timed_sends(stats: ExecStats, pacer: Any) -> list[tuple[int, int, float, float]]:
    """This call's paced sends as ``(peer, nbytes, busy from, busy until)`` for the watch.

    Under emulation the virtual NIC is what is slow, and its service time is what the pacer
    charged: per peer, all bytes sent over the seconds charged for them (the pacing wait
    happens before a paced send is handed to MPI, so the records alone would not show it).
    A pacer that charged nothing leaves the executor's records (handed to MPI, completed).
    """
    if pacer is None or not pacer.charged_to:
        return [r[1:] for r in stats.sends]
    sent: dict[int, int] = {}
    for _, peer, nbytes, _, _ in stats.sends:
        sent[peer] = sent.get(peer, 0) + nbytes
    return [(q, sent[q], 0.0, secs) for q, secs in pacer.charged_to.items() if q in sent]


def _recvbuf_for(flat_in: Any, recvbuf: Any, backend: Any) -> tuple[Any, bool]:
    """``recvbuf`` as a flat array of ``sendbuf``'s kind, checked, and whether it is
    ``sendbuf``'s very memory (then the call is in place, as in mpi4py)."""
    flat_out, out_backend = as_array(recvbuf, what="recvbuf")
    if out_backend is not backend:
        raise ArgumentTypeError(
            f"sendbuf is a {backend.name} buffer but recvbuf a "
            f"{out_backend.name} one; pass two of the same kind"
        )
    _same_shape(flat_in, flat_out)
    overlap = _overlap(flat_in, flat_out, backend)
    if overlap and overlap != "same":
        raise ArgumentError("sendbuf and recvbuf overlap; use IN_PLACE to reduce in place")
    if not backend.writable(flat_out):
        raise ArgumentError("recvbuf is read-only")
    return flat_out, overlap == "same"


def _same_shape(flat_in: Any, flat_out: Any) -> None:
    """ArgumentError unless send and receive buffers have the same type and count."""
    if flat_out.dtype != flat_in.dtype:
        raise ArgumentError(
            f"recvbuf dtype {flat_out.dtype} differs from sendbuf dtype {flat_in.dtype}"
        )
    if flat_out.size != flat_in.size:
        raise ArgumentError(f"recvbuf has {flat_out.size} elements, sendbuf {flat_in.size}")


def _numpy_flat(arr: np.ndarray, what: str) -> np.ndarray:
    """``arr`` as a 1-D view, if contiguous in either order."""
    if arr.ndim == 1:
        if arr.flags.c_contiguous:
            return arr
    else:
        flags = arr.flags
        if flags.c_contiguous or flags.f_contiguous:
            return arr.ravel(order="K")
    flat, _ = as_array(arr, what=what)  # raises the error
    return flat  # pragma: no cover


def _overlap(a: Any, b: Any, backend: Any) -> str | bool:
    """ "same" if ``a`` and ``b`` (1-D, same size and type) are the same memory, True if
    they overlap otherwise, else False."""
    if backend is _NUMPY:
        if not np.may_share_memory(a, b):
            return False
        pa = a.__array_interface__["data"][0]
        pb = b.__array_interface__["data"][0]
        return "same" if pa == pb else True
    ptr = getattr(getattr(a, "data", None), "ptr", None)  # CuPy
    if ptr is not None:
        pb = b.data.ptr
        if ptr == pb:
            return "same"
        n = a.size * a.dtype.itemsize
        return bool(ptr < pb + n and pb < ptr + n)
    return False


def _fold_views(st: CommState, dtype: np.dtype, nbytes: int) -> tuple[Any, list[Any]]:
    """Typed views of the data room: this rank's block, and every rank's gathered row
    (cached until the room changes)."""
    lo, hi = HEADER_BYTES, HEADER_BYTES + nbytes
    views = (
        st.block[lo:hi].view(dtype),
        [st.gathered[r, lo:hi].view(dtype) for r in range(st.size)],
    )
    if len(st.views) > 16:
        st.views.clear()
    st.views[(dtype, nbytes)] = views
    return views


def _gather_reduce(st: CommState, opn: str, flat_in: Any, out: Any, backend: Any) -> None:
    """Allgather every rank's data (through host memory) and reduce it in rank order."""
    dtype = flat_in.dtype
    nbytes = flat_in.size * dtype.itemsize
    # The room of the check's buffers, for this call only: the next check restores the
    # one every rank agreed on (CommState.next_capacity).
    cap = _capacity(st.size, nbytes)
    if cap != st.capacity or st.block is None:
        st.ensure_capacity(cap, HEADER_BYTES)
    views = st.views.get((dtype, nbytes)) or _fold_views(st, dtype, nbytes)
    if backend is _NUMPY:
        np.copyto(views[0], flat_in)
    else:
        backend.synchronize()
        np.copyto(views[0], backend.to_host(flat_in))
    st.private.Allgather(st.block, st.gathered)
    if backend is _NUMPY:
        _reduce_gathered(st, opn, dtype, nbytes, out)
    else:
        host = np.empty(flat_in.size, dtype=dtype)
        _reduce_gathered(st, opn, dtype, nbytes, host)
        backend.from_host(out, host)
        backend.synchronize()


def _reduce_gathered(st: CommState, opn: str, dtype: np.dtype, nbytes: int, out: Any) -> None:
    """Reduce every rank's data from the agreement's gather into ``out``, in rank order."""
    kind = fastcall.reduce_kind(_NAME_OF.get(dtype, "")) if opn == "sum" else 0
    if kind and st.size > 1:
        # The loop of the compiled path, so that both paths give the same bits.
        fastcall.sum_rows(kind, out, st.gathered, HEADER_BYTES)
        return
    views = st.views.get((dtype, nbytes))
    rows = views[1] if views is not None else _fold_views(st, dtype, nbytes)[1]
    if opn == "sum" and dtype not in _LOW_PRECISION:
        np.add(rows[0], rows[1], out=out)
        for row in rows[2:]:
            np.add(out, row, out=out)
        return
    np.copyto(out, rows[0])
    for row in rows[1:]:
        _reduce_with(np, opn, out, row)


def _probe(st: CommState, emu: Emulation | None) -> Any:
    """The probe's result for this communicator (measured once, on the private duplicate)."""
    from optcc_mpi.probe import cached_probe

    return cached_probe(st.comm, emulate=emu)


# -- the agreement --------------------------------------------------------------------------------
class _Mismatch(Exception):
    """Some rank failed or the ranks disagree (every rank raises it: all saw the same)."""

    def __init__(self, table: Any = None, bounds: Any = None) -> None:
        super().__init__()
        self.table, self.bounds = table, bounds


def _agree(
    st: CommState,
    fields: tuple[int, ...],
    err: BaseException | None,
    foldable: bool,
    data: Any,
    extra: np.ndarray | None = None,
) -> bool:
    """One collective of fixed shape; returns True if the data travelled with it (then
    the gathered blocks hold every rank's data). ``foldable``: the call is one whose data
    may travel with it, room permitting (then ``data`` is the 1-D input). ``extra``: a
    small int64 vector to carry in the data room of a call whose data does not travel
    (the watch's observations); read back with :func:`_gathered_extra`. Raises
    :class:`_Mismatch` on every rank if any rank failed or the ranks disagree."""
    p = st.size
    if not fields:
        fields = (_PROTOCOL, 1) + (0,) * (len(_FIELDS) - 2)
    if p > GATHER_MAX_P:
        lo, hi = agreement.agree_fields(st.private, fields)
        if err is not None or hi[1] or not np.array_equal(hi, lo):
            raise _Mismatch(bounds=(lo, hi))
        return False
    # The data room agreed at the previous call (the gathered blocks of that call were
    # read before it changed).
    if st.next_capacity != st.capacity or st.block is None:
        st.ensure_capacity(st.next_capacity, HEADER_BYTES)
    cap = st.capacity
    nbytes = fields[10]
    fold = foldable and nbytes <= cap
    fields = fields[:11] + (cap * 4 + 2 * int(foldable) + int(fold),)
    hb = _HEADER.pack(*fields)
    st.block_mv[:HEADER_BYTES] = hb
    if fold and nbytes:
        views = st.views.get((data.dtype, nbytes))
        if views is None:
            views = _fold_views(st, data.dtype, nbytes)
        np.copyto(views[0], data)
    elif extra is not None and _extra_fits(st, extra.size):
        st.block[HEADER_BYTES : HEADER_BYTES + 8 * extra.size].view("<i8")[:] = extra
    st.private.Allgather(st.block, st.gathered)
    heads = st.heads
    if err is None and heads.tobytes() == hb * p:
        # Room for the next call: this call's size if its data could travel with the
        # check, else the least (a large room would only slow the checks of calls whose
        # data never travels with them; a watched call sets its own after running).
        room = _capacity(p, nbytes) if foldable else FOLD_MIN
        if room != cap:
            st.next_capacity = room
        return fold
    table = heads.copy().view("<i8")  # (p, fields)
    # Every rank saw the same table: the same next room, then the same error.
    st.next_capacity = FOLD_MIN
    raise _Mismatch(table=table)


def _extra_fits(st: CommState, n: int) -> bool:
    """Whether ``n`` int64 travel in the check's data room (the same answer on every
    rank: the room and the size of the communicator are agreed)."""
    return st.size <= GATHER_MAX_P and st.block is not None and 8 * n <= st.capacity


def _gathered_extra(st: CommState, n: int) -> np.ndarray:
    """Every rank's ``extra`` of the last check, one row per rank."""
    return st.gathered[:, HEADER_BYTES : HEADER_BYTES + 8 * n].view("<i8")


def _describe(scope: dict[str, Any]) -> dict[str, str]:
    """What this rank passed, in words, for error messages on other ranks."""
    shown: dict[str, str] = {}
    if "count" in scope:
        shown["element count"] = str(scope["count"])
    if "name" in scope:
        shown["dtype"] = scope["name"]
    if "opn" in scope:
        shown["op"] = scope["opn"]
    shown["algorithm"] = repr(scope.get("algorithm"))
    link = scope.get("link_obj")
    if link is not None:
        shown["link profile"] = (
            "probe" if link is PROBE else "watch" if link is WATCH else str(link)
        )
    if "emu" in scope:
        shown["emulation"] = str(scope["emu"] or "none")
    backend = scope.get("backend")
    if backend is not None:
        shown["backend"] = backend.name
    shown["params"] = repr(scope.get("params") or {})
    return shown


def _disagreement(
    st: CommState,
    err: BaseException | None,
    table: Any,
    bounds: Any,
    scope: dict[str, Any],
) -> None:
    """Raise the same error on every rank (they all call this: every rank saw the same
    headers). One more collective carries each rank's own words."""
    # Each rank's own words and its view of the arguments, in one collective; a rank
    # that failed re-raises its own error, the others name it.
    shown = agreement.agree(st.private, err, _describe(scope), what="allreduce: arguments rejected")
    if table is not None:
        if len(set(int(x) for x in table[:, 0])) > 1:
            raise ArgumentError(
                "allreduce: ranks run different versions of optcc_mpi's agreement protocol"
            )
        columns = [table[:, i] for i in range(table.shape[1])]
    else:
        lo, hi = bounds
        columns = [np.array([lo[i], hi[i]]) for i in range(len(lo))]
    for i in range(2, len(_FIELDS) - 2):
        col = columns[i]
        if col.min() == col.max():
            continue
        field = _FIELDS[i]
        groups: dict[str, list[int]] = {}
        for r, view in enumerate(shown):
            groups.setdefault(view.get(field, "?"), []).append(r)
        detail = "; ".join(
            f"{value} on {agreement.describe_ranks(rs)}" for value, rs in groups.items()
        )
        raise ArgumentError(f"allreduce: {field} differs across ranks: {detail}")
    raise ArgumentError(  # pragma: no cover - a difference in a field not listed above
        "allreduce: the ranks' arguments differ"
    )
