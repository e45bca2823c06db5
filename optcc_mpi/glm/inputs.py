"""What :func:`~optcc_mpi.glm.api.fit` is given, checked: on this rank, then across the
ranks.

Phase 1 of ``fit`` (:mod:`optcc_mpi.glm.api`): :func:`check_options` checks the settings
(:class:`Options`), :func:`kernels_for` where this rank computes (:class:`Kernels`:
NumPy, CuPy or SciPy over MPI, torch over a process group; :func:`resolve_device`),
:func:`check_inputs` this rank's arrays (:class:`Inputs`). Each raises ``ValueError``
(:class:`~optcc_mpi.errors.ArgumentError`) on this rank only; ``fit`` then agrees on the
outcome in one small collective (:func:`~optcc_mpi.glm.comm.agree`), and
:func:`check_across` judges what every rank holds (:meth:`Inputs.summary`), the same on
every rank. :func:`validation_rows` says which rows ``early_stopping`` holds out.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import scipy.sparse as sp

from ..arrays import get_cupy
from ..errors import ArgumentError
from .comm import Group, checksum
from .kernels import GRAM_LAYOUTS
from .models import Model, get_model
from .precision import Recipe, get_recipe, is_tensor
from .solvers import LEARNING_RATES, SOLVERS, Stopping

__all__ = [
    "Inputs",
    "Kernels",
    "Options",
    "check_across",
    "check_inputs",
    "check_options",
    "held_out_rows",
    "kernels_for",
    "resolve_device",
    "validation_rows",
]


def resolve_device(device: Any) -> Any:
    """Array module for the local kernels: NumPy for ``"cpu"``, CuPy for ``"gpu"``.

    ``"auto"`` picks the GPU when one is usable. CuPy is obtained from
    ``optcc_mpi.arrays.get_cupy()`` (the only module allowed to import it), which returns
    the module when ``cupy.is_available()`` and None otherwise. A module object is
    returned unchanged (for callers and tests that bring their own).
    """
    if not isinstance(device, str):
        return device
    name = device.lower()
    if name == "cpu":
        return np
    if name not in ("gpu", "auto"):
        raise ArgumentError(f"unknown device {device!r}; choose cpu, gpu or auto")
    cp = get_cupy()
    if cp is not None:
        return cp
    if name == "auto":
        return np
    raise ArgumentError(
        "device='gpu' but no usable GPU (CuPy missing or cupy.is_available() is False)"
    )


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or int(value) != value or int(value) < minimum:
        raise ArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _finite(name: str, value: Any, *, positive: bool = False) -> float:
    v = float(value)
    if not math.isfinite(v) or (v <= 0 if positive else v < 0):
        raise ArgumentError(
            f"{name} must be a finite {'positive' if positive else 'non-negative'} number, "
            f"got {value!r}"
        )
    return v


def _to_numpy(a: Any) -> np.ndarray:
    """A tensor's values as a NumPy array on the host (bf16 as ``ml_dtypes.bfloat16``)."""
    t = a.detach().cpu()
    if str(t.dtype) == "torch.bfloat16":
        import torch  # loaded already: a is a tensor

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _check_tensor_X(X: Any) -> Any:
    import torch  # loaded already: X is a tensor

    if X.layout != torch.strided:
        raise ArgumentError(
            "X is a sparse tensor: pass a dense tensor (or a SciPy CSR matrix under MPI)"
        )
    if X.ndim != 2:
        raise ArgumentError(f"X must be a 2-D tensor (rows = samples), got shape {tuple(X.shape)}")
    if not X.is_floating_point():
        if X.is_complex():
            raise ArgumentError(f"X must hold floating-point numbers, got dtype {X.dtype}")
        X = X.double()
    if not bool(X.isfinite().all()):
        raise ArgumentError("X contains NaN or inf")
    return X


def _host(a: Any) -> Any:
    """``a`` as an array NumPy can read (tensors copied to the host)."""
    return _to_numpy(a) if is_tensor(a) else a


