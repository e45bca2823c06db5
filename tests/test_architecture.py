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
from typing import NamedTuple

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
        ("optcc_mpi", "errors", "units", "config", "compiled", "progress", "labels"),
    ),
    ("element types and reductions by name", ("dtypes",)),
    ("how reductions compute", ("reductions",)),
    ("array libraries, link profiles", ("arrays", "links", "linklog", "linkrates")),
    ("models and emulation", ("model", "emulation")),
    ("the schedule", ("schedule",)),
    (
        "the schedule's readers, transports, algorithms",
        (
            "verify",
            "simulate",
            "executor",
            "transports",
            "transports.*",
            "check.fastcall",
            "algorithms",
            "algorithms.*",
        ),
    ),  # fmt: skip
    (
        "the check's state per communicator, agreement",
        ("check.state", "check.agreement", "check.crossover"),
    ),
    (
        "the check's protocol and its ride, the probe, the watch",
        ("check.protocol", "check.ride", "probe", "watch"),
    ),
    # The check's face: lazy names only (it imports none of its modules).
    ("the argument check's face", ("check",)),
    ("what the collectives keep per communicator", ("communicators",)),
    ("a call's plan: its links, the link rate, the schedule", ("planning",)),
    ("a call's arguments, checked on its rank; its buffers' checks", ("arguments",)),
    ("the compiled call path", ("compiled_path",)),
    ("the collective entry points", ("collectives",)),
    (
        "tensors over a transport, the torch.distributed backend, a call's Work, its ordered "
        "worker, its side streams and device agreement",
        (
            "torch.tensors",
            "torch.process_group",
            "torch.work",
            "torch.worker",
            "torch.streams",
            "torch.devices",
        ),
    ),
    (
        "faces: Comm, torch, doctor, testing, CA-SGD, data",
        (
            "comm",
            "torch",
            "doctor",
            "doctor.*",
            "testing",
            "testing.*",
            "glm",
            "glm.*",
            "data",
            "data.*",
        ),  # fmt: skip
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
    "arrays",
    "emulation",
    "probe",
    "model",
    "errors",
    "check.agreement",
    "config",
    "compiled",
    "doctor",
    "linklog",
    "linkrates",
    "watch",
)


def _modules(pkg: Path = PKG) -> list[tuple[str, Path]]:
    out = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg.parent).with_suffix("")
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


#: Where a module may import our own modules by a string (``importlib.import_module``,
#: ``__import__``): the package's face, whose lazy names (``_EXPORTS``) the check resolves
#: to the modules that define them, and the algorithm registry's discovery.
STRING_IMPORTS = {"optcc_mpi", "optcc_mpi.algorithms", "optcc_mpi.check"}
#: Our compiled extensions: optional, imported inside functions like a heavy dependency.
COMPILED = {"optcc_mpi.check._fastcall", "optcc_mpi._simcore"}


class Edge(NamedTuple):
    """One module's use of another: ``how`` is ``import`` (an import statement, at module
    level or in a function), ``name`` (a name reached through the package or a module
    bound by an import: ``optcc_mpi.allreduce``, ``from optcc_mpi import allreduce``,
    ``from . import allreduce``, ``getattr(optcc_mpi, "allreduce")``) or ``string``
    (``importlib.import_module("optcc_mpi.x")``)."""

    source: str
    target: str
    in_function: bool
    line: int
    how: str


class Graph(NamedTuple):
    #: Module-level import edges, by module.
    top: dict[str, set[str]]
    #: Every edge, to our modules and (``<third party> name``) to others in functions.
    edges: list[Edge]
    #: Each module's module-level third-party imports.
    third: dict[str, set[str]]
    #: String imports the check cannot follow, or that stand outside STRING_IMPORTS.
    strings: list[str]


def _exports(pkg: Path) -> dict[str, dict[str, str]]:
    """Per package, the lazy names its ``__init__`` resolves on access (an ``_EXPORTS``
    dict literal: name -> defining module)."""
    out: dict[str, dict[str, str]] = {}
    for module, path in _modules(pkg):
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text(), str(path)).body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)
                and isinstance(node.value, ast.Dict)
            ):
                out[module] = {
                    k.value: v.value
                    for k, v in zip(node.value.keys, node.value.values)
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)
                }
    return out


_STRING_IMPORTERS = {
    "importlib.import_module",
    "import_module",
    "__import__",
    "importlib.__import__",
}


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything else."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else None


