"""Array backends: NumPy and CuPy behind one small interface, and the reductions.

Everything that touches array memory goes through a :class:`Backend`: allocation, copies,
the element-wise reduction, stream synchronisation, host staging, and the buffer handed
to MPI. This is the only module that imports CuPy, and only when a CuPy array shows up;
likewise PyTorch, only when a tensor shows up (:func:`as_array`).

Element types and reductions
----------------------------
The element types are those MPI and mpi4py reduce (:data:`DTYPES`): bool, signed and
unsigned integers of 8 to 64 bits, float16, bfloat16 (``ml_dtypes.bfloat16``), float32,
float64, long double, and complex of float, double and long double. The reductions are
MPI's (:data:`OPS`), each on the types MPI defines it for (:func:`check_op_dtype`):

* ``sum``, ``prod``: integers (wrapping modulo 2**bits, as in C), floats, complex;
* ``max``, ``min``: integers and floats;
* ``land``, ``lor``, ``lxor``: integers (result 0 or 1) and bool;
* ``band``, ``bor``, ``bxor``: integers.

Semantics every algorithm shares (``native`` included, see ``docs/api.md``):

* integer, logical and bitwise reductions are exact;
* ``max``/``min`` on floats order ``-0.0 < +0.0`` and propagate NaN: if any input element
  is NaN the result is NaN, always the type's canonical quiet NaN (positive, payload
  zero). They are computed on order-preserving integer *keys* (:func:`to_keys`), which
  makes them exact and commutative, so the MPI library's result is the same bits on every
  rank too;
* ``sum``/``prod`` on floats follow IEEE arithmetic in an order fixed by the algorithm;
  a NaN input gives a NaN result (for results the MPI library reduced, the canonical
  NaN, since which NaN an addition returns depends on the operand order);
* 16-bit floats are reduced in float32 and rounded after every step.

Point-to-point messages travel as raw bytes (``uint8`` views): no MPI datatype is needed
for bfloat16, and the reduction never happens inside MPI, so results do not depend on how
the MPI library reduces. Only the ``native`` algorithm asks MPI to reduce
(:func:`mpi_datatype_and_op`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from optcc_mpi.errors import ArgumentError, ArgumentTypeError

__all__ = [
    "Backend",
    "NumpyBackend",
    "CupyBackend",
    "register_backend",
    "backend_for",
    "DTYPES",
    "OPS",
    "check_dtype",
    "check_op",
    "check_op_dtype",
    "dtype_name",
    "op_name",
    "as_array",
    "result_like",
    "to_keys",
    "from_keys",
    "key_dtype",
    "canonical_nans",
    "mpi_datatype_and_op",
    "cupy_status",
    "cuda_aware_mpi",
    "get_cupy",
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
_NAME_OF: dict[np.dtype, str] = {dt: name for name, dt in DTYPES.items()}
#: Also accepted as names: NumPy's own (``float128``, ``complex256``) and short aliases.
_ALIASES: dict[str, str] = {
    **{dt.name: name for name, dt in DTYPES.items()},
    "half": "float16",
    "single": "float32",
    "double": "float64",
    "float": "float64",
    "int": "int64",
}
#: Supported reductions, as MPI names them (lower case).
OPS: tuple[str, ...] = ("sum", "prod", "max", "min", "land", "lor", "lxor", "band", "bor", "bxor")
_LOW_PRECISION = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))

# Which types each reduction is defined for: MPI's table (MPI 4.1, section 6.9.2), which
# MPICH enforces too. Categories: "int" (signed and unsigned), "bool", "float", "complex".
_CATEGORY: dict[str, str] = {
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


def dtype_name(dtype: Any) -> str:
    """Our name (a key of :data:`DTYPES`) of a supported dtype; ArgumentError otherwise."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    name = _NAME_OF.get(dt) if dt is not None else None
    if name is None:
        if dt is not None and not dt.isnative and dt.newbyteorder("=") in _NAME_OF:
            raise ArgumentError(
                f"dtype {dt.str!r} is not in native byte order; convert it first "
                "(arr.astype(arr.dtype.newbyteorder('=')))"
            )
        raise ArgumentError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return name


