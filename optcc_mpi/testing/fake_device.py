"""A fake device array, so the GPU code paths run on machines without a GPU.

:class:`HostDeviceArray` exposes ``__cuda_array_interface__`` over host memory, as a GPU
array would over device memory, and :class:`FakeDeviceArrayOps` treats it as device memory:
every element-wise operation (a copy, or any of the reductions of
:data:`optcc_mpi.dtypes.OPS`) is "queued" on a fake stream, and handing a buffer to MPI
while work is queued raises :class:`UnsynchronizedError`. Tests therefore fail if the
executor ever forgets to synchronise before an MPI call. With the array library's
``cuda_aware`` set to True the array itself goes to mpi4py (through the CUDA array
interface); otherwise data is staged through host copies, exactly as for CuPy.

Importing this module registers the array library (:data:`FAKE_DEVICE`); it owns only
:class:`HostDeviceArray` instances, so no other array is affected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, SupportsIndex

import numpy as np
import numpy.typing as npt

from optcc_mpi.arrays import ArrayOps, register_array_ops
from optcc_mpi.dtypes import NAME_OF
from optcc_mpi.errors import OptccError
from optcc_mpi.reductions import reduce_into, reduce_with

if TYPE_CHECKING:
    from numpy._core.multiarray import flagsobj as _Flags  # the type of ndarray.flags

__all__ = ["HostDeviceArray", "FakeDeviceArrayOps", "UnsynchronizedError", "device_array"]


class UnsynchronizedError(OptccError, AssertionError):
    """A device buffer reached MPI while work on the stream was still queued."""


class HostDeviceArray:
    """A 1-D-or-more array in host memory that presents itself as device memory."""

    def __init__(self, host: np.ndarray) -> None:
        self.host = host

    # The parts of the array API the package uses.
    @property
    def dtype(self) -> np.dtype:
        return self.host.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.host.shape

    @property
    def size(self) -> int:
        return self.host.size

    @property
    def nbytes(self) -> int:
        return self.host.nbytes

    @property
    def flags(self) -> _Flags:
        return self.host.flags

    def reshape(
        self, *shape: SupportsIndex | tuple[SupportsIndex, ...], order: Literal["C", "F", "A"] = "C"
    ) -> HostDeviceArray:
        sizes: list[SupportsIndex] = []  # as NumPy's: the sizes, or one tuple of them
        for s in shape:
            if isinstance(s, tuple):
                sizes.extend(s)
            else:
                sizes.append(s)
        return HostDeviceArray(self.host.reshape(sizes, order=order))

    def ravel(self, order: Literal["K", "A", "C", "F"] = "C") -> HostDeviceArray:
        return HostDeviceArray(self.host.ravel(order=order))

    def view(self, dtype: npt.DTypeLike) -> HostDeviceArray:
        return HostDeviceArray(self.host.view(dtype))

    def __getitem__(self, key: slice | int) -> HostDeviceArray:
        return HostDeviceArray(self.host[key])

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        h = self.host
        return {
            "shape": h.shape,
            "typestr": h.dtype.str if h.dtype.kind != "V" else "|V2",
            "data": (h.ctypes.data, not h.flags.writeable),
            "version": 3,
            "strides": None if h.flags.c_contiguous else h.strides,
        }

    def get(self) -> np.ndarray:
        """Copy to the host (as ``cupy.ndarray.get``)."""
        return self.host.copy()

    def __repr__(self) -> str:
        return f"HostDeviceArray({self.host!r})"


def device_array(values: np.ndarray) -> HostDeviceArray:
    """A fake device array holding a copy of ``values``."""
    return HostDeviceArray(np.array(values, copy=True))


class FakeDeviceArrayOps(ArrayOps[HostDeviceArray, np.dtype]):
    """The operations on :class:`HostDeviceArray`, with a fake, checked stream."""

    name = "fake-device"
    device = True

    def __init__(self) -> None:
        self.queued = 0  # element-wise operations not yet synchronised
        self.syncs = 0
        self.mpi_calls = 0
        self.staged = 0

    def owns(self, arr: object) -> bool:
        return isinstance(arr, HostDeviceArray)

    def empty(self, n: int, dtype: np.dtype) -> HostDeviceArray:
        return HostDeviceArray(np.empty(n, dtype=dtype))

    def empty_like(self, arr: HostDeviceArray) -> HostDeviceArray:
        return HostDeviceArray(np.empty_like(arr.host))

    def copyto(self, dst: HostDeviceArray, src: HostDeviceArray) -> None:
        np.copyto(dst.host, src.host)
        self.queued += 1

    def reduce(self, op: str, dst: HostDeviceArray, src: HostDeviceArray) -> None:
        reduce_with(np, op, dst.host, src.host)
        self.queued += 1

    def reduce_into(
        self, op: str, out: HostDeviceArray, a: HostDeviceArray, b: HostDeviceArray
    ) -> None:
        reduce_into(np, op, out.host, a.host, b.host)
        self.queued += 1

    def synchronize(self) -> None:
        self.queued = 0
        self.syncs += 1

    def _check(self) -> None:
        self.mpi_calls += 1
        if self.queued:
            raise UnsynchronizedError(
                f"device buffer handed to MPI with {self.queued} operation(s) still queued"
            )

    def byte_view(self, arr: HostDeviceArray) -> HostDeviceArray:
        self._check()
        return arr.view(np.uint8)

    def to_host(self, arr: HostDeviceArray) -> np.ndarray:
        self._check()
        self.staged += 1
        return arr.host.copy()

    def from_host(self, dst: HostDeviceArray, host: np.ndarray) -> None:
        np.copyto(dst.host, host)
        self.queued += 1

    def flat(self, arr: HostDeviceArray) -> HostDeviceArray:
        return arr.ravel(order="K")

    def contiguous(self, arr: HostDeviceArray) -> bool:
        flags = arr.flags
        return bool(flags.c_contiguous or flags.f_contiguous)

    def dtype_name(self, arr: HostDeviceArray) -> str | None:
        return NAME_OF.get(arr.dtype)

    def writable(self, arr: HostDeviceArray) -> bool:
        return bool(arr.host.flags.writeable)


#: The registered instance factory (tests reset its counters through it).
FAKE_DEVICE = register_array_ops(FakeDeviceArrayOps)
