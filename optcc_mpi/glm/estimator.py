"""Estimators in scikit-learn's spirit: ``fit``, ``predict``, ``score``, ``get_params``.

They need no scikit-learn at run time. ``fit(X, y)`` takes the full matrix on every rank
(as scikit-learn users hold it) and trains collectively over ``comm``; afterwards every
rank has all the weights in ``coef_`` and can predict locally.

Parameter mapping to scikit-learn (our objective is ``mean loss + (lam/2) ||w||^2``, no
intercept): ``SGDClassifier(loss="log_loss", penalty="l2", alpha=lam,
fit_intercept=False)``, ``SGDRegressor(penalty="l2", alpha=lam, fit_intercept=False)``,
``PoissonRegressor(alpha=lam, fit_intercept=False)``, ``LogisticRegression(C=1/(lam*m),
fit_intercept=False)``.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from .api import FitResult, fit
from .models import get_model

__all__ = ["GLM", "CASGDClassifier", "CASGDRegressor"]


class GLM:
    """A generalized linear model trained by SGD or CA-SGD over MPI.

    Parameters
    ----------
    model : str
        ``logistic``, ``linear`` or ``poisson``.
    solver : str
        ``casgd`` or ``sgd``.
    s, b : int
        Steps per outer iteration and mini-batch size.
    lr : float
        Step size.
    epochs : int
        Passes over the data.
    lam : float
        L2 strength (scikit-learn's ``alpha``).
    recipe : str
        Precision preset (``fp64``, ``fp32``, ``C``, ``D``).
    slots : list of str, optional
        Per-slot precision overrides (``["comm=bf16"]``).
    seed : int
        Seed of the sample sequence.
    comm : mpi4py.MPI.Comm, optional
        Communicator (``COMM_WORLD`` by default).
    allreduce : str or callable
        AllReduce to use (see :func:`optcc_mpi.glm.fit`).
    links, emulate : optional
        Passed to the AllReduce.
    device : str
        ``cpu``, ``gpu`` or ``auto``.

    Attributes
    ----------
    coef_ : ndarray
        Weights after ``fit``.
    result_ : FitResult
        Everything ``fit`` recorded (history, stats, config).
    n_features_in_ : int
        Columns seen in ``fit``.
    """

    def __init__(
        self,
        model: str = "logistic",
        solver: str = "casgd",
        s: int = 16,
        b: int = 32,
        lr: float = 0.5,
        epochs: int = 5,
        lam: float = 0.0,
        recipe: str = "fp32",
        slots: list[str] | None = None,
        seed: int = 0,
        comm: Any = None,
        allreduce: Any = "mpi",
        links: Any = None,
        emulate: Any = None,
        device: str = "cpu",
    ) -> None:
        self.model = model
        self.solver = solver
        self.s = s
        self.b = b
        self.lr = lr
        self.epochs = epochs
        self.lam = lam
        self.recipe = recipe
        self.slots = slots
        self.seed = seed
        self.comm = comm
        self.allreduce = allreduce
        self.links = links
        self.emulate = emulate
        self.device = device

    # -- scikit-learn conventions ------------------------------------------------------

    @classmethod
    def _param_names(cls) -> list[str]:
        sig = inspect.signature(cls.__init__)
        return [p for p in sig.parameters if p != "self"]

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """Constructor parameters as a dict."""
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params: Any) -> GLM:
        """Set constructor parameters; returns self."""
        valid = set(self._param_names())
        for key, value in params.items():
            if key not in valid:
                raise ValueError(f"invalid parameter {key!r} for {type(self).__name__}")
            setattr(self, key, value)
        return self

    def __repr__(self) -> str:
        defaults = {
            name: p.default for name, p in inspect.signature(type(self).__init__).parameters.items()
        }
        shown = ", ".join(
            f"{k}={v!r}" for k, v in self.get_params().items() if defaults.get(k) != v
        )
        return f"{type(self).__name__}({shown})"

    # -- fitting and prediction --------------------------------------------------------

    def _fit_labels(self, y: Any) -> np.ndarray:
        return np.asarray(y)

    def fit(self, X: Any, y: Any) -> GLM:
        """Train on the full ``X`` (the same on every rank) and labels ``y``; collective."""
        labels = self._fit_labels(y)
        params = self.get_params()
        params.pop("slots")
        params.pop("model", None)
        self.result_: FitResult = fit(X, labels, model=self.model, slots=self.slots, **params)
        self.coef_ = self.result_.coef
        self.n_features_in_ = self.coef_.shape[0]
        return self

    def _check_fitted(self, X: Any) -> Any:
        if not hasattr(self, "coef_"):
            raise ValueError(f"this {type(self).__name__} is not fitted yet; call fit first")
        if X.shape[-1] != self.n_features_in_:
            raise ValueError(
                f"X has {X.shape[-1]} features, the model was fit with {self.n_features_in_}"
            )
        return X

    def decision_function(self, X: Any) -> np.ndarray:
        """Margins ``X @ coef_`` (float64); local, no communication."""
        X = self._check_fitted(X if hasattr(X, "shape") else np.asarray(X))
        return np.asarray(X.astype(np.float64) @ self.coef_).ravel()

    def predict(self, X: Any) -> np.ndarray:
        """Predicted mean: probability (logistic), value (linear), rate (poisson)."""
        return get_model(self.model).mean(self.decision_function(X))

    def score(self, X: Any, y: Any) -> float:
        """R^2 (linear) or D^2, the fraction of Poisson deviance explained (poisson)."""
        y = np.asarray(y, dtype=np.float64)
        mdl = get_model(self.model)
        z = self.decision_function(X)
        if mdl.name == "linear":
            resid = ((y - z) ** 2).sum()
            total = ((y - y.mean()) ** 2).sum()
            return float(1.0 - resid / total) if total > 0 else 0.0
        if mdl.name == "poisson":
            dev = mdl.loss(z, y).sum()
            null = mdl.loss(np.full_like(y, np.log(max(y.mean(), 1e-300))), y).sum()
            return float(1.0 - dev / null) if null > 0 else 0.0
        raise NotImplementedError("GLM.score for logistic: use CASGDClassifier")


class CASGDClassifier(GLM):
    """Binary logistic regression by CA-SGD; any two labels (kept in ``classes_``).

    ``predict`` returns labels from ``classes_``, ``predict_proba`` the two class
    probabilities, ``score`` the accuracy. Other parameters as :class:`GLM`.
    """

    def __init__(
        self,
        solver: str = "casgd",
        s: int = 16,
        b: int = 32,
        lr: float = 0.5,
        epochs: int = 5,
        lam: float = 0.0,
        recipe: str = "fp32",
        slots: list[str] | None = None,
        seed: int = 0,
        comm: Any = None,
        allreduce: Any = "mpi",
        links: Any = None,
        emulate: Any = None,
        device: str = "cpu",
    ) -> None:
        super().__init__(
            "logistic",
            solver,
            s,
            b,
            lr,
            epochs,
            lam,
            recipe,
            slots,
            seed,
            comm,
            allreduce,
            links,
            emulate,
            device,
        )

    def _fit_labels(self, y: Any) -> np.ndarray:
        y = np.asarray(y)
        self.classes_ = np.unique(y)
        if self.classes_.size != 2:
            raise ValueError(
                f"CASGDClassifier is binary: y has {self.classes_.size} distinct label(s)"
            )
        return (y == self.classes_[1]).astype(np.float64)

    def predict_proba(self, X: Any) -> np.ndarray:
        """Probabilities of ``classes_[0]`` and ``classes_[1]``, shape ``(n, 2)``."""
        p = get_model("logistic").mean(self.decision_function(X))
        return np.column_stack([1.0 - p, p])

    def predict(self, X: Any) -> np.ndarray:
        """Predicted labels (from ``classes_``)."""
        return self.classes_[(self.decision_function(X) > 0).astype(int)]

    def score(self, X: Any, y: Any) -> float:
        """Mean accuracy."""
        return float(np.mean(self.predict(X) == np.asarray(y)))


class CASGDRegressor(GLM):
    """Linear (``model="linear"``) or Poisson (``model="poisson"``) regression by CA-SGD.

    ``predict`` returns the mean, ``score`` R^2 (linear) or D^2 (poisson). Parameters as
    :class:`GLM`.
    """

    def __init__(
        self,
        model: str = "linear",
        solver: str = "casgd",
        s: int = 16,
        b: int = 32,
        lr: float = 0.1,
        epochs: int = 5,
        lam: float = 0.0,
        recipe: str = "fp32",
        slots: list[str] | None = None,
        seed: int = 0,
        comm: Any = None,
        allreduce: Any = "mpi",
        links: Any = None,
        emulate: Any = None,
        device: str = "cpu",
    ) -> None:
        if model not in ("linear", "poisson"):
            raise ValueError(f"CASGDRegressor fits linear or poisson models, not {model!r}")
        super().__init__(
            model,
            solver,
            s,
            b,
            lr,
            epochs,
            lam,
            recipe,
            slots,
            seed,
            comm,
            allreduce,
            links,
            emulate,
            device,
        )
