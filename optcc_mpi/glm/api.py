"""``fit``: train a GLM with SGD or CA-SGD, from arrays or a loaded partition, over MPI or
torch.distributed.

Every check on the inputs runs before any training and ends in one small collective
(:func:`~optcc_mpi.glm.comm.agree`), so a bad input stops every rank with the same message
instead of leaving some ranks waiting in an AllReduce.

:func:`fit` runs in five phases: check and agree (:mod:`optcc_mpi.glm.inputs`:
:func:`~optcc_mpi.glm.inputs.check_options`, :func:`~optcc_mpi.glm.inputs.check_inputs`,
then :func:`~optcc_mpi.glm.inputs.check_across` on what every rank holds), then one
function each below it: set up this rank's column block and the trainer (:func:`_setup`,
with the validation split and ``s="auto"``), resume from a checkpoint (:func:`_resume`),
the solver loop (:func:`_train`) and the results (:func:`_result`).

Which kernels: over an mpi4py communicator NumPy (or CuPy with ``device="gpu"``, or SciPy
CSR), the AllReduce buffer on the host; over a torch.distributed process group PyTorch
tensors on the group's device (gloo: the CPU, NCCL: the current CUDA device, or the
device of ``X`` when it is a tensor), everything on that device
(:mod:`optcc_mpi.glm.torch_kernels`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp

from .. import config as _config
from ..data import column_block
from ..progress import Progress
from . import auto
from .checkpoint import load_checkpoint, save_checkpoint
from .comm import LIBRARY, Group, Reducer, checksum
from .inputs import (
    Inputs,
    Kernels,
    Options,
    check_across,
    check_inputs,
    check_options,
    held_out_rows,
    kernels_for,
)
from .kernels import LocalData
from .models import model_for_task
from .precision import Recipe, is_tensor, storage_dtype
from .solvers import (
    DIVERGENCE_FACTOR,
    EXIT_AFTER_ENV,
    STOP_REASONS,
    TrainConfig,
    Trainer,
    TrainState,
)

__all__ = [
    "FitResult",
    "column_block",
    "fit",
    "fit_partition",
]


@dataclass
class FitResult:
    """What :func:`fit` returns (the same on every rank except ``coef_local``).

    Attributes
    ----------
    coef : ndarray, shape (n_features,) or (n_features, K)
        All weights, float64, on every rank (``K`` columns when ``y`` had ``K``).
    coef_local : ndarray or tensor
        This rank's rows of ``coef`` in the update precision (a tensor on the group's
        device over torch.distributed).
    cols : slice
        This rank's global columns.
    final_loss : float
        Full training objective at the end.
    history : list of dict
        Loss records (``steps``, ``epoch``, ``loss``, ``train_s``, ``epoch_end``, ``lr``,
        and ``val_score`` with early stopping).
    n_iter : int
        Epochs run (resumed segments included).
    stop_reason : str
        Why training stopped: a key of ``optcc_mpi.glm.solvers.STOP_REASONS``
        (``converged``, ``no_validation_improvement``, ``max_iter``);
        :attr:`stop_text` says it in words.
    train_score : float
        The model's score on the training rows at the end: accuracy (logistic), R^2
        (linear), D^2 (Poisson); with sample weights, weighted.
    val_score : float or None
        The same on the rows held out by ``early_stopping`` (None without).
    stats : dict
        AllReduce calls and bytes, ``comm_s``, ``compute_s``, ``train_s`` (rank 0's; the
        ``*_max`` entries are the maxima over ranks), evaluation counters.
    config : dict
        Settings of the run (model, solver, s, b, lr, lam, seed, recipe, P, m, n ...).
    resumed_from : dict or None
        ``steps`` and ``epoch`` of the checkpoint the run continued from.
    """

    coef: np.ndarray
    coef_local: Any
    cols: slice
    final_loss: float
    history: list[dict[str, Any]]
    stats: dict[str, Any]
    config: dict[str, Any]
    resumed_from: dict[str, Any] | None = None
    n_iter: int = 0
    stop_reason: str = "max_iter"
    train_score: float = math.nan
    val_score: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def converged(self) -> bool:
        """Whether the stopping rule stopped training (not ``max_iter``)."""
        return self.stop_reason in ("converged", "no_validation_improvement")

    @property
    def stop_text(self) -> str:
        """Why training stopped, in words."""
        return STOP_REASONS.get(self.stop_reason, self.stop_reason)

    def epoch_losses(self) -> list[float]:
        """Full training loss at the end of each epoch."""
        return [h["loss"] for h in self.history if h["epoch_end"]]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (weights omitted)."""
        return {
            "final_loss": self.final_loss,
            "n_iter": self.n_iter,
            "stop_reason": self.stop_reason,
            "train_score": self.train_score,
            "val_score": self.val_score,
            "epoch_losses": self.epoch_losses(),
            "history": self.history,
            "stats": self.stats,
            "config": self.config,
            "resumed_from": self.resumed_from,
        }


