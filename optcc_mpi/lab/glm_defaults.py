"""The estimators' defaults against scikit-learn's on one process: time to within a
tolerance of ``LogisticRegression``'s loss (``optcc-mpi bench-glm --defaults``).

The problem: ``sklearn.datasets.make_classification(m, n, random_state=seed)``, the
features standardised (``StandardScaler``), labels {0, 1}. The loss compared is the mean
log loss on the training rows (the data term, without any penalty: each estimator keeps
its own default penalty, which is part of its defaults). The target is
``LogisticRegression()``'s loss at convergence (lbfgs, its defaults, ``max_iter`` raised
until it stops by its own tolerance) times ``1 + tolerance``.

Each contender runs with its defaults and ``max_iter`` doubled (1, 2, 4, ...) until its
fit ends within the target; its time is the wall time of that whole ``fit`` call (setup,
every epoch, its own convergence checks), as a user would see it. Truncating a run at
``max_iter`` epochs is the same run as the defaults up to there, for all three:

* ``CASGDClassifier()`` (ours: ``b``, ``lr``, ``s`` "auto", ``tol=1e-3``, adaptive step);
* ``LogisticRegression()`` (lbfgs);
* ``SGDClassifier(loss="log_loss")`` (its defaults: ``alpha=1e-4``, "optimal" step).

Every fit runs with one BLAS thread (``threadpoolctl``), the same for all. Sweeps
(``repeats``) run every contender once each, so drift of the machine's load meets all;
times are the median, min and max over sweeps. The full default fit of each (no
``max_iter`` given) is timed too, with its final loss.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import glm

__all__ = ["run_defaults_bench", "format_defaults"]

#: The largest ``max_iter`` tried before a contender counts as not reaching the target.
MAX_ITER_CAP = 4096


def _synthetic(m: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import make_classification
    from sklearn.preprocessing import StandardScaler

    X, y = make_classification(n_samples=m, n_features=n, random_state=seed)
    return StandardScaler().fit_transform(X), y


def _log_loss(est: Any, X: np.ndarray, y: np.ndarray) -> float:
    """Mean log loss of ``est``'s probabilities on ``(X, y)`` (float64)."""
    z = np.asarray(est.decision_function(X), dtype=np.float64)
    return float(np.mean(np.logaddexp(0.0, z) - y * z))


def _one_thread() -> Any:
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - comes with scikit-learn
        return contextlib.nullcontext()
    return threadpool_limits(limits=1)


def _timed_fit(make: Callable[[], Any], X: np.ndarray, y: np.ndarray) -> tuple[Any, float]:
    from sklearn.exceptions import ConvergenceWarning

    est = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        t0 = time.perf_counter()
        est.fit(X, y)
        return est, time.perf_counter() - t0


def _to_target(
    make: Callable[[int], Any], X: np.ndarray, y: np.ndarray, target: float, budget_s: float
) -> dict[str, Any]:
    """``make(max_iter)`` fitted with ``max_iter`` doubled until its loss <= ``target``."""
    k, spent = 1, 0.0
    loss = float("nan")
    while k <= MAX_ITER_CAP and spent < budget_s:
        est, secs = _timed_fit(lambda k=k: make(k), X, y)
        spent += secs
        loss = _log_loss(est, X, y)
        if loss <= target:
            return {"time_s": secs, "max_iter": k, "loss": loss, "n_iter": _n_iter(est)}
        k *= 2
    return {"time_s": None, "max_iter": k, "loss": loss, "n_iter": None}


def _n_iter(est: Any) -> int:
    n = np.max(np.atleast_1d(getattr(est, "n_iter_", 0)))
    return int(n)


def contenders() -> dict[str, Callable[[int | None], Any]]:
    """The estimators compared, by name: ``make(max_iter)`` (None: the defaults)."""
    from sklearn.linear_model import LogisticRegression, SGDClassifier

    def ours(k: int | None) -> Any:
        return glm.CASGDClassifier() if k is None else glm.CASGDClassifier(max_iter=k)

    def lbfgs(k: int | None) -> Any:
        return LogisticRegression() if k is None else LogisticRegression(max_iter=k)

    def sgd(k: int | None) -> Any:
        est = SGDClassifier(loss="log_loss", random_state=0)
        return est if k is None else est.set_params(max_iter=k)

    return {
        "CASGDClassifier()": ours,
        "LogisticRegression(lbfgs)": lbfgs,
        "SGDClassifier(log_loss)": sgd,
    }


