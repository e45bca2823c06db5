"""Public names kept kind (issue 34, deliver 4).

* Names removed from a module's ``__all__`` that users could have imported still resolve
  for one release, each with a ``FutureWarning`` naming what replaced it.
* The package face (``optcc_mpi``) exports what README.md tells users to call: every
  ``optcc_mpi.<...>`` the README names resolves, and a function or class it names on a
  module that is not itself a face (a subpackage, or a module the README names or imports
  on its own) is reachable from ``optcc_mpi`` directly.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import optcc_mpi
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


# -- the package face exports what README.md tells users to call --------------------------

_NAMED = re.compile(r"\boptcc_mpi(?:\.[A-Za-z_]\w*)+")
_IMPORTED = re.compile(r"^\s*(?:import|from)\s+(optcc_mpi(?:\.\w+)+)", re.M)


def _is_module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:
        return False


def _readme_names() -> tuple[list[str], set[str]]:
    text = (REPO / "README.md").read_text()
    names = sorted(set(_NAMED.findall(text)))
    faces = {m for m in names if _is_module(m)} | set(_IMPORTED.findall(text))
    return names, faces


def _split(dotted: str) -> tuple[str, list[str]]:
    """(the longest module prefix of ``dotted``, the attribute path after it)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if _is_module(".".join(parts[:i])):
            return ".".join(parts[:i]), parts[i:]
    raise AssertionError(dotted)


def _is_face(module: str, faces: set[str]) -> bool:
    if module == "optcc_mpi" or module in faces:
        return True
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.submodule_search_locations is not None  # a subpackage


def test_readme_calls_are_reachable_from_the_package_face() -> None:
    names, faces = _readme_names()
    assert "optcc_mpi.allreduce" in names  # the README still shows the quick start
    missing = []
    for dotted in names:
        module, attrs = _split(dotted)
        if not attrs:
            continue  # a module the README names: importable (find_spec found it)
        if module.split(".")[1:2] == ["torch"]:
            pytest.importorskip("torch")
        obj = importlib.import_module(module)
        for attr in attrs:
            obj = getattr(obj, attr)
        if _is_face(module, faces):
            continue
        leaf = attrs[0]
        if leaf not in optcc_mpi.__all__ or getattr(optcc_mpi, leaf) is not getattr(
            importlib.import_module(module), leaf
        ):
            missing.append(f"{dotted} (as optcc_mpi.{leaf})")
    assert not missing, f"README.md sends users to names the package face lacks: {missing}"


def test_last_stats_from_the_package_face_in_a_fresh_process() -> None:
    """The README's `optcc_mpi.collectives.last_stats()`, from `import optcc_mpi` alone."""
    code = (
        "import optcc_mpi\n"
        "assert 'last_stats' in optcc_mpi.__all__ and 'last_stats' in dir(optcc_mpi)\n"
        "assert optcc_mpi.last_stats() == {}\n"
        "from optcc_mpi import last_stats\n"
        "import optcc_mpi.collectives as c\n"
        "assert last_stats is c.last_stats\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
