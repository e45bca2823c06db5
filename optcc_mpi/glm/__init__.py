"""Mixed-precision communication-avoiding SGD (CA-SGD) for generalized linear models.

Models: logistic, linear least squares, Poisson (log link); objective
``mean loss + (lambda/2) ||w||^2``. Data in the 1D block-column layout: each rank holds all
rows of a block of columns and the matching weights. The ranks are an MPI communicator
(NumPy, CuPy or SciPy kernels) or a torch.distributed process group (torch tensors on the
group's device, gloo or NCCL).

Solvers: ``sgd`` (one AllReduce of the b mini-batch margins per step) and ``casgd``
(one AllReduce of the packed base margins and Gram matrix per s steps, the s dependent
updates replayed identically on every rank). Both follow the same sample sequence, so in
exact arithmetic they produce the same iterates.

Precision recipes (:mod:`optcc_mpi.glm.precision`): ``fp64``, ``fp32``, ``C``, ``D``, and
any per-slot override.

Modules
-------
``models``      losses, residuals, label domains (the task rules: :mod:`optcc_mpi.labels`)
``precision``   recipes and rounding helpers
``sampler``     the shared per-epoch sample sequence
``kernels``     a rank's column block and its local kernels (CPU, sparse, GPU via CuPy)
``torch_kernels`` the same on PyTorch tensors (CPU or CUDA; imported when used)
``gram``        the bf16-in, fp32-out Gram on the GPU with CuPy (cuBLAS GemmEx, recipe C)
``comm``        the ranks (MPI or torch.distributed), the counted AllReduce, agreement
``auto``        ``s="auto"``: the cost model's choice of steps per AllReduce
``solvers``     SGD and CA-SGD steps, the recurrence, the stopping rule, the training loop
``checkpoint``  HDF5 checkpoints and exact resume
``inputs``      fit's arguments checked on each rank, then across the ranks
``api``         :func:`fit`, :func:`fit_partition`
``estimator``   :class:`GLM`, :class:`CASGDClassifier`, :class:`CASGDRegressor`
                (scikit-learn estimators; imported on first use, they need scikit-learn)
``synthetic``   synthetic problems for tests and benchmarks

Example
-------
>>> from optcc_mpi.glm import fit, make_glm_data
>>> X, y = make_glm_data("logistic", 4096, 64, seed=1)
>>> res = fit(X, y, model="logistic", solver="casgd", s=8, b=16, lr=0.5, max_iter=2,
...           tol=None, recipe="C")
>>> round(res.final_loss, 2) < 0.69
True
"""

from __future__ import annotations

from typing import Any

from .api import FitResult, column_block, fit, fit_partition
from .comm import Group, Reducer, agree
from .models import MODELS, Model, get_model, model_for_task
from .precision import PRECISIONS, RECIPES, SLOTS, Recipe, get_recipe
from .solvers import (
    DIVERGENCE_FACTOR,
    EXIT_AFTER_ENV,
    SOLVERS,
    STOP_REASONS,
    DivergenceError,
    Stopping,
    casgd_recurrence,
    least_squares_deltas,
)
from .synthetic import make_glm_data

# The scikit-learn estimators, loaded on first access: scikit-learn is an optional
# dependency, and fit, the train command and the benchmarks work without it.
_ESTIMATORS = ("GLM", "CASGDClassifier", "CASGDRegressor")


def __getattr__(name: str) -> Any:
    if name not in _ESTIMATORS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from . import estimator  # imports scikit-learn
    except ImportError as exc:
        if "sklearn" not in f"{exc} {getattr(exc, 'name', '')}":
            raise
        raise ImportError(
            f"optcc_mpi.glm.{name} is a scikit-learn estimator and needs scikit-learn >= 1.6 "
            f"({exc}); install it with: pip install 'scikit-learn>=1.6'"
        ) from exc
    value = getattr(estimator, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "DIVERGENCE_FACTOR",
    "EXIT_AFTER_ENV",
    "GLM",
    "MODELS",
    "PRECISIONS",
    "RECIPES",
    "SLOTS",
    "SOLVERS",
    "STOP_REASONS",
    "CASGDClassifier",
    "CASGDRegressor",
    "DivergenceError",
    "FitResult",
    "Group",
    "Model",
    "Recipe",
    "Reducer",
    "Stopping",
    "agree",
    "casgd_recurrence",
    "column_block",
    "fit",
    "fit_partition",
    "get_model",
    "get_recipe",
    "least_squares_deltas",
    "make_glm_data",
    "model_for_task",
]
