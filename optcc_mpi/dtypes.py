"""Element types and reductions by name: the vocabulary every other module shares.

The element types are those MPI and mpi4py reduce (:data:`DTYPES`): bool, signed and
unsigned integers of 8 to 64 bits, float16, bfloat16 (``ml_dtypes.bfloat16``), float32,
float64, long double, and complex of float, double and long double. The reductions are
MPI's (:data:`OPS`), each on the types MPI defines it for (:func:`check_op_dtype`):

* ``sum``, ``prod``: integers (wrapping modulo 2**bits, as in C), floats, complex;
* ``max``, ``min``: integers and floats;
* ``land``, ``lor``, ``lxor``: integers (result 0 or 1) and bool;
* ``band``, ``bor``, ``bxor``: integers.

How the reductions compute (NaN, signed zeros, 16-bit floats) is
:mod:`optcc_mpi.reductions`; how a transport asks its library to reduce is the
transport's (:mod:`optcc_mpi.transports`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, cast

import ml_dtypes
import numpy as np
import numpy.typing as npt

from optcc_mpi.errors import ArgumentError, ArgumentTypeError

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = [
    "DTYPES",
    "NAME_OF",
    "ALIASES",
    "OPS",
    "CATEGORY",
    "LOW_PRECISION",
    "VALID_PAIRS",
    "dtype_name",
    "check_dtype",
    "op_name",
    "check_op",
    "check_op_dtype",
]


def _dtypes() -> dict[str, np.dtype]:
    d: dict[str, np.dtype] = {"bool": np.dtype(np.bool_)}
    for bits in (8, 16, 32, 64):
        d[f"int{bits}"] = np.dtype(f"int{bits}")
    for bits in (8, 16, 32, 64):
        d[f"uint{bits}"] = np.dtype(f"uint{bits}")
    d["float16"] = np.dtype(np.float16)
    d["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
    d["float32"] = np.dtype(np.float32)
    d["float64"] = np.dtype(np.float64)
    # long double is float64 on some platforms (MSVC, some ARM ABIs): listed once then.
    if np.dtype(np.longdouble) != np.dtype(np.float64):
        d["longdouble"] = np.dtype(np.longdouble)
    d["complex64"] = np.dtype(np.complex64)
    d["complex128"] = np.dtype(np.complex128)
    if np.dtype(np.clongdouble) != np.dtype(np.complex128):
        d["clongdouble"] = np.dtype(np.clongdouble)
    return d


#: Supported element types, by name (the order gives each a stable code).
DTYPES: dict[str, np.dtype] = _dtypes()
NAME_OF: dict[np.dtype, str] = {dt: name for name, dt in DTYPES.items()}
#: Also accepted as names: NumPy's own (``float128``, ``complex256``) and short aliases.
ALIASES: dict[str, str] = {
    **{dt.name: name for name, dt in DTYPES.items()},
    "half": "float16",
    "single": "float32",
    "double": "float64",
    "float": "float64",
    "int": "int64",
}
#: Supported reductions, as MPI names them (lower case).
OPS: tuple[str, ...] = ("sum", "prod", "max", "min", "land", "lor", "lxor", "band", "bor", "bxor")
LOW_PRECISION = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))

# Which types each reduction is defined for: MPI's table (MPI 4.1, section 6.9.2), which
# MPICH enforces too. Categories: "int" (signed and unsigned), "bool", "float", "complex".
CATEGORY: dict[str, str] = {
    name: (
        "bool"
        if dt.kind == "b"
        else "int"
        if dt.kind in "iu"
        else "complex"
        if dt.kind == "c"
        else "float"
    )
    for name, dt in DTYPES.items()
}
_OP_CATEGORIES: dict[str, frozenset[str]] = {
    "sum": frozenset({"int", "float", "complex"}),
    "prod": frozenset({"int", "float", "complex"}),
    "max": frozenset({"int", "float"}),
    "min": frozenset({"int", "float"}),
    "land": frozenset({"int", "bool"}),
    "lor": frozenset({"int", "bool"}),
    "lxor": frozenset({"int", "bool"}),
    "band": frozenset({"int"}),
    "bor": frozenset({"int"}),
    "bxor": frozenset({"int"}),
}
_OP_HINT = {
    "bool": "for bool use land, lor or lxor",
    "float": "floating types take sum, prod, max and min",
    "complex": "complex types take sum and prod",
}


def dtype_name(dtype: object) -> str:
    """Our name (a key of :data:`DTYPES`) of a supported dtype; ArgumentError otherwise."""
    try:
        dt = np.dtype(cast("npt.DTypeLike", dtype))  # NumPy reads it, or TypeError
    except TypeError:
        dt = None
    name = NAME_OF.get(dt) if dt is not None else None
    if name is None:
        if dt is not None and not dt.isnative and dt.newbyteorder("=") in NAME_OF:
            raise ArgumentError(
                f"dtype {dt.str!r} is not in native byte order; convert it first "
                "(arr.astype(arr.dtype.newbyteorder('=')))"
            )
        raise ArgumentError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return name


def check_dtype(dtype: object) -> np.dtype:
    """The NumPy dtype for ``dtype`` (a dtype, type or name); ArgumentError naming it if
    unsupported."""
    if isinstance(dtype, str) and dtype in ALIASES:
        return DTYPES[ALIASES[dtype]]
    return DTYPES[dtype_name(dtype)]


@functools.cache
def _mpi_ops() -> dict[int, str]:
    from mpi4py import MPI

    return {getattr(MPI, name.upper()).handle: name for name in OPS}


def op_name(op: object) -> str:
    """The reduction named by ``op``: one of :data:`OPS` (any case), or an mpi4py
    ``MPI.Op`` such as ``MPI.SUM``. ArgumentError for anything else, naming it."""
    if isinstance(op, str):
        low = op.lower()
        if low in _OP_CATEGORIES:
            return low
        raise ArgumentError(f"unsupported op {op!r}; supported: {', '.join(OPS)}")
    handle = getattr(op, "handle", None)
    if handle is not None and type(op).__name__ == "Op" and "mpi4py" in type(op).__module__:
        name = _mpi_ops().get(handle)
        if name is not None:
            return name
        op = cast("MPI.Op", op)  # (recognised above, without importing mpi4py)
        if not op.is_predefined:
            raise ArgumentError(
                "user-defined MPI ops (MPI.Op.Create) are not supported: our schedules "
                "reduce in NumPy/CuPy with a fixed order; use comm.Allreduce for them, or "
                f"one of {', '.join(OPS)}"
            )
        raise ArgumentError(
            f"unsupported MPI op {_mpi_op_label(op)}; supported: "
            + ", ".join(f"MPI.{n.upper()}" for n in OPS)
        )
    raise ArgumentTypeError(
        f"op must be a string such as 'sum' or an mpi4py MPI.Op, not {type(op).__name__}"
    )


def _mpi_op_label(op: MPI.Op) -> str:
    from mpi4py import MPI

    for name in ("MAXLOC", "MINLOC", "REPLACE", "NO_OP"):
        if op == getattr(MPI, name, None):
            return f"MPI.{name}"
    return repr(op)


def check_op(op: object) -> str:
    """``op``'s canonical name if it is a supported reduction; ArgumentError otherwise."""
    return op_name(op)


def check_op_dtype(op: str, dtype_name_: str) -> None:
    """ArgumentError unless reduction ``op`` is defined for element type ``dtype_name_``
    (MPI's table)."""
    cat = CATEGORY[dtype_name_]
    if cat not in _OP_CATEGORIES[op]:
        hint = _OP_HINT.get(cat, "integer types take every op")
        raise ArgumentError(f"op {op!r} is not defined for {dtype_name_} ({hint}; as in MPI)")


def _valid_pairs() -> frozenset[tuple[str, str]]:
    pairs: set[tuple[str, str]] = set()
    for op, cats in _OP_CATEGORIES.items():
        pairs.update((op, name) for name in DTYPES if CATEGORY[name] in cats)
    return frozenset(pairs)


#: Every (op, dtype name) pair MPI defines.
VALID_PAIRS: frozenset[tuple[str, str]] = _valid_pairs()
