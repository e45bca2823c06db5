"""From timed messages to each rank's rate and fraction: the one estimator of the watch,
its probe and ``links="probe"``.

A message moves at the pace of the slower of its two ends, so its rate is a lower bound
on its sender's egress and its receiver's ingress, and noise only ever makes a link look
slower. :func:`message_rates` turns timed messages into two such bounds per rank: its
egress (its messages out: their bytes over the time they kept it busy, the union of their
intervals, within a *group* of messages that shared its NIC at once, such as one call of a
collective or one round of a probe; the fastest group) and its ingress (the same of its
messages in).

A rank's rate is the *faster* of the two (:func:`rank_rates`). A degraded NIC limits both
directions of its rank (the testbed shapes both, emulation paces both), so each bound is a
bound on that one rate and the larger is the tighter; the smaller would blame a healthy
rank for a slow partner. In a ring, where every rank sends to one neighbour and receives
from the other, the slow rank's messages out and in are both slow, while each neighbour
has one slow direction and one fast: only the faster direction tells the neighbours from
the slow rank (tests/test_watch.py, tests/test_linkrates.py). A link slow in one direction
only is outside this model; :mod:`optcc_mpi.doctor`, which still reports the smaller of
the two fractions, is the tool for it.

Fractions are of a reference rate (:func:`relative_rates`): the emulated rate, an
expected one, the median rank or the upper quartile of the ranks' rates
(:func:`upper_quartile`, where up to half of them may be slow). A rank is *named* slow
only where some partner of its low direction was clearly faster (:func:`explained`):
otherwise its low rate may be its partners', and the measurement cannot say which end is
slow. Measurements that pair every rank with partners spread over the ring
(:func:`spread`: 1, about a third and two thirds of the way round) give every rank a fast
partner unless most of them are slow, so that two slow ranks next to each other, or a
healthy rank between two slow ones, are told apart.

Pure functions of the measured rates: every rank computes the same from the same
gathered records. Used by :mod:`optcc_mpi.watch` (its calls' traffic), by
:func:`optcc_mpi.probe.probe_ranks` (what ``links="watch"`` runs where its calls' traffic
cannot tell ranks apart) and :func:`optcc_mpi.probe.probe` (``links="probe"``); and, for
:func:`spread`, :func:`relative_rates`, :func:`explained` and the threshold, by
:mod:`optcc_mpi.doctor`.

Thresholds
----------
:data:`HEALTHY_ABOVE` (0.8) judges a fraction that is the best of several measurements:
the doctor's over every partner and repeat, the watch's confirmed over calls and decided
by :func:`~optcc_mpi.probe.probe_ranks`. :data:`optcc_mpi.probe.ONE_SHOT_HEALTHY_ABOVE`
(0.75) judges one noisier measurement that nothing repeats (``links="probe"``, taken once
per communicator): the two are different on purpose, and these are their only
definitions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from optcc_mpi.links import Links

__all__ = [
    "HEALTHY_ABOVE", "EXPLAIN", "spread", "busy", "message_rates", "bounds", "rank_rates",
    "explained", "relative_rates", "upper_quartile", "named",
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


def busy(lo: np.ndarray, hi: np.ndarray) -> float:
    """Length of the union of the intervals ``[lo, hi)``: how long messages that overlap
    kept one side busy (bytes over it is their rate together, however they overlapped)."""
    if lo.size == 0:
        return 0.0
    order = np.argsort(lo, kind="stable")
    a, b = lo[order].astype(float), hi[order].astype(float)
    # In start order, each interval adds what reaches past every earlier one's end.
    before = np.concatenate(([-np.inf], np.maximum.accumulate(b)[:-1]))
    return float(np.maximum(b - np.maximum(a, before), 0.0).sum())


def message_rates(
    sender: np.ndarray,
    receiver: np.ndarray,
    nbytes: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    p: int,
    group: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, its egress and ingress rate (bytes/s) from timed messages; NaN where no
    message of that direction was timed.

    Within a group, a rank's rate out is the bytes of its messages out over the time they
    kept it busy (:func:`busy`: messages in flight together share its NIC), and likewise
    in; over the groups, the fastest (noise only ever slows a message). A message whose
    interval is empty or unknown (``hi <= lo``, NaN) is left out.

    Parameters
    ----------
    sender, receiver : numpy.ndarray
        Per message, its two ends.
    nbytes : numpy.ndarray
        Per message, its bytes.
    lo, hi : numpy.ndarray
        Per message, when it was on the wire (seconds, one clock per group).
    p : int
        Ranks.
    group : numpy.ndarray, optional
        Per message, the group it was timed in (messages of different groups never share a
        NIC: a probe's rounds); default one group (one call of a collective).

    Returns
    -------
    egress, ingress : numpy.ndarray
        Per rank, ``p`` rates.
    """
    sender = np.asarray(sender, dtype=np.int64)
    receiver = np.asarray(receiver, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.float64)
    lo, hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
    ok = (hi > lo) & (nbytes > 0)  # False for NaN too
    g = np.zeros(sender.size, np.int64) if group is None else np.asarray(group, np.int64)
    out = []
    for side in (sender, receiver):
        rate = np.full(p, math.nan)
        sel = np.flatnonzero(ok)
        # One (group, rank) at a time, in one sort: each its messages' bytes over busy.
        key = np.unique(g[sel], return_inverse=True)[1].reshape(-1) * p + side[sel]
        order = np.argsort(key, kind="stable")
        keys, starts = np.unique(key[order], return_index=True)
        for k, idx in zip(keys, np.split(sel[order], starts[1:])):
            t = busy(lo[idx], hi[idx])
            if t > 0:
                r = int(k % p)
                rate[r] = np.fmax(rate[r], float(nbytes[idx].sum()) / t)
        out.append(rate)
    return out[0], out[1]


