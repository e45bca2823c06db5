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

What each of our schedules costs is declared by the algorithm itself, in its module
under :mod:`optcc_mpi.algorithms` (OptCC's fluid plan, for instance, lives with OptCC);
this module holds what is true of every algorithm, and the one model of the collective
that is not ours to schedule, the MPI (or gloo, NCCL) library's own AllReduce
(:func:`library_allreduce`): the ``native`` algorithm declares it as its cost, the
emulator's pacer charges it (:meth:`optcc_mpi.emulation.Pacer.coll_done`), and CA-SGD's
benchmark and projection charge it to every AllReduce. It sits below the algorithms and
the emulation, which use it. The registry puts the algorithms side by side
(:func:`optcc_mpi.algorithms.times`, :func:`optcc_mpi.algorithms.table`).

The library's AllReduce (derived, ours; ``docs/model.md``)
----------------------------------------------------------
MPI libraries choose the algorithm by message size: recursive doubling for short
messages (MPICH below 2 KiB), where latency dominates, and a bandwidth-optimal
reduce-scatter plus allgather (Rabenseifner's) for long ones. A tuned library runs the
faster of the two, so the model is their minimum, with ``alpha`` the latency per message
and the slowest NIC's rate ``B min_r f_r`` (every round waits for it):

* recursive doubling: ``R(p) (alpha + n / B')`` with ``R = log2 p`` rounds of the whole
  payload, or ``floor(log2 p) + 2`` when ``p`` is not a power of two (one message folds
  the surplus ranks in and one folds them out again, as MPICH does);
* Rabenseifner: ``2 (p-1)/p n / B' + 2 ceil(log2 p) alpha``.

Without latency the second is never slower, so the bandwidth-only (fluid) time is
Rabenseifner's, ``T_ff / min_r f_r``.
"""

from __future__ import annotations

import math

import numpy as np

from optcc_mpi.errors import ArgumentError
from optcc_mpi.links import Links

__all__ = [
    "fractions",
    "fault_free",
    "lower_bound",
    "library_allreduce",
    "recursive_doubling_rounds",
]


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


def recursive_doubling_rounds(p: int) -> int:
    """Messages on the critical path of a recursive-doubling AllReduce on ``p`` ranks:
    ``log2 p``, or ``floor(log2 p) + 2`` when ``p`` is not a power of two (0 for one rank)."""
    if p < 2:
        return 0
    k = p.bit_length() - 1  # floor(log2 p), exact for ints
    return k if p == 1 << k else k + 2


def library_allreduce(
    p: int,
    nbytes: float,
    bw: float | None,
    links: Links | str | None = None,
    *,
    latency: float = 0.0,
) -> float:
    """Modelled time of the library's own AllReduce of ``nbytes`` per rank (module
    docstring): the faster of recursive doubling and Rabenseifner's algorithm, held back
    by the slowest NIC, with ``latency`` seconds per message.

    Parameters
    ----------
    p : int
        Ranks.
    nbytes : float
        Payload bytes per rank.
    bw : float or None
        Healthy NIC rate in bytes/s; None (or 0): no bandwidth term, latency only.
    links : Links or str, optional
        Link profile; the slowest rank's fraction scales ``bw``.
    latency : float
        Seconds per message (alpha).

    Examples
    --------
    p = 8, 1 MB, 1 GB/s, 5 us: Rabenseifner, ``1.75 ms + 6 x 5 us``; for 128 bytes,
    recursive doubling, ``3 x (5 us + 0.128 us)``.

    >>> round(library_allreduce(8, 1e6, 1e9, latency=5e-6) * 1e3, 3)
    1.78
    >>> round(library_allreduce(8, 128, 1e9, latency=5e-6) * 1e6, 3)
    15.384
    """
    if p < 2:
        return 0.0
    if nbytes < 0:
        raise ArgumentError(f"the payload must be >= 0 bytes, got {nbytes}")
    if not (latency >= 0 and math.isfinite(latency)):
        raise ArgumentError(f"latency must be a finite number >= 0, got {latency}")
    if bw is not None and not (bw >= 0 and math.isfinite(bw)):
        raise ArgumentError(f"bandwidth must be a finite number > 0, got {bw}")
    rate = bw * float(fractions(links, p).min()) if bw else None
    per_byte = 1.0 / rate if rate else 0.0
    doubling = recursive_doubling_rounds(p) * (latency + nbytes * per_byte)
    rabenseifner = 2.0 * (p - 1) / p * nbytes * per_byte + 2 * math.ceil(math.log2(p)) * latency
    return min(doubling, rabenseifner)
