"""The docstrings' examples run as doctests, each module in a fresh process.

``MODULES`` lists every module of the package with an example not marked ``+SKIP`` (a
test below fails on one left out), and each must run at least one example: a module
whose examples were all skipped or lost fails instead of passing with nothing run, as
pytest's exit code 5 (no tests) would let it. ``REQUIRED`` names the docstrings that must
hold examples that run: ``allreduce``, the torch backend, the DDP hook, ``fit`` and the
scikit-learn estimators.

The examples run on one process, as a reader would paste them into ``python``:
``COMM_WORLD`` of size 1, a torch.distributed world of one on a ``HashStore``, without
any launcher's or ``OPTCC_*`` variables, with doctest's default options (an example that
needs ``...`` in its output says ``# doctest: +ELLIPSIS``). Each module gets a process of
its own, so that the MPI and torch.distributed state of one example set (a process group
left behind by a failure) cannot leak into another's or into pytest's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODULES = (
    "optcc_mpi.collectives",
    "optcc_mpi.comm",
    "optcc_mpi.data.layout",
    "optcc_mpi.emulation",
    "optcc_mpi.glm",
    "optcc_mpi.glm.api",
    "optcc_mpi.glm.estimator",
    "optcc_mpi.links",
    "optcc_mpi.model",
    "optcc_mpi.testing.contract",
    "optcc_mpi.testing.parametrize",
    "optcc_mpi.torch",
)

#: Docstrings (doctest's names) that must hold at least one example that runs.
REQUIRED = {
    "optcc_mpi.collectives": ("optcc_mpi.collectives.allreduce",),
    "optcc_mpi.torch": ("optcc_mpi.torch", "optcc_mpi.torch.comm_hook"),
    "optcc_mpi.glm.api": ("optcc_mpi.glm.api.fit",),
    "optcc_mpi.glm.estimator": (
        "optcc_mpi.glm.estimator.GLM",
        "optcc_mpi.glm.estimator.CASGDClassifier",
        "optcc_mpi.glm.estimator.CASGDRegressor",
    ),
}

#: Runs one module's examples; prints doctest's report of each failure, then one line of
#: JSON: {docstring name: [attempted, failed]}.
RUNNER = """
import doctest, importlib, json, sys

module = importlib.import_module(sys.argv[1])
runner = doctest.DocTestRunner()
counts = {}
for test in doctest.DocTestFinder().find(module):
    if test.examples:
        result = runner.run(test)
        counts[test.name] = [result.attempted, result.failed]
print("DOCTESTS " + json.dumps(counts))
"""


def _env() -> dict[str, str]:
    from optcc_mpi.lab import launch

    env = {k: v for k, v in launch.clean_env().items() if not k.startswith("OPTCC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def test_every_module_with_examples_is_listed() -> None:
    """An example outside MODULES would never run: a docstring would promise output that
    nobody checks (as Emulation's did)."""
    found = set()
    for path in sorted((ROOT / "optcc_mpi").rglob("*.py")):
        lines = path.read_text().splitlines()
        if any(s.lstrip().startswith(">>>") and "+SKIP" not in s for s in lines):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found.add(name.removesuffix(".__init__"))
    assert found, "no module with examples found: is ROOT the repository?"
    missing = sorted(found - set(MODULES))
    assert not missing, f"modules with examples that no test runs: {missing}; add to MODULES"
    assert set(REQUIRED) <= set(MODULES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("module", MODULES)
def test_examples_run(module: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, module],
        cwd=tmp_path,  # an example that writes a file writes it there
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    shown = f"{module}:\n--- stdout\n{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-3000:]}"
    assert done.returncode == 0, shown
    last = [s for s in done.stdout.splitlines() if s.startswith("DOCTESTS ")]
    assert last, f"the doctest run printed no counts\n{shown}"
    counts: dict[str, list[int]] = json.loads(last[-1].removeprefix("DOCTESTS "))
    failed = {name: f for name, (_, f) in counts.items() if f}
    assert not failed, f"failed examples: {failed}\n{shown}"
    attempted = sum(a for a, _ in counts.values())
    assert attempted > 0, f"{module}: no example ran (all skipped?)\n{shown}"
    for name in REQUIRED.get(module, ()):
        assert counts.get(name, [0])[0] > 0, f"{name}: no example ran\n{shown}"