def bounds(pair: Pairs, p: int) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the fastest rate out (egress) and in (ingress) of the messages in
    ``pair`` (:func:`message_rates` of messages timed each alone); NaN where none was
    measured."""
    keys = [k for k, v in pair.items() if v > 0]
    n = len(keys)
    sender = np.array([s for s, _ in keys], dtype=np.int64)
    receiver = np.array([d for _, d in keys], dtype=np.int64)
    # A rate is the bytes of a message on the wire for one second.
    rate = np.array([pair[k] for k in keys], dtype=np.float64)
    return message_rates(sender, receiver, rate, np.zeros(n), np.ones(n), p, np.arange(n))


def rank_rates(egress: np.ndarray, ingress: np.ndarray) -> np.ndarray:
    """Per rank, its rate: the faster of its egress and ingress (NaN where neither was
    measured).

    Both are lower bounds on the one rate of its NIC (the module docstring), so the
    larger is the tighter. The smaller would blame a healthy rank whose messages of one
    direction all went to or came from a slow one (a ring's neighbours of a slow rank)."""
    with np.errstate(invalid="ignore"):
        return np.fmax(egress, ingress)


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


def upper_quartile(rates: np.ndarray) -> float | None:
    """The upper quartile of the ranks' measured rates (:func:`rank_rates`; NaN and 0:
    not measured): a reference where up to half of the ranks may be slow (a degraded
    server), where the median would be a slow one and the single fastest measurement is
    noise. None where nothing was measured."""
    rates = np.asarray(rates, dtype=np.float64)
    seen = rates[np.isfinite(rates) & (rates > 0)]
    return float(np.quantile(seen, 0.75)) if seen.size else None


def named(
    pair: Pairs, p: int, ref: float | None, healthy_above: float
) -> tuple[Links, list[int], np.ndarray]:
    """The profile the rates in ``pair`` indicate against ``ref`` (default: the median):
    every rank whose fraction (of its :func:`rank_rates`) is below ``healthy_above`` and
    not :func:`explained` by its partners, at that fraction (at least 0.01, rounded to two
    places). Also returns the ranks below the threshold that their partners explain
    (*unresolved*: not named) and every rank's fraction (NaN: not measured)."""
    egress, ingress = bounds(pair, p)
    fe, _ = relative_rates(egress, ref)
    fi, _ = relative_rates(ingress, ref)
    frac = rank_rates(fe, fi)  # (against one reference: the fraction of the faster)
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
