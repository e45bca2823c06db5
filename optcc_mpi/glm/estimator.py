"""scikit-learn estimators trained by SGD or CA-SGD over MPI.

:class:`CASGDClassifier` (logistic regression, any number of classes), :class:`CASGDRegressor`
(linear or Poisson regression) and their common base :class:`GLM` (any model; predicts the
conditional mean) are scikit-learn estimators: ``BaseEstimator`` with the classifier or
regressor mixin, tags, ``NotFittedError`` before ``fit``, every check of the inputs and of
the parameters in ``fit`` (``__init__`` only stores them), ``sample_weight``, and they work
in ``Pipeline``, ``GridSearchCV`` and ``cross_val_score``. Training is
:func:`optcc_mpi.glm.fit`.

One process or many
-------------------
Without ``mpiexec`` the communicator is a ``COMM_WORLD`` of size 1 and ``fit`` trains on this
process (no MPI launch needed). Under ``mpiexec -n P`` the same code trains distributed,
with these rules for ``fit`` on every rank:

* every rank of ``comm`` (``COMM_WORLD`` by default) calls ``fit`` with the same full ``X``,
  ``y`` and ``sample_weight``, as scikit-learn users hold them (rows split across ranks are
  not this layout: the data are split by *columns*);
* each rank validates its inputs; if any rank rejects its input, every rank raises (the rank
  that failed re-raises its own exception, the others an ``ArgumentError`` naming it), so no
  rank waits forever. The ranks also check that they hold the same shapes, ``y`` and
  ``sample_weight`` (CRC-32); a different ``X`` with the same shape is not detected;
* each rank keeps the column block ``optcc_mpi.data.column_block(n + 1, P, rank)`` of
  ``[X, 1]`` (the intercept column is the last) and trains its weights; the mini-batches,
  and so the iterates, are the same as on one process (in fp64 equal to roundoff);
* afterwards ``coef_``, ``intercept_``, ``classes_``, ``n_iter_`` and ``result_`` are
  identical on every rank (the weights are all-gathered in float64);
* ``predict``, ``predict_proba``, ``decision_function`` and ``score`` are local: no
  communication, any rank may call them on any rows;
* ``GridSearchCV`` and ``cross_val_score`` work when every rank runs the same search with
  ``n_jobs=1``, so that the collective fits happen in the same order on every rank.

A ``comm`` passed as a parameter is shared (not copied) by ``clone``; an estimator holding
a communicator other than ``COMM_WORLD``/``COMM_SELF`` cannot be pickled.

Parameter mapping to scikit-learn: the objective is ``sum_i sw_i l_i / sum_i sw_i +
(lam/2) ||w||^2`` with the mean over rows (``lam`` is ``SGDClassifier``'s and
``PoissonRegressor``'s ``alpha``). With ``fit_intercept=True`` a column of ones is appended,
so the intercept is penalised by ``lam`` like the other weights (scikit-learn leaves it
unpenalised; the two agree at ``lam = 0``, the default).
"""

from __future__ import annotations

import copy
import numbers
import warnings
from typing import Any

import numpy as np
import scipy.sparse as sp
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin, clone
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils.extmath import safe_sparse_dot
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_array, check_is_fitted, validate_data

from ..errors import ArgumentError, ArgumentTypeError
from .api import FitResult, fit
from .comm import LIBRARY, Group
from .inputs import validation_rows
from .models import MODELS, get_model
from .precision import get_recipe
from .solvers import DIVERGENCE_FACTOR

__all__ = [
    "EXPECTED_FAILED_CHECKS",
    "MINI_BATCH_FAILED_CHECKS",
    "GLM",
    "CASGDClassifier",
    "CASGDRegressor",
    "auto_batch",
    "auto_lr",
    "expected_failed_checks",
]

_DTYPES = [np.float64, np.float32]

_FLOAT32_MARGINS = (
    "below recipe fp64 the classifier trains in float32, so a fit with integer "
    "sample_weight and one on the repeated rows agree to float32 roundoff, not exactly "
    "(on the check's data: margins within 6e-8, probabilities within 1.2e-7 relative); "
    "the check compares decision_function with atol=1e-9 and rtol=1e-7, and the margins "
    "of rows near a class boundary are close to 0, where that tolerance is 50 times finer "
    "than float32 resolves. The objective is the same (the weights enter it exactly as "
    "repeated rows do, tests/test_estimators.py), and with recipe='fp64' both checks pass"
)

_MINI_BATCHES = (
    "with b='auto' the check's 15 rows (27 repeated) train in mini-batches of a few rows, "
    "and a row of weight k then meets the others in other mini-batches than its k copies "
    "do: the same objective, different stochastic iterates (scikit-learn declares the "
    "same of its SGDClassifier and SGDRegressor). In full batch (b >= n_samples) weights "
    "and repetitions give the same iterates and the check passes (tests/test_estimators.py)"
)

#: The scikit-learn checks :class:`CASGDClassifier` is expected to fail with its default
#: recipe (fp32), with the reason, whatever its batch.
EXPECTED_FAILED_CHECKS: dict[str, str] = {
    "check_sample_weight_equivalence_on_dense_data": _FLOAT32_MARGINS,
    "check_sample_weight_equivalence_on_sparse_data": _FLOAT32_MARGINS,
}