def check_dtype(dtype: Any) -> np.dtype:
    """The NumPy dtype for ``dtype`` (a dtype, type or name); ArgumentError naming it if
    unsupported."""
    if isinstance(dtype, str) and dtype in _ALIASES:
        return DTYPES[_ALIASES[dtype]]
    return DTYPES[dtype_name(dtype)]


@functools.cache
def _mpi_ops() -> dict[int, str]:
    from mpi4py import MPI

    return {getattr(MPI, name.upper()).handle: name for name in OPS}


def op_name(op: Any) -> str:
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


def _mpi_op_label(op: Any) -> str:
    from mpi4py import MPI

    for name in ("MAXLOC", "MINLOC", "REPLACE", "NO_OP"):
        if op == getattr(MPI, name, None):
            return f"MPI.{name}"
    return repr(op)


def check_op(op: Any) -> str:
    """``op``'s canonical name if it is a supported reduction; ArgumentError otherwise."""
    return op_name(op)


def check_op_dtype(op: str, dtype_name_: str) -> None:
    """ArgumentError unless reduction ``op`` is defined for element type ``dtype_name_``
    (MPI's table)."""
    cat = _CATEGORY[dtype_name_]
    if cat not in _OP_CATEGORIES[op]:
        hint = _OP_HINT.get(cat, "integer types take every op")
        raise ArgumentError(f"op {op!r} is not defined for {dtype_name_} ({hint}; as in MPI)")


# -- the reductions ------------------------------------------------------------------------------
# max/min on floats work on integer keys: the float's bits as a signed integer, with the
# magnitude bits flipped for negative numbers, order like the floats and put -0.0 just
# below +0.0. NaNs (any sign, any payload) map to the top key for max and the bottom key
# for min, so they win; mapping back gives the canonical quiet NaN. An integer max/min is
# exact and commutative, hence so is this one: every rank gets the same bits whatever order
# the MPI library combines in.
_KEY_INFO: dict[np.dtype, tuple[np.dtype, int, int]] = {
    # float dtype: (integer dtype of the same width, bits of +inf, bits of canonical NaN)
    np.dtype(np.float16): (np.dtype(np.int16), 0x7C00, 0x7E00),
    np.dtype(ml_dtypes.bfloat16): (np.dtype(np.int16), 0x7F80, 0x7FC0),
    np.dtype(np.float32): (np.dtype(np.int32), 0x7F800000, 0x7FC00000),
    np.dtype(np.float64): (np.dtype(np.int64), 0x7FF0000000000000, 0x7FF8000000000000),
}


def key_dtype(dtype: np.dtype) -> np.dtype | None:
    """The integer dtype :func:`to_keys` maps ``dtype`` to, or None if it has no keys
    (integers, long double, complex)."""
    info = _KEY_INFO.get(dtype)
    return None if info is None else info[0]


def _key_consts(dtype: np.dtype, op: str) -> tuple[np.dtype, Any, Any, Any, Any, Any]:
    it, inf_bits, nan_bits = _KEY_INFO[dtype]
    info = np.iinfo(it)
    t = it.type
    sentinel = t(info.max) if op == "max" else t(info.min)
    return it, t(info.max), t(inf_bits), t(nan_bits), t(it.itemsize * 8 - 1), sentinel


def to_keys(xp: Any, arr: Any, op: str) -> Any:
    """Map a float array to integer keys for ``op`` ("max" or "min"), in place.

    Returns the integer view of ``arr`` holding the keys; :func:`from_keys` maps back.
    ``xp`` is the array module (NumPy or CuPy).
    """
    it, maxpos, inf_bits, _nan, shift, sentinel = _key_consts(arr.dtype, op)
    u = arr.view(it)
    nan = (u & maxpos) > inf_bits
    t = u >> shift  # arithmetic: all ones for negative numbers
    t &= maxpos
    u ^= t
    xp.copyto(u, sentinel, where=nan)
    return u


def from_keys(xp: Any, keys: Any, dtype: np.dtype, op: str) -> Any:
    """Inverse of :func:`to_keys`, in place; returns the float view (dtype ``dtype``)."""
    it, maxpos, _inf, nan_bits, shift, sentinel = _key_consts(dtype, op)
    nan = keys == sentinel
    t = keys >> shift
    t &= maxpos
    keys ^= t
    xp.copyto(keys, nan_bits, where=nan)
    return keys.view(dtype)