def fit(
    X: Any,
    y: Any,
    *,
    model: str = "logistic",
    solver: str = "casgd",
    s: int | str = "auto",
    b: int = 32,
    lr: float = 0.5,
    max_iter: int = 1000,
    tol: float | None = 1e-3,
    n_iter_no_change: int = 5,
    learning_rate: str = "adaptive",
    early_stopping: bool = False,
    validation_fraction: float = 0.1,
    epochs: int | None = None,
    lam: float = 0.0,
    seed: int = 0,
    recipe: str | Recipe | Mapping[str, str] = "fp32",
    slots: Iterable[str] | Mapping[str, str] | None = None,
    comm: Any = None,
    allreduce: str | Callable[[Any, Any], None] = LIBRARY,
    links: Any = None,
    emulate: Any = None,
    cols: slice | None = None,
    n_features: int | None = None,
    w0: Any = None,
    gram_layout: str = "lower",
    eval_every: int = 0,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    progress: bool = False,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    device: Any = None,
    sample_weight: Any = None,
    divergence_factor: float | None = DIVERGENCE_FACTOR,
) -> FitResult:
    """Fit a GLM by mini-batch SGD or CA-SGD; collective over ``comm``.

    The objective is ``mean loss + (lam/2) ||w||^2`` without an intercept (append a
    column of ones for one; it is then penalised too).

    Parameters
    ----------
    X : ndarray, scipy.sparse matrix or torch.Tensor
        With ``cols=None``: the full ``(m, n)`` matrix, the same on every rank; each rank
        keeps its column block. With ``cols``: this rank's ``(m, n_local)`` block.
        Any float dtype, bf16 included. A tensor stays on its device over a
        torch.distributed group (and is copied to NumPy over MPI).
    y : array_like or tensor, shape (m,) or (m, K)
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
    s : int or "auto"
        Steps per outer iteration (``sgd`` uses it only to group steps for checkpoints).
        ``"auto"``: the fastest by the cost model (:mod:`optcc_mpi.glm.auto`): 1 on one
        process (no communication to save), else the argmin of the modelled time per
        step; the value used is ``config["s"]``.
    b : int
        Mini-batch size.
    lr : float
        Step size ``eta`` (the first one with ``learning_rate="adaptive"``); the
        mini-batch gradient is a mean, so the step is ``eta/b`` times the summed gradient.
    max_iter : int
        Epochs at most (the run's total, resumed segments included).
    tol : float or None
        Stop (or, adaptive, divide the step by 5) after ``n_iter_no_change`` epochs whose
        training objective (the validation score with ``early_stopping``) did not improve
        on the best by ``tol``. None: run ``max_iter`` epochs.
    n_iter_no_change : int
        Epochs without improvement that make a plateau.
    learning_rate : {"adaptive", "constant"}
        ``adaptive``: at a plateau divide the step by 5, and stop only when the last
        division improved the criterion by less than ``tol``; ``constant``: stop at the
        first plateau. The same either way with ``tol=None``.
    early_stopping : bool
        Hold out ``validation_fraction`` of the rows (stratified by class for logistic,
        drawn from ``seed``, the same on every rank) and judge improvement by the score on
        them (accuracy for logistic, R^2 for linear, D^2 for Poisson) instead of the
        training objective.
    validation_fraction : float
        Share of the rows held out with ``early_stopping`` (in (0, 1)).
    epochs : int, optional
        Deprecated: ``max_iter=epochs, tol=None`` (exactly that many epochs), with a
        ``FutureWarning``.
    lam : float
        L2 strength ``lambda`` (0 allowed).
    seed : int
        Seed of the shared sample sequence.
    recipe : str, Recipe or mapping
        Precision preset (``fp64``, ``fp32``, ``C``, ``D``) or recipe.
    slots : iterable of str or mapping, optional
        Per-slot overrides, e.g. ``["comm=bf16"]``.
    comm : mpi4py communicator or torch.distributed.ProcessGroup, optional
        The ranks that train together. Default: torch.distributed's default group when
        torch.distributed is initialised, else ``MPI.COMM_WORLD``
        (:func:`optcc_mpi.glm.comm.default_comm`).
    allreduce : str or callable
        ``"native"`` (the library's own AllReduce; ``"mpi"`` is the same), an
        ``optcc_mpi.allreduce`` algorithm, or ``f(buf, comm)`` reducing in place.
    links : Links or str, optional
        Link profile for an ``optcc_mpi.allreduce`` algorithm (``"3:0.5"``).
    emulate : Emulation or str, optional
        Network emulation (``"latency=50us"``), passed to the AllReduce; for ``"native"``
        and callables each AllReduce lasts the modelled time of the library's AllReduce
        (:func:`optcc_mpi.model.library_allreduce`).
    cols : slice, optional
        Global columns of this rank's block (see ``X``).
    n_features : int, optional
        With ``cols``: the number of columns of the whole problem (``Partition.n_features``);
        the ranks' blocks must then tile ``0..n_features`` in rank order, which catches
        blocks split for another communicator.
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
        Show a progress bar on rank 0 (the epoch and its running mini-batch loss).
    on_record : callable, optional
        Called with every loss record (on every rank).
    device : str, module or torch.device, optional
        Over MPI: ``cpu`` (default), ``gpu`` or ``auto`` (CuPy), or an array module for
        the local kernels. Over torch.distributed: where the tensors live, by default the
        group's (gloo: CPU; NCCL: the current CUDA device) or ``X``'s; ``cpu``/``gpu``
        are checked against it.
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
        With ``n_iter`` (epochs run) and ``stop_reason``. ``fit`` itself warns of
        nothing when ``max_iter`` ends the run; the estimators raise scikit-learn's
        ``ConvergenceWarning``.

    Raises
    ------
    ValueError
        On every rank, before training, for any invalid input on any rank.
    optcc_mpi.glm.DivergenceError
        On every rank, if the iterates become non-finite or the loss diverges (see
        ``divergence_factor``); the message advises on the step size.

    Examples
    --------
    On one process (``COMM_WORLD`` of size 1 under plain ``python``; under ``mpiexec``
    every rank runs the same lines and keeps its block of columns):

    >>> from optcc_mpi.glm import fit, make_glm_data
    >>> X, y = make_glm_data("linear", 1024, 16, seed=0)
    >>> res = fit(X, y, model="linear", solver="casgd", s=4, b=32, lr=0.1, max_iter=20)
    >>> res.coef.shape, res.train_score > 0.95
    ((16,), True)

    SGD and CA-SGD follow the same sample sequence: in fp64 their weights agree to
    roundoff, and CA-SGD makes one AllReduce per ``s`` steps instead of one per step:

    >>> sgd = fit(X, y, model="linear", solver="sgd", b=32, lr=0.1, max_iter=3, tol=None,
    ...           recipe="fp64")
    >>> ca = fit(X, y, model="linear", solver="casgd", s=8, b=32, lr=0.1, max_iter=3,
    ...          tol=None, recipe="fp64")
    >>> bool(abs(sgd.coef - ca.coef).max() < 1e-12)
    True
    >>> sgd.stats["allreduce_calls"], ca.stats["allreduce_calls"]
    (96, 12)
    """
    if epochs is not None:
        warnings.warn(
            "fit(epochs=E) is deprecated and will be removed: pass max_iter=E, tol=None "
            "for exactly E epochs (or leave tol set to stop when the loss stops improving)",
            FutureWarning,
            stacklevel=2,
        )
    # The ranks: refused at once if comm is not a communicator (nobody to agree with).
    group = Group(comm)
    # 1. Check every argument on this rank, then agree across the ranks (collective): a bad
    #    input on any rank stops every rank here, with its message, before any training.
    error = None
    opts: Options | None = None
    inputs: Inputs | None = None
    payload = kernels = reducer = None
    try:
        opts = check_options(
            model=model,
            solver=solver,
            s=s,
            b=b,
            lr=lr,
            max_iter=max_iter if epochs is None else epochs,
            tol=tol if epochs is None else None,
            n_iter_no_change=n_iter_no_change,
            learning_rate=learning_rate,
            early_stopping=early_stopping,
            validation_fraction=validation_fraction,
            fixed_epochs=epochs is not None,
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
        kernels = kernels_for(group, X, device)
        reducer = Reducer(group, allreduce, links=links, emulate=emulate)
        inputs = check_inputs(opts.model, X, y, sample_weight, cols, w0, kernels, n_features)
        payload = inputs.summary(kernels)
    except (ValueError, TypeError, OverflowError) as exc:
        error = str(exc)
    shared = group.agree(error, payload)  # raises on every rank if any rank failed
    assert opts is not None and inputs is not None and reducer is not None  # agreed
    assert kernels is not None
    opts, n_total = check_across(group.size, shared, opts, inputs)

    # 2. This rank's block of columns, the rows trained on, s, and the trainer.
    run, w0 = _setup(group, opts, inputs, n_total, kernels, reducer, shared)

    # 3. Where to start: from scratch, or from a checkpoint of the same run.
    state = TrainState(w=run.trainer.initial_weights(w0), lr=run.opts.lr)
    resumed = None
    if opts.checkpoint is not None and opts.resume:
        state, resumed = _resume(run, state)

    # 4. The solver loop, writing checkpoints as it goes.
    _train(run, state, progress=progress, on_record=on_record)

    # 5. The results, the same on every rank.
    return _result(run, state, links=links, resumed=resumed)


# -- fit's phases ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _DataBlock:
    """This rank's columns of ``X`` (C-contiguous, or CSR; a tensor for torch kernels),
    which they are, and its ``w0``."""

    X: Any
    cols: slice
    w0: Any


def _partition(group: Group, inputs: Inputs, n_features: int) -> _DataBlock:
    """This rank's block in the 1D block-column layout (:func:`column_block`), unless the
    caller passed its block already (``cols``)."""
    cols, w0 = inputs.cols, inputs.w0
    if cols is None:
        size = group.size
        cols = column_block(n_features, size, group.rank) if size > 1 else slice(0, n_features)
        X_local = inputs.X[:, cols]
        if w0 is not None:
            w0 = np.asarray(w0)[cols]
    else:
        X_local = inputs.X
    if is_tensor(X_local):
        X_local = X_local.contiguous()
    elif not sp.issparse(X_local):
        X_local = np.ascontiguousarray(X_local)
    else:
        X_local = X_local.tocsr()
    return _DataBlock(X_local, cols, w0)


@dataclass(frozen=True)
class _TrainRun:
    """A run set up (phase 2): what the later phases share."""

    group: Group
    opts: Options
    cols: slice
    local: Any
    trainer: Trainer
    #: What makes this run this run: a checkpoint resumes it only if it records the same.
    identity: dict[str, Any]
    kernels: Kernels


def _local_data(block: _DataBlock, opts: Options, kernels: Kernels) -> Any:
    """The kernels over this rank's block."""
    if kernels.kind == "torch":
        from .torch_kernels import TorchLocalData  # imports torch: the group is torch's

        return TorchLocalData(
            block.X, opts.recipe, device=kernels.torch_device, layout=opts.gram_layout
        )
    return LocalData(block.X, opts.recipe, xp=kernels.xp, layout=opts.gram_layout)


def _auto_s(
    group: Group,
    opts: Options,
    local: Any,
    reducer: Reducer,
    outputs: int,
    n_local_max: int,
    m_train: int,
) -> int:
    """``s="auto"`` (:mod:`optcc_mpi.glm.auto`); collective when there are several ranks."""
    s_max = max(1, min(auto.S_MAX, m_train // opts.b))
    if group.size == 1 or s_max == 1:
        return 1
    b = opts.b
    itemsize = storage_dtype(opts.recipe.comm).itemsize
    net = auto.network_of(reducer.emulate)
    if net is None:

        def reduce(buf: np.ndarray) -> None:
            group.sum(local.space(buf))
            local.sync()

        net = auto.measure_network(reduce, group.size)
    rows = local.space(np.arange(s_max * b) % local.m)
    Yd = local.gather(rows)

    def gram() -> None:
        local.gram_packed(Yd, s_max, b)
        local.sync()

    flops, _ = auto._flops_bytes(s_max, b, local.n_local, 1, opts.gram_layout)
    gamma = auto.measure_gamma(gram, flops - 4.0 * s_max * b * local.n_local)
    figures = group.allgather((net[0], net[1], gamma))
    latency = max(f[0] for f in figures)
    bws = [f[1] for f in figures if f[1]]
    bw = min(bws) if len(bws) == len(figures) else None
    return auto.choose_s(
        p=group.size,
        b=b,
        n_local=n_local_max,
        outputs=outputs,
        latency=latency,
        bw=bw,
        gamma=max(f[2] for f in figures),
        s_max=s_max,
        layout=opts.gram_layout,
        itemsize=itemsize,
    )


def _setup(
    group: Group,
    opts: Options,
    inputs: Inputs,
    n_features: int,
    kernels: Kernels,
    reducer: Reducer,
    shared: list[tuple[Any, ...]],
) -> tuple[_TrainRun, Any]:
    """Phase 2: this rank's block of columns in the kernels' precision and array kind, the
    rows trained on, ``s``, and the trainer over it. Returns the run and this rank's part
    of ``w0`` (None: zeros)."""
    block = _partition(group, inputs, n_features)
    local = _local_data(block, opts, kernels)
    val_rows = held_out_rows(inputs.y, opts)
    m = inputs.y.shape[0]
    train_rows = None
    sw = inputs.sw
    if val_rows.size:
        train_rows = np.setdiff1d(np.arange(m), val_rows)
        if sw is not None:
            # Mean 1 over the training rows, as the objective's weights must be.
            sw = sw * (train_rows.size / float(sw[train_rows].sum()))
    m_train = m if train_rows is None else int(train_rows.size)
    outputs = inputs.y.shape[1] if inputs.y.ndim == 2 else 1
    if opts.s == 0:
        if group.size == 1:
            widest = local.n_local
        elif inputs.cols is None:
            widest = -(-n_features // group.size)
        else:
            widest = max(p[1] for p in shared)
        opts = dataclasses.replace(
            opts, s=_auto_s(group, opts, local, reducer, outputs, widest, m_train)
        )
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
        learning_rate=opts.learning_rate,
        tol=opts.tol,
        n_iter_no_change=opts.n_iter_no_change,
        validation_fraction=opts.validation_fraction,
    )
    trainer = Trainer(
        group,
        local,
        inputs.y,
        opts.model,
        cfg,
        reducer,
        weights=sw,
        train_rows=train_rows,
        val_rows=val_rows if val_rows.size else None,
    )
    identity = {
        **cfg.as_dict(),
        "m": inputs.X.shape[0],
        "n_features": n_features,
        "y_crc32": checksum(inputs.y),
    }
    if inputs.sw is not None:  # only then, so that checkpoints of unweighted runs stay as they were
        identity["sample_weight_crc32"] = checksum(inputs.sw)
    return _TrainRun(group, opts, block.cols, local, trainer, identity, kernels), block.w0


def _resume(run: _TrainRun, fresh: TrainState) -> tuple[TrainState, dict[str, Any] | None]:
    """Phase 3 (collective): the state saved in the run's checkpoint, or ``fresh`` if there
    is none; and where the run resumes (``steps``, ``epoch``, ``block``), or None."""
    path = run.opts.checkpoint
    saved = load_checkpoint(path, run.group, run.identity, run.cols)
    if saved is None:
        if run.group.rank == 0:
            print(f"no checkpoint at {path}; starting from scratch", file=sys.stderr)
        return fresh, None
    schedule = saved["schedule"]
    state = TrainState(
        w=run.local.initial(saved["w"], run.opts.recipe.update),
        epoch=saved["epoch"],
        block=saved["block"],
        steps=saved["steps"],
        outer=saved["outer"],
        history=saved["history"],
        train_s=saved["train_s"],
        prior=saved["counters"],
        lr=schedule.get("lr") or run.opts.lr,
        best=float(schedule.get("best", math.inf)),
        best_at_cut=float(schedule.get("best_at_cut", math.inf)),
        no_improve=int(schedule.get("no_improve", 0)),
        cuts=int(schedule.get("cuts", 0)),
        # A run stopped by its rule stays stopped; one that reached max_iter may go on.
        stop_reason=schedule.get("stop_reason")
        if schedule.get("stop_reason") in ("converged", "no_validation_improvement")
        else None,
    )
    return state, {"steps": state.steps, "epoch": state.epoch, "block": state.block}


def _train(
    run: _TrainRun,
    state: TrainState,
    *,
    progress: bool,
    on_record: Callable[[dict[str, Any]], None] | None,
) -> None:
    """Phase 4: the solver loop (:meth:`Trainer.run`) until the stopping rule says so,
    updating ``state``, with a progress bar on rank 0 and a checkpoint every
    ``checkpoint_every`` outer iterations and at the end."""
    opts, trainer = run.opts, run.trainer

    def write(st: TrainState) -> None:
        save_checkpoint(
            opts.checkpoint,
            run.group,
            run.local.host(st.w),
            config=run.identity,
            position={
                "epoch": st.epoch,
                "block": st.block,
                "steps": st.steps,
                "outer": st.outer,
                "train_s": st.train_s,
            },
            schedule=st.schedule(),
            history=st.history,
            counters=trainer.stats(st),
        )

    exit_env = _config.get(EXIT_AFTER_ENV)
    per_epoch = trainer.sampler.blocks_per_epoch
    # With a tolerance the length is unknown: count outer iterations without a total.
    total = opts.max_iter * per_epoch if opts.tol is None else None
    steps = "" if opts.solver == "sgd" else f" s={opts.s}"
    bar = Progress(
        total,
        desc=f"{opts.solver}{steps} b={opts.b} {opts.recipe.name}",
        enabled=progress and run.group.rank == 0,
        unit="outer",
    )
    bar.n = state.outer if total is None else min(state.outer, total)
    with bar:
        trainer.run(
            state,
            opts.stopping(),
            eval_every=opts.eval_every,
            progress=bar,
            checkpoint=write if opts.checkpoint is not None else None,
            checkpoint_every=opts.checkpoint_every,
            exit_after=int(exit_env) if exit_env else None,
            on_record=on_record,
            divergence_factor=opts.divergence_factor,
        )


def _result(
    run: _TrainRun, state: TrainState, *, links: Any, resumed: dict[str, Any] | None
) -> FitResult:
    """Phase 5 (collective): all weights on every rank, and the maxima of the times."""
    group, trainer, local = run.group, run.trainer, run.local
    train_score = trainer.score(state.w, trainer.train_rows)
    val_score = None if trainer.val_rows is None else trainer.score(state.w, trainer.val_rows)
    w_local = np.asarray(local.host(state.w))
    stats = trainer.stats(state)
    times = (stats["train_s"], stats["comm_s"], stats["compute_s"])
    gathered = group.allgather((w_local.astype(np.float64), times))
    coef = np.concatenate([g[0] for g in gathered])
    maxima = np.max([g[1] for g in gathered], axis=0)
    stats.update(train_s_max=maxima[0], comm_s_max=maxima[1], compute_s_max=maxima[2])
    reducer = trainer.reducer
    opts = run.opts
    config = {
        **run.identity,
        "max_iter": opts.max_iter,
        "P": group.size,
        "backend": group.library,
        "allreduce": reducer.name,
        "emulate": None if reducer.emulate is None else str(reducer.emulate),
        "links": None if links is None else str(links),
        "device": ("gpu" if local.on_device else "cpu")
        if run.kernels.kind == "numpy"
        else str(run.kernels.torch_device),
        "kernels": run.kernels.kind,
        "steps_per_epoch": trainer.sampler.steps_per_epoch,
        "outer_per_epoch": trainer.sampler.blocks_per_epoch,
        "m_train": trainer.sampler.m,
    }
    return FitResult(
        coef=coef,
        coef_local=state.w if run.kernels.kind == "torch" else w_local,
        cols=run.cols,
        final_loss=state.history[-1]["loss"],
        history=state.history,
        stats=stats,
        config=config,
        resumed_from=resumed,
        n_iter=state.epoch,
        stop_reason=state.stop_reason or "max_iter",
        train_score=train_score,
        val_score=val_score,
    )


def fit_partition(partition: Any, **kwargs: Any) -> FitResult:
    """:func:`fit` on a ``optcc_mpi.data.Partition`` (this rank's block of a dataset file).

    The model defaults to the one matching the partition's ``task``; the partition's
    ``n_features`` is checked against the blocks the ranks of ``comm`` hold together.
    """
    kwargs.setdefault("model", model_for_task(partition.task))
    kwargs.setdefault("n_features", partition.n_features)
    return fit(partition.X, partition.y, cols=partition.cols, **kwargs)
