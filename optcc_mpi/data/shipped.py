"""Datasets that come with optcc_mpi: the default synthetic set and the shipped real sets.

:func:`default_dataset` is the synthetic set ``train`` uses when given no data, created on
first use in :func:`data_home`; :func:`shipped` finds the small real datasets kept in the
source repository's ``data/`` folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py

from optcc_mpi import config, transports
from optcc_mpi.check import agreement
from optcc_mpi.errors import DatasetError, ExecutionError, FileMissingError

from .synthetic import SYNTH_VERSION, synth

__all__ = ["DEFAULT_SYNTH", "SHIPPED", "data_home", "default_dataset", "shipped"]

#: Real datasets shipped in ``data/``.
SHIPPED = ("breast_cancer", "diabetes", "randhie")
#: The synthetic set :func:`default_dataset` creates (and ``train`` uses without ``--data``).
DEFAULT_SYNTH: dict[str, Any] = {
    "kind": "logistic",
    "rows": 32768,
    "cols": 256,
    "seed": 0,
    "dtype": "float32",
}


def data_home() -> Path:
    """Cache folder for generated datasets: ``$OPTCC_DATA_HOME`` or ``~/.cache/optcc_mpi``."""
    env = config.get("OPTCC_DATA_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "optcc_mpi"


def _default_path() -> Path:
    s = DEFAULT_SYNTH
    return data_home() / (
        f"synth-{s['kind']}-{s['rows']}x{s['cols']}-seed{s['seed']}-{s['dtype']}"
        f"-v{SYNTH_VERSION}.h5"
    )


def _is_current(path: Path) -> bool:
    """True if ``path`` is a readable default dataset made by this generator version."""
    try:
        with h5py.File(path, "r") as f:
            a = f.attrs
            return int(a.get("synth_version", -1)) == SYNTH_VERSION and f["X"].shape == (
                DEFAULT_SYNTH["rows"],
                DEFAULT_SYNTH["cols"],
            )
    except (OSError, KeyError):
        return False


def _ensure_default(path: Path) -> None:
    if not _is_current(path):
        s = DEFAULT_SYNTH
        synth(s["kind"], s["rows"], s["cols"], s["seed"], path, dtype=s["dtype"], progress=False)


def default_dataset(comm: Any = None) -> Path:
    """Return the default synthetic dataset, creating it in the cache on first use.

    The set is ``synth(**DEFAULT_SYNTH)`` (logistic, 32768 x 256, seed 0, float32; 32 MiB) in
    :func:`data_home`. With a communicator, rank 0 creates it (under a temporary name, then an
    atomic rename) while the others wait for rank 0's broadcast of the outcome; a rank that
    still cannot see the file afterwards (a node-local cache folder) creates its own copy,
    which is identical because the generator is deterministic.

    Parameters
    ----------
    comm : mpi4py communicator or torch.distributed.ProcessGroup, optional
        Collective over ``comm`` when given.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    RuntimeError
        Rank 0 could not create the file (raised on every rank).
    """
    path = _default_path()
    if comm is None:
        _ensure_default(path)
        return path
    error = None
    t = transports.of(comm)
    if t.rank == 0:
        try:
            _ensure_default(path)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = f"{type(exc).__name__}: {exc}"
    error = agreement.agree(t, None, error)[0]  # rank 0's outcome, on every rank
    if error is not None:
        raise ExecutionError(f"rank 0 could not create the default dataset {path}: {error}")
    if not path.exists():
        _ensure_default(path)
    return path


def _repo_data_dir() -> Path:
    # optcc_mpi/data/shipped.py -> the repository root, which holds data/
    return Path(__file__).resolve().parents[2] / "data"


def shipped(name: str) -> Path:
    """Return the path of a real dataset shipped in the repository's ``data/`` folder.

    Parameters
    ----------
    name : {'breast_cancer', 'diabetes', 'randhie'}

    Returns
    -------
    pathlib.Path

    Raises
    ------
    DatasetError
        Unknown name.
    FileNotFoundError
        The file is absent (e.g. optcc_mpi installed from a wheel, which does not carry
        ``data/``).
    """
    if name not in SHIPPED:
        known = ", ".join(SHIPPED)
        raise DatasetError(f"unknown shipped dataset {name!r}; expected one of {known}")
    path = _repo_data_dir() / f"{name}.h5"
    if not path.is_file():
        raise FileMissingError(
            f"shipped dataset {name!r} not found at {path}; the files live in the source "
            "repository's data/ folder (regenerate with data/make_datasets.py)"
        )
    return path
