"""Label semantics of the GLM tasks: which labels a task accepts, and how they are read.

A dataset file declares a task (``binary``, ``regression`` or ``counts``, :data:`TASKS`); the
task names the GLM its labels are meant for and fixes their domain:

* ``binary`` (logistic regression): every label in {0, 1}, or every label in {-1, +1}, which
  is read as {0, 1} (-1 -> 0);
* ``counts`` (Poisson regression): non-negative integers;
* ``regression`` (least squares): any finite value.

:func:`check_labels` enforces a domain, :func:`infer_task` guesses the task from the labels,
and :class:`LabelScan` does both for labels that arrive in pieces (the svmlight converter's
text blocks), naming the first offending label by the caller's own positions (line numbers).

This module sits below both users of these rules: :mod:`optcc_mpi.data` (which checks a
file's labels against its task) and :mod:`optcc_mpi.glm` (whose models check their targets).
It depends on NumPy and :mod:`optcc_mpi.errors` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from optcc_mpi.errors import DatasetError

__all__ = ["TASKS", "LabelScan", "binary_to_01", "check_labels", "infer_task"]

#: Tasks a dataset can declare (file attribute ``task``, ``docs/data.md``), each with the
#: label domain above.
TASKS = ("binary", "regression", "counts")


def _first_bad(mask: np.ndarray) -> int:
    """Index of the first True in a boolean array (the caller knows there is one)."""
    return int(np.flatnonzero(mask)[0])


def check_labels(y: npt.ArrayLike, task: str) -> np.ndarray:
    """Check labels against a task's domain and return them normalised, as float64.

    Parameters
    ----------
    y : array_like, shape (m,)
        Labels.
    task : {'binary', 'regression', 'counts'}
        ``binary``: every label in {0, 1}, or every label in {-1, +1} (then mapped to {0, 1});
        ``counts``: non-negative integers; ``regression``: any finite value.

    Returns
    -------
    numpy.ndarray
        A float64 copy of ``y``; {-1, +1} labels become {0, 1}.

    Raises
    ------
    DatasetError
        Naming the first offending label and its index, or an unknown task.
    """
    if task not in TASKS:
        raise DatasetError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    y = np.array(y, dtype=np.float64, copy=True)
    if y.ndim != 1:
        raise DatasetError(f"labels must be one-dimensional, got shape {y.shape}")
    bad = ~np.isfinite(y)
    if bad.any():
        i = _first_bad(bad)
        raise DatasetError(f"label y[{i}] = {y[i]} is not finite")
    if task == "binary":
        not01 = (y != 0) & (y != 1)
        if not not01.any():
            return y
        notpm1 = (y != -1) & (y != 1)
        if not notpm1.any():
            return (y > 0).astype(np.float64)
        i = _first_bad(not01 & notpm1) if (not01 & notpm1).any() else _first_bad(not01)
        j = _first_bad(notpm1)
        if (not01 & notpm1).any():
            raise DatasetError(
                f"binary labels must be all in {{0, 1}} or all in {{-1, +1}}; y[{i}] = {y[i]:g}"
            )
        raise DatasetError(
            f"binary labels mix {{0, 1}} and {{-1, +1}}: y[{j}] = {y[j]:g} but y[{i}] = {y[i]:g}"
        )
    if task == "counts":
        bad = (y < 0) | (y != np.floor(y))
        if bad.any():
            i = _first_bad(bad)
            raise DatasetError(f"count labels must be non-negative integers; y[{i}] = {y[i]:g}")
    return y


def infer_task(y: npt.ArrayLike) -> str:
    """Guess the task from label values.

    ``binary`` if every label is in {0, 1} or every label is in {-1, +1}; otherwise ``counts``
    if every label is a non-negative integer; otherwise ``regression``. Multi-class integer
    labels therefore read as counts: pass the task explicitly when that is wrong.
    """
    y = np.asarray(y, dtype=np.float64).ravel()
    scan = LabelScan()
    scan.add(y, np.arange(y.size))
    return scan.task()


def binary_to_01(y: np.ndarray) -> np.ndarray:
    """Map {-1, +1} labels to {0, 1}; any other labels are returned unchanged.

    Files made by other tools may hold binary labels as {-1, +1}; the trainer expects
    {0, 1}. Labels outside both sets are left for :func:`check_labels` to report.
    """
    y = np.asarray(y, dtype=np.float64)
    if y.size and np.all((y == -1) | (y == 1)):
        return (y > 0).astype(np.float64)
    return y


@dataclass
class LabelScan:
    """The first label outside each task's domain, over labels seen in pieces.

    Feed every piece to :meth:`add` with the positions the caller wants errors to name (line
    numbers of a text file, say); then :meth:`task` infers the task with :func:`infer_task`'s
    rule and :meth:`encoding` checks a task against everything seen. Memory is constant.
    """

    not01: tuple[int, float] | None = None
    notpm1: tuple[int, float] | None = None
    notcount: tuple[int, float] | None = None

    def add(self, y: np.ndarray, where: np.ndarray) -> None:
        """Record labels ``y``, found at positions ``where`` (same length)."""
        y = np.asarray(y, dtype=np.float64)
        for attr, bad in (
            ("not01", (y != 0) & (y != 1)),
            ("notpm1", (y != -1) & (y != 1)),
            ("notcount", (y < 0) | (y != np.floor(y))),
        ):
            if getattr(self, attr) is None and bad.any():
                r = _first_bad(bad)
                setattr(self, attr, (int(where[r]), float(y[r])))

    def task(self) -> str:
        """The task :func:`infer_task` would give for all labels seen."""
        if self.not01 is None or self.notpm1 is None:
            return "binary"
        if self.notcount is None:
            return "counts"
        return "regression"

    def encoding(self, task: str, source: str, what: str = "line") -> str | None:
        """Check ``task`` against the labels seen; return the label encoding applied.

        Parameters
        ----------
        task : {'binary', 'regression', 'counts'}
        source : str
            What the labels come from, for error messages (a file name).
        what : str
            What a position is, for error messages (``line``).

        Returns
        -------
        str or None
            ``"{-1,+1} -> {0,1}"`` for binary labels given as {-1, +1}, else None.

        Raises
        ------
        DatasetError
            An unknown task, or a label outside its domain (naming its position).
        """
        if task not in TASKS:
            raise DatasetError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
        if task == "binary":
            if self.not01 is None:
                return None
            if self.notpm1 is None:
                return "{-1,+1} -> {0,1}"
            (l1, v1), (l2, v2) = self.not01, self.notpm1
            raise DatasetError(
                f"{source}: task 'binary' needs labels all in {{0, 1}} or all in {{-1, +1}}: "
                f"{what} {l1} has label {v1:g}, {what} {l2} has label {v2:g}"
            )
        if task == "counts" and self.notcount is not None:
            pos, v = self.notcount
            raise DatasetError(
                f"{source}: task 'counts' needs non-negative integer labels: {what} {pos} has {v:g}"
            )
        return None
