"""``fit``: train a GLM with SGD or CA-SGD over MPI, from arrays or a loaded partition.

Every check on the inputs runs before any training and ends in one small collective
(:func:`~optcc_mpi.glm.comm.agree`), so a bad input stops every rank with the same message
instead of leaving some ranks waiting in an AllReduce.

:func:`fit` runs in five phases, one function each below it: check and agree
(:func:`_check_options`, :func:`_check_inputs`, then :func:`_check_across` on what every
rank holds), set up this rank's column block and the trainer (:func:`_setup`), resume from a
checkpoint (:func:`_resume`), the solver loop (:func:`_train`) and the results
(:func:`_result`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp
from mpi4py import MPI

from .. import config as _config
from ..backend import get_cupy
from ..data import column_block
from ..progress import Progress
from .checkpoint import load_checkpoint, save_checkpoint
from .comm import Reducer, agree, checksum
from .kernels import GRAM_LAYOUTS, LocalData
from .models import Model, get_model, model_for_task
from .precision import Recipe, get_recipe, rounded
from .solvers import (
    DIVERGENCE_FACTOR,
    EXIT_AFTER_ENV,
    SOLVERS,
    TrainConfig,
    Trainer,
    TrainState,
)

__all__ = ["FitResult", "column_block", "fit", "fit_partition", "resolve_device"]


def resolve_device(device: Any) -> Any:
    """Array module for the local kernels: NumPy for ``"cpu"``, CuPy for ``"gpu"``.

    ``"auto"`` picks the GPU when one is usable. CuPy is obtained from
    ``optcc_mpi.backend.get_cupy()`` (the only module allowed to import it), which returns
    the module when ``cupy.is_available()`` and None otherwise. A module object is
    returned unchanged (for callers and tests that bring their own).
    """
    if not isinstance(device, str):
        return device
    name = device.lower()
    if name == "cpu":
        return np
    if name not in ("gpu", "auto"):
        raise ValueError(f"unknown device {device!r}; choose cpu, gpu or auto")
    cp = get_cupy()
    if cp is not None:
        return cp
    if name == "auto":
        return np
    raise ValueError(
        "device='gpu' but no usable GPU (CuPy missing or cupy.is_available() is False)"
    )


@dataclass
class FitResult:
    """What :func:`fit` returns (the same on every rank except ``coef_local``).

    Attributes
    ----------
    coef : ndarray, shape (n_features,) or (n_features, K)
        All weights, float64, on every rank (``K`` columns when ``y`` had ``K``).
    coef_local : ndarray
        This rank's rows of ``coef`` in the update precision.
    cols : slice
        This rank's global columns.
    final_loss : float
        Full training objective at the end.
    history : list of dict
        Loss records (``steps``, ``epoch``, ``loss``, ``train_s``, ``epoch_end``).
    stats : dict
        AllReduce calls and bytes, ``comm_s``, ``compute_s``, ``train_s`` (rank 0's; the
        ``*_max`` entries are the maxima over ranks), evaluation counters.
    config : dict
        Settings of the run (model, solver, s, b, lr, lam, seed, recipe, P, m, n ...).
    resumed_from : dict or None
        ``steps`` and ``epoch`` of the checkpoint the run continued from.
    """

    coef: np.ndarray
    coef_local: np.ndarray
    cols: slice
    final_loss: float
    history: list[dict[str, Any]]
    stats: dict[str, Any]
    config: dict[str, Any]
    resumed_from: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def epoch_losses(self) -> list[float]:
        """Full training loss at the end of each epoch."""
        return [h["loss"] for h in self.history if h["epoch_end"]]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (weights omitted)."""
        return {
            "final_loss": self.final_loss,
            "epoch_losses": self.epoch_losses(),
            "history": self.history,
            "stats": self.stats,
            "config": self.config,
            "resumed_from": self.resumed_from,
        }


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or int(value) != value or int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _finite(name: str, value: Any, *, positive: bool = False) -> float:
    v = float(value)
    if not math.isfinite(v) or (v <= 0 if positive else v < 0):
        raise ValueError(
            f"{name} must be a finite {'positive' if positive else 'non-negative'} number, "
            f"got {value!r}"
        )
    return v


