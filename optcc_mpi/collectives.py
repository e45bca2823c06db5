"""The public AllReduce, in the style of mpi4py.

``allreduce(sendbuf, recvbuf=None, *, op="sum", comm=None, algorithm="auto", links=None)``
reduces NumPy or CuPy arrays over a communicator with the chosen algorithm.

Argument checking costs one small collective: every rank checks its own arguments, then
one ``MPI_Allreduce`` of a few integers (maximum and negated minimum packed together)
tells every rank whether any rank found an error and whether counts, dtypes, ops,
algorithms or link profiles differ across ranks. Only when something is wrong does a
second collective gather the messages, so that every rank raises the same clear error
before any buffer is touched, and no rank is left waiting for the others.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from optcc_mpi import algorithms, config
from optcc_mpi.algorithms._policy import SMALL_BYTES
from optcc_mpi.backend import DTYPES, OPS, backend_for, check_dtype, check_op
from optcc_mpi.emulation import Emulation
from optcc_mpi.errors import ArgumentError
from optcc_mpi.executor import ExecStats, execute
from optcc_mpi.links import ENV_LINKS, Links

__all__ = [
    "allreduce",
    "IN_PLACE",
    "choose_algorithm",
    "last_stats",
    "SMALL_BYTES",
]  # and ALGORITHMS


def _in_place() -> Any:
    from mpi4py import MPI

    return MPI.IN_PLACE


IN_PLACE: Any = _in_place()
#: Marker for ``links="probe"``: measure the profile (once per communicator).
PROBE = Links({})
_last: dict[str, Any] = {}


def last_stats() -> dict[str, Any]:
    """What the last :func:`allreduce` on this process did (algorithm, schedule, stats)."""
    return dict(_last)


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


class _Private:
    """A duplicate of a user communicator, cached on it, so our messages never match the
    user's (MPI attribute caching frees it with the communicator)."""

    keyval: Any = None

    @classmethod
    def comm(cls, comm: Any) -> Any:
        from mpi4py import MPI

        if cls.keyval is None:
            cls.keyval = MPI.Comm.Create_keyval(delete_fn=lambda obj, key, val: val.Free())
        dup = comm.Get_attr(cls.keyval)
        if dup is None:
            dup = comm.Dup()
            comm.Set_attr(cls.keyval, dup)
        return dup


_FIELDS = (
    "error",
    "element count",
    "dtype",
    "op",
    "algorithm",
    "link profile",
    "emulation",
    "backend",
)


def _code(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def allreduce(
    sendbuf: Any,
    recvbuf: Any = None,
    *,
    op: str = "sum",
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
    sendbuf : array or IN_PLACE
        This rank's contribution (NumPy or CuPy, contiguous). ``optcc_mpi.IN_PLACE`` (or
        ``mpi4py.MPI.IN_PLACE``) reduces ``recvbuf`` in place.
    recvbuf : array, optional
        Where the result goes: same size and dtype as ``sendbuf``, contiguous, writable.
        A new array is returned when omitted.
    op : {"sum", "max", "min"}
        The reduction.
    comm : mpi4py.MPI.Comm, optional
        Communicator (default ``COMM_WORLD``).
    algorithm : {"auto", "ring", "optcc", "r2ccl", "native"}
        Schedule to run. ``auto`` picks the fastest by the model for this size and link
        profile, and the MPI library's own AllReduce for short messages.
    links : Links or str, optional
        Degraded ranks, ``"RANK:FRACTION,..."``, or ``"probe"`` to measure them (once per
        communicator, :mod:`optcc_mpi.probe`); default ``$OPTCC_LINKS``, else healthy.
        Must be the same on every rank.
    emulate : Emulation or str, optional
        Pace every rank's messages like a NIC of this rate and latency (the profile's
        fractions apply); default ``$OPTCC_EMULATE``, else none.
    params : dict, optional
        Extra parameters for the algorithm's schedule function (e.g. ``{"k": 16}``).
    check : bool
        Check arguments across ranks (one small collective). Turn off only when the
        arguments are known to agree.

    Returns
    -------
    array
        ``recvbuf``, or a new array shaped like ``sendbuf``.

    Raises
    ------
    ValueError, TypeError
        On every rank, naming the offending value, before any buffer is modified.

    Notes
    -----
    Results are deterministic: every schedule fixes the order of every reduction, so the
    same inputs give bit-identical results on every rank and in every run. 16-bit floats
    are summed in float32 and rounded at each step.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    p = comm.Get_size()
    rank = comm.Get_rank()
    error: Exception | None = None
    sig = [0] * len(_FIELDS)
    shown: dict[str, str] = {}
    try:
        data, out, backend, link_obj, emu = _check_local(
            sendbuf, recvbuf, op, algorithm, links, emulate, p, params
        )
        sig[1:] = [
            data.size,
            list(DTYPES.values()).index(data.dtype),
            OPS.index(op),
            _code(algorithm),
            _code("probe" if link_obj is PROBE else repr(link_obj.key())),
            _code(str(emu)),
            _code(backend.name),
        ]
        shown = {
            "algorithm": algorithm,
            "link profile": "probe" if link_obj is PROBE else str(link_obj),
            "emulation": str(emu),
            "backend": backend.name,
        }
    except (ValueError, TypeError) as exc:
        error = exc
        sig[0] = 1
    if check and p > 1:
        _agree(comm, sig, error, shown)
    elif error is not None:
        raise error

    if link_obj is PROBE:
        # Every rank agreed on "probe" above, so all of them take part in it.
        from optcc_mpi.probe import cached_probe

        link_obj = cached_probe(comm, emulate=emu).links
    name = choose_algorithm(p, data.nbytes, link_obj) if algorithm == "auto" else algorithm
    extra = dict(params or {})
    sched = algorithms.build(name, p, data.size, link_obj, itemsize=data.dtype.itemsize, **extra)

    target = out if out is not None else backend.empty_like(sendbuf)
    flat_out = backend.flat(target)
    if sendbuf is not IN_PLACE:
        backend.copyto(flat_out, data)
    pacer = emu.pacer(rank, p, link_obj) if emu is not None else None
    staging = backend.staging()
    stats: ExecStats = execute(
        sched,
        flat_out,
        comm=_Private.comm(comm) if p > 1 else comm,
        op=op,
        backend=backend,
        staging=staging,
        pacer=pacer,
    )
    _last.clear()
    _last.update(
        algorithm=name, schedule=sched, stats=stats, links=link_obj, emulate=emu, params=extra
    )
    return target