#: The checks every estimator with ``b="auto"`` (the default) is expected to fail.
MINI_BATCH_FAILED_CHECKS: dict[str, str] = {
    "check_sample_weight_equivalence_on_dense_data": _MINI_BATCHES,
    "check_sample_weight_equivalence_on_sparse_data": _MINI_BATCHES,
}


def expected_failed_checks(estimator: Any) -> dict[str, str]:
    """The scikit-learn checks ``estimator`` is expected to fail, with the reason each fails.

    scikit-learn (>= 1.6) takes this as ``expected_failed_checks=`` (the mechanism that
    replaced the ``_xfail_checks`` tag): a dict for ``check_estimator`` and this function
    itself for ``parametrize_with_checks``::

        check_estimator(est, expected_failed_checks=expected_failed_checks(est))

        @parametrize_with_checks([CASGDClassifier()], expected_failed_checks=expected_failed_checks)
        def test_sklearn_compatible(estimator, check):
            check(estimator)

    Two checks can fail, the sample-weight-equivalence ones: with ``b="auto"`` (mini-batches
    on the check's few rows, :data:`MINI_BATCH_FAILED_CHECKS`), and for a
    :class:`CASGDClassifier` with a recipe below fp64 (float32 roundoff,
    :data:`EXPECTED_FAILED_CHECKS`). With a batch of at least the check's rows, the
    regressors and the fp64 classifier pass every check.
    """
    out: dict[str, str] = {}
    if isinstance(getattr(estimator, "b", None), str):
        out.update(MINI_BATCH_FAILED_CHECKS)
    if isinstance(estimator, CASGDClassifier):
        try:
            precisions = set(get_recipe(estimator.recipe, estimator.slots).slots().values())
        except (TypeError, ValueError):
            return out  # fit refuses the recipe, in every check alike
        if precisions != {"fp64"}:
            out.update(EXPECTED_FAILED_CHECKS)
    return out


def _collective(group: Group, step: Any) -> Any:
    """Run ``step()`` on every rank; if it raised on any rank, raise on every rank.

    The rank whose step failed re-raises its own exception (type and message unchanged, as
    scikit-learn's checks expect); the others raise an ``ArgumentError`` naming the rank
    (:func:`optcc_mpi.check.agreement.run_everywhere`). On one process no communication at all.
    """
    return group.run_everywhere(step, what="fit stopped on every rank")


#: Rows of the sample on which ``lr="auto"`` estimates the top Hessian eigenvalue.
_AUTO_LR_ROWS = 4096
#: Power iterations of that estimate.
_AUTO_LR_ITERATIONS = 50
#: Curvature of each model's loss in the margin at the start (see :func:`auto_lr`).
_CURVATURE = {"logistic": 0.25, "linear": 1.0}


def _second_moments(X: Any, sample_weight: np.ndarray | None) -> tuple[float, np.ndarray]:
    """``lambda_max`` of ``(1/m) sum_i sw_i x_i x_i^T`` (power iteration on a fixed sample
    of at most 4096 rows) and ``sw_i ||x_i||^2`` of every row (weights normalised to mean 1)."""
    m = X.shape[0]
    sw = np.ones(m) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
    sw = sw * (m / sw.sum())
    if sp.issparse(X):
        sq = np.asarray(X.multiply(X).sum(axis=1), dtype=np.float64).ravel()
    else:
        # Row chunks: a float64 copy of a large float32 X is never made at once.
        sq = np.empty(m)
        for lo in range(0, m, 1 << 16):
            chunk = np.asarray(X[lo : lo + (1 << 16)], dtype=np.float64)
            sq[lo : lo + chunk.shape[0]] = np.einsum("ij,ij->i", chunk, chunk)
    rows = np.arange(m)
    if m > _AUTO_LR_ROWS:
        rows = np.sort(np.random.default_rng(0).choice(m, _AUTO_LR_ROWS, replace=False))
    S, ws = X[rows], sw[rows]
    v = np.random.default_rng(1).normal(size=X.shape[1])
    lam_max = 0.0
    for _ in range(_AUTO_LR_ITERATIONS):
        norm = np.linalg.norm(v)
        if norm == 0.0:
            break
        v = v / norm
        u = np.asarray(safe_sparse_dot(S, v), dtype=np.float64)
        v = np.asarray(safe_sparse_dot(S.T, ws * u), dtype=np.float64).ravel() / len(rows)
        lam_max = float(np.linalg.norm(v))
    return lam_max, sw * sq


