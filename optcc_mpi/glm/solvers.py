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

Divergence (:meth:`Trainer.run`): besides non-finite residuals or losses, a recorded loss
above ``divergence_factor`` times the best recorded loss *and* above the starting loss stops
training with :class:`~optcc_mpi.errors.DivergenceError` on every rank (the loss is the
reduced value, identical on every rank, so every rank decides the same).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI
from scipy.linalg import solve_triangular

from ..errors import DivergenceError
from .comm import Reducer
from .kernels import LocalData
from .models import Model
from .precision import Recipe, compute_dtype, is_half, rounded, storage_dtype
from .sampler import Sampler

__all__ = [
    "DIVERGENCE_FACTOR",
    "EXIT_AFTER_ENV",
    "SOLVERS",
    "DivergenceError",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "casgd_recurrence",
    "least_squares_deltas",
    "margins64",
]

SOLVERS = ("sgd", "casgd")

#: Environment variable: exit the process (status 75) after this many outer iterations.
#: Used to test that ``resume`` continues a killed run exactly.
EXIT_AFTER_ENV = "OPTCC_GLM_EXIT_AFTER"
EXIT_AFTER_STATUS = 75

#: Default of ``divergence_factor``: a recorded loss above this many times the best one
#: (and above the starting loss) stops training as diverged.
DIVERGENCE_FACTOR = 10.0