def _check_local(
    sendbuf: Any,
    recvbuf: Any,
    op: str,
    algorithm: str,
    links: Any,
    emulate: Any,
    p: int,
    params: dict[str, Any] | None = None,
) -> tuple[Any, Any, Any, Links, Emulation | None]:
    """Validate this rank's arguments; return (flat input, result array, backend, links,
    emulation)."""
    if algorithm != "auto":
        algorithms.get(algorithm).check_params(params or {})  # errors name the choices
    check_op(op)
    in_place = sendbuf is IN_PLACE
    if in_place:
        if recvbuf is None:
            raise ValueError("sendbuf is IN_PLACE but no recvbuf was given")
        source = recvbuf
    else:
        source = sendbuf
    backend = backend_for(source)
    check_dtype(source.dtype)
    if not backend.contiguous(source):
        raise ValueError(
            "buffer is not contiguous; pass a contiguous array (e.g. np.ascontiguousarray)"
        )
    if recvbuf is not None:
        if backend_for(recvbuf) is not backend:
            raise TypeError(f"sendbuf and recvbuf must both be {backend.name} arrays")
        if recvbuf.dtype != source.dtype:
            raise ValueError(
                f"recvbuf dtype {recvbuf.dtype} differs from sendbuf dtype {source.dtype}"
            )
        if recvbuf.size != source.size:
            raise ValueError(f"recvbuf has {recvbuf.size} elements, sendbuf {source.size}")
        if not backend.contiguous(recvbuf):
            raise ValueError("recvbuf is not contiguous")
        if not backend.writable(recvbuf):
            raise ValueError("recvbuf is read-only")
        if not in_place and _overlaps(sendbuf, recvbuf):
            raise ValueError("sendbuf and recvbuf overlap; use IN_PLACE to reduce in place")
    emu = Emulation.coerce(emulate)
    if links is None:
        links = config.get(ENV_LINKS)
    if isinstance(links, str) and links.strip().lower() == "probe":
        link_obj = PROBE
    else:
        link_obj = Links.coerce(links)
        link_obj.check(p)
    return backend.flat(source), recvbuf, backend, link_obj, emu


def _overlaps(a: Any, b: Any) -> bool:
    try:
        return bool(np.shares_memory(a, b)) if isinstance(a, np.ndarray) else False
    except Exception:
        return False


def _agree(comm: Any, sig: list[int], error: Exception | None, shown: dict[str, str]) -> None:
    """One small collective: raise the same error on every rank if any rank has a bad
    argument or the ranks disagree."""
    from mpi4py import MPI

    vec = np.array(sig + [-x for x in sig], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, vec, op=MPI.MAX)
    hi, lo = vec[: len(sig)], -vec[len(sig) :]
    if hi[0]:
        # Somebody failed: gather the messages (second collective, error path only).
        msgs = comm.allgather(None if error is None else f"{type(error).__name__}: {error}")
        bad = [(r, m) for r, m in enumerate(msgs) if m]
        if error is not None:
            raise error
        r, m = bad[0]
        raise ValueError(f"allreduce: rank {r} rejected its arguments: {m}")
    for i in range(1, len(sig)):
        if hi[i] != lo[i]:
            field = _FIELDS[i]
            if field == "element count":
                detail = f"{lo[i]} on some ranks, {hi[i]} on others (this rank: {sig[i]})"
            elif field == "dtype":
                names = list(DTYPES)
                detail = f"{names[lo[i]]} vs {names[hi[i]]} (this rank: {names[sig[i]]})"
            elif field == "op":
                detail = f"{OPS[lo[i]]} vs {OPS[hi[i]]} (this rank: {OPS[sig[i]]})"
            else:
                detail = f"this rank has {shown.get(field, '?')}"
            raise ValueError(f"allreduce: {field} differs across ranks: {detail}")
