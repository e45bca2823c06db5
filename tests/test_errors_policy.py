"""Errors as ``optcc_mpi.errors`` promises them, enforced on the source.

Every exception the package raises on purpose derives from :class:`OptccError` and from
the built-in a caller would catch (issue 34). Outside the lab and the command line
(``optcc_mpi/lab``, ``optcc_mpi/cli``: tools, whose errors stop a run):

* no ``raise`` names a plain built-in exception class (``ValueError``, ``TypeError``,
  ``RuntimeError``, ``KeyError``, ...), but for the exceptions in :data:`ALLOWED`, each
  with its reason: Python protocols (an abstract method, a module's ``__getattr__``, a
  mapping's ``__getitem__``) and the few kept on purpose;
* no exception class derives from a built-in exception without deriving from
  ``OptccError`` too, but for those in :data:`ALLOWED_CLASSES`.

The walk reads the source with :mod:`ast`, so it sees every ``raise``, also those in
branches no test takes. An allowance that no longer matches anything fails too: the list
says what is, not what was.
"""

from __future__ import annotations

import ast
import builtins
import fnmatch
from pathlib import Path

import pytest

import optcc_mpi
from optcc_mpi import errors

PKG = Path(optcc_mpi.__file__).parent
ROOT = PKG.parent
#: Folders of the package whose errors stop a tool: not walked.
TOOLING = ("optcc_mpi/lab/", "optcc_mpi/cli/")
#: Every built-in exception class, by name (``ValueError``, ``KeyError``, ``OSError``, ...).
BUILTIN_EXCEPTIONS = frozenset(
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
)

#: (file, enclosing function or class, fnmatch pattern; exception): why it stays a plain
#: built-in.
ALLOWED: dict[tuple[str, str, str], str] = {
    # -- Python protocols --------------------------------------------------------------
    ("optcc_mpi/__init__.py", "__getattr__", "AttributeError"): (
        "module __getattr__ (PEP 562): AttributeError is how hasattr/getattr learn a name is absent"
    ),
    ("optcc_mpi/collectives.py", "__getattr__", "AttributeError"): "module __getattr__ (PEP 562)",
    ("optcc_mpi/check/__init__.py", "__getattr__", "AttributeError"): (
        "module __getattr__ (PEP 562)"
    ),
    ("optcc_mpi/glm/__init__.py", "__getattr__", "AttributeError"): "module __getattr__ (PEP 562)",
    ("optcc_mpi/testing/__init__.py", "__getattr__", "AttributeError"): (
        "module __getattr__ (PEP 562)"
    ),
    ("optcc_mpi/config.py", "Settings.__[gs]etattr__", "AttributeError"): (
        "attribute protocol of the settings object (rc.unknown is an AttributeError)"
    ),
    ("optcc_mpi/communicators.py", "CallRecord.__getitem__", "KeyError"): (
        "Mapping protocol: a record read by key raises KeyError for a missing key"
    ),
    ("optcc_mpi/config.py", "Settings.text", "KeyError"): (
        "a lookup by variable name in the table, documented as KeyError like rc[name] "
        "(a programming error, not a user's input)"
    ),
    ("optcc_mpi/glm/sampler.py", "Sampler.block", "IndexError"): (
        "sequence-style access to the epoch's blocks: an index past the end is an "
        "IndexError, as for a list"
    ),
    ("optcc_mpi/arrays.py", "ArrayOps.*", "NotImplementedError"): (
        "abstract methods of the ArrayOps interface"
    ),
    ("optcc_mpi/transports/base.py", "Transport.*", "NotImplementedError"): (
        "abstract methods of the transport contract, and allreduce: a capability a "
        "transport may lack (called only where native() said yes)"
    ),
    ("optcc_mpi/algorithms/_optcc_pipeline.py", "_Attached.*", "NotImplementedError"): (
        "abstract methods of the attached-rows helper"
    ),
    # -- kept on purpose ---------------------------------------------------------------
    ("optcc_mpi/arguments.py", "_numpy_flat", "AssertionError"): (
        "an unreachable line (buffer_of raised first): an assertion of ours, not an error "
        "a caller can cause"
    ),
    ("optcc_mpi/testing/fake_streams.py", "FakeStreams.launch", "AssertionError"): (
        "a test double's failed check: pytest reports an AssertionError as a failure"
    ),
    ("optcc_mpi/glm/__init__.py", "__getattr__", "ImportError"): (
        "scikit-learn missing: the command line prints a traceback for an ImportError "
        "that is not ours (cli/_common.run_command); one of ours would change that"
    ),
    ("optcc_mpi/torch/__init__.py", "<module>", "ImportError"): (
        "PyTorch missing, at import: as for scikit-learn, the command line's handling of "
        "an ImportError that is not ours is kept"
    ),
}

