"""The compiled call path of a short AllReduce.

A short :func:`optcc_mpi.allreduce` is one ``MPI_Allgather`` that carries the argument
check and the data together, or, above the communicator's gather limit
(:mod:`optcc_mpi.check.crossover`), the check alone followed by the library's ``MPI_Allreduce``
(:mod:`optcc_mpi.collectives`; this module's caller is :mod:`optcc_mpi.compiled_path`). In
Python the bookkeeping around those collectives (validating two buffers, packing and
comparing the headers, reducing the rows) costs about three times the collective itself
at two ranks on shared memory. ``_fastcall.c``
does the same work in C for the commonest call: NumPy arrays for both ``sendbuf`` and
``recvbuf``, ``op`` given by name, every other argument at its default and neither
``$OPTCC_LINKS`` nor ``$OPTCC_EMULATE`` set, on a communicator of 2 to
:data:`~optcc_mpi.collectives.GATHER_MAX_P` ranks whose last call left the check room this
message needs. Above the limit it takes the pairs of type and op whose library reduction
is one of MPI's own (:func:`context`'s ``handles``), not a Python callback, and not one
that goes through integer keys (max and min on floats). It writes the same header, byte
for byte, as the Python path and calls the same collectives, so ranks on either path agree
with each other, and it declines (before touching anything) whatever else it is given: the
Python path then runs the whole call, errors included.

The extension is optional and never links MPI. It calls the ``MPI_Allgather`` and
``MPI_Allreduce`` that mpi4py's own extension module resolves (looked up through that
module's handle with ``dlsym``, so it is the very library mpi4py uses, MPICH or Open MPI
or the standard ABI), with handles of the size that library uses. Where the extension
was not built (no C compiler), was built from another version of its source, or the MPI
library's entries cannot be found, :func:`available` is False and the Python path runs
every call, with the same results. ``OPTCC_FASTCALL=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from optcc_mpi import config
from optcc_mpi.dtypes import CATEGORY, DTYPES, LOW_PRECISION, OPS, check_op_dtype
from optcc_mpi.errors import ArgumentError
from optcc_mpi.transports.base import Transport

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = [
    "Compilable",
    "built",
    "available",
    "context",
    "fold_function",
    "reduce_kind",
    "sum_rows",
    "FoldCall",
    "Handles",
]

#: fold()'s answers (``_fastcall.c``).
FALLBACK, DONE, GATHERED, MISMATCH, LIBRARY = -1, 0, 1, 2, 3
#: The rank-order sums done in C, by our dtype name (``_fastcall.c``'s RED_*).
_SUM_KINDS = {"float32": 1, "float64": 2, "int32": 3, "int64": 4}


@runtime_checkable
class Compilable(Protocol):
    """A transport the compiled path can drive (MPI's): it offers the mpi4py
    communicator its calls travel on, and the handles of its library's AllReduce."""

    @property
    def private(self) -> MPI.Intracomm | None:
        """The communicator the calls travel on (None once freed)."""
        ...

    def predefined(self, dtype_name: str, op: str) -> tuple[MPI.Datatype, MPI.Op] | None:
        """The MPI datatype and op of the library's AllReduce for this pair when both are
        MPI's own, else None."""
        ...


#: ``handles(dtype name, op)``: the MPI datatype and op of the library's AllReduce for the
#: pair when both are MPI's own, else None (:meth:`Compilable.predefined`).
Handles = Callable[[str, str], "tuple[MPI.Datatype, MPI.Op] | None"]
#: The compiled call: ``fold(context, sendbuf, recvbuf, op code, compare)``, one of
#: FALLBACK, DONE, GATHERED, MISMATCH, LIBRARY (:func:`fold_function`).
FoldCall = Callable[[object, np.ndarray, np.ndarray, int, bool], int]


def _built(here: Path) -> ModuleType | None:
    """The extension module if it was built from the source beside it (or there is no
    source beside it, as in a wheel), else None."""
    if not any((here / f"_fastcall{s}").exists() for s in importlib.machinery.EXTENSION_SUFFIXES):
        return None
    try:
        from optcc_mpi.check import _fastcall as ext  # the optional compiled extension
    except ImportError:  # pragma: no cover - a library built for another interpreter
        return None
    src = here / "_fastcall.c"
    if src.exists() and getattr(ext, "SOURCE", "") != hashlib.sha256(src.read_bytes()).hexdigest():
        return None  # a checkout whose C source changed since the install
    return ext


@functools.lru_cache(maxsize=1)
def _extension() -> ModuleType | None:
    """The extension module (its rank-order sums need no MPI), or None where off."""
    if not config.rc.fastcall or sys.byteorder != "little":
        return None
    return _built(Path(__file__).parent)


@functools.lru_cache(maxsize=1)
def _module() -> tuple[ModuleType, int, int, int] | None:
    """The extension, the addresses of mpi4py's MPI_Allgather and MPI_Allreduce and the
    size of a handle, or None."""
    ext = _extension()
    if ext is None:
        return None
    try:
        from mpi4py import MPI  # the MPI transport's library: absent from torch-only jobs
    except (ImportError, RuntimeError):
        return None
    try:
        mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
        # dlsym through mpi4py's own module finds the MPI library that module calls.
        lib = ctypes.CDLL(MPI.__file__, mode=mode)
        address = ctypes.cast(lib.MPI_Allgather, ctypes.c_void_p).value
        reduce_at = ctypes.cast(lib.MPI_Allreduce, ctypes.c_void_p).value
    except (OSError, AttributeError):  # pragma: no cover - a platform without dlsym
        return None
    size = MPI._sizeof(MPI.Comm)
    if not address or not reduce_at or size not in (4, ctypes.sizeof(ctypes.c_void_p)):
        return None  # pragma: no cover
    return ext, address, size, reduce_at


def built() -> bool:
    """Whether the extension is built from this source (and not turned off); it needs no
    MPI library to say so."""
    return _extension() is not None


def available() -> bool:
    """Whether short AllReduces take the compiled path (see the module docstring)."""
    return _module() is not None


@functools.lru_cache(maxsize=1)
def _formats() -> tuple[tuple[str, int, int, int, int], ...]:
    """Per element type the C path handles: (buffer format, dtype code of the header,
    itemsize, mask of the ops defined on it, sum kind). A format two of our types share
    is left out (the Python path tells them apart)."""

    rows: dict[str, tuple[str, int, int, int, int]] = {}
    clash: set[str] = set()
    for code, (name, dt) in enumerate(DTYPES.items()):
        try:
            fmt = memoryview(np.empty(1, dtype=dt)).format
        except (TypeError, ValueError, BufferError):  # pragma: no cover - no buffer format
            continue
        mask = 0
        for i, op in enumerate(OPS):
            try:
                check_op_dtype(op, name)
            except ArgumentError:
                continue
            mask |= 1 << i
        if fmt in rows or len(fmt) >= 8:
            clash.add(fmt)
        rows[fmt] = (fmt, code, dt.itemsize, mask, _SUM_KINDS.get(name, 0))
    return tuple(row for fmt, row in rows.items() if fmt not in clash)


def context(
    transport: Transport,
    block: np.ndarray,
    gathered: np.ndarray,
    room: int,
    header: tuple[int, ...],
    sizes: tuple[int, int],
    least: int,
    limit: int,
    handles: Handles | None = None,
) -> object | None:
    """The C context for a communicator's check buffers, or None without the extension
    (or for a transport that is not MPI's, or a single rank).

    Parameters
    ----------
    transport : Transport
        The communicator's MPI transport (its private duplicate carries the calls).
    block, gathered : numpy.ndarray
        The check's buffers: this rank's block (header, then ``room`` bytes) and every
        rank's, one row each.
    room : int
        The check's room in these buffers.
    header : tuple of int
        The 12 header fields, those of the call zero.
    sizes : (int, int)
        ``(lo, hi)``: the message sizes ``lo < n <= hi`` this room serves
        (:func:`optcc_mpi.check.state.served`): the C side takes its calls by this range, not
        by a copy of the sizing rule.
    least : int
        The least room (after a call above the limit, the check has it).
    limit : int
        The gather limit: larger messages go to the library's AllReduce after the check.
    handles : callable, optional
        ``handles(dtype name, op)``: the MPI datatype and op the library's AllReduce uses
        for that pair when both are MPI's own, else None (None: calls above the limit are
        left to Python).
    """
    mod = _module()
    if mod is None or not isinstance(transport, Compilable) or not 1 < transport.size:
        return None
    private = transport.private
    if private is None:  # freed
        return None
    from mpi4py import MPI  # loaded already: _module() found it

    ext, address, size, reduce_at = mod
    formats = _formats()
    lo, hi = sizes
    return ext.make(
        address,
        size,
        MPI._handleof(private),
        MPI._handleof(MPI.BYTE),
        transport.size,
        room,
        lo,
        hi,
        least,
        limit,
        block,
        gathered,
        header,
        formats,
        reduce_at,
        int(MPI.IN_PLACE) & _MASK,
        _library(formats, handles) if handles is not None else (),
    )


_MASK = (1 << 64) - 1


def _library(
    formats: tuple[tuple[str, int, int, int, int], ...],
    handles: Handles,
) -> tuple[tuple[int, int, int, int, int], ...]:
    """Per (format, op) the C path may hand to the library's AllReduce: (format index, op
    code, datatype handle, op handle, width of the floats whose NaNs are made canonical
    afterwards, as :func:`optcc_mpi.collectives` does). Not 16-bit floats (the library
    reduces them with a Python callback), max/min on floats (they go through integer
    keys), nor long doubles (no C canonical NaN here)."""
    from mpi4py import MPI

    names = list(DTYPES)
    out = []
    for i, (_fmt, code, _size, mask, _kind) in enumerate(formats):
        name = names[code]
        dt = DTYPES[name]
        if dt in LOW_PRECISION or name in ("longdouble", "clongdouble"):
            continue
        floats = CATEGORY[name] in ("float", "complex")
        for j, op in enumerate(OPS):
            if not mask >> j & 1 or (floats and op in ("max", "min")):
                continue
            pair = handles(name, op)
            if pair is None:
                continue
            datatype, mpi_op = pair
            width = dt.itemsize // (2 if dt.kind == "c" else 1) if floats else 0
            if op not in ("sum", "prod"):
                width = 0
            out.append(
                (i, j, MPI._handleof(datatype) & _MASK, MPI._handleof(mpi_op) & _MASK, width)
            )
    return tuple(out)


def fold_function() -> FoldCall | None:
    """The compiled call, ``fold(context, sendbuf, recvbuf, op code, compare)`` answering
    FALLBACK, DONE, GATHERED, MISMATCH or LIBRARY (``_fastcall.c``), or None where the
    path is off; the caller binds it once, so that a short call costs no lookup."""
    mod = _module()
    return mod[0].fold if mod is not None else None


def reduce_kind(name: str) -> int:
    """The C sum for dtype ``name`` (0: none)."""
    return _SUM_KINDS.get(name, 0) if _extension() is not None else 0


def sum_rows(kind: int, out: np.ndarray, gathered: np.ndarray, offset: int) -> None:
    """``out`` = the rank-order sum of ``gathered[:, offset:offset + out.nbytes]``, by the
    same C loop as the compiled call path (so that both give the same bits)."""
    ext = _extension()
    assert ext is not None  # reduce_kind() said there is a C sum
    ext.reduce(kind, out, gathered, offset, gathered.shape[1], gathered.shape[0])