def _check_X(X: Any) -> Any:
    if is_tensor(X):
        return _check_tensor_X(X)
    if sp.issparse(X):
        if X.ndim != 2:
            raise ArgumentError(f"X must be 2-D, got shape {X.shape}")
        values = X.tocsr().data
    else:
        if not hasattr(X, "shape") or not hasattr(X, "dtype"):
            X = np.asarray(X)
        if X.ndim != 2:
            raise ArgumentError(f"X must be a 2-D array (rows = samples), got shape {X.shape}")
        if X.dtype.kind in "iub":
            X = X.astype(np.float64)
        values = X
    if values.dtype.kind not in "fV" and values.dtype.name != "bfloat16":
        raise ArgumentError(f"X must hold floating-point numbers, got dtype {values.dtype}")
    if not np.isfinite(values).all():
        raise ArgumentError("X contains NaN or inf")
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
        raise ArgumentError(f"sample_weight must hold numbers, got dtype {sw.dtype}")
    sw = sw.astype(np.float64)
    if sw.ndim == 0:
        sw = np.full(m, float(sw))
    if sw.shape != (m,):
        raise ArgumentError(f"sample_weight needs shape ({m},) like y, got {sw.shape}")
    if not np.isfinite(sw).all():
        raise ArgumentError("sample_weight contains NaN or inf")
    if (sw < 0).any():
        i = int(np.flatnonzero(sw < 0)[0])
        raise ArgumentError(f"sample_weight must be non-negative; sample_weight[{i}] = {sw[i]:g}")
    total = float(sw.sum())
    if not total > 0:
        raise ArgumentError("sample_weight sums to 0: at least one row needs a positive weight")
    if np.all(sw == sw[0]):
        return None
    return sw * (m / total)


@dataclass(frozen=True)
class Options:
    """``fit``'s settings, checked (what :func:`check_options` returns). ``s`` is 0 for
    ``"auto"`` until ``fit`` sets its run up (``optcc_mpi.glm.api._setup``)."""

    model: Model
    solver: str
    recipe: Recipe
    gram_layout: str
    s: int
    b: int
    max_iter: int
    tol: float | None
    n_iter_no_change: int
    learning_rate: str
    validation_fraction: float
    fixed_epochs: bool
    seed: int
    eval_every: int
    checkpoint_every: int
    lr: float
    lam: float
    divergence_factor: float | None
    checkpoint: str | os.PathLike | None
    resume: bool

    def stopping(self) -> Stopping:
        """The stopping rule of these settings."""
        return Stopping(
            max_iter=self.max_iter,
            tol=self.tol,
            n_iter_no_change=self.n_iter_no_change,
            learning_rate=self.learning_rate,
            reason="no_validation_improvement" if self.validation_fraction else "converged",
        )