def auto_batch(X: Any, sample_weight: np.ndarray | None = None) -> int:
    """The batch size ``b="auto"`` uses: the critical batch ``b* = max_i sw_i ||x_i||^2 /
    lambda_max``, rounded, in ``1 .. n_samples``: where the two terms of
    :func:`auto_lr`'s curvature are equal.

    Derived (ours). With the step of :func:`auto_lr`, ``lr = 1 / (c (lambda_max + R^2 /
    b))`` (``R^2`` the largest weighted squared row norm), an epoch of ``m / b`` steps
    moves the weights by about ``m lr / b = m / (c (b lambda_max + R^2))``: nearly the same
    for every ``b`` below ``b*`` (the row term sets the step, which grows with ``b``), then
    falling like ``1 / b``. An epoch costs ``m / b`` times a step's fixed cost (the
    trainer's own overhead and, on several ranks, an AllReduce or ``1/s`` of one) plus
    work per row, so below ``b*`` a larger batch only saves, and above it every epoch does
    less. ``b*`` is where the saving ends (an epoch there does half the progress of the
    smallest batches, with ``b*`` times fewer steps). The rule depends on the data alone:
    the sample sequence, and so the iterates, are the same on every machine and every
    number of ranks.
    """
    lam_max, wsq = _second_moments(X, sample_weight)
    if not lam_max > 0:
        return 1
    b = int(round(float(np.max(wsq)) / lam_max))
    return max(1, min(b, X.shape[0]))


def auto_lr(
    X: Any, y: np.ndarray, model: str, b: int, sample_weight: np.ndarray | None = None
) -> float:
    """The step size ``lr="auto"`` uses: ``1 / (c (lambda_max + max_i sw_i ||x_i||^2 / b))``.

    Derived (ours). The mean loss of a mini-batch ``B`` has Hessian ``(c / b) sum_{i in B}
    sw_i x_i x_i^T`` with ``c`` the loss's curvature in the margin (1/4 at most for
    logistic, 1 for least squares, the mean rate for Poisson, taken as ``max(1, mean y)``,
    a heuristic). Its largest eigenvalue is at most about the full data's, ``c
    lambda_max``, plus one row's share, ``c max_i sw_i ||x_i||^2 / b``; one over that sum
    is a step that neither full-batch descent (``b = m``) nor single-row SGD (``b = 1``,
    where the row term dominates) overshoots, on any scaling of the features. In full batch
    (``b >= m``) the batch's Hessian is the full one and the row term is 0: the step is
    ``1 / (c lambda_max)``, and a weight of k gives the same step as k copies of the row.
    ``lambda_max`` of ``(1/m) sum_i sw_i x_i x_i^T`` is estimated by power iteration on a
    fixed sample of at most 4096 rows.

    Parameters
    ----------
    X : ndarray or sparse matrix, shape (m, n)
        Training rows (intercept column included).
    y : ndarray
        Targets as trained (for Poisson's mean).
    model : str
        ``logistic``, ``linear`` or ``poisson``.
    b : int
        Mini-batch size.
    sample_weight : ndarray, optional
        Row weights (any scale: normalised to mean 1 here).
    """
    m = X.shape[0]
    lam_max, wsq = _second_moments(X, sample_weight)
    # In full batch the mini-batch Hessian is the full one: no row can dominate a batch, and
    # the step no longer depends on how the weights are spread (a weight of k equals k
    # copies of the row).
    row_term = float(np.max(wsq)) / b if b < m else 0.0
    if model == "poisson":
        sw = np.ones(m) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        c = max(1.0, float(np.sum(sw * y) / np.sum(sw)))
    else:
        c = _CURVATURE[model]
    scale = c * (lam_max + row_term)
    return 1.0 / scale if scale > 0 and np.isfinite(scale) else 1.0


def _with_intercept(X: Any) -> Any:
    """``[X, 1]``: X with a last column of ones, sparse or dense, in X's dtype."""
    ones = np.ones((X.shape[0], 1), dtype=X.dtype)
    if sp.issparse(X):
        return sp.hstack([X, sp.csr_matrix(ones)], format="csr")
    return np.hstack([X, ones])


