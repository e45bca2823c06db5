"""Closed-form times of the algorithms and the lower bound, in the fluid model.

Conventions: ``p`` ranks, ``n`` bytes per rank, healthy NIC rate ``B`` bytes/s per
direction, per-rank bandwidth fractions ``f_r`` in (0, 1] (a :class:`Links`). All times
are bandwidth-only (no per-message latency) unless a function says otherwise; the
fault-free optimum is ``T_ff = 2(p-1)/p * n/B``.

Lower bound (derived, ours; see ``docs/model.md``)
--------------------------------------------------
1. *Cut bound*: every rank must receive n bytes (its output depends on the others'
   inputs, which are independent of its own) and send n bytes (the others' outputs
   reveal its input), so ``T >= n / (B * min_r f_r)``.
2. *Capacity bound*: in the combining model every element needs at least 2(p-1)
   point-to-point transfers (a reduction tree and a broadcast tree over p ranks), and
   the ranks together send at most ``B * sum_r f_r`` bytes/s, so
   ``T >= 2(p-1) n / (B * sum_r f_r)``.

With one rank at ``f = 1/l`` this gives ``T* = n/B * max(l, 2(p-1) l / ((p-1) l + 1))``.

OptCC's fluid time (derived, ours)
----------------------------------
A *scheme* attaches the j slowest ranks (stragglers) to a ring of the others: the healthy
ring reduce-scatters and all-gathers, and each straggler exchanges each section once in
each direction with a healthy rank. Per unit of data a straggler moves 1 unit each way and
a healthy rank ``(2(h-1) + j) / h`` with ``h = p - j`` (j = 0 is the plain ring). Running
several schemes side by side on disjoint parts of the buffer, the best split is the
linear program

    minimise T  subject to  sum_j x_j = 1,  x_j >= 0,
                            sum_j x_j * load_j(r) <= T * f_r   for every rank r.

With one straggler it mixes the ring (x_0) and the four-stage schedule (x_1) exactly as
the bubble-filling split ``alpha(p, l)`` and meets the lower bound for every l; with
several degraded ranks or any vector of bandwidths it is our generalisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from optcc_mpi.links import Links

__all__ = [
    "fault_free",
    "lower_bound",
    "ring_time",
    "r2ccl_time",
    "OptccPlan",
    "optcc_plan",
    "optcc_time",
    "plan_time",
    "scheme_loads",
    "FILL_GAIN",
    "bubble_fraction",
    "l_star",
    "native_time",
    "times",
    "table",
]


def _fractions(links: Links | str | None, p: int) -> np.ndarray:
    return (Links.coerce(links) if links is not None else Links()).vector(p)


def fault_free(p: int, nbytes: float, bw: float) -> float:
    """``2(p-1)/p * n / B``: the healthy ring, optimal without faults."""
    return 2.0 * (p - 1) / p * nbytes / bw if p > 1 else 0.0


def lower_bound(p: int, nbytes: float, bw: float, links: Links | str | None = None) -> float:
    """Lower bound on AllReduce time under per-rank bandwidths (module docstring)."""
    if p < 2:
        return 0.0
    f = _fractions(links, p)
    return nbytes / bw * max(1.0 / f.min(), 2.0 * (p - 1) / f.sum())


def l_star(p: int) -> float:
    """``(2p-3)/(p-1)``: slowdown beyond which the pure four-stage schedule is optimal."""
    return (2 * p - 3) / (p - 1)


def bubble_fraction(p: int, l: float) -> float:
    """Share of the data sent through the full ring, one straggler at rate B/l (derived).

    ``alpha = p[(2p-3) - l(p-1)] / [(p-2)(l(p-1) + 1)]`` for ``1 <= l <= l*``; 0 beyond
    ``l*`` (pure four-stage) and 1 at ``l = 1`` (pure ring).
    """
    if p < 3 or l >= l_star(p):
        return 0.0
    return p * ((2 * p - 3) - l * (p - 1)) / ((p - 2) * (l * (p - 1) + 1))


def ring_time(p: int, nbytes: float, bw: float, links: Links | str | None = None) -> float:
    """The ring, held back at every step by the slowest NIC: ``T_ff / min_r f_r``."""
    if p < 2:
        return 0.0
    return fault_free(p, nbytes, bw) / _fractions(links, p).min()


def native_time(
    p: int, nbytes: float, bw: float, links: Links | str | None = None, *, latency: float = 0.0
) -> float:
    """A bandwidth-optimal library AllReduce held back by the slowest NIC, plus
    ``2 log2 p`` latencies (Rabenseifner's algorithm, MPICH's choice for large messages)."""
    if p < 2:
        return 0.0
    return ring_time(p, nbytes, bw, links) + 2 * math.ceil(math.log2(p)) * latency


def r2ccl_time(
    p: int,
    nbytes: float,
    bw: float,
    links: Links | str | None = None,
    *,
    chunks: int | None = None,
) -> float:
    """R2CCL-AllReduce under its own cost model (from R2CCL's code).

    ``T = max(T1, T2) + T3`` with ``Y = X`` (tail share = bandwidth lost at the worst
    rank): T1 the main AllReduce of ``(1-Y) n`` held back by the degraded rank, T2 the
    healthy-only AllReduce of ``Y n`` on spare bandwidth, T3 the tail crossing the
    degraded link once, ``(1 + 1/K) Y n / ((1-X) B)`` with K pipeline chunks
    (``chunks=None``: K -> infinity). With several degraded ranks X is the largest loss.
    """
    if p < 2:
        return 0.0
    f = _fractions(links, p)
    fmin = float(f.min())
    x = 1.0 - fmin
    if x <= 0.0:
        return fault_free(p, nbytes, bw)
    y = x
    m = int(np.sum(f < 1.0))
    h = p - m
    t1 = 2.0 * (p - 1) / p * (1 - y) * nbytes / (fmin * bw)
    t2 = 2.0 * (h - 1) / h * y * nbytes / (x * bw) if h > 1 else 0.0
    k_term = 1.0 if chunks is None else 1.0 + 1.0 / chunks
    t3 = k_term * y * nbytes / (fmin * bw)
    return max(t1, t2) + t3


@dataclass(frozen=True)
class OptccPlan:
    """How OptCC splits the buffer over schemes (see the module docstring).

    Attributes
    ----------
    schemes : tuple of (tuple of int, float)
        (straggler ranks, share of the data) for each scheme in use; an empty straggler
        tuple is the full ring over all ranks.
    time : float
        Fluid time in units of n/B.
    """

    schemes: tuple[tuple[tuple[int, ...], float], ...]
    time: float

    @property
    def stragglers(self) -> tuple[int, ...]:
        """Every rank that is a straggler in some scheme."""
        return tuple(sorted({r for d, _ in self.schemes for r in d}))


#: ``fill="auto"`` runs the bubble-filling split only when it beats attaching every
#: degraded rank by more than this in the fluid model: the plain-ring share competes with
#: the attached scheme for the degraded links, which costs our schedules 3 to 9% in the
#: simulator, so smaller gains are not worth it (docs/optcc.md).
FILL_GAIN = 0.03


def scheme_loads(p: int, stragglers: tuple[int, ...]) -> np.ndarray:
    """Per-rank traffic of one scheme, per unit of data and direction: 1 for an attached
    rank, ``(2(h-1) + j)/h`` for the ``h`` ring members when ``j`` ranks are attached."""
    j = len(stragglers)
    h = p - j
    loads = np.full(p, (2.0 * (h - 1) + j) / h if h else 0.0)
    loads[list(stragglers)] = 1.0
    return loads


def plan_time(p: int, links: Links | str | None, schemes: tuple) -> float:
    """Fluid time (units of n/B) of running ``schemes`` ((stragglers, share) pairs) side
    by side: the busiest rank's traffic over its bandwidth."""
    if p < 2:
        return 0.0
    f = _fractions(links, p)
    total = sum(x * scheme_loads(p, tuple(d)) for d, x in schemes)
    return float(np.max(total / f))


def optcc_plan(p: int, links: Links | str | None = None, *, fill: bool | str = True) -> OptccPlan:
    """How OptCC splits the data over straggler schemes.

    ``fill=True``: the best fluid split, by linear programming (bubble filling included);
    ``fill=False``: every degraded rank attached to the ring of the others, for all of the
    data; ``fill="auto"``: the first unless it gains less than ``FILL_GAIN`` over the second.
    """
    f = _fractions(links, p)
    best = _plan(p, tuple(f.round(12).tolist()))
    if fill is True or p < 2:
        return best
    slow = tuple(int(r) for r in np.flatnonzero(f < f.max()))
    if not slow:
        return best
    attach = ((slow, 1.0),)
    plain = OptccPlan(attach, plan_time(p, links, attach))
    if fill is False or plain.time <= best.time * (1 + FILL_GAIN):
        return plain
    return best


@lru_cache(maxsize=256)
def _plan(p: int, f_tuple: tuple[float, ...]) -> OptccPlan:
    if p < 2:
        return OptccPlan((((), 1.0),), 0.0)
    f = np.asarray(f_tuple)
    order = np.argsort(f, kind="stable")
    n_slow = int(np.sum(f < f.max()))
    if n_slow == 0:
        return OptccPlan((((), 1.0),), 2.0 * (p - 1) / p / f.max())
    # Scheme j attaches the j slowest ranks; j = 0 is the ring over all ranks. Attaching a
    # rank as fast as the fastest never helps, so j stops at the number of slower ranks.
    J = min(n_slow, p - 1) + 1
    loads = np.empty((J, p))
    for j in range(J):
        h = p - j
        loads[j] = (2.0 * (h - 1) + j) / h
        loads[j, order[:j]] = 1.0
    from scipy.optimize import linprog

    # Variables x_0..x_{J-1}, T. Minimise T.
    c = np.zeros(J + 1)
    c[-1] = 1.0
    a_ub = np.hstack([loads.T, -f[:, None]])
    a_eq = np.zeros((1, J + 1))
    a_eq[0, :J] = 1.0
    res = linprog(
        c,
        A_ub=a_ub,
        b_ub=np.zeros(p),
        A_eq=a_eq,
        b_eq=[1.0],
        bounds=[(0, None)] * (J + 1),
        method="highs",
    )
    if not res.success:  # pragma: no cover - the LP is always feasible and bounded
        raise RuntimeError(f"OptCC plan: linear program failed: {res.message}")
    x = np.where(res.x[:J] < 1e-9, 0.0, res.x[:J])
    x /= x.sum()
    schemes = tuple(
        (tuple(sorted(int(r) for r in order[:j])), float(x[j])) for j in range(J) if x[j] > 0
    )
    return OptccPlan(schemes, float(res.x[-1]))


def optcc_time(
    p: int,
    nbytes: float,
    bw: float,
    links: Links | str | None = None,
    *,
    k: int | None = None,
    fill: bool | str = True,
) -> float:
    """OptCC's fluid time (the best split unless ``fill`` says otherwise, see
    :func:`optcc_plan`); with ``k`` segments, one segment's worth of pipeline head and
    tail added, ``(1 + 1/k)`` times the fluid time (derived)."""
    if p < 2:
        return 0.0
    t = optcc_plan(p, links, fill=fill).time * nbytes / bw
    return t if k is None else t * (1.0 + 1.0 / k)


def times(p: int, nbytes: float, bw: float, links: Links | str | None = None) -> dict[str, float]:
    """Fluid times of ring, r2ccl and optcc, with the fault-free optimum and the bound."""
    return {
        "fault_free": fault_free(p, nbytes, bw),
        "bound": lower_bound(p, nbytes, bw, links),
        "ring": ring_time(p, nbytes, bw, links),
        "r2ccl": r2ccl_time(p, nbytes, bw, links),
        "optcc": optcc_time(p, nbytes, bw, links),
    }


def table(p: int, nbytes: float, bw: float, links: Links | str | None = None) -> dict:
    """The ``optcc-mpi model`` result as one JSON-ready dictionary."""
    t = times(p, nbytes, bw, links)
    ff, bound = t["fault_free"], t["bound"]
    algs = {}
    for name in ("ring", "r2ccl", "optcc"):
        algs[name] = {
            "time_s": t[name],
            "ratio_fault_free": t[name] / ff if ff else 1.0,
            "ratio_bound": t[name] / bound if bound else 1.0,
        }
    return {
        "p": p,
        "size": int(nbytes),
        "bw": bw,
        "links": str(Links.coerce(links) if links is not None else Links()),
        "fault_free_s": ff,
        "bound_s": bound,
        "bound_ratio_fault_free": bound / ff if ff else 1.0,
        "algorithms": algs,
    }
