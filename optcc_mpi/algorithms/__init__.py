"""Collective algorithms: each a pure function returning a :class:`~optcc_mpi.schedule.Schedule`.

An algorithm is registered with :func:`register` and called as
``fn(p, count, links, *, itemsize=4, **params)``. Adding an algorithm is adding one module
here; the executor, simulator and verifier need no change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from optcc_mpi.links import Links
from optcc_mpi.schedule import Schedule

__all__ = ["Algorithm", "register", "get", "names", "build"]


@dataclass(frozen=True)
class Algorithm:
    """A registered algorithm: its name, one-line summary and schedule function."""

    name: str
    summary: str
    fn: Callable[..., Schedule]


_REGISTRY: dict[str, Algorithm] = {}
#: Modules holding the algorithms, in the order they are listed.
_MODULES = ("ring", "optcc", "r2ccl", "native")


def register(
    name: str, summary: str
) -> Callable[[Callable[..., Schedule]], Callable[..., Schedule]]:
    """Class the decorated schedule function as algorithm ``name``."""

    def deco(fn: Callable[..., Schedule]) -> Callable[..., Schedule]:
        if name in _REGISTRY:
            raise ValueError(f"algorithm {name!r} registered twice")
        _REGISTRY[name] = Algorithm(name, summary, fn)
        return fn

    return deco


def _load() -> None:
    # Importing the modules registers them; done lazily to avoid import cycles.
    import importlib

    for module in _MODULES:
        try:
            importlib.import_module(f"{__name__}.{module}")
        except ModuleNotFoundError as exc:  # not written yet
            if exc.name != f"{__name__}.{module}":
                raise


def names() -> tuple[str, ...]:
    """Names of the registered algorithms."""
    _load()
    return tuple(_REGISTRY)


def get(name: str) -> Algorithm:
    """The algorithm called ``name``; ValueError naming the choices otherwise."""
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; choose one of {', '.join(sorted(_REGISTRY))} or 'auto'"
        ) from None


def build(
    name: str, p: int, count: int, links: Links | str | None = None, **params: Any
) -> Schedule:
    """Schedule of algorithm ``name`` (memoised: schedules are pure functions of the inputs)."""
    links = Links.coerce(links) if links is not None else Links()
    key = tuple(sorted(params.items()))
    return _build_cached(name, int(p), int(count), links.key(), key)


@lru_cache(maxsize=64)
def _build_cached(
    name: str, p: int, count: int, links_key: tuple[tuple[int, float], ...], params: tuple
) -> Schedule:
    return get(name).fn(p, count, Links(dict(links_key)), **dict(params))