class _Module:
    """The uses of our modules in one module's source (:func:`_graph`)."""

    def __init__(
        self, module: str, path: Path, index: _Index, graph: Graph, source: str | None = None
    ) -> None:
        self.module, self.index, self.graph = module, index, graph
        self.package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        #: Local names bound to one of our modules by an import.
        self.bound: dict[str, str] = {}
        graph.third[module] = set()
        text = path.read_text() if source is None else source
        self.visit(ast.parse(text, str(path)), False)

    def add(self, target: str | None, fn: bool, line: int, how: str) -> None:
        if target and target != self.module:
            self.graph.edges.append(Edge(self.module, target, fn, line, how))
            if not fn and how == "import":
                self.graph.top.setdefault(self.module, set()).add(target)

    def absolute(self, base: str, level: int) -> str:
        if not level:
            return base
        parent = self.package.split(".")
        parent = parent[: len(parent) - level + 1]
        return ".".join(parent + ([base] if base else []))

    def outside(self, name: str, fn: bool, line: int) -> None:
        """An import of a module not ours."""
        top = name.split(".")[0]
        if not fn:
            self.graph.third[self.module].add(top)
        elif top not in sys.stdlib_module_names:
            self.graph.edges.append(Edge(self.module, "<third party> " + top, True, line, "import"))

    def visit(self, node: ast.AST, in_fn: bool) -> None:
        for ch in ast.iter_child_nodes(node):
            fn = in_fn or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(ch, ast.Import):
                self.imported(ch, fn)
            elif isinstance(ch, ast.ImportFrom):
                self.imported_from(ch, fn)
            elif isinstance(ch, ast.Attribute) and (names := _chain(ch)) is not None:
                self.attribute(names, fn, ch.lineno)
                continue  # a chain of names: nothing more inside
            elif isinstance(ch, ast.Call):
                self.call(ch, fn)
            self.visit(ch, fn)

    def imported(self, node: ast.Import, fn: bool) -> None:
        ix = self.index
        for a in node.names:
            if a.name.split(".")[0] != ix.root:
                self.outside(a.name, fn, node.lineno)
                continue
            target = ix.resolve(a.name)
            self.add(target, fn, node.lineno, "import")
            if a.asname:
                self.bound[a.asname] = target or ix.root
            else:
                self.bound[a.name.split(".")[0]] = ix.root

    def imported_from(self, node: ast.ImportFrom, fn: bool) -> None:
        ix = self.index
        base = self.absolute(node.module or "", node.level)
        if base.split(".")[0] != ix.root:
            if base:
                self.outside(base, fn, node.lineno)
            return
        owner = ix.resolve(base) or ix.root
        for a in node.names:
            full = f"{base}.{a.name}"
            if full in COMPILED:
                self.graph.edges.append(
                    Edge(self.module, "<compiled> " + full, fn, node.lineno, "import")
                )
                continue
            target = ix.member(owner, a.name)
            if full in ix.known:
                # `from pkg import sub` imports the submodule, not the package's body.
                self.add(target, fn, node.lineno, "import")
                self.bound[a.asname or a.name] = full
            elif target != owner:
                # A lazy name of the package: the module that defines it.
                self.add(owner, fn, node.lineno, "import")
                self.add(target, fn, node.lineno, "name")
            else:
                self.add(owner, fn, node.lineno, "import")

    def attribute(self, names: list[str], fn: bool, line: int) -> None:
        start = self.bound.get(names[0])
        if start is None:
            return
        target = start
        for attr in names[1:]:
            nxt = self.index.member(target, attr)
            if nxt == target:
                break
            target = nxt
        if target != start:
            self.add(target, fn, line, "name")

    def call(self, node: ast.Call, fn: bool) -> None:
        name = ".".join(_chain(node.func) or [])
        if name in ("getattr", "hasattr") and len(node.args) >= 2:
            obj = _chain(node.args[0])
            if obj and obj[0] in self.bound:
                attr = node.args[1]
                if isinstance(attr, ast.Constant) and isinstance(attr.value, str):
                    self.attribute([*obj, attr.value], fn, node.lineno)
                elif (
                    self.index.is_package(self.bound[obj[0]]) and self.module not in STRING_IMPORTS
                ):
                    # (on a plain module, a computed name reaches only what that module
                    # itself imported, which is checked there)
                    self.graph.strings.append(
                        f"{self.module}:{node.lineno} {name}() of one of our modules with a "
                        "computed name"
                    )
            return
        if name not in _STRING_IMPORTERS:
            return
        arg = node.args[0] if node.args else None
        literal = arg.value if isinstance(arg, ast.Constant) else None
        if isinstance(literal, str):
            dots = len(literal) - len(literal.lstrip("."))
            literal = self.absolute(literal[dots:], dots)
            if literal.split(".")[0] != self.index.root:
                return  # another package, by name
            self.add(self.index.resolve(literal), fn, node.lineno, "string")
        if self.module not in STRING_IMPORTS:
            what = repr(literal) if isinstance(literal, str) else "a computed name"
            self.graph.strings.append(f"{self.module}:{node.lineno} {name}({what})")