def _check_X(X: Any) -> Any:
    if sp.issparse(X):
        if X.ndim != 2:
            raise ValueError(f"X must be 2-D, got shape {X.shape}")
        values = X.tocsr().data
    else:
        if not hasattr(X, "shape") or not hasattr(X, "dtype"):
            X = np.asarray(X)
        if X.ndim != 2:
            raise ValueError(f"X must be a 2-D array (rows = samples), got shape {X.shape}")
        if X.dtype.kind in "iub":
            X = X.astype(np.float64)
        values = X
    if values.dtype.kind not in "fV" and values.dtype.name != "bfloat16":
        raise ValueError(f"X must hold floating-point numbers, got dtype {values.dtype}")
    if not np.isfinite(values).all():
        raise ValueError("X contains NaN or inf")
    return X


def _sample_weights(sample_weight: Any, m: int) -> np.ndarray | None:
    """Check sample weights and normalise them to mean 1; None when they are all equal.

    Equal weights leave the weighted mean loss unchanged, so they take the unweighted path
    (bit for bit the run without weights).
    """
    if sample_weight is None:
        return None
    sw = np.asarray(sample_weight)
    if sw.dtype.kind not in "fiub":
        raise ValueError(f"sample_weight must hold numbers, got dtype {sw.dtype}")
    sw = sw.astype(np.float64)
    if sw.ndim == 0:
        sw = np.full(m, float(sw))
    if sw.shape != (m,):
        raise ValueError(f"sample_weight needs shape ({m},) like y, got {sw.shape}")
    if not np.isfinite(sw).all():
        raise ValueError("sample_weight contains NaN or inf")
    if (sw < 0).any():
        i = int(np.flatnonzero(sw < 0)[0])
        raise ValueError(f"sample_weight must be non-negative; sample_weight[{i}] = {sw[i]:g}")
    total = float(sw.sum())
    if not total > 0:
        raise ValueError("sample_weight sums to 0: at least one row needs a positive weight")
    if np.all(sw == sw[0]):
        return None
    return sw * (m / total)


