"""Out of place without a copy: the executor's static analysis of where each operation
reads the input from (``optcc_mpi.executor._Sourcing``), checked without MPI.

Each rank's program is run symbolically, one operation at a time in a random order its
dependencies allow: element values are 64-bit tokens, a received message is a token per
operation, and a reduction mixes its two operands in order (so swapped operands, a lost
write or a read of the wrong buffer all change the result). Run in place (buffer 0 starts
as the input) and out of place as the analysis directs (buffer 0 starts as garbage; sends,
reductions and copies read the source where it says; its up-front and final copies), every
message sent and every final buffer must be the same. The MPI tests of the real executor
are in ``tests/test_executor.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from optcc_mpi import algorithms
from optcc_mpi.executor import PIECES, SOURCE, _flattened, _Sourcing
from optcc_mpi.links import Links
from optcc_mpi.schedule import COLL, COPY, RECV, RECV_REDUCE, REDUCE, SEND, ScheduleBuilder
from optcc_mpi.verify import verify

_K1, _K2, _K3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(7)


def _mix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """An order-dependent combination of two token arrays (the reduction)."""
    with np.errstate(over="ignore"):
        return a * _K1 + b * _K2 + _K3


def _token(op: int, n: int) -> np.ndarray:
    """What op ``op`` receives (a message, or a COLL's contribution of the others)."""
    return (np.arange(n, dtype=np.uint64) + np.uint64(1000 * op + 17)) * _K2


def _order(flat: object, seed: int) -> list[int]:
    """A random order the dependencies allow."""
    rng = np.random.default_rng(seed)
    waiting = list(flat.waiting)
    ready = [i for i in range(flat.n) if waiting[i] == 0]
    out = []
    while ready:
        i = ready.pop(int(rng.integers(len(ready))))
        out.append(i)
        for d in flat.dependents[i]:
            waiting[d] -= 1
            if waiting[d] == 0:
                ready.append(d)
    assert len(out) == flat.n
    return out


def _run(flat: object, scratch: int, order: list[int], sourcing: _Sourcing | None) -> tuple:
    """The program run symbolically: (messages sent by op, buffer 0, scratch)."""
    count = flat.count
    source = np.arange(1, count + 1, dtype=np.uint64) * _K1
    garbage = np.arange(count, dtype=np.uint64) + np.uint64(0xDEAD0000)
    bufs = {0: source.copy() if sourcing is None else garbage, 1: np.zeros(scratch, np.uint64)}
    bufs[SOURCE] = source
    rbuf, sbuf = (flat.buf, flat.sbuf) if sourcing is None else (sourcing.rbuf, sourcing.sbuf)
    if sourcing is not None:
        for lo, hi in sourcing.pre:
            bufs[0][lo:hi] = source[lo:hi]
    sent = {}
    for i in order:
        k, b, lo, hi, slo = flat.kind[i], flat.buf[i], flat.lo[i], flat.hi[i], flat.slo[i]
        target = bufs[b][lo:hi]
        if k == SEND:
            sent[i] = bufs[rbuf[i]][lo:hi].copy()
            continue
        if k == COPY:
            target[...] = bufs[sbuf[i]][slo : slo + hi - lo].copy()
            continue
        if k == RECV:
            target[...] = _token(i, hi - lo)
            continue
        operand = (
            _token(i, hi - lo)
            if k in (RECV_REDUCE, COLL)
            else bufs[sbuf[i]][slo : slo + hi - lo].copy()
        )
        if rbuf[i] == PIECES:
            for a, z, early in sourcing.pieces[i]:
                first = source[a:z] if early else target[a - lo : z - lo]
                target[a - lo : z - lo] = _mix(first, operand[a - lo : z - lo])
        else:
            target[...] = _mix(bufs[rbuf[i]][lo:hi], operand)
    if sourcing is not None:
        for lo, hi in sourcing.post:
            bufs[0][lo:hi] = source[lo:hi]
    return sent, bufs[0], bufs[1]


def _same(flat: object, scratch: int, seed: int) -> _Sourcing:
    sourcing = flat.sourced()
    for s in (seed, seed + 1):
        order = _order(flat, s)
        want_sent, want, want_scratch = _run(flat, scratch, order, None)
        got_sent, got, got_scratch = _run(flat, scratch, order, sourcing)
        assert got_sent.keys() == want_sent.keys()
        for i in want_sent:
            np.testing.assert_array_equal(got_sent[i], want_sent[i], err_msg=f"message of op {i}")
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got_scratch, want_scratch)
    return sourcing


