"""How reductions compute: the semantics every algorithm and array library shares.

* integer, logical and bitwise reductions are exact;
* ``max``/``min`` on floats order ``-0.0 < +0.0`` and propagate NaN: if any input element
  is NaN the result is NaN, always the type's canonical quiet NaN (positive, payload
  zero). They are computed on order-preserving integer *keys* (:func:`to_keys`), which
  makes them exact and commutative, so a library's result is the same bits on every
  rank too;
* ``sum``/``prod`` on floats follow IEEE arithmetic in an order fixed by the algorithm;
  a NaN input gives a NaN result (for results an MPI library reduced, the canonical NaN,
  since which NaN an addition returns depends on the operand order, which MPI may vary by
  rank; gloo's and NCCL's rings reduce each element once and copy it, so their NaNs are
  left as the sum made them, the same bits on every rank);
* 16-bit floats are reduced in float32 and rounded after every step.

The functions take the array module ``xp`` (NumPy or CuPy, whose APIs agree on what is
used here); :class:`TorchOps` gives PyTorch tensors the same rules, computed by torch on
the tensors' own device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, TypeVar

import ml_dtypes
import numpy as np

from optcc_mpi.dtypes import LOW_PRECISION, OPS
from optcc_mpi.errors import ArgumentError

if TYPE_CHECKING:  # names for annotations: neither library is imported to run
    import cupy
    import torch

__all__ = [
    "key_dtype",
    "to_keys",
    "from_keys",
    "canonical_nans",
    "reduce_with",
    "reduce_into",
    "reduce_rows",
    "TorchOps",
    "XpArray",
]

#: A NumPy or a CuPy array: the functions below take either, with its array module ``xp``
#: (CuPy mirrors what they use of NumPy's API). Constrained, so that a function returns an
#: array of the kind it was given.
XpArray = TypeVar("XpArray", np.ndarray, "cupy.ndarray")

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


def _key_consts(
    dtype: np.dtype, op: str
) -> tuple[np.dtype, np.integer, np.integer, np.integer, np.integer, np.integer]:
    it, inf_bits, nan_bits = _KEY_INFO[dtype]
    info = np.iinfo(it)
    t = it.type
    sentinel = t(info.max) if op == "max" else t(info.min)
    return it, t(info.max), t(inf_bits), t(nan_bits), t(it.itemsize * 8 - 1), sentinel


def to_keys(xp: ModuleType, arr: XpArray, op: str, src: XpArray | None = None) -> XpArray:
    """Map a float array to integer keys for ``op`` ("max" or "min"), in place, or the
    keys of ``src`` (same type and size) into ``arr`` (one pass instead of a copy first).

    Returns the integer view of ``arr`` holding the keys; :func:`from_keys` maps back.
    ``xp`` is the array module (NumPy or CuPy).
    """
    it, maxpos, inf_bits, _nan, shift, sentinel = _key_consts(arr.dtype, op)
    u = arr.view(it)
    s = u if src is None else src.view(it)
    nan = (s & maxpos) > inf_bits
    t = s >> shift  # arithmetic: all ones for negative numbers
    t &= maxpos
    xp.bitwise_xor(s, t, out=u)
    xp.copyto(u, sentinel, where=nan)
    return u


def from_keys(xp: ModuleType, keys: XpArray, dtype: np.dtype, op: str) -> XpArray:
    """Inverse of :func:`to_keys`, in place; returns the float view (dtype ``dtype``)."""
    it, maxpos, _inf, nan_bits, shift, sentinel = _key_consts(dtype, op)
    nan = keys == sentinel
    t = keys >> shift
    t &= maxpos
    keys ^= t
    xp.copyto(keys, nan_bits, where=nan)
    return keys.view(dtype)


def canonical_nans(xp: ModuleType, arr: XpArray) -> None:
    """Replace every NaN in float or complex ``arr`` by the canonical quiet NaN, in place
    (each component of a complex number separately)."""
    dt = arr.dtype
    if dt.kind == "c":
        arr = arr.view(np.dtype(f"f{dt.itemsize // 2}"))
        dt = arr.dtype
    if dt.itemsize >= 4:
        # One vectorised pass with no temporary: no NaN anywhere (a NaN or an infinity
        # makes the sum non-finite, and only then is every element looked at). The sum is
        # only a test: finite elements that add up past the type's maximum (or infinities
        # of both signs) are no error of the reduction, which is finished, so the user's
        # np.seterr must not make them a warning or a FloatingPointError (on every rank).
        with np.errstate(all="ignore"):
            total = float(arr.sum())
        if math.isfinite(total):
            return
    info = _KEY_INFO.get(dt)
    if info is not None:
        it, inf_bits, nan_bits = info
        u = arr.view(it)
        maxpos = it.type(np.iinfo(it).max)
        nan = (u & maxpos) > it.type(inf_bits)
        xp.copyto(u, it.type(nan_bits), where=nan)
    elif dt.kind == "f":  # long double: no integer of its width
        xp.copyto(arr, dt.type("nan"), where=xp.isnan(arr))


def _float_maxmin(
    xp: ModuleType, op: str, dst: XpArray, src: XpArray, first: XpArray | None = None
) -> None:
    it = _KEY_INFO[dst.dtype][0]
    a = dst if first is None else first
    kd = to_keys(xp, a.view(it).copy().view(dst.dtype), op)
    ks = to_keys(xp, src.view(it).copy().view(src.dtype), op)
    (xp.maximum if op == "max" else xp.minimum)(kd, ks, out=kd)
    dst.view(it)[...] = from_keys(xp, kd, dst.dtype, op).view(it)


def _wide_maxmin(xp: ModuleType, op: str, dst: XpArray, src: XpArray) -> None:
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


def reduce_with(xp: ModuleType, op: str, dst: XpArray, src: XpArray) -> None:
    """``dst = op(dst, src)`` element-wise, in place, with the semantics in the module
    docstring (shared by NumPy and CuPy, whose APIs agree on what is used here)."""
    dt = dst.dtype
    if op in _ARITH:
        fn = getattr(xp, _ARITH[op])
        if dt in LOW_PRECISION:
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


def reduce_into(xp: ModuleType, op: str, out: XpArray, a: XpArray, b: XpArray) -> None:
    """``out = op(a, b)`` element-wise: the bits :func:`reduce_with` gives for ``out``
    holding ``a`` (the same operands in the same order), without first copying ``a`` into
    ``out``. ``out`` may be ``a`` or ``b`` itself; it must not overlap either otherwise."""
    dt = out.dtype
    if op in _ARITH:
        fn = getattr(xp, _ARITH[op])
        if dt in LOW_PRECISION:
            f = a.astype(xp.float32)
            fn(f, b.astype(xp.float32), out=f)
            out[...] = f.astype(dt)
        else:
            fn(a, b, out=out)
    elif (op == "max" or op == "min") and dt.kind in "iu":
        (xp.maximum if op == "max" else xp.minimum)(a, b, out=out)
    elif (op == "max" or op == "min") and dt in _KEY_INFO:
        _float_maxmin(xp, op, out, b, first=a)
    elif op in _LOGICAL:
        out[...] = getattr(xp, _LOGICAL[op])(a, b)
    elif op in _BITWISE:
        getattr(xp, _BITWISE[op])(a, b, out=out)
    else:  # long double max/min (and the error for an unknown op)
        first = a.copy()
        reduce_with(xp, op, first, b)
        xp.copyto(out, first)


def reduce_rows(xp: ModuleType, op: str, out: XpArray, rows: Sequence[XpArray]) -> None:
    """``out = op(...op(op(rows[0], rows[1]), rows[2])..., rows[-1])`` element-wise: the
    rows reduced in their order (rank order), so that every rank that reduces the same
    rows holds the same bits.

    The one rank-order reduction of the Python paths: the argument check's gathered data
    (:func:`optcc_mpi.check.protocol.reduce_gathered`) and every rank's rows gathered
    through host memory (:mod:`optcc_mpi.collectives`). The compiled path's sum
    (``check/_fastcall.c``) and the board's reduce-scatter
    (:meth:`optcc_mpi.transports.board.Board.allreduce`) do the same, held to these bits
    by tests/test_reduction_order.py.

    As the library's AllReduce, an overflow is the result, not a warning: a warning the
    user's ``np.seterr`` made an error would be raised by a finished reduction.

    Parameters
    ----------
    xp : module
        The array module (NumPy or CuPy).
    op : str
        The reduction (:data:`optcc_mpi.dtypes.OPS`).
    out : array
        Where the result goes; it must not overlap any row.
    rows : sequence of arrays
        One per rank, in rank order, each the size and type of ``out`` (at least one).
    """
    if len(rows) == 1:
        xp.copyto(out, rows[0])
        return
    with np.errstate(all="ignore"):
        reduce_into(xp, op, out, rows[0], rows[1])
        for row in rows[2:]:
            reduce_with(xp, op, out, row)


class TorchOps:
    """The rules above for PyTorch tensors, computed by torch on the tensors' own device.

    The same keys, the same NaN rule, the same float32 rounding of 16-bit floats, so a
    tensor reduced here gives the bits NumPy gives for the same inputs.

    Parameters
    ----------
    torch : module
        The ``torch`` module (passed in: this module never imports PyTorch).
    """

    def __init__(self, torch: ModuleType) -> None:
        self.torch = torch
        t = torch
        # float dtype: (integer dtype of the same width, bits of +inf, bits of canonical NaN)
        self._keys = {
            t.float16: (t.int16, 0x7C00, 0x7E00),
            t.bfloat16: (t.int16, 0x7F80, 0x7FC0),
            t.float32: (t.int32, 0x7F800000, 0x7FC00000),
            t.float64: (t.int64, 0x7FF0000000000000, 0x7FF8000000000000),
        }
        self._low = (t.float16, t.bfloat16)

    def key_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """The integer dtype :meth:`to_keys` maps ``dtype`` to, or None."""
        info = self._keys.get(dtype)
        return None if info is None else info[0]

    def _consts(self, dtype: torch.dtype, op: str) -> tuple[torch.dtype, int, int, int, int, int]:
        it, inf_bits, nan_bits = self._keys[dtype]
        info = self.torch.iinfo(it)
        sentinel = info.max if op == "max" else info.min
        return it, info.max, inf_bits, nan_bits, info.bits - 1, sentinel

    def to_keys(self, arr: torch.Tensor, op: str, src: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`to_keys` for a tensor, in place (or from ``src``); returns the integer
        view."""
        it, maxpos, inf_bits, _nan, shift, sentinel = self._consts(arr.dtype, op)
        u = arr.view(it)
        s = u if src is None else src.view(it)
        nan = (s & maxpos) > inf_bits
        t = s >> shift  # arithmetic: all ones for negative numbers
        t &= maxpos
        self.torch.bitwise_xor(s, t, out=u)
        u.masked_fill_(nan, sentinel)
        return u

    def from_keys(self, keys: torch.Tensor, dtype: torch.dtype, op: str) -> torch.Tensor:
        """:func:`from_keys` for a tensor, in place; returns the float view."""
        _it, maxpos, _inf, nan_bits, shift, sentinel = self._consts(dtype, op)
        nan = keys == sentinel
        t = keys >> shift
        t &= maxpos
        keys ^= t
        keys.masked_fill_(nan, nan_bits)  # every canonical NaN pattern is positive
        return keys.view(dtype)

    def canonical_nans(self, arr: torch.Tensor) -> None:
        """:func:`canonical_nans` for a tensor, in place."""
        if arr.is_complex():
            arr = self.torch.view_as_real(arr)
        info = self._keys.get(arr.dtype)
        if info is None:
            return
        it, inf_bits, nan_bits = info
        u = arr.view(it)
        maxpos = self.torch.iinfo(it).max
        u.masked_fill_((u & maxpos) > inf_bits, nan_bits)

    def reduce(self, op: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst = op(dst, src)`` element-wise, in place, with this module's rules."""
        torch = self.torch
        if op == "sum" or op == "prod":
            if dst.dtype in self._low:
                a = dst.float()
                (a.add_ if op == "sum" else a.mul_)(src.float())
                dst.copy_(a)  # round to nearest even, as ml_dtypes and NumPy do
            elif op == "sum" and dst.is_complex():
                # torch adds complex tensors as dst + alpha * src, and the product with
                # alpha = 1 + 0j turns an infinite part into NaN (inf * 0) and -0.0 into
                # +0.0: add the real and imaginary parts as the floats they are.
                torch.view_as_real(dst).add_(torch.view_as_real(src))
            elif op == "sum":
                dst.add_(src)
            else:
                dst.mul_(src)
        elif op == "max" or op == "min":
            pick = torch.maximum if op == "max" else torch.minimum
            if dst.dtype in self._keys:
                it = self._keys[dst.dtype][0]
                kd = self.to_keys(dst.view(it).clone().view(dst.dtype), op)
                ks = self.to_keys(src.view(it).clone().view(src.dtype), op)
                pick(kd, ks, out=kd)
                dst.view(it).copy_(self.from_keys(kd, dst.dtype, op).view(it))
            else:
                pick(dst, src, out=dst)
        elif op in _LOGICAL:
            dst.copy_(getattr(torch, _LOGICAL[op])(dst, src))  # 0 or 1 in dst's type
        elif op in _BITWISE:
            getattr(torch, _BITWISE[op])(dst, src, out=dst)
        else:
            raise ArgumentError(f"unsupported op {op!r}; supported: {', '.join(OPS)}")

    def reduce_into(self, op: str, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """``out = op(a, b)``: the bits of :meth:`reduce` on ``out`` holding ``a``,
        without the copy; ``out`` may be ``a`` or ``b`` (:func:`reduce_into`)."""
        torch = self.torch
        if op == "sum" or op == "prod":
            if out.dtype in self._low:
                f = a.float()
                (f.add_ if op == "sum" else f.mul_)(b.float())
                out.copy_(f)
            elif op == "sum" and out.is_complex():
                real = torch.view_as_real
                torch.add(real(a), real(b), out=real(out))
            else:
                (torch.add if op == "sum" else torch.mul)(a, b, out=out)
        elif (op == "max" or op == "min") and out.dtype not in self._keys:
            (torch.maximum if op == "max" else torch.minimum)(a, b, out=out)
        elif op in _BITWISE:
            getattr(torch, _BITWISE[op])(a, b, out=out)
        else:  # float max/min (through the keys), logical: as reduce, on a copy
            first = a.clone()
            self.reduce(op, first, b)
            out.copy_(first)
