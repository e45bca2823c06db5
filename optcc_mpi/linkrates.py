"""From the rates of single messages to each rank's fraction: the estimator the doctor and
the watch's probe share.

A message moves at the pace of the slower of its two ends, so its rate is a lower bound
on its sender's egress and its receiver's ingress, and noise only ever makes a link look
slower. A rank's egress is the fastest of its messages out (over every partner and
repeat), its ingress the fastest in, and its fraction the smaller of the two against a
reference rate (:func:`relative_rates`). A rank is *named* slow only where some partner of
its low direction was clearly faster (:func:`explained`): otherwise its low rate may be
its partners', and the measurement cannot say which end is slow. Measurements that pair
every rank with partners spread over the ring (:func:`spread`: 1, about a third and two
thirds of the way round) give every rank a fast partner unless most of them are slow, so
that two slow ranks next to each other, or a healthy rank between two slow ones, are
told apart.

Pure functions of the measured rates: every rank computes the same from the same
gathered records. Used by :mod:`optcc_mpi.doctor` (its verdicts) and by
:func:`optcc_mpi.probe.probe_ranks` (what ``links="watch"`` runs where its calls'
traffic cannot tell ranks apart, :mod:`optcc_mpi.watch`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from optcc_mpi.links import Links

__all__ = [
    "HEALTHY_ABOVE", "EXPLAIN", "spread", "bounds", "explained", "relative_rates",
    "upper_quartile", "named",
]  # fmt: skip

#: A rank (or link) whose fraction of the reference is at or above this is healthy, where
#: the fraction is the best of several measurements: the doctor's over every partner and
#: repeat, the watch's confirmed over calls and decided by
#: :func:`optcc_mpi.probe.probe_ranks`. Healthy links measure 0.9 or more on the testbed,
#: and a link at 0.7 is found with room for its measurement error. The one threshold of
#: :mod:`optcc_mpi.doctor`, :mod:`optcc_mpi.watch` and ``probe_ranks``; the first-call
#: probe of ``links="probe"`` judges one noisier measurement against a lower one
#: (:data:`optcc_mpi.probe.ONE_SHOT_HEALTHY_ABOVE`).
HEALTHY_ABOVE = 0.8

#: A partner whose own rate is within this factor of a rank's low rate may have been
#: what limited it.
EXPLAIN = 1.15

#: Fastest rate (bytes/s) per (sender, receiver).
Pairs = Mapping[tuple[int, int], float]


def spread(n: int, k: int) -> list[int]:
    """Up to ``k`` distinct shifts in ``1..n-1``, spread over the ring: 1, about a third
    of the way round, about two thirds (for k = 3)."""
    k = min(k, n - 1)
    return sorted({1 + (i * (n - 1)) // k for i in range(k)}) if k > 0 else []


def bounds(pair: Pairs, p: int) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the fastest rate out (egress) and in (ingress) of the messages in
    ``pair``; NaN where none was measured."""
    egress = np.full(p, math.nan)
    ingress = np.full(p, math.nan)
    for (s, d), v in pair.items():
        if v > 0:
            egress[s] = np.fmax(egress[s], v)
            ingress[d] = np.fmax(ingress[d], v)
    return egress, ingress


def explained(
    r: int,
    pair: Pairs,
    egress: np.ndarray,
    ingress: np.ndarray,
    low_e: bool,
    low_i: bool,
    factor: float = EXPLAIN,
) -> bool:
    """Whether rank ``r``'s low rates (``low_e``: out, ``low_i``: in) could all be its
    partners': every partner of a low direction was itself no faster than ``r`` (then
    either end may be slow)."""
    ok = True
    if low_e:
        outs = [d for (s, d) in pair if s == r]
        ok &= all(not (ingress[d] > egress[r] * factor) for d in outs)
    if low_i:
        ins = [s for (s, d) in pair if d == r]
        ok &= all(not (egress[s] > ingress[r] * factor) for s in ins)
    return bool((low_e or low_i) and ok)


def relative_rates(values: np.ndarray, ref: float | None) -> tuple[np.ndarray, float]:
    """``values`` over the reference (the median of the measured ones, or ``ref``), at
    most 1; NaN where not measured. Also returns the median."""
    seen = np.isfinite(values) & (values > 0)
    med = float(np.median(values[seen])) if seen.any() else math.nan
    base = ref if ref is not None else med
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(seen, np.minimum(values / base, 1.0), math.nan)
    return frac, med


def upper_quartile(egress: np.ndarray, ingress: np.ndarray) -> float | None:
    """The upper quartile of the ranks' smaller rate: a reference where up to half of
    the ranks may be slow (a degraded server), where the median would be a slow one and
    the single fastest measurement is noise. None where nothing was measured."""
    cap = np.fmin(egress, ingress)
    cap = cap[np.isfinite(cap) & (cap > 0)]
    return float(np.quantile(cap, 0.75)) if cap.size else None


def named(
    pair: Pairs, p: int, ref: float | None, healthy_above: float
) -> tuple[Links, list[int], np.ndarray]:
    """The profile the rates in ``pair`` indicate against ``ref`` (default: the median):
    every rank whose smaller fraction is below ``healthy_above`` and not
    :func:`explained` by its partners, at that fraction (at least 0.01, rounded to two
    places). Also returns the ranks below the threshold that their partners explain
    (*unresolved*: not named) and every rank's fraction (NaN: not measured)."""
    egress, ingress = bounds(pair, p)
    fe, _ = relative_rates(egress, ref)
    fi, _ = relative_rates(ingress, ref)
    frac = np.fmin(fe, fi)
    prof: dict[int, float] = {}
    unresolved = []
    for r in range(p):
        if not (frac[r] < healthy_above):
            continue
        if explained(r, pair, egress, ingress, fe[r] < healthy_above, fi[r] < healthy_above):
            unresolved.append(r)
        else:
            prof[r] = max(0.01, round(float(frac[r]), 2))
    return Links(prof), unresolved, frac
