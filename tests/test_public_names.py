"""Public names kept kind (issue 34, deliver 4).

* Names removed from a module's ``__all__`` that users could have imported still resolve
  for one release, each with a ``FutureWarning`` naming what replaced it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from optcc_mpi.errors import ArgumentError
from optcc_mpi.glm import comm as glm_comm

REPO = Path(__file__).resolve().parents[1]

# -- glm.comm's former model and pacer -------------------------------------------------

REMOVED = ("PATHS", "allreduce_path", "allreduce_cost", "NetworkPacer")


@pytest.mark.parametrize("name", REMOVED)
def test_removed_glm_comm_names_warn_and_still_resolve(name: str) -> None:
    assert name not in glm_comm.__all__
    with pytest.warns(FutureWarning, match=rf"optcc_mpi\.glm\.comm\.{name} is deprecated.*use "):
        value = getattr(glm_comm, name)
    assert value is not None


def test_removed_names_warn_at_the_callers_line_on_from_import() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from optcc_mpi.glm.comm import allreduce_cost  # noqa: F401
    (w,) = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert w.filename == __file__  # stacklevel: the user's import, not our module
    assert "optcc_mpi.model.library_allreduce" in str(w.message)


def test_removed_names_compute_as_before() -> None:
    """The aliases are the former code, unchanged: recursive doubling charged to every
    size, and the pacer that sleeps to deadlines."""
    with pytest.warns(FutureWarning):
        cost = glm_comm.allreduce_cost
        path = glm_comm.allreduce_path
        paths = glm_comm.PATHS
        pacer_cls = glm_comm.NetworkPacer
    assert paths == ("recursive-doubling", "ring")
    assert path(8, 1000) == (3, 1000.0) and path(6, 1000) == (4, 1000.0)
    assert path(4, 1000, "ring") == (6, 250.0)
    assert round(cost(8, 1000, 5e-6, 1e9) * 1e6, 6) == 18.0  # 3 * (5 us + 1 us)
    with pytest.raises(ArgumentError, match="critical path"):
        path(8, 10, "tree")
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    pacer = pacer_cls(8, 5e-6, 1e9, sleep=sleep, clock=lambda: now[0])
    assert pacer.finish(0.0, 1000) == pytest.approx(18e-6)
    assert slept == [pytest.approx(18e-6)]
    assert pacer.stats()["net_calls"] == 1


def test_unknown_glm_comm_name_is_still_an_attribute_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not hasattr(glm_comm, "no_such_name")
