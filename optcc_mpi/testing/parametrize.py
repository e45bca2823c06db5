"""The contract as pytest tests: one per (algorithm, check), as scikit-learn's
``parametrize_with_checks`` makes one per (estimator, check).

A package that registers an algorithm through the entry-point group
``optcc_mpi.algorithms`` tests it against the contract with::

    from optcc_mpi.testing import parametrize_with_checks

    @parametrize_with_checks(["myring"])
    def test_contract(algorithm, check):
        check(algorithm)

``pytest`` then runs ``test_contract[myring-registration]``,
``test_contract[myring-verifies]``, ... (:data:`optcc_mpi.testing.CHECKS`). The MPI check
(``mpi_reference``) is marked ``pytest.mark.mpi(min_size=2)`` where pytest-mpi is
installed: it runs under ``mpiexec -n N python -m mpi4py -m pytest --with-mpi`` on
``MPI.COMM_WORLD`` (or the ``comm`` given to ``check``) and is skipped, saying why, in a
plain ``pytest`` run. Where pytest-timeout is installed it also gets a timeout, so a rank
that stops answering fails the test instead of hanging it.

This module imports pytest, a test-time dependency the rest of the package does without;
:mod:`optcc_mpi.testing` loads it only when :func:`parametrize_with_checks` is asked for.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence

import pytest
from mpi4py import MPI

from optcc_mpi import algorithms
from optcc_mpi.testing.contract import MPI_TIMEOUT, Check, check_algorithm, select_checks

__all__ = ["ContractCheck", "parametrize_with_checks"]


class ContractCheck:
    """One check of the contract, called on an algorithm's name inside a test.

    ``check(algorithm)`` runs it (:func:`optcc_mpi.testing.check_algorithm`); a failure
    raises :class:`optcc_mpi.testing.ContractError` (an ``AssertionError``) and a check
    that cannot run here calls ``pytest.skip`` with the reason. ``comm`` is where the MPI
    check runs; ``MPI.COMM_WORLD`` by default.
    """

    def __init__(self, check: Check) -> None:
        self.check = check

    @property
    def name(self) -> str:
        return self.check.name

    def __call__(self, algorithm: str, comm: MPI.Comm | None = None) -> None:
        if self.check.needs_comm and comm is None:
            comm = MPI.COMM_WORLD
        (outcome,) = check_algorithm(algorithm, comm=comm, checks=[self.check.name])
        if outcome.status == "skipped":
            pytest.skip(f"{algorithm} {self.check.name}: {outcome.message}")

    def __repr__(self) -> str:
        return f"<contract check {self.check.name}>"


def _plugin(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def parametrize_with_checks(
    names: Sequence[str] | str | None = None, *, checks: Iterable[str] | str | None = None
) -> pytest.MarkDecorator:
    """A ``pytest.mark.parametrize`` over every (algorithm, check) pair.

    Parameters
    ----------
    names : str or sequence of str, optional
        Registered algorithms (an unknown name fails at collection, naming the
        registered ones); every registered algorithm by default.
    checks : iterable of str, optional
        Names of the checks (:data:`optcc_mpi.testing.CHECKS`); all by default.

    Returns
    -------
    pytest.MarkDecorator
        Parametrizes the arguments ``algorithm`` (the name) and ``check`` (a
        :class:`ContractCheck`); test ids read ``<algorithm>-<check>``.

    Examples
    --------
    >>> @parametrize_with_checks(["ring"])
    ... def test_contract(algorithm, check):
    ...     check(algorithm)
    """
    if names is None:
        chosen = list(algorithms.names())
    else:
        chosen = [names] if isinstance(names, str) else list(names)
        for name in chosen:
            algorithms.get(name)
    selected = select_checks(checks)
    mpi_marks: list[pytest.MarkDecorator] = []
    if _plugin("pytest_mpi"):
        mpi_marks.append(pytest.mark.mpi(min_size=2))
    if _plugin("pytest_timeout"):
        mpi_marks.append(pytest.mark.timeout(MPI_TIMEOUT))
    params = [
        pytest.param(
            name,
            ContractCheck(check),
            id=f"{name}-{check.name}",
            marks=mpi_marks if check.needs_comm else (),
        )
        for name in chosen
        for check in selected
    ]
    return pytest.mark.parametrize(("algorithm", "check"), params)
