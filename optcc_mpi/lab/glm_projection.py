"""The GLM projection: time per SGD step at larger P, from compute measured on this machine
and a modelled AllReduce (a projection, not a measurement).

:func:`run_projection` times one rank's compute between AllReduces (:func:`measure_compute`,
the real trainer on one process) for the column block a rank would hold at each P, and
:func:`project` adds the modelled time of each AllReduce (the one model of the library's
AllReduce, :func:`optcc_mpi.model.library_allreduce`).
:func:`optcc_mpi.lab.glm_plots.plot_projection` draws the result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import glm
from ..model import library_allreduce
from .glm_measure import CallRecorder, thread_limiter

__all__ = ["Projection", "measure_compute", "project", "run_projection"]


@dataclass
class Projection:
    """Projected time per SGD step at each P (a projection, not a measurement).

    Attributes
    ----------
    p_values : list of int
    latency, bw : float
    baseline_s : float
        fp32 SGD on one rank (all ``n`` columns, no communication), per step.
    per_step : dict
        ``label -> list of seconds per SGD step`` at each P.
    speedup : dict
        ``label -> baseline_s / per_step`` at each P.
    """

    p_values: list[int]
    latency: float
    bw: float | None
    baseline_s: float
    per_step: dict[str, list[float]] = field(default_factory=dict)
    speedup: dict[str, list[float]] = field(default_factory=dict)


def project(
    p_values: Sequence[int],
    compute: dict[str, dict[int, float]],
    nbytes: dict[str, int],
    steps_per_call: dict[str, int],
    baseline_s: float,
    latency: float,
    bw: float | None,
) -> Projection:
    """Projected time per SGD step: measured compute plus the modelled AllReduce.

    For each solver label ``k`` and each ``P``::

        t_k(P) = (compute[k][P] + library_allreduce(P, nbytes[k], bw, latency=latency))
                 / steps_per_call[k]

    and the speedup is ``baseline_s / t_k(P)`` (strong scaling: the same problem, the
    columns split over P ranks; the same number of steps to the target loss, which holds
    exactly for fp32 CA-SGD and within the measured loss gap for the recipes).

    Parameters
    ----------
    p_values : sequence of int
    compute : dict
        ``label -> {P: CPU seconds of one rank between two AllReduces}``.
    nbytes : dict
        ``label -> bytes of each AllReduce``.
    steps_per_call : dict
        ``label -> SGD steps per AllReduce`` (1 for SGD, s for CA-SGD).
    baseline_s : float
        Seconds per step of the one-rank reference.
    latency, bw
        The network (see :func:`optcc_mpi.model.library_allreduce`).
    """
    proj = Projection(list(p_values), latency, bw, baseline_s)
    for label, by_p in compute.items():
        times = []
        for p in p_values:
            cost = library_allreduce(p, nbytes[label], bw, latency=latency)
            times.append((by_p[p] + cost) / steps_per_call[label])
        proj.per_step[label] = times
        proj.speedup[label] = [baseline_s / t for t in times]
    return proj


def measure_compute(
    model: str,
    m: int,
    n_local: int,
    solver: str,
    *,
    s: int = 1,
    recipe: str = "fp32",
    b: int = 32,
    lr: float = 0.5,
    seed: int = 0,
    calls: int = 32,
) -> tuple[float, int]:
    """CPU seconds per AllReduce interval of one rank holding ``n_local`` columns.

    Runs the real trainer on one process (MPI's ``COMM_SELF``) over an ``(m, n_local)``
    block with a recording AllReduce; returns the median compute interval and the
    AllReduce payload in bytes.
    """
    X, y = glm.make_glm_data(model, min(m, calls * s * b), n_local, seed=seed)
    rec = CallRecorder(1, 0.0, None)
    sent: list[int] = []

    def reduce(buf: np.ndarray, comm: Any) -> None:
        sent.append(buf.nbytes)
        rec(buf, comm)

    reduce.__name__ = "recorder"
    glm.fit(
        X,
        y,
        model=model,
        solver=solver,
        s=s,
        recipe=recipe,
        b=b,
        lr=lr,
        max_iter=1,
        tol=None,
        seed=seed,
        comm=_comm_self(),
        allreduce=reduce,
        on_record=rec.mark,
        divergence_factor=None,
    )
    # The first interval holds one-off setup; the median of the rest is robust to load.
    segs = rec.segments[1:] or rec.segments
    return float(np.median(segs)), int(np.median(sent))


def _comm_self() -> Any:
    from mpi4py import MPI  # the projection times one process as an MPI rank would run

    return MPI.COMM_SELF


def run_projection(
    model: str,
    n: int,
    b: int,
    s_values: Sequence[int],
    recipe: str,
    p_values: Sequence[int],
    networks: Sequence[tuple[float, float | None]],
    *,
    lr: float = 0.5,
    seed: int = 0,
    calls: int = 16,
    progress: Any = None,
) -> tuple[list[Projection], dict[str, Any]]:
    """Measure per-rank compute at each P (columns ``ceil(n / P)``) and project.

    One BLAS thread, as each rank of a real run would have one core. Returns the
    projections (one per network) and the measured inputs.
    """
    with thread_limiter(2):
        return _run_projection(
            model, n, b, s_values, recipe, p_values, networks, lr, seed, calls, progress
        )


def _run_projection(
    model: str,
    n: int,
    b: int,
    s_values: Sequence[int],
    recipe: str,
    p_values: Sequence[int],
    networks: Sequence[tuple[float, float | None]],
    lr: float,
    seed: int,
    calls: int,
    progress: Any,
) -> tuple[list[Projection], dict[str, Any]]:
    say = progress or (lambda msg: None)
    m_time = calls * max(s_values) * b
    compute: dict[str, dict[int, float]] = {"sgd": {}}
    nbytes: dict[str, int] = {}
    steps: dict[str, int] = {"sgd": 1}
    say(f"one rank, all {n} columns (fp32 SGD baseline)")
    baseline, _ = measure_compute(model, m_time, n, "sgd", b=b, lr=lr, seed=seed, calls=calls)
    for p in p_values:
        n_loc = max(1, math.ceil(n / p))
        say(f"P = {p}: {n_loc} columns per rank")
        compute["sgd"][p], nbytes["sgd"] = measure_compute(
            model, m_time, n_loc, "sgd", b=b, lr=lr, seed=seed, calls=calls
        )
        for s in s_values:
            label = f"casgd {recipe} s={s}"
            compute.setdefault(label, {})[p], nbytes[label] = measure_compute(
                model, m_time, n_loc, "casgd", s=s, recipe=recipe, b=b, lr=lr, seed=seed,
                calls=calls,
            )  # fmt: skip
            steps[label] = s
    projections = [
        project(p_values, compute, nbytes, steps, baseline, lat, bw) for lat, bw in networks
    ]
    inputs = {
        "baseline_s_per_step": baseline,
        "compute_s_per_call": compute,
        "bytes_per_call": nbytes,
        "steps_per_call": steps,
        "calls_timed": calls,
        "clock": "thread CPU time, median over calls, one BLAS thread",
    }
    return projections, inputs
