"""The label rules of the GLM tasks, where this package has always exported them.

They live in :mod:`optcc_mpi.labels`, below both :mod:`optcc_mpi.data` and this package, so
that the data package can check a file's labels without importing the trainer; this module
re-exports them unchanged for code that imports ``optcc_mpi.glm.labels``.
"""

from __future__ import annotations

from ..labels import TASKS, LabelScan, binary_to_01, check_labels, infer_task

__all__ = ["TASKS", "LabelScan", "binary_to_01", "check_labels", "infer_task"]
