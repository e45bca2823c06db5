"""The mpi4py face: :class:`Comm`, a communicator whose ``Allreduce`` is ours.

``optcc_mpi.Comm(MPI.COMM_WORLD)`` wraps a communicator: its ``Allreduce(sendbuf, recvbuf,
op=MPI.SUM)`` has mpi4py's signature and semantics and runs :func:`optcc_mpi.allreduce`
with the wrapper's ``algorithm`` and ``links``; every other attribute is the wrapped
communicator's, so an existing code changes one line::

    comm = optcc_mpi.Comm(MPI.COMM_WORLD, algorithm="auto", links="probe")
    comm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)    # ours
    comm.Bcast(weights, root=0)                        # mpi4py's

What is cached per communicator is :mod:`optcc_mpi.check.state`'s; the MPI side of it (the
private duplicate, ``$OPTCC_LINKS`` translated through the groups) is
:mod:`optcc_mpi.transports.mpi`'s.
"""

from __future__ import annotations

import enum
from typing import Any

from mpi4py import MPI

from optcc_mpi.collectives import allreduce
from optcc_mpi.emulation import Emulation
from optcc_mpi.errors import ArgumentError
from optcc_mpi.links import Links
from optcc_mpi.schedule import Params
from optcc_mpi.transports.mpi import check_comm

__all__ = ["Comm"]


class _Unset(enum.Enum):
    """A setting not given to :class:`Comm` (then copied from the wrapped one)."""

    UNSET = 0


_UNSET = _Unset.UNSET


class Comm(MPI.Intracomm):
    """An mpi4py intracommunicator whose ``Allreduce`` is ours (module docstring).

    A subclass of ``mpi4py.MPI.Intracomm`` sharing the wrapped communicator's handle: it
    *is* that communicator for every other method and for any code that takes an mpi4py
    communicator. ``Dup`` and ``Create``-style methods that mpi4py makes of the same class
    give wrappers with the default settings.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        The communicator to wrap (default ``COMM_WORLD``). Wrapping a :class:`Comm` copies
        its settings unless given here.
    algorithm : str
        What ``Allreduce`` runs: ``"auto"`` (default) or a registered algorithm.
    links : Links or str, optional
        Link profile for ``Allreduce`` in ranks of ``comm``, or ``"probe"``; default
        ``$OPTCC_LINKS`` (ranks of COMM_WORLD, translated).
    emulate, params, check
        As for :func:`optcc_mpi.allreduce`.

    Examples
    --------
    >>> from mpi4py import MPI
    >>> comm = Comm(MPI.COMM_WORLD, links="0:0.5")  # doctest: +SKIP
    >>> comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)  # doctest: +SKIP
    """

    algorithm: str = "auto"
    links: Links | str | None = None
    emulate: Emulation | str | None = None
    params: Params | None = None
    check: bool = True

    def __new__(cls, comm: MPI.Comm | None = None, **settings: object) -> Comm:
        # mpi4py's constructor takes only the communicator.
        return super().__new__(cls, check_comm(comm))

    def __init__(
        self,
        comm: MPI.Comm | None = None,
        *,
        algorithm: str | _Unset = _UNSET,
        links: Links | str | None | _Unset = _UNSET,
        emulate: Emulation | str | None | _Unset = _UNSET,
        params: Params | None | _Unset = _UNSET,
        check: bool | _Unset = _UNSET,
    ) -> None:
        given: dict[str, object] = {
            "algorithm": algorithm,
            "links": links,
            "emulate": emulate,
            "params": params,
            "check": check,
        }
        for name, value in given.items():
            if value is _UNSET:
                value = getattr(comm, name) if isinstance(comm, Comm) else getattr(Comm, name)
            setattr(self, name, value)

    def Allreduce(  # noqa: N802
        self, sendbuf: Any, recvbuf: Any, op: MPI.Op | str | None = None
    ) -> None:  # (buffers: a user's, classified by allreduce)
        """mpi4py's ``Comm.Allreduce``: reduce ``sendbuf`` of every rank into ``recvbuf``.

        ``sendbuf`` may be ``MPI.IN_PLACE`` or None (reduce ``recvbuf`` in place), as may
        ``sendbuf is recvbuf``; buffers are anything mpi4py accepts there (arrays, objects
        with the buffer protocol, ``[buf, MPI.DOUBLE]``, ``[buf, count, MPI.DOUBLE]``)
        plus PyTorch tensors; ``op`` an ``MPI.Op`` (default ``MPI.SUM``) or a name.
        Returns None, as mpi4py does.
        """
        if recvbuf is None:
            raise ArgumentError("Allreduce needs a recvbuf (as in mpi4py)")
        allreduce(
            sendbuf,
            recvbuf,
            op="sum" if op is None else op,
            comm=self,
            algorithm=self.algorithm,
            links=self.links,
            emulate=self.emulate,
            params=self.params,
            check=self.check,
        )

    def __repr__(self) -> str:
        return (
            f"<optcc_mpi.Comm size={self.Get_size()} algorithm={self.algorithm!r} "
            f"links={self.links!r}>"
        )