#: (file, class): why it derives from a built-in exception and not from OptccError.
ALLOWED_CLASSES: dict[tuple[str, str], str] = {
    ("optcc_mpi/check/protocol.py", "Mismatch"): (
        "an internal signal between the check's steps: always caught, never reaches a caller"
    ),
}


def _sources() -> list[tuple[str, ast.Module]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(TOOLING):
            out.append((rel, ast.parse(path.read_text(), rel)))
    return out


def _bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds itself (imports, classes, assignments): a local
    ``TimeoutError`` imported from elsewhere is not the built-in."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _builtin_name(node: ast.expr, shadowed: set[str]) -> str | None:
    """The built-in exception class ``node`` names (``ValueError``,
    ``builtins.ValueError``), or None."""
    if isinstance(node, ast.Name) and node.id in BUILTIN_EXCEPTIONS and node.id not in shadowed:
        return node.id
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "builtins"
        and node.attr in BUILTIN_EXCEPTIONS
    ):
        return node.attr
    return None


def plain_raises(rel: str, tree: ast.Module) -> list[tuple[str, str, str, int]]:
    """Every ``raise`` of a plain built-in exception in one module, as (file, enclosing
    function or class qualified name, exception, line)."""
    shadowed = _bound_names(tree)
    found: list[tuple[str, str, str, int]] = []

    def visit(node: ast.AST, where: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*where, child.name])
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                name = _builtin_name(exc, shadowed)
                if name is not None:
                    found.append((rel, ".".join(where) or "<module>", name, child.lineno))
            visit(child, where)

    visit(tree, [])
    return found


def _allowed(rel: str, where: str, name: str) -> tuple[str, str, str] | None:
    for key in ALLOWED:
        file, pattern, exc = key
        if file == rel and exc == name and fnmatch.fnmatchcase(where, pattern):
            return key
    return None


def check_raises(sources: list[tuple[str, ast.Module]]) -> tuple[list[str], set[tuple]]:
    """(the plain raises not allowed, as 'file:line: in where: raise Name'; the allowances
    that matched)."""
    bad, used = [], set()
    for rel, tree in sources:
        for file, where, name, line in plain_raises(rel, tree):
            key = _allowed(file, where, name)
            if key is None:
                bad.append(f"{file}:{line}: in {where}: raise {name}")
            else:
                used.add(key)
    return bad, used


#: Our exception classes, by name: OptccError and every class errors.py exports from it.
OURS = frozenset(
    name
    for name in errors.__all__
    if isinstance(getattr(errors, name), type) and issubclass(getattr(errors, name), Exception)
)


#: The root of ours, the one class that derives from Exception alone.
ROOT_CLASS = ("optcc_mpi/errors.py", "OptccError")


def check_classes(sources: list[tuple[str, ast.Module]]) -> tuple[list[str], set[tuple]]:
    """(exception classes that derive from a built-in exception and none of ours; the
    allowances that matched)."""
    bad, used = [], set()
    for rel, tree in sources:
        shadowed = _bound_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef) or (rel, node.name) == ROOT_CLASS:
                continue
            bases = node.bases
            if not any(_builtin_name(b, shadowed) for b in bases):
                continue
            if any(isinstance(b, ast.Name) and b.id in OURS for b in bases):
                continue
            if (rel, node.name) in ALLOWED_CLASSES:
                used.add((rel, node.name))
            else:
                bad.append(f"{rel}:{node.lineno}: class {node.name}")
    return bad, used