class _BaseGLM(BaseEstimator):
    """Shared machinery: parameters, validation, the collective fit, the margins."""

    #: Models an estimator accepts (``model`` parameter).
    _models: tuple[str, ...] = tuple(MODELS)

    # -- parameters ----------------------------------------------------------------------

    def _model_name(self) -> str:
        return str(self.model).lower()

    def _check_params(self) -> None:
        """Validate what :func:`optcc_mpi.glm.fit` does not see or sees only after clipping."""
        given = getattr(self, "model", self._model_name())  # the classifier has no param
        if not isinstance(given, str) or self._model_name() not in self._models:
            raise ArgumentError(
                f"{type(self).__name__} fits the models {', '.join(self._models)}; "
                f"got model={given!r}"
            )
        lr = self.lr
        if not (isinstance(lr, str) and lr == "auto"):
            if isinstance(lr, (bool, str)) or not isinstance(lr, numbers.Real) or not lr > 0:
                raise ArgumentError(f'lr must be "auto" or a number > 0, got {lr!r}')
        for key in ("s", "b"):
            value = getattr(self, key)
            if isinstance(value, str) and value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ArgumentError(f'{key} must be "auto" or an integer >= 1, got {value!r}')
        if self.epochs is not None:
            e = self.epochs
            if isinstance(e, bool) or not isinstance(e, numbers.Integral) or e < 1:
                raise ArgumentError(f"epochs must be an integer >= 1 (or None), got {e!r}")
        if not isinstance(self.fit_intercept, (bool, np.bool_)):
            raise ArgumentTypeError(
                f"fit_intercept must be True or False, got {self.fit_intercept!r}"
            )

    def __sklearn_clone__(self) -> _BaseGLM:
        # scikit-learn deep-copies every parameter, and a user communicator cannot be
        # copied (nor should it be: the clone must train on the same ranks). Share it.
        params = self.get_params(deep=False)
        new = type(self)(
            **{k: (v if k == "comm" else clone(v, safe=False)) for k, v in params.items()}
        )
        if hasattr(self, "_metadata_request"):
            new._metadata_request = copy.deepcopy(self._metadata_request)
        if hasattr(self, "_sklearn_output_config"):
            new._sklearn_output_config = copy.deepcopy(self._sklearn_output_config)
        return new

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = True
        return tags

    # -- fitting -------------------------------------------------------------------------

    def _encode_targets(self, y: np.ndarray, sample_weight: np.ndarray | None) -> np.ndarray:
        """Targets for :func:`optcc_mpi.glm.fit` (the model checks their domain)."""
        return y

    def _validate(self, X: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
        self._check_params()
        X, y = validate_data(
            self,
            X,
            y,
            accept_sparse="csr",
            dtype=_DTYPES,
            y_numeric=not isinstance(self, ClassifierMixin),
        )
        sw = None
        if sample_weight is not None:
            sw = _weights(sample_weight, X.shape[0], non_negative=True)
        targets = self._encode_targets(y, sw)
        if self._model_name() != "logistic":
            get_model(self._model_name()).check_labels(targets)  # a clear error here
        return X, targets, sw

    def fit(self, X: Any, y: Any, sample_weight: Any = None) -> Any:
        """Train on ``X`` and ``y``; collective over ``comm`` (see the module docstring).

        Parameters
        ----------
        X : {array-like, sparse matrix} of shape (n_samples, n_features)
            Training rows, the same on every rank.
        y : array-like of shape (n_samples,)
            Targets, the same on every rank.
        sample_weight : array-like of shape (n_samples,), optional
            Non-negative row weights, the same on every rank. A weight of 2 counts the row
            twice in the objective (in full batch exactly a duplicated row).

        Returns
        -------
        self
            Fitted; ``coef_``, ``intercept_`` and ``result_`` equal on every rank.

        Raises
        ------
        ValueError, TypeError
            On every rank, for invalid input or parameters on any rank.
        optcc_mpi.errors.DivergenceError
            On every rank, when training diverges (see ``divergence_factor``).
        """
        group = Group(self.comm)  # a TypeError at once for anything but a communicator
        X, targets, sw = _collective(group, lambda: self._validate(X, y, sample_weight))
        m = X.shape[0]
        Xa = _with_intercept(X) if self.fit_intercept else X
        m_train = m
        fraction = self.validation_fraction
        if self.early_stopping and isinstance(fraction, numbers.Real) and 0 < fraction < 1:
            # The batch must fit the rows trained on: those left after the validation rows
            # (fit checks the fraction itself; a bad one fails there on every rank).
            held = validation_rows(
                targets, float(fraction), self.seed, stratify=self._model_name() == "logistic"
            )
            m_train = max(1, m - held.size)
        # Defaults that work on small data: a batch no larger than the data (and, given as
        # a number, as many steps per outer iteration as one epoch holds, at least 1).
        b = self.b
        if isinstance(b, str):
            b = auto_batch(Xa, sw)
        b = max(1, min(int(b), m_train))
        s = self.s if isinstance(self.s, str) else max(1, min(int(self.s), m_train // b))
        lr = self.lr
        if isinstance(lr, str) and lr == "auto":
            lr = auto_lr(Xa, targets, self._model_name(), b, sw)
        # Every rank computed b and lr from the same data; rank 0's values make the steps,
        # and so the iterates, bit-identical across ranks whatever the BLAS does.
        b, lr = group.allgather((b, lr))[0]
        if self.epochs is not None:
            warnings.warn(
                f"epochs={self.epochs} is deprecated and will be removed: use "
                f"max_iter={self.epochs}, tol=None for exactly that many epochs (or the "
                "defaults, which stop when the loss stops improving)",
                FutureWarning,
                stacklevel=2,
            )
            max_iter, tol = int(self.epochs), None
        else:
            max_iter, tol = self.max_iter, self.tol
        res: FitResult = fit(
            Xa,
            targets,
            model=self._model_name(),
            solver=self.solver,
            s=s,
            b=b,
            lr=lr,
            max_iter=max_iter,
            tol=tol,
            n_iter_no_change=self.n_iter_no_change,
            learning_rate=self.learning_rate,
            early_stopping=self.early_stopping,
            validation_fraction=self.validation_fraction,
            lam=self.lam,
            seed=self.seed,
            recipe=self.recipe,
            slots=self.slots,
            comm=group.comm,
            allreduce=self.allreduce,
            links=self.links,
            emulate=self.emulate,
            device=self.device,
            sample_weight=sw,
            divergence_factor=self.divergence_factor,
            progress=bool(self.verbose),
        )
        coef = res.coef
        n = X.shape[1]
        self._set_coef(coef[:n], coef[n] if self.fit_intercept else np.zeros(coef.shape[1:]))
        self.s_ = int(res.config["s"])
        self.b_ = b
        self.lr_ = float(lr)
        self.n_iter_ = int(res.n_iter)
        self.stop_reason_ = res.stop_reason
        self.result_ = res
        if res.stop_reason == "max_iter" and tol is not None:
            warnings.warn(
                f"{type(self).__name__}: the maximum number of epochs (max_iter={max_iter}) "
                f"was reached before the loss stopped improving by tol={tol:g}; consider "
                "increasing max_iter",
                ConvergenceWarning,
                stacklevel=2,
            )
        return self

    def _set_coef(self, coef: np.ndarray, intercept: np.ndarray) -> None:
        self.coef_ = coef
        self.intercept_ = float(intercept)

    # -- prediction (local) --------------------------------------------------------------

    def _margins(self, X: Any) -> np.ndarray:
        check_is_fitted(self)
        X = validate_data(self, X, accept_sparse="csr", dtype=_DTYPES, reset=False)
        return np.asarray(safe_sparse_dot(X, self.coef_.T), dtype=np.float64) + self.intercept_


_PARAMS_DOC = """
    solver : {"casgd", "sgd"}, default="casgd"
        CA-SGD (one AllReduce per ``s`` steps) or SGD (one per step); same iterates in
        exact arithmetic.
    s : int or "auto", default="auto"
        Steps per CA-SGD outer iteration. ``"auto"``: the fastest by the cost model
        (:mod:`optcc_mpi.glm.auto`): 1 on one process, where there is no communication
        to save; on several, the argmin of the modelled time per step. A number is
        clipped to the steps one epoch holds. Fitted value in ``s_``.
    b : int or "auto", default="auto"
        Mini-batch size. ``"auto"``: the stable rank of the rows' second moment
        (:func:`optcc_mpi.glm.estimator.auto_batch`: the largest batch that still makes
        full progress per epoch). Clipped to the training rows; fitted value in ``b_``
        (``b >= n_samples`` is full-batch gradient descent).
    lr : float or "auto", default="auto"
        Step size: the step is ``lr`` times the mean gradient of the mini-batch (the first
        step with ``learning_rate="adaptive"``). ``"auto"`` derives it from the data
        (:func:`optcc_mpi.glm.estimator.auto_lr`: one over the curvature of a
        mini-batch's loss, safe on any feature scaling); the value used is ``lr_``.
    max_iter : int, default=1000
        Epochs at most. When they end the fit with ``tol`` set, a
        ``sklearn.exceptions.ConvergenceWarning`` is raised.
    tol : float or None, default=1e-3
        The stopping criterion: training stops after ``n_iter_no_change`` epochs whose
        training loss (validation score with ``early_stopping``) did not improve on the
        best by ``tol``; None runs ``max_iter`` epochs.
    n_iter_no_change : int, default=5
        Epochs without improvement before the step is divided or training stops.
    learning_rate : {"adaptive", "constant"}, default="adaptive"
        ``adaptive``: at each plateau the step is divided by 5, and training stops at a
        plateau once the last division improved the criterion by less than ``tol``;
        ``constant``: the first plateau stops training.
    early_stopping : bool, default=False
        Hold out ``validation_fraction`` of the rows (stratified for the classifier) and
        stop on their score (accuracy; R^2 or D^2 for the regressors).
    validation_fraction : float, default=0.1
        Share of the rows held out with ``early_stopping``.
    epochs : int, optional
        Deprecated (``FutureWarning``): ``max_iter=epochs, tol=None``, exactly that many
        epochs, as before the stopping rule existed.
    lam : float, default=0.0
        L2 strength (scikit-learn's ``alpha``), applied to the intercept as well.
    fit_intercept : bool, default=True
        Append a column of ones (the intercept is then the last weight).
    recipe : str, default="fp32"
        Precision recipe: ``fp64``, ``fp32``, ``C`` (bf16 data, margins and Gram inputs),
        ``D`` (C communicated in bf16).
    slots : list of str, optional
        Per-slot precision overrides, e.g. ``["comm=bf16"]``.
    seed : int, default=0
        Seed of the sample sequence (shared by every rank); results are deterministic.
    divergence_factor : float or None, default=10.0
        Stop with ``optcc_mpi.errors.DivergenceError`` when the loss recorded at an epoch
        end exceeds this many times its best value so far and its starting value; None
        keeps only the NaN/inf check.
    verbose : bool, default=False
        Progress bar on rank 0.
    comm : mpi4py communicator or torch.distributed.ProcessGroup, optional
        The ranks that train together: by default torch.distributed's default group when
        it is initialised, else ``MPI.COMM_WORLD``. Over a process group the training
        runs on torch tensors on the group's device (gloo: CPU, NCCL: GPU).
    allreduce : str or callable, default="native"
        AllReduce to use (see :func:`optcc_mpi.glm.fit`): ``native`` is the library's own.
    links, emulate : optional
        Link profile and network emulation passed to the AllReduce.
    device : {"cpu", "gpu", "auto"}, optional
        Over MPI where the local kernels run (default the CPU; ``gpu``: CuPy). Over a
        process group the group's device (checked against this when given).
"""

_ATTRS_DOC = """
    n_features_in_ : int
        Columns seen in ``fit``.
    feature_names_in_ : ndarray of str
        Column names, when ``X`` had string column names.
    s_, b_ : int
        Steps per outer iteration and batch size actually used (chosen, or clipped).
    lr_ : float
        Initial step size used (``lr``, or the ``"auto"`` value).
    n_iter_ : int
        Epochs run.
    stop_reason_ : str
        Why training stopped: ``converged``, ``no_validation_improvement`` or
        ``max_iter`` (``result_.stop_text`` in words).
    result_ : FitResult
        What :func:`optcc_mpi.glm.fit` recorded: loss history, AllReduce counts and
        bytes, time split, settings.
"""


class GLM(RegressorMixin, _BaseGLM):
    __doc__ = f"""A generalized linear model trained by SGD or CA-SGD over MPI.

    Predicts the conditional mean ``E[y | x]`` (probability for ``logistic``, value for
    ``linear``, rate for ``poisson``); ``score`` is ``D^2``, the fraction of the model's
    deviance explained (``R^2`` for ``linear``). :class:`CASGDClassifier` and
    :class:`CASGDRegressor` are the estimators to use in scikit-learn's tools; ``GLM``
    is their common base and fits any model.

    Parameters
    ----------
    model : {{"logistic", "linear", "poisson"}}, default="logistic"
        The model: targets in {{0, 1}} (or {{-1, +1}}), real, or non-negative real.
    {_PARAMS_DOC.strip()}

    Attributes
    ----------
    coef_ : ndarray of shape (n_features,)
        Weights (float64), the same on every rank.
    intercept_ : float
        Intercept (0.0 with ``fit_intercept=False``).
    {_ATTRS_DOC.strip()}

    Examples
    --------
    A Poisson regression, beside scikit-learn's own on the same data:

    >>> from sklearn.linear_model import PoissonRegressor
    >>> from optcc_mpi.glm import GLM, make_glm_data
    >>> X, y = make_glm_data("poisson", 2000, 8, seed=0, dtype="float64")
    >>> glm = GLM("poisson").fit(X, y)
    >>> bool((glm.predict(X) > 0).all())  # rates
    True
    >>> ref = PoissonRegressor(alpha=0).fit(X, y)
    >>> abs(glm.score(X, y) - ref.score(X, y)) < 1e-3  # D^2 of both
    True
    """

    def __init__(
        self,
        model: str = "logistic",
        *,
        solver: str = "casgd",
        s: int | str = "auto",
        b: int | str = "auto",
        lr: float | str = "auto",
        max_iter: int = 1000,
        tol: float | None = 1e-3,
        n_iter_no_change: int = 5,
        learning_rate: str = "adaptive",
        early_stopping: bool = False,
        validation_fraction: float = 0.1,
        epochs: int | None = None,
        lam: float = 0.0,
        fit_intercept: bool = True,
        recipe: str = "fp32",
        slots: list[str] | None = None,
        seed: int = 0,
        divergence_factor: float | None = DIVERGENCE_FACTOR,
        verbose: bool = False,
        comm: Any = None,
        allreduce: Any = LIBRARY,
        links: Any = None,
        emulate: Any = None,
        device: str | None = None,
    ) -> None:
        self.model = model
        self.solver = solver
        self.s = s
        self.b = b
        self.lr = lr
        self.max_iter = max_iter
        self.tol = tol
        self.n_iter_no_change = n_iter_no_change
        self.learning_rate = learning_rate
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.epochs = epochs
        self.lam = lam
        self.fit_intercept = fit_intercept
        self.recipe = recipe
        self.slots = slots
        self.seed = seed
        self.divergence_factor = divergence_factor
        self.verbose = verbose
        self.comm = comm
        self.allreduce = allreduce
        self.links = links
        self.emulate = emulate
        self.device = device

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        tags.target_tags.positive_only = self._model_name() == "poisson"
        return tags

    def predict(self, X: Any) -> np.ndarray:
        """Predicted mean: probability (logistic), value (linear), rate (poisson)."""
        return get_model(self._model_name()).mean(self._margins(X))

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """``D^2``: fraction of the model's deviance explained (``R^2`` for linear).

        ``1 - dev(model) / dev(null)`` where the null model predicts the (weighted) mean
        of ``y``; the deviance is the model's loss (squared error, log loss, Poisson
        deviance). Local, no communication.
        """
        if self._model_name() == "linear":
            return float(super().score(X, y, sample_weight=sample_weight))
        z = self._margins(X)
        mdl = get_model(self._model_name())
        y = mdl.check_labels(np.asarray(y).ravel())
        if y.shape[0] != z.shape[0]:
            raise ArgumentError(f"X has {z.shape[0]} rows but y has {y.shape[0]} values")
        sw = None
        if sample_weight is not None:
            sw = _weights(sample_weight, z.shape[0])
        return mdl.d2(z, y, sw)


def _weights(sample_weight: Any, n_rows: int, *, non_negative: bool = False) -> np.ndarray:
    """``sample_weight`` as float64 of shape ``(n_rows,)``: a number is given to every row;
    an array-like is validated by scikit-learn's public ``check_array`` (finite, numeric)
    and must be one-dimensional with one weight per row. ``non_negative``: refuse a
    negative weight (the losses are weighted sums that must stay convex).

    Raises ValueError (scikit-learn's convention, which its estimator checks expect)."""
    if isinstance(sample_weight, numbers.Number):
        sample_weight = np.full(n_rows, float(sample_weight))
    sw = check_array(
        sample_weight, ensure_2d=False, dtype=np.float64, order="C", input_name="sample_weight"
    )
    if sw.ndim != 1 or sw.shape[0] != n_rows:
        raise ArgumentError(
            f"sample_weight has shape {sw.shape}; expected one weight per row, shape ({n_rows},)"
        )
    if non_negative and bool((sw < 0).any()):
        raise ArgumentError(f"sample_weight has {int((sw < 0).sum())} negative value(s)")
    if n_rows and not bool(sw.any()):
        raise ArgumentError("sample_weight is zero for every row: nothing to fit or score")
    return sw


class CASGDRegressor(GLM):
    __doc__ = f"""Linear or Poisson regression trained by SGD or CA-SGD over MPI.

    ``predict`` returns the mean (value, or rate ``exp(margin)`` for Poisson); ``score``
    is ``R^2`` for linear and ``D^2`` (Poisson deviance explained, as
    ``PoissonRegressor.score``) for Poisson. Poisson targets may be any non-negative
    numbers, integer or not. See the module docstring for ``fit`` under ``mpiexec``.

    Parameters
    ----------
    model : {{"linear", "poisson"}}, default="linear"
        Least squares, or Poisson with log link.
    {_PARAMS_DOC.strip()}

    Attributes
    ----------
    coef_ : ndarray of shape (n_features,)
        Weights (float64), the same on every rank.
    intercept_ : float
        Intercept (0.0 with ``fit_intercept=False``).
    {_ATTRS_DOC.strip()}

    Examples
    --------
    >>> from sklearn.pipeline import make_pipeline
    >>> from sklearn.preprocessing import StandardScaler
    >>> from optcc_mpi.glm import CASGDRegressor, make_glm_data
    >>> X, y = make_glm_data("linear", 512, 8, seed=0, dtype="float64")
    >>> reg = make_pipeline(StandardScaler(), CASGDRegressor()).fit(X, y)
    >>> reg.score(X, y) > 0.9
    True
    """

    _models = ("linear", "poisson")

    def __init__(
        self,
        model: str = "linear",
        *,
        solver: str = "casgd",
        s: int | str = "auto",
        b: int | str = "auto",
        lr: float | str = "auto",
        max_iter: int = 1000,
        tol: float | None = 1e-3,
        n_iter_no_change: int = 5,
        learning_rate: str = "adaptive",
        early_stopping: bool = False,
        validation_fraction: float = 0.1,
        epochs: int | None = None,
        lam: float = 0.0,
        fit_intercept: bool = True,
        recipe: str = "fp32",
        slots: list[str] | None = None,
        seed: int = 0,
        divergence_factor: float | None = DIVERGENCE_FACTOR,
        verbose: bool = False,
        comm: Any = None,
        allreduce: Any = LIBRARY,
        links: Any = None,
        emulate: Any = None,
        device: str | None = None,
    ) -> None:
        super().__init__(
            model,
            solver=solver,
            s=s,
            b=b,
            lr=lr,
            max_iter=max_iter,
            tol=tol,
            n_iter_no_change=n_iter_no_change,
            learning_rate=learning_rate,
            early_stopping=early_stopping,
            validation_fraction=validation_fraction,
            epochs=epochs,
            lam=lam,
            fit_intercept=fit_intercept,
            recipe=recipe,
            slots=slots,
            seed=seed,
            divergence_factor=divergence_factor,
            verbose=verbose,
            comm=comm,
            allreduce=allreduce,
            links=links,
            emulate=emulate,
            device=device,
        )


class CASGDClassifier(ClassifierMixin, _BaseGLM):
    __doc__ = f"""Logistic regression trained by SGD or CA-SGD over MPI; any number of classes.

    Multiclass: **one-vs-rest, trained jointly**. With ``K > 2`` classes, ``K`` binary
    logistic problems (class ``k`` against the rest) are trained at once on the same
    mini-batches: every AllReduce carries the ``K`` margin columns and the one Gram matrix
    they share, so ``K`` classes cost one Gram per outer iteration, not ``K``. Each
    column equals the binary fit of its class (to roundoff). ``predict_proba`` normalises
    the ``K`` sigmoid probabilities to sum to 1; ``predict`` is the class of the largest
    margin. Two classes train one problem (``classes_[1]`` is the positive class).

    ``score`` is the (weighted) accuracy. See the module docstring for ``fit`` under
    ``mpiexec``.

    Parameters
    ----------
    {_PARAMS_DOC.strip()}

    Attributes
    ----------
    classes_ : ndarray of shape (n_classes,)
        The labels seen in ``fit``, sorted.
    coef_ : ndarray of shape (1, n_features) or (n_classes, n_features)
        Weights (float64), the same on every rank; one row for two classes.
    intercept_ : ndarray of shape (1,) or (n_classes,)
        Intercepts (zeros with ``fit_intercept=False``).
    {_ATTRS_DOC.strip()}

    Examples
    --------
    >>> from sklearn.datasets import load_iris
    >>> from sklearn.pipeline import make_pipeline
    >>> from sklearn.preprocessing import StandardScaler
    >>> from optcc_mpi.glm import CASGDClassifier
    >>> X, y = load_iris(return_X_y=True)
    >>> clf = make_pipeline(StandardScaler(), CASGDClassifier()).fit(X, y)
    >>> clf.score(X, y) > 0.9
    True
    """

    def __init__(
        self,
        *,
        solver: str = "casgd",
        s: int | str = "auto",
        b: int | str = "auto",
        lr: float | str = "auto",
        max_iter: int = 1000,
        tol: float | None = 1e-3,
        n_iter_no_change: int = 5,
        learning_rate: str = "adaptive",
        early_stopping: bool = False,
        validation_fraction: float = 0.1,
        epochs: int | None = None,
        lam: float = 0.0,
        fit_intercept: bool = True,
        recipe: str = "fp32",
        slots: list[str] | None = None,
        seed: int = 0,
        divergence_factor: float | None = DIVERGENCE_FACTOR,
        verbose: bool = False,
        comm: Any = None,
        allreduce: Any = LIBRARY,
        links: Any = None,
        emulate: Any = None,
        device: str | None = None,
    ) -> None:
        self.solver = solver
        self.s = s
        self.b = b
        self.lr = lr
        self.max_iter = max_iter
        self.tol = tol
        self.n_iter_no_change = n_iter_no_change
        self.learning_rate = learning_rate
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.epochs = epochs
        self.lam = lam
        self.fit_intercept = fit_intercept
        self.recipe = recipe
        self.slots = slots
        self.seed = seed
        self.divergence_factor = divergence_factor
        self.verbose = verbose
        self.comm = comm
        self.allreduce = allreduce
        self.links = links
        self.emulate = emulate
        self.device = device

    def _model_name(self) -> str:
        return "logistic"

    def _encode_targets(self, y: np.ndarray, sample_weight: np.ndarray | None) -> np.ndarray:
        check_classification_targets(y)
        classes = np.unique(y)
        if classes.size < 2:
            raise ArgumentError(
                f"y has only one class ({classes[0]!r} for every row); a classifier needs "
                "samples of at least two classes"
            )
        if sample_weight is not None:
            weighted = [c for c in classes if sample_weight[y == c].sum() > 0]
            if len(weighted) < 2:
                raise ArgumentError(
                    f"sample_weight leaves only one class with positive weight ({weighted}); "
                    "a classifier needs at least two classes"
                )
        self.classes_ = classes
        if classes.size == 2:
            return (y == classes[1]).astype(np.float64)
        return (y[:, None] == classes[None, :]).astype(np.float64)

    def _set_coef(self, coef: np.ndarray, intercept: np.ndarray) -> None:
        # coef is (n,) for two classes and (n, K) for K; scikit-learn's layout is (., n).
        self.coef_ = np.ascontiguousarray(np.atleast_2d(coef.T)) if coef.ndim == 2 else coef[None]
        self.intercept_ = np.atleast_1d(np.asarray(intercept, dtype=np.float64)).copy()

    def decision_function(self, X: Any) -> np.ndarray:
        """Margins: shape (n_samples,) for two classes (positive: ``classes_[1]``),
        (n_samples, n_classes) otherwise. Local, no communication."""
        z = self._margins(X)
        return z[:, 0] if self.classes_.size == 2 else z

    def predict_proba(self, X: Any) -> np.ndarray:
        """Class probabilities, shape (n_samples, n_classes); each row sums to 1.

        Two classes: ``[1 - p, p]`` with ``p = sigmoid(margin)``. More: the one-vs-rest
        sigmoids normalised to sum to 1 (computed from log-sigmoids, so that rows whose
        sigmoids all underflow still get finite probabilities).
        """
        z = self.decision_function(X)
        if z.ndim == 1:
            p = get_model("logistic").mean(z)
            return np.column_stack([1.0 - p, p])
        log_p = -np.logaddexp(0.0, -z)  # log sigmoid(z), stable for any z
        log_p -= log_p.max(axis=1, keepdims=True)
        p = np.exp(log_p)
        return p / p.sum(axis=1, keepdims=True)

    def predict_log_proba(self, X: Any) -> np.ndarray:
        """Logarithm of :meth:`predict_proba`."""
        with np.errstate(divide="ignore"):
            return np.log(self.predict_proba(X))

    def predict(self, X: Any) -> np.ndarray:
        """Predicted labels (from ``classes_``): the class of the largest margin."""
        z = self.decision_function(X)
        if z.ndim == 1:
            return self.classes_[(z > 0).astype(int)]
        return self.classes_[np.argmax(z, axis=1)]
