"""One name per concept (issue 34): no two modules of the package define a module-level
class or function of the same name for different things.

A name two modules share is allowed only where it is one concept each module has its own
of (an interface: a command's ``run``, a lab tool's ``measure``), listed here with why;
a new clash fails until one side is renamed or the name joins the list for a reason.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "optcc_mpi"

#: Names several modules define, each for its own instance of one concept.
SHARED: dict[str, str] = {
    "__getattr__": "a module's attribute hook (PEP 562): names made on first use",
    "__dir__": "a module's listing hook (PEP 562)",
    "register": "registers this module's entry (a command, the algorithms, the optcc backend)",
    "run": "a command's or a lab tool's body",
    "main": "a lab tool's `python -m` entry point, and the CLI's",
    "add_arguments": "a lab tool's options",
    "run_args": "a lab tool's body, from its parsed options",
    "measure": "what a lab tool (and the crossover) times",
    "plot": "the figure of this module's results",
    "transport": "the transport of a communicator of this module's kind",
    "allreduce": "the AllReduce: of arrays (collectives) and of tensors (optcc_mpi.torch)",
    "agree": "agreement.agree, and the GLM trainer's over its Group",
    "gram_bf16": "the bf16 Gram matrix, one kernel per array library (CuPy, torch)",
    "get": "a lookup in this module's table (algorithms by name, variables by name)",
    "markdown": "this module's table as Markdown (variables, link profiles)",
}


def _definitions(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Every module-level class and function name under ``root``: the modules that
    define it."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found[node.name].add(str(path.relative_to(root.parent)))
    return found


def test_no_two_modules_define_one_name_for_two_things() -> None:
    shared = {name: sorted(where) for name, where in _definitions().items() if len(where) > 1}
    clashes = {name: where for name, where in shared.items() if name not in SHARED}
    assert not clashes, f"one name, several modules (rename one, or list it in SHARED): {clashes}"


def test_the_list_holds_only_names_still_shared() -> None:
    defs = _definitions()
    stale = [name for name in SHARED if len(defs.get(name, ())) < 2]
    assert not stale, f"listed in SHARED but defined once or never: {stale}"


def test_the_check_sees_a_clash(tmp_path: Path) -> None:
    """The walk finds a name defined in two modules (the test above could not fail if it
    did not)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("def twice():\n    pass\n\ndef once():\n    pass\n")
    (pkg / "sub" / "b.py").write_text("class twice:\n    def once(self):\n        pass\n")
    found = _definitions(pkg)
    assert found["twice"] == {"pkg/a.py", "pkg/sub/b.py"}
    assert found["once"] == {"pkg/a.py"}  # (a method is not module-level)


def test_every_module_of_ours_imports_without_a_future_warning() -> None:
    """Every module of the package imports, in a fresh interpreter with FutureWarning an
    error: no module is left at an old name, and none reaches a deprecated name."""
    import subprocess
    import sys

    code = (
        "import importlib, pkgutil, optcc_mpi\n"
        "for m in pkgutil.walk_packages(optcc_mpi.__path__, 'optcc_mpi.'):\n"
        "    skip = m.name.endswith(('__main__', '._simcore', '._board'))  # (ctypes libraries)\n"
        "    if not skip:\n"
        "        importlib.import_module(m.name)\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
