"""The trainer's communication: a pluggable, counted, timed AllReduce and error agreement.

:class:`Reducer` wraps whichever AllReduce the user chose:

* ``"mpi"``: the MPI library's ``MPI_Allreduce``. 16-bit payloads travel as 2-byte words
  reduced by the user-defined operation of :func:`optcc_mpi.backend.mpi_datatype_and_op`,
  which adds in float32 and rounds each partial sum back to the payload format, as NCCL
  does for a bf16 AllReduce;
* an :func:`optcc_mpi.allreduce` algorithm (``ring``, ``optcc``, ``r2ccl``, ``native``,
  ``auto``), called with the user's ``links`` and ``emulate`` settings;
* a callable ``f(buf, comm) -> None`` that reduces ``buf`` in place.

Every call is counted (calls, payload bytes) and timed, which is where the trainer's
communication time comes from.

Latency emulation for ``"mpi"`` and callables (ours; the ``optcc_mpi.allreduce``
algorithms pace each of their messages instead): with an
:class:`~optcc_mpi.emulation.Emulation` (or ``$OPTCC_EMULATE``), every rank waits
``ceil(log2 P) * (latency + nbytes / bw)`` before each AllReduce, the critical path of a
recursive-doubling AllReduce in the alpha-beta model. Waits use ``time.sleep`` for the
bulk and spin for the last stretch, because a plain sleep on Linux overshoots by about
0.1 ms, more than the latencies being emulated.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from ..backend import mpi_datatype_and_op
from ..emulation import Emulation

__all__ = ["Reducer", "agree", "checksum"]


def _pause(seconds: float, sleep_overshoot: float) -> None:
    """Wait ``seconds``: sleep for what a sleep cannot overshoot, spin for the rest."""
    end = time.perf_counter() + seconds
    if seconds > sleep_overshoot:
        time.sleep(seconds - sleep_overshoot)
    while time.perf_counter() < end:
        pass


def _measure_sleep_overshoot() -> float:
    worst = 0.0
    for _ in range(5):
        t = time.perf_counter()
        time.sleep(1e-5)
        worst = max(worst, time.perf_counter() - t - 1e-5)
    return min(worst, 2e-3)


class Reducer:
    """A counted, timed, pluggable in-place SUM AllReduce.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        The communicator of the ranks that hold the column blocks.
    allreduce : str or callable
        ``"mpi"``, an ``optcc_mpi.allreduce`` algorithm name, or ``f(buf, comm) -> None``.
    links : object, optional
        Link profile passed to ``optcc_mpi.allreduce`` (``Links`` or its string form).
    emulate : Emulation or str, optional
        Network emulation (``"latency=50us"``; None: ``$OPTCC_EMULATE`` if set). Passed
        to ``optcc_mpi.allreduce``; for ``"mpi"`` and callables it is emulated here.

    Attributes
    ----------
    calls, nbytes : int
        AllReduce calls made and payload bytes reduced.
    seconds : float
        Wall time spent inside the calls (emulated latency included).
    emulated_seconds : float
        Part of ``seconds`` spent waiting for emulated latency and bandwidth.
    """

    def __init__(
        self,
        comm: MPI.Comm,
        allreduce: str | Callable[[np.ndarray, MPI.Comm], None] = "mpi",
        *,
        links: Any = None,
        emulate: Emulation | str | None = None,
    ) -> None:
        self.comm = comm
        self.links = links
        self.calls = 0
        self.nbytes = 0
        self.seconds = 0.0
        self.emulated_seconds = 0.0
        self._rounds = math.ceil(math.log2(comm.size)) if comm.size > 1 else 0
        if callable(allreduce):
            self.name = getattr(allreduce, "__name__", "callable")
            self._reduce = self._callable(allreduce)
            self._emulate_here = True
        elif str(allreduce).lower() == "mpi":
            self.name = "mpi"
            self._reduce = self._mpi
            self._emulate_here = True
        else:
            self.name = str(allreduce)
            self._reduce = self._optcc(self.name)
            self._emulate_here = False
        if links is not None and self._emulate_here:
            raise ValueError(
                f"a link profile needs an optcc_mpi.allreduce algorithm, not {self.name!r}"
            )
        # The optcc_mpi algorithms read $OPTCC_EMULATE themselves when emulate is None.
        self.emulate = Emulation.coerce(emulate) if self._emulate_here else emulate
        self._latency = self.emulate.latency if self._emulate_here and self.emulate else 0.0
        self._bw = (self.emulate.bw or 0.0) if self._emulate_here and self.emulate else 0.0
        self._emulating = self._latency > 0 or self._bw > 0
        self._overshoot = _measure_sleep_overshoot() if self._emulating else 0.0

    def _callable(self, fn: Callable[[np.ndarray, MPI.Comm], None]) -> Callable:
        def reduce(buf: np.ndarray) -> np.ndarray:
            fn(buf, self.comm)
            return buf

        return reduce

    def _mpi(self, buf: np.ndarray) -> np.ndarray:
        if self.comm.size == 1:
            return buf
        datatype, op = mpi_datatype_and_op(buf.dtype.name, "sum")
        view = buf.view(np.uint16) if buf.dtype.itemsize == 2 else buf
        self.comm.Allreduce(MPI.IN_PLACE, [view, datatype], op)
        return buf

    def _optcc(self, name: str) -> Callable:
        from .. import collectives

        if name not in collectives.ALGORITHMS:
            raise ValueError(
                f"unknown AllReduce algorithm {name!r}; choose 'mpi' or one of "
                f"{', '.join(collectives.ALGORITHMS)}"
            )

        def reduce(buf: np.ndarray) -> np.ndarray:
            # Every rank passes the same size, dtype and settings by construction, so the
            # per-call argument check (one more small collective) is skipped.
            return collectives.allreduce(
                collectives.IN_PLACE,
                buf,
                op="sum",
                comm=self.comm,
                algorithm=name,
                links=self.links,
                emulate=self.emulate,
                check=False,
            )

        return reduce

    def __call__(self, buf: np.ndarray) -> np.ndarray:
        """SUM-reduce ``buf`` (a contiguous 1-D host array) over the communicator."""
        t0 = time.perf_counter()
        if self._emulating and self._rounds:
            wait = self._rounds * (self._latency + (buf.nbytes / self._bw if self._bw > 0 else 0.0))
            _pause(wait, self._overshoot)
            self.emulated_seconds += time.perf_counter() - t0
        out = self._reduce(buf)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.nbytes += buf.nbytes
        return out

    def stats(self) -> dict[str, Any]:
        """Counters as a JSON-ready dict."""
        return {
            "allreduce": self.name,
            "allreduce_calls": self.calls,
            "allreduce_bytes": self.nbytes,
            "comm_s": self.seconds,
            "emulated_wait_s": self.emulated_seconds,
        }


def agree(comm: MPI.Comm, error: str | None, payload: Any = None) -> list[Any]:
    """Share each rank's verdict (and a small payload); raise on every rank if any failed.

    One ``allgather`` of a small Python object, so ranks whose own checks passed do not
    wait forever in the next collective while another rank has bailed out.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        Communicator of all ranks that must agree.
    error : str or None
        This rank's error message, or None.
    payload : object, optional
        Anything small to share at the same time (shapes, checksums).

    Returns
    -------
    list
        Every rank's payload, in rank order.

    Raises
    ------
    ValueError
        On every rank, when at least one rank reported an error. Identical messages from
        several ranks are listed once with their ranks.
    """
    verdicts = comm.allgather((error, payload))
    failed: dict[str, list[int]] = {}
    for rank, (msg, _) in enumerate(verdicts):
        if msg is not None:
            failed.setdefault(msg, []).append(rank)
    if failed:
        if comm.size == 1:
            raise ValueError(next(iter(failed)))
        parts = []
        for msg, ranks in failed.items():
            where = (
                "all ranks"
                if len(ranks) == comm.size
                else "rank" + ("s " if len(ranks) > 1 else " ") + ", ".join(map(str, ranks))
            )
            parts.append(f"{msg} ({where})")
        raise ValueError("; ".join(parts))
    return [p for _, p in verdicts]


def checksum(a: np.ndarray) -> int:
    """CRC-32 of an array's bytes: a cheap check that replicated arrays agree."""
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).ravel())
