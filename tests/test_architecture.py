"""The shape of the code, enforced: layers with arrows one way, and one registry.

* The package is a stack of layers (:data:`LAYERS`, bottom first): no module imports one
  in a layer above its own, at module level or inside a function; the import graph has no
  loop; a function-level import is only for an optional heavy dependency (MPI, PyTorch,
  CuPy, matplotlib, scikit-learn), or for a module of ours that imports one.
* Nothing outside ``optcc_mpi.lab`` and ``optcc_mpi.cli`` imports the lab (benchmarks,
  sweeps, reports, the reproduction, the testbed, launching), checked on the source's
  import statements (function-level imports included) and on what importing the core
  actually loads.
* Every ``OPTCC_*`` variable the package reads is declared in ``optcc_mpi.config``.
* An algorithm is one module: a copy of ``ring.py`` under a new name, and nothing else, is
  usable through ``allreduce``, ``simulate``, ``model`` and ``bench``.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import optcc_mpi
from optcc_mpi import config
from optcc_mpi.lab import launch

PKG = Path(optcc_mpi.__file__).parent
TOOLING = ("lab", "cli")
#: The layers, bottom first; a module belongs to the first pattern that names it (a
#: pattern ``x.*`` names every module below package ``x``).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # optcc_mpi itself: its public names resolve lazily (module __getattr__), so importing
    # the package imports nothing of ours.
    (
        "foundation: errors, units, settings",
        ("optcc_mpi", "errors", "units", "config", "progress", "labels"),
    ),
    ("element types and reductions by name", ("dtypes",)),
    ("how reductions compute", ("reductions",)),
    ("array backends, link profiles", ("backend", "links", "linklog")),
    ("models and emulation", ("model", "emulation", "fastcall")),
    ("the schedule", ("schedule",)),
    (
        "the schedule's readers, transports, algorithms",
        (
            "verify",
            "simulate",
            "executor",
            "transports",
            "transports.*",
            "algorithms",
            "algorithms.*",
        ),
    ),  # fmt: skip
    ("per-communicator state, agreement", ("state", "agreement", "crossover")),
    ("the check's protocol, the probe, the watch", ("protocol", "probe", "watch")),
    ("the collective entry points", ("collectives",)),
    (
        "faces: Comm, torch, doctor, testing, CA-SGD, data",
        ("comm", "torch", "doctor", "testing", "testing.*", "glm", "glm.*", "data", "data.*"),
    ),
    ("argument types", ("argtypes",)),
    ("the lab", ("lab", "lab.*")),
    ("the command line", ("cli", "cli.*", "__main__")),
)
#: Optional heavy dependencies: the only things imported inside functions.
OPTIONAL = {"mpi4py", "torch", "cupy", "cupy_backends", "matplotlib", "sklearn", "threadpoolctl"}
CORE = (
    "collectives",
    "schedule",
    "executor",
    "simulate",
    "verify",
    "algorithms",
    "links",
    "backend",
    "emulation",
    "probe",
    "model",
    "errors",
    "agreement",
    "config",
    "doctor",
    "linklog",
    "watch",
)


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((".".join(parts), path))
    return out


def _imports(module: str, path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports, anywhere in the file."""
    names: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def _layer(module: str) -> int:
    name = module.removeprefix("optcc_mpi.")
    for i, (_, patterns) in enumerate(LAYERS):
        for pat in patterns:
            if name == pat or (pat.endswith(".*") and name.startswith(pat[:-1])):
                return i
    raise AssertionError(f"{module} is in no layer of LAYERS: add it")


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, str, bool, int]], dict[str, set[str]]]:
    """Module-level edges, every edge ``(from, to, inside a function, line)``, and each
    module's module-level third-party imports."""
    known = {m for m, _ in _modules()}

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    top: dict[str, set[str]] = {}
    edges: list[tuple[str, str, bool, int]] = []
    third: dict[str, set[str]] = {}
    for module, path in _modules():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        third[module] = set()

        def visit(node: ast.AST, in_fn: bool, module: str = module, package: str = package) -> None:
            for ch in ast.iter_child_nodes(node):
                fn = in_fn or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef))
                names: list[str] = []
                if isinstance(ch, ast.Import):
                    names = [a.name for a in ch.names]
                elif isinstance(ch, ast.ImportFrom):
                    base = ch.module or ""
                    if ch.level:
                        parent = package.split(".")
                        parent = parent[: len(parent) - ch.level + 1]
                        base = ".".join(parent + ([base] if base else []))
                    # `from pkg import sub` imports the submodule, not the package's body
                    subs = [f"{base}.{a.name}" for a in ch.names]
                    names = [n for n in subs if n in known] or [base]
                for n in names:
                    if n.split(".")[0] == "optcc_mpi":
                        target = resolve(n)
                        if target and target != module:
                            edges.append((module, target, fn, ch.lineno))
                            if not fn:
                                top.setdefault(module, set()).add(target)
                    elif not fn and n:
                        third[module].add(n.split(".")[0])
                    elif fn and n and n.split(".")[0] not in sys.stdlib_module_names:
                        edges.append((module, "<third party> " + n.split(".")[0], True, ch.lineno))
                visit(ch, fn, module, package)

        visit(ast.parse(path.read_text(), str(path)), False)
    return top, edges, third


