"""What tests of code built on optcc_mpi need, and the algorithm contract anyone can run.

One topic per module, the public names re-exported here:

:mod:`optcc_mpi.testing.contract`
    The contract every registered AllReduce algorithm meets: :func:`check_algorithm` runs
    it on one algorithm by name (this package's or one registered by another package
    through the entry-point group ``optcc_mpi.algorithms``); :data:`CHECKS` lists the
    checks, :func:`profiles` the link profiles they use.
:mod:`optcc_mpi.testing.parametrize`
    :func:`parametrize_with_checks`: the contract as pytest tests, one per (algorithm,
    check). It imports pytest, so it is loaded only when that name is asked for.
:mod:`optcc_mpi.testing.local`
    :class:`~optcc_mpi.testing.local.LocalWorld`: ranks as threads of one process, over a
    transport of the four required methods (``docs/transports.md``): every collective
    runs over it without MPI or a process group.
:mod:`optcc_mpi.testing.fake_device`
    A fake device array and its ArrayOps (:func:`device_array`, :data:`FAKE_DEVICE`), so the
    GPU code paths run, and are checked for missing stream synchronisation, without a
    GPU. Importing this package registers that array library; it owns only its own arrays.
:mod:`optcc_mpi.testing.fake_streams`
    Recording fakes of device streams and events (:class:`FakeStreams`), so the stream
    protocol of :mod:`optcc_mpi.torch.streams` (side streams, completion events, a wait that
    leaves the host free) is checked in order without a GPU.

Examples
--------
A package registering the algorithm ``myring`` tests it with::

    from optcc_mpi.testing import parametrize_with_checks

    @parametrize_with_checks(["myring"])
    def test_contract(algorithm, check):
        check(algorithm)

or, outside pytest, ``check_algorithm("myring")`` (with ``comm=MPI.COMM_WORLD`` under
``mpiexec`` for the MPI check).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from optcc_mpi.testing.contract import (
    CHECKS,
    COST_RANKS,
    COST_TOLERANCE,
    VERIFY_RANKS,
    Check,
    ContractError,
    Outcome,
    check_algorithm,
    cost_profiles,
    mpi_counts,
    profiles,
    select_checks,
    verify_counts,
)
from optcc_mpi.testing.fake_device import (
    FAKE_DEVICE,
    FakeDeviceArrayOps,
    HostDeviceArray,
    UnsynchronizedError,
    device_array,
)
from optcc_mpi.testing.fake_streams import FakeStreams, FakeTensor

__all__ = [
    "CHECKS",
    "COST_RANKS",
    "COST_TOLERANCE",
    "VERIFY_RANKS",
    "Check",
    "ContractError",
    "Outcome",
    "check_algorithm",
    "cost_profiles",
    "mpi_counts",
    "parametrize_with_checks",
    "profiles",
    "select_checks",
    "verify_counts",
    "FAKE_DEVICE",
    "FakeDeviceArrayOps",
    "HostDeviceArray",
    "UnsynchronizedError",
    "device_array",
    "FakeStreams",
    "FakeTensor",
]


if TYPE_CHECKING:  # imported on first use (below): it needs pytest
    from optcc_mpi.testing.parametrize import parametrize_with_checks


def __getattr__(name: str) -> object:
    # pytest is a test-time dependency, not the package's: the pytest face is imported
    # when asked for, so check_algorithm and the fake device work where pytest is absent.
    if name == "parametrize_with_checks":
        from optcc_mpi.testing.parametrize import parametrize_with_checks

        return parametrize_with_checks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