def fit(
    X: Any,
    y: Any,
    *,
    model: str = "logistic",
    solver: str = "casgd",
    s: int = 16,
    b: int = 32,
    lr: float = 0.5,
    epochs: int = 5,
    lam: float = 0.0,
    seed: int = 0,
    recipe: str | Recipe | Mapping[str, str] = "fp32",
    slots: Iterable[str] | Mapping[str, str] | None = None,
    comm: MPI.Comm | None = None,
    allreduce: str | Callable[[np.ndarray, MPI.Comm], None] = "mpi",
    links: Any = None,
    emulate: Any = None,
    cols: slice | None = None,
    w0: np.ndarray | None = None,
    gram_layout: str = "lower",
    eval_every: int = 0,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    progress: bool = False,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    device: Any = "cpu",
    sample_weight: Any = None,
    divergence_factor: float | None = DIVERGENCE_FACTOR,
) -> FitResult:
    """Fit a GLM by mini-batch SGD or CA-SGD; collective over ``comm``.

    The objective is ``mean loss + (lam/2) ||w||^2`` without an intercept (append a
    column of ones for one; it is then penalised too).

    Parameters
    ----------
    X : ndarray or scipy.sparse matrix
        With ``cols=None``: the full ``(m, n)`` matrix, the same on every rank; each rank
        keeps its column block. With ``cols``: this rank's ``(m, n_local)`` block.
        Any float dtype, bf16 included.
    y : array_like, shape (m,) or (m, K)
        Labels, the same on every rank: {0, 1} or {-1, +1} (logistic), real (linear),
        non-negative reals (poisson). ``K`` columns train ``K`` independent problems of
        the model on the same rows at once (the one-vs-rest multiclass classifier uses
        this): same sample sequence, one AllReduce of the ``K`` margin columns and the one
        shared Gram matrix per outer iteration; ``coef`` then has ``K`` columns.
    model : str
        ``logistic``, ``linear`` or ``poisson``.
    solver : str
        ``sgd`` (one AllReduce of b margins per step) or ``casgd`` (one AllReduce of the
        packed ``[r; G]`` per ``s`` steps).
    s : int
        Steps per outer iteration (``sgd`` uses it only to group steps for checkpoints).
    b : int
        Mini-batch size.
    lr : float
        Step size ``eta``; the mini-batch gradient is a mean, so the step is ``eta/b``
        times the summed gradient.
    epochs : int
        Passes over the data (total, including those before a resume).
    lam : float
        L2 strength ``lambda`` (0 allowed).
    seed : int
        Seed of the shared sample sequence.
    recipe : str, Recipe or mapping
        Precision preset (``fp64``, ``fp32``, ``C``, ``D``) or recipe.
    slots : iterable of str or mapping, optional
        Per-slot overrides, e.g. ``["comm=bf16"]``.
    comm : mpi4py.MPI.Comm, optional
        Defaults to ``MPI.COMM_WORLD``.
    allreduce : str or callable
        ``"mpi"``, an ``optcc_mpi.allreduce`` algorithm, or ``f(buf, comm)`` reducing in place.
    links : Links or str, optional
        Link profile for an ``optcc_mpi.allreduce`` algorithm (``"3:0.5"``).
    emulate : Emulation or str, optional
        Network emulation (``"latency=50us"``), passed to the AllReduce; for ``"mpi"`` and
        callables each AllReduce waits ``ceil(log2 P)`` message latencies here.
    cols : slice, optional
        Global columns of this rank's block (see ``X``).
    w0 : ndarray, optional
        Initial weights (this rank's slice when ``cols`` is given, else all of them);
        zeros by default.
    gram_layout : str
        ``lower`` (send only the Gram blocks the recurrence reads) or ``full``.
    eval_every : int
        Record the full loss every this many SGD steps as well as at each epoch end.
    checkpoint : path-like, optional
        HDF5 checkpoint file.
    checkpoint_every : int
        Write the checkpoint every this many outer iterations (and at the end).
    resume : bool
        Continue from ``checkpoint`` if it exists (a missing file starts afresh).
    progress : bool
        Show a progress bar on rank 0.
    on_record : callable, optional
        Called with every loss record (on every rank).
    device : str or module
        ``cpu``, ``gpu``, ``auto``, or an array module for the local kernels.
    sample_weight : array_like, shape (m,), optional
        Non-negative weights of the rows, the same on every rank. The objective becomes
        ``sum_i sw_i l_i / sum_i sw_i + (lam/2) ||w||^2``: the weights are normalised to
        mean 1 and scale each row's residual, so in full batch (``b = m``) a weight of 2
        is the same as the row appearing twice. All-equal weights are no weights.
    divergence_factor : float or None
        Stop with ``DivergenceError`` when a recorded loss (each epoch end, and every
        ``eval_every`` steps) exceeds both ``divergence_factor`` times the best loss
        recorded before it and the loss at the start. Default 10; None or inf turns the
        check off (non-finite losses and residuals always stop training).

    Returns
    -------
    FitResult

    Raises
    ------
    ValueError
        On every rank, before training, for any invalid input on any rank.
    optcc_mpi.glm.DivergenceError
        On every rank, if the iterates become non-finite or the loss diverges (see
        ``divergence_factor``); the message advises on the step size.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    # 1. Check every argument on this rank, then agree across the ranks (collective): a bad
    #    input on any rank stops every rank here, with its message, before any training.
    error = None
    opts: _Options | None = None
    inputs: _Inputs | None = None
    payload = xp = reducer = None
    try:
        opts = _check_options(
            model=model,
            solver=solver,
            s=s,
            b=b,
            lr=lr,
            epochs=epochs,
            lam=lam,
            seed=seed,
            recipe=recipe,
            slots=slots,
            gram_layout=gram_layout,
            eval_every=eval_every,
            checkpoint=checkpoint,
            checkpoint_every=checkpoint_every,
            resume=resume,
            divergence_factor=divergence_factor,
        )
        xp = resolve_device(device)
        reducer = Reducer(comm, allreduce, links=links, emulate=emulate)
        inputs = _check_inputs(opts.model, X, y, sample_weight, cols, w0)
        payload = inputs.summary()
    except (ValueError, TypeError, OverflowError) as exc:
        error = str(exc)
    shared = agree(comm, error, payload)  # raises on every rank if any rank failed
    assert opts is not None and inputs is not None and reducer is not None  # agree() passed
    opts, n_features = _check_across(comm.size, shared, opts, inputs)

    # 2. This rank's block of columns, and the trainer over it.
    run, w0 = _setup(comm, opts, inputs, n_features, xp, reducer)

    # 3. Where to start: from scratch, or from a checkpoint of the same run.
    state = TrainState(w=run.trainer.initial_weights(w0))
    resumed = None
    if opts.checkpoint is not None and opts.resume:
        state, resumed = _resume(run, state)

    # 4. The solver loop, writing checkpoints as it goes.
    _train(run, state, progress=progress, on_record=on_record)

    # 5. The results, the same on every rank.
    return _result(run, state, links=links, resumed=resumed)


# -- fit's phases ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    """:func:`fit`'s settings, checked (what :func:`_check_options` returns)."""

    model: Model
    solver: str
    recipe: Recipe
    gram_layout: str
    s: int
    b: int
    epochs: int
    seed: int
    eval_every: int
    checkpoint_every: int
    lr: float
    lam: float
    divergence_factor: float | None
    checkpoint: str | os.PathLike | None
    resume: bool


