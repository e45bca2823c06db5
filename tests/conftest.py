"""Shared test set-up.

Serial tests run with plain ``pytest``; MPI tests are marked ``@pytest.mark.mpi`` and run
under ``mpiexec -n N python -m mpi4py -m pytest --with-mpi``. Under ``--with-mpi`` only the
MPI tests are collected (pytest-mpi 0.6 would otherwise run every serial test once per
rank), and ranks other than 0 report quietly.
"""

from __future__ import annotations

import os

import numpy as np
import pytest


def _with_mpi(config: pytest.Config) -> bool:
    try:
        return bool(config.getoption("with_mpi"))
    except ValueError:
        return False


def pytest_configure(config: pytest.Config) -> None:
    if _with_mpi(config):
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() > 0:
            config.option.verbose = -2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _with_mpi(config):
        return
    keep = [it for it in items if it.get_closest_marker("mpi")]
    drop = [it for it in items if not it.get_closest_marker("mpi")]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def rng() -> np.random.Generator:
    """A generator seeded per test, the same on every rank."""
    seed = int(os.environ.get("OPTCC_TEST_SEED", "20261202"))
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _fresh_settings():
    """Every test starts from the environment as it is (``optcc_mpi.config.rc`` reads it
    once; a test that changes ``OPTCC_*`` variables calls ``config.reload()``)."""
    from optcc_mpi import config

    config.reload()
    yield
    config.reload()
