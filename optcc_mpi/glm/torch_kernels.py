"""A rank's column block and its local kernels as PyTorch tensors (CPU or CUDA).

Where the ranks are a ``torch.distributed`` process group (gloo: CPU tensors; NCCL: CUDA
tensors), the block, the weights, the labels and every intermediate of the trainer are
tensors on the group's device from the first outer iteration to the last: the row gather,
the margin GEMV, the Gram product, the AllReduce of the packed ``[r; G]`` (on the device,
through :func:`optcc_mpi.allreduce`), the inner recurrence and the update. Only the
per-epoch row order (a permutation drawn by NumPy, the same on every rank and as under
MPI) crosses to the device, once per epoch, and loss values come back as numbers.

Precision slots follow :mod:`optcc_mpi.glm.precision` as on NumPy: values are rounded to
a 16-bit format by a round trip through torch's bfloat16 or float16 (round to nearest
even), and 16-bit data are stored in 16 bits.

The recipe-C Gram (bf16 inputs, fp32 accumulation and result) is one call on CUDA:
``torch.mm(Y, Y.T, out_dtype=torch.float32)`` on bf16 rows, a tensor-core GEMM whose fp32
accumulator is stored unrounded (:func:`gram_bf16`). Where that form is missing (the CPU,
older torch) the rows are widened to float32 and multiplied in float32: the same values,
since every bf16 number is exact in float32 and the accumulation is fp32 either way. On
the CPU the rows are widened at the gather (float32 BLAS is the fast path there) and the
lower-layout Gram is one GEMM per block row straight into the packed vector, as on NumPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import ArgumentError
from .kernels import GRAM_LAYOUTS, lower_block_index, packed_size
from .precision import Recipe, is_half, rounded, storage_dtype, torch_dtype

__all__ = ["TorchLocalData", "as_tensor", "gram_bf16"]


def as_tensor(a: Any, device: torch.device) -> torch.Tensor:
    """``a`` (a NumPy array, ``ml_dtypes.bfloat16`` included, or a tensor) as a tensor on
    ``device``; a tensor already there is returned as it is (no copy)."""
    if isinstance(a, torch.Tensor):
        return a.to(device)
    arr = np.ascontiguousarray(a)
    if arr.dtype == storage_dtype("bf16"):
        # torch cannot wrap ml_dtypes' bfloat16: the same bits, viewed as torch's.
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(arr).to(device)


def gram_bf16(Y: torch.Tensor) -> torch.Tensor:
    """``Y @ Y.T`` in float32 from bf16 rows, accumulated in fp32.

    On CUDA: ``torch.mm(Y, Y.T, out_dtype=torch.float32)``, tensor cores with the fp32
    accumulator stored as it is (torch's plain ``matmul`` of bf16 operands would round the
    result to bf16). Elsewhere, or where torch lacks that form: the rows widened to float32
    and multiplied in float32, which gives the same values (bf16 is exact in float32).
    """
    if Y.device.type != "cpu":
        try:
            return torch.mm(Y, Y.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            pass  # this torch has no mixed-dtype mm on this device: widen below
    Yf = Y.to(torch.float32)
    return Yf @ Yf.T


class TorchLocalData:
    """A rank's column block as a tensor in ``recipe.data`` precision, and its kernels.

    The interface is :class:`optcc_mpi.glm.kernels.LocalData`'s; here the trainer's own
    arrays (the AllReduce buffer, the recurrence, labels and weights of the rows) are
    tensors on the same device as the block.

    Parameters
    ----------
    X : ndarray or torch.Tensor
        The dense ``(m, n_local)`` column block, any float dtype.
    recipe : Recipe
        Precision of each slot.
    device : torch.device
        Where the kernels run (the group's device).
    layout : str
        Gram packing, ``"lower"`` or ``"full"``.
    """

    def __init__(
        self, X: Any, recipe: Recipe, *, device: torch.device, layout: str = "lower"
    ) -> None:
        if layout not in GRAM_LAYOUTS:
            raise ArgumentError(f"unknown Gram layout {layout!r}; choose one of {GRAM_LAYOUTS}")
        self.recipe = recipe
        self.layout = layout
        self.torch_device = device
        self.sparse = False
        self.on_device = device.type != "cpu"
        given = as_tensor(X, device)
        #: The block as given, for the reported loss (every recipe scored on the same data).
        self.X_eval = given
        self.X = given.to(torch_dtype(recipe.data, storage=True)).contiguous()
        self.m, self.n_local = self.X.shape
        self._index_cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # Device rows stay 16-bit after the gather; the GEMVs share one widened copy.
        self._keep_half = self.on_device and is_half(recipe.data)
        self._wide: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- the trainer's arrays ------------------------------------------------------------

    def host(self, a: Any) -> np.ndarray:
        """``a`` as a NumPy array (a copy to the host for device tensors)."""
        return a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)

    def device(self, a: Any) -> torch.Tensor:
        """``a`` as a tensor on the kernels' device."""
        return as_tensor(a, self.torch_device)

    def space(self, a: Any) -> torch.Tensor:
        """An array of the trainer's (a row order, labels, weights) as it computes with
        it: a tensor on the device."""
        return as_tensor(a, self.torch_device)

    def empty(self, shape: tuple[int, ...], precision: str) -> torch.Tensor:
        """An uninitialised array of the recurrence in ``precision``'s arithmetic dtype."""
        return torch.empty(shape, dtype=torch_dtype(precision), device=self.torch_device)

    def pack(self, parts: list[torch.Tensor], precision: str) -> torch.Tensor:
        """The AllReduce buffer: ``parts`` flattened end to end in ``precision``'s storage
        dtype (16-bit values travel as 16-bit words)."""
        dt = torch_dtype(precision, storage=True)
        return torch.cat([p.reshape(-1).to(dt) for p in parts])

    def all_finite(self, a: torch.Tensor) -> bool:
        """Whether every value of ``a`` is finite (a host synchronisation on CUDA)."""
        return bool(torch.isfinite(a).all())

    def initial(self, w: np.ndarray, precision: str) -> torch.Tensor:
        """Master weights (``w`` from the host) on the device in ``precision``."""
        return rounded(self.device(np.asarray(w, dtype=np.float64)), precision)

    def sqnorm64(self, w: torch.Tensor) -> torch.Tensor:
        """``[||w||^2]`` in float64 (shape (1,), for the objective's AllReduce)."""
        w64 = w.to(torch.float64)
        return (w64 * w64).sum().reshape(1)

    def sync(self) -> None:
        """Wait for the kernels queued so far (on a GPU; timing needs it)."""
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)

    def margins64(self, w: Any, rows: Any = None, chunk: int = 1 << 16) -> torch.Tensor:
        """``X_eval @ w`` in float64 over ``rows`` (all rows by default), in row chunks."""
        X = self.X_eval if rows is None else self.X_eval.index_select(0, self.space(rows))
        w64 = w.to(torch.float64)
        out = torch.empty((X.shape[0], *w64.shape[1:]), dtype=torch.float64, device=X.device)
        for start in range(0, X.shape[0], chunk):
            out[start : start + chunk] = X[start : start + chunk].to(torch.float64) @ w64
        return out

    # -- kernels -------------------------------------------------------------------------

    def _widened(self, Yd: torch.Tensor) -> torch.Tensor:
        """16-bit device rows widened to float32, once per gathered block."""
        if not self._keep_half or Yd.dtype == torch.float32:
            return Yd
        if self._wide is None or self._wide[0] is not Yd:
            self._wide = (Yd, Yd.to(torch.float32))
        return self._wide[1]

    def _operand(self, Yd: torch.Tensor, slot: str, acc: str) -> torch.Tensor:
        """Rows as the input of a kernel with input precision ``slot``, accumulating in ``acc``."""
        A = self._widened(Yd)
        if is_half(slot) and slot != self.recipe.data:
            A = rounded(A, slot)
        return A.to(torch_dtype(acc))

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """``X[rows]``: widened to the data precision's arithmetic dtype on the CPU, kept in
        its storage dtype on a GPU (16-bit rows go to the Gram as they are)."""
        Y = self.X.index_select(0, rows)
        if self._keep_half:
            return Y
        return Y.to(torch_dtype(self.recipe.data))

    def margins(self, Yd: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Partial margins ``Y @ w`` (slots weights_in, margin_acc, margin)."""
        rc = self.recipe
        A = self._operand(Yd, rc.data, rc.margin_acc)
        r = A @ rounded(w, rc.weights_in).to(torch_dtype(rc.margin_acc))
        if is_half(rc.margin_acc):
            r = rounded(r, rc.margin_acc)
        return rounded(r, rc.margin)

    def gram_packed(self, Yd: torch.Tensor, s: int, b: int) -> torch.Tensor:
        """Partial Gram of the gathered rows, packed per the layout (slots gram_in, gram_acc)."""
        rc = self.recipe
        acc = torch_dtype(rc.gram_acc)
        if self.layout == "lower" and s == 1:
            return torch.zeros(0, dtype=acc, device=self.torch_device)
        if self.on_device and rc.data == "bf16" and rc.gram_in == "bf16" and rc.gram_acc == "fp32":
            G = gram_bf16(Yd.to(torch.bfloat16))
        elif self.layout == "lower" and not self.on_device:
            # Only the blocks the recurrence reads, one GEMM per block row written straight
            # into the packed vector (as the NumPy kernels do).
            A = self._operand(Yd, rc.gram_in, rc.gram_acc)
            out = torch.empty(packed_size(s, b), dtype=A.dtype, device=A.device)
            for j in range(1, s):
                off, lo = b * b * j * (j - 1) // 2, j * b
                torch.matmul(A[lo : lo + b], A[:lo].T, out=out[off : off + b * lo].view(b, lo))
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

    def _lower_index(self, s: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (s, b)
        if key not in self._index_cache:
            ri, ci = lower_block_index(s, b)
            self._index_cache[key] = (self.device(ri), self.device(ci))
        return self._index_cache[key]

    def unpack_lower(self, G_full: torch.Tensor, s: int, b: int) -> torch.Tensor:
        """Packed lower blocks of a reduced full ``(sb)^2`` Gram."""
        ri, ci = self._lower_index(s, b)
        return G_full.reshape(s * b, s * b)[ri, ci]

    def gradient(self, Yd: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``Y.T @ v`` in the update precision (v already holds the step coefficients)."""
        rc = self.recipe
        A = self._operand(Yd, rc.data, rc.update)
        g = A.T @ v.to(torch_dtype(rc.update))
        return rounded(g, rc.update) if is_half(rc.update) else g
