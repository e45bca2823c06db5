"""Array libraries the collective tests run over (written once, run for each).

Each entry turns a NumPy array into the library's array and back. The fake device array
exercises the GPU code paths on any machine: CUDA-aware (device buffers straight to MPI)
and staged (through host copies), with a checked stream. CuPy joins when a GPU is usable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from optcc_mpi import testing
from optcc_mpi.arrays import cupy_status
from optcc_mpi.arrays import instance as _instance


@dataclass(frozen=True)
class ArrayKind:
    name: str
    make: Callable[[np.ndarray], Any]
    host: Callable[[Any], np.ndarray]
    setup: Callable[[], None] = lambda: None


def _fake(aware: bool) -> ArrayKind:
    def setup() -> None:
        be = _instance(testing.FAKE_DEVICE)
        be.cuda_aware = aware
        be.queued = 0

    return ArrayKind(
        name=f"fake-device-{'aware' if aware else 'staged'}",
        make=testing.device_array,
        host=lambda a: a.get(),
        setup=setup,
    )


KINDS: list[ArrayKind] = [
    ArrayKind("numpy", lambda a: np.array(a, copy=True), lambda a: np.asarray(a)),
    _fake(True),
    _fake(False),
]

if cupy_status().get("available"):  # pragma: no cover - needs a GPU
    import cupy

    KINDS.append(ArrayKind("cupy", cupy.asarray, cupy.asnumpy))

KIND_IDS = [k.name for k in KINDS]
