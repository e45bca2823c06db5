"""Checkpoints of a training run in HDF5: weights plus the sampler position.

Layout (one file, written by rank 0)::

    /w          (n_features,) master weights in their exact dtype (float32 or float64)
    attrs:
      format        "optcc_mpi.glm.checkpoint"
      version       1
      config        JSON of TrainConfig plus m, n_features and a CRC of the labels
      epoch, block  the next outer iteration to run
      steps, outer  SGD steps and outer iterations done
      train_s       training time so far
      schedule      JSON of the stopping rule's state: the step of the next epoch, the
                    best criterion, epochs without improvement, divisions of the step
      history       JSON list of loss records
      counters      JSON of communication/time counters so far

Because the sample sequence is a pure function of ``(seed, epoch)``, ``(epoch, block)`` is
the whole sampler state, and a run resumed from a checkpoint replays exactly the remaining
mini-batches on exactly the saved weights: the final weights are bit-for-bit those of an
uninterrupted run (with the same number of ranks; a different P gives the same iterates
up to roundoff only).

The file is written to ``NAME.tmp`` and renamed over ``NAME``, so a run killed while
writing leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ..errors import ArgumentError
from .comm import Group

__all__ = ["FORMAT", "load_checkpoint", "save_checkpoint"]

FORMAT = "optcc_mpi.glm.checkpoint"
VERSION = 2


def save_checkpoint(
    path: str | os.PathLike,
    group: Group,
    w_local: np.ndarray,
    *,
    config: dict[str, Any],
    position: dict[str, Any],
    history: list[dict[str, Any]],
    counters: dict[str, Any],
    schedule: dict[str, Any] | None = None,
) -> None:
    """Gather the weight slices on rank 0 and write the checkpoint atomically.

    Parameters
    ----------
    path : path-like
        Checkpoint file.
    group : Group
        All ranks of the run (collective call).
    w_local : ndarray
        This rank's weight slice, in rank order of the column blocks.
    config : dict
        Settings a resumed run must match.
    position : dict
        ``epoch, block, steps, outer, train_s``.
    history, counters
        Loss records and counters so far.
    schedule : dict, optional
        The stopping rule's state (``TrainState.schedule()``).
    """
    slices = group.allgather(np.asarray(w_local))
    error = None
    if group.rank == 0:
        try:
            path = Path(path)
            tmp = path.with_name(path.name + ".tmp")
            with h5py.File(tmp, "w") as f:
                f.create_dataset("w", data=np.concatenate(slices))
                f.attrs["format"] = FORMAT
                f.attrs["version"] = VERSION
                f.attrs["config"] = json.dumps(config, sort_keys=True)
                for key in ("epoch", "block", "steps", "outer"):
                    f.attrs[key] = int(position[key])
                f.attrs["train_s"] = float(position["train_s"])
                f.attrs["schedule"] = json.dumps(schedule or {})
                f.attrs["history"] = json.dumps(history)
                f.attrs["counters"] = json.dumps(counters)
            os.replace(tmp, path)
        except OSError as exc:
            error = f"cannot write checkpoint {path}: {exc}"
    group.agree(error)


def load_checkpoint(
    path: str | os.PathLike, group: Group, config: dict[str, Any], cols: slice
) -> dict[str, Any] | None:
    """Read a checkpoint on rank 0, check it matches ``config``, share it with every rank.

    Returns
    -------
    dict or None
        ``w`` (this rank's slice), ``epoch, block, steps, outer, train_s, schedule,
        history, counters``; None when the file does not exist (a fresh start).

    Raises
    ------
    ValueError
        On every rank, when the file is not a checkpoint or was written by a run with
        different settings or data.
    """
    error = None
    state: dict[str, Any] | None = None
    if group.rank == 0:
        path = Path(path)
        if path.exists():
            try:
                with h5py.File(path, "r") as f:
                    if f.attrs.get("format") != FORMAT:
                        raise ArgumentError(f"{path} is not a optcc_mpi.glm checkpoint")
                    if int(f.attrs.get("version", 0)) != VERSION:
                        raise ArgumentError(
                            f"{path} is a checkpoint of format version "
                            f"{int(f.attrs.get('version', 0))}, written before the stopping "
                            f"rule was saved (this is version {VERSION}): start afresh"
                        )
                    saved = json.loads(f.attrs["config"])
                    diff = sorted(
                        k for k in set(saved) | set(config) if saved.get(k) != config.get(k)
                    )
                    if diff:
                        shown = ", ".join(
                            f"{k}: checkpoint {saved.get(k)!r} vs now {config.get(k)!r}"
                            for k in diff
                        )
                        raise ArgumentError(
                            f"checkpoint {path} was written by a different run ({shown})"
                        )
                    state = {
                        "w": f["w"][...],
                        **{k: int(f.attrs[k]) for k in ("epoch", "block", "steps", "outer")},
                        "train_s": float(f.attrs["train_s"]),
                        "schedule": json.loads(f.attrs["schedule"]),
                        "history": json.loads(f.attrs["history"]),
                        "counters": json.loads(f.attrs["counters"]),
                    }
            except (OSError, KeyError, ValueError) as exc:
                error = (
                    str(exc)
                    if isinstance(exc, ValueError)
                    else f"cannot read checkpoint {path}: {exc}"
                )
    group.agree(error)
    state = group.allgather(state)[0]
    if state is not None:
        state["w"] = state["w"][cols]
    return state
