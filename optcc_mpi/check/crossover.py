"""Up to which size a short call gathers every rank's data: measured per communicator.

A short ``auto`` call either carries its data in the argument check, so that every rank
gathers every rank's contribution and reduces them in rank order (one collective, of p
times the bytes: :mod:`optcc_mpi.check.protocol`), or sends only the check's header and then
calls the library's own AllReduce (two collectives, of the message's bytes). Which is
faster depends on the machine, the library and p: on one machine gathering 64 KiB at p = 2
cost 1.1x ``MPI_Allreduce``, on another 1.85x. So the largest message that is gathered,
the *gather limit*, is measured on each communicator the first time a call needs it
(:func:`decide`): a power of two between :data:`~optcc_mpi.check.state.FOLD_MIN` and
``FOLD_TOTAL / p``, cached on the communicator's state.

The measurement (:func:`measure`) is collective and cheap (about 3 ms at p = 2 on shared
memory, once per communicator): for every room the check can have, the two ways of moving
a message that fills it, each timed over a few calls, back to back, room by room, in a few
repetitions. Every rank takes the element-wise maximum over the ranks of the times (a
collective is as slow as its slowest member), so every rank holds the same numbers and
takes the same decisions from them:

* per size, a verdict (:func:`verdicts`): the median over the repetitions of the ratio of
  the two ways' times *in the same repetition* (both saw the same load), if the
  repetitions agree on which way is faster (:data:`AGREE` of them), else a tie;
* repetitions are added while some size has no verdict, up to :data:`MOST` or
  :data:`BUDGET` seconds of measuring (fewer than :data:`FIRST`: no verdicts at all);
* the limit (:func:`choose`): the one that costs least in all, summed over the sizes, of
  being slower than the faster way by more than :data:`TOLERANCE`; among equals the
  largest (preferring to gather: one collective, and a rank-order reduction).

Under load, repetitions disturbed at random disagree, and a size without a verdict counts
as a tie, which leaves it to gathering (what every call did before anything was
measured); one disturbed repetition cannot flip a verdict, and one disturbed size cannot
move the limit past sizes measured clearly. The measurement stops after its budget however
loaded the machine is.

``$OPTCC_GATHER_LIMIT`` (a size, e.g. ``16K``; ``0`` for the least) fixes the limit
instead: for results that must not depend on a measurement (the library's AllReduce may
reduce in another order than rank order at p > 2), or to compare. It must be the same on
every rank (checked when first used, with the same error on every rank). Over
torch.distributed the limit stays the largest room unless set: ``FOLD_TOTAL / p``, or
the transport's :attr:`~optcc_mpi.transports.Transport.gather_total` over p where its
gather is cheap (ranks on one machine sharing a board, :mod:`optcc_mpi.transports.board`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from optcc_mpi import config
from optcc_mpi.arrays import NUMPY
from optcc_mpi.check import fastcall
from optcc_mpi.check.state import FOLD_MIN, HEADER_BYTES, CheckState, rooms, served
from optcc_mpi.errors import ArgumentError
from optcc_mpi.transports.base import Transport
from optcc_mpi.units import format_size, parse_size

__all__ = [
    "TOLERANCE",
    "static",
    "decide",
    "measure",
    "verdicts",
    "choose",
    "describe",
]

#: A limit whose worst case is within this factor of the best is as good as the best
#: (then the largest such limit is chosen: gathering is one collective).
TOLERANCE = 1.05
#: Calls timed together; the least repetitions for a verdict, and the most.
CALLS, FIRST, MOST = 3, 3, 15
#: Seconds of measuring (the agreed times, summed) after which no repetition is added.
BUDGET = 0.05
#: Share of the repetitions that must agree on which way is faster at a size.
AGREE = 0.75
#: One way of moving a message: ``way(x, y)`` reduces ``x`` into ``y`` over the ranks.
Way = Callable[[np.ndarray, np.ndarray], object]


def static(p: int) -> int:
    """The limit where nothing is measured: the largest room."""
    return rooms(p)[-1]


def decide(st: CheckState) -> int:
    """The communicator's gather limit, decided now if it is not yet (collective then:
    every rank must call it at the same call, which every rank does since the calls that
    need it are agreed). Raises ArgumentError on every rank if ``$OPTCC_GATHER_LIMIT``
    differs across ranks or does not parse."""
    if st.gather_limit is not None:
        return st.gather_limit
    choices = list(rooms(st.size, total=st.transport.gather_total))
    text = config.rc.gather_limit
    wanted, err = -1, None
    if text is not None:
        try:
            wanted = parse_size(text)
        except ArgumentError as exc:
            err = exc
    # One small collective agrees on the setting, errors included, before anyone measures.
    mine = np.array([wanted, -wanted, err is not None], dtype=np.int64)
    st.transport.allreduce_max(mine)
    if err is not None:
        raise ArgumentError(f"$OPTCC_GATHER_LIMIT={text!r}: {err}")
    if mine[2]:
        raise ArgumentError("$OPTCC_GATHER_LIMIT does not parse on some rank")
    if mine[0] != -mine[1]:
        raise ArgumentError(
            f"$OPTCC_GATHER_LIMIT differs across ranks (from {-mine[1]} to {mine[0]} bytes, "
            "-1: unset); set it alike on every rank"
        )
    if wanted >= 0:
        limit = max([c for c in choices if c <= wanted] or [FOLD_MIN])
    elif not isinstance(st.transport, fastcall.Compilable) or st.size < 2:
        limit = choices[-1]
    else:
        ratio = verdicts(measure(st.transport, choices))
        limit = choose(choices, ratio, np.ones_like(ratio))
    st.decide_limit(limit)
    return limit


def measure(transport: Transport, sizes: list[int]) -> np.ndarray:
    """Seconds per call of the two ways (module docstring) at each size, per repetition:
    shape (repetitions, 2, sizes), way 0 gathering the check's block with the data and
    reducing the rows in rank order, way 1 gathering the header then calling the library's
    AllReduce. Each entry is the maximum over the ranks (a collective is as slow as its
    slowest member), so every rank holds the same array. Repetitions are added one at a
    time until every size has a verdict (:func:`verdicts`; at least :data:`FIRST`
    repetitions), up to :data:`MOST` of them or :data:`BUDGET` seconds of measuring; the
    decision to go on is taken from the agreed times, so every rank takes it alike.
    Collective."""
    cases = _cases(transport, sizes)
    runs: list[np.ndarray] = []
    while True:
        ns = np.ceil(_repetition(cases) * 1e9).astype(np.int64)
        transport.allreduce_max(ns)
        runs.append(ns.reshape(1, 2, len(sizes)).astype(np.float64) * 1e-9)
        times = np.concatenate(runs)
        spent = float(times.sum()) * CALLS
        if len(times) >= MOST or spent >= BUDGET:
            return times
        if len(times) >= FIRST and _settled(times):
            return times


def verdicts(times: np.ndarray) -> np.ndarray:
    """Per size, how much slower gathering is than the library way (< 1: faster): the
    median over the repetitions of the ratio of the two ways' times in the same
    repetition (so that both saw the same load), or 1 (a tie) where the repetitions do not
    agree on which is faster, or are fewer than :data:`FIRST` (the budget ran out first):
    load that disturbs the measurement leaves those sizes to gathering, as they were
    before anything was measured."""
    ratio = times[:, 0, :] / np.maximum(times[:, 1, :], 1e-12)
    median = np.median(ratio, axis=0)
    if len(times) < FIRST:
        return np.ones_like(median)
    return np.where(_agreed(ratio, median), median, 1.0)


def _agreed(ratio: np.ndarray, median: np.ndarray) -> np.ndarray:
    """Per size: the repetitions agree (AGREE of them on the median's side of 1), or it is
    a tie within TOLERANCE (either way is as good)."""
    tie = np.abs(np.log(np.maximum(median, 1e-12))) <= np.log(TOLERANCE)
    side = (ratio < 1) == (median < 1)
    return tie | (side.mean(axis=0) >= AGREE)


def _settled(times: np.ndarray) -> bool:
    ratio = times[:, 0, :] / np.maximum(times[:, 1, :], 1e-12)
    return bool(np.all(_agreed(ratio, np.median(ratio, axis=0))))


class _Case(NamedTuple):
    """One size's buffers and its two ways of moving them."""

    x: np.ndarray
    y: np.ndarray
    gathered: Way
    library: Way


def _cases(transport: Transport, sizes: list[int]) -> list[_Case]:
    """Buffers for both ways at each size, and the two ways as functions of them: the
    compiled call path's own (:mod:`optcc_mpi.check.fastcall`, on contexts of their own) where
    every rank has it, so that what is timed is what the calls will run, else the Python
    path's steps."""
    # Every rank must time the same way: one small collective says whether all can.
    fold = fastcall.fold_function()
    handles = transport.predefined if isinstance(transport, fastcall.Compilable) else None
    flag = np.array([fold is None or handles is None], dtype=np.int64)
    transport.allreduce_max(flag)
    compiled = flag[0] == 0
    cases = []
    for size in sizes:
        x = np.arange(size // 4, dtype=np.float32)
        y = np.empty_like(x)
        if compiled and fold is not None and handles is not None:  # (compiled: both are)
            ways = _compiled_ways(transport, fold, handles, size)
        else:
            ways = _python_ways(transport, size)
        if ways is None:  # pragma: no cover - a context the extension refused
            ways = _python_ways(transport, size)
        for way in ways:  # warm up: first-touch pages, the library's own set-up
            way(x, y)
        cases.append(_Case(x, y, *ways))
    return cases


def _compiled_ways(
    transport: Transport,
    fold: fastcall.FoldCall,
    handles: fastcall.Handles,
    size: int,
) -> tuple[Way, Way] | None:
    """The compiled path's two ways for messages of ``size`` bytes: gathered in a room of
    that size, and the check then the library (a context whose limit is below any size),
    each on check buffers of its own; every rank writes the same header."""
    p = transport.size
    header = (0,) * 12

    def context(room: int, limit: int) -> object | None:
        block = np.zeros(HEADER_BYTES + room, dtype=np.uint8)
        gathered = np.zeros((p, block.size), dtype=np.uint8)
        sizes = served(p, room, limit)
        return fastcall.context(
            transport, block, gathered, room, header, sizes, FOLD_MIN, limit, handles
        )

    folded, checked = context(size, size), context(FOLD_MIN, 0)
    if folded is None or checked is None:
        return None
    return (
        lambda x, y: fold(folded, x, y, 0, True),
        lambda x, y: fold(checked, x, y, 0, True),
    )


def _python_ways(transport: Transport, size: int) -> tuple[Way, Way]:
    """The Python path's steps of the two ways for messages of ``size`` bytes."""
    p = transport.size
    head = np.zeros(HEADER_BYTES + FOLD_MIN, dtype=np.uint8)
    heads = np.zeros((p, head.size), dtype=np.uint8)
    block = np.zeros(HEADER_BYTES + size, dtype=np.uint8)
    rows = np.zeros((p, block.size), dtype=np.uint8)
    data = block[HEADER_BYTES:].view(np.float32)
    kind = fastcall.reduce_kind("float32")

    def gathered(x: np.ndarray, y: np.ndarray) -> None:
        np.copyto(data, x)
        transport.allgather_block(block, rows)
        if kind:
            fastcall.sum_rows(kind, y, rows, HEADER_BYTES)
        else:
            np.copyto(y, rows[0, HEADER_BYTES:].view(np.float32))
            for r in range(1, p):
                np.add(y, rows[r, HEADER_BYTES:].view(np.float32), out=y)

    def library(x: np.ndarray, y: np.ndarray) -> None:
        transport.allgather_block(head, heads)
        np.copyto(y, x)
        transport.allreduce_now(NUMPY, y, "float32", "sum")

    return gathered, library


def _repetition(cases: list[_Case]) -> np.ndarray:
    """This rank's seconds per call in one repetition, shape (2 * sizes,): size by size,
    the two ways back to back (each over CALLS calls); way 0's sizes first."""
    n = len(cases)
    out = np.empty(2 * n)
    clock = time.perf_counter
    first = cases[0]
    first.gathered(first.x, first.y)  # untimed: the ranks leave the last collective apart
    for k, case in enumerate(cases):
        for way, fn in enumerate((case.gathered, case.library)):
            t0 = clock()
            for _ in range(CALLS):
                fn(case.x, case.y)
            out[way * n + k] = (clock() - t0) / CALLS
    return out


def choose(
    sizes: Sequence[int],
    gather: Sequence[float] | np.ndarray,
    library: Sequence[float] | np.ndarray,
    tolerance: float = TOLERANCE,
) -> int:
    """The gather limit from per-size times (or ratios) of the two ways: of the limits
    ``sizes[j]`` (sizes up to it gathered, larger ones by the library), one whose total
    excess is least, the largest of them. A size's excess is how much slower its way is
    than the faster one, as a logarithm, beyond ``tolerance`` (within it, the two are as
    good); the least size is gathered under every limit and does not count. Summing
    rather than taking the worst size keeps one disturbed size from moving the limit
    past sizes that were measured clearly. Pure: the same numbers give the same limit."""
    g = np.asarray(gather, dtype=np.float64)
    lib = np.asarray(library, dtype=np.float64)
    if len(sizes) == 0 or g.shape != (len(sizes),) or lib.shape != g.shape:
        raise ArgumentError("choose: one time per size and way")
    fastest = np.maximum(np.minimum(g, lib), np.finfo(float).tiny)
    slack = np.log(tolerance)
    over_g = np.maximum(np.log(g / fastest) - slack, 0.0)[1:]
    over_l = np.maximum(np.log(lib / fastest) - slack, 0.0)[1:]
    # score[j]: sizes 1..j gathered, j+1.. by the library
    score = np.concatenate([[0.0], np.cumsum(over_g)]) + np.concatenate(
        [np.cumsum(over_l[::-1])[::-1], [0.0]]
    )
    best = np.flatnonzero(score <= score.min() + 1e-12)
    return int(sizes[int(best.max())])


def describe(st: CheckState) -> str:
    """One line on the communicator's limit, for messages and ``info``."""
    if st.gather_limit is None:
        return "gather limit not decided yet"
    return f"gather limit {format_size(st.gather_limit)}"