def casgd_recurrence(
    r: np.ndarray,
    G_lower: np.ndarray,
    y: np.ndarray,
    residual: Callable[[np.ndarray, np.ndarray], np.ndarray],
    eta: float,
    b: int,
    s: int,
    q: float = 1.0,
    precision: str = "fp64",
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """The inner recurrence of one CA-SGD outer iteration (identical on every rank).

    Parameters
    ----------
    r : ndarray, shape (s*b,) or (s*b, K)
        Reduced base margins ``Y @ w_k`` (one column per output).
    G_lower : ndarray
        Reduced strictly block-lower Gram blocks, packed as in
        :func:`~optcc_mpi.glm.kernels.lower_block_index`.
    y : ndarray, shape like ``r``
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
    weights : ndarray, shape (s*b,), optional
        Sample weights of the rows (normalised to mean 1 over the training set); each
        residual is multiplied by its row's weight.

    Returns
    -------
    ndarray, shape like ``r``
        The residuals ``delta_j`` of the ``s`` steps, in the recurrence's compute dtype.
    """
    dt = compute_dtype(precision)
    half = is_half(precision)
    scale = dt.type(eta / b)
    qd = dt.type(q)
    y = y.astype(dt, copy=False)
    if weights is not None:
        weights = weights.astype(dt, copy=False)
        if r.ndim == 2:
            weights = weights[:, None]
    delta = np.empty(r.shape, dtype=dt)
    # u[t] = (eta/b) q^(j-1-t) delta_t: the coefficients of the correction sum at step j.
    u = np.empty(r.shape, dtype=dt)
    for j in range(s):
        lo, hi = j * b, (j + 1) * b
        z = r[lo:hi]
        if q != 1.0 and j:
            z = z * dt.type(q**j)
        if j:
            off = b * b * j * (j - 1) // 2
            Gj = G_lower[off : off + b * lo].reshape(b, lo)
            corr = Gj @ u[:lo]
            if half:
                corr = rounded(corr, precision)
            z = z - corr
        if half:
            z = rounded(z, precision)
        d = residual(z, y[lo:hi])
        if weights is not None:
            d = d * weights[lo:hi]
        delta[lo:hi] = rounded(d, precision) if half else d
        if j + 1 < s:
            if q != 1.0:
                u[:lo] *= qd
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


def margins64(X: Any, w: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
    """``X @ w`` in float64, in row chunks so that a float64 copy of X is never made."""
    w64 = np.asarray(w, dtype=np.float64)
    m = X.shape[0]
    out = np.empty((m, *w64.shape[1:]), dtype=np.float64)
    for start in range(0, m, chunk):
        out[start : start + chunk] = X[start : start + chunk].astype(np.float64) @ w64
    return out


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
        Step size ``eta`` and L2 strength ``lambda``.
    seed : int
        Seed of the sample sequence.
    recipe : Recipe
        Precision of each slot.
    gram_layout : str
        ``lower`` or ``full`` (see :mod:`optcc_mpi.glm.kernels`).
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
        }


@dataclass
class TrainState:
    """Where a run is: weights, position in the sample sequence, what has been recorded.

    Attributes
    ----------
    w : ndarray
        This rank's weight slice (master weights, update precision).
    epoch, block : int
        Next outer iteration to run: block ``block`` of epoch ``epoch``.
    steps, outer : int
        SGD steps and outer iterations done so far (over all resumed segments).
    history : list of dict
        Loss records: ``steps``, ``epoch`` (fractional), ``loss``, ``train_s``, ``epoch_end``.
    train_s : float
        Training wall time so far (evaluation and checkpoint writing excluded).
    prior : dict
        Counters carried over from the segments before a resume.
    """

    w: np.ndarray
    epoch: int = 0
    block: int = 0
    steps: int = 0
    outer: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    train_s: float = 0.0
    prior: dict[str, float] = field(default_factory=dict)


class Trainer:
    """Runs SGD or CA-SGD on one rank's column block; every rank runs one.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        Ranks holding the column blocks.
    local : LocalData
        This rank's block in the recipe's precisions.
    X_eval : array or sparse matrix
        The block as given by the user, for the reported loss (so that every recipe is
        scored on the same data).
    y : ndarray, shape (m,) or (m, K)
        Labels (float64, replicated, already in the model's domain); ``K`` columns train
        ``K`` problems at once.
    model : Model
        The GLM.
    config : TrainConfig
        Solver settings.
    reducer : Reducer
        The AllReduce used for training.
    weights : ndarray, shape (m,), optional
        Sample weights normalised to mean 1 (replicated); None for unweighted.
    """

    def __init__(
        self,
        comm: MPI.Comm,
        local: LocalData,
        X_eval: Any,
        y: np.ndarray,
        model: Model,
        config: TrainConfig,
        reducer: Reducer,
        weights: np.ndarray | None = None,
    ) -> None:
        self.comm = comm
        self.local = local
        self.X_eval = X_eval
        self.y = y
        self.model = model
        self.cfg = config
        self.reducer = reducer
        self.weights = None if weights is None else np.asarray(weights, dtype=np.float64)
        # The residual scaling runs in the recurrence's dtype, as every residual does.
        self._weights_rec = (
            None
            if weights is None
            else rounded(self.weights, config.recipe.recurrence).astype(
                compute_dtype(config.recipe.recurrence)
            )
        )
        self.outputs = y.shape[1:]  # () for one output, (K,) for K
        self.recipe = config.recipe
        self.q = 1.0 - config.lr * config.lam
        self.sampler = Sampler(y.shape[0], config.b, config.s, config.seed)
        self.eval_calls = 0
        self.eval_bytes = 0
        self.eval_s = 0.0
        self.checkpoint_s = 0.0
        self._epoch = 0
        self._comm_dtype = storage_dtype(self.recipe.comm)

    # -- state -----------------------------------------------------------------------

    def initial_weights(self, w0: np.ndarray | None = None) -> np.ndarray:
        """Zero weights (or ``w0``, this rank's slice) in the update precision."""
        shape = (self.local.n_local, *self.outputs)
        w = np.zeros(shape) if w0 is None else np.asarray(w0, dtype=np.float64)
        if w.shape != shape:
            raise ValueError(f"initial weights for this rank need shape {shape}, got {w.shape}")
        return rounded(w, self.recipe.update)

    # -- loss ------------------------------------------------------------------------

    def objective(self, w: np.ndarray) -> float:
        """Full training objective ``mean loss + (lambda/2) ||w||^2`` (fp64, all ranks)."""
        t0 = time.perf_counter()
        m = self.y.shape[0]
        w64 = np.asarray(self.local.host(w), dtype=np.float64)
        if self.outputs:
            # K outputs: the margins of every output, then the squared norm; the objective
            # is the sum of the K problems' objectives.
            k = self.outputs[0]
            buf = np.empty(m * k + 1)
            buf[: m * k] = margins64(self.X_eval, w64).ravel()
            buf[m * k] = np.sum(w64 * w64)
            if self.comm.size > 1:
                self.comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
            per = self.model.loss(buf[: m * k].reshape(m, k), self.y)
            if self.weights is not None:
                per = per * self.weights[:, None]
            data_term = float(np.sum(np.mean(per, axis=0)))
            loss = data_term + 0.5 * self.cfg.lam * float(buf[m * k])
        else:
            buf = np.empty(m + 1)
            buf[:m] = margins64(self.X_eval, w64)
            buf[m] = w64 @ w64
            if self.comm.size > 1:
                self.comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
            per = self.model.loss(buf[:m], self.y)
            if self.weights is not None:
                per = per * self.weights
            loss = float(np.mean(per) + 0.5 * self.cfg.lam * buf[m])
        self.eval_calls += 1
        self.eval_bytes += buf.nbytes
        self.eval_s += time.perf_counter() - t0
        return loss

    def _advice(self) -> str:
        lr = self.cfg.lr
        return (
            f"the step size lr = {lr:g} is probably too large: try lr = {lr / 2:g} or "
            "smaller (features on very different scales also cause this: standardise them)"
        )

    # -- one outer iteration ---------------------------------------------------------

    def _step_coefficients(self, steps: int, dt: np.dtype) -> np.ndarray:
        """``(eta/b) q^(steps-1-t)`` for each row of block ``t`` (the update's weights)."""
        b = self.cfg.b
        powers = np.repeat(np.arange(steps - 1, -1, -1), b)
        return ((self.cfg.lr / b) * self.q**powers).astype(dt)

    def _apply_update(self, w: Any, Yd: Any, delta: np.ndarray, steps: int) -> Any:
        dt = compute_dtype(self.recipe.update)
        if self.q == 1.0:
            v = delta.astype(dt) * dt.type(self.cfg.lr / self.cfg.b)
        else:
            coef = self._step_coefficients(steps, dt)
            v = delta.astype(dt) * (coef[:, None] if delta.ndim == 2 else coef)
        g = self.local.gradient(Yd, self.local.device(v))
        w_new = (w * dt.type(self.q**steps) if self.q != 1.0 else w) - g
        return rounded(w_new, self.recipe.update) if is_half(self.recipe.update) else w_new

    def casgd_block(self, w: Any, rows: np.ndarray, steps: int) -> tuple[Any, np.ndarray]:
        """One CA-SGD outer iteration over ``rows``; returns new weights and the residuals."""
        L, b, rec = self.local, self.cfg.b, self.recipe.recurrence
        sb = steps * b
        nr = sb * (self.outputs[0] if self.outputs else 1)  # words of the margins
        Yd = L.gather(rows)
        r = L.margins(Yd, w)
        Gp = L.gram_packed(Yd, steps, b)
        buf = np.empty(nr + Gp.shape[0], dtype=self._comm_dtype)
        buf[:nr] = L.host(r).reshape(-1)
        buf[nr:] = L.host(Gp)
        buf = self.reducer(buf)
        r_all = rounded(buf[:nr].reshape(sb, *self.outputs), rec)
        G_all = buf[nr:]
        if self.local.layout == "full":
            G_all = L.unpack_lower(G_all, steps, b)
        G_all = rounded(G_all, rec)
        wts = None if self._weights_rec is None else self._weights_rec[rows]
        delta = casgd_recurrence(
            r_all,
            G_all,
            self.y[rows],
            self.model.residual,
            self.cfg.lr,
            b,
            steps,
            self.q,
            rec,
            weights=wts,
        )
        if not np.isfinite(delta).all():
            raise DivergenceError(
                f"CA-SGD diverged (non-finite residuals) in epoch {self._epoch + 1}; "
                f"{self._advice()}"
            )
        return self._apply_update(w, Yd, delta, steps), delta

    def sgd_block(self, w: Any, rows: np.ndarray, steps: int) -> tuple[Any, np.ndarray]:
        """``steps`` plain SGD steps over ``rows`` (one AllReduce each)."""
        L, b, rec = self.local, self.cfg.b, self.recipe.recurrence
        Yd = L.gather(rows)
        deltas = np.empty((steps * b, *self.outputs), dtype=compute_dtype(rec))
        nz = b * (self.outputs[0] if self.outputs else 1)
        wts = self._weights_rec
        for j in range(steps):
            J = slice(j * b, (j + 1) * b)
            Yj = Yd[J]
            buf = np.empty(nz, dtype=self._comm_dtype)
            buf[:] = L.host(L.margins(Yj, w)).reshape(-1)
            buf = self.reducer(buf)
            z = rounded(buf.reshape(b, *self.outputs), rec)
            d = self.model.residual(z, self.y[rows[J]].astype(z.dtype))
            if wts is not None:
                wj = wts[rows[J]]
                d = d * (wj[:, None] if d.ndim == 2 else wj)
            d = rounded(d, rec) if is_half(rec) else d
            if not np.isfinite(d).all():
                raise DivergenceError(
                    f"SGD diverged (non-finite residuals) in epoch {self._epoch + 1}; "
                    f"{self._advice()}"
                )
            deltas[J] = d
            w = self._apply_update(w, Yj, d, 1)
        return w, deltas

    # -- the loop --------------------------------------------------------------------

    def run(
        self,
        state: TrainState,
        epochs: int,
        *,
        eval_every: int = 0,
        progress: Any = None,
        checkpoint: Callable[[TrainState], None] | None = None,
        checkpoint_every: int = 0,
        exit_after: int | None = None,
        on_record: Callable[[dict[str, Any]], None] | None = None,
        divergence_factor: float | None = DIVERGENCE_FACTOR,
    ) -> TrainState:
        """Train until ``epochs`` epochs are done, starting from ``state``.

        Parameters
        ----------
        state : TrainState
            Start point (fresh or restored from a checkpoint); updated in place.
        epochs : int
            Total epochs of the run (not additional ones).
        eval_every : int
            Also record the full loss whenever another ``eval_every`` SGD steps have been
            done (0: only at the end of each epoch).
        progress : Progress, optional
            Advanced by one per outer iteration.
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
        sampler = self.sampler
        K, nblocks = sampler.steps_per_epoch, sampler.blocks_per_epoch
        done_here = 0
        w = self.local.device(state.w) if self.local.on_device else state.w

        def record(epoch_end: bool) -> None:
            state.w = w
            loss = self.objective(w)
            rec = {
                "steps": state.steps,
                "epoch": state.steps / K,
                "loss": loss,
                "train_s": state.train_s,
                "epoch_end": epoch_end,
            }
            state.history.append(rec)
            if on_record is not None:
                on_record(rec)
            if not np.isfinite(loss):
                raise DivergenceError(
                    f"the training loss is {loss} after {state.steps} steps; {self._advice()}"
                )
            if divergence_factor is not None and len(state.history) > 1:
                start = state.history[0]["loss"]
                best = min(h["loss"] for h in state.history[:-1])
                if loss > divergence_factor * best and loss > start:
                    raise DivergenceError(
                        f"the training loss rose to {loss:.6g} after {state.steps} steps "
                        f"(epoch {rec['epoch']:.4g}): more than {divergence_factor:g} times "
                        f"its best value {best:.6g} and above its starting value {start:.6g}. "
                        f"Training diverges: {self._advice()}. (The check is the "
                        "divergence_factor setting; None turns it off.)"
                    )

        if not state.history:
            record(epoch_end=False)  # the loss of the starting point
        while state.epoch < epochs:
            self._epoch = state.epoch
            perm = sampler.permutation(state.epoch)
            while state.block < nblocks:
                rows, steps = sampler.block(perm, state.block)
                t0 = time.perf_counter()
                # Overflow (Poisson's exp) is reported as a DivergenceError, not warnings.
                with np.errstate(over="ignore", invalid="ignore"):
                    w, _ = block_fn(w, rows, steps)
                state.train_s += time.perf_counter() - t0
                before = state.steps
                state.steps += steps
                state.block += 1
                state.outer += 1
                done_here += 1
                if eval_every and state.steps // eval_every > before // eval_every:
                    if state.block < nblocks:  # the epoch-end record follows otherwise
                        record(epoch_end=False)
                if progress is not None:
                    last = state.history[-1]["loss"] if state.history else float("nan")
                    progress.update(1, postfix=f"epoch {state.epoch + 1} loss {last:.6g}")
                if (
                    checkpoint is not None
                    and checkpoint_every
                    and state.outer % checkpoint_every == 0
                ):
                    state.w = w
                    t0 = time.perf_counter()
                    checkpoint(state)
                    self.checkpoint_s += time.perf_counter() - t0
                if exit_after is not None and done_here >= exit_after:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(EXIT_AFTER_STATUS)
            state.epoch += 1
            state.block = 0
            record(epoch_end=True)
        state.w = w
        if checkpoint is not None:
            t0 = time.perf_counter()
            checkpoint(state)
            self.checkpoint_s += time.perf_counter() - t0
        return state

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
