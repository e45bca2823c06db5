"""The contract every registered AllReduce algorithm meets, as checks anyone can run.

In the spirit of scikit-learn's ``check_estimator``: an algorithm registered in this
package, or by another package through the entry-point group ``optcc_mpi.algorithms``, is
checked by name with :func:`check_algorithm`, and a pytest suite runs the same checks one
test each with :func:`optcc_mpi.testing.parametrize_with_checks`. The package's own
``tests/test_contract.py`` is exactly such a suite over every registered algorithm.

The checks (:data:`CHECKS`, in the order they run)
--------------------------------------------------
``registration``
    The registration is complete: the name it is listed under, a one-line summary,
    callable builder and cost, ``itemsize`` not among the parameters, ``auto`` a bool or a
    predicate, and an ``explain`` (if any) that returns one line of text.
``parameters``
    Parameters, builder and cost agree: the builder takes every declared parameter, and the
    cost requires no parameter but the declared ones (it is called with ``latency`` and
    the declared parameters it accepts); building with the declared
    defaults spelled out gives the same schedule as building without them, so the cost
    (which is given those defaults) describes the schedule that runs; a parameter the
    algorithm does not take is refused by name.
``cost``
    The declared cost is a time: zero on one rank, finite and positive on more, never
    below the lower bound of :mod:`optcc_mpi.model` on any profile of :func:`profiles`
    at p = 6, and not shorter with a per-message latency than without.
``eligibility``
    Whether ``algorithm="auto"`` may choose it is a pure answer: a bool, the same on
    every call, for p = 1 to 17, messages of 0 bytes to 64 MiB and every profile. Every
    rank asks on its own, so an answer that varied would split the ranks' choice.
``verifies``
    The verifier (:func:`optcc_mpi.verify.verify`) proves the schedule (matching, no
    deadlock, no race, every contribution exactly once) for p = 2 to 17
    (:data:`VERIFY_RANKS`), every profile of :func:`profiles` and the counts of
    :func:`verify_counts`.
``simulated_cost``
    In the fluid regime its cost describes (64 MiB per rank, no latency) the simulated
    time of the schedule is within :data:`COST_TOLERANCE` of the declared cost at
    p = 4 and 8 (:data:`COST_RANKS`) on every profile of :func:`profiles`, except where
    the registration's ``cost_gap`` gives a reason the cost cannot hold (the outcome
    names each such profile and the reason).
``mpi_reference``
    Under MPI, on a communicator of more than one rank: on every profile, for the counts
    of :func:`mpi_counts` in float64 and float32, the result matches a long-double
    reference within the summation bound ``(p + 1) eps sum|x| + eps |ref|`` and is
    bit-identical on every rank. Every rank must run it (it is collective); every rank
    then reports the failures of all of them, so no rank is left waiting.

Everything but ``mpi_reference`` runs in one process, anywhere.
"""

from __future__ import annotations

import inspect
import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from optcc_mpi import algorithms
from optcc_mpi.collectives import allreduce
from optcc_mpi.errors import ArgumentError, OptccError
from optcc_mpi.links import Links
from optcc_mpi.model import lower_bound
from optcc_mpi.schedule import Schedule
from optcc_mpi.simulate import simulate
from optcc_mpi.verify import verify

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = [
    "CHECKS",
    "COST_RANKS",
    "COST_TOLERANCE",
    "VERIFY_RANKS",
    "Check",
    "ContractError",
    "Outcome",
    "check_algorithm",
    "cost_profiles",
    "mpi_counts",
    "profiles",
    "select_checks",
    "verify_counts",
]

#: How far the simulated time of a schedule may lie from the algorithm's declared cost,
#: in the fluid regime (large messages, no latency): above by pipeline head and tail and
#: queueing, below by nothing the model omits.
COST_TOLERANCE = 0.10

#: Rank counts the verifier proves every schedule for.
VERIFY_RANKS = range(2, 18)

