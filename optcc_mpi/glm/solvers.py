"""SGD and CA-SGD in the 1D block-column layout, and the training loop around them.

SGD step (every rank, identical mini-batch ``B``)::

    z_p = X[B, C_p] @ w[C_p]                 partial margins, length b
    z   = AllReduce(z_p)                     one AllReduce per step
    w[C_p] = q w[C_p] - (eta/b) X[B, C_p]^T residual(z, y[B]),   q = 1 - eta*lambda

CA-SGD outer iteration of ``s`` steps (``Y`` = the ``s`` stacked mini-batches, ``sb`` rows)::

    [r; G] = AllReduce([Y_p @ w_p ; Y_p @ Y_p^T])        one AllReduce per s steps
    z_j    = q^j r_j - (eta/b) sum_{t<j} q^(j-1-t) G_jt delta_t     (replayed on every rank)
    delta_j = residual(z_j, y_j)
    w_p    = q^s w_p - (eta/b) sum_t q^(s-1-t) Y_tp^T delta_t

In exact arithmetic both produce the same iterates for the same sample sequence
(``docs/casgd.md`` derives it; the tests check it to 1e-12 in fp64).

Sample weights scale each residual: ``delta_i = wt_i residual(z_i, y_i)`` with the weights
normalised to mean 1 over the training rows, so that the full-batch step is the gradient of
the weighted mean loss ``sum_i wt_i l_i / sum_i wt_i``. The scaling is linear in ``delta``,
so it enters the CA-SGD correction sums and the update exactly as in SGD.

Several outputs. ``y`` of shape ``(m, K)`` trains ``K`` independent problems on the same
rows at once (one-vs-rest multiclass): the weights become ``(n, K)``, the margins ``b x K``,
and CA-SGD sends the ``K`` margin columns with the one Gram matrix, which all ``K``
problems share.

Arrays. The kernels (:class:`~optcc_mpi.glm.kernels.LocalData` on NumPy, CuPy or SciPy
CSR; :class:`~optcc_mpi.glm.torch_kernels.TorchLocalData` on PyTorch tensors) say where the
trainer's own arrays live: on the host in NumPy under MPI, on the group's device in torch
under ``torch.distributed``. The code below is the same for both: it calls the kernels,
slices, multiplies and reduces, and every function it applies (the residuals, the
rounding) takes either kind.

When training stops (:class:`Stopping`, after every epoch): ``max_iter`` epochs; or, with
``tol`` set, ``n_iter_no_change`` epochs in a row whose criterion (the training objective,
or minus the validation score with ``early_stopping``) did not improve on the best so far
by ``tol``. With ``learning_rate="adaptive"`` such a plateau first divides the step by 5,
and training stops at a plateau only when the last division bought less than ``tol``
(ours; scikit-learn's "adaptive" divides until the step is below 1e-6).

Divergence (:meth:`Trainer.run`): besides non-finite residuals or losses, a recorded loss
above ``divergence_factor`` times the best recorded loss *and* above the starting loss stops
training with :class:`~optcc_mpi.errors.DivergenceError` on every rank (the loss is the
reduced value, identical on every rank, so every rank decides the same).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.linalg import solve_triangular

from ..errors import ArgumentError, DivergenceError
from .comm import Group, Reducer
from .models import Model
from .precision import Recipe, as_compute, is_half, is_tensor, rounded, torch_dtype
from .precision import compute_dtype as _compute_dtype
from .sampler import Sampler

__all__ = [
    "DIVERGENCE_FACTOR",
    "EXIT_AFTER_ENV",
    "LEARNING_RATES",
    "SOLVERS",
    "STOP_REASONS",
    "DivergenceError",
    "Stopping",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "casgd_recurrence",
    "least_squares_deltas",
]

SOLVERS = ("sgd", "casgd")
#: Step-size schedules: the same step throughout, or divided by 5 at each plateau.
LEARNING_RATES = ("constant", "adaptive")

#: Environment variable: exit the process (status 75) after this many outer iterations.
#: Used to test that ``resume`` continues a killed run exactly.
EXIT_AFTER_ENV = "OPTCC_GLM_EXIT_AFTER"
EXIT_AFTER_STATUS = 75

#: Default of ``divergence_factor``: a recorded loss above this many times the best one
#: (and above the starting loss) stops training as diverged.
DIVERGENCE_FACTOR = 10.0

#: Why training stopped, in words (``FitResult.stop_reason`` is the key).
STOP_REASONS = {
    "converged": "the training loss improved by less than tol for n_iter_no_change epochs",
    "no_validation_improvement": (
        "the validation score improved by less than tol for n_iter_no_change epochs"
    ),
    "max_iter": "max_iter epochs were run",
}

#: At most this many divisions of the step by 5 (``learning_rate="adaptive"``).
MAX_STEP_CUTS = 8


def _empty_like(a: Any, precision: str) -> Any:
    """An uninitialised array shaped like ``a`` in ``precision``'s arithmetic dtype, of
    ``a``'s kind (NumPy or tensor, on ``a``'s device)."""
    if is_tensor(a):
        return a.new_empty(a.shape, dtype=torch_dtype(precision))
    return np.empty(a.shape, dtype=_compute_dtype(precision))


def casgd_recurrence(
    r: Any,
    G_lower: Any,
    y: Any,
    residual: Callable[[Any, Any], Any],
    eta: float,
    b: int,
    s: int,
    q: float = 1.0,
    precision: str = "fp64",
    weights: Any = None,
    on_margins: Callable[[Any, int, int], None] | None = None,
) -> Any:
    """The inner recurrence of one CA-SGD outer iteration (identical on every rank).

    Parameters
    ----------
    r : ndarray or tensor, shape (s*b,) or (s*b, K)
        Reduced base margins ``Y @ w_k`` (one column per output).
    G_lower : ndarray or tensor
        Reduced strictly block-lower Gram blocks, packed as in
        :func:`~optcc_mpi.glm.kernels.lower_block_index`.
    y : ndarray or tensor, shape like ``r``
        Labels of the ``s`` mini-batches.
    residual : callable
        The model's ``residual(z, y)``.
    eta, b, s : float, int, int
        Step size, batch size, steps.
    q : float
        ``1 - eta*lambda`` (1 without L2).
    precision : str
        Precision of the recurrence: its operands are expected already rounded to it;
        for 16-bit formats every intermediate is rounded again.
    weights : ndarray or tensor, shape (s*b,), optional
        Sample weights of the rows (normalised to mean 1 over the training set); each
        residual is multiplied by its row's weight.
    on_margins : callable, optional
        ``on_margins(z, lo, hi)`` with the margins ``z`` that step ``j`` sees, rows
        ``lo:hi`` of the outer iteration (the running loss of the progress line).

    Returns
    -------
    ndarray or tensor, shape like ``r``
        The residuals ``delta_j`` of the ``s`` steps, in the recurrence's compute dtype.
        All arrays are of ``r``'s kind: NumPy, or tensors on ``r``'s device.
    """
    half = is_half(precision)
    # Python floats in the arithmetic: a float32 array times a Python float stays float32
    # (the scalar is rounded to float32 first), in NumPy and in torch alike.
    scale = eta / b
    y = as_compute(y, precision)
    if weights is not None:
        weights = as_compute(weights, precision)
        if r.ndim == 2:
            weights = weights[:, None]
    delta = _empty_like(r, precision)
    # u[t] = (eta/b) q^(j-1-t) delta_t: the coefficients of the correction sum at step j.
    u = _empty_like(r, precision)
    for j in range(s):
        lo, hi = j * b, (j + 1) * b
        z = r[lo:hi]
        if q != 1.0 and j:
            z = z * (q**j)
        if j:
            off = b * b * j * (j - 1) // 2
            Gj = G_lower[off : off + b * lo].reshape(b, lo)
            corr = Gj @ u[:lo]
            if half:
                corr = rounded(corr, precision)
            z = z - corr
        if half:
            z = rounded(z, precision)
        if on_margins is not None:
            on_margins(z, lo, hi)
        d = residual(z, y[lo:hi])
        if weights is not None:
            d = d * weights[lo:hi]
        delta[lo:hi] = rounded(d, precision) if half else d
        if j + 1 < s:
            if q != 1.0:
                u[:lo] *= q
            u[lo:hi] = scale * delta[lo:hi]
            if half:
                u[lo:hi] = rounded(u[lo:hi], precision)
    return delta


def least_squares_deltas(
    r: np.ndarray, G: np.ndarray, y: np.ndarray, eta: float, b: int, s: int, q: float = 1.0
) -> np.ndarray:
    """Closed form of the least-squares recurrence: one block-triangular solve.

    With ``delta = z - y`` the recurrence is linear:
    ``(I + (eta/b) L_q) delta = D_q r - y``, where ``L_q`` holds the strictly block-lower
    blocks ``q^(j-1-t) G_jt`` and ``D_q = diag(q^j)`` per block (``q = 1``: the plain
    ``(I + (eta/b) L) delta = r - y``).

    Parameters
    ----------
    r : ndarray, shape (s*b,)
        Base margins.
    G : ndarray, shape (s*b, s*b)
        Full Gram matrix ``Y Y^T``.
    y, eta, b, s, q
        As in :func:`casgd_recurrence`.
    """
    sb = s * b
    blk = np.repeat(np.arange(s), b)
    power = blk[:, None] - 1 - blk[None, :]
    Lq = np.where(blk[:, None] > blk[None, :], G * float(q) ** np.maximum(power, 0), 0.0)
    A = np.eye(sb) + (eta / b) * Lq
    rhs = r * float(q) ** blk - y
    return solve_triangular(A, rhs, lower=True, unit_diagonal=True)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the iterates (a resumed run must match it).

    Attributes
    ----------
    model : str
        ``logistic``, ``linear`` or ``poisson``.
    solver : str
        ``sgd`` or ``casgd``.
    s, b : int
        Steps per outer iteration and mini-batch size (``sgd`` uses ``s`` only to group
        steps for checkpoints and progress).
    lr, lam : float
        Initial step size ``eta`` and L2 strength ``lambda``.
    seed : int
        Seed of the sample sequence (and of the validation rows).
    recipe : Recipe
        Precision of each slot.
    gram_layout : str
        ``lower`` or ``full`` (see :mod:`optcc_mpi.glm.kernels`).
    learning_rate : str
        ``constant`` or ``adaptive`` (:class:`Stopping`).
    tol : float or None
        Improvement that counts (:class:`Stopping`); None: none is looked for.
    n_iter_no_change : int
        Epochs without it that make a plateau.
    validation_fraction : float
        Share of the rows held out for the validation score (0: no early stopping).
    """

    model: str
    solver: str
    s: int
    b: int
    lr: float
    lam: float
    seed: int
    recipe: Recipe
    gram_layout: str = "lower"
    learning_rate: str = "constant"
    tol: float | None = None
    n_iter_no_change: int = 5
    validation_fraction: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "model": self.model,
            "solver": self.solver,
            "s": self.s,
            "b": self.b,
            "lr": self.lr,
            "lam": self.lam,
            "seed": self.seed,
            "recipe": self.recipe.as_dict(),
            "gram_layout": self.gram_layout,
            "learning_rate": self.learning_rate,
            "tol": self.tol,
            "n_iter_no_change": self.n_iter_no_change,
            "validation_fraction": self.validation_fraction,
        }


