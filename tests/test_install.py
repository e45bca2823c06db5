"""Installing and the test targets: pins that PyPI can serve, one torch for both
environments, and no pytest run whose "no tests ran" (exit status 5) passes silently.

That every pin resolves from PyPI alone, with its dependencies, needs PyPI: `make
pypi-check` (.ci/pypi-check, run by .ci/run) proves it. These tests need no network.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (REPO / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line)
            assert m, f"{name}: {line!r} is not an exact pin"
            pins[m.group(1).lower()] = m.group(2)
    return pins


@pytest.mark.parametrize("name", ["requirements.txt", "requirements-openmpi.txt"])
def test_pins_are_exact_and_public(name: str) -> None:
    """Every requirement is NAME==VERSION with a public version: a local label such as
    ``+cpu`` is served by no index but a project's own, so PyPI alone could not install it
    (``torch==2.13.0`` still takes a CPU build ``2.13.0+cpu`` where one is offered)."""
    for pkg, version in _pins(name).items():
        assert "+" not in version, f"{name}: {pkg}=={version} has a local version label"
    if name == "requirements.txt":
        assert _pins(name)["torch"] == "2.13.0"


def test_both_environments_share_one_resolution() -> None:
    """.venv-ompi is installed under the constraint of what .venv holds, so that the two
    environments differ in their MPI library only."""
    text = (REPO / "Makefile").read_text()
    rule = text[text.index("$(STAMP_OMPI):") :].split("\n\n", 1)[0]
    assert rule.splitlines()[0].startswith("$(STAMP_OMPI): $(STAMP)")
    assert "pip freeze --exclude-editable | grep -v '^mpich=='" in rule
    assert "-c $(VENV_OMPI)/constraints.txt" in rule
    assert "make pypi-check" in (REPO / ".ci" / "run").read_text()
    assert os.access(REPO / ".ci" / "pypi-check", os.X_OK)


def _fake(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.parametrize("target", ["test-serial", "test-mpi", "test-ompi"])
def test_no_tests_collected_fails_the_target(target: str, tmp_path: Path) -> None:
    """A pytest run that collects nothing exits 5; every test target must fail on it.
    The interpreters and launchers are stand-ins: a 'python' whose pytest exits 5 and
    an 'mpiexec' that runs the command once; the environments are taken as installed."""
    py = _fake(tmp_path / "python", 'case " $* " in *" pytest "*) exit 5;; esac\nexit 0\n')
    mpiexec = _fake(tmp_path / "mpiexec", 'shift 2; exec "$@"\n')
    stamp, stamp_ompi = tmp_path / "stamp", tmp_path / "stamp-ompi"
    stamp.touch()  # newer than every prerequisite: nothing is installed
    stamp_ompi.touch()
    overrides = [
        f"STAMP={stamp}",
        f"STAMP_OMPI={stamp_ompi}",
        f"PY={py}",
        f"PY_OMPI={py}",
        f"MPIEXEC={mpiexec}",
        f"OMPI_MPIEXEC={mpiexec}",
        "MPI_SIZES=2",
        "OMPI_SIZES=2",
    ]
    res = subprocess.run(
        ["make", "--no-print-directory", "-C", str(REPO), target, *overrides],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0, f"make {target} passed with pytest exit 5:\n{res.stdout}"
    # Sanity of the stand-in: the same targets pass when pytest passes.
    _fake(py, "exit 0\n")
    ok = subprocess.run(
        ["make", "--no-print-directory", "-C", str(REPO), target, *overrides],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