def _check_options(
    *,
    model: str,
    solver: str,
    s: int,
    b: int,
    lr: float,
    epochs: int,
    lam: float,
    seed: int,
    recipe: str | Recipe | Mapping[str, str],
    slots: Iterable[str] | Mapping[str, str] | None,
    gram_layout: str,
    eval_every: int,
    checkpoint: str | os.PathLike | None,
    checkpoint_every: int,
    resume: bool,
    divergence_factor: float | None,
) -> _Options:
    """Check :func:`fit`'s settings on this rank; a ``ValueError`` names the first bad one."""
    mdl = get_model(model)
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    rcp = get_recipe(recipe, slots)
    if gram_layout not in GRAM_LAYOUTS:
        raise ValueError(f"unknown gram_layout {gram_layout!r}; choose one of {GRAM_LAYOUTS}")
    s = _positive_int("s", s)
    b = _positive_int("b", b)
    epochs = _positive_int("epochs", epochs, 0)
    seed = _positive_int("seed", seed, 0)
    eval_every = _positive_int("eval_every", eval_every, 0)
    checkpoint_every = _positive_int("checkpoint_every", checkpoint_every, 0)
    lr = _finite("lr", lr, positive=True)
    lam = _finite("lam", lam)
    if divergence_factor is not None:
        factor = float(divergence_factor)
        if not factor > 1:
            raise ValueError(
                f"divergence_factor must be a number > 1 (or None to turn the check "
                f"off), got {divergence_factor!r}"
            )
        divergence_factor = None if math.isinf(factor) else factor
    if resume and checkpoint is None:
        raise ValueError("resume needs a checkpoint file")
    return _Options(
        model=mdl,
        solver=solver,
        recipe=rcp,
        gram_layout=gram_layout,
        s=s,
        b=b,
        epochs=epochs,
        seed=seed,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        lr=lr,
        lam=lam,
        divergence_factor=divergence_factor,
        checkpoint=checkpoint,
        resume=bool(resume),
    )