def canonical_nans(xp: Any, arr: Any) -> None:
    """Replace every NaN in float or complex ``arr`` by the canonical quiet NaN, in place
    (each component of a complex number separately)."""
    dt = arr.dtype
    if dt.kind == "c":
        arr = arr.view(np.dtype(f"f{dt.itemsize // 2}"))
        dt = arr.dtype
    info = _KEY_INFO.get(dt)
    if info is not None:
        it, inf_bits, nan_bits = info
        u = arr.view(it)
        maxpos = it.type(np.iinfo(it).max)
        nan = (u & maxpos) > it.type(inf_bits)
        xp.copyto(u, it.type(nan_bits), where=nan)
    elif dt.kind == "f":  # long double: no integer of its width
        xp.copyto(arr, dt.type("nan"), where=xp.isnan(arr))


def _float_maxmin(xp: Any, op: str, dst: Any, src: Any) -> None:
    it = _KEY_INFO[dst.dtype][0]
    kd = to_keys(xp, dst.view(it).copy().view(dst.dtype), op)
    ks = to_keys(xp, src.view(it).copy().view(src.dtype), op)
    (xp.maximum if op == "max" else xp.minimum)(kd, ks, out=kd)
    dst.view(it)[...] = from_keys(xp, kd, dst.dtype, op).view(it)


def _wide_maxmin(xp: Any, op: str, dst: Any, src: Any) -> None:
    """max/min for long double (no integer of its width): the same order and NaN rule as
    the keys, in the float domain."""
    if op == "max":
        take = (src > dst) | ((src == dst) & xp.signbit(dst) & ~xp.signbit(src))
    else:
        take = (src < dst) | ((src == dst) & ~xp.signbit(dst) & xp.signbit(src))
    nan = xp.isnan(dst) | xp.isnan(src)
    xp.copyto(dst, src, where=take)
    xp.copyto(dst, dst.dtype.type("nan"), where=nan)


_ARITH = {"sum": "add", "prod": "multiply"}
_LOGICAL = {"land": "logical_and", "lor": "logical_or", "lxor": "logical_xor"}
_BITWISE = {"band": "bitwise_and", "bor": "bitwise_or", "bxor": "bitwise_xor"}


def _reduce_with(xp: Any, op: str, dst: Any, src: Any) -> None:
    """``dst = op(dst, src)`` element-wise, in place, with the semantics in the module
    docstring (shared by NumPy and CuPy, whose APIs agree on what is used here)."""
    dt = dst.dtype
    if op in _ARITH:
        fn = getattr(xp, _ARITH[op])
        if dt in _LOW_PRECISION:
            a = dst.astype(xp.float32)
            fn(a, src.astype(xp.float32), out=a)
            dst[...] = a.astype(dt)
        else:
            fn(dst, src, out=dst)
    elif op == "max" or op == "min":
        if dt.kind in "iu":
            (xp.maximum if op == "max" else xp.minimum)(dst, src, out=dst)
        elif dt in _KEY_INFO:
            _float_maxmin(xp, op, dst, src)
        else:
            _wide_maxmin(xp, op, dst, src)
    elif op in _LOGICAL:
        # C semantics: the result is 0 or 1 in the operands' type.
        dst[...] = getattr(xp, _LOGICAL[op])(dst, src)
    elif op in _BITWISE:
        getattr(xp, _BITWISE[op])(dst, src, out=dst)
    else:
        raise ArgumentError(f"unsupported op {op!r}; supported: {', '.join(OPS)}")