def test_layers_point_one_way() -> None:
    """No module imports one of a higher layer, not even inside a function."""
    _, edges, _ = _graph()
    bad = [
        f"{a}:{line} imports {b} ({LAYERS[_layer(b)][0]}) from {LAYERS[_layer(a)][0]}"
        for a, b, _, line in edges
        if not b.startswith("<") and _layer(b) > _layer(a)
    ]
    assert not bad, "upward imports:\n" + "\n".join(sorted(set(bad)))


def test_no_import_loop() -> None:
    """The import graph (function-level imports included) has no cycle."""
    _, edges, _ = _graph()
    graph: dict[str, set[str]] = {}
    for a, b, _, _ in edges:
        if not b.startswith("<"):
            graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w) :] + [w]
            if w not in state:
                loop = walk(w)
                if loop:
                    return loop
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            loop = walk(v)
            assert loop is None, "import loop: " + " -> ".join(loop)


def test_function_level_imports_are_for_optional_dependencies() -> None:
    """Inside functions: only the optional heavy dependencies, or a module of ours that
    imports one at module level (directly or through its own imports)."""
    top, edges, third = _graph()

    def heavy(m: str, seen: frozenset[str] = frozenset()) -> bool:
        if third.get(m, set()) & OPTIONAL:
            return True
        return any(heavy(b, seen | {m}) for b in top.get(m, ()) if b not in seen)

    bad = []
    for a, b, fn, line in edges:
        if not fn:
            continue
        if b.startswith("<third party> "):
            if b.split()[-1] not in OPTIONAL:
                bad.append(f"{a}:{line} imports {b.split()[-1]} inside a function")
        elif not heavy(b):
            bad.append(f"{a}:{line} imports {b} inside a function (import it at the top)")
    assert not bad, "\n".join(sorted(set(bad)))