def run_defaults_bench(
    m: int,
    n: int,
    *,
    seed: int = 0,
    tolerance: float = 0.01,
    repeats: int = 3,
    budget_s: float = 600.0,
    command: str = "",
    say: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """The benchmark (module docstring); one row per contender."""
    say = say or (lambda msg: None)
    X, y = _synthetic(m, n, seed)
    makers = contenders()
    with _one_thread():
        ref, ref_s = _timed_fit(lambda: makers["LogisticRegression(lbfgs)"](10_000), X, y)
        ref_loss = _log_loss(ref, X, y)
        target = ref_loss * (1 + tolerance)
        say(f"LogisticRegression() converged to loss {ref_loss:.6f}; target {target:.6f}")
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in makers}
        full: dict[str, list[dict[str, Any]]] = {name: [] for name in makers}
        for rep in range(max(1, repeats)):
            for name, make in makers.items():
                say(f"sweep {rep + 1}/{repeats}: {name}")
                runs[name].append(_to_target(make, X, y, target, budget_s))
                est, secs = _timed_fit(lambda make=make: make(None), X, y)
                full[name].append(
                    {"time_s": secs, "loss": _log_loss(est, X, y), "n_iter": _n_iter(est)}
                )
    rows = []
    for name in makers:
        times = [r["time_s"] for r in runs[name]]
        reached = all(t is not None for t in times)
        defaults = full[name]
        last = defaults[-1]
        rows.append(
            {
                "bench": "glm-defaults",
                "command": command,
                "estimator": name,
                "m": m,
                "n": n,
                "seed": seed,
                "tolerance": tolerance,
                "reference_loss": ref_loss,
                "target_loss": target,
                "repeats": repeats,
                "threads": 1,
                "time_to_target_s": float(np.median(times)) if reached else None,
                "time_to_target_min_s": min(times) if reached else None,
                "time_to_target_max_s": max(times) if reached else None,
                "time_to_target_all_s": times,
                "max_iter_to_target": runs[name][-1]["max_iter"] if reached else None,
                "loss_at_target": runs[name][-1]["loss"],
                "defaults_time_s": float(np.median([d["time_s"] for d in defaults])),
                "defaults_time_min_s": min(d["time_s"] for d in defaults),
                "defaults_time_max_s": max(d["time_s"] for d in defaults),
                "defaults_loss": last["loss"],
                "defaults_gap": last["loss"] / ref_loss - 1.0,
                "defaults_n_iter": last["n_iter"],
                "reference_fit_s": ref_s,
                "loadavg": os.getloadavg()[0],
            }
        )
    return rows


def format_defaults(rows: list[dict[str, Any]]) -> str:
    """The rows as the printed table."""

    def cell(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    r0 = rows[0]
    lines = [
        f"one process, make_classification {r0['m']} x {r0['n']} standardised; target: "
        f"within {100 * r0['tolerance']:g}% of LogisticRegression's loss "
        f"{r0['reference_loss']:.6f}",
        f"{'estimator':>26} {'to target (s) med [min, max]':>30} {'max_iter':>8} "
        f"{'defaults (s)':>12} {'epochs':>6} {'defaults gap':>12}",
    ]
    for r in rows:
        span = (
            f"{cell(r['time_to_target_s'], '.3f')} [{cell(r['time_to_target_min_s'], '.3f')}, "
            f"{cell(r['time_to_target_max_s'], '.3f')}]"
        )
        lines.append(
            f"{r['estimator']:>26} {span:>30} {cell(r['max_iter_to_target'], 'd'):>8} "
            f"{r['defaults_time_s']:12.3f} {r['defaults_n_iter']:6d} "
            f"{100 * r['defaults_gap']:11.2f}%"
        )
    return "\n".join(lines)
