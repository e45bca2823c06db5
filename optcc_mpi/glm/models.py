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
poisson       e^z - y z + y log y - y  (half dev.)   e^z - y                    0, 1, 2, ...
============  =====================================  =========================  ==========

Logistic labels given as {-1, +1} are mapped to {0, 1}. The Poisson loss is the half
deviance: the negative log-likelihood shifted by a constant so that a perfect fit scores 0
(``PoissonRegressor``'s objective), which makes relative loss gaps meaningful.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.special import expit, xlogy

from ..data import check_labels

__all__ = ["MODELS", "TASKS", "Model", "get_model", "model_for_task"]


def _logistic_loss(z: np.ndarray, y: np.ndarray) -> np.ndarray:
    # logaddexp(0, z) = log(1 + e^z) without overflow for large |z|.
    return np.logaddexp(0.0, z) - y * z


def _logistic_residual(z: np.ndarray, y: np.ndarray) -> np.ndarray:
    # expit keeps float32 inputs in float32, which the fp32 recurrence relies on.
    return expit(z) - y.astype(z.dtype, copy=False)


def _linear_loss(z: np.ndarray, y: np.ndarray) -> np.ndarray:
    d = z - y
    return 0.5 * d * d


def _linear_residual(z: np.ndarray, y: np.ndarray) -> np.ndarray:
    return z - y.astype(z.dtype, copy=False)


def _poisson_loss(z: np.ndarray, y: np.ndarray) -> np.ndarray:
    # Half deviance y log(y / mu) - y + mu with mu = e^z; xlogy gives 0 log 0 = 0.
    return np.exp(z) - y * z + xlogy(y, y) - y


def _poisson_residual(z: np.ndarray, y: np.ndarray) -> np.ndarray:
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
    """

    name: str
    task: str
    loss: Callable[[np.ndarray, np.ndarray], np.ndarray]
    residual: Callable[[np.ndarray, np.ndarray], np.ndarray]
    mean: Callable[[np.ndarray], np.ndarray]

    def check_labels(self, y: np.ndarray) -> np.ndarray:
        """Return ``y`` as float64 in the model's domain, or raise ``ValueError``.

        The domain is the dataset task's (:func:`optcc_mpi.data.check_labels`): {0, 1}
        or {-1, +1} (mapped to {0, 1}) for logistic, non-negative integers for Poisson,
        finite values for linear. The estimator :class:`~optcc_mpi.glm.CASGDClassifier`
        maps arbitrary label pairs.
        """
        return check_labels(y, self.task)


MODELS: dict[str, Model] = {
    "logistic": Model("logistic", "binary", _logistic_loss, _logistic_residual, expit),
    "linear": Model("linear", "regression", _linear_loss, _linear_residual, lambda z: z),
    "poisson": Model("poisson", "counts", _poisson_loss, _poisson_residual, np.exp),
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
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}") from None


def model_for_task(task: str) -> str:
    """Return the model name for a dataset task (``binary`` -> ``logistic`` ...)."""
    try:
        return TASKS[task]
    except KeyError:
        raise ValueError(
            f"unknown dataset task {task!r}; expected one of {', '.join(TASKS)}"
        ) from None
