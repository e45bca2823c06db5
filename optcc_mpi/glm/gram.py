"""The bf16-in, fp32-out Gram matrix on the GPU (CA-SGD's recipe C): cuBLAS GemmEx.

CuPy's public ``dot``/``matmul`` on bf16 operands return bf16 (the fp32 accumulator is
rounded on store) and ``out=`` must match the operand dtype, so "bf16 inputs, fp32 result"
is reached by calling ``cublasGemmEx`` directly (:func:`gram_bf16`). The argument
bookkeeping, :func:`gemm_nt_plan`, is a pure function that the CPU test suite checks
against NumPy; :mod:`optcc_mpi.glm.kernels` is the only caller of :func:`gram_bf16`.

CuPy itself is never imported here: the caller passes the ``cupy`` module it got from
:func:`optcc_mpi.arrays.get_cupy`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ArgumentError, ExecutionError

__all__ = [
    "CUBLAS_COMPUTE_32F",
    "CUBLAS_GEMM_DEFAULT",
    "CUBLAS_OP_N",
    "CUBLAS_OP_T",
    "CUDA_R_16BF",
    "CUDA_R_32F",
    "gemm_nt_plan",
    "gram_bf16",
]

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
        raise ArgumentError(f"GEMM sizes must be positive, got m={m}, n={n}, k={k}")
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


def _cublas(cp: Any) -> Any:
    """CuPy's low-level cuBLAS binding (the one holding ``gemmEx``)."""
    lib = getattr(getattr(cp, "cuda", None), "cublas", None)
    if lib is not None and hasattr(lib, "gemmEx"):
        return lib
    from cupy_backends.cuda.libs import cublas  # CuPy's own binding, where cupy.cuda lacks it

    return cublas


class _CurrentStreamCublas:
    """A cuBLAS binding whose ``gemmEx`` first binds the handle to CuPy's current stream.

    CuPy's shared handle stays bound to whichever stream last used it; a GemmEx issued
    through it without rebinding could run on another stream than the CuPy kernels that
    produce its input and consume its output.
    """

    def __init__(self, cp: Any, lib: Any) -> None:
        self._cp = cp
        self._lib = lib

    def gemmEx(self, handle: Any, *args: Any) -> Any:  # noqa: N802 (cuBLAS's name)
        self._lib.setStream(handle, self._cp.cuda.get_current_stream().ptr)
        return self._lib.gemmEx(handle, *args)

    def __getattr__(self, name: str) -> Any:  # enum constants of the binding
        return getattr(self._lib, name)


def gram_bf16(cp: Any, Y: Any, *, cublas: Any = None) -> Any:
    """Return ``Y @ Y.T`` in float32 from a bf16 device matrix, accumulating in fp32.

    Parameters
    ----------
    cp : module
        The ``cupy`` module (passed in so that this module never imports it).
    Y : cupy.ndarray
        C-contiguous ``(rows, k)`` bfloat16 array on the current device.
    cublas : module, optional
        The low-level cuBLAS binding to call ``gemmEx`` through. By default CuPy's, with
        CuPy's handle bound to CuPy's *current* stream before the call, so that the GemmEx
        is ordered with the CuPy kernels around it whatever stream the caller made current.

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
        raise ExecutionError("gram_bf16 needs a CUDA device (cupy.is_available() is False)")
    Y = cp.ascontiguousarray(Y)
    rows, k = Y.shape
    major = int(cp.cuda.Device().compute_capability) // 10
    if major < 8:
        Yf = Y.astype(cp.float32)
        return Yf @ Yf.T
    lib = cublas if cublas is not None else _CurrentStreamCublas(cp, _cublas(cp))
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
