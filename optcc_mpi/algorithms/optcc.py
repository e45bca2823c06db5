"""OptCC: AllReduce that keeps degraded ranks off the critical path.

The four stages (after the OptCC paper; the details below are our reading, see
``docs/optcc.md``): the healthy ranks reduce-scatter and all-gather among themselves; each
*straggler* exchanges each data section once in each direction with the healthy rank that
owns it, instead of carrying ~2n bytes each way as a ring member.

The plan: who owns how much (derived, ours)
-------------------------------------------
Every rank r *owns* a share ``w_r`` of each segment of the buffer (``sum_r w_r = 1``); the
owners reduce-scatter the segment, each ending with the complete sum of its share, and
all-gather it back. A rank that owns nothing is an *attached* rank (a straggler): it
sends its raw input of every section to the section's owner and receives the result
back, one unit of traffic each way. Per unit of data, in each direction, rank r moves

    L_r = 1 + (p - 2) w_r                                              (derived, ours)

bytes (it sends everything it does not own and every other rank's copy of what it does
own), and ``sum_r L_r = 2(p-1)``: the combining minimum. Choosing ``L_r = T f_r`` with T
the lower bound is therefore always possible (every ``T f_r >= 1`` because T is at least
the cut bound, and ``sum_r T f_r >= 2(p-1)`` because T is at least the capacity bound),
so the plan's fluid time *is* the lower bound for every bandwidth vector. Where
``sum_r T f_r`` exceeds ``2(p-1)`` the loads are water-filled, ``L_r = min(T f_r, lam)``,
which gives the fastest ranks equal shares; ranks with ``T f_r = 1`` (the cut bound's
straggler) own nothing and are attached.

With one straggler at rate ``1/l`` this is the four-stage schedule for ``l >= l*`` (the
straggler owns nothing) and, below ``l*``, gives the straggler the share ``alpha/p`` where
the notes' bubble-filling split would send ``alpha`` of the data through a full ring: the
same per-rank loads in one schedule instead of two competing ones.

The schedule
------------
The owners form a grid of ``a`` rows and ``b`` columns; owners of one column have equal
shares (so a column is a plain ring), columns may differ (so a row is a *weighted direct*
exchange). Per segment:

* **S1** reduce-scatter: along each row, every owner sends each other column's block to
  that column's owner (received into scratch and added in a fixed order, so results are
  bit-reproducible); then along each column, a ring reduce-scatter of the column's block;
* **S2/S3** an attached rank either *folds* (sends its raw section to the owner, which
  adds it; ordering 2 of the notes) or *closes* (the owner sends it the partial sum, it
  adds its input and returns the global sum; ordering 1);
* **S4** all-gather: along each column (ring), then along each row (each owner sends its
  block to every other column); owners return the finished sections to folding ranks.

With every share equal and ``b = 1`` this is the paper's healthy ring; ``a = 1`` is a
direct all-to-all; large groups use both (``a x b`` about ``sqrt(h)`` each) so that a
segment costs ``O(h sqrt h)`` operations instead of ``O(h^2)``.

Segments are pipelined: an owner starts segment L's reduce-scatter only when it holds
the result of segment ``L - depth``, and an attached rank sends segment L's raw input only
when it received the results of segment ``L - lag``: every stage advances at the pace of
the slowest, so no stage runs ahead and crowds the others out of a shared NIC.

This module holds the plan and the sizes (shares, the owners' grid, segments) and
registers the algorithm; :mod:`optcc_mpi.algorithms._optcc_pipeline` builds the stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from optcc_mpi.algorithms import register
from optcc_mpi.algorithms._optcc_pipeline import Pipeline
from optcc_mpi.algorithms._policy import MAX_AUTO_OPS, Fabric, fabric_of, large_messages
from optcc_mpi.errors import ArgumentError, PlanError
from optcc_mpi.links import Links
from optcc_mpi.model import fractions, lower_bound
from optcc_mpi.schedule import (
    BYTES_PER_OP,
    Params,
    Schedule,
    ScheduleBuilder,
    check_size,
    memory_available,
)

__all__ = [
    "optcc",
    "optcc_time",
    "optcc_plan",
    "OptccPlan",
    "l_star",
    "explain_plan",
    "segment_bounds",
    "auto_ramp",
    "PATTERNS",
]

PATTERNS = ("auto", "fold", "closer")

#: Smallest message (one section of one segment) worth cutting a segment into, on a
#: fabric without per-message costs (the simulator's; the builder's default).
SECTION_BYTES = 16 * 1024
#: Smallest section on any fabric, whatever its model says.
SECTION_MIN = 1024


def section_floor(fabric: str | Fabric | None) -> int:
    """Smallest section of a segment over ``fabric``: :data:`SECTION_BYTES` without one
    (the simulator's fabric, where a message costs only its bytes); over a fabric that
    overlaps, the bytes the fixed costs of one message at both its ends could have moved
    (``2 * message_cost * rate``, at least :data:`SECTION_MIN`), below which the CPU's
    work per message outruns the wire; without overlap (shared memory, where MPI copies
    with the CPU) a whole section per segment, so the fewest segments.

    The network default (:data:`~optcc_mpi.algorithms._policy.NETWORK`) gives 97.7 KiB.
    On the testbed (8 ranks at 400 Mbit/s on 2 cores, rank 0 at half rate) OptCC took
    2.4x the bound at 16 MiB with 19 KiB sections (128 segments), 1.16-1.25x with 75 to
    300 KiB (8 to 32 segments), and at 32 MiB 1.09x with 150 KiB against 1.15x with
    75 KiB (docs/testbed.md section 1.6d, ``testbed/ksweep-p8.jsonl``). The floor was
    rounded up to a power of two (128 KiB) until a sweep with the ramp held to
    :data:`RAMP_MAX_NETWORK` found 24, 47 and 95 segments 0.5-1.5% faster than 18, 36
    and 72 at 16, 32 and 64 MiB (docs/testbed.md 1.6f).
    """
    if fabric is None:
        return SECTION_BYTES
    fab = fabric_of(fabric)
    if not fab.overlap:
        return 1 << 62
    # (No minimum of SECTION_BYTES here: on slow links whose rate is told the model's
    # own floor is the right one, 4 KB at 50 Mbit/s with 8 ranks per core, where 128
    # segments of 4.4 KiB sections came within 1.03x of the bound and 34 of 16 KiB took
    # 1.23x; docs/testbed.md 1.6j. The fabric's own section_min holds: a watched call's.)
    return int(np.ceil(max(float(SECTION_MIN), 2 * fab.message_cost * fab.rate, fab.section_min)))


#: How much above the bound the plan may go to attach ranks that would own almost
#: nothing (see :func:`optcc_plan`): attached, they wait for the owners' reduce-scatter
#: only, where as owners of a sliver they also wait for the all-gather.
ATTACH_TOL = 1e-3

#: A share below this fraction of the largest is "tiny" (see :func:`optcc_plan`).
TINY_SHARE = 0.05

#: Owners up to which the grid is a single row (a direct exchange among all owners).
DIRECT_OWNERS = 128

#: Beyond DIRECT_OWNERS, how much above the bound a plan that suits the owners' grid may
#: go (see ``_grid_plan``).
GRID_TOL = 0.02

#: The pipeline's ends with owners of equal shares, in segments (see ``_grid_plan``).
GRID_C0 = 0.1


# ----------------------------------------------------------------------------- the plan


def l_star(p: int) -> float:
    """``(2p-3)/(p-1)``: slowdown beyond which the pure four-stage schedule is optimal."""
    return (2 * p - 3) / (p - 1)


@dataclass(frozen=True)
class OptccPlan:
    """Who owns how much of each segment (see the module docstring).

    Attributes
    ----------
    weights : tuple of float
        Per rank, the share of every segment it owns (they sum to 1); 0 for an attached
        rank.
    time : float
        Fluid time in units of n/B: the lower bound, or at most :data:`ATTACH_TOL`
        above it where ranks with tiny shares are attached instead (at most
        :data:`GRID_TOL` beyond :data:`DIRECT_OWNERS` owners, see ``_grid_plan``).
    """

    weights: tuple[float, ...]
    time: float

    @property
    def p(self) -> int:
        return len(self.weights)

    @property
    def attached(self) -> tuple[int, ...]:
        """Ranks that own nothing: they exchange every section once each way."""
        return tuple(r for r, w in enumerate(self.weights) if w == 0.0)

    @property
    def stragglers(self) -> tuple[int, ...]:
        """Alias of :attr:`attached` (the paper's word for them)."""
        return self.attached

    @property
    def owners(self) -> tuple[int, ...]:
        return tuple(r for r, w in enumerate(self.weights) if w > 0.0)

    def loads(self) -> np.ndarray:
        """Per rank, bytes moved each way per byte of the buffer: ``1 + (p-2) w``."""
        p = self.p
        w = np.asarray(self.weights)
        if p < 2:
            return np.zeros(p)
        return 1.0 + (p - 2) * w if p > 2 else np.ones(p)


def optcc_plan(p: int, links: Links | str | None = None) -> OptccPlan:
    """OptCC's plan for ``p`` ranks under ``links``: shares whose loads meet the bound.

    Ranks whose share would be below :data:`TINY_SHARE` of the largest are attached
    instead when that costs at most :data:`ATTACH_TOL` of the time; beyond
    :data:`DIRECT_OWNERS` owners the plan is one that suits the owners' grid, at most
    :data:`GRID_TOL` above the bound (see ``_grid_plan``).
    """
    f = fractions(links, p)
    # Rounded to 12 significant digits (not decimals: 1e-13 must not become 0) so that
    # profiles equal up to rounding share a cache entry.
    return _optcc_plan_cached(p, tuple(float(f"{x:.12g}") for x in f.tolist()))


@lru_cache(maxsize=256)
def _optcc_plan_cached(p: int, f_tuple: tuple[float, ...]) -> OptccPlan:
    if p < 2:
        return OptccPlan((1.0,) * p, 0.0)
    f = np.asarray(f_tuple)
    # The bound in units of n/B, with f as given (not normalised: the fastest rank may be
    # below the healthy rate B).
    t = t0 = lower_bound(p, 1.0, 1.0, Links({r: float(v) for r, v in enumerate(f)}))
    if p == 2:
        return OptccPlan((0.5, 0.5), t)
    none = np.zeros(p, dtype=bool)
    w = _shares(f, t, none)

    def attach_time(att: np.ndarray) -> float:
        return max(t, (2.0 * (p - 1) - att.sum()) / f[~att].sum())

    # Ranks left with a tiny share are attached instead when that costs at most
    # ATTACH_TOL of the time: an attached rank's receives need only the owners' reduce-
    # scatter, an owner's also its all-gather, so a slow owner idles longer at the start
    # (simulated, p = 1024 with 8 ranks at half rate, each owning 0.0003%: 11% above the
    # bound as owners).
    attached = (w <= TINY_SHARE * w.max()) & (w < w.max())
    if attached.any() and attach_time(attached) > t * (1.0 + ATTACH_TOL):
        attached = w == 0.0
    if (~attached).sum() > DIRECT_OWNERS:
        # More owners than a direct exchange handles: they form a grid, whose columns
        # need equal shares; choose among plans that suit a grid (see _grid_plan).
        w, t = _grid_plan(f, t0, attached)
    elif attached.any():
        t = attach_time(attached)
        w = _shares(f, t, attached)
    if w.sum() <= 0:  # pragma: no cover - sum of loads is 2(p-1) > p
        raise PlanError(f"OptCC plan: no rank can own anything under {f_tuple}")
    w = w / w.sum()
    # Equal shares should be exactly equal (the grid groups owners by share).
    w = np.round(w, 12)
    w = w / w.sum()
    return OptccPlan(tuple(float(x) for x in w), float(t))


def _grid_plan(f: np.ndarray, bound: float, base: np.ndarray) -> tuple[np.ndarray, float]:
    """Shares and fluid time for more owners than a direct exchange handles.

    The owners then form a grid whose columns need equal shares (``_grid_shape``), so a
    plan whose shares come in many levels, or in levels whose counts have no common
    divisor, can only be realised as one long row: few segments fit the operation budget
    and the pipeline's head and tail cost up to 15% (p = 1024, one rank at 0.625: one row
    of 1024 owners, k = 2). Candidates, each within :data:`GRID_TOL` of the bound
    (derived, ours):

    * the water-filled plan with ``base`` attached;
    * every owner below the top share attached as well (a slow owner idles at the
      pipeline's ends; attached, it only sends and receives each section once);
    * either of these with up to 8 of the fastest owners attached too, for an owner
      count with a squarer grid (1016 owners form an 8 x 127 grid, 1015 a 29 x 35 one);
    * owners sorted by rate in groups of ``a`` (a divisor of their number), each group
      held to its slowest member's rate, so that every share level fills whole columns
      of an ``a``-row grid.

    The winner minimises ``time * (1 + (GRID_C0 + 1 - w_min / w_max) / k)``, ``k`` the
    segments the operation budget allows: the fluid time with the pipeline's ends
    charged, more where owners' shares differ (fitted to simulated runs at p = 256 to
    1024: owners of unequal shares cost up to about ``(1 - w_min/w_max) / k`` above the
    fluid time, equal ones about a tenth of ``1/k``).
    """
    p = f.size

    def fluid(att: np.ndarray, rate: np.ndarray) -> float:
        return max(bound, (2.0 * (p - 1) - att.sum()) / rate[~att].sum())

    def score(rate: np.ndarray, t: float, att: np.ndarray) -> tuple[float, np.ndarray]:
        w = _shares(rate, t, att)
        k = max(1, min(128, MAX_AUTO_OPS // max(_grid_cost(w), 1)))
        own = w[w > 0]
        return t * (1.0 + (GRID_C0 + 1.0 - own.min() / own.max()) / k), w

    w0 = _shares(f, fluid(base, f), base)
    slow = ~base & (w0 < w0.max() * (1 - 1e-9))
    bases = [base] + ([base | slow] if slow.any() else [])
    best: tuple[float, np.ndarray, float] | None = None
    for att0 in bases:
        # The fastest owners, last rank first among equals, are the ones attached for a
        # better factorisation.
        own = np.flatnonzero(~att0)
        fast = own[np.lexsort((-own, -f[own]))]
        for e in range(min(9, own.size - 2)):
            att = att0.copy()
            att[fast[:e]] = True
            t = fluid(att, f)
            if t > bound * (1.0 + GRID_TOL):
                break
            tries = [(f, t)]
            h = own.size - e
            order = np.flatnonzero(~att)
            order = order[np.argsort(f[order], kind="stable")]
            for a in range(2, int(np.sqrt(h)) + 1):
                if h % a:
                    continue
                # Each group of a consecutive owners (by rate) at its slowest's rate.
                grouped = f.copy()
                grouped[order] = np.repeat(f[order].reshape(h // a, a)[:, 0], a)
                tq = fluid(att, grouped)
                if tq <= bound * (1.0 + GRID_TOL):
                    tries.append((grouped, tq))
            for rate, tt in tries:
                s, w = score(rate, tt, att)
                if best is None or s < best[0] * (1 - 1e-12):
                    best = (s, w, tt)
    assert best is not None
    return best[1], best[2]


def _shares(f: np.ndarray, t: float, attached: np.ndarray) -> np.ndarray:
    """Shares ``w = (L - 1)/(p - 2)`` whose loads ``L`` fit ``t f`` and sum to the
    combining minimum ``2(p-1)``, attached ranks at ``L = 1``: water-filled,
    ``L_r = min(t f_r, lam)``, so the fastest ranks get equal shares."""
    p = f.size
    cap = np.where(attached, 1.0, t * f)  # the most each rank can move in time t
    need = 2.0 * (p - 1) - attached.sum()
    owners = cap[~attached]
    c = np.sort(owners)
    below = np.concatenate(([0.0], np.cumsum(c)))  # sum of the i smallest caps
    lam = c[-1]
    for i in range(c.size):
        # lam within [c[i-1], c[i]]: the i smallest are capped, the rest at lam.
        level = (need - below[i]) / (c.size - i)
        if level <= c[i] + 1e-12:
            lam = max(level, c[i - 1] if i else 1.0)
            break
    loads = np.where(attached, 1.0, np.minimum(cap, lam))
    w = (loads - 1.0) / (p - 2)
    w[w < 1e-9] = 0.0
    return w


def optcc_time(
    p: int,
    nbytes: float,
    bw: float,
    links: Links | str | None = None,
    *,
    latency: float = 0.0,
    k: int | None = None,
) -> float:
    """OptCC's fluid time, the plan's: the lower bound, or at most :data:`ATTACH_TOL`
    above it (:data:`GRID_TOL` beyond :data:`DIRECT_OWNERS` owners; see
    :func:`optcc_plan`); with ``k`` equal segments, one segment's worth of pipeline head
    and tail added, ``(1 + 1/k)`` times it (derived); plus one latency per step of a
    segment's critical path."""
    if p < 2:
        return 0.0
    plan = optcc_plan(p, links)
    t = plan.time * nbytes / bw
    t = t if k is None else t * (1.0 + 1.0 / k)
    a, _ = _grid_shape(plan, "auto")
    steps = 2 * (a - 1) + 2 + (2 if plan.attached else 0)
    return t + steps * latency


def explain_plan(p: int, links: Links | str | None = None, **_: object) -> str:
    """The plan in words: attached ranks, and the share each owner holds."""
    plan = optcc_plan(p, links)
    att = plan.attached
    levels: dict[float, list[int]] = {}
    for r in plan.owners:
        levels.setdefault(round(plan.weights[r], 9), []).append(r)
    parts = []
    if att:
        parts.append(f"ranks {_rank_runs(att)} attached (own nothing)")
    for w, ranks in sorted(levels.items()):
        parts.append(f"{len(ranks)} rank(s) {_rank_runs(ranks)} own {w:.4%} each")
    a, b = _grid_shape(plan, "auto")
    parts.append(f"owners in a {a} x {b} grid")
    return "; ".join(parts)


def _rank_runs(ranks: tuple[int, ...] | list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    rs = sorted(ranks)
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


# ----------------------------------------------------------------------------- the grid


def _grid_shape(plan: OptccPlan, grid: int | str) -> tuple[int, int]:
    """Rows ``a`` and columns ``b`` of the owners' grid.

    A column's owners must have equal shares, so ``a`` divides the number of owners at
    every share level. ``auto`` is one row (a direct exchange among all owners) up to
    :data:`DIRECT_OWNERS` owners, and beyond that the allowed ``a`` that minimises the
    operations of a segment (``a`` near the square root of the owners).
    """
    owners = plan.owners
    h = len(owners)
    if h == 0:
        return 1, 0
    counts = np.unique(np.round([plan.weights[r] for r in owners], 9), return_counts=True)[1]
    g = int(np.gcd.reduce(counts))
    allowed = [a for a in range(1, g + 1) if g % a == 0]
    if grid != "auto":
        a = int(grid)
        if a not in allowed:
            raise ArgumentError(
                f"optcc: grid rows {a} must divide the owners at every share level "
                f"(allowed: {allowed})"
            )
        return a, h // a
    if h <= DIRECT_OWNERS:
        return 1, h
    a = min(allowed, key=lambda a: (h // a + a, a))
    return a, h // a


def _grid_cost(w: np.ndarray) -> int:
    """Operations per segment of the automatic grid for shares ``w``."""
    plan = OptccPlan(tuple(float(x) for x in np.round(w / w.sum(), 12)), 0.0)
    a, b = _grid_shape(plan, "auto")
    return _ops_per_segment(plan.p, a, b, len(plan.attached))


def _layout(plan: OptccPlan, a: int) -> tuple[np.ndarray, np.ndarray]:
    """Owners as an ``(a, b)`` array (row i, column c) and each column's share of a
    segment. Columns are ordered by share, then rank; rows by rank within a column."""
    owners = sorted(plan.owners, key=lambda r: (round(plan.weights[r], 9), r))
    h = len(owners)
    b = h // a
    grid = np.asarray(owners, dtype=np.int64).reshape(b, a).T.copy()
    col_share = np.array([a * plan.weights[int(grid[0, c])] for c in range(b)])
    return grid, col_share / col_share.sum()


def segment_bounds(lo: int, hi: int, k: int, ramp: int = 0, ratio: float = 2.0) -> np.ndarray:
    """Boundaries of ``k`` segments of ``[lo, hi)``.

    The pipeline's head (an attached rank idles until the first segment is
    reduce-scattered) and tail (the owners all-gather the last segment after the attached
    ranks are done) each cost about one segment. With ``ramp = R`` the first and last R
    segments are 1/2, 1/4, ..., 1/2**R of the others (the smallest at the ends), which
    shortens both by about 2**R at the price of R more segments each.
    """
    ramp = max(0, min(int(ramp), (k - 1) // 2))
    weights = np.ones(k)
    for i in range(ramp):
        weights[i] = weights[k - 1 - i] = ratio ** -(ramp - i)
    cum = np.concatenate(([0.0], np.cumsum(weights)))
    return lo + np.round(cum / cum[-1] * (hi - lo)).astype(np.int64)


#: The longest automatic ramp over a fabric whose messages have a fixed cost (see
#: :func:`auto_ramp`).
RAMP_MAX_NETWORK = 5


def auto_ramp(k: int, most: int = 8) -> int:
    """Ramp segments at each end for ``k`` segments: ``k / 7`` rounded, 1 to ``most``
    (8; :data:`RAMP_MAX_NETWORK` over a fabric whose messages have a fixed cost, where
    a ramp's last sections are small messages: on the testbed below, k = 47 at 32 MiB took
    1524-1531 ms with a ramp of 7 and 1420-1430 ms with 4 or 5, and k = 95 at 64 MiB
    2828-2836 ms with 8 and 2783-2795 ms with 5; docs/testbed.md 1.6f).

    The ramp shortens the pipeline's head and tail, but with few segments a long one
    leaves most of the data in one or two full segments in the middle, which nothing
    overlaps. Measured (docs/testbed.md 1.6e): 8 ranks at 400 Mbit/s, rank 0 at half rate,
    k = 18 (16 MiB): 822-825 ms with 8 ramp segments, 748-751 ms with 3, 777-787 ms with
    none; k = 36 (32 MiB): 1475-1490 ms with 8, 1432-1450 with 4, 1440-1445 with 5.
    Simulated at p = 1024 (1 GiB, 50 GB/s, over the bound): a random vector with k = 17,
    1.121 with 8 and 1.060 with 2 or 3; one rank at half rate with k = 43, 1.0064 with 8,
    1.0084 with 6, 1.0134 with 4.
    """
    return int(min(most, max(1, round(k / 7))))


def column_fold(a: int, pattern: str = "fold", m: int = 0, b: int = 1) -> bool:
    """Whether the ``m`` attached ranks fold whole column blocks into one owner of each
    column (``_optcc_pipeline._ColumnFold``) rather than a section into every owner.

    Only with several rows and the folding pattern, and only where it at least doubles
    the segments :data:`MAX_AUTO_OPS` allows (derived, ours): the column fold sends ``a``
    times fewer messages, but in one segment only some of a column's owners take an
    attached rank's block, each ``a`` sections' worth, so per segment the owners' loads
    are uneven (even only over ``a`` segments). Simulated (1 GiB, 50 GB/s): a random
    vector in [0.1, 1) at p = 1024, 114 ranks attached, 17 segments -> 48 and 1.060 ->
    1.022 of the bound; at equal segments it costs (a degraded server at half rate,
    p = 256: 1.0002 -> 1.0120)."""
    if a < 2 or pattern != "fold" or m == 0:
        return False
    h = a * b
    grid_ops = h * 5 * (a + b - 2) + h
    per_owner = MAX_AUTO_OPS // (grid_ops + 5 * m * h)
    per_column = MAX_AUTO_OPS // (grid_ops + 5 * m * b)
    return per_owner < 128 and min(128, per_column) >= 2 * per_owner


def _ops_per_segment(p: int, a: int, b: int, m: int, pattern: str = "fold") -> int:
    """Operations one segment adds (upper estimate): per owner and peer of its row and of
    its column a send, a receive and a reduce (reduce-scatter) and a send and a receive
    (all-gather), and a join with several rows; per attached rank and owner it serves
    (every owner, or one per column with the column fold) a send, a receive, a reduce and
    a return."""
    h = a * b
    served = b if column_fold(a, pattern, m, b) else h
    return h * 5 * (a + b - 2) + (h if a > 1 else 0) + 5 * m * served


def choose_segments(
    nbytes: int,
    plan: OptccPlan,
    a: int,
    *,
    section_bytes: int = SECTION_BYTES,
    pattern: str = "fold",
) -> int:
    """Segments k: the pipeline's head and tail cost about one segment (with every owner
    busy, about half of one segment's time each), so as many as fit in
    :data:`MAX_AUTO_OPS` operations and in the memory available, at most 128, and no more
    than leave each owner's section of a segment ``section_bytes`` or more (at least 4).
    """
    h = len(plan.owners)
    b = h // a if a else 0
    k = int(np.clip(nbytes // max(1, max(h, 1) * section_bytes), 4, 128))
    per = max(_ops_per_segment(plan.p, a, b, len(plan.attached), pattern), 1)
    fits = memory_available() // (BYTES_PER_OP * per)
    return int(max(1, min(k, MAX_AUTO_OPS // per, fits)))


@register(
    summary="four-stage pipelined AllReduce: degraded ranks attached to the others, any "
    "bandwidth vector at its lower bound",
    cost=optcc_time,
    explain=explain_plan,
    auto=large_messages,
    order=10,
)
def optcc(
    p: int,
    count: int,
    links: Links | None = None,
    *,
    itemsize: int = 4,
    k: int | None = None,
    depth: int = 3,
    lag: int = 3,
    window: int = 2,
    pattern: str = "auto",
    grid: int | str = "auto",
    lookahead: int | None = None,
    ramp: int | None = None,
    ratio: float = 1.4,
    row_lag: int = 1,
    ag_lag: int = 0,
    fabric: str | Fabric | None = None,
) -> Schedule:
    """OptCC AllReduce schedule.

    Parameters
    ----------
    p, count : int
        Ranks and elements.
    links : Links
        Per-rank bandwidths; with all ranks equal, OptCC is a (grid of) ring(s).
    itemsize : int
        Bytes per element (segment sizes).
    k : int, optional
        Segments; chosen from the size by default (:func:`choose_segments`).
    depth : int
        Segments an owner's reduce-scatter runs ahead of its finished sections.
    lag : int
        Segments an attached rank's raw input runs ahead of the results it got back.
    window : int
        Messages in flight per connection.
    pattern : {"auto", "fold", "closer"}
        How attached ranks exchange (module docstring): ``closer`` rotates one closing
        rank per segment and lets the others fold; ``auto`` closes with one attached rank
        and folds with several.
    grid : int or "auto"
        Rows of the owners' grid (see :func:`_grid_shape`); 1 is a direct all-to-all,
        the number of owners a ring.
    lookahead : int, optional
        Messages an attached rank keeps in flight per direction (default: one segment's
        worth, the number of owners).
    ramp : int, optional
        Geometrically smaller segments at each end of the pipeline (see
        :func:`segment_bounds`); by default :func:`auto_ramp` of the segment count.
    fabric : {"network", "shared-memory"}, Fabric or None
        What joins the ranks (set by :func:`optcc_mpi.allreduce` from the communicator):
        it sets the smallest section of a segment (:func:`section_floor`), so the number
        of segments when ``k`` is not given. None (the default, and the simulator's
        setting) is a fabric whose messages cost only their bytes.
    """
    if pattern not in PATTERNS:
        raise ArgumentError(f"unknown OptCC pattern {pattern!r}; choose one of {PATTERNS}")
    links = links if links is not None else Links()
    plan = optcc_plan(p, links)
    a, nb = _grid_shape(plan, grid)
    m = len(plan.attached)
    pat = "fold" if pattern == "auto" else pattern
    kk, ramp = _segments(count * itemsize, plan, a, k=k, ramp=ramp, fabric=fabric, pattern=pat)
    check_size("optcc", kk * _ops_per_segment(p, a, nb, m, pat) + 1, p=p, k=kk)
    params: Params = dict(
        weights=plan.weights,
        grid=(a, nb),
        k=kk,
        depth=depth,
        lag=lag,
        pattern=pat,
        fold="column" if column_fold(a, pat, m, nb) else "owner",
        ramp=ramp,
    )
    if p < 2 or count == 0 or nb == 0:
        return ScheduleBuilder(p, count, "optcc", window=window, **params).build()
    G, col_share = _layout(plan, a)
    seg = segment_bounds(0, count, kk, ramp, ratio)
    b = ScheduleBuilder(p, count, "optcc", window=window, **params)
    pipe = Pipeline(
        b,
        np.asarray(plan.attached, dtype=np.int64),
        G,
        col_share,
        seg,
        colfold=column_fold(a, pat, m, nb),
        pattern=pat,
        depth=depth,
        lag=lag,
        lookahead=lookahead
        if lookahead is not None
        else (nb if column_fold(a, pat, m, nb) else a * nb),
        row_lag=row_lag,
        ag_lag=ag_lag,
    )
    b.scratch = pipe.scratch_end
    pipe.run()
    return b.build()


def _segments(
    nbytes: int,
    plan: OptccPlan,
    a: int,
    *,
    k: int | None,
    ramp: int | None,
    fabric: str | Fabric | None,
    pattern: str,
) -> tuple[int, int]:
    """Segments and ramp segments of a buffer of ``nbytes``: ``k`` and ``ramp`` where
    given, otherwise :func:`choose_segments` with the section floor of ``fabric``
    (:func:`section_floor`) and :func:`auto_ramp`."""
    floor = section_floor(fabric)
    kk = (
        k
        if k is not None
        else choose_segments(nbytes, plan, a, section_bytes=floor, pattern=pattern)
    )
    kk = max(1, int(kk))
    if ramp is None:
        # A fabric with a fixed cost per message holds the ramp's smallest sections
        # back (auto_ramp).
        costly = fabric is not None and floor > SECTION_BYTES
        ramp = auto_ramp(kk, RAMP_MAX_NETWORK if costly else 8)
    return kk, int(ramp)