@dataclass
class TrainState:
    """Where a run is: weights, position in the sample sequence, what has been recorded.

    Attributes
    ----------
    w : ndarray or tensor
        This rank's weight slice (master weights, update precision), in the kernels'
        array kind.
    epoch, block : int
        Next outer iteration to run: block ``block`` of epoch ``epoch``.
    steps, outer : int
        SGD steps and outer iterations done so far (over all resumed segments).
    history : list of dict
        Loss records: ``steps``, ``epoch`` (fractional), ``loss``, ``train_s``,
        ``epoch_end``, ``lr``, and ``val_score`` with early stopping.
    train_s : float
        Training wall time so far (evaluation and checkpoint writing excluded).
    prior : dict
        Counters carried over from the segments before a resume.
    lr : float or None
        The step of the next epoch (None: the configured one).
    best, best_at_cut : float
        Best stopping criterion so far (lower is better), and its value at the last
        division of the step.
    no_improve, cuts : int
        Epochs in a row without an improvement by ``tol``; divisions of the step so far.
    stop_reason : str or None
        Why training stopped (a key of :data:`STOP_REASONS`); None while it may go on.
    """

    w: Any
    epoch: int = 0
    block: int = 0
    steps: int = 0
    outer: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    train_s: float = 0.0
    prior: dict[str, float] = field(default_factory=dict)
    lr: float | None = None
    best: float = math.inf
    best_at_cut: float = math.inf
    no_improve: int = 0
    cuts: int = 0
    stop_reason: str | None = None

    def schedule(self) -> dict[str, Any]:
        """The stopping rule's state, JSON-ready (checkpoints)."""
        return {
            "lr": self.lr,
            "best": self.best,
            "best_at_cut": self.best_at_cut,
            "no_improve": self.no_improve,
            "cuts": self.cuts,
            "stop_reason": self.stop_reason,
        }


