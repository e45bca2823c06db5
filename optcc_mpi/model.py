"""The algorithm-free part of the cost model: fault-free time and the lower bound.

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

What each algorithm costs is declared by the algorithm itself, in its module under
:mod:`optcc_mpi.algorithms` (OptCC's fluid plan, for instance, lives with OptCC); this
module holds only what is true of every algorithm, and sits below the algorithms, which
use it. The registry puts them side by side (:func:`optcc_mpi.algorithms.times`,
:func:`optcc_mpi.algorithms.table`).
"""

from __future__ import annotations

import numpy as np

from optcc_mpi.links import Links

__all__ = ["fractions", "fault_free", "lower_bound"]


def fractions(links: Links | str | None, p: int) -> np.ndarray:
    """Per-rank bandwidth fractions of ``links`` as a length-``p`` vector."""
    return (Links.coerce(links) if links is not None else Links()).vector(p)


def fault_free(p: int, nbytes: float, bw: float) -> float:
    """``2(p-1)/p * n / B``: the healthy ring, optimal without faults."""
    return 2.0 * (p - 1) / p * nbytes / bw if p > 1 else 0.0


def lower_bound(p: int, nbytes: float, bw: float, links: Links | str | None = None) -> float:
    """Lower bound on AllReduce time under per-rank bandwidths (module docstring)."""
    if p < 2:
        return 0.0
    f = fractions(links, p)
    return nbytes / bw * max(1.0 / f.min(), 2.0 * (p - 1) / f.sum())