def check_options(
    *,
    model: str,
    solver: str,
    s: int | str,
    b: int,
    lr: float,
    max_iter: int,
    tol: float | None,
    n_iter_no_change: int,
    learning_rate: str,
    early_stopping: bool,
    validation_fraction: float,
    fixed_epochs: bool,
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
) -> Options:
    """Check ``fit``'s settings on this rank; a ``ValueError`` names the first bad one."""
    mdl = get_model(model)
    if solver not in SOLVERS:
        raise ArgumentError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    rcp = get_recipe(recipe, slots)
    if gram_layout not in GRAM_LAYOUTS:
        raise ArgumentError(f"unknown gram_layout {gram_layout!r}; choose one of {GRAM_LAYOUTS}")
    s = 0 if isinstance(s, str) and s == "auto" else _positive_int("s", s)
    b = _positive_int("b", b)
    max_iter = _positive_int("epochs" if fixed_epochs else "max_iter", max_iter, 0)
    if tol is not None:
        tol = _finite("tol", tol)
    n_iter_no_change = _positive_int("n_iter_no_change", n_iter_no_change)
    if learning_rate not in LEARNING_RATES:
        raise ArgumentError(
            f"unknown learning_rate {learning_rate!r}; choose one of {', '.join(LEARNING_RATES)}"
        )
    if not isinstance(early_stopping, (bool, np.bool_)):
        raise ArgumentError(f"early_stopping must be True or False, got {early_stopping!r}")
    fraction = 0.0
    if early_stopping:
        fraction = float(validation_fraction)
        if not 0.0 < fraction < 1.0:
            raise ArgumentError(
                f"validation_fraction must be in (0, 1), got {validation_fraction!r}"
            )
    seed = _positive_int("seed", seed, 0)
    eval_every = _positive_int("eval_every", eval_every, 0)
    checkpoint_every = _positive_int("checkpoint_every", checkpoint_every, 0)
    lr = _finite("lr", lr, positive=True)
    lam = _finite("lam", lam)
    if divergence_factor is not None:
        factor = float(divergence_factor)
        if not factor > 1:
            raise ArgumentError(
                f"divergence_factor must be a number > 1 (or None to turn the check "
                f"off), got {divergence_factor!r}"
            )
        divergence_factor = None if math.isinf(factor) else factor
    if resume and checkpoint is None:
        raise ArgumentError("resume needs a checkpoint file")
    return Options(
        model=mdl,
        solver=solver,
        recipe=rcp,
        gram_layout=gram_layout,
        s=s,
        b=b,
        max_iter=max_iter,
        tol=tol,
        n_iter_no_change=n_iter_no_change,
        learning_rate=learning_rate,
        validation_fraction=fraction,
        fixed_epochs=fixed_epochs,
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
class Kernels:
    """Where this rank computes: NumPy-family kernels (``xp``: NumPy or CuPy) over MPI, or
    torch on ``torch_device`` over a process group."""

    kind: str  # "numpy" or "torch"
    xp: Any = None
    torch_device: Any = None

    @property
    def device_type(self) -> str:
        """``cpu`` or the accelerator's type (``cuda``): what the ranks must share."""
        if self.kind == "torch":
            return str(self.torch_device.type)
        return "cpu" if self.xp is np else "cuda"


def kernels_for(group: Group, X: Any, device: Any) -> Kernels:
    """The kernels of this rank (:mod:`optcc_mpi.glm.api`); ``ValueError`` where ``device``, ``X``
    and the group's library do not fit together."""
    if not group.is_torch:
        return Kernels("numpy", xp=resolve_device("cpu" if device is None else device))
    import torch  # the group is torch's: torch is loaded

    if is_tensor(X):
        dev = X.device
    elif group.library == "nccl":
        if not torch.cuda.is_available():
            raise ArgumentError("an NCCL process group but no usable CUDA device in this process")
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    if isinstance(device, str) and device.lower() in ("cpu", "gpu"):
        want = "cpu" if device.lower() == "cpu" else "cuda"
        if dev.type != want:
            raise ArgumentError(
                f"device={device!r} but the data are on {dev} (over {group.describe()})"
            )
    elif device not in (None, "auto"):
        raise ArgumentError(
            f"device={device!r}: over a torch.distributed group the tensors stay on X's "
            "device, or the group's (gloo: cpu, NCCL: the current CUDA device); pass "
            "None, 'auto', 'cpu' or 'gpu'"
        )
    if group.library == "gloo" and dev.type != "cpu":
        raise ArgumentError(
            f"X is on {dev} but the process group is gloo's, which moves CPU tensors: use "
            "an NCCL group for CUDA tensors, or move X to the CPU"
        )
    if group.library == "nccl" and dev.type != "cuda":
        raise ArgumentError(
            f"X is on {dev} but the process group is NCCL's, which moves CUDA tensors: "
            "move X to the GPU (or train over gloo on the CPU)"
        )
    return Kernels("torch", torch_device=dev)


@dataclass(frozen=True)
class Inputs:
    """This rank's arrays, checked: ``X`` (all columns, or its block ``cols``; a tensor
    for torch kernels, else NumPy/SciPy), the labels as float64, the weights normalised
    to mean 1 (None: unweighted), ``w0`` (NumPy), the declared ``n_features``."""

    X: Any
    y: np.ndarray
    sw: np.ndarray | None
    cols: slice | None
    w0: Any
    n_features: int | None = None

    def summary(self, kernels: Kernels) -> tuple[Any, ...]:
        """What the ranks compare: rows, columns, block, CRC-32 of ``y`` and of the
        weights, the device type, the declared number of features."""
        return (
            self.X.shape[0],
            self.X.shape[1],
            None if self.cols is None else (self.cols.start, self.cols.stop),
            checksum(self.y),
            None if self.sw is None else checksum(self.sw),
            kernels.device_type,
            self.n_features,
        )


def check_inputs(
    mdl: Model,
    X: Any,
    y: Any,
    sample_weight: Any,
    cols: slice | None,
    w0: Any,
    kernels: Kernels,
    n_features: int | None,
) -> Inputs:
    """Check this rank's arrays (types, shapes, values, label domain); ``ValueError`` if bad."""
    X = _check_X(X)
    if kernels.kind == "numpy" and is_tensor(X):
        X = _to_numpy(X)  # over MPI the kernels are NumPy's
    if kernels.kind == "torch" and sp.issparse(X):
        raise ArgumentError(
            "sparse X trains over MPI only: pass a dense array or tensor over a "
            "torch.distributed group"
        )
    y_in = np.asarray(_host(y))
    if y_in.ndim == 2 and y_in.shape[1] >= 1:
        y64 = mdl.check_labels(y_in.reshape(-1)).reshape(y_in.shape)
    else:
        y64 = mdl.check_labels(y_in)
    if y64.shape[0] != X.shape[0]:
        raise ArgumentError(f"X has {X.shape[0]} rows but y has {y64.shape[0]} labels")
    sw = _sample_weights(_host(sample_weight), X.shape[0])
    if cols is not None:
        if not isinstance(cols, slice) or cols.step not in (None, 1):
            raise ArgumentError(f"cols must be a contiguous slice, got {cols!r}")
        if cols.stop - cols.start != X.shape[1]:
            raise ArgumentError(
                f"cols {cols.start}:{cols.stop} name {cols.stop - cols.start} columns but "
                f"X has {X.shape[1]}"
            )
    if n_features is not None:
        if cols is None:
            raise ArgumentError("n_features goes with cols (this rank's block of the columns)")
        n_features = _positive_int("n_features", n_features)
    if w0 is not None:
        w0 = _host(w0)
        if np.shape(w0) != (X.shape[1], *y64.shape[1:]):
            raise ArgumentError(
                f"w0 needs shape {(X.shape[1], *y64.shape[1:])} (X's columns, y's outputs), "
                f"got {np.shape(w0)}"
            )
    return Inputs(X, y64, sw, cols, w0, n_features)


def check_across(
    size: int, shared: list[tuple[Any, ...]], opts: Options, inputs: Inputs
) -> tuple[Options, int]:
    """The checks across ranks, on every rank's :meth:`Inputs.summary` (``shared``).

    Every rank reaches the same verdict from the same gathered data, so a ``ValueError``
    here is raised on every rank. Returns the options and the number of features of the
    whole problem.
    """
    m = shared[0][0]
    if any(p[0] != m for p in shared):
        raise ArgumentError(f"ranks disagree on the number of rows: {[p[0] for p in shared]}")
    if any(p[3] != shared[0][3] for p in shared):
        raise ArgumentError("ranks hold different labels y (they must be replicated)")
    if any(p[4] != shared[0][4] for p in shared):
        raise ArgumentError("ranks hold different sample_weight (it must be replicated)")
    devices = [p[5] for p in shared]
    if len(set(devices)) > 1:
        where = ", ".join(f"rank {r} {d}" for r, d in enumerate(devices))
        raise ArgumentError(
            f"the ranks hold their data on different kinds of device ({where}): every rank "
            "must compute on the same kind (all CPU, or all GPU)"
        )
    if len({p[2] is None for p in shared}) > 1:
        raise ArgumentError("either every rank passes cols (its column block) or none does")
    if inputs.cols is None:
        n_features = shared[0][1]
        if any(p[1] != n_features for p in shared):
            raise ArgumentError("without cols every rank must pass the full X (same shape)")
    else:
        spans = [p[2] for p in shared]
        declared = {p[6] for p in shared}
        if len(declared) > 1:
            raise ArgumentError(f"ranks disagree on n_features: {[p[6] for p in shared]}")
        if spans[0][0] != 0 or any(spans[i][1] != spans[i + 1][0] for i in range(size - 1)):
            raise ArgumentError(
                f"the ranks' cols must tile 0..n in rank order, got {spans}: were the blocks "
                f"split for another communicator (another number of ranks, or another order) "
                f"than this one ({size} ranks)?"
            )
        n_features = spans[-1][1]
        total = declared.pop()
        if total is not None and total != n_features:
            raise ArgumentError(
                f"the {size} ranks' blocks cover columns 0..{n_features} of {total}: the data "
                f"were split for another communicator (another number of ranks) than this "
                f"one; load them with the communicator that trains"
            )
    if n_features < size:
        raise ArgumentError(
            f"{size} ranks but only {n_features} features: every rank needs at least one "
            f"column; run on at most {n_features} ranks"
        )
    if any(p[1] == 0 for p in shared) and inputs.cols is not None:
        raise ArgumentError("every rank needs at least one column (a block has width 0)")
    m_train = m - _validation_size(inputs.y, opts)
    s, b = opts.s, opts.b
    if opts.validation_fraction and m_train < m:
        held = m - m_train
        if held < 1 or m_train < 1:
            raise ArgumentError(
                f"validation_fraction={opts.validation_fraction:g} of {m} rows leaves "
                f"{m_train} to train on and {held} to validate: lower or raise it"
            )
    if b > m_train:
        raise ArgumentError(f"the batch size b = {b} exceeds the {m_train} training rows")
    if opts.solver == "sgd":
        # SGD groups steps only for bookkeeping: any s works ("auto": one step).
        opts = dataclasses.replace(opts, s=min(s or 1, m_train // b))
    elif s * b > m_train:
        raise ArgumentError(
            f"s*b = {s}*{b} = {s * b} exceeds the {m_train} training rows; lower s or b"
        )
    return opts, n_features


def _classes(y: np.ndarray) -> np.ndarray:
    """The class of each row for a stratified split (logistic): the label, or the column
    of the largest label with K outputs."""
    return np.argmax(y, axis=1) if y.ndim == 2 else (y > 0.5).astype(np.int64)


def validation_rows(y: np.ndarray, fraction: float, seed: int, *, stratify: bool) -> np.ndarray:
    """The rows ``early_stopping`` holds out, sorted (empty for ``fraction`` 0): a
    ``fraction`` share of every class (``stratify``: logistic; the class of a row with K
    label columns is its largest) or of all rows, at least one, drawn from ``seed`` (the
    same on every rank). A class of two rows or more keeps at least one to train on."""
    if not fraction:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng([seed, 0x5A11D])
    m = y.shape[0]
    if not stratify:
        return np.sort(rng.permutation(m)[: max(1, int(round(fraction * m)))])
    cls = _classes(y)
    held = []
    for c in np.unique(cls):
        rows = np.flatnonzero(cls == c)
        k = int(round(fraction * rows.size))
        if rows.size >= 2:
            k = min(max(k, 1), rows.size - 1)  # every class both trained on and validated
        held.append(rng.permutation(rows)[:k])
    return np.sort(np.concatenate(held)).astype(np.int64)


def held_out_rows(y: np.ndarray, opts: Options) -> np.ndarray:
    """The rows ``opts`` holds out (:func:`validation_rows` with its settings)."""
    return validation_rows(
        y, opts.validation_fraction, opts.seed, stratify=opts.model.name == "logistic"
    )


def _validation_size(y: np.ndarray, opts: Options) -> int:
    return int(held_out_rows(y, opts).size)
