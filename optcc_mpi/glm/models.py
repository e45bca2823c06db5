"""Generalized linear models: per-sample loss, residual, mean, and label domain.

Every model is written in terms of the margin ``z = x @ w``; the trainer only ever needs
the residual ``delta = d loss / d z`` (elementwise, so every rank can apply it redundantly to
the reduced margins) and, for reporting, the mean loss over the training set.

The losses are chosen so that our objective ``mean loss + (lambda/2) ||w||^2`` equals the
objective scikit-learn documents for the matching estimator (``docs/casgd.md``):

============  =====================================  =========================  ==========
model         loss l(z, y)                           residual dl/dz             labels
============  =====================================  =========================  ==========
logistic      log(1 + e^z) - y z                     sigmoid(z) - y             {0, 1}
linear        (z - y)^2 / 2                          z - y                      real
poisson       e^z - y z + y log y - y  (half dev.)   e^z - y                    real >= 0
============  =====================================  =========================  ==========

The losses and residuals take NumPy arrays or PyTorch tensors (computed by torch on the
tensor's device). Logistic labels given as {-1, +1} are mapped to {0, 1}. The Poisson loss
is the half deviance: the negative log-likelihood shifted by a constant so that a perfect
fit scores 0 (``PoissonRegressor``'s objective), which makes relative loss gaps meaningful. Like
``PoissonRegressor``, it accepts any non-negative target (rates, averaged counts), not only
integers: the half deviance and its gradient are defined for every ``y >= 0``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import expit, logit, xlogy

from ..errors import ArgumentError
from ..labels import check_labels

__all__ = ["MODELS", "TASKS", "Model", "get_model", "model_for_task"]


def _is_tensor(a: Any) -> bool:
    # PyTorch tensors take torch's own functions (on their device); checked by module
    # name so that this module never imports torch for NumPy users.
    return type(a).__module__.partition(".")[0] == "torch"


def _logistic_loss(z: Any, y: Any) -> Any:
    if _is_tensor(z):
        import torch.nn.functional as F  # loaded already: z is a tensor

        return F.softplus(z) - y * z
    # logaddexp(0, z) = log(1 + e^z) without overflow for large |z|.
    return np.logaddexp(0.0, z) - y * z


def _logistic_residual(z: Any, y: Any) -> Any:
    if _is_tensor(z):
        return z.sigmoid() - y.to(z.dtype)
    # expit keeps float32 inputs in float32, which the fp32 recurrence relies on.
    return expit(z) - y.astype(z.dtype, copy=False)


def _linear_loss(z: Any, y: Any) -> Any:
    d = z - y
    return 0.5 * d * d


def _linear_residual(z: Any, y: Any) -> Any:
    return z - (y.to(z.dtype) if _is_tensor(z) else y.astype(z.dtype, copy=False))


def _poisson_loss(z: Any, y: Any) -> Any:
    # Half deviance y log(y / mu) - y + mu with mu = e^z; xlogy gives 0 log 0 = 0.
    if _is_tensor(z):
        return z.exp() - y * z + y.xlogy(y) - y
    return np.exp(z) - y * z + xlogy(y, y) - y


def _poisson_residual(z: Any, y: Any) -> Any:
    if _is_tensor(z):
        return z.exp() - y.to(z.dtype)
    return np.exp(z) - y.astype(z.dtype, copy=False)


@dataclass(frozen=True)
class Model:
    """One generalized linear model.

    Attributes
    ----------
    name : str
        ``"logistic"``, ``"linear"`` or ``"poisson"``.
    task : str
        The dataset task it fits (``"binary"``, ``"regression"``, ``"counts"``), as recorded
        in dataset files.
    loss : callable
        ``loss(z, y)``: per-sample loss, elementwise.
    residual : callable
        ``residual(z, y)``: derivative of the loss in the margin, elementwise; keeps the
        dtype of ``z``.
    mean : callable
        ``mean(z)``: the predicted mean (probability, value, rate).
    link : callable
        ``link(mu)``: the margin whose mean is ``mu`` (the inverse of ``mean``); used for
        the null model of :meth:`d2`.
    """

    name: str
    task: str
    loss: Callable[[np.ndarray, np.ndarray], np.ndarray]
    residual: Callable[[np.ndarray, np.ndarray], np.ndarray]
    mean: Callable[[np.ndarray], np.ndarray]
    link: Callable[[np.ndarray], np.ndarray]

    def check_labels(self, y: np.ndarray) -> np.ndarray:
        """Return ``y`` as float64 in the model's domain, or raise ``ValueError``.

        Logistic: {0, 1} or {-1, +1} (mapped to {0, 1}), as the dataset task ``binary``
        (:func:`optcc_mpi.labels.check_labels`); linear: finite values; Poisson: finite
        non-negative values, integer or not (as scikit-learn's ``PoissonRegressor``). The
        estimator :class:`~optcc_mpi.glm.CASGDClassifier` maps arbitrary labels.
        """
        if self.name != "poisson":
            return check_labels(y, self.task)
        y = check_labels(y, "regression")
        negative = np.flatnonzero(y < 0)
        if negative.size:
            i = int(negative[0])
            raise ArgumentError(
                f"Poisson targets must be non-negative; y[{i}] = {y[i]:g} "
                f"({negative.size} negative value{'s' if negative.size > 1 else ''})"
            )
        return y

    def d2(self, z: np.ndarray, y: np.ndarray, sample_weight: np.ndarray | None = None) -> float:
        """Fraction of the deviance explained, ``D^2 = 1 - dev(z) / dev(null)``.

        ``dev`` is the (weighted) sum of the model's loss, whose minimum over margins is 0
        for a perfect fit up to a constant that cancels in the ratio; the null model
        predicts the (weighted) mean of ``y`` for every row. For ``linear`` this is
        exactly ``R^2``; for ``poisson`` it is scikit-learn's ``PoissonRegressor.score``;
        for ``logistic`` it is the log-loss ``D^2``. As ``sklearn.metrics.r2_score``
        (``force_finite``), a constant ``y`` scores 1 when predicted exactly, else 0.
        """
        y = np.asarray(y, dtype=np.float64)
        z = np.asarray(z, dtype=np.float64)
        sw = np.ones_like(y) if sample_weight is None else np.asarray(sample_weight, float)
        mu = float(np.sum(sw * y) / np.sum(sw))
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            dev = float(np.sum(sw * self.loss(z, y)))
            null = float(np.sum(sw * self.loss(np.full_like(y, self.link(mu)), y)))
        if y.size == 0 or np.all(y == y.flat[0]) or not null > 0:
            # A constant target: the ratio is undefined (0/0 or noise over roundoff).
            return 1.0 if dev == 0.0 else 0.0
        return 1.0 - dev / null


def _identity(z: np.ndarray) -> np.ndarray:
    return z


def _log(mu: np.ndarray) -> np.ndarray:
    # A zero mean has margin -inf; the smallest normal double keeps the loss finite.
    return np.log(np.maximum(mu, np.finfo(np.float64).tiny))


def _logit(mu: np.ndarray) -> np.ndarray:
    eps = np.finfo(np.float64).tiny
    return logit(np.clip(mu, eps, 1.0 - np.finfo(np.float64).epsneg))


MODELS: dict[str, Model] = {
    "logistic": Model("logistic", "binary", _logistic_loss, _logistic_residual, expit, _logit),
    "linear": Model("linear", "regression", _linear_loss, _linear_residual, _identity, _identity),
    "poisson": Model("poisson", "counts", _poisson_loss, _poisson_residual, np.exp, _log),
}

#: Dataset task -> the model that fits it.
TASKS: dict[str, str] = {m.task: name for name, m in MODELS.items()}


def get_model(name: str | Model) -> Model:
    """Return the model called ``name`` (``logistic``, ``linear``, ``poisson``)."""
    if isinstance(name, Model):
        return name
    try:
        return MODELS[str(name).lower()]
    except KeyError:
        raise ArgumentError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}") from None


def model_for_task(task: str) -> str:
    """Return the model name for a dataset task (``binary`` -> ``logistic`` ...)."""
    try:
        return TASKS[task]
    except KeyError:
        raise ArgumentError(
            f"unknown dataset task {task!r}; expected one of {', '.join(TASKS)}"
        ) from None
