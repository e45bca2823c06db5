"""Measuring a GLM run as the benchmark and the projection do: per-rank CPU time between
AllReduces, the critical path, time to a target loss.

Two clocks are reported for every run of ours (:mod:`optcc_mpi.lab.glm_bench`):

* **wall**: the run itself, the network emulated by the pacer of
  :meth:`optcc_mpi.emulation.Pacer.hold` (sleeps to a deadline, so waiting ranks leave the
  cores to computing ranks);
* **critical path** (:func:`critical_path_times`): the sum over AllReduces of the slowest
  rank's *CPU* time between AllReduces plus the modelled time of each AllReduce (the one
  model of the library's AllReduce, :func:`optcc_mpi.model.library_allreduce`). CPU
  time does not grow when ranks share cores (8 ranks on 2 cores, other jobs on the
  machine), so this is the time the same code would take with one core per rank and the
  modelled network. Loss evaluations are excluded from both.

:class:`CallRecorder` is the AllReduce that records those CPU times.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..collectives import allreduce
from ..model import library_allreduce

__all__ = ["CallRecorder", "bw_text", "critical_path_times", "thread_limiter", "time_to_target"]


class CallRecorder:
    """An AllReduce callable for :func:`optcc_mpi.glm.fit` that records per-rank CPU time.

    It reduces with the library's own AllReduce through :func:`optcc_mpi.allreduce`
    (``algorithm="native"``, as the trainer's default does; over MPI or a
    torch.distributed group, NumPy arrays or tensors) and notes this thread's CPU time
    when each call starts and ends; :meth:`mark` (passed as ``on_record``) notes when a
    loss evaluation ended, so the evaluation's CPU time is left out of the compute
    segments.
    """

    __name__ = "native"

    def __init__(self, p: int, latency: float, bw: float | None) -> None:
        self.p, self.latency, self.bw = p, latency, bw
        self.segments: list[float] = []  # CPU seconds before each call since the last event
        self.costs: list[float] = []  # alpha-beta charge of each call
        self.records: list[int] = []  # calls done at each loss record
        self._last = time.thread_time()

    def __call__(self, buf: Any, comm: Any) -> None:
        now = time.thread_time()
        self.segments.append(now - self._last)
        nbytes = int(buf.nbytes)
        self.costs.append(library_allreduce(self.p, nbytes, self.bw, latency=self.latency))
        if self.p > 1:
            # Paced by the trainer's pacer (or not at all): "" keeps $OPTCC_EMULATE out.
            allreduce(None, buf, op="sum", comm=comm, algorithm="native", emulate="",
                      check=False)  # fmt: skip
        self._last = time.thread_time()

    def mark(self, record: dict[str, Any]) -> None:
        """``on_record`` hook: a loss evaluation just ended."""
        self.records.append(len(self.segments))
        self._last = time.thread_time()


def critical_path_times(
    segments: np.ndarray, costs: Sequence[float], records: Sequence[int]
) -> list[float]:
    """Critical-path time at each loss record.

    Parameters
    ----------
    segments : ndarray, shape (P, calls)
        Each rank's CPU seconds before each AllReduce.
    costs : sequence of float
        Alpha-beta charge of each AllReduce.
    records : sequence of int
        AllReduces completed at each loss record.

    Returns
    -------
    list of float
        ``sum_{i < c} (max_p segments[p, i] + costs[i])`` for each record's ``c``.
    """
    per_call = np.max(np.atleast_2d(segments), axis=0) + np.asarray(costs, dtype=np.float64)
    cum = np.concatenate([[0.0], np.cumsum(per_call)])
    return [float(cum[c]) for c in records]


def time_to_target(times: Sequence[float], losses: Sequence[float], target: float) -> Any:
    """The first of ``times`` whose loss is at most ``target``; None if none is."""
    for t, loss in zip(times, losses, strict=True):
        if loss <= target:
            return t
    return None


def thread_limiter(size: int) -> Any:
    """One BLAS thread per rank while the block runs, when ``size`` ranks share the cores
    (more threads only fight); a no-op without threadpoolctl or on one rank."""
    try:
        from threadpoolctl import threadpool_limits  # optional: comes with scikit-learn
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1) if size > 1 else contextlib.nullcontext()


def bw_text(bw: float | None) -> str:
    """A bandwidth in bytes/s for tables and legends: ``25GB/s``, or ``inf`` for None."""
    return "inf" if not bw else f"{bw / 1e9:g}GB/s"
