"""``s="auto"``: the steps per outer iteration that the cost model says are fastest.

Derived (ours; ``docs/casgd.md`` section 5). Per SGD step, CA-SGD with ``s`` steps per
outer iteration on ``P`` ranks costs its outer iteration's compute and one AllReduce,
divided by ``s``::

    t(s) = [ gamma * flops(s) + T_lib(P, bytes(s)) ] / s

    flops(s) = 2 b^2 s(s-1)/2 n_p        the lower Gram blocks (the full layout: 2 (sb)^2 n_p)
             + 4 s b n_p K               the margin and gradient GEMVs (K outputs)
             + 2 b^2 s(s-1)/2 K          the recurrence's correction sums
    bytes(s) = itemsize * (s b K + b^2 s(s-1)/2)      (the full layout: (sb)^2 Gram words)

with ``n_p`` the widest rank's columns, ``gamma`` seconds per flop of this machine's
float32 GEMM and ``T_lib`` the one model of the library's AllReduce
(:func:`optcc_mpi.model.library_allreduce`). The latency term falls like ``1/s`` and the
Gram term grows like ``s``, so ``t`` has one minimum; ``s`` is its argmin over ``1 ..
s_max``. On one process there is no AllReduce (``T_lib = 0``) and ``t`` grows with ``s``:
``s = 1``, plain SGD, whose lower-layout "Gram" is empty.

The network: the emulated one when the run emulates one (what the pacer charges), else
measured once per fit on the group itself (:func:`measure_network`: the latency from
AllReduces of 8 bytes, the bandwidth from one of 1 MiB). ``gamma``: one timed GEMM of
the largest candidate's Gram shape on this rank's kernels (:func:`measure_gamma`). Every
rank measures; the slowest rank's figures decide, and the choice is the same on every
rank (it is computed from the gathered figures). The choice changes the iterates only by
roundoff (every ``s`` gives SGD's iterates in exact arithmetic).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..emulation import Emulation
from ..model import library_allreduce, recursive_doubling_rounds

__all__ = ["S_MAX", "choose_s", "measure_gamma", "measure_network", "step_time"]

#: The largest ``s`` that ``"auto"`` considers.
S_MAX = 64


def _flops_bytes(s: int, b: int, n_local: int, outputs: int, layout: str) -> tuple[float, int]:
    pairs = b * b * s * (s - 1) // 2  # entries of the strictly block-lower Gram
    gram = 2.0 * pairs * n_local if layout == "lower" else 2.0 * (s * b) ** 2 * n_local
    flops = gram + 4.0 * s * b * n_local * outputs + 2.0 * pairs * outputs
    words = s * b * outputs + (pairs if layout == "lower" else (s * b) ** 2)
    return flops, words


def step_time(
    s: int,
    *,
    p: int,
    b: int,
    n_local: int,
    outputs: int = 1,
    latency: float,
    bw: float | None,
    gamma: float,
    layout: str = "lower",
    itemsize: int = 4,
) -> float:
    """Modelled seconds per SGD step of CA-SGD with ``s`` steps per AllReduce (module
    docstring)."""
    flops, words = _flops_bytes(s, b, n_local, outputs, layout)
    comm = library_allreduce(p, words * itemsize, bw, latency=latency) if p > 1 else 0.0
    return (gamma * flops + comm) / s


def choose_s(
    *,
    p: int,
    b: int,
    n_local: int,
    outputs: int = 1,
    latency: float,
    bw: float | None,
    gamma: float,
    s_max: int = S_MAX,
    layout: str = "lower",
    itemsize: int = 4,
) -> int:
    """The ``s`` in ``1 .. s_max`` with the smallest :func:`step_time` (the smallest such
    ``s`` when several are within 1% of it: fewer Gram flops for the same time)."""
    if p < 2 or s_max <= 1:
        return 1
    times = [
        step_time(
            s,
            p=p,
            b=b,
            n_local=n_local,
            outputs=outputs,
            latency=latency,
            bw=bw,
            gamma=gamma,
            layout=layout,
            itemsize=itemsize,
        )  # fmt: skip
        for s in range(1, s_max + 1)
    ]
    best = min(times)
    return next(s for s, t in enumerate(times, start=1) if t <= best * 1.01)


def measure_network(reduce: Callable[[np.ndarray], Any], p: int) -> tuple[float, float | None]:
    """Latency per message and bandwidth of ``reduce`` (the library's AllReduce over the
    group; collective), fitted to :func:`optcc_mpi.model.library_allreduce`: the median
    of 7 AllReduces of 8 bytes gives ``latency`` (recursive doubling's ``R(p)`` messages),
    one of 1 MiB then the bandwidth of its remaining time (None when none remains)."""
    small = np.zeros(2, dtype=np.float32)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        reduce(small)
        times.append(time.perf_counter() - t0)
    latency = float(np.median(times)) / max(1, recursive_doubling_rounds(p))
    big = np.zeros(1 << 18, dtype=np.float32)
    t0 = time.perf_counter()
    reduce(big)
    elapsed = time.perf_counter() - t0
    # Rabenseifner's form for 1 MiB: 2 ceil(log2 p) latencies plus 2(p-1)/p n / bw.
    rest = elapsed - 2 * int(np.ceil(np.log2(p))) * latency
    bw = 2.0 * (p - 1) / p * big.nbytes / rest if rest > 0 else None
    return latency, bw


def measure_gamma(gram: Callable[[], Any], flops: float) -> float:
    """Seconds per flop of ``gram()`` (a callable running one local Gram product of
    ``flops`` flops, synchronised), the fastest of 3 runs after a warm-up."""
    gram()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        gram()
        best = min(best, time.perf_counter() - t0)
    return best / max(flops, 1.0)


def network_of(emulate: Emulation | None) -> tuple[float, float | None] | None:
    """The emulated network's latency and bandwidth, or None when nothing is emulated."""
    if emulate is None or not (emulate.latency or emulate.bw):
        return None
    return float(emulate.latency), emulate.bw