class _Index:
    """The package's modules and the lazy names of its packages."""

    def __init__(self, pkg: Path) -> None:
        self.root = pkg.name
        self.known = {m for m, _ in _modules(pkg)}
        self.exports = _exports(pkg)

    def is_package(self, module: str) -> bool:
        """Whether ``module`` has submodules or lazy names (a computed attribute of it
        could be any of them)."""
        return module in self.exports or any(m.startswith(module + ".") for m in self.known)

    def resolve(self, name: str) -> str | None:
        """The module of ours ``name`` is or is in."""
        while name and name not in self.known:
            name = name.rpartition(".")[0]
        return name or None

    def member(self, base: str, attr: str) -> str:
        """The module ``base.attr`` stands for: a submodule, a lazy name's defining
        module, or ``base`` itself (a plain attribute)."""
        sub = f"{base}.{attr}"
        if sub in self.known:
            return sub
        return self.exports.get(base, {}).get(attr, base)


def _graph(pkg: Path = PKG) -> Graph:
    """Every use of one of our modules by another (:class:`Edge`), with names taken
    through the package resolved to the modules that define them."""
    index = _Index(pkg)
    graph = Graph({}, [], {}, [])
    for module, path in _modules(pkg):
        _Module(module, path, index, graph)
    return graph


def _layer(module: str) -> int:
    name = module.removeprefix("optcc_mpi.")
    for i, (_, patterns) in enumerate(LAYERS):
        for pat in patterns:
            if name == pat or (pat.endswith(".*") and name.startswith(pat[:-1])):
                return i
    raise AssertionError(f"{module} is in no layer of LAYERS: add it")


def _upward(graph: Graph) -> list[str]:
    return sorted(
        {
            f"{e.source}:{e.line} {'uses' if e.how != 'import' else 'imports'} {e.target} "
            f"({LAYERS[_layer(e.target)][0]}) from {LAYERS[_layer(e.source)][0]}"
            + ("" if e.how == "import" else f" [{e.how}]")
            for e in graph.edges
            if not e.target.startswith("<") and _layer(e.target) > _layer(e.source)
        }
    )


def test_layers_point_one_way() -> None:
    """No module uses one of a higher layer: not by an import (even inside a function),
    not by a name taken through the package or a bound module, not by a string."""
    bad = _upward(_graph())
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_string_imports() -> None:
    """Our modules are imported by import statements, which the check can read: by a
    string only in the package's face and the algorithm registry."""
    strings = _graph().strings
    assert not strings, "\n".join(strings)


def test_no_import_loop() -> None:
    """The import graph (function-level imports and names taken through the package
    included) has no cycle."""
    graph: dict[str, set[str]] = {}
    for e in _graph().edges:
        if not e.target.startswith("<"):
            graph.setdefault(e.source, set()).add(e.target)
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
    """Inside functions: only the optional heavy dependencies and our compiled
    extensions, or a module of ours that imports one at module level (directly or through
    its own imports)."""
    top, edges, third, _ = _graph()

    def heavy(m: str, seen: frozenset[str] = frozenset()) -> bool:
        if third.get(m, set()) & OPTIONAL:
            return True
        return any(heavy(b, seen | {m}) for b in top.get(m, ()) if b not in seen)

    bad = []
    for e in edges:
        if not e.in_function or e.how != "import" or e.target.startswith("<compiled> "):
            continue
        if e.target.startswith("<third party> "):
            name = e.target.split()[-1].split(".")[0]
            if name not in OPTIONAL:
                bad.append(f"{e.source}:{e.line} imports {name} inside a function")
        elif not heavy(e.target):
            bad.append(
                f"{e.source}:{e.line} imports {e.target} inside a function (import it at the top)"
            )
    assert not bad, "\n".join(sorted(set(bad)))


_FN = "\n\ndef _f():\n    return "
BYPASSES = {
    "attribute through the package": "import optcc_mpi\n" + _FN + "optcc_mpi.allreduce\n",
    "a name from the package": "from optcc_mpi import allreduce  # noqa: F401\n",
    "a relative name": "from . import allreduce  # noqa: F401\n",
    "a string import": "import importlib\n"
    + _FN
    + "importlib.import_module('optcc_mpi.collectives')\n",
    "getattr on the package": "import optcc_mpi\n" + _FN + "getattr(optcc_mpi, 'allreduce')\n",
    "an alias of the package": "import optcc_mpi as o\n" + _FN + "o.collectives.allreduce\n",
}


@pytest.mark.parametrize("bypass", sorted(BYPASSES))
def test_bypasses_are_caught(bypass: str) -> None:
    """Each way a low module could reach the collectives through the package, appended
    to ``schedule.py``'s source, fails the layer check (a string import also fails the
    string check); the source as it is passes."""
    path = PKG / "schedule.py"

    def check(source: str) -> Graph:
        graph = Graph({}, [], {}, [])
        _Module("optcc_mpi.schedule", path, _Index(PKG), graph, source)
        return graph

    clean = check(path.read_text())
    assert not _upward(clean) and not clean.strings
    caught = check(path.read_text() + "\n" + BYPASSES[bypass])
    found = _upward(caught)
    assert found, f"{bypass} slipped past the layer check"
    assert all("optcc_mpi.collectives" in f for f in found), found
    assert bool(caught.strings) == (bypass == "a string import")


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
