"""The GLM benchmark: time to fp32 SGD's loss for SGD, CA-SGD and scikit-learn, measured
under an emulated alpha-beta network, and projected to larger P.

Two clocks are reported for every run of ours:

* **wall**: the run itself, the network emulated by :class:`optcc_mpi.glm.comm.NetworkPacer`
  (sleeps to a deadline, so waiting ranks leave the cores to computing ranks);
* **critical path**: the sum over AllReduces of the slowest rank's *CPU* time between
  AllReduces plus the alpha-beta charge of each AllReduce. CPU time does not grow when
  ranks share cores (8 ranks on 2 cores, other jobs on the machine), so this is the time
  the same code would take with one core per rank and the modelled network. Loss
  evaluations are excluded from both.

The projection (:func:`project`) applies the same alpha-beta cost to per-call compute
times measured on this machine for the column block a rank would hold at each P.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..glm.comm import allreduce_cost

__all__ = [
    "CallRecorder",
    "Projection",
    "critical_path_times",
    "measure_compute",
    "plot_projection",
    "project",
    "run_bench",
    "run_projection",
    "sklearn_baselines",
]


# -- the critical path of a measured run ------------------------------------------------


class CallRecorder:
    """An AllReduce callable for :func:`optcc_mpi.glm.fit` that records per-rank CPU time.

    It reduces with ``MPI_Allreduce`` (16-bit payloads as 2-byte words with the
    widening sum of :func:`optcc_mpi.backend.mpi_datatype_and_op`, as the ``"mpi"``
    choice does) and notes this thread's CPU time when each call starts and ends;
    :meth:`mark` (passed as ``on_record``) notes when a loss evaluation ended, so the
    evaluation's CPU time is left out of the compute segments.
    """

    __name__ = "mpi"

    def __init__(self, p: int, latency: float, bw: float | None) -> None:
        self.p, self.latency, self.bw = p, latency, bw
        self.segments: list[float] = []  # CPU seconds before each call since the last event
        self.costs: list[float] = []  # alpha-beta charge of each call
        self.records: list[int] = []  # calls done at each loss record
        self._last = time.thread_time()

    def __call__(self, buf: np.ndarray, comm: Any) -> None:
        from mpi4py import MPI

        from ..backend import mpi_datatype_and_op

        now = time.thread_time()
        self.segments.append(now - self._last)
        self.costs.append(allreduce_cost(self.p, buf.nbytes, self.latency, self.bw))
        if comm.size > 1:
            datatype, op = mpi_datatype_and_op(buf.dtype.name, "sum")
            view = buf.view(np.uint16) if buf.dtype.itemsize == 2 else buf
            comm.Allreduce(MPI.IN_PLACE, [view, datatype], op)
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


def _time_to_target(times: Sequence[float], losses: Sequence[float], target: float) -> Any:
    for t, loss in zip(times, losses, strict=True):
        if loss <= target:
            return t
    return None


# -- scikit-learn ------------------------------------------------------------------------


def sklearn_baselines(
    model: str,
    X: Any,
    y: Any,
    lam: float,
    lr: float,
    b: int,
    target: float,
    seed: int,
    *,
    lbfgs: bool = True,
    max_epochs: int = 100,
    budget_s: float = 300.0,
) -> list[dict[str, Any]]:
    """Time until scikit-learn on this process reaches ``target`` (fit time only).

    Logistic: ``SGDClassifier(log_loss)`` one epoch at a time (constant step
    ``lr / b`` per sample, our step per mini-batch mean) and ``LogisticRegression(lbfgs)``
    with ``max_iter`` doubled until it reaches the target; linear: ``SGDRegressor``;
    Poisson: ``PoissonRegressor(lbfgs)``. No intercept, same objective.
    """
    from ..glm import get_model

    loss_fn = get_model(model).loss

    def objective(w: Any) -> float:
        return float(np.mean(loss_fn(X.astype(np.float64) @ w, y)) + 0.5 * lam * (w @ w))

    try:
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import (
            LogisticRegression,
            PoissonRegressor,
            SGDClassifier,
            SGDRegressor,
        )
    except ImportError:
        return [{"solver": "sklearn", "error": "scikit-learn is not installed"}]

    def doubling(make: Any, name: str) -> dict[str, Any]:
        elapsed, loss, reached, max_iter = 0.0, float("nan"), None, 1
        while max_iter <= 4096 and elapsed < budget_s:
            est = make(max_iter)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                t0 = time.perf_counter()
                est.fit(X, y)
                elapsed = time.perf_counter() - t0
            loss = objective(est.coef_.ravel().astype(np.float64))
            if loss <= target:
                reached = elapsed
                break
            max_iter *= 2
        return {
            "solver": "sklearn",
            "estimator": name,
            "time_to_target_s": reached,
            "final_loss": loss,
            "max_iter": max_iter,
        }

    out = []
    if model == "poisson":
        out.append(
            doubling(
                lambda k: PoissonRegressor(alpha=lam, fit_intercept=False, max_iter=k, tol=0.0),
                "PoissonRegressor(lbfgs)",
            )
        )
        return out
    common = {
        "penalty": "l2" if lam > 0 else None,
        "alpha": lam,
        "fit_intercept": False,
        "learning_rate": "constant",
        "eta0": lr / b,  # ours: lr times the mean of b gradients, i.e. lr/b per sample
        "random_state": seed,
    }
    if model == "logistic":
        est, name = SGDClassifier(loss="log_loss", **common), "SGDClassifier(log_loss)"
    else:
        est, name = SGDRegressor(loss="squared_error", **common), "SGDRegressor"
    elapsed, epochs, loss, reached = 0.0, 0, float("nan"), None
    while epochs < max_epochs and elapsed < budget_s:
        t0 = time.perf_counter()
        if model == "logistic":
            est.partial_fit(X, y, classes=np.array([0.0, 1.0]))
        else:
            est.partial_fit(X, y)
        elapsed += time.perf_counter() - t0
        epochs += 1
        loss = objective(est.coef_.ravel().astype(np.float64))
        if loss <= target:
            reached = elapsed
            break
    out.append(
        {
            "solver": "sklearn",
            "estimator": name,
            "time_to_target_s": reached,
            "final_loss": loss,
            "epochs": epochs,
        }
    )
    if model == "logistic" and lbfgs:
        # C is the inverse of the summed penalty: sum-loss + ||w||^2 / (2C) = m * ours.
        m = X.shape[0]

        def make(k: int) -> Any:
            if lam > 0:
                return LogisticRegression(C=1.0 / (lam * m), fit_intercept=False, max_iter=k)
            return LogisticRegression(C=np.inf, fit_intercept=False, max_iter=k, tol=0.0)

        out.append(doubling(make, "LogisticRegression(lbfgs)"))
    return out


# -- the measured benchmark ------------------------------------------------------------


def _polite_wait(comm: Any) -> None:
    """Wait for rank 0 without busy-polling, so a rank-0-only job gets the cores."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def _thread_limiter(size: int) -> Any:
    # One BLAS thread per rank: P ranks share the cores, and more threads only fight.
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1) if size > 1 else contextlib.nullcontext()