class Backend:
    """Operations on 1-D contiguous arrays of one array library.

    Subclasses implement the methods for their library; ``device`` says whether the
    memory lives on a GPU (then MPI calls need a synchronised stream, and staging through
    host memory when the MPI library is not CUDA-aware).
    """

    name = "abstract"
    device = False
    #: The array module (NumPy-compatible API) for whole-buffer element-wise work, or None
    #: when the backend offers only the methods below.
    xp: Any = None
    #: Whether MPI may be handed this backend's device memory; None: ask the library.
    cuda_aware: bool | None = None

    def owns(self, arr: Any) -> bool:
        """True if ``arr`` is an array of this backend."""
        raise NotImplementedError

    def empty(self, n: int, dtype: np.dtype) -> Any:
        raise NotImplementedError

    def empty_like(self, arr: Any) -> Any:
        """Uninitialised array with the shape, dtype and memory order of ``arr``."""
        raise NotImplementedError

    def copyto(self, dst: Any, src: Any) -> None:
        raise NotImplementedError

    def reduce(self, op: str, dst: Any, src: Any) -> None:
        """``dst = op(dst, src)`` element-wise, in place."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for queued work on the current stream (no-op on the host)."""

    def mpi_buffer(self, arr: Any) -> Any:
        """Object to pass to mpi4py for the bytes of ``arr`` (after :meth:`synchronize`)."""
        raise NotImplementedError

    def to_host(self, arr: Any) -> np.ndarray:
        """A host (NumPy) copy of ``arr``."""
        raise NotImplementedError

    def from_host(self, dst: Any, host: np.ndarray) -> None:
        """Copy host data into ``dst``."""
        raise NotImplementedError

    def flat(self, arr: Any) -> Any:
        """``arr`` as a 1-D view in memory order (it must be contiguous)."""
        return arr.ravel(order="K")

    def staging(self) -> bool:
        """True when messages must go through host copies (device memory, MPI not
        CUDA-aware)."""
        if not self.device:
            return False
        aware = self.cuda_aware if self.cuda_aware is not None else cuda_aware_mpi()
        return not aware

    def contiguous(self, arr: Any) -> bool:
        flags = arr.flags
        return bool(flags.c_contiguous or flags.f_contiguous)

    def writable(self, arr: Any) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class NumpyBackend(Backend):
    """Host memory, NumPy arrays."""

    name = "numpy"
    xp = np

    def owns(self, arr: Any) -> bool:
        return isinstance(arr, np.ndarray)

    def empty(self, n: int, dtype: np.dtype) -> np.ndarray:
        return np.empty(n, dtype=dtype)

    def empty_like(self, arr: np.ndarray) -> np.ndarray:
        return np.empty_like(arr)

    def copyto(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def reduce(self, op: str, dst: np.ndarray, src: np.ndarray) -> None:
        _reduce_with(np, op, dst, src)

    def mpi_buffer(self, arr: np.ndarray) -> np.ndarray:
        return arr.view(np.uint8)

    def to_host(self, arr: np.ndarray) -> np.ndarray:
        return arr

    def from_host(self, dst: np.ndarray, host: np.ndarray) -> None:
        if host is not dst:
            np.copyto(dst, host)

    def writable(self, arr: np.ndarray) -> bool:
        return bool(arr.flags.writeable)


class CupyBackend(Backend):
    """GPU memory, CuPy arrays; reductions run on the GPU.

    The current stream is synchronised before every buffer goes to MPI (mpi4py never
    does this itself). With an MPI library that is not CUDA-aware, messages are staged
    through host copies.
    """

    name = "cupy"
    device = True

    def __init__(self) -> None:
        import cupy  # the only import of CuPy in the package

        self.cp = cupy
        self.xp = cupy

    def owns(self, arr: Any) -> bool:
        return isinstance(arr, self.cp.ndarray)

    def empty(self, n: int, dtype: np.dtype) -> Any:
        return self.cp.empty(n, dtype=dtype)

    def empty_like(self, arr: Any) -> Any:
        return self.cp.empty_like(arr)

    def copyto(self, dst: Any, src: Any) -> None:
        self.cp.copyto(dst, src)

    def reduce(self, op: str, dst: Any, src: Any) -> None:
        _reduce_with(self.cp, op, dst, src)

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def mpi_buffer(self, arr: Any) -> Any:
        return arr.view(self.cp.uint8)

    def to_host(self, arr: Any) -> np.ndarray:
        return self.cp.asnumpy(arr)

    def from_host(self, dst: Any, host: np.ndarray) -> None:
        dst.set(host)


_BACKENDS: list[Callable[[], Backend]] = []
_INSTANCES: dict[Callable[[], Backend], Backend] = {}


def register_backend(factory: Callable[[], Backend]) -> Callable[[], Backend]:
    """Add a backend (a zero-argument factory); later registrations are tried first."""
    _BACKENDS.insert(0, factory)
    return factory


register_backend(NumpyBackend)


def _instance(factory: Callable[[], Backend]) -> Backend:
    inst = _INSTANCES.get(factory)
    if inst is None:
        inst = _INSTANCES[factory] = factory()
    return inst


#: The NumPy backend (the fast path of :func:`as_array`).
_NUMPY = _instance(NumpyBackend)


def backend_for(arr: Any) -> Backend:
    """The backend owning ``arr``; TypeError if none does."""
    for factory in _BACKENDS:
        inst = _instance(factory)
        if inst.owns(arr):
            return inst
    if type(arr).__module__.split(".")[0] == "cupy":
        return _instance(_cupy_factory())
    raise ArgumentTypeError(
        f"unsupported buffer type {type(arr).__module__}.{type(arr).__name__}; "
        "pass a NumPy or CuPy array"
    )


@functools.lru_cache(maxsize=1)
def _cupy_factory() -> Callable[[], Backend]:
    return register_backend(CupyBackend)


def get_cupy() -> Any:
    """The ``cupy`` module when a GPU is usable, else None (never raises)."""
    try:
        import cupy
    except Exception:
        return None
    try:
        return cupy if cupy.is_available() else None
    except Exception:
        return None


# -- what users pass: arrays, buffers, mpi4py buffer specifications, tensors --------------------
def _contiguous_flat(arr: Any, backend: Backend, what: str) -> Any:
    if not backend.contiguous(arr):
        raise ArgumentError(
            f"{what} is not contiguous; pass a contiguous array (e.g. np.ascontiguousarray)"
        )
    return backend.flat(arr)


def as_array(obj: Any, *, what: str = "buffer") -> tuple[Any, Backend]:
    """A 1-D array over the memory of ``obj`` (no copy), and the backend that owns it.

    Accepted: NumPy and CuPy arrays of any shape and either memory order, if contiguous;
    any object with the buffer protocol (``array.array``, ``bytearray``, ``memoryview``,
    ...); mpi4py buffer specifications ``[buf, datatype]``, ``[buf, count, datatype]``,
    ``[buf, (count, displ), datatype]`` and ``[buf, count, displ, datatype]`` with a
    predefined MPI datatype (or a contiguous one of a predefined type); PyTorch tensors
    (CPU tensors through a NumPy view; CUDA tensors through DLPack as CuPy arrays, after
    synchronising PyTorch's current stream). ``what`` names the argument in errors.
    """
    if isinstance(obj, np.ndarray):
        return _contiguous_flat(obj, _NUMPY, what), _NUMPY
    if isinstance(obj, (list, tuple)):
        return _from_spec(obj, what)
    module = type(obj).__module__
    if module == "torch" or module.startswith("torch."):
        arr = _from_torch(obj, what)
        return as_array(arr, what=what)
    for factory in _BACKENDS:
        inst = _instance(factory)
        if inst.owns(obj):
            return _contiguous_flat(obj, inst, what), inst
    if module.split(".")[0] == "cupy":
        inst = _instance(_cupy_factory())
        return _contiguous_flat(obj, inst, what), inst
    try:
        view = memoryview(obj)
    except TypeError:
        raise ArgumentTypeError(
            f"unsupported {what} type {module}.{type(obj).__name__}; pass a NumPy or CuPy "
            "array, a PyTorch tensor, an object with the buffer protocol, or an mpi4py "
            "buffer specification such as [buf, MPI.DOUBLE]"
        ) from None
    if not view.contiguous:
        raise ArgumentError(f"{what} is not contiguous")
    try:
        arr = np.asarray(view)
    except (TypeError, ValueError, NotImplementedError):
        raise ArgumentTypeError(
            f"{what}: buffer format {view.format!r} has no NumPy dtype; pass "
            "[buf, datatype] to say what the bytes hold"
        ) from None
    return _contiguous_flat(arr, _NUMPY, what), _NUMPY


def _from_torch(t: Any, what: str) -> Any:
    """A NumPy (CPU) or CuPy (CUDA) array sharing the memory of tensor ``t``."""
    import torch  # only reached for tensors, so torch stays optional

    t = t.detach()
    if t.device.type == "cpu":
        try:
            if t.dtype == torch.bfloat16:
                # NumPy has no bfloat16: the same bits, viewed through ml_dtypes.
                return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
            return t.numpy()
        except (TypeError, RuntimeError) as exc:
            raise ArgumentTypeError(f"{what}: cannot view tensor of {t.dtype}: {exc}") from None
    if t.device.type == "cuda":
        cp = get_cupy()
        if cp is None:
            raise ArgumentTypeError(f"{what}: CUDA tensors need CuPy (pip install cupy-cuda12x)")
        # Work queued on PyTorch's stream must finish before CuPy and MPI touch the memory.
        torch.cuda.current_stream(t.device).synchronize()
        with cp.cuda.Device(t.device.index):
            try:
                return cp.from_dlpack(t)
            except Exception as exc:  # e.g. bfloat16 with a CuPy that lacks it
                raise ArgumentTypeError(
                    f"{what}: cannot view CUDA tensor of {t.dtype} through DLPack ({exc}); "
                    "bfloat16 needs CuPy >= 14"
                ) from None
    raise ArgumentTypeError(f"{what}: tensors on {t.device.type} are not supported (cpu, cuda)")


def _from_spec(msg: list[Any] | tuple[Any, ...], what: str) -> tuple[Any, Backend]:
    """An mpi4py buffer specification as a 1-D array of the datatype's elements."""
    from mpi4py import MPI

    n = len(msg)
    count: Any = None
    displ: Any = 0
    datatype: Any = None
    if n == 2:
        buf, second = msg
        if isinstance(second, MPI.Datatype):
            datatype = second
        elif isinstance(second, (list, tuple)):
            count, displ = second
        else:
            count = second
    elif n == 3:
        buf, count, datatype = msg
        if isinstance(count, (list, tuple)):
            count, displ = count
    elif n == 4:
        buf, count, displ, datatype = msg
    else:
        raise ArgumentError(
            f"{what}: a buffer specification has 2 to 4 items "
            "([buf, datatype], [buf, count, datatype], ...), got {n}"
        )
    if isinstance(buf, (bool, int, float, complex, list, tuple)):
        raise ArgumentTypeError(
            f"{what}: a list or tuple is read as an mpi4py buffer specification "
            "[buf, datatype] whose first item is the buffer; for numbers pass "
            "np.array([...])"
        )
    raw, backend = as_array(buf, what=what)
    dtype, per = (raw.dtype, 1) if datatype is None else _datatype_dtype(datatype, what)
    nbytes = raw.size * raw.dtype.itemsize
    if nbytes % dtype.itemsize:
        raise ArgumentError(f"{what}: {nbytes} bytes are not a whole number of {dtype} elements")
    total = nbytes // dtype.itemsize
    displ = int(displ) * per
    count = total - displ if count is None else int(count) * per
    if count < 0 or displ < 0:
        raise ArgumentError(f"{what}: negative count or displacement")
    if displ + count > total:
        raise ArgumentError(
            f"{what}: count {count} and displacement {displ} exceed the buffer's "
            f"{total} elements of {dtype}"
        )
    size = dtype.itemsize
    as_bytes = raw.view(np.uint8) if raw.dtype != np.uint8 else raw
    return as_bytes[displ * size : (displ + count) * size].view(dtype), backend


def _datatype_dtype(datatype: Any, what: str) -> tuple[np.dtype, int]:
    """NumPy dtype of a predefined MPI datatype (or a contiguous one of a predefined type),
    and how many elements of it one datatype item holds."""
    from mpi4py import MPI
    from mpi4py.util import dtlib

    if datatype == MPI.DATATYPE_NULL:
        raise ArgumentError(f"{what}: datatype is MPI.DATATYPE_NULL")
    for name in ("BFLOAT16_T",):
        special = getattr(MPI, name, MPI.DATATYPE_NULL)
        if special != MPI.DATATYPE_NULL and datatype == special:
            return np.dtype(ml_dtypes.bfloat16), 1
    try:
        dt = dtlib.to_numpy_dtype(datatype)
    except Exception:
        dt = None
    per = 1
    if dt is not None and dt.subdtype is not None:
        dt, shape = dt.subdtype
        per = int(np.prod(shape))
    if dt is None or dt.fields is not None or dt not in _NAME_OF:
        raise ArgumentTypeError(
            f"{what}: MPI datatype {datatype.Get_name() or datatype!r} is not supported; "
            "use a predefined datatype such as MPI.DOUBLE (or a contiguous one of it)"
        )
    return dt, per


def result_like(obj: Any, flat: Any, backend: Backend) -> tuple[Any, Any]:
    """A new result for input ``obj`` (whose 1-D view is ``flat``): the object returned to
    the caller, and its 1-D view. Arrays and tensors get one of their own kind, shape and
    memory order; other buffers a 1-D NumPy array of their element type."""
    if isinstance(obj, np.ndarray):
        out = np.empty_like(obj)
        return out, out.ravel(order="K")
    module = type(obj).__module__
    if module == "torch" or module.startswith("torch."):
        import torch

        out = torch.empty_like(obj, memory_format=torch.preserve_format)
        return out, as_array(out, what="result")[0]
    if backend is not _NUMPY and not isinstance(obj, (list, tuple)) and backend.owns(obj):
        out = backend.empty_like(obj)
        return out, backend.flat(out)
    out = backend.empty(flat.size, flat.dtype)
    return out, out


# -- environment probes -------------------------------------------------------------------------
def cupy_status() -> dict[str, Any]:
    """Whether CuPy imports, whether a GPU is usable, and versions (for ``optcc-mpi info``)."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install
        return {"installed": False, "available": False, "reason": str(exc).splitlines()[0]}
    status: dict[str, Any] = {"installed": True, "version": cupy.__version__}
    try:
        status["available"] = bool(cupy.is_available())
        if status["available"]:
            dev = cupy.cuda.Device()
            props = cupy.cuda.runtime.getDeviceProperties(dev.id)
            status["device"] = (
                props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            )
            status["compute_capability"] = dev.compute_capability
            status["devices"] = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        status["available"] = False
        status["reason"] = str(exc).splitlines()[0]
    return status


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
    import os

    from optcc_mpi import config

    forced = config.get("OPTCC_CUDA_AWARE")
    if forced in ("0", "1"):
        return forced == "1"
    from mpi4py import MPI

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


# -- the native reduction -----------------------------------------------------------------------
@functools.cache
def mpi_datatype_and_op(dtype_name: str, op: str) -> tuple[Any, Any]:
    """MPI datatype and op for ``MPI_Allreduce`` on ``dtype_name`` (the ``native`` path).

    ``dtype_name`` is a key of :data:`DTYPES` or NumPy's name (``float128``). Predefined
    types and ops are used where MPI's reduction has our semantics. A user-defined
    commutative op reduces with :func:`_reduce_with` instead for 16-bit floats (no MPI
    reduction, or not one in float32; they travel as 2-byte ``MPI.UINT16_T`` elements)
    and for ``max``/``min`` on floats (MPI's compare-and-select returns whichever operand
    comes second for NaN or equal zeros, so ranks could disagree). Callers that map floats
    to keys first (:func:`to_keys`) reduce integers and never need that op.
    """
    from mpi4py import MPI

    name = _ALIASES.get(dtype_name, dtype_name)
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
    float_maxmin = _CATEGORY[name] == "float" and op in ("max", "min")
    if name in predefined and not float_maxmin:
        mpi_op = getattr(MPI, op.upper())
        if _CATEGORY[name] != "int" or op not in ("sum", "prod"):
            return predefined[name], mpi_op
        if _library_wraps(predefined[name], mpi_op, dtype, op == "prod"):
            return predefined[name], mpi_op
        # The library's integer sum or product saturates on overflow (Open MPI's
        # vectorised 8- and 16-bit kernels clamp, a behaviour its developers keep), while
        # NumPy, C on real machines and our own schedules wrap modulo 2**bits: reduce with
        # NumPy so that native agrees with every other algorithm.

    def combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        a = np.frombuffer(inbuf, dtype=dtype)
        b = np.frombuffer(inoutbuf, dtype=dtype)
        # No warning or exception from inside MPI (and not on some ranks only).
        with np.errstate(all="ignore"):
            _reduce_with(np, op, b, a)

    datatype = MPI.UINT16_T if dtype in _LOW_PRECISION else predefined[name]
    return datatype, MPI.Op.Create(combine, commute=True)


def _library_wraps(datatype: Any, mpi_op: Any, dtype: np.dtype, prod: bool) -> bool:
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