def test_mpi_free_core() -> None:
    """The core, the torch face and the CLI's parser load no MPI library: a torchrun job
    needs none, and `optcc-mpi info` runs without one."""
    code = (
        "import sys\n"
        "sys.modules['mpi4py'] = None\n"
        "import optcc_mpi.collectives, optcc_mpi.executor, optcc_mpi.probe, optcc_mpi.watch\n"
        "import optcc_mpi.doctor, optcc_mpi.transports, optcc_mpi.cli\n"
        "optcc_mpi.cli.build_parser()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_library_never_imports_the_lab() -> None:
    offenders = []
    for module, path in _modules():
        top = module.split(".")[1] if "." in module else ""
        if top in TOOLING or module == "optcc_mpi.__main__":  # the CLI's entry point
            continue
        bad = sorted(
            n for n in _imports(module, path) if re.match(r"optcc_mpi\.(lab|cli)(\.|$)", n)
        )
        if bad:
            offenders.append(f"{module}: {', '.join(bad)}")
    assert not offenders, "the library imports the lab or the CLI:\n" + "\n".join(offenders)


def test_importing_the_core_loads_no_tooling() -> None:
    code = (
        "import sys, json\n"
        + "".join(f"import optcc_mpi.{m}\n" for m in CORE)
        + "from optcc_mpi import algorithms; algorithms.names()\n"
        + "print(json.dumps(sorted(m for m in sys.modules if m.startswith('optcc_mpi'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    loaded = json.loads(out.stdout)
    assert not [m for m in loaded if m.startswith(("optcc_mpi.lab", "optcc_mpi.cli"))]
    assert "optcc_mpi.algorithms.ring" in loaded  # discovery ran


def test_every_environment_variable_is_declared() -> None:
    read = set()
    for _, path in _modules():
        text = path.read_text()
        read.update(re.findall(r"config\.(?:get|is_set)\(\s*[\"'](OPTCC_\w+)", text))
        # Direct reads bypass the table: there must be none.
        direct = re.findall(r"os\.environ(?:\.get)?[\[(]\s*[\"'](OPTCC_\w+)", text)
        assert not direct, f"{path.name} reads {direct} directly; use optcc_mpi.config.get"
    assert read <= set(config.VARIABLES), read - set(config.VARIABLES)
    assert "| `OPTCC_LINKS` |" in config.markdown()
    doc = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
    assert config.markdown() in doc, "docs/config.md is stale: regenerate it (see its header)"


# ----------------------------------------------------------------------------- one module


@pytest.fixture(scope="module")
def package_with_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the package with ``algorithms/ring.py`` copied to ``myring.py``."""
    root = tmp_path_factory.mktemp("pkg")
    shutil.copytree(PKG, root / "optcc_mpi", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(PKG / "algorithms" / "ring.py", root / "optcc_mpi" / "algorithms" / "myring.py")
    return root


def _run(root: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {
        **launch.clean_env(),  # a new job, not part of the one that may run this test
        "PYTHONPATH": str(root),
        "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
    }
    env.pop("OPTCC_LINKS", None)
    return subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, env=env, cwd=root
    )


def test_copied_module_is_an_algorithm(package_with_copy: Path) -> None:
    root = package_with_copy
    py = sys.executable
    out = _run(root, py, "-c", "from optcc_mpi import algorithms; print(algorithms.names())")
    assert out.returncode == 0, out.stderr
    assert "myring" in out.stdout and "'ring'" in out.stdout
    # model: a row for it, with the ring's time.
    out = _run(root, py, "-m", "optcc_mpi", "model", "--p", "8", "--json")
    assert out.returncode == 0, out.stderr
    table = json.loads(out.stdout)["algorithms"]
    assert table["myring"]["time_s"] == pytest.approx(table["ring"]["time_s"])
    # simulate: built, verified and timed like the ring.
    out = _run(
        root, py, "-m", "optcc_mpi", "simulate", "--p", "5", "--size", "1M", "--verify",
        "--algorithms", "ring,myring", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = {r["algorithm"]: r for r in json.loads(out.stdout)}
    assert rows["myring"]["verified"] is True
    assert rows["myring"]["sim_s"] == pytest.approx(rows["ring"]["sim_s"])


@pytest.mark.timeout(600)
def test_copied_module_runs_under_mpi(package_with_copy: Path) -> None:
    root = package_with_copy

    # The launcher of the MPI library in use, with the flags it needs here (Open MPI:
    # oversubscription, root), found as the package's own tools find it.
    def mpiexec(n: int) -> list[str]:
        return launch.launcher_argv(n)

    code = (
        "import numpy as np, optcc_mpi\n"
        "from mpi4py import MPI\n"
        "c = MPI.COMM_WORLD; r, p = c.Get_rank(), c.Get_size()\n"
        "x = np.arange(1000, dtype=np.float64) * (r + 1)\n"
        "y = optcc_mpi.allreduce(x, algorithm='myring')\n"
        "assert np.array_equal(y, np.arange(1000) * p * (p + 1) / 2), y[:4]\n"
        "assert optcc_mpi.collectives.last_stats()['algorithm'] == 'myring'\n"
        "print('ok', r)\n"
    )
    out = _run(root, *mpiexec(3), sys.executable, "-m", "mpi4py", "-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("ok") == 3
    bench = _run(
        root, *mpiexec(2), sys.executable, "-m", "optcc_mpi", "bench",
        "-b", "64K", "-e", "64K", "-n", "2", "-w", "0", "--algorithms", "myring",
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    assert "myring" in bench.stdout