@dataclass(frozen=True)
class _Inputs:
    """This rank's arrays, checked: ``X`` (all columns, or its block ``cols``), the labels
    as float64, the weights normalised to mean 1 (None: unweighted), ``w0``."""

    X: Any
    y: np.ndarray
    sw: np.ndarray | None
    cols: slice | None
    w0: Any

    def summary(self) -> tuple[Any, ...]:
        """What the ranks compare: rows, columns, block, CRC-32 of ``y`` and of the weights."""
        return (
            self.X.shape[0],
            self.X.shape[1],
            None if self.cols is None else (self.cols.start, self.cols.stop),
            checksum(self.y),
            None if self.sw is None else checksum(self.sw),
        )


def _check_inputs(
    mdl: Model, X: Any, y: Any, sample_weight: Any, cols: slice | None, w0: Any
) -> _Inputs:
    """Check this rank's arrays (types, shapes, values, label domain); ``ValueError`` if bad."""
    X = _check_X(X)
    y_in = np.asarray(y)
    if y_in.ndim == 2 and y_in.shape[1] >= 1:
        y64 = mdl.check_labels(y_in.reshape(-1)).reshape(y_in.shape)
    else:
        y64 = mdl.check_labels(y_in)
    if y64.shape[0] != X.shape[0]:
        raise ValueError(f"X has {X.shape[0]} rows but y has {y64.shape[0]} labels")
    sw = _sample_weights(sample_weight, X.shape[0])
    if cols is not None:
        if not isinstance(cols, slice) or cols.step not in (None, 1):
            raise ValueError(f"cols must be a contiguous slice, got {cols!r}")
        if cols.stop - cols.start != X.shape[1]:
            raise ValueError(
                f"cols {cols.start}:{cols.stop} name {cols.stop - cols.start} columns but "
                f"X has {X.shape[1]}"
            )
    if w0 is not None and np.shape(w0) != (X.shape[1], *y64.shape[1:]):
        raise ValueError(
            f"w0 needs shape {(X.shape[1], *y64.shape[1:])} (X's columns, y's outputs), "
            f"got {np.shape(w0)}"
        )
    return _Inputs(X, y64, sw, cols, w0)