def test_no_plain_builtin_raise_outside_the_lab_and_the_cli() -> None:
    bad, used = check_raises(_sources())
    assert not bad, (
        "raise one of optcc_mpi.errors' classes (each also a ValueError, TypeError, "
        "RuntimeError, ... as the built-in was), or add the raise to ALLOWED with its "
        "reason:\n  " + "\n  ".join(bad)
    )
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"allowances that match no raise any more (remove them): {stale}"


def test_every_exception_class_is_ours() -> None:
    bad, used = check_classes(_sources())
    assert not bad, (
        "derive these from optcc_mpi.errors.OptccError too (keeping the built-in base), "
        "or add them to ALLOWED_CLASSES with the reason:\n  " + "\n  ".join(bad)
    )
    stale = sorted(set(ALLOWED_CLASSES) - used)
    assert not stale, f"class allowances that match nothing any more (remove them): {stale}"


@pytest.mark.parametrize(
    "source, found",
    [
        ("def f():\n    raise ValueError('x')\n", ["f", "ValueError"]),
        ("def f():\n    raise KeyError\n", ["f", "KeyError"]),
        ("class C:\n    def g(self):\n        raise OSError(1, 'x')\n", ["C.g", "OSError"]),
        ("import builtins\nraise builtins.TypeError('x')\n", ["<module>", "TypeError"]),
        ("def f():\n    raise RuntimeError('x') from None\n", ["f", "RuntimeError"]),
        # Ours, a variable, a re-raise and a local class of a built-in's name are not.
        ("from optcc_mpi.errors import ArgumentError\nraise ArgumentError('x')\n", None),
        ("def f(exc):\n    raise exc\n", None),
        ("try:\n    pass\nexcept ValueError:\n    raise\n", None),
        ("from concurrent.futures import TimeoutError\nraise TimeoutError()\n", None),
    ],
)
def test_the_walk_finds_what_it_must(source: str, found: list[str] | None) -> None:
    """The check can fail: a deliberate plain raise in a module of the package is
    reported (and one of ours, or a re-raise, is not)."""
    rel = "optcc_mpi/example.py"
    bad, _ = check_raises([(rel, ast.parse(source))])
    if found is None:
        assert bad == []
    else:
        where, name = found
        assert len(bad) == 1 and f"in {where}: raise {name}" in bad[0], bad


def test_the_walk_covers_the_package_but_the_lab_and_the_cli() -> None:
    files = {rel for rel, _ in _sources()}
    assert "optcc_mpi/glm/api.py" in files and "optcc_mpi/errors.py" in files
    assert not any(f.startswith(TOOLING) for f in files)


def test_a_class_of_a_builtin_alone_is_reported() -> None:
    bad, _ = check_classes([("optcc_mpi/x.py", ast.parse("class E(ValueError):\n    pass\n"))])
    assert bad == ["optcc_mpi/x.py:1: class E"]
    ours = "from optcc_mpi.errors import OptccError\nclass E(OptccError, ValueError):\n    pass\n"
    assert check_classes([("optcc_mpi/x.py", ast.parse(ours))])[0] == []


@pytest.mark.parametrize("name", sorted(OURS))
def test_our_classes_keep_a_builtin_base(name: str) -> None:
    """Each class of ours is an OptccError and (but the root) also the built-in a caller
    caught before."""
    cls = getattr(errors, name)
    assert issubclass(cls, errors.OptccError)
    if cls is not errors.OptccError:
        assert any(b.__module__ == "builtins" and b is not Exception for b in cls.__mro__[1:]), (
            cls.__mro__
        )
