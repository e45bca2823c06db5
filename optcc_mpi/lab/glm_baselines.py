"""scikit-learn baselines of the GLM benchmark: how long scikit-learn, on one process, takes
to reach the loss the benchmark's fp32 SGD reference reached (:mod:`optcc_mpi.lab.glm_bench`).

scikit-learn is optional: without it :func:`sklearn_baselines` returns one row saying so.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from ..glm import get_model

__all__ = ["sklearn_baselines"]


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
    try:
        from sklearn.linear_model import (
            LogisticRegression,
            PoissonRegressor,
            SGDClassifier,
            SGDRegressor,
        )
    except ImportError:
        return [{"solver": "sklearn", "error": "scikit-learn is not installed"}]

    loss_fn = get_model(model).loss

    def objective(w: Any) -> float:
        return float(np.mean(loss_fn(X.astype(np.float64) @ w, y)) + 0.5 * lam * (w @ w))

    if model == "poisson":
        # Stop on max_iter, not on convergence: the smallest tolerance PoissonRegressor
        # accepts (it refuses 0, which LogisticRegression below takes).
        tol = float(np.finfo(np.float64).tiny)
        return [
            _doubling(
                lambda k: PoissonRegressor(alpha=lam, fit_intercept=False, max_iter=k, tol=tol),
                "PoissonRegressor(lbfgs)",
                X,
                y,
                objective,
                target,
                budget_s,
            )
        ]
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
        fit_kw = {"classes": np.array([0.0, 1.0])}
    else:
        est, name = SGDRegressor(loss="squared_error", **common), "SGDRegressor"
        fit_kw = {}
    out = [_epochs(est, name, X, y, fit_kw, objective, target, max_epochs, budget_s)]
    if model == "logistic" and lbfgs:
        # C is the inverse of the summed penalty: sum-loss + ||w||^2 / (2C) = m * ours.
        m = X.shape[0]

        def make(k: int) -> Any:
            if lam > 0:
                return LogisticRegression(C=1.0 / (lam * m), fit_intercept=False, max_iter=k)
            return LogisticRegression(C=np.inf, fit_intercept=False, max_iter=k, tol=0.0)

        out.append(_doubling(make, "LogisticRegression(lbfgs)", X, y, objective, target, budget_s))
    return out


def _epochs(
    est: Any,
    name: str,
    X: Any,
    y: Any,
    fit_kw: dict[str, Any],
    objective: Callable[[Any], float],
    target: float,
    max_epochs: int,
    budget_s: float,
) -> dict[str, Any]:
    """An SGD estimator trained one epoch (``partial_fit``) at a time until ``target``."""
    elapsed, epochs, loss, reached = 0.0, 0, float("nan"), None
    while epochs < max_epochs and elapsed < budget_s:
        t0 = time.perf_counter()
        est.partial_fit(X, y, **fit_kw)
        elapsed += time.perf_counter() - t0
        epochs += 1
        loss = objective(est.coef_.ravel().astype(np.float64))
        if loss <= target:
            reached = elapsed
            break
    return {
        "solver": "sklearn",
        "estimator": name,
        "time_to_target_s": reached,
        "final_loss": loss,
        "epochs": epochs,
    }


def _doubling(
    make: Callable[[int], Any],
    name: str,
    X: Any,
    y: Any,
    objective: Callable[[Any], float],
    target: float,
    budget_s: float,
) -> dict[str, Any]:
    """A batch solver refitted with ``max_iter`` doubled (1, 2, 4 ... 4096) until ``target``."""
    from sklearn.exceptions import ConvergenceWarning

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