@dataclass(frozen=True)
class Stopping:
    """When training stops, decided after every epoch from a criterion, lower is better
    (the training objective, or minus the validation score).

    Parameters
    ----------
    max_iter : int
        Epochs at most (the total of the run, resumed segments included).
    tol : float or None
        An epoch improves when its criterion is below the best so far minus ``tol``.
        None: never stop early (``max_iter`` epochs, the step never divided).
    n_iter_no_change : int
        Epochs in a row without improvement that make a plateau.
    learning_rate : str
        ``constant``: a plateau stops training. ``adaptive``: a plateau divides the step
        by 5, unless the criterion improved by less than ``tol`` since the previous
        division (or the step was divided :data:`MAX_STEP_CUTS` times): then it stops.
    reason : str
        What a stop at a plateau is called (``converged``, ``no_validation_improvement``).
    """

    max_iter: int
    tol: float | None = None
    n_iter_no_change: int = 5
    learning_rate: str = "constant"
    reason: str = "converged"

    def after_epoch(self, state: TrainState, criterion: float, lr: float) -> None:
        """Update ``state`` after an epoch that ran at step ``lr`` and ended with
        ``criterion``: the next step (``state.lr``) and, when it stops, ``stop_reason``."""
        state.lr = lr
        if self.tol is not None:
            if criterion > state.best - self.tol:
                state.no_improve += 1
            else:
                state.no_improve = 0
        state.best = min(state.best, criterion)
        if self.tol is not None and state.no_improve >= self.n_iter_no_change:
            gained = state.best < state.best_at_cut - self.tol
            if self.learning_rate == "adaptive" and gained and state.cuts < MAX_STEP_CUTS:
                state.lr = lr / 5.0
                state.cuts += 1
                state.best_at_cut = state.best
                state.no_improve = 0
            else:
                state.stop_reason = self.reason
                return
        if state.epoch >= self.max_iter:
            state.stop_reason = "max_iter"


