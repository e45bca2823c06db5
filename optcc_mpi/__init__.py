"""optcc_mpi: fault-tolerant AllReduce over MPI, and communication-avoiding SGD.

Collectives
-----------
``allreduce(sendbuf, recvbuf=None, *, op="sum", comm=None, algorithm="auto", links=None)``
    AllReduce of NumPy or CuPy arrays, PyTorch tensors, buffers or mpi4py buffer
    specifications, with every MPI element type and reduction, a choice of algorithms
    (``ring``, ``optcc``, ``r2ccl``, ``native``, ``auto``) and a link profile naming
    degraded ranks; ``docs/api.md``.
``Links``
    Per-rank NIC bandwidth as fractions of the healthy rate (``"0:0.5"``).
``IN_PLACE``
    Pass as ``sendbuf`` to reduce ``recvbuf`` in place (as in mpi4py).
``Comm``
    ``Comm(MPI.COMM_WORLD)``: an mpi4py communicator whose ``Allreduce`` is ours.
``last_stats()``
    What the last ``allreduce`` of this process did: ``last_stats()["algorithm"]`` is the
    algorithm that ran (also under torch.distributed's ``"optcc"`` backend).

Modules
-------
``schedule``   the schedule representation shared by every algorithm and reader
``algorithms`` one module per algorithm, each a pure function returning a schedule
``comm``       the per-communicator cache and the mpi4py-style ``Comm``
``executor``   runs a schedule with nonblocking mpi4py point-to-point calls
``simulate``   times a schedule under a link model by discrete events
``verify``     proves a schedule correct and deadlock-free, symbolically
``model``      closed-form times and the lower bound
``arrays``     NumPy / CuPy arrays and torch tensors behind one interface
``glm``        mixed-precision CA-SGD for generalized linear models
``data``       HDF5 datasets, partitioned loading, converters
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names and the module that defines each. Resolved on first access so that
# ``import optcc_mpi`` stays cheap and does not initialise MPI by itself.
_EXPORTS = {
    "OptccError": "optcc_mpi.errors",
    "allreduce": "optcc_mpi.collectives",
    "IN_PLACE": "optcc_mpi.collectives",
    "Comm": "optcc_mpi.comm",
    "ALGORITHMS": "optcc_mpi.collectives",
    "last_stats": "optcc_mpi.collectives",
    "Links": "optcc_mpi.links",
    "Emulation": "optcc_mpi.emulation",
}

__all__ = ["__version__", *_EXPORTS]


# Left open: each name is a different kind of object (a function, classes, a marker); naming
# their types here would import the layers above this one (tests/test_architecture.py).
def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'optcc_mpi' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
