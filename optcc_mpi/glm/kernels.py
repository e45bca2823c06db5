"""This rank's column block and the local kernels, each in its recipe slot's precision.

Rank ``p`` holds ``X[:, C_p]`` for all ``m`` rows and the weight slice ``w[C_p]``. The local
kernels of an outer iteration are the row gather ``Y = X[I, C_p]``, the margin GEMV
``Y @ w``, the Gram product ``Y @ Y.T`` and the gradient GEMV ``Y.T @ v``; everything else
(the reduction, the recurrence) happens on the host on small arrays.

The kernels run on NumPy, on SciPy CSR matrices, or on CuPy arrays (``xp``). On the CPU the
lower-layout Gram is one GEMM per block row, written into the packed vector (half the
flops of the full product); for bf16 inputs on a GPU it is the fp32-output GemmEx of
:func:`optcc_mpi.glm.gram.gram_bf16`.

On a GPU, 16-bit data stay 16-bit: the gathered rows keep the storage dtype, the GemmEx
Gram reads them as they are, and the two GEMVs (margins, gradient) share one float32
widening of the rows per outer iteration. (On the CPU the rows are widened once at the
gather, because float32 BLAS is the only fast path there.) GemmEx runs on CuPy's cuBLAS
handle bound to CuPy's *current* stream, so it is ordered with the CuPy kernels around it
whatever stream the caller made current. bf16 arrays need CuPy 14 or newer.

Gram layout. The recurrence reads only the strictly block-lower blocks ``G[j, t]``
(``t < j``) of the ``sb x sb`` Gram matrix. ``layout="lower"`` (the default) packs just those,
``b^2 s (s - 1) / 2`` words, row block after row block; ``layout="full"`` sends the whole
matrix (``(sb)^2`` words) as the paper's description does. Either way the recurrence
receives the packed lower blocks. Sending only the lower blocks is our choice.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import scipy.sparse as sp

from ..errors import ArgumentError
from .gram import gram_bf16
from .precision import Recipe, compute_dtype, is_half, rounded, storage_dtype

__all__ = ["GRAM_LAYOUTS", "LocalData", "lower_block_index", "packed_size"]

GRAM_LAYOUTS = ("lower", "full")


def packed_size(s: int, b: int, layout: str = "lower") -> int:
    """Words of the packed Gram part for ``s`` steps of batch ``b``."""
    if layout == "full":
        return (s * b) ** 2
    return b * b * s * (s - 1) // 2


@lru_cache(maxsize=64)
def lower_block_index(s: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column indices of the strictly block-lower blocks, in packed order.

    Row block ``j`` (rows ``jb .. jb+b-1``) contributes its first ``jb`` columns, row by row,
    so block row ``j`` starts at offset ``b^2 j (j - 1) / 2`` of the packed vector and is a
    C-ordered ``b x jb`` matrix there.
    """
    rows, cols = [], []
    for j in range(1, s):
        r = np.arange(j * b, (j + 1) * b)
        c = np.arange(j * b)
        rows.append(np.repeat(r, j * b))
        cols.append(np.tile(c, b))
    if not rows:
        empty = np.zeros(0, dtype=np.intp)
        return empty, empty
    return np.concatenate(rows), np.concatenate(cols)


#: Oldest CuPy whose arrays hold bfloat16 (through ml_dtypes).
CUPY_BF16_MIN = 14


def _cupy_major(xp: Any) -> int | None:
    version = getattr(xp, "__version__", None)
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return None


