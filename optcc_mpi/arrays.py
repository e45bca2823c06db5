"""Array libraries: NumPy, CuPy and PyTorch tensors behind one small interface.

Everything that touches array memory goes through an :class:`ArrayOps`: allocation,
copies, the element-wise reduction (:mod:`optcc_mpi.reductions`), the order-preserving
keys of ``max``/``min`` and the canonical NaN, stream synchronisation and host copies.
What a transport hands to its library is the transport's business
(:mod:`optcc_mpi.transports`): an :class:`ArrayOps` only says where the memory lives.

This is the only module that imports CuPy, and only when a CuPy array shows up; likewise
PyTorch, only when a tensor shows up. :func:`buffer_of` turns what users pass (arrays,
buffers, mpi4py buffer specifications, tensors, objects with the CUDA array interface)
into a 1-D array and its :class:`ArrayOps`, without a copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Generic, TypeVar, Union, cast

import ml_dtypes
import numpy as np

from optcc_mpi.dtypes import NAME_OF
from optcc_mpi.errors import ArgumentError, ArgumentTypeError
from optcc_mpi.reductions import (
    TorchOps,
    XpArray,
    canonical_nans,
    from_keys,
    key_dtype,
    reduce_into,
    reduce_with,
    to_keys,
)

if TYPE_CHECKING:  # names for annotations: none of these libraries is imported to run
    import cupy
    import torch
    from mpi4py import MPI

__all__ = [
    "Array",
    "ArrayOps",
    "XpArrayOps",
    "NumpyArrayOps",
    "CupyArrayOps",
    "TorchArrayOps",
    "NUMPY",
    "register_array_ops",
    "torch_array_ops",
    "TORCH_DTYPES",
    "buffer_of",
    "result_like",
    "cupy_status",
    "get_cupy",
]

#: A 1-D contiguous array of one array library: a NumPy or CuPy array, or a PyTorch tensor.
Array = Union[np.ndarray, "torch.Tensor", "cupy.ndarray"]
#: The array type and the element-type type of one library (:class:`ArrayOps`'s parameters).
ArrayT = TypeVar("ArrayT")
DTypeT = TypeVar("DTypeT")


class ArrayOps(Generic[ArrayT, DTypeT]):
    """Operations on 1-D contiguous arrays of one array library.

    Generic in the library's array type and its type of element types
    (``ArrayOps[np.ndarray, np.dtype]``, ``ArrayOps[torch.Tensor, torch.dtype]``); subclasses
    implement the methods for their library. Code that takes whichever library owns a
    user's buffer, not known until run time, writes a bare ``ArrayOps`` and :data:`Array`
    for its arrays. ``device`` says whether the memory lives on a GPU (then MPI calls
    need a synchronised stream, and staging through host memory when the MPI library is
    not CUDA-aware).
    """

    name = "abstract"
    device = False
    #: Whether a transport may hand these arrays' device memory to its library
    #: directly; None: the transport asks its library (:mod:`optcc_mpi.transports`).
    cuda_aware: bool | None = None

    def owns(self, arr: object) -> bool:
        """True if ``arr`` is an array of this library."""
        raise NotImplementedError

    def empty(self, n: int, dtype: DTypeT) -> ArrayT:
        raise NotImplementedError

    def empty_like(self, arr: ArrayT) -> ArrayT:
        """Uninitialised array with the shape, dtype and memory order of ``arr``."""
        raise NotImplementedError

    def copyto(self, dst: ArrayT, src: ArrayT) -> None:
        raise NotImplementedError

    def reduce(self, op: str, dst: ArrayT, src: ArrayT) -> None:
        """``dst = op(dst, src)`` element-wise, in place."""
        raise NotImplementedError

    def reduce_into(self, op: str, out: ArrayT, a: ArrayT, b: ArrayT) -> None:
        """``out = op(a, b)`` element-wise: the bits of :meth:`reduce` on ``out`` holding
        ``a`` (the same operands in the same order). ``out`` may be ``a`` or ``b`` itself
        (the same object), and must not overlap them otherwise. A library that can write
        the result elsewhere saves a copy (the executor reads a send buffer's first use
        this way); this default copies."""
        if out is b:
            first = self.empty_like(a)
            self.copyto(first, a)
            self.reduce(op, first, b)
            self.copyto(out, first)
            return
        if out is not a:
            self.copyto(out, a)
        self.reduce(op, out, b)

    # -- max/min keys and NaN (optcc_mpi.reductions), on the whole buffer ---------------------
    def has_keys(self, dtype: DTypeT) -> bool:
        """Whether ``max``/``min`` on ``dtype`` go through integer keys (a library that
        reduces nothing itself: no)."""
        return False

    def to_keys(self, arr: ArrayT, op: str, src: ArrayT | None = None) -> ArrayT:
        """Map float ``arr`` to its integer keys for ``op`` in place (or write the keys of
        ``src`` into ``arr``); the integer view. Called where :meth:`has_keys` says so."""
        raise NotImplementedError

    def from_keys(self, keys: ArrayT, dtype: DTypeT, op: str) -> ArrayT:
        """Inverse of :meth:`to_keys`, in place; the float view."""
        raise NotImplementedError

    def canonical_nans(self, arr: ArrayT) -> None:
        """Every NaN of float or complex ``arr`` made the canonical one, in place (a
        library that reduces nothing itself: nothing to do)."""

    def dtype_name(self, arr: ArrayT) -> str | None:
        """Our name (:data:`optcc_mpi.dtypes.DTYPES`) of ``arr``'s element type, or None."""
        raise NotImplementedError

    def byte_view(self, arr: ArrayT) -> ArrayT:
        """``arr``'s memory as a 1-D array of bytes (no copy): what messages carry."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for queued work on the current stream (no-op on the host)."""

    def to_host(self, arr: ArrayT) -> np.ndarray:
        """A host (NumPy) copy of ``arr``."""
        raise NotImplementedError

    def from_host(self, dst: ArrayT, host: np.ndarray) -> None:
        """Copy host data into ``dst``."""
        raise NotImplementedError

    def flat(self, arr: ArrayT) -> ArrayT:
        """``arr`` as a 1-D view in memory order (it must be contiguous)."""
        raise NotImplementedError

    def contiguous(self, arr: ArrayT) -> bool:
        raise NotImplementedError

    def writable(self, arr: ArrayT) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class XpArrayOps(ArrayOps[XpArray, np.dtype]):
    """The ops of NumPy's array API (NumPy, CuPy): the keys, the NaNs, names, views and
    flags computed through the array module :attr:`xp`."""

    #: The array module (NumPy-compatible API) for whole-buffer element-wise work.
    xp: ModuleType

    def has_keys(self, dtype: np.dtype) -> bool:
        return key_dtype(dtype) is not None

    def to_keys(self, arr: XpArray, op: str, src: XpArray | None = None) -> XpArray:
        return to_keys(self.xp, arr, op, src)

    def from_keys(self, keys: XpArray, dtype: np.dtype, op: str) -> XpArray:
        return from_keys(self.xp, keys, dtype, op)

    def canonical_nans(self, arr: XpArray) -> None:
        canonical_nans(self.xp, arr)

    def dtype_name(self, arr: XpArray) -> str | None:
        return NAME_OF.get(arr.dtype)

    def flat(self, arr: XpArray) -> XpArray:
        return arr.ravel(order="K")

    def contiguous(self, arr: XpArray) -> bool:
        flags = arr.flags
        return bool(flags.c_contiguous or flags.f_contiguous)


