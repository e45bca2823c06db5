"""Public names kept kind (issue 34, deliver 4): the package face (``optcc_mpi``) exports
what README.md tells users to call. Every ``optcc_mpi.<...>`` the README names resolves,
and a function or class it names on a module that is not itself a face (a subpackage, or a
module the README names or imports on its own) is reachable from ``optcc_mpi`` directly.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import optcc_mpi

REPO = Path(__file__).resolve().parents[1]

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
