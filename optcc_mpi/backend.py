"""Array backends: NumPy and CuPy behind one small interface.

Everything that touches array memory goes through a :class:`Backend`: allocation, copies,
the element-wise reduction, stream synchronisation, host staging, and the buffer handed
to MPI. This is the only module that imports CuPy, and only when a CuPy array shows up.

16-bit floats (float16, bfloat16) are reduced in float32 and rounded once, which is both
faster than NumPy's 16-bit loops and deterministic. bfloat16 is ``ml_dtypes.bfloat16``.

Point-to-point messages travel as raw bytes (``uint8`` views): no MPI datatype is needed
for bfloat16, and the reduction never happens inside MPI, so results do not depend on how
the MPI library reduces. Only the ``native`` algorithm asks MPI to reduce
(:func:`mpi_datatype_and_op`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

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
    "mpi_datatype_and_op",
    "cupy_status",
    "cuda_aware_mpi",
    "get_cupy",
    "gram_bf16",
    "gemm_nt_plan",
    "apply_plan",
]

#: Supported element types, by name.
DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
}
#: Supported reductions.
OPS = ("sum", "max", "min")
_LOW_PRECISION = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def check_dtype(dtype: Any) -> np.dtype:
    """The NumPy dtype for ``dtype``; ValueError naming it if unsupported."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt not in DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return dt


def check_op(op: str) -> str:
    """``op`` if it is a supported reduction; ValueError naming it otherwise."""
    if op not in OPS:
        raise ValueError(f"unsupported op {op!r}; supported: {', '.join(OPS)}")
    return op


class Backend:
    """Operations on 1-D contiguous arrays of one array library.

    Subclasses implement the methods for their library; ``device`` says whether the
    memory lives on a GPU (then MPI calls need a synchronised stream, and staging through
    host memory when the MPI library is not CUDA-aware).
    """

    name = "abstract"
    device = False
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


def _reduce_with(xp: Any, op: str, dst: Any, src: Any) -> None:
    """Reduction shared by NumPy and CuPy (identical APIs for what is used here)."""
    if dst.dtype in _LOW_PRECISION:
        a = dst.astype(xp.float32)
        b = src.astype(xp.float32)
        fn = {"sum": xp.add, "max": xp.maximum, "min": xp.minimum}[op]
        fn(a, b, out=a)
        dst[...] = a.astype(dst.dtype)
        return
    fn = {"sum": xp.add, "max": xp.maximum, "min": xp.minimum}[op]
    fn(dst, src, out=dst)


class NumpyBackend(Backend):
    """Host memory, NumPy arrays."""

    name = "numpy"

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