class LocalData:
    """A rank's column block stored in ``recipe.data`` precision, and its kernels.

    Parameters
    ----------
    X : ndarray or scipy.sparse matrix
        The ``(m, n_local)`` column block, any float dtype (bf16 included).
    recipe : Recipe
        Precision of each slot.
    xp : module, optional
        Array module for the kernels: NumPy (default) or CuPy.
    layout : str
        Gram packing, ``"lower"`` or ``"full"``.
    """

    def __init__(self, X: Any, recipe: Recipe, *, xp: Any = None, layout: str = "lower") -> None:
        if layout not in GRAM_LAYOUTS:
            raise ArgumentError(f"unknown Gram layout {layout!r}; choose one of {GRAM_LAYOUTS}")
        self.recipe = recipe
        self.layout = layout
        self.xp = np if xp is None else xp
        self.sparse = sp.issparse(X)
        self.on_device = self.xp is not np
        #: The block as given, for the reported loss (every recipe scored on the same data).
        self.X_eval = X
        data = recipe.data
        if self.sparse:
            if self.on_device:
                raise ArgumentError("sparse X runs on the CPU only")
            # SciPy has no 16-bit sparse arithmetic: hold 16-bit values in float32.
            self.X = rounded(sp.csr_matrix(X), data)
        else:
            X = np.asarray(X) if not self.on_device else X
            stored = X.astype(storage_dtype(data), copy=False)
            self.X = self.xp.ascontiguousarray(self.xp.asarray(stored))
        self.m, self.n_local = self.X.shape
        self._index_cache: dict[int, Any] = {}
        # Device rows stay 16-bit after the gather; the GEMVs share one widened copy.
        self._keep_half = self.on_device and is_half(data)
        self._wide: tuple[Any, Any] | None = None
        if self.on_device and any(p == "bf16" for p in recipe.slots().values()):
            major = _cupy_major(self.xp)
            if major is not None and major < CUPY_BF16_MIN:
                raise ArgumentError(
                    f"bf16 on the GPU needs CuPy >= {CUPY_BF16_MIN} (found "
                    f"{self.xp.__version__}): pip install 'cupy-cuda12x>={CUPY_BF16_MIN}'"
                )

    # -- the trainer's arrays: NumPy, on the host -------------------------------------------
    # The AllReduce buffer, the recurrence, the rows' labels and weights live on the host
    # (an MPI library moves host memory; on a GPU the packed buffer is copied over).

    def host(self, a: Any) -> np.ndarray:
        """``a`` as a NumPy array (copies device arrays to the host, which synchronises)."""
        return a.get() if self.on_device and not isinstance(a, np.ndarray) else a

    def device(self, a: np.ndarray) -> Any:
        """``a`` as an array of the kernel module."""
        return self.xp.asarray(a) if self.on_device else a

    def space(self, a: np.ndarray) -> np.ndarray:
        """An array of the trainer's (a row order, labels, weights) as it computes with
        it: NumPy, on the host."""
        return a

    def empty(self, shape: tuple[int, ...], precision: str) -> np.ndarray:
        """An uninitialised array of the recurrence in ``precision``'s arithmetic dtype."""
        return np.empty(shape, dtype=compute_dtype(precision))

    def pack(self, parts: list[Any], precision: str) -> np.ndarray:
        """The AllReduce buffer: ``parts`` (kernel arrays) flattened end to end, on the
        host, in ``precision``'s storage dtype (16-bit values travel as 16-bit words).
        Always a new array: the AllReduce overwrites it."""
        flat = [self.host(p).reshape(-1) for p in parts]
        buf = np.concatenate(flat) if len(flat) > 1 else flat[0].copy()
        return buf.astype(storage_dtype(precision), copy=False)

    def all_finite(self, a: np.ndarray) -> bool:
        """Whether every value of ``a`` is finite."""
        return bool(np.isfinite(a).all())

    def initial(self, w: np.ndarray, precision: str) -> Any:
        """Master weights (``w`` from the host) in the kernels' module, in ``precision``."""
        return self.device(rounded(np.asarray(w, dtype=np.float64), precision))

    def sqnorm64(self, w: Any) -> np.ndarray:
        """``[||w||^2]`` in float64 (shape (1,), for the objective's AllReduce)."""
        w64 = np.asarray(self.host(w), dtype=np.float64)
        return np.array([np.sum(w64 * w64)])

    def sync(self) -> None:
        """Wait for the kernels queued so far (on a GPU; timing needs it)."""
        if self.on_device:
            self.xp.cuda.get_current_stream().synchronize()

    def margins64(self, w: Any, rows: np.ndarray | None = None, chunk: int = 1 << 16) -> np.ndarray:
        """``X_eval @ w`` in float64 over ``rows`` (all rows by default), in row chunks so
        that a float64 copy of X is never made."""
        X = self.X_eval if rows is None else self.X_eval[rows]
        w64 = np.asarray(self.host(w), dtype=np.float64)
        out = np.empty((X.shape[0], *w64.shape[1:]), dtype=np.float64)
        for start in range(0, X.shape[0], chunk):
            out[start : start + chunk] = X[start : start + chunk].astype(np.float64) @ w64
        return out

    def _widened(self, Yd: Any) -> Any:
        """16-bit device rows widened to float32, once per gathered block."""
        if not self._keep_half or Yd.dtype == np.float32:
            return Yd
        if self._wide is None or self._wide[0] is not Yd:
            self._wide = (Yd, Yd.astype(np.float32))
        return self._wide[1]

    def _operand(self, Yd: Any, slot: str, acc: str) -> Any:
        """Rows as the input of a kernel with input precision ``slot``, accumulating in ``acc``."""
        A = self._widened(Yd)
        if is_half(slot) and slot != self.recipe.data:
            A = rounded(A, slot)
        return A.astype(compute_dtype(acc), copy=False)

    # -- kernels -----------------------------------------------------------------------

    def gather(self, rows: np.ndarray) -> Any:
        """``X[rows]``: on the CPU widened to the arithmetic dtype of the data precision
        (one widening per outer iteration, reused by every kernel); on a GPU in the
        storage dtype (16-bit data stay 16-bit for the GemmEx Gram).
        """
        Y = self.X[self.device(rows) if self.on_device else rows]
        if self._keep_half:
            return Y
        return Y.astype(compute_dtype(self.recipe.data), copy=False)

    def margins(self, Yd: Any, w: Any) -> Any:
        """Partial margins ``Y @ w`` (slots weights_in, margin_acc, margin)."""
        rc = self.recipe
        A = self._operand(Yd, rc.data, rc.margin_acc)
        w_in = rounded(w, rc.weights_in).astype(compute_dtype(rc.margin_acc), copy=False)
        r = A @ w_in
        if is_half(rc.margin_acc):
            r = rounded(r, rc.margin_acc)
        return rounded(r, rc.margin)

    def gram_packed(self, Yd: Any, s: int, b: int) -> Any:
        """Partial Gram of the gathered rows, packed per the layout (slots gram_in, gram_acc)."""
        rc = self.recipe
        if self.layout == "lower" and s == 1:
            return self.xp.zeros(0, dtype=compute_dtype(rc.gram_acc))
        if self.sparse:
            A = self._operand(Yd, rc.gram_in, rc.gram_acc)
            G = (A @ A.T).toarray()
        elif self.on_device:
            G = self._gram_device(Yd)
        elif self.layout == "lower":
            # Only the blocks the recurrence reads, one GEMM per block row written straight
            # into the packed vector: half the flops of the full product, no gather after.
            A = self._operand(Yd, rc.gram_in, rc.gram_acc)
            out = np.empty(packed_size(s, b), dtype=A.dtype)
            for j in range(1, s):
                off, lo = b * b * j * (j - 1) // 2, j * b
                np.matmul(A[lo : lo + b], A[:lo].T, out=out[off : off + b * lo].reshape(b, lo))
            return rounded(out, rc.gram_acc) if is_half(rc.gram_acc) else out
        else:
            A = self._operand(Yd, rc.gram_in, rc.gram_acc)
            G = A @ A.T
        if is_half(rc.gram_acc):
            G = rounded(G, rc.gram_acc)
        if self.layout == "full":
            return G.reshape(-1)
        ri, ci = self._lower_index(s, b)
        return G[ri, ci]

    def _gram_device(self, Yd: Any) -> Any:
        rc = self.recipe
        if rc.data == "bf16" and rc.gram_in == "bf16" and rc.gram_acc == "fp32":
            # Yd is already bf16 (gather keeps 16-bit rows on the device): no conversion.
            # gram_bf16 binds cuBLAS's handle to CuPy's current stream before the GemmEx.
            return gram_bf16(self.xp, Yd.astype(storage_dtype("bf16"), copy=False))
        A = self._operand(Yd, rc.gram_in, rc.gram_acc)
        return A @ A.T

    def _lower_index(self, s: int, b: int) -> tuple[Any, Any]:
        key = s * 100003 + b
        if key not in self._index_cache:
            ri, ci = lower_block_index(s, b)
            self._index_cache[key] = (self.device(ri), self.device(ci))
        return self._index_cache[key]

    def unpack_lower(self, G_full: np.ndarray, s: int, b: int) -> np.ndarray:
        """Packed lower blocks of a reduced full ``(sb)^2`` Gram (host)."""
        ri, ci = lower_block_index(s, b)
        return G_full.reshape(s * b, s * b)[ri, ci]

    def gradient(self, Yd: Any, v: Any) -> Any:
        """``Y.T @ v`` in the update precision (v already holds the step coefficients)."""
        rc = self.recipe
        A = self._operand(Yd, rc.data, rc.update)
        g = A.T @ v.astype(compute_dtype(rc.update), copy=False)
        return rounded(g, rc.update) if is_half(rc.update) else g
