"""OptCC: AllReduce that keeps degraded ranks off the ring's critical path.

The four stages (after the OptCC paper; the details below are our reading, see
``docs/optcc.md``): the healthy ranks form a ring; each *straggler* exchanges each data
section once in each direction with one healthy rank, instead of carrying ~2n bytes each
way as a ring member.

Per segment of the buffer, cut into h = (number of healthy ranks) sections, section j
owned by healthy index j:

* **S1** reduce-scatter over the healthy ring; the chain of section j starts at healthy
  index j+1 and ends at the owner.
* **S2/S3** a straggler either *closes* the section (ordering 1: the owner sends it the
  partial sum, the straggler adds its input and returns the global sum), or *folds* its
  raw input into the chain before it starts (ordering 2: it sends section j to the
  chain's first rank, which adds it before forwarding).
* **S4** all-gather over the healthy ring; stragglers that folded receive the global
  section from a healthy rank (spread over the ring, so no healthy rank carries more than
  its share).

The two orderings alternate from segment to segment (``pattern="alternate"``), so the
straggler sends raw input of one segment while it receives and returns another: both
directions of its link stay busy. Segments are pipelined: each rank's ring queue carries
the reduce-scatter of segment L+depth before the all-gather of segment L, so the ring
works on later segments while a straggler handles earlier ones.

Several stragglers, and any vector of per-rank bandwidths, are handled by the plan of
:func:`optcc_plan` (ours): the buffer is split over *schemes*, each
attaching a set of slow ranks to the ring of the others, plus (when stragglers keep more
than about half their bandwidth) a share through the plain ring over all ranks, which
fills the bubbles on the stragglers' links. All schemes run at once on separate channels.

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

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from optcc_mpi.algorithms import register
from optcc_mpi.algorithms._policy import large_messages
from optcc_mpi.algorithms.ring import (
    CHUNK_BYTES,
    add_ring_allreduce,
    all_gather,
    reduce_scatter,
    ring_chunks,
)
from optcc_mpi.links import Links
from optcc_mpi.model import fractions
from optcc_mpi.schedule import Schedule, ScheduleBuilder, split

__all__ = [
    "optcc",
    "optcc_time",
    "optcc_plan",
    "OptccPlan",
    "plan_time",
    "scheme_loads",
    "bubble_fraction",
    "l_star",
    "FILL_GAIN",
    "add_attached",
    "choose_segments",
    "PATTERNS",
]

PATTERNS = ("auto", "alternate", "closer", "raw")
#: Channels used by one attached scheme: reduce-scatter, all-gather, raw folds, closer
#: exchange, returns.
_CHANNELS_PER_SCHEME = 5


#: Smallest message (one section of one segment) worth cutting a segment into.
SECTION_BYTES = 256 * 1024


def choose_segments(
    nbytes: int, healthy: int, *, section_bytes: int = SECTION_BYTES, lo: int = 4, hi: int = 128
) -> int:
    """Segments k for an attached scheme.

    The pipeline head and tail cost about one segment each, so the time is about
    ``(1 + 1/k)`` times the fluid time (:func:`optcc_mpi.model.optcc_time`): more segments
    are better until messages get so small that per-message costs dominate. k is the
    number of segments whose sections are ``section_bytes``, within ``[lo, hi]``.
    """
    return int(np.clip(nbytes // max(1, healthy * section_bytes), lo, hi))


def segment_bounds(lo: int, hi: int, k: int, ramp: int = 0) -> np.ndarray:
    """Boundaries of ``k`` segments of ``[lo, hi)``.

    The pipeline's head (the straggler idles until the first segment is reduce-scattered)
    and tail (the ring all-gathers the last segment after the straggler is done) each cost
    about one segment. With ``ramp = R`` the first and last R segments are 1/2, 1/4, ...,
    1/2**R of the others (the smallest at the ends), which shortens both by about 2**R at
    the price of R more segments each.
    """
    ramp = max(0, min(int(ramp), (k - 1) // 2))
    weights = np.ones(k)
    for i in range(ramp):
        weights[i] = weights[k - 1 - i] = 0.5 ** (ramp - i)
    cum = np.concatenate(([0.0], np.cumsum(weights)))
    return lo + np.round(cum / cum[-1] * (hi - lo)).astype(np.int64)


def add_attached(
    b: ScheduleBuilder,
    healthy: Sequence[int],
    stragglers: Sequence[int],
    lo: int,
    hi: int,
    *,
    k: int,
    depth: int = 2,
    pattern: str = "auto",
    chan: int = 0,
    lookahead: int | None = None,
    fold_ahead: int = 1,
    ramp: int = 0,
) -> None:
    """Add the four-stage AllReduce of ``[lo, hi)``: ``stragglers`` attached to the ring
    of ``healthy`` (in ring order), in ``k`` pipelined segments.

    Parameters
    ----------
    b : ScheduleBuilder
        Where to add the operations.
    healthy, stragglers : sequence of int
        Ring members and attached ranks (disjoint; at least one healthy rank).
    lo, hi : int
        Element range.
    k : int
        Segments.
    depth : int
        Segments of reduce-scatter each ring queue runs ahead of the all-gather.
    pattern : {"auto", "alternate", "closer", "raw"}
        Which ordering the segments use: alternate closing (ordering 1) and folding
        (ordering 2), always close, or always fold. With several stragglers at most one
        closes a given segment (the others fold); closers rotate. ``auto`` closes with one
        straggler and folds with several: a closer must finish its whole segment before
        the ring can all-gather it, and with several stragglers that one rank becomes the
        pipeline's bottleneck (simulated, p = 16 with 8 ranks at half rate: 1.14 x the
        bound folding, 1.58 x closing).
    chan : int
        First of the five channels this scheme uses.
    lookahead : int, optional
        Messages each straggler keeps in flight per direction, across all its peers
        (default: one segment's worth, ``h``). Without this bound a straggler would share
        its slow link among every segment that is ready and finish none of them early.
    fold_ahead : int
        Segments by which a straggler's raw sends run ahead of its closing work.
    ramp : int
        Segments at each end that grow (shrink) geometrically, halving the head and tail
        of the pipeline with each step (see :func:`segment_bounds`).
    """
    if pattern not in PATTERNS:
        raise ValueError(f"unknown OptCC pattern {pattern!r}; choose one of {PATTERNS}")
    H = np.asarray(healthy, dtype=np.int64)
    D = np.asarray(stragglers, dtype=np.int64)
    nh, m = H.size, D.size
    if pattern == "auto":
        pattern = "closer" if m == 1 else "raw"
    if nh < 1:
        raise ValueError("an attached scheme needs at least one healthy rank")
    if hi <= lo:
        return
    # Reduce-scatter and all-gather use separate channels, so an all-gather waiting for
    # a straggler never holds up the reduce-scatter of later segments behind it.
    c_rs, c_ag, c_fold, c_close, c_ret = range(chan, chan + _CHANNELS_PER_SCHEME)
    seg = segment_bounds(lo, hi, k, ramp)
    sec = split(seg[:-1], seg[1:], nh)  # (k, nh + 1)
    j = np.arange(nh)
    starter = (j + 1) % nh  # healthy index that starts section j's chain
    lookahead = nh if lookahead is None else lookahead
    streams: dict[tuple[int, str], list[int]] = {}

    def paced(u: int, direction: str, ids: np.ndarray) -> None:
        b.stream(ids, lookahead, streams.setdefault((u, direction), []))

    def closer_of(L: int) -> int | None:
        if m == 0 or pattern == "raw":
            return None
        if pattern == "closer":
            return L % m
        return (L // 2) % m if L % 2 == 0 else None

    pending: dict[int, tuple[Any, ...]] = {}
    finals: dict[int, np.ndarray] = {}  # per segment, by healthy index: section complete

    folded: dict[int, tuple[np.ndarray, dict[int, np.ndarray]]] = {}

    def fold(L: int) -> None:
        # S3 first (ordering 2): raw sections go to the chain's first rank, which adds
        # them one after the other (a fixed order keeps the sum bit-reproducible). Created
        # `fold_ahead` segments early, so each straggler's paced stream sends raw input of
        # later segments before it closes earlier ones and no straggler waits on another.
        slo, shi = sec[L, :-1], sec[L, 1:]
        closer = closer_of(L)
        fold_last = np.full(nh, -1, dtype=np.int64)  # by healthy index
        raw_sends = {}
        for u in range(m):
            if u == closer:
                continue
            sids, rids = b.transfer(
                D[u],
                H[starter],
                slo,
                shi,
                chan=c_fold,
                reduce=True,
                recv_deps=fold_last[starter],
            )
            raw_sends[u] = sids
            paced(u, "send", sids)
            fold_last[starter] = rids
        folded[L] = (fold_last, raw_sends)

    def front(L: int) -> None:
        slo, shi = sec[L, :-1], sec[L, 1:]
        closer = closer_of(L)
        fold_last, raw_sends = folded.pop(L)
        # S1: reduce-scatter over the healthy ring, at most `depth` segments ahead of the
        # all-gather (each member waits until it holds the result of segment L - depth).
        throttle = finals[L - depth] if L >= depth else -1
        rs_sends, final = reduce_scatter(
            b,
            H,
            slo[:, None],
            shi[:, None],
            chan=c_rs,
            first_deps=[fold_last[:, None], np.reshape(throttle, (-1, 1))],
        )
        final = np.where(final[:, 0] >= 0, final[:, 0], fold_last)
        # S2 then S3 (ordering 1): the closer completes each section and returns it.
        if closer is not None:
            c = D[closer]
            s_up, r_up = b.transfer(H, c, slo, shi, chan=c_close, reduce=True, send_deps=final)
            s_down, r_down = b.transfer(
                c, H, slo, shi, chan=c_close, send_deps=r_up, recv_deps=s_up
            )
            paced(closer, "recv", r_up)
            paced(closer, "send", s_down)
            final = r_down
        finals[L] = final
        pending[L] = (rs_sends, final, raw_sends)

    def back(L: int) -> None:
        rs_sends, final, raw_sends = pending.pop(L)
        slo, shi = sec[L, :-1], sec[L, 1:]
        # S4: all-gather over the healthy ring.
        ag = all_gather(
            b,
            H,
            slo[:, None],
            shi[:, None],
            chan=c_ag,
            first_deps=final[:, None],
            rs_sends=rs_sends,
        )
        # S2 last (ordering 2): folders get the global sections back. Straggler u takes
        # section j from healthy index j+u, which holds it after all-gather step u-1, so
        # the returns are spread over the ring.
        for u, raw in raw_sends.items():
            step = u % nh
            src = (j + step) % nh
            dep = final if step == 0 else ag[step - 1][src, 0]
            _, rids = b.transfer(H[src], D[u], slo, shi, chan=c_ret, send_deps=dep, recv_deps=raw)
            paced(u, "recv", rids)

    for tau in range(k + fold_ahead + depth):
        if tau < k:
            fold(tau)
        if 0 <= tau - fold_ahead - depth < k:
            back(tau - fold_ahead - depth)
        if 0 <= tau - fold_ahead < k:
            front(tau - fold_ahead)


def _share_bounds(lo: int, hi: int, shares: Sequence[float]) -> list[tuple[int, int]]:
    """Cut ``[lo, hi)`` into consecutive ranges proportional to ``shares``."""
    cum = np.concatenate(([0.0], np.cumsum(shares)))
    cuts = lo + np.round(cum / cum[-1] * (hi - lo)).astype(np.int64)
    return [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]


# ----------------------------------------------------------------------------- the plan


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
    f = fractions(links, p)
    total = sum(x * scheme_loads(p, tuple(d)) for d, x in schemes)
    return float(np.max(total / f))


def optcc_plan(p: int, links: Links | str | None = None, *, fill: bool | str = True) -> OptccPlan:
    """How OptCC splits the data over straggler schemes.

    ``fill=True``: the best fluid split, by linear programming (bubble filling included);
    ``fill=False``: every degraded rank attached to the ring of the others, for all of the
    data; ``fill="auto"``: the first unless it gains less than ``FILL_GAIN`` over the second.
    """
    f = fractions(links, p)
    # Rounded to 12 significant digits (not decimals: 1e-13 must not become 0) so that
    # profiles equal up to rounding share a cache entry.
    best = _plan(p, tuple(float(f"{x:.12g}") for x in f.tolist()))
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

    # Each scheme on its own (attach the j slowest ranks, all of the data): a feasible
    # plan whose time is exact, the answer when the fractions are too extreme for the LP.
    with np.errstate(over="ignore", divide="ignore"):
        single = np.max(loads / f[None, :], axis=1)
    j_best = int(np.argmin(single))
    x = np.zeros(J)
    x[j_best] = 1.0
    t = float(single[j_best])
    # Variables x_0..x_{J-1}, T. Minimise T. Row r reads loads_r . x / f_r <= T: divided
    # by f_r, the coefficients of T are all -1, so a tiny fraction (1e-9) gives a large
    # load coefficient, which the solver keeps, instead of a tiny one, which it drops as
    # zero (the problem then looked infeasible).
    c = np.zeros(J + 1)
    c[-1] = 1.0
    with np.errstate(over="ignore", divide="ignore"):
        a_ub = np.hstack([loads.T / f[:, None], -np.ones((p, 1))])
    a_eq = np.zeros((1, J + 1))
    a_eq[0, :J] = 1.0
    if np.all(np.isfinite(a_ub)) and np.abs(a_ub).max() < 1e12:
        res = linprog(
            c,
            A_ub=a_ub,
            b_ub=np.zeros(p),
            A_eq=a_eq,
            b_eq=[1.0],
            bounds=[(0, None)] * (J + 1),
            method="highs",
        )
        if res.success:
            x_lp = np.where(res.x[:J] < 1e-9, 0.0, res.x[:J])
            x_lp /= x_lp.sum()
            t_lp = float(res.x[-1])
            # Keep the LP's answer if it is what its split really takes, and no worse
            # than the best single scheme.
            check = float(np.max(loads.T @ x_lp / f))
            if abs(check - t_lp) <= 1e-6 * t_lp and t_lp <= t * (1 + 1e-9):
                x, t = x_lp, t_lp
    schemes = tuple(
        (tuple(sorted(int(r) for r in order[:j])), float(x[j])) for j in range(J) if x[j] > 0
    )
    return OptccPlan(schemes, t)


def optcc_time(
    p: int,
    nbytes: float,
    bw: float,
    links: Links | str | None = None,
    *,
    latency: float = 0.0,
    k: int | None = None,
    fill: bool | str = True,
) -> float:
    """OptCC's fluid time (the best split unless ``fill`` says otherwise, see
    :func:`optcc_plan`); with ``k`` segments, one segment's worth of pipeline head and
    tail added, ``(1 + 1/k)`` times the fluid time (derived); plus one latency per ring
    step, 2(p-1)."""
    if p < 2:
        return 0.0
    t = optcc_plan(p, links, fill=fill).time * nbytes / bw
    t = t if k is None else t * (1.0 + 1.0 / k)
    return t + 2 * (p - 1) * latency


def explain_plan(p: int, links: Links | str | None = None, *, fill: bool | str = "auto") -> str:
    """The plan in words: each scheme's share and what it attaches."""
    parts = []
    for d, x in optcc_plan(p, links, fill=fill).schemes:
        what = f"ranks {','.join(map(str, d))} attached" if d else "ring over all ranks"
        parts.append(f"{x:.1%} {what}")
    return "; ".join(parts)