def _profiles(p: int) -> list[dict[int, float]]:
    return [{}, {0: 0.5}, {p - 1: 0.3}, {0: 0.5, 1: 0.25} if p > 2 else {1: 0.7}]


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("name", sorted(algorithms.names()))
def test_every_algorithm_reads_the_source_as_in_place(name: str, p: int) -> None:
    """Every registered algorithm, several link profiles and sizes, every rank: the same
    messages and results in place and out of place, and nothing copied up front or at the
    end but the library's own AllReduce's range (it reduces in place)."""
    for links in _profiles(p):
        for count in (1, p + 1, 1009, 70_001):
            small = {"chunk_bytes": 4096} if "chunk_bytes" in algorithms.get(name).params else {}
            sched = algorithms.build(name, p, count, Links(links), itemsize=4, **small)
            for rank in range(p):
                flat = _flattened(sched, rank, 4)
                sourcing = _same(flat, sched.scratch, seed=rank + count)
                colls = [(lo, hi) for k, lo, hi in zip(flat.kind, flat.lo, flat.hi) if k == COLL]
                assert sourcing.pre == colls, (links, count, rank)
                assert sourcing.post == []  # an AllReduce writes every element
                if name != "native":  # some operation reads the input straight from it
                    assert SOURCE in sourcing.rbuf, (links, count, rank)


def _awkward(p: int = 2) -> object:
    """A program on two ranks (not an AllReduce) with every case of the analysis: a send,
    a receive-and-reduce and a copy of untouched input; a copy of written data; a copy's
    operand and a send read partly before their first write; a reduction whose target is
    partly written already; a COLL over written and untouched elements; elements nothing
    writes."""
    b = ScheduleBuilder(p, 70, "awkward", scratch=38)
    last = []
    for r in range(p):
        q = 1 - r
        s0 = b.send(r, q, 0, 16)
        r0 = b.recv(r, q, 16, 32, reduce=True)
        b.copy(r, 32, 38, 64, buf=1)  # never written: from the source
        c0 = b.copy(r, 0, 16, 16, buf=1, deps=[r0])  # written already: from buffer 0
        c1 = b.copy(r, 16, 32, 8, buf=1, deps=[r0])  # [8, 16) untouched, [16, 24) written
        red = b.reduce(r, 10, 30, 0, sbuf=1, deps=[c0, c1, s0])
        b.send(r, q, 20, 40, chan=1, deps=[red])  # [20, 32) written, [32, 40) untouched
        last.append(int(b.recv(r, q, 40, 60, chan=1, reduce=True)))
    b.coll(50, 64, deps=[np.array(last)])  # [50, 60) written, [60, 64) untouched
    return b.build()


def test_every_case_of_the_analysis() -> None:
    sched = _awkward()
    # Race-free (the analysis relies on it): the verifier's race rule passes, and its
    # execution rule, which runs only then, objects only that this is no AllReduce.
    report = verify(sched, raise_on_error=False)
    assert report.errors and not any(e.startswith(("race", "matching")) for e in report.errors)
    for rank in range(2):
        flat = _flattened(sched, rank, 8)
        sourcing = _same(flat, sched.scratch, seed=3)
        # up front: the copy's operand [8, 16), the send's [32, 40), the COLL's [60, 64)
        assert sourcing.pre == [(8, 16), (32, 40), (60, 64)]
        assert sourcing.post == [(0, 8), (64, 70)]
        kinds = flat.kind
        first_send = kinds.index(SEND)
        first_rr = kinds.index(RECV_REDUCE)
        assert sourcing.rbuf[first_send] == SOURCE and sourcing.rbuf[first_rr] == SOURCE
        red = kinds.index(REDUCE)
        assert sourcing.rbuf[red] == PIECES
        assert sourcing.pieces[red] == [(10, 16, True), (16, 30, False)]
        copies = [i for i, k in enumerate(kinds) if k == COPY]
        assert [sourcing.sbuf[i] for i in copies] == [SOURCE, 0, 0]


def test_analysis_is_cached_per_plan() -> None:
    sched = algorithms.build("ring", 4, 4096, Links(), itemsize=4)
    flat = _flattened(sched, 1, 4)
    assert flat.sourcing is None  # made on the first call out of place only
    assert flat.sourced() is flat.sourced()
    assert RECV in flat.kind or RECV_REDUCE in flat.kind