def run_bench(args: Any, comm: Any, command: str, print_fn: Any = print) -> list[dict[str, Any]]:
    """The measured benchmark of ``optcc-mpi bench-glm`` (see its ``--help``).

    ``args`` carries the command's options, already validated (lists parsed:
    ``s_values``, ``recipes``, ``latencies``, ``bws``). Returns the rows (rank 0; other
    ranks return them too, without the scikit-learn rows).
    """
    from .. import glm
    from ..emulation import Emulation

    rank, size = comm.rank, comm.size
    K = args.m // args.b
    s_max = max(args.s_values)
    eval_every = args.eval_every or max(1, (K // 8) // s_max) * s_max
    X, y = glm.make_glm_data(args.model, args.m, args.n, seed=args.seed)

    base = {
        "bench": "glm",
        "command": command,
        "P": size,
        "model": args.model,
        "m": args.m,
        "n": args.n,
        "b": args.b,
        "lr": args.lr,
        "lam": args.lam,
        "epochs": args.epochs,
        "host": platform.node(),
        "net_path": "recursive-doubling",
        # Other jobs on the machine inflate wall times; the load average says how much.
        "loadavg_start": os.getloadavg()[0],
    }

    def one(solver: str, recipe: str, s: int, latency: float, bw: float | None) -> Any:
        rec = CallRecorder(size, latency, bw)
        emulate = Emulation(latency=latency, bw=bw) if (latency or bw) else None
        comm.Barrier()
        try:
            res = glm.fit(
                X,
                y,
                model=args.model,
                solver=solver,
                s=s,
                recipe=recipe,
                comm=comm,
                allreduce=rec,
                emulate=emulate,
                eval_every=eval_every,
                on_record=rec.mark,
                b=args.b,
                lr=args.lr,
                epochs=args.epochs,
                lam=args.lam,
                seed=args.seed,
            )
        except glm.DivergenceError as exc:
            return str(exc)
        segs = np.asarray(comm.allgather(rec.segments))
        losses = [h["loss"] for h in res.history]
        crit = critical_path_times(segs, rec.costs, rec.records)
        walls = [h["train_s"] for h in res.history]
        return {
            "res": res,
            "losses": losses,
            "wall": walls,
            "crit": crit,
            "compute_max_cpu_s": float(np.sum(np.max(segs, axis=0))),
            "compute_mean_cpu_s": float(np.mean(np.sum(segs, axis=1))),
        }

    settings = [("sgd", "fp32", 1)] + [("casgd", r, s) for r in args.recipes for s in args.s_values]
    repeats = max(1, args.repeats)
    rows: list[dict[str, Any]] = []
    with _thread_limiter(size):
        for latency in args.latencies:
            for bw in args.bws:
                runs: dict[tuple[str, str, int], list[Any]] = {key: [] for key in settings}
                # Repeats outermost: sweeping every setting once per repeat exposes them
                # all to the same drift of the machine's load (the speedups are paired).
                for rep in range(repeats):
                    for key in settings:
                        if runs[key] and isinstance(runs[key][-1], str):
                            continue  # diverged once: it will again
                        if rank == 0 and args.verbose:
                            print_fn(
                                f"[{time.strftime('%H:%M:%S')}] latency {latency * 1e6:g} us "
                                f"bw {_bw_text(bw)} repeat {rep + 1}/{repeats}: {key}",
                                flush=True,
                            )
                        runs[key].append(one(*key, latency, bw))
                rows.extend(_rows(base, settings, runs, latency, bw, args.tolerance, repeats))
                if not args.no_sklearn:
                    rows.extend(_sklearn_rows(args, comm, X, y, base, rows[-len(settings)]))
    if rank == 0:
        for row in rows:
            row["loadavg_end"] = os.getloadavg()[0]
    return rows


def _bw_text(bw: float | None) -> str:
    return "inf" if not bw else f"{bw / 1e9:g}GB/s"


def _rows(
    base: dict[str, Any],
    settings: list[tuple[str, str, int]],
    runs: dict[tuple[str, str, int], list[Any]],
    latency: float,
    bw: float | None,
    tolerance: float,
    repeats: int,
) -> list[dict[str, Any]]:
    ref_runs = runs[settings[0]]
    if isinstance(ref_runs[-1], str):
        raise RuntimeError(f"the fp32 SGD reference diverged: {ref_runs[-1]}; lower --lr")
    ref_loss = ref_runs[0]["losses"][-1]
    target = ref_loss * (1 + tolerance) if ref_loss >= 0 else ref_loss * (1 - tolerance)

    def ttt(run: dict[str, Any], clock: str) -> Any:
        return _time_to_target(run[clock], run["losses"], target)

    ref = {c: [ttt(r, c) for r in ref_runs] for c in ("wall", "crit")}
    out = []
    for key in settings:
        solver, recipe, s = key
        row = {
            **base,
            "latency_s": latency,
            "bw": bw,
            "solver": solver,
            "recipe": recipe,
            "s": s,
            "repeats": repeats,
            "target_loss": target,
            "reference_loss": ref_loss,
        }
        if isinstance(runs[key][-1], str):
            out.append({**row, "error": runs[key][-1]})
            continue
        last = runs[key][-1]
        st = last["res"].stats
        for clock, name in (("wall", "time_to_target_s"), ("crit", "critical_s")):
            times = [ttt(r, clock) for r in runs[key]]
            reached = all(t is not None for t in times)
            row[name] = float(np.median(times)) if reached else None
            row[name.replace("_s", "_all_s")] = times
            pairs = zip(ref[clock], times, strict=True)
            row["speedup" if clock == "wall" else "critical_speedup"] = (
                float(np.median([a / t for a, t in pairs])) if reached else None
            )

        def median(stat: str, rs: list[Any] = runs[key]) -> float:
            return float(np.median([r["res"].stats[stat] for r in rs]))

        final = last["losses"][-1]
        row.update(
            final_loss=final,
            loss_gap=abs(final - ref_loss) / abs(ref_loss) if ref_loss else None,
            train_s=median("train_s"),
            compute_s=median("compute_s"),
            comm_s=median("comm_s"),
            compute_max_cpu_s=float(np.median([r["compute_max_cpu_s"] for r in runs[key]])),
            compute_mean_cpu_s=float(np.median([r["compute_mean_cpu_s"] for r in runs[key]])),
            allreduce_calls=st["allreduce_calls"],
            allreduce_bytes=st["allreduce_bytes"],
            **{k: v for k, v in st.items() if k.startswith("net_")},
        )
        out.append(row)
    return out


def _sklearn_rows(
    args: Any, comm: Any, X: Any, y: Any, base: dict[str, Any], ref_row: dict[str, Any]
) -> list[dict[str, Any]]:
    rank, size = comm.rank, comm.size
    rows: list[dict[str, Any]] = []
    if rank == 0:
        target = ref_row["target_loss"]
        per_est: dict[str, list[dict[str, Any]]] = {}
        for _ in range(max(1, args.repeats)):
            found = sklearn_baselines(
                args.model, X, y, args.lam, args.lr, args.b, target, args.seed,
                lbfgs=not args.no_lbfgs,
            )  # fmt: skip
            for r in found:
                per_est.setdefault(r.get("estimator", "sklearn"), []).append(r)
        for tries in per_est.values():
            sk = dict(tries[-1])
            times = [t.get("time_to_target_s") for t in tries]
            if all(t is not None for t in times):
                sk["time_to_target_s"] = float(np.median(times))
                sk["time_to_target_all_s"] = times
            ref_t = ref_row.get("time_to_target_s")
            ttt = sk.get("time_to_target_s")
            rows.append(
                {
                    **base,
                    "latency_s": ref_row["latency_s"],
                    "bw": ref_row["bw"],
                    "P": 1,
                    "recipe": "fp64",
                    "s": None,
                    "repeats": args.repeats,
                    "target_loss": target,
                    "reference_loss": ref_row["reference_loss"],
                    "speedup": (ref_t / ttt) if ttt and ref_t else None,
                    **sk,
                }
            )
    if size > 1 and rank:
        _polite_wait(comm)  # rank 0 alone runs scikit-learn: leave it the cores
    elif size > 1:
        comm.Ibarrier().Wait()
    return rows


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(rows: Iterable[dict[str, Any]]) -> str:
    """The rows as the printed table."""
    lines = [
        f"{'latency':>8} {'bw':>8} {'solver':>8} {'recipe':>6} {'s':>4} {'t_wall(s)':>9} "
        f"{'speedup':>7} {'t_crit(s)':>9} {'crit.sp':>7} {'final loss':>11} {'gap':>8} "
        f"{'calls':>6} {'MiB':>8} {'charged(s)':>10}"
    ]
    for r in rows:
        head = (
            f"{r['latency_s'] * 1e6:6.0f}us {_bw_text(r.get('bw')):>8} "
            f"{r.get('estimator', r['solver'])[:8] if r['solver'] == 'sklearn' else r['solver']:>8}"
            f" {r.get('recipe') or '':>6} {_fmt(r.get('s'), 'd'):>4}"
        )
        if "error" in r:
            lines.append(f"{head}  {r['error']}")
            continue
        mib = r.get("allreduce_bytes")
        lines.append(
            f"{head} {_fmt(r.get('time_to_target_s'), '.3f'):>9} "
            f"{_fmt(r.get('speedup'), '.2f'):>7} {_fmt(r.get('critical_s'), '.3f'):>9} "
            f"{_fmt(r.get('critical_speedup'), '.2f'):>7} {_fmt(r.get('final_loss'), '.6g'):>11} "
            f"{_fmt(r.get('loss_gap'), '.1e'):>8} {_fmt(r.get('allreduce_calls'), 'd'):>6} "
            f"{_fmt(mib and mib / 2**20, '.2f'):>8} {_fmt(r.get('net_charged_s'), '.3f'):>10}"
        )
    return "\n".join(lines)


def write_rows(rows: list[dict[str, Any]], out: str | os.PathLike) -> None:
    """Append the rows to a JSON-lines file."""
    with Path(out).open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


# -- the projection --------------------------------------------------------------------


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
    path: str = "recursive-doubling",
) -> Projection:
    """Projected time per SGD step: measured compute plus the modelled AllReduce.

    For each solver label ``k`` and each ``P``::

        t_k(P) = (compute[k][P] + allreduce_cost(P, nbytes[k], latency, bw, path))
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
    latency, bw, path
        The network (see :func:`optcc_mpi.glm.comm.allreduce_cost`).
    """
    proj = Projection(list(p_values), latency, bw, baseline_s)
    for label, by_p in compute.items():
        times = []
        for p in p_values:
            cost = allreduce_cost(p, nbytes[label], latency, bw, path)
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

    Runs the real trainer on one process (``MPI.COMM_SELF``) over an ``(m, n_local)``
    block with a recording AllReduce; returns the median compute interval and the
    AllReduce payload in bytes.
    """
    from mpi4py import MPI

    from .. import glm

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
        epochs=1,
        seed=seed,
        comm=MPI.COMM_SELF,
        allreduce=reduce,
        on_record=rec.mark,
        divergence_factor=None,
    )
    # The first interval holds one-off setup; the median of the rest is robust to load.
    segs = rec.segments[1:] or rec.segments
    return float(np.median(segs)), int(np.median(sent))


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
    with _thread_limiter(2):
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


def plot_projection(projections: Sequence[Projection], path: str | os.PathLike, title: str) -> None:
    """Speedup against P, one line per solver and network, log-log; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = ["-", "--", ":", "-."]
    for i, proj in enumerate(projections):
        net = f"{proj.latency * 1e6:g} us, {_bw_text(proj.bw)}"
        for j, (label, sp) in enumerate(proj.speedup.items()):
            ax.plot(
                proj.p_values,
                sp,
                styles[i % len(styles)],
                marker="os^v"[j % 4],
                color=f"C{j}",
                label=f"{label} ({net})",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks P (columns split over P; strong scaling)")
    ax.set_ylabel("speedup over fp32 SGD on 1 rank")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
