"""The algorithm registry: the only place an AllReduce algorithm is named.

An algorithm is one module in this package that registers its schedule builder::

    @register(summary="...", cost=my_time)
    def my_algorithm(p, count, links=None, *, itemsize=4, chunk_bytes=1 << 20) -> Schedule:
        ...

Everything else (``allreduce`` and ``auto``, ``optcc-mpi model``, ``simulate`` and
``bench``, the report, the demo, the contract of :mod:`optcc_mpi.testing`) iterates
:func:`names` and calls :func:`get`, so adding an algorithm is adding one module: modules
here are discovered without a list to edit, and packages elsewhere can add theirs through
the entry-point group ``optcc_mpi.algorithms``. :func:`times` and :func:`table` give the
modelled time of every registered algorithm beside the fault-free optimum and the lower
bound of :mod:`optcc_mpi.model`.

A schedule does not depend on the reduction: where an algorithm's docstrings say "sum"
or "adds", read whichever reduction the call asks for (:data:`optcc_mpi.dtypes.OPS`).

What a registration declares
----------------------------
name
    The module's own name unless given (so a copied module registers under its new name).
summary
    One line for ``--help`` and tables.
build
    ``build(p, count, links, *, itemsize=4, **params) -> Schedule``, a pure function.
cost
    ``cost(p, nbytes, bw, links, *, latency=0.0, **params) -> seconds``: the modelled
    time on ``p`` ranks of ``nbytes`` bytes each, healthy NIC rate ``bw`` bytes/s per
    direction, the link profile ``links`` and a per-message latency. It receives the
    parameters it accepts from the same ``params`` the builder gets.
params
    The tunable parameters with their defaults: by default the builder's keyword-only
    parameters (``itemsize`` excluded).
auto
    Whether ``algorithm="auto"`` may choose it: a bool, or a predicate
    ``auto(p, nbytes, links) -> bool`` for algorithms that only suit some sizes.
order
    Where it is listed (smaller first); ties by name.
explain
    Optional ``explain(p, links, **params) -> str``: one line on how the algorithm adapts
    to this profile (OptCC prints its plan), shown by ``optcc-mpi model``.
cost_gap
    Optional ``cost_gap(p, links) -> str | None``: where the declared cost is known not to
    describe the schedule (a load the model leaves out), the reason; ``None`` elsewhere.
    The contract (:func:`optcc_mpi.testing.check_algorithm`) does not hold the simulated
    time to the cost on such a profile, and says why.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import TypedDict

from optcc_mpi.errors import ArgumentError
from optcc_mpi.links import Links
from optcc_mpi.model import fault_free, lower_bound
from optcc_mpi.schedule import Schedule

__all__ = [
    "Algorithm",
    "register",
    "get",
    "names",
    "all_algorithms",
    "build",
    "times",
    "table",
    "ENTRY_POINTS",
    "ModelTable",
    "ModelRow",
]

#: Entry-point group through which other packages register algorithms.
ENTRY_POINTS = "optcc_mpi.algorithms"

Builder = Callable[..., Schedule]
Cost = Callable[..., float]


@dataclass(frozen=True)
class Algorithm:
    """Everything about one registered algorithm (see the module docstring)."""

    name: str
    summary: str
    build: Builder
    cost: Cost
    #: The builder's keyword parameters and their defaults (each typed by the builder).
    params: Mapping[str, object] = field(default_factory=dict)
    auto: bool | Callable[[int, float, Links], bool] = True
    order: int = 100
    module: str = ""
    explain: Callable[..., str] | None = None
    cost_gap: Callable[[int, Links], str | None] | None = None

    def time(
        self,
        p: int,
        nbytes: float,
        bw: float,
        links: Links | str | None = None,
        *,
        latency: float = 0.0,
        **params: object,
    ) -> float:
        """Modelled time in seconds: the registered cost, given the parameters it takes
        (the builder's defaults, overridden by ``params``), so that the cost describes the
        schedule :func:`build` makes with the same parameters."""
        links = Links.coerce(links) if links is not None else Links()
        given = _accepted(self.cost, {**self.params, **params})
        return float(self.cost(p, nbytes, bw, links, latency=latency, **given))

    def cost_gap_at(self, p: int, links: Links | str | None = None) -> str | None:
        """Why the declared cost does not describe the schedule on ``p`` ranks under
        ``links`` (the registration's ``cost_gap``), or None where it does."""
        if self.cost_gap is None:
            return None
        links = Links.coerce(links) if links is not None else Links()
        return self.cost_gap(p, links)

    def eligible(self, p: int, nbytes: float, links: Links) -> bool:
        """Whether ``auto`` may run this algorithm for this call."""
        return bool(self.auto(p, nbytes, links)) if callable(self.auto) else bool(self.auto)

    def check_params(self, params: Mapping[str, object]) -> None:
        """Raise :class:`ArgumentError` naming any parameter this algorithm does not take."""
        unknown = sorted(set(params) - set(self.params) - {"itemsize"})
        if unknown:
            known = ", ".join(sorted(self.params)) or "none"
            raise ArgumentError(
                f"algorithm {self.name!r} has no parameter {', '.join(map(repr, unknown))} "
                f"(its parameters: {known})"
            )


_REGISTRY: dict[str, Algorithm] = {}
_loaded = False
_loading = False
_LOAD_LOCK = threading.RLock()


def _accepted(fn: Callable[..., object], params: Mapping[str, object]) -> dict[str, object]:
    """The subset of ``params`` that ``fn`` accepts by keyword."""
    sig = inspect.signature(fn)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return dict(params)
    return {k: v for k, v in params.items() if k in sig.parameters}


def _builder_params(fn: Builder) -> dict[str, object]:
    return {
        name: prm.default
        for name, prm in inspect.signature(fn).parameters.items()
        if prm.kind is prm.KEYWORD_ONLY and name != "itemsize"
    }


def register(
    name: str | None = None,
    *,
    summary: str,
    cost: Cost,
    params: Mapping[str, object] | None = None,
    auto: bool | Callable[[int, float, Links], bool] = True,
    order: int = 100,
    explain: Callable[..., str] | None = None,
    cost_gap: Callable[[int, Links], str | None] | None = None,
) -> Callable[[Builder], Builder]:
    """Register the decorated schedule builder as an algorithm (module docstring)."""

    def deco(fn: Builder) -> Builder:
        module = fn.__module__
        key = name or module.rsplit(".", 1)[-1]
        if not key.isidentifier() or key == "auto":
            raise ArgumentError(f"algorithm name {key!r} must be an identifier other than 'auto'")
        old = _REGISTRY.get(key)
        if old is not None and old.module != module:
            raise ArgumentError(f"algorithm {key!r} registered by both {old.module} and {module}")
        _REGISTRY[key] = Algorithm(
            name=key,
            summary=summary,
            build=fn,
            cost=cost,
            params=MappingProxyType(dict(_builder_params(fn) if params is None else params)),
            auto=auto,
            order=order,
            module=module,
            explain=explain,
            cost_gap=cost_gap,
        )
        _build_cached.cache_clear()
        return fn

    return deco


def _load_entry_points() -> None:
    """Import every module of this package and every entry point (they register).

    Once per process, and thread-safe: a thread that asks while another is loading waits
    for the whole registry (it used to see an empty one). The loading thread itself may
    ask again (an algorithm module that looks another up while it is imported): it then
    sees what has registered so far."""
    global _loaded, _loading
    if _loaded:
        return
    with _LOAD_LOCK:
        if _loaded or _loading:
            return
        _loading = True
        try:
            for info in pkgutil.iter_modules(__path__):
                if not info.name.startswith("_"):
                    importlib.import_module(f"{__name__}.{info.name}")
            for ep in entry_points(group=ENTRY_POINTS):
                ep.load()
            _loaded = True
        finally:
            _loading = False


def all_algorithms() -> tuple[Algorithm, ...]:
    """Every registered algorithm, in listing order."""
    _load_entry_points()
    return tuple(sorted(_REGISTRY.values(), key=lambda a: (a.order, a.name)))


def names() -> tuple[str, ...]:
    """Names of the registered algorithms, in listing order (``auto`` is not one)."""
    return tuple(a.name for a in all_algorithms())


def get(name: str) -> Algorithm:
    """The algorithm called ``name``; :class:`ArgumentError` naming the choices otherwise."""
    _load_entry_points()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ArgumentError(
            f"unknown algorithm {name!r}; choose one of {', '.join(names())} or 'auto'"
        ) from None


def build(
    name: str, p: int, count: int, links: Links | str | None = None, **params: object
) -> Schedule:
    """Schedule of algorithm ``name`` (memoised: schedules are pure functions of the inputs)."""
    links = Links.coerce(links) if links is not None else Links()
    get(name).check_params(params)
    key = tuple(sorted(params.items()))
    return _build_cached(name, int(p), int(count), links.key(), key)


@lru_cache(maxsize=64)
def _build_cached(
    name: str,
    p: int,
    count: int,
    links_key: tuple[tuple[int, float], ...],
    params: tuple[tuple[str, object], ...],
) -> Schedule:
    return get(name).build(p, count, Links(dict(links_key)), **dict(params))


# ------------------------------------------------------------------ every algorithm's time


def times(
    p: int,
    nbytes: float,
    bw: float,
    links: Links | str | None = None,
    *,
    latency: float = 0.0,
    algorithms: tuple[str, ...] | None = None,
) -> dict[str, float]:
    """Modelled time of every registered algorithm (or those named), with the fault-free
    optimum (``"fault_free"``) and the lower bound (``"bound"``) of :mod:`optcc_mpi.model`.
    """
    out = {"fault_free": fault_free(p, nbytes, bw), "bound": lower_bound(p, nbytes, bw, links)}
    for name in algorithms if algorithms is not None else names():
        out[name] = get(name).time(p, nbytes, bw, links, latency=latency)
    return out


class ModelRow(TypedDict):
    """One algorithm's modelled time in :func:`table`."""

    time_s: float
    ratio_fault_free: float
    ratio_bound: float


class ModelTable(TypedDict):
    """What :func:`table` returns (``optcc-mpi model --json``)."""

    p: int
    size: int
    bw: float
    latency: float
    links: str
    fault_free_s: float
    bound_s: float
    bound_ratio_fault_free: float
    algorithms: dict[str, ModelRow]


def table(
    p: int,
    nbytes: float,
    bw: float,
    links: Links | str | None = None,
    *,
    latency: float = 0.0,
    algorithms: tuple[str, ...] | None = None,
) -> ModelTable:
    """The ``optcc-mpi model`` result as one JSON-ready dictionary: :func:`times` and
    each algorithm's ratios to the fault-free optimum and to the bound."""
    t = times(p, nbytes, bw, links, latency=latency, algorithms=algorithms)
    ff, bound = t.pop("fault_free"), t.pop("bound")
    algs: dict[str, ModelRow] = {
        name: {
            "time_s": v,
            "ratio_fault_free": v / ff if ff else 1.0,
            "ratio_bound": v / bound if bound else 1.0,
        }
        for name, v in t.items()
    }
    return {
        "p": p,
        "size": int(nbytes),
        "bw": bw,
        "latency": latency,
        "links": str(Links.coerce(links) if links is not None else Links()),
        "fault_free_s": ff,
        "bound_s": bound,
        "bound_ratio_fault_free": bound / ff if ff else 1.0,
        "algorithms": algs,
    }