def backend_for(arr: Any) -> Backend:
    """The backend owning ``arr``; TypeError if none does."""
    for factory in _BACKENDS:
        inst = _instance(factory)
        if inst.owns(arr):
            return inst
    if type(arr).__module__.split(".")[0] == "cupy":
        return _instance(_cupy_factory())
    raise TypeError(
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

    Types without an MPI reduction (bfloat16, and float16 where the library lacks it) get
    a user-defined commutative op over 2-byte elements that reduces in float32 like the
    point-to-point algorithms.
    """
    from mpi4py import MPI

    dtype = DTYPES[dtype_name]
    mpi_op = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
    predefined = {
        "float32": MPI.FLOAT,
        "float64": MPI.DOUBLE,
        "int32": MPI.INT32_T,
        "int64": MPI.INT64_T,
    }
    if dtype_name in predefined:
        return predefined[dtype_name], mpi_op

    def combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        a = np.frombuffer(inbuf, dtype=dtype)
        b = np.frombuffer(inoutbuf, dtype=dtype)
        _reduce_with(np, op, b, a)

    return MPI.UINT16_T, MPI.Op.Create(combine, commute=True)


# -- bf16 Gram on the GPU (CA-SGD's recipe C) --------------------------------------------------
# CuPy's public dot/matmul on bf16 operands returns bf16 (the fp32 accumulator is rounded on
# store) and ``out=`` must match the operand dtype, so "bf16 inputs, fp32 result" is reached
# by calling cublasGemmEx directly. The argument bookkeeping is a pure function the CPU test
# suite checks against NumPy.
# cuBLAS / CUDA enum values (cublas_api.h, library_types.h); used when the Python binding
# does not export a name.
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUDA_R_32F = 0
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1


def gemm_nt_plan(m: int, n: int, k: int) -> dict[str, int]:
    """cuBLAS arguments computing row-major ``C = A @ B.T``.

    ``A`` is ``m x k``, ``B`` is ``n x k`` and ``C`` is ``m x n``, all C-contiguous. A
    row-major matrix is its transpose in column-major storage, so cuBLAS is asked for
    ``C^T = B @ A^T``: its first operand is ``B`` read transposed (stored as the
    column-major ``k x n`` matrix ``B^T``, leading dimension ``k``), its second is ``A``
    as stored (column-major ``k x m``, leading dimension ``k``), and the column-major
    ``n x m`` result with leading dimension ``n`` is ``C`` row-major.

    Returns
    -------
    dict
        ``transa, transb, m, n, k, lda, ldb, ldc`` for ``gemmEx``, and ``first``/``second``
        naming which row-major operand (``"A"`` or ``"B"``) goes in each pointer slot.
    """
    if min(m, n, k) < 1:
        raise ValueError(f"GEMM sizes must be positive, got m={m}, n={n}, k={k}")
    return {
        "transa": CUBLAS_OP_T,
        "transb": CUBLAS_OP_N,
        "m": n,
        "n": m,
        "k": k,
        "lda": k,
        "ldb": k,
        "ldc": n,
        "first": "B",
        "second": "A",
    }


def apply_plan(plan: dict[str, int], A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Execute a :func:`gemm_nt_plan` the way cuBLAS would, with NumPy (for tests).

    Each pointer is read as a column-major matrix with the plan's leading dimension, the
    operations are applied, and the column-major result is returned as the row-major
    ``C`` that the caller would see.
    """
    ops = {"A": np.ascontiguousarray(A), "B": np.ascontiguousarray(B)}

    def colmajor(flat: np.ndarray, rows: int, cols: int, ld: int) -> np.ndarray:
        # Element (i, j) of a column-major matrix with leading dimension ld is flat[i + j*ld].
        return flat.reshape(-1)[: ld * cols].reshape(cols, ld).T[:rows, :]

    M, N, K = plan["m"], plan["n"], plan["k"]
    a_rows, a_cols = (K, M) if plan["transa"] == CUBLAS_OP_T else (M, K)
    b_rows, b_cols = (N, K) if plan["transb"] == CUBLAS_OP_T else (K, N)
    a = colmajor(ops[plan["first"]].astype(np.float64), a_rows, a_cols, plan["lda"])
    b = colmajor(ops[plan["second"]].astype(np.float64), b_rows, b_cols, plan["ldb"])
    op_a = a.T if plan["transa"] == CUBLAS_OP_T else a
    op_b = b.T if plan["transb"] == CUBLAS_OP_T else b
    c = op_a @ op_b  # column-major M x N result, leading dimension ldc == M
    flat = np.asfortranarray(c).ravel(order="F")
    return flat.reshape(N, plan["ldc"])[:, :M]


def _cublas(cp: Any) -> Any:
    lib = getattr(getattr(cp, "cuda", None), "cublas", None)
    if lib is not None and hasattr(lib, "gemmEx"):
        return lib
    return importlib.import_module("cupy_backends.cuda.libs.cublas")  # CuPy's own binding


def gram_bf16(cp: Any, Y: Any, *, cublas: Any = None) -> Any:
    """Return ``Y @ Y.T`` in float32 from a bf16 device matrix, accumulating in fp32.

    Parameters
    ----------
    cp : module
        The ``cupy`` module (passed in so that this module never imports it).
    Y : cupy.ndarray
        C-contiguous ``(rows, k)`` bfloat16 array on the current device.
    cublas : module, optional
        The low-level cuBLAS binding; defaults to CuPy's.

    Returns
    -------
    cupy.ndarray
        ``(rows, rows)`` float32 Gram matrix.

    Notes
    -----
    Devices before compute capability 8.0 have no bf16 tensor-core GEMM; there the inputs
    are widened to float32 and multiplied with CuPy's fp32 GEMM (same values, since bf16 is
    exact in fp32).
    """
    if not cp.is_available():
        raise RuntimeError("gram_bf16 needs a CUDA device (cupy.is_available() is False)")
    Y = cp.ascontiguousarray(Y)
    rows, k = Y.shape
    major = int(cp.cuda.Device().compute_capability) // 10
    if major < 8:
        Yf = Y.astype(cp.float32)
        return Yf @ Yf.T
    lib = cublas if cublas is not None else _cublas(cp)
    plan = gemm_nt_plan(rows, rows, k)
    out = cp.empty((rows, rows), dtype=cp.float32)
    one = np.array(1.0, dtype=np.float32)
    zero = np.array(0.0, dtype=np.float32)
    bf16 = getattr(cp.cuda.runtime, "CUDA_R_16BF", CUDA_R_16BF)
    f32 = getattr(cp.cuda.runtime, "CUDA_R_32F", CUDA_R_32F)
    lib.gemmEx(
        cp.cuda.device.get_cublas_handle(),
        plan["transa"],
        plan["transb"],
        plan["m"],
        plan["n"],
        plan["k"],
        one.ctypes.data,  # alpha/beta are host scalars (default pointer mode)
        Y.data.ptr,
        bf16,
        plan["lda"],
        Y.data.ptr,
        bf16,
        plan["ldb"],
        zero.ctypes.data,
        out.data.ptr,
        f32,
        plan["ldc"],
        getattr(lib, "CUBLAS_COMPUTE_32F", CUBLAS_COMPUTE_32F),
        getattr(lib, "CUBLAS_GEMM_DEFAULT", CUBLAS_GEMM_DEFAULT),
    )
    return out