@register(
    summary="four-stage pipelined AllReduce that attaches degraded ranks to a healthy ring",
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
    window: int = 2,
    pattern: str = "auto",
    fill: bool | str = "auto",
    chunk_bytes: int = CHUNK_BYTES,
    lookahead: int | None = None,
    ramp: int = 2,
) -> Schedule:
    """OptCC AllReduce schedule.

    Parameters
    ----------
    p, count : int
        Ranks and elements.
    links : Links
        Which ranks are degraded; with none, OptCC is the ring.
    itemsize : int
        Bytes per element (segment and chunk sizes).
    k : int, optional
        Segments per attached scheme; chosen from the size by default.
    depth : int
        Pipeline depth of the healthy ring (segments of look-ahead).
    window : int
        Messages in flight per connection.
    pattern : {"auto", "alternate", "closer", "raw"}
        Stage ordering per segment (see :func:`add_attached`).
    fill : bool or "auto"
        True: the bubble-filling split of :func:`optcc_plan` (a plain
        ring over all ranks beside the attached scheme); False: every degraded rank
        attached, for all of the data; "auto": the split only where the fluid model says
        it gains more than ``FILL_GAIN`` (3%), since the two shares compete for the
        degraded links (simulated, p = 32 at 12.5% loss: 1.057 x the bound with the
        split, 1.013 x attaching).
    chunk_bytes : int
        Message size target of the full-ring share.
    lookahead : int, optional
        Messages a straggler keeps in flight per direction (see :func:`add_attached`).
    ramp : int
        Geometrically smaller segments at each end of the pipeline (see
        :func:`segment_bounds`); with 2, the simulated overhead at k = 16 drops from 6.3%
        to 2.9% of the bound (p = 8, half rate).
    """
    links = links if links is not None else Links()
    plan = optcc_plan(p, links, fill=fill)
    ks: list[int] = []
    b = ScheduleBuilder(p, count, "optcc", window=window)
    chan = 0
    shares = [x for _, x in plan.schemes]
    for (stragglers, _), (lo, hi) in zip(plan.schemes, _share_bounds(0, count, shares)):
        if not stragglers:
            chunks = ring_chunks(-(-(hi - lo) // p), itemsize, chunk_bytes)
            add_ring_allreduce(b, range(p), lo, hi, chunks=chunks, chan=chan)
            chan += 1
            continue
        healthy = [r for r in range(p) if r not in stragglers]
        kk = k if k is not None else choose_segments((hi - lo) * itemsize, len(healthy))
        ks.append(kk)
        add_attached(
            b,
            healthy,
            stragglers,
            lo,
            hi,
            k=kk,
            depth=depth,
            pattern=pattern,
            chan=chan,
            lookahead=lookahead,
            ramp=ramp,
        )
        chan += _CHANNELS_PER_SCHEME
    b.params.update(
        schemes=tuple((tuple(d), x) for d, x in plan.schemes),
        k=tuple(ks),
        depth=depth,
        pattern=pattern,
        window=window,
    )
    return b.build()