#: Rank counts at which the simulated time is held to the declared cost.
COST_RANKS = (4, 8)

#: Bytes per rank and healthy rate (bytes/s) of the cost check: the fluid regime.
COST_BYTES, COST_BW = 64 * 2**20, 1e9

#: Element types of the MPI check, with the reference in long double.
MPI_DTYPES = (np.float64, np.float32)

#: What the MPI check allows for a rank's run (seconds), as the pytest helper marks it.
MPI_TIMEOUT = 300


class ContractError(OptccError, AssertionError):
    """An algorithm breaks the contract; the message names every failed check."""


def profiles(p: int) -> list[Links]:
    """Link profiles valid at ``p`` ranks: healthy, one straggler (not rank 0), two at
    different fractions (from p = 3), a degraded 'server' of half the ranks (from p = 4),
    and a random vector (fractions drawn in [0.3, 1), seeded by ``p``)."""
    out = [Links(), Links({p - 1: 0.5})]
    if p >= 3:
        out.append(Links({0: 0.75, p // 2: 0.4}))
    if p >= 4:
        out.append(Links({r: 0.6 for r in range(p // 2)}))
    g = np.random.default_rng([7, p])
    out.append(Links({r: float(f) for r, f in enumerate(g.uniform(0.3, 1.0, p))}))
    return out


def cost_profiles(p: int, name: str) -> tuple[list[Links], list[tuple[Links, str]]]:
    """The profiles of :func:`profiles` on which ``name``'s schedule must meet its declared
    cost, and those its registration exempts (``cost_gap``), each with the reason."""
    alg = algorithms.get(name)
    held: list[Links] = []
    exempt: list[tuple[Links, str]] = []
    for links in profiles(p):
        reason = alg.cost_gap_at(p, links)
        if reason is None:
            held.append(links)
        else:
            exempt.append((links, reason))
    return held, exempt


def verify_counts(p: int) -> tuple[int, ...]:
    """Element counts the verifier proves a schedule for at ``p`` ranks: none, fewer than
    the ranks, and an uneven split."""
    return (0, p - 1, 7 * p + 3)


def mpi_counts(p: int) -> tuple[int, ...]:
    """Element counts of the MPI check at ``p`` ranks: one element, one more than the
    ranks, a prime, and a size above the algorithms' small-message thresholds."""
    return (1, p + 1, 1009, 3 * 2**16 + 5)


# ----------------------------------------------------------------------------- outcomes


@dataclass(frozen=True)
class Outcome:
    """What one check said about one algorithm."""

    algorithm: str
    check: str
    status: Literal["passed", "failed", "skipped"]
    message: str = ""

    def __str__(self) -> str:
        tail = f": {self.message}" if self.message else ""
        return f"{self.algorithm} {self.check} {self.status}{tail}"


def _require(ok: object, message: str) -> None:
    # Not ``assert``: the contract must hold under ``python -O`` too.
    if not ok:
        raise ContractError(message)


# ----------------------------------------------------------------------------- the checks


def _check_registration(name: str, comm: MPI.Comm | None = None) -> None:
    alg = algorithms.get(name)
    _require(alg.name == name, f"listed as {name!r} but named {alg.name!r}")
    _require(isinstance(alg.summary, str) and alg.summary.strip(), "the summary is empty")
    _require("\n" not in alg.summary.strip(), "the summary is more than one line")
    _require(callable(alg.build), "the builder is not callable")
    _require(callable(alg.cost), "the cost is not callable")
    _require("itemsize" not in alg.params, "itemsize is declared as a tunable parameter")
    _require(
        isinstance(alg.auto, bool) or callable(alg.auto),
        f"auto is {alg.auto!r}, neither a bool nor a predicate",
    )
    if alg.explain is not None:
        _require(callable(alg.explain), "explain is not callable")
        for links in profiles(6):
            text = alg.explain(6, links, **alg.params)
            _require(
                isinstance(text, str) and text.strip() and "\n" not in text.strip(),
                f"explain(6, {links}) gave {text!r}, not one line of text",
            )


def _keywords(fn: Callable[..., object]) -> tuple[set[str], bool]:
    """Names ``fn`` accepts by keyword, and whether it takes any (``**kwargs``)."""
    sig = inspect.signature(fn)
    named = {
        n
        for n, prm in sig.parameters.items()
        if prm.kind in (prm.POSITIONAL_OR_KEYWORD, prm.KEYWORD_ONLY)
    }
    return named, any(prm.kind is prm.VAR_KEYWORD for prm in sig.parameters.values())


def _same_schedule(a: Schedule, b: Schedule) -> bool:
    if (a.name, a.p, a.count, a.scratch) != (b.name, b.p, b.count, b.scratch):
        return False
    cols = ("kind", "rank", "peer", "chan", "buf", "lo", "hi", "sbuf", "slo", "dep_ptr", "dep_idx")
    return all(np.array_equal(getattr(a, c), getattr(b, c)) for c in cols)


def _check_parameters(name: str, comm: MPI.Comm | None = None) -> None:
    alg = algorithms.get(name)
    takes, any_kw = _keywords(alg.build)
    missing = sorted(set(alg.params) - takes) if not any_kw else []
    _require(not missing, f"the builder does not take declared parameter(s) {missing}")
    # The cost is called as cost(p, nbytes, bw, links, latency=..., **declared): any other
    # parameter it has must have a default, or no call could give it.
    sig = inspect.signature(alg.cost)
    needed = [
        n
        for i, (n, prm) in enumerate(sig.parameters.items())
        if i >= 4
        and prm.default is prm.empty
        and prm.kind not in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD)
        and n not in alg.params
        and n != "latency"
    ]
    _require(
        not needed,
        f"the cost requires {needed}, which are not declared parameters: no call gives them",
    )
    # A small count and one of 1 MiB per rank (where message sizes and segment counts
    # come into play).
    for p, count, links in ((5, 1005, Links({1: 0.5})), (8, 2**18 + 8, profiles(8)[-1])):
        plain = algorithms.build(name, p, count, links, itemsize=4)
        spelled = algorithms.build(name, p, count, links, itemsize=4, **alg.params)
        _require(
            _same_schedule(plain, spelled),
            f"p={p} count={count} {links}: building with the declared defaults "
            f"{dict(alg.params)} gives another schedule than building without them, so the "
            "cost (given those defaults) does not describe the schedule that runs",
        )
    try:
        algorithms.build(name, 4, 100, None, bogus=1)
    except ValueError as exc:
        _require("no parameter 'bogus'" in str(exc), f"unknown parameter refused as: {exc}")
    else:
        raise ContractError("an unknown parameter 'bogus' was accepted")


def _check_cost(name: str, comm: MPI.Comm | None = None) -> None:
    alg = algorithms.get(name)
    one = alg.time(1, 2**20, 1e10)
    _require(one == 0.0, f"one rank costs {one!r} s, not 0")
    for links in profiles(6):
        t = alg.time(6, 2**26, 1e10, links)
        _require(math.isfinite(t) and t > 0, f"p=6 {links}: cost {t!r} is not a positive time")
        bound = lower_bound(6, 2**26, 1e10, links)
        _require(
            t >= bound * (1 - 1e-9),
            f"p=6 {links}: cost {t:.6g} s is below the lower bound {bound:.6g} s",
        )
        slow = alg.time(6, 2**26, 1e10, links, latency=1e-5)
        _require(slow >= t, f"p=6 {links}: {slow:.6g} s with latency, {t:.6g} s without")


def _check_eligibility(name: str, comm: MPI.Comm | None = None) -> None:
    alg = algorithms.get(name)
    for p in (1, 2, 3, 5, 8, 17):
        for links in profiles(p):
            for nbytes in (0, 4, 2**10, 2**16, 2**20, 2**26):
                first = alg.auto(p, nbytes, links) if callable(alg.auto) else alg.auto
                _require(
                    isinstance(first, (bool, np.bool_)),
                    f"auto({p}, {nbytes}, {links}) gave {first!r}, not a bool",
                )
                again = alg.eligible(p, nbytes, links)
                _require(
                    again == bool(first),
                    f"auto({p}, {nbytes}, {links}) changed its answer between calls",
                )


def _check_verifies(name: str, comm: MPI.Comm | None = None) -> None:
    for p in VERIFY_RANKS:
        for links in profiles(p):
            for count in verify_counts(p):
                sched = algorithms.build(name, p, count, links, itemsize=4)
                _require(
                    (sched.p, sched.count) == (p, count),
                    f"p={p} count={count}: the schedule is for p={sched.p} count={sched.count}",
                )
                report = verify(sched, raise_on_error=False)
                _require(report.ok, f"p={p} {links} count={count}: {report.errors[:3]}")


def _check_simulated_cost(name: str, comm: MPI.Comm | None = None) -> None:
    alg = algorithms.get(name)
    for p in COST_RANKS:
        held, _ = cost_profiles(p, name)
        for links in held:
            sched = algorithms.build(name, p, COST_BYTES // 4, links, itemsize=4)
            sim = simulate(sched, links, bw=COST_BW, latency=0.0).time
            cost = alg.time(p, COST_BYTES, COST_BW, links)
            _require(
                abs(sim - cost) <= max(COST_TOLERANCE * abs(cost), 1e-12),
                f"p={p} {links}: simulated {sim:.4g} s, declared cost {cost:.4g} s "
                f"(more than {COST_TOLERANCE:.0%} apart)",
            )


def _contributions(p: int, n: int, seed: int) -> list[np.ndarray]:
    return [np.random.default_rng([seed, r, n]).standard_normal(n) for r in range(p)]


def _check_mpi_reference(name: str, comm: MPI.Comm | None) -> None:
    assert comm is not None  # needs_comm: check_algorithm gives one
    rank, p = comm.Get_rank(), comm.Get_size()
    failures: list[str] = []
    for links in profiles(p):
        for n in mpi_counts(p):
            xs = _contributions(p, n, seed=n)
            ref = np.sum(np.array(xs, dtype=np.longdouble), axis=0)
            magnitude = np.sum(np.abs(np.array(xs)), axis=0)
            for dtype in MPI_DTYPES:
                out = allreduce(xs[rank].astype(dtype), algorithm=name, links=links, comm=comm)
                where = f"{links} n={n} {np.dtype(dtype).name}"
                if out.shape != (n,) or out.dtype != dtype:
                    failures.append(f"rank {rank}, {where}: result {out.shape} {out.dtype}")
                    out = np.zeros(n, dtype)  # still take part in the digest below
                eps = np.finfo(dtype).eps
                bound = (p + 1) * eps * magnitude + eps * np.abs(ref)
                err = np.abs(out.astype(np.longdouble) - ref)
                if not np.all(err <= bound):
                    worst = int(np.argmax(err - bound))
                    failures.append(
                        f"rank {rank}, {where}: element {worst} is {float(err[worst]):.3g} "
                        f"from the reference, beyond the summation bound "
                        f"{float(bound[worst]):.3g}"
                    )
                digests = comm.allgather(zlib.crc32(out.tobytes()))
                if rank == 0 and len(set(digests)) != 1:
                    failures.append(f"{where}: the ranks' results differ")
    # Every rank raises the same error (or none): a failure on one rank only must not
    # leave the others in the next collective.
    every = [m for mine in comm.allgather(failures) for m in mine]
    if every:
        more = f" (and {len(every) - 5} more)" if len(every) > 5 else ""
        raise ContractError("; ".join(every[:5]) + more)
    _require(math.isfinite(float(comm.allreduce(1.0))), "the communicator is broken afterwards")


@dataclass(frozen=True)
class Check:
    """One check of the contract (see the module docstring for each)."""

    name: str
    run: Callable[[str, MPI.Comm | None], None]
    needs_comm: bool = False

    def __str__(self) -> str:
        return self.name


#: The checks, by name, in the order :func:`check_algorithm` runs them.
CHECKS: dict[str, Check] = {
    c.name: c
    for c in (
        Check("registration", _check_registration),
        Check("parameters", _check_parameters),
        Check("cost", _check_cost),
        Check("eligibility", _check_eligibility),
        Check("verifies", _check_verifies),
        Check("simulated_cost", _check_simulated_cost),
        Check("mpi_reference", _check_mpi_reference, needs_comm=True),
    )
}


def select_checks(checks: Iterable[str] | str | None = None) -> list[Check]:
    """The checks named (all of :data:`CHECKS` for None), in the order given; ValueError
    naming the choices for a name that is not a check."""
    if checks is None:
        return list(CHECKS.values())
    wanted = [checks] if isinstance(checks, str) else list(checks)
    unknown = [c for c in wanted if c not in CHECKS]
    if unknown:
        raise ArgumentError(
            f"unknown check(s) {', '.join(map(repr, unknown))}; choose from {', '.join(CHECKS)}"
        )
    return [CHECKS[c] for c in wanted]


def check_algorithm(
    name: str,
    *,
    comm: MPI.Comm | None = None,
    checks: Iterable[str] | str | None = None,
    raise_on_failure: bool = True,
) -> list[Outcome]:
    """Run the contract on the registered algorithm ``name``.

    Parameters
    ----------
    name : str
        A registered algorithm (:func:`optcc_mpi.algorithms.names`), including those other
        packages register through the entry-point group ``optcc_mpi.algorithms``.
    comm : mpi4py communicator, optional
        Where ``mpi_reference`` runs; it is skipped without one or with one of a single
        rank. With a communicator every rank must call this with the same arguments (the
        check is collective), e.g. under ``mpiexec -n 3``.
    checks : str or iterable of str, optional
        Names of the checks to run (:data:`CHECKS`); all of them by default.
    raise_on_failure : bool
        Raise :class:`ContractError` naming every failed check (after running them all);
        with False, only return the outcomes.

    Returns
    -------
    list of Outcome
        One per check, in order: passed, failed (with the message) or skipped (why).

    Raises
    ------
    optcc_mpi.errors.ArgumentError
        ``name`` is not registered (before any check runs).
    ValueError
        A name in ``checks`` is not a check.
    ContractError
        With ``raise_on_failure``, when a check failed.

    Examples
    --------
    >>> from optcc_mpi.testing import check_algorithm
    >>> [o.status for o in check_algorithm("ring", checks=["registration", "cost"])]
    ['passed', 'passed']
    """
    algorithms.get(name)  # an unknown name fails here, naming the choices
    selected = select_checks(checks)
    size = comm.Get_size() if comm is not None else 1
    outcomes: list[Outcome] = []
    for check in selected:
        if check.needs_comm and size < 2:
            why = "needs a communicator of more than one rank (comm=...)"
            outcomes.append(Outcome(name, check.name, "skipped", why))
            continue
        try:
            check.run(name, comm if check.needs_comm else None)
        except AssertionError as exc:
            outcomes.append(Outcome(name, check.name, "failed", str(exc)))
        except Exception as exc:  # an algorithm that raises breaks the contract too
            outcomes.append(Outcome(name, check.name, "failed", f"{type(exc).__name__}: {exc}"))
        else:
            outcomes.append(Outcome(name, check.name, "passed"))
    failed = [o for o in outcomes if o.status == "failed"]
    if failed and raise_on_failure:
        raise ContractError(
            f"algorithm {name!r} breaks the contract:\n" + "\n".join(f"  {o}" for o in failed)
        )
    return outcomes
