"""Mixed-precision communication-avoiding SGD (CA-SGD) for generalized linear models.

Models: logistic, linear least squares, Poisson (log link); objective
``mean loss + (lambda/2) ||w||^2``. Data in the 1D block-column layout: each rank holds all
rows of a block of columns and the matching weights.

Solvers: ``sgd`` (one AllReduce of the b mini-batch margins per step) and ``casgd``
(one AllReduce of the packed base margins and Gram matrix per s steps, the s dependent
updates replayed identically on every rank). Both follow the same sample sequence, so in
exact arithmetic they produce the same iterates.

Precision recipes (:mod:`optcc_mpi.glm.precision`): ``fp64``, ``fp32``, ``C``, ``D``, and
any per-slot override.

Modules
-------
``models``      losses, residuals, label domains
``precision``   recipes and rounding helpers
``sampler``     the shared per-epoch sample sequence
``kernels``     a rank's column block and its local kernels (CPU, sparse, GPU; the
                bf16-in, fp32-out Gram is ``optcc_mpi.backend.gram_bf16``)
``comm``        the pluggable, counted AllReduce; error agreement
``solvers``     SGD and CA-SGD steps, the recurrence, the training loop
``checkpoint``  HDF5 checkpoints and exact resume
``api``         :func:`fit`, :func:`fit_partition`
``estimator``   :class:`GLM`, :class:`CASGDClassifier`, :class:`CASGDRegressor`
                (scikit-learn estimators; imported on first use, they need scikit-learn)
``synthetic``   synthetic problems for tests and benchmarks

Example
-------
>>> from optcc_mpi.glm import fit, make_glm_data
>>> X, y = make_glm_data("logistic", 4096, 64, seed=1)
>>> res = fit(X, y, model="logistic", solver="casgd", s=8, b=16, lr=0.5, epochs=2,
...           recipe="C")
>>> round(res.final_loss, 2) < 0.69
True
"""

from __future__ import annotations

import importlib
from typing import Any

# Public names and the submodule that defines each, resolved on first access: importing
# optcc_mpi.glm (for instance for its label rules, from optcc_mpi.data) must not load
# mpi4py or scikit-learn; the trainer and the estimators load them when used.
_EXPORTS = {
    "FitResult": "api",
    "column_block": "api",
    "fit": "api",
    "fit_partition": "api",
    "Reducer": "comm",
    "agree": "comm",
    "MODELS": "models",
    "Model": "models",
    "get_model": "models",
    "model_for_task": "models",
    "PRECISIONS": "precision",
    "RECIPES": "precision",
    "SLOTS": "precision",
    "Recipe": "precision",
    "get_recipe": "precision",
    "DIVERGENCE_FACTOR": "solvers",
    "EXIT_AFTER_ENV": "solvers",
    "SOLVERS": "solvers",
    "DivergenceError": "solvers",
    "casgd_recurrence": "solvers",
    "least_squares_deltas": "solvers",
    "make_glm_data": "synthetic",
    "GLM": "estimator",
    "CASGDClassifier": "estimator",
    "CASGDRegressor": "estimator",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        mod = importlib.import_module(f"{__name__}.{module}")
    except ImportError as exc:
        if module != "estimator" or "sklearn" not in f"{exc} {getattr(exc, 'name', '')}":
            raise
        raise ImportError(
            f"optcc_mpi.glm.{name} is a scikit-learn estimator and needs scikit-learn >= 1.6 "
            f"({exc}); install it with: pip install 'scikit-learn>=1.6'"
        ) from exc
    value = getattr(mod, name)
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
    "CASGDClassifier",
    "CASGDRegressor",
    "DivergenceError",
    "FitResult",
    "Model",
    "Recipe",
    "Reducer",
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
