"""Names renamed in one release that still resolve in the next: one helper for every
module that keeps some (issue 34: one name per concept).

A module ends with ``__getattr__ = renamed(__name__, {"Old": "New"}, globals())``; then
``module.Old`` is ``module.New``, with a ``FutureWarning`` that names the new name. A
module that moved keeps its old name as a two-line module that imports the new one and
calls :func:`moved`: the old name is then the new module, with the same warning.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType

__all__ = ["renamed", "moved"]


def renamed(
    module: str, new_names: Mapping[str, str], namespace: Mapping[str, object]
) -> Callable[[str], object]:
    """A module ``__getattr__`` (PEP 562) under which each old name of ``new_names``
    resolves to what ``namespace`` (the module's ``globals()``) holds under its new name,
    with a ``FutureWarning``; any other name is an ``AttributeError``, as without it."""

    def __getattr__(name: str) -> object:
        new = new_names.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is now {new}; the old name goes in the next release",
            FutureWarning,
            stacklevel=2,
        )
        return namespace[new]

    return __getattr__


def moved(old: str, new: ModuleType) -> None:
    """Make the module name ``old`` the module ``new`` (which the caller, the module left at
    the old name, imported), with a ``FutureWarning`` at the import that names the new
    one: ``import optcc_mpi.process_group`` keeps working one release."""
    warnings.warn(
        f"{old} is now {new.__name__}; the old name goes in the next release",
        FutureWarning,
        stacklevel=3,
    )
    sys.modules[old] = new