def _check_across(
    size: int, shared: list[tuple[Any, ...]], opts: _Options, inputs: _Inputs
) -> tuple[_Options, int]:
    """The checks across ranks, on every rank's :meth:`_Inputs.summary` (``shared``).

    Every rank reaches the same verdict from the same gathered data, so a ``ValueError``
    here is raised on every rank. Returns the options (SGD's ``s`` clipped to the steps of
    an epoch) and the number of features of the whole problem.
    """
    m = shared[0][0]
    if any(p[0] != m for p in shared):
        raise ValueError(f"ranks disagree on the number of rows: {[p[0] for p in shared]}")
    if any(p[3] != shared[0][3] for p in shared):
        raise ValueError("ranks hold different labels y (they must be replicated)")
    if any(p[4] != shared[0][4] for p in shared):
        raise ValueError("ranks hold different sample_weight (it must be replicated)")
    if len({p[2] is None for p in shared}) > 1:
        raise ValueError("either every rank passes cols (its column block) or none does")
    if inputs.cols is None:
        n_features = shared[0][1]
        if any(p[1] != n_features for p in shared):
            raise ValueError("without cols every rank must pass the full X (same shape)")
    else:
        spans = [p[2] for p in shared]
        if spans[0][0] != 0 or any(spans[i][1] != spans[i + 1][0] for i in range(size - 1)):
            raise ValueError(f"the ranks' cols must tile 0..n in rank order, got {spans}")
        n_features = spans[-1][1]
    if n_features < size:
        raise ValueError(
            f"{size} ranks but only {n_features} features: every rank needs at least one "
            f"column; run on at most {n_features} ranks"
        )
    if any(p[1] == 0 for p in shared) and inputs.cols is not None:
        raise ValueError("every rank needs at least one column (a block has width 0)")
    s, b = opts.s, opts.b
    if b > m:
        raise ValueError(f"the batch size b = {b} exceeds the {m} training rows")
    if opts.solver == "sgd":
        # SGD groups steps only for bookkeeping: any s works.
        opts = dataclasses.replace(opts, s=min(s, m // b))
    elif s * b > m:
        raise ValueError(f"s*b = {s}*{b} = {s * b} exceeds the {m} training rows; lower s or b")
    return opts, n_features


@dataclass(frozen=True)
class _Block:
    """This rank's columns of ``X`` (C-contiguous, or CSR), which they are, and its ``w0``."""

    X: Any
    cols: slice
    w0: Any


def _partition(comm: MPI.Comm, inputs: _Inputs, n_features: int) -> _Block:
    """This rank's block in the 1D block-column layout (:func:`column_block`), unless the
    caller passed its block already (``cols``)."""
    cols, w0 = inputs.cols, inputs.w0
    if cols is None:
        size = comm.size
        cols = column_block(n_features, size, comm.rank) if size > 1 else slice(0, n_features)
        X_local = inputs.X[:, cols]
        if w0 is not None:
            w0 = np.asarray(w0)[cols]
    else:
        X_local = inputs.X
    if not sp.issparse(X_local):
        X_local = np.ascontiguousarray(X_local)
    else:
        X_local = X_local.tocsr()
    return _Block(X_local, cols, w0)


@dataclass(frozen=True)
class _Run:
    """A run set up (phase 2): what the later phases share."""

    comm: MPI.Comm
    opts: _Options
    cols: slice
    local: LocalData
    trainer: Trainer
    #: What makes this run this run: a checkpoint resumes it only if it records the same.
    identity: dict[str, Any]


def _setup(
    comm: MPI.Comm,
    opts: _Options,
    inputs: _Inputs,
    n_features: int,
    xp: Any,
    reducer: Reducer,
) -> tuple[_Run, Any]:
    """Phase 2: this rank's block of columns in the kernels' precision and module, and the
    trainer over it. Returns the run and this rank's part of ``w0`` (None: zeros)."""
    block = _partition(comm, inputs, n_features)
    cfg = TrainConfig(
        opts.model.name,
        opts.solver,
        opts.s,
        opts.b,
        opts.lr,
        opts.lam,
        opts.seed,
        opts.recipe,
        opts.gram_layout,
    )
    local = LocalData(block.X, opts.recipe, xp=xp, layout=opts.gram_layout)
    trainer = Trainer(comm, local, block.X, inputs.y, opts.model, cfg, reducer, weights=inputs.sw)
    identity = {
        **cfg.as_dict(),
        "m": inputs.X.shape[0],
        "n_features": n_features,
        "y_crc32": checksum(inputs.y),
    }
    if inputs.sw is not None:  # only then, so that checkpoints of unweighted runs stay as they were
        identity["sample_weight_crc32"] = checksum(inputs.sw)
    return _Run(comm, opts, block.cols, local, trainer, identity), block.w0


def _resume(run: _Run, fresh: TrainState) -> tuple[TrainState, dict[str, Any] | None]:
    """Phase 3 (collective): the state saved in the run's checkpoint, or ``fresh`` if there
    is none; and where the run resumes (``steps``, ``epoch``, ``block``), or None."""
    path = run.opts.checkpoint
    saved = load_checkpoint(path, run.comm, run.identity, run.cols)
    if saved is None:
        if run.comm.rank == 0:
            print(f"no checkpoint at {path}; starting from scratch", file=sys.stderr)
        return fresh, None
    state = TrainState(
        w=rounded(saved["w"], run.opts.recipe.update),
        epoch=saved["epoch"],
        block=saved["block"],
        steps=saved["steps"],
        outer=saved["outer"],
        history=saved["history"],
        train_s=saved["train_s"],
        prior=saved["counters"],
    )
    return state, {"steps": state.steps, "epoch": state.epoch, "block": state.block}


def _train(
    run: _Run,
    state: TrainState,
    *,
    progress: bool,
    on_record: Callable[[dict[str, Any]], None] | None,
) -> None:
    """Phase 4: the solver loop (:meth:`Trainer.run`) up to ``opts.epochs``, updating
    ``state``, with a progress bar on rank 0 and a checkpoint every ``checkpoint_every``
    outer iterations and at the end."""
    opts, trainer = run.opts, run.trainer

    def write(st: TrainState) -> None:
        save_checkpoint(
            opts.checkpoint,
            run.comm,
            run.local.host(st.w),
            config=run.identity,
            position={
                "epoch": st.epoch,
                "block": st.block,
                "steps": st.steps,
                "outer": st.outer,
                "train_s": st.train_s,
            },
            history=st.history,
            counters=trainer.stats(st),
        )

    exit_env = _config.get(EXIT_AFTER_ENV)
    total = opts.epochs * trainer.sampler.blocks_per_epoch
    steps = "" if opts.solver == "sgd" else f" s={opts.s}"
    bar = Progress(
        total,
        desc=f"{opts.solver}{steps} b={opts.b} {opts.recipe.name}",
        enabled=progress and run.comm.rank == 0,
        unit="outer",
    )
    bar.n = min(state.outer, total)
    with bar:
        trainer.run(
            state,
            opts.epochs,
            eval_every=opts.eval_every,
            progress=bar,
            checkpoint=write if opts.checkpoint is not None else None,
            checkpoint_every=opts.checkpoint_every,
            exit_after=int(exit_env) if exit_env else None,
            on_record=on_record,
            divergence_factor=opts.divergence_factor,
        )


def _result(
    run: _Run, state: TrainState, *, links: Any, resumed: dict[str, Any] | None
) -> FitResult:
    """Phase 5 (collective): all weights on every rank, and the maxima of the times."""
    comm, trainer, local = run.comm, run.trainer, run.local
    w_local = np.asarray(local.host(state.w))
    coef = np.concatenate(comm.allgather(w_local.astype(np.float64)))
    stats = trainer.stats(state)
    maxima = np.array([stats["train_s"], stats["comm_s"], stats["compute_s"]])
    comm.Allreduce(MPI.IN_PLACE, maxima, MPI.MAX)
    stats.update(train_s_max=maxima[0], comm_s_max=maxima[1], compute_s_max=maxima[2])
    reducer = trainer.reducer
    config = {
        **run.identity,
        "epochs": run.opts.epochs,
        "P": comm.size,
        "allreduce": reducer.name,
        "emulate": None if reducer.emulate is None else str(reducer.emulate),
        "links": None if links is None else str(links),
        "device": "gpu" if local.on_device else "cpu",
        "steps_per_epoch": trainer.sampler.steps_per_epoch,
        "outer_per_epoch": trainer.sampler.blocks_per_epoch,
    }
    return FitResult(
        coef=coef,
        coef_local=w_local,
        cols=run.cols,
        final_loss=state.history[-1]["loss"],
        history=state.history,
        stats=stats,
        config=config,
        resumed_from=resumed,
    )


def fit_partition(partition: Any, **kwargs: Any) -> FitResult:
    """:func:`fit` on a ``optcc_mpi.data.Partition`` (this rank's block of a dataset file).

    The model defaults to the one matching the partition's ``task``.
    """
    kwargs.setdefault("model", model_for_task(partition.task))
    return fit(partition.X, partition.y, cols=partition.cols, **kwargs)