class Trainer:
    """Runs SGD or CA-SGD on one rank's column block; every rank runs one.

    Parameters
    ----------
    group : Group
        Ranks holding the column blocks.
    local : LocalData or TorchLocalData
        This rank's block in the recipe's precisions, and its kernels.
    y : ndarray, shape (m,) or (m, K)
        Labels of every row (float64, replicated, already in the model's domain); ``K``
        columns train ``K`` problems at once.
    model : Model
        The GLM.
    config : TrainConfig
        Solver settings.
    reducer : Reducer
        The AllReduce used for training.
    weights : ndarray, shape (m,), optional
        Sample weights normalised to mean 1 over the training rows (replicated); None for
        unweighted.
    train_rows, val_rows : ndarray, optional
        The rows trained on and the rows held out for the validation score (early
        stopping); None: every row is trained on.
    """

    def __init__(
        self,
        group: Group,
        local: Any,
        y: np.ndarray,
        model: Model,
        config: TrainConfig,
        reducer: Reducer,
        weights: np.ndarray | None = None,
        train_rows: np.ndarray | None = None,
        val_rows: np.ndarray | None = None,
    ) -> None:
        self.group = group
        self.local = local
        self.model = model
        self.cfg = config
        self.reducer = reducer
        self.recipe = config.recipe
        self.outputs = y.shape[1:]  # () for one output, (K,) for K
        self.train_rows = train_rows
        self.val_rows = val_rows
        y_train = y if train_rows is None else y[train_rows]
        sw = None if weights is None else np.asarray(weights, dtype=np.float64)
        sw_train = sw if sw is None or train_rows is None else sw[train_rows]
        L = local
        # The trainer's arrays, where it computes (host NumPy, or tensors on the device).
        self.y_train = L.space(np.ascontiguousarray(y_train, dtype=np.float64))
        self.weights_train = None if sw_train is None else L.space(sw_train)
        # The residual scaling runs in the recurrence's precision, as every residual does.
        self._wts_rec = (
            None if sw_train is None else rounded(L.space(sw_train), config.recipe.recurrence)
        )
        self._train_index = None if train_rows is None else L.space(train_rows)
        self._y_all = np.asarray(y)
        self._sw_all = sw
        self.sampler = Sampler(y_train.shape[0], config.b, config.s, config.seed)
        self.eval_calls = 0
        self.eval_bytes = 0
        self.eval_s = 0.0
        self.checkpoint_s = 0.0
        self._epoch = 0
        self.track_loss = False
        self._coef: dict[tuple[int, float], Any] = {}
        self._run_loss: Any = 0.0
        self._run_rows = 0

    # -- state -----------------------------------------------------------------------

    def initial_weights(self, w0: np.ndarray | None = None) -> Any:
        """Zero weights (or ``w0``, this rank's slice) in the update precision, in the
        kernels' array kind."""
        shape = (self.local.n_local, *self.outputs)
        w = np.zeros(shape) if w0 is None else np.asarray(w0, dtype=np.float64)
        if w.shape != shape:
            raise ArgumentError(f"initial weights for this rank need shape {shape}, got {w.shape}")
        return self.local.initial(w, self.recipe.update)

    # -- loss ------------------------------------------------------------------------

    def objective(self, w: Any) -> float:
        """Full training objective ``mean loss + (lambda/2) ||w||^2`` (fp64, all ranks)
        over the training rows; with ``K`` outputs the sum of the ``K`` objectives."""
        t0 = time.perf_counter()
        L = self.local
        z = L.margins64(w, self.train_rows)
        m, nz = z.shape[0], z.shape[0] * (z.shape[1] if z.ndim == 2 else 1)
        buf = L.pack([z, L.sqnorm64(w)], "fp64")
        self.group.sum(buf)
        per = self.model.loss(buf[:nz].reshape(z.shape), self.y_train)
        if self.weights_train is not None:
            wt = self.weights_train
            per = per * (wt[:, None] if per.ndim == 2 else wt)
        loss = float(per.sum()) / m + 0.5 * self.cfg.lam * float(buf[nz])
        self.eval_calls += 1
        self.eval_bytes += int(buf.nbytes)
        self.eval_s += time.perf_counter() - t0
        return loss

    def validation_score(self, w: Any) -> float:
        """The score on the held-out rows (:meth:`score`)."""
        return self.score(w, self.val_rows)

    def score(self, w: Any, rows: np.ndarray | None) -> float:
        """The model's score on ``rows`` (None: all), higher is better (collective):
        accuracy for logistic (the class of the largest margin with K outputs), ``R^2``
        for linear, ``D^2`` for Poisson (the mean over K outputs); weighted by the rows'
        sample weights."""
        t0 = time.perf_counter()
        L = self.local
        z = L.margins64(w, rows)
        buf = L.pack([z], "fp64")
        self.group.sum(buf)
        zv = L.host(buf).reshape(z.shape)
        y = self._y_all if rows is None else self._y_all[rows]
        sw = (
            None if self._sw_all is None else (self._sw_all if rows is None else self._sw_all[rows])
        )
        if self.model.name == "logistic":
            if zv.ndim == 2:
                hit = np.argmax(zv, axis=1) == np.argmax(y, axis=1)
            else:
                hit = (zv > 0) == (y > 0.5)
            score = float(np.average(hit, weights=sw))
        elif zv.ndim == 2:
            scores = [self.model.d2(zv[:, k], y[:, k], sw) for k in range(y.shape[1])]
            score = float(np.mean(scores))
        else:
            score = self.model.d2(zv, y, sw)
        self.eval_calls += 1
        self.eval_bytes += int(buf.nbytes)
        self.eval_s += time.perf_counter() - t0
        return score

    def _advice(self, lr: float) -> str:
        return (
            f"the step size lr = {lr:g} is probably too large: try lr = {lr / 2:g} or "
            "smaller (features on very different scales also cause this: standardise them)"
        )

    # -- one outer iteration ---------------------------------------------------------

    def _track(self, z: Any, y: Any, wts: Any) -> None:
        """Add the mini-batch losses at margins ``z`` to the running loss of the epoch."""
        per = self.model.loss(as_compute(z, "fp64"), as_compute(y, "fp64"))
        if wts is not None:
            wts = as_compute(wts, "fp64")
            per = per * (wts[:, None] if per.ndim == 2 else wts)
        self._run_loss = self._run_loss + per.sum()
        self._run_rows += int(z.shape[0])

    def running_loss(self) -> float:
        """Mean loss of the mini-batches of the current epoch so far, each at the margins
        its step saw (what the progress line shows); NaN before the first."""
        if not self._run_rows:
            return math.nan
        return float(self._run_loss) / self._run_rows

    def _update(self, w: Any, Yd: Any, delta: Any, steps: int, lr: float) -> Any:
        upd = self.recipe.update
        b = self.cfg.b
        q = 1.0 - lr * self.cfg.lam
        d = as_compute(delta, upd)
        if q == 1.0:
            v = d * (lr / b)
        else:
            # (eta/b) q^(steps-1-t) for each row of block t: the update's weights, made once
            # per (steps, step size) where the trainer computes (no copy per iteration).
            key = (steps, lr)
            coef = self._coef.get(key)
            if coef is None:
                powers = np.repeat(np.arange(steps - 1, -1, -1), b)
                coef = self.local.space(((lr / b) * q**powers).astype(_compute_dtype(upd)))
                self._coef = {key: coef} if len(self._coef) > 8 else {**self._coef, key: coef}
            v = d * (coef[:, None] if d.ndim == 2 else coef)
        g = self.local.gradient(Yd, self.local.device(v))
        w_new = (w * (q**steps) if q != 1.0 else w) - g
        return rounded(w_new, upd) if is_half(upd) else w_new

    def _labels(self, rows: Any) -> tuple[Any, Any]:
        """Labels and recurrence-precision weights (None: unweighted) of training ``rows``."""
        return self.y_train[rows], None if self._wts_rec is None else self._wts_rec[rows]

    def _rows(self, rows: Any) -> Any:
        """Rows of the training set as rows of the block."""
        return rows if self._train_index is None else self._train_index[rows]

    def casgd_block(self, w: Any, rows: Any, steps: int, lr: float) -> tuple[Any, Any]:
        """One CA-SGD outer iteration over training ``rows``; new weights and residuals."""
        L, b, rec = self.local, self.cfg.b, self.recipe.recurrence
        sb = steps * b
        nr = sb * (self.outputs[0] if self.outputs else 1)  # words of the margins
        Yd = L.gather(self._rows(rows))
        parts = [L.margins(Yd, w), L.gram_packed(Yd, steps, b)]
        buf = self.reducer(L.pack(parts, self.recipe.comm))
        r_all = rounded(buf[:nr].reshape(sb, *self.outputs), rec)
        G_all = buf[nr:]
        if L.layout == "full":
            G_all = L.unpack_lower(G_all, steps, b)
        G_all = rounded(G_all, rec)
        y_rows, wts = self._labels(rows)
        seen = None
        if self.track_loss:

            def seen(z: Any, lo: int, hi: int) -> None:
                self._track(z, y_rows[lo:hi], None if wts is None else wts[lo:hi])

        delta = casgd_recurrence(
            r_all,
            G_all,
            y_rows,
            self.model.residual,
            lr,
            b,
            steps,
            1.0 - lr * self.cfg.lam,
            rec,
            weights=wts,
            on_margins=seen,
        )
        if not L.all_finite(delta):
            raise DivergenceError(
                f"CA-SGD diverged (non-finite residuals) in epoch {self._epoch + 1}; "
                f"{self._advice(lr)}"
            )
        return self._update(w, Yd, delta, steps, lr), delta

    def sgd_block(self, w: Any, rows: Any, steps: int, lr: float) -> tuple[Any, Any]:
        """``steps`` plain SGD steps over training ``rows`` (one AllReduce each)."""
        L, b, rec = self.local, self.cfg.b, self.recipe.recurrence
        Yd = L.gather(self._rows(rows))
        deltas = L.empty((steps * b, *self.outputs), rec)
        y_rows, wts = self._labels(rows)
        for j in range(steps):
            J = slice(j * b, (j + 1) * b)
            Yj = Yd[J]
            buf = self.reducer(L.pack([L.margins(Yj, w)], self.recipe.comm))
            z = rounded(buf.reshape(b, *self.outputs), rec)
            if self.track_loss:
                self._track(z, y_rows[J], None if wts is None else wts[J])
            d = self.model.residual(z, y_rows[J])
            if wts is not None:
                d = d * (wts[J][:, None] if d.ndim == 2 else wts[J])
            d = rounded(d, rec) if is_half(rec) else d
            if not L.all_finite(d):
                raise DivergenceError(
                    f"SGD diverged (non-finite residuals) in epoch {self._epoch + 1}; "
                    f"{self._advice(lr)}"
                )
            deltas[J] = d
            w = self._update(w, Yj, d, 1, lr)
        return w, deltas

    # -- the loop --------------------------------------------------------------------

    def run(
        self,
        state: TrainState,
        stopping: Stopping,
        *,
        eval_every: int = 0,
        progress: Any = None,
        checkpoint: Callable[[TrainState], None] | None = None,
        checkpoint_every: int = 0,
        exit_after: int | None = None,
        on_record: Callable[[dict[str, Any]], None] | None = None,
        divergence_factor: float | None = DIVERGENCE_FACTOR,
    ) -> TrainState:
        """Train from ``state`` until ``stopping`` says so.

        Parameters
        ----------
        state : TrainState
            Start point (fresh or restored from a checkpoint); updated in place.
        stopping : Stopping
            ``max_iter`` (total epochs of the run, not additional ones), ``tol`` and the
            rest of the rule.
        eval_every : int
            Also record the full loss whenever another ``eval_every`` SGD steps have been
            done (0: only at the end of each epoch).
        progress : Progress, optional
            Advanced by one per outer iteration; shows the epoch and the running loss of
            the current epoch's mini-batches.
        checkpoint : callable, optional
            ``checkpoint(state)``; called every ``checkpoint_every`` outer iterations and at
            the end.
        exit_after : int, optional
            Exit the process after this many outer iterations of *this* call (a simulated
            kill, for testing resume).
        on_record : callable, optional
            Called with each loss record.
        divergence_factor : float or None
            Stop with :class:`DivergenceError` when a recorded loss exceeds both this
            many times the best loss recorded before it and the starting loss (the first
            record). None (or inf) keeps only the non-finite check.

        Raises
        ------
        DivergenceError
            On every rank together: the decision is taken from the reduced loss, which is
            identical on every rank.
        """
        block_fn = self.casgd_block if self.cfg.solver == "casgd" else self.sgd_block
        K = self.sampler.steps_per_epoch
        early = self.val_rows is not None
        self.track_loss = progress is not None and bool(getattr(progress, "enabled", False))
        if state.lr is None:
            state.lr = self.cfg.lr

        def record(epoch_end: bool) -> dict[str, Any]:
            """Record the full loss (and validation score) at ``state.w``."""
            loss = self.objective(state.w)
            rec: dict[str, Any] = {
                "steps": state.steps,
                "epoch": state.steps / K,
                "loss": loss,
                "train_s": state.train_s,
                "epoch_end": epoch_end,
                "lr": state.lr,
            }
            if early:
                rec["val_score"] = self.validation_score(state.w)
            state.history.append(rec)
            if on_record is not None:
                on_record(rec)
            if not np.isfinite(loss):
                raise DivergenceError(
                    f"the training loss is {loss} after {state.steps} steps; "
                    f"{self._advice(state.lr)}"
                )
            if divergence_factor is not None and len(state.history) > 1:
                start = state.history[0]["loss"]
                best = min(h["loss"] for h in state.history[:-1])
                if loss > divergence_factor * best and loss > start:
                    raise DivergenceError(
                        f"the training loss rose to {loss:.6g} after {state.steps} steps "
                        f"(epoch {rec['epoch']:.4g}): more than {divergence_factor:g} times "
                        f"its best value {best:.6g} and above its starting value {start:.6g}. "
                        f"Training diverges: {self._advice(state.lr)}. (The check is the "
                        "divergence_factor setting; None turns it off.)"
                    )
            return rec

        if not state.history:
            record(epoch_end=False)  # the loss of the starting point
        # Overflow (Poisson's exp) is reported as a DivergenceError, not as warnings.
        with np.errstate(over="ignore", invalid="ignore"):
            self._epochs(state, stopping, block_fn, record, progress, checkpoint,
                         checkpoint_every, exit_after, eval_every)  # fmt: skip
        if state.stop_reason is None:
            state.stop_reason = "max_iter"
        if checkpoint is not None:
            t0 = time.perf_counter()
            checkpoint(state)
            self.checkpoint_s += time.perf_counter() - t0
        return state

    def _epochs(
        self,
        state: TrainState,
        stopping: Stopping,
        block_fn: Callable[..., tuple[Any, Any]],
        record: Callable[[bool], dict[str, Any]],
        progress: Any,
        checkpoint: Callable[[TrainState], None] | None,
        checkpoint_every: int,
        exit_after: int | None,
        eval_every: int,
    ) -> None:
        """The epochs of :meth:`run` until the stopping rule ends them (``state.w`` is
        current at every record, every checkpoint and the end)."""
        sampler = self.sampler
        nblocks = sampler.blocks_per_epoch
        early = self.val_rows is not None
        done_here = 0
        w = state.w
        while state.stop_reason is None and state.epoch < stopping.max_iter:
            self._epoch = state.epoch
            lr = state.lr
            perm = self.local.space(sampler.permutation(state.epoch))
            self._run_loss, self._run_rows = 0.0, 0
            while state.block < nblocks:
                rows, steps = sampler.block(perm, state.block)
                t0 = time.perf_counter()
                w, _ = block_fn(w, rows, steps, lr)
                state.train_s += time.perf_counter() - t0
                before = state.steps
                state.steps += steps
                state.block += 1
                state.outer += 1
                done_here += 1
                state.w = w
                if eval_every and state.steps // eval_every > before // eval_every:
                    if state.block < nblocks:  # the epoch-end record follows otherwise
                        record(False)
                if progress is not None:
                    text = f"epoch {state.epoch + 1}"
                    if self.track_loss:
                        text += f" loss {self.running_loss():.6g}"
                    progress.update(1, postfix=text)
                if (
                    checkpoint is not None
                    and checkpoint_every
                    and state.outer % checkpoint_every == 0
                ):
                    t0 = time.perf_counter()
                    checkpoint(state)
                    self.checkpoint_s += time.perf_counter() - t0
                if exit_after is not None and done_here >= exit_after:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(EXIT_AFTER_STATUS)
            state.epoch += 1
            state.block = 0
            rec = record(True)
            # The objective as reported: with K outputs the sum of the K problems', so tol
            # holds them to tol / K each on average (stricter than K separate fits would).
            criterion = -rec["val_score"] if early else rec["loss"]
            stopping.after_epoch(state, criterion, lr)

    def stats(self, state: TrainState) -> dict[str, Any]:
        """Counters and the time split, summed over resumed segments."""
        prior = state.prior
        comm_s = self.reducer.seconds + prior.get("comm_s", 0.0)
        out = {
            **self.reducer.stats(),
            "allreduce_calls": self.reducer.calls + int(prior.get("allreduce_calls", 0)),
            "allreduce_bytes": self.reducer.nbytes + int(prior.get("allreduce_bytes", 0)),
            "comm_s": comm_s,
            "emulated_wait_s": self.reducer.emulated_seconds + prior.get("emulated_wait_s", 0.0),
            "train_s": state.train_s,
            "compute_s": state.train_s - comm_s,
            "eval_calls": self.eval_calls + int(prior.get("eval_calls", 0)),
            "eval_bytes": self.eval_bytes + int(prior.get("eval_bytes", 0)),
            "eval_s": self.eval_s + prior.get("eval_s", 0.0),
            "checkpoint_s": self.checkpoint_s + prior.get("checkpoint_s", 0.0),
            "steps": state.steps,
            "outer_iterations": state.outer,
        }
        return out
