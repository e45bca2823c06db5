"""Symbolic verification of a schedule.

The verifier runs a schedule without data: every element range carries the *set of ranks
whose contributions it holds* (a bit mask). It proves, for the given ``p`` and ``count``:

1. **Matching**: every send meets a receive of the same length (per queue, in order).
2. **No deadlock**: executing the programs under the executor's rules (an operation
   starts when its dependencies completed and the earlier operations of its queue were
   posted; a message completes when both sides are posted; ``COLL`` when every rank has
   posted it) completes every operation. Because these rules never block a rank on a
   single operation, this covers every interleaving MPI may choose.
3. **No races**: two operations of one rank that touch overlapping elements, one of them
   writing, are ordered by a dependency path. With (2), the result cannot depend on
   message timing, which is what makes results bit-identical from run to run.
4. **Exactly once**: no reduction ever combines two ranges holding the same rank's
   contribution, no operation reads elements holding no contribution, and at the end
   every element of every rank's buffer holds every contribution.

Masks are arrays of 64-bit words, so any ``p`` works. Ranges are handled as elementary
segments (the common refinement of every range boundary), so the cost does not depend
on ``count``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from optcc_mpi.errors import VerificationError
from optcc_mpi.schedule import (
    COLL,
    COPY,
    KIND_NAMES,
    RECV,
    RECV_REDUCE,
    REDUCE,
    SEND,
    Schedule,
)

__all__ = ["VerificationError", "Report", "verify"]


@dataclass
class Report:
    """Outcome of :func:`verify`."""

    name: str
    p: int
    count: int
    n_ops: int
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def __str__(self) -> str:
        head = f"{self.name} p={self.p} count={self.count} ops={self.n_ops}"
        if self.ok:
            return f"{head}: verified (matching, no deadlock, no races, exactly once)"
        return f"{head}: {len(self.errors)} error(s)\n  " + "\n  ".join(self.errors[:20])


def verify(schedule: Schedule, *, raise_on_error: bool = True, max_errors: int = 20) -> Report:
    """Verify ``schedule``; see the module docstring for what is proven.

    Parameters
    ----------
    schedule : Schedule
        The schedule to check.
    raise_on_error : bool
        Raise :class:`VerificationError` on the first failed rule (with up to
        ``max_errors`` messages) instead of returning a failed report.
    max_errors : int
        Errors collected per rule before it stops looking (matching, then races, then
        execution: a rule runs only when those before it passed).

    Returns
    -------
    Report
        ``ok`` and the errors found; with ``raise_on_error`` only a passing one.

    Raises
    ------
    VerificationError
        With ``raise_on_error``, when a rule fails; the message is the report.
    """
    rep = Report(schedule.name, schedule.p, schedule.count, schedule.n_ops)
    try:
        partner = schedule.partner
    except ValueError as exc:
        rep.errors.append(f"matching: {exc}")
    else:
        seg = _Segments(schedule)
        _check_races(schedule, seg, rep, max_errors)
        if rep.ok:
            _execute(schedule, seg, partner, rep, max_errors)
    if raise_on_error and not rep.ok:
        raise VerificationError(str(rep))
    return rep


# -- elementary segments --------------------------------------------------------------------
class _Segments:
    """Maps element ranges of each buffer to runs of elementary segments."""

    def __init__(self, s: Schedule) -> None:
        length = s.hi - s.lo
        pts: list[set[int]] = [{0, s.count}, {0, s.scratch}]
        for b in (0, 1):
            mine = s.buf == b
            pts[b].update(s.lo[mine].tolist())
            pts[b].update(s.hi[mine].tolist())
            src = np.isin(s.kind, (COPY, REDUCE)) & (s.sbuf == b)
            pts[b].update(s.slo[src].tolist())
            pts[b].update((s.slo[src] + length[src]).tolist())
        # A transfer or local copy whose source and target offsets differ must carry every
        # boundary of one side over to the other, until nothing changes.
        moves = self._moves(s, length)
        changed = bool(moves)
        while changed:
            changed = False
            for sb, slo, db, dlo, n in moves:
                for src_b, src_lo, dst_b, dst_lo in ((sb, slo, db, dlo), (db, dlo, sb, slo)):
                    inner = [x for x in pts[src_b] if src_lo < x < src_lo + n]
                    for x in inner:
                        y = x - src_lo + dst_lo
                        if y not in pts[dst_b]:
                            pts[dst_b].add(y)
                            changed = True
        self.bounds = [np.array(sorted(x), dtype=np.int64) for x in pts]
        self.size = [max(0, b.size - 1) for b in self.bounds]

    @staticmethod
    def _moves(s: Schedule, length: np.ndarray) -> list[tuple[int, int, int, int, int]]:
        moves = []
        sends = np.flatnonzero(s.kind == SEND)
        part = s.partner[sends] if sends.size else sends
        for a, b in zip(sends.tolist(), part.tolist()):
            if s.lo[a] != s.lo[b] or s.buf[a] != s.buf[b]:
                moves.append(
                    (int(s.buf[a]), int(s.lo[a]), int(s.buf[b]), int(s.lo[b]), int(length[a]))
                )
        for a in np.flatnonzero(np.isin(s.kind, (COPY, REDUCE))).tolist():
            if s.slo[a] != s.lo[a] or s.sbuf[a] != s.buf[a]:
                moves.append(
                    (int(s.sbuf[a]), int(s.slo[a]), int(s.buf[a]), int(s.lo[a]), int(length[a]))
                )
        return moves

    def run(self, buf: int, lo: int, hi: int) -> tuple[int, int]:
        """Segment indices ``[a, b)`` covering elements ``[lo, hi)`` of buffer ``buf``."""
        bnd = self.bounds[buf]
        return int(np.searchsorted(bnd, lo)), int(np.searchsorted(bnd, hi))


def _accesses(s: Schedule, op: int) -> list[tuple[int, int, int, bool]]:
    """(buffer, lo, hi, writes) for each range ``op`` touches."""
    kind = int(s.kind[op])
    buf, lo, hi = int(s.buf[op]), int(s.lo[op]), int(s.hi[op])
    if kind == SEND:
        return [(buf, lo, hi, False)]
    if kind in (COPY, REDUCE):
        n = hi - lo
        return [(int(s.sbuf[op]), int(s.slo[op]), int(s.slo[op]) + n, False), (buf, lo, hi, True)]
    return [(buf, lo, hi, True)]  # RECV, RECV_REDUCE, COLL write (the latter two also read)


# -- rule 3: races --------------------------------------------------------------------------
def _check_races(s: Schedule, seg: _Segments, rep: Report, max_errors: int) -> None:
    for rank in range(s.p):
        ids = s.op_ids(rank).tolist()
        local = {g: i for i, g in enumerate(ids)}
        deps = [[local[d] for d in s.deps(g).tolist()] for g in ids]
        # Ancestor sets as Python integers used as bit sets over the rank's local ops. An
        # op's set is needed only until its last dependant has been seen: dropping it then
        # keeps the live sets to the program's frontier (all of them at once took 16 GiB
        # for R2CCL's helper of 516 thousand operations, p = 128, a random vector).
        last_use = list(range(len(ids)))
        for i, ds in enumerate(deps):
            for j in ds:
                last_use[j] = i
        anc: dict[int, int] = {}
        last_write: dict[tuple[int, int], int] = {}
        reads: dict[tuple[int, int], list[int]] = {}
        for i, g in enumerate(ids):
            mine = 0
            for j in deps[i]:
                mine |= anc[j] | (1 << j)
            for j in deps[i]:
                if last_use[j] == i:
                    anc.pop(j, None)
            if last_use[i] > i:
                anc[i] = mine
            for buf, lo, hi, writes in _accesses(s, g):
                a, b = seg.run(buf, lo, hi)
                for k in range(a, b):
                    key = (buf, k)
                    w = last_write.get(key)
                    if w is not None and not (mine >> w) & 1:
                        _race(s, rep, rank, ids[w], g, seg, buf, k)
                    if writes:
                        for r in reads.get(key, ()):
                            if r != i and not (mine >> r) & 1:
                                _race(s, rep, rank, ids[r], g, seg, buf, k)
                        last_write[key] = i
                        reads[key] = []
                    else:
                        reads.setdefault(key, []).append(i)
                if len(rep.errors) >= max_errors:
                    return


def _race(
    s: Schedule, rep: Report, rank: int, a: int, b: int, seg: _Segments, buf: int, k: int
) -> None:
    lo, hi = seg.bounds[buf][k], seg.bounds[buf][k + 1]
    msg = (
        f"race on rank {rank}: {_op(s, a)} and {_op(s, b)} both touch buffer {buf} "
        f"[{lo}, {hi}) and are not ordered by dependencies"
    )
    if msg not in rep.errors:
        rep.errors.append(msg)


def _op(s: Schedule, g: int) -> str:
    kind = int(s.kind[g])
    text = f"op {g} ({KIND_NAMES[kind]}"
    if kind in (SEND, RECV, RECV_REDUCE):
        text += f" {'to' if kind == SEND else 'from'} {s.peer[g]} ch {s.chan[g]}"
    return text + f" [{s.lo[g]}, {s.hi[g]}))"


# -- rules 2 and 4: execution ----------------------------------------------------------------
def _execute(
    s: Schedule, seg: _Segments, partner: np.ndarray, rep: Report, max_errors: int
) -> None:
    """Run ``s`` on contribution masks: whether every operation completes (rule 2) and
    whether every element ends with every contribution exactly once (rule 4). Appends
    to ``rep``; stops early at ``max_errors`` errors, or at the first collective whose
    ranges differ between ranks (nothing after it can be trusted)."""
    run = _Execution(s, seg, partner, rep)
    if not run.run(max_errors):
        return
    if run.completed < s.n_ops:
        _report_deadlock(s, run, rep)
        return
    _check_complete(s, seg, run.state[0], rep, max_errors)


class _Execution:
    """The executor's rules played on masks (module docstring, rules 2 and 4): per rank
    and buffer, the set of ranks whose contributions each elementary segment holds, and
    which operations are posted and done.

    An operation is *ready* when its dependencies completed and the operation before it
    in its queue was posted; ready operations are posted from a work list in the order
    they became ready. Rule 3 passed before this runs, so that order cannot change what
    any operation reads."""

    def __init__(self, s: Schedule, seg: _Segments, partner: np.ndarray, rep: Report) -> None:
        self.s, self.seg, self.partner, self.rep = s, seg, partner, rep
        words = (s.p + 63) // 64
        # Every rank starts with its own contribution in every element of its buffer.
        self.state = [np.zeros((s.p, n, words), dtype=np.uint64) for n in seg.size]
        for r in range(s.p):
            a, b = seg.run(0, 0, s.count)
            self.state[0][r, a:b, r // 64] = np.uint64(1) << np.uint64(r % 64)
        n = s.n_ops
        # Python lists: the loop below touches them one element at a time.
        self.kind = s.kind.tolist()
        self.rank = s.rank.tolist()
        self.waiting = np.diff(s.dep_ptr).tolist()
        self.qprev = s.queue_prev.tolist()
        self.qnext = [-1] * n
        for i, j in enumerate(self.qprev):
            if j >= 0:
                self.qnext[j] = i
        self.dependents: list[list[int]] = [[] for _ in range(n)]
        for op in range(n):
            for d in s.deps(op).tolist():
                self.dependents[d].append(op)
        self.posted = [False] * n
        self.done = [False] * n
        self.completed = 0
        # Collectives complete in their order on every rank, once every rank posted one.
        self.coll_ops = [s.op_ids(r)[s.kind[s.op_ids(r)] == COLL].tolist() for r in range(s.p)]
        self.coll_posted = [0] * s.p
        self.coll_next = 0  # index of the next collective to complete
        self.work: deque[int] = deque(
            op for op in range(n) if self.waiting[op] == 0 and self.qprev[op] < 0
        )

    def read(self, r: int, buf: int, lo: int, hi: int, op: int) -> np.ndarray:
        """The masks of rank ``r``'s elements ``[lo, hi)`` of ``buf``, as ``op`` reads
        them; an element holding no contribution is an error (rule 4)."""
        a, b = self.seg.run(buf, lo, hi)
        val = self.state[buf][r, a:b].copy()
        if b > a and not np.all(val.any(axis=-1)):
            self.rep.errors.append(
                f"rank {r}: {_op(self.s, op)} reads elements holding no contribution"
            )
        return val

    def write(
        self, r: int, buf: int, lo: int, hi: int, val: np.ndarray, reduce: bool, op: int
    ) -> None:
        """Store ``val`` (``reduce``: combine it) into rank ``r``'s elements; combining a
        contribution already there is an error (rule 4)."""
        a, b = self.seg.run(buf, lo, hi)
        cur = self.state[buf][r, a:b]
        if reduce:
            if np.any(cur & val):
                self.rep.errors.append(
                    f"rank {r}: {_op(self.s, op)} would count a contribution twice "
                    f"(ranks {_ranks(np.bitwise_or.reduce(cur & val, axis=0))})"
                )
            cur |= val
        else:
            cur[...] = val

    def complete(self, op: int) -> None:
        """Mark ``op`` done; queue what became ready through it."""
        self.done[op] = True
        self.completed += 1
        waiting, qprev, posted = self.waiting, self.qprev, self.posted
        for d in self.dependents[op]:
            waiting[d] -= 1
            if waiting[d] == 0 and (qprev[d] < 0 or posted[qprev[d]]):
                self.work.append(d)

    def run(self, max_errors: int) -> bool:
        """Post ready operations until none is left; False where it stopped early (at
        ``max_errors`` errors, or a collective whose ranges differ)."""
        s, kind, rank, posted, work = self.s, self.kind, self.rank, self.posted, self.work
        while work:
            op = work.popleft()
            if posted[op]:
                continue
            posted[op] = True
            k = kind[op]
            if k in (SEND, RECV, RECV_REDUCE):
                self._message(op)
            elif k in (COPY, REDUCE):
                length = int(s.hi[op] - s.lo[op])
                val = self.read(
                    rank[op], int(s.sbuf[op]), int(s.slo[op]), int(s.slo[op]) + length, op
                )
                self.write(
                    rank[op], int(s.buf[op]), int(s.lo[op]), int(s.hi[op]), val, k == REDUCE, op
                )
                self.complete(op)
            elif k == COLL:
                self.coll_posted[rank[op]] += 1
                if not self._collectives():
                    return False
            if len(self.rep.errors) >= max_errors:
                return False
        return True

    def _message(self, op: int) -> None:
        """A send or receive was posted: its queue's next may follow, and the message
        completes if its partner was posted already."""
        s, kind, rank = self.s, self.kind, self.rank
        nxt = self.qnext[op]
        if nxt >= 0 and self.waiting[nxt] == 0:
            self.work.append(nxt)
        other = int(self.partner[op])
        if not self.posted[other]:
            return
        snd, rcv = (op, other) if kind[op] == SEND else (other, op)
        val = self.read(rank[snd], int(s.buf[snd]), int(s.lo[snd]), int(s.hi[snd]), snd)
        self.write(
            rank[rcv],
            int(s.buf[rcv]),
            int(s.lo[rcv]),
            int(s.hi[rcv]),
            val,
            kind[rcv] == RECV_REDUCE,
            rcv,
        )
        self.complete(snd)
        self.complete(rcv)

    def _collectives(self) -> bool:
        """Complete every collective that every rank has posted; False (and an error)
        when one has different ranges on different ranks."""
        s, rep = self.s, self.rep
        while self.coll_next < min(self.coll_posted):
            ops = [self.coll_ops[q][self.coll_next] for q in range(s.p)]
            lo, hi = int(s.lo[ops[0]]), int(s.hi[ops[0]])
            if any(int(s.lo[o]) != lo or int(s.hi[o]) != hi for o in ops):
                rep.errors.append(
                    f"collective {self.coll_next} has different ranges on different ranks"
                )
                return False
            vals = [self.read(q, int(s.buf[o]), lo, hi, o) for q, o in enumerate(ops)]
            total = np.zeros_like(vals[0])
            for q, v in enumerate(vals):
                if np.any(total & v):
                    rep.errors.append(
                        f"collective {self.coll_next}: rank {q} adds a contribution twice"
                    )
                total |= v
            for q, o in enumerate(ops):
                self.write(q, int(s.buf[o]), lo, hi, total, False, o)
            self.coll_next += 1
            for o in ops:
                self.complete(o)
        return True


def _report_deadlock(s: Schedule, run: _Execution, rep: Report) -> None:
    """Rule 2 failed: how many operations never complete, and why for the first five
    (a dependency not done, a queue blocked behind an unposted operation, or a partner
    never posted)."""
    n = s.n_ops
    done, posted, qprev, partner = run.done, run.posted, run.qprev, run.partner
    stuck = [op for op in range(n) if not done[op]]
    rep.errors.append(f"deadlock: {len(stuck)} of {n} operations never complete")
    for op in stuck[:5]:
        why = []
        deps_left = [d for d in s.deps(op).tolist() if not done[d]]
        if deps_left:
            why.append(f"waits for {', '.join(_op(s, d) for d in deps_left[:3])}")
        elif qprev[op] >= 0 and not posted[qprev[op]]:
            why.append(f"queued behind {_op(s, qprev[op])}")
        elif partner[op] >= 0:
            why.append(f"partner {_op(s, int(partner[op]))} never posted")
        rep.errors.append(f"  rank {run.rank[op]}: {_op(s, op)} {'; '.join(why)}")


def _check_complete(
    s: Schedule, seg: _Segments, state: np.ndarray, rep: Report, max_errors: int
) -> None:
    """Rule 4 at the end: every element of every rank's buffer (``state``, the masks of
    buffer 0) holds every rank's contribution; the first element without, per rank."""
    full = np.zeros(state.shape[-1], dtype=np.uint64)
    for r in range(s.p):
        full[r // 64] |= np.uint64(1) << np.uint64(r % 64)
    a, b = seg.run(0, 0, s.count)
    for r in range(s.p):
        got = state[r, a:b]
        missing = ~got & full
        if np.any(missing):
            bad = int(np.flatnonzero(np.any(missing, axis=-1))[0])
            lo, hi = seg.bounds[0][a + bad], seg.bounds[0][a + bad + 1]
            rep.errors.append(
                f"rank {r} ends without the contributions of ranks "
                f"{_ranks(missing[bad])} in elements [{lo}, {hi})"
            )
            if len(rep.errors) >= max_errors:
                return


def _ranks(mask: np.ndarray) -> list[int]:
    out = []
    for w, word in enumerate(np.atleast_1d(mask).tolist()):
        for bit in range(64):
            if (int(word) >> bit) & 1:
                out.append(64 * w + bit)
    return out