class NumpyArrayOps(XpArrayOps[np.ndarray]):
    """Host memory, NumPy arrays."""

    name = "numpy"
    xp = np

    def owns(self, arr: object) -> bool:
        return isinstance(arr, np.ndarray)

    def empty(self, n: int, dtype: np.dtype) -> np.ndarray:
        return np.empty(n, dtype=dtype)

    def empty_like(self, arr: np.ndarray) -> np.ndarray:
        return np.empty_like(arr)

    def copyto(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def reduce(self, op: str, dst: np.ndarray, src: np.ndarray) -> None:
        reduce_with(np, op, dst, src)

    def reduce_into(self, op: str, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        reduce_into(np, op, out, a, b)

    def byte_view(self, arr: np.ndarray) -> np.ndarray:
        return arr.view(np.uint8)

    def to_host(self, arr: np.ndarray) -> np.ndarray:
        return arr

    def from_host(self, dst: np.ndarray, host: np.ndarray) -> None:
        if host is not dst:
            np.copyto(dst, host)

    def writable(self, arr: np.ndarray) -> bool:
        return bool(arr.flags.writeable)


class CupyArrayOps(XpArrayOps["cupy.ndarray"]):
    """GPU memory, CuPy arrays; reductions run on the GPU.

    The executor synchronises the current stream before a buffer goes to a library that
    does not order itself after it (MPI; mpi4py never does this itself); with an MPI
    library that is not CUDA-aware, messages are staged through host copies.
    """

    name = "cupy"
    device = True

    def __init__(self) -> None:
        import cupy  # the only import of CuPy in the package

        self.cp = cupy
        self.xp = cupy

    def owns(self, arr: object) -> bool:
        return isinstance(arr, self.cp.ndarray)

    def empty(self, n: int, dtype: np.dtype) -> cupy.ndarray:
        return self.cp.empty(n, dtype=dtype)

    def empty_like(self, arr: cupy.ndarray) -> cupy.ndarray:
        return self.cp.empty_like(arr)

    def copyto(self, dst: cupy.ndarray, src: cupy.ndarray) -> None:
        self.cp.copyto(dst, src)

    def reduce(self, op: str, dst: cupy.ndarray, src: cupy.ndarray) -> None:
        reduce_with(self.cp, op, dst, src)

    def reduce_into(self, op: str, out: cupy.ndarray, a: cupy.ndarray, b: cupy.ndarray) -> None:
        reduce_into(self.cp, op, out, a, b)

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def byte_view(self, arr: cupy.ndarray) -> cupy.ndarray:
        return arr.view(self.cp.uint8)

    def to_host(self, arr: cupy.ndarray) -> np.ndarray:
        return self.cp.asnumpy(arr)

    def from_host(self, dst: cupy.ndarray, host: np.ndarray) -> None:
        dst.set(host)


class TorchArrayOps(ArrayOps["torch.Tensor", "torch.dtype"]):
    """PyTorch tensors, kept as tensors: reductions by torch on the tensors' device.

    The torch.distributed transport moves tensors (:mod:`optcc_mpi.transports.distributed`);
    over MPI a tensor is viewed as a NumPy or CuPy array instead (:func:`buffer_of`). One
    instance per device (:func:`torch_array_ops`). Work is queued on torch's current
    stream, which NCCL's operations are ordered with, so nothing here synchronises.
    """

    name = "torch"

    def __init__(self, device: torch.device | str) -> None:
        import torch  # only reached for tensors: torch stays optional

        self.torch = torch
        self.where = torch.device(device)
        self.device = self.where.type != "cpu"
        self.ops = TorchOps(torch)
        self._names = {getattr(torch, n): n for n in TORCH_DTYPES if hasattr(torch, n)}

    def owns(self, arr: object) -> bool:
        return isinstance(arr, self.torch.Tensor) and arr.device == self.where

    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return self.torch.empty(n, dtype=dtype, device=self.where)

    def empty_like(self, arr: torch.Tensor) -> torch.Tensor:
        return self.torch.empty_like(arr, memory_format=self.torch.preserve_format)

    def copyto(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def reduce(self, op: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.ops.reduce(op, dst, src)

    def reduce_into(self, op: str, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        self.ops.reduce_into(op, out, a, b)

    def has_keys(self, dtype: torch.dtype) -> bool:
        return self.ops.key_dtype(dtype) is not None

    def to_keys(self, arr: torch.Tensor, op: str, src: torch.Tensor | None = None) -> torch.Tensor:
        return self.ops.to_keys(arr, op, src)

    def from_keys(self, keys: torch.Tensor, dtype: torch.dtype, op: str) -> torch.Tensor:
        return self.ops.from_keys(keys, dtype, op)

    def canonical_nans(self, arr: torch.Tensor) -> None:
        self.ops.canonical_nans(arr)

    def dtype_name(self, arr: torch.Tensor) -> str | None:
        return self._names.get(arr.dtype)

    def synchronize(self) -> None:
        if self.device:
            self.torch.cuda.current_stream(self.where).synchronize()

    def byte_view(self, arr: torch.Tensor) -> torch.Tensor:
        return arr.view(self.torch.uint8)

    def to_host(self, arr: torch.Tensor) -> np.ndarray:
        flat = arr.detach().cpu()
        if flat.dtype == self.torch.bfloat16:
            return flat.view(self.torch.int16).numpy().view(ml_dtypes.bfloat16)
        return flat.numpy()

    def from_host(self, dst: torch.Tensor, host: np.ndarray) -> None:
        if host.dtype == np.dtype(ml_dtypes.bfloat16):
            src = self.torch.from_numpy(host.view(np.int16)).view(self.torch.bfloat16)
        else:
            src = self.torch.from_numpy(host)
        dst.copy_(src)

    def flat(self, arr: torch.Tensor) -> torch.Tensor:
        return arr.detach().reshape(-1)

    def contiguous(self, arr: torch.Tensor) -> bool:
        return bool(arr.is_contiguous())

    def writable(self, arr: torch.Tensor) -> bool:
        return not (arr.is_conj() or arr.is_neg())


#: The tensor element types TorchArrayOps reduces (by our names, which are torch's).
TORCH_DTYPES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)


@functools.lru_cache(maxsize=16)
def torch_array_ops(device: torch.device | str) -> TorchArrayOps:
    """The :class:`TorchArrayOps` of ``device`` (a ``torch.device`` or its name)."""
    return TorchArrayOps(device)


_FACTORIES: list[Callable[[], ArrayOps]] = []
_INSTANCES: dict[Callable[[], ArrayOps], ArrayOps] = {}


def register_array_ops(factory: Callable[[], ArrayOps]) -> Callable[[], ArrayOps]:
    """Add an array library (its ArrayOps' factory, no arguments); later ones are tried first."""
    _FACTORIES.insert(0, factory)
    return factory


register_array_ops(NumpyArrayOps)


def instance(factory: Callable[[], ArrayOps]) -> ArrayOps:
    inst = _INSTANCES.get(factory)
    if inst is None:
        inst = _INSTANCES[factory] = factory()
    return inst


#: NumPy's ArrayOps (the fast path of :func:`buffer_of`).
NUMPY = instance(NumpyArrayOps)


@functools.lru_cache(maxsize=1)
def _cupy_factory() -> Callable[[], ArrayOps]:
    return register_array_ops(CupyArrayOps)


def get_cupy() -> ModuleType | None:
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
def _contiguous_flat(arr: Array, arrays: ArrayOps, what: str) -> Array:
    if not arrays.contiguous(arr):
        raise ArgumentError(
            f"{what} is not contiguous; pass a contiguous array (e.g. np.ascontiguousarray)"
        )
    return arrays.flat(arr)


def buffer_of(obj: Any, *, what: str = "buffer", tensors: bool = False) -> tuple[Array, ArrayOps]:
    """A 1-D array over the memory of ``obj`` (no copy), and the ArrayOps of its library.

    Accepted: NumPy and CuPy arrays of any shape and either memory order, if contiguous;
    any object with the buffer protocol (``array.array``, ``bytearray``, ``memoryview``,
    ...); mpi4py buffer specifications ``[buf, datatype]``, ``[buf, count, datatype]``,
    ``[buf, (count, displ), datatype]`` and ``[buf, count, displ, datatype]`` with a
    predefined MPI datatype (or a contiguous one of a predefined type); objects with the
    CUDA array interface (Numba device arrays and the like, viewed through CuPy); PyTorch
    tensors: with ``tensors`` (the torch.distributed transport) as tensors
    (:class:`TorchArrayOps`), else CPU tensors through a NumPy view and CUDA tensors
    through DLPack as CuPy arrays, after synchronising PyTorch's current stream. ``what``
    names the argument in errors.
    """
    if isinstance(obj, np.ndarray):
        return _contiguous_flat(obj, NUMPY, what), NUMPY
    if isinstance(obj, (list, tuple)):
        return _from_spec(obj, what)
    module = type(obj).__module__
    if module == "torch" or module.startswith("torch."):
        if tensors:
            return _tensor(obj, what)
        arr = _from_torch(obj, what)
        return buffer_of(arr, what=what)
    for factory in _FACTORIES:
        inst = instance(factory)
        if inst.owns(obj):
            return _contiguous_flat(obj, inst, what), inst
    if module.split(".")[0] == "cupy":
        inst = instance(_cupy_factory())
        return _contiguous_flat(obj, inst, what), inst
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cuda_interface(obj, what)
    try:
        view = memoryview(obj)
    except TypeError:
        raise ArgumentTypeError(
            f"unsupported {what} type {module}.{type(obj).__name__}; pass a NumPy or CuPy "
            "array, a PyTorch tensor, an object with the buffer protocol or the CUDA array "
            "interface, or an mpi4py buffer specification such as [buf, MPI.DOUBLE]"
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
    return _contiguous_flat(arr, NUMPY, what), NUMPY


def _from_cuda_interface(obj: object, what: str) -> tuple[Array, ArrayOps]:
    """A CuPy view (no copy) of an object exposing ``__cuda_array_interface__``."""
    cp = get_cupy()
    if cp is None:
        raise ArgumentTypeError(
            f"{what}: {type(obj).__module__}.{type(obj).__name__} is device memory (CUDA "
            "array interface); reducing it needs CuPy with a usable GPU "
            "(pip install 'optcc-mpi[gpu]')"
        )
    try:
        arr = cp.asarray(obj)  # wraps the pointer: same memory, CuPy's view of it
    except Exception as exc:
        raise ArgumentTypeError(f"{what}: cannot view its CUDA array interface: {exc}") from None
    inst = instance(_cupy_factory())
    return _contiguous_flat(arr, inst, what), inst


def _tensor(t: torch.Tensor, what: str) -> tuple[torch.Tensor, TorchArrayOps]:
    """A tensor as a 1-D tensor of the same memory, and its device's TorchArrayOps."""
    import torch

    if t.layout != torch.strided:
        raise ArgumentError(f"{what}: {t.layout} tensors are not supported; pass a dense tensor")
    if not t.is_contiguous():
        raise ArgumentError(
            f"{what}: tensor of shape {tuple(t.shape)} is not contiguous; reduce "
            "tensor.contiguous() and copy the result back"
        )
    if t.is_conj() or t.is_neg():
        raise ArgumentError(f"{what}: a lazy conjugate/negative view; call .resolve_conj() first")
    inst = torch_array_ops(t.device)
    if inst.dtype_name(t) is None:
        raise ArgumentTypeError(
            f"{what}: tensor dtype {t.dtype} is not supported; supported: "
            + ", ".join(TORCH_DTYPES)
        )
    return t.detach().reshape(-1), inst


def _from_torch(t: torch.Tensor, what: str) -> Array:
    """A NumPy (CPU) or CuPy (CUDA) array sharing the memory of tensor ``t``."""
    import torch  # only reached for tensors, so torch stays optional

    if t.is_conj() or t.is_neg():
        raise ArgumentError(f"{what}: a lazy conjugate/negative view; call .resolve_conj() first")
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


def _from_spec(msg: list[Any] | tuple[Any, ...], what: str) -> tuple[Array, ArrayOps]:
    """An mpi4py buffer specification as a 1-D array of the datatype's elements."""
    from mpi4py import MPI

    n = len(msg)
    count: int | None = None
    displ: int = 0
    datatype: MPI.Datatype | None = None
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
            f"([buf, datatype], [buf, count, datatype], ...), got {n}"
        )
    if isinstance(buf, (bool, int, float, complex, list, tuple)):
        raise ArgumentTypeError(
            f"{what}: a list or tuple is read as an mpi4py buffer specification "
            "[buf, datatype] whose first item is the buffer; for numbers pass "
            "np.array([...])"
        )
    seen, arrays = buffer_of(buf, what=what)
    raw = cast(np.ndarray, seen)  # not a tensor (tensors=False): NumPy's API (CuPy's too)
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
    return as_bytes[displ * size : (displ + count) * size].view(dtype), arrays


def _datatype_dtype(datatype: MPI.Datatype, what: str) -> tuple[np.dtype, int]:
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
    if dt is None or dt.fields is not None or dt not in NAME_OF:
        raise ArgumentTypeError(
            f"{what}: MPI datatype {datatype.Get_name() or datatype!r} is not supported; "
            "use a predefined datatype such as MPI.DOUBLE (or a contiguous one of it)"
        )
    return dt, per


def result_like(obj: Any, flat: Array, arrays: ArrayOps) -> tuple[Array, Array]:
    """A new result for input ``obj`` (whose 1-D view is ``flat``): the object returned to
    the caller, and its 1-D view. Arrays and tensors get one of their own kind, shape and
    memory order; other buffers a 1-D NumPy array of their element type."""
    if isinstance(obj, np.ndarray):
        out = np.empty_like(obj)
        return out, out.ravel(order="K")
    module = type(obj).__module__
    if module == "torch" or module.startswith("torch."):
        import torch

        made = torch.empty_like(obj, memory_format=torch.preserve_format)
        return made, buffer_of(made, what="result", tensors=arrays.name == "torch")[0]
    if arrays is not NUMPY and not isinstance(obj, (list, tuple)) and arrays.owns(obj):
        own = arrays.empty_like(obj)
        return own, arrays.flat(own)
    new = arrays.empty(flat.shape[0], flat.dtype)
    return new, new


# -- environment probes -------------------------------------------------------------------------
def cupy_status() -> dict[str, object]:
    """Whether CuPy imports, whether a GPU is usable, and versions (for ``optcc-mpi info``)."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install
        return {"installed": False, "available": False, "reason": str(exc).splitlines()[0]}
    status: dict[str, object] = {"installed": True, "version": cupy.__version__}
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
