"""OptCC's schedule, stage by stage: the builder :func:`optcc_mpi.algorithms.optcc.optcc`
hands its plan to.

The algorithm, its plan (who owns how much, the owners' grid, the segments) and the stages
S1-S4 are described in :mod:`optcc_mpi.algorithms.optcc`, which registers it; this module
only builds what that plan says into a :class:`~optcc_mpi.schedule.ScheduleBuilder`.

Four parts
----------
:class:`_Geometry`
    Where a segment's blocks, sections and scratch regions lie.
:class:`_DirectExchange`
    The owners' direct exchanges along the grid's rows and columns (reduce-scatter,
    all-gather).
:class:`_OwnerFold`, :class:`_ColumnFold`
    The attached ranks' traffic (:class:`_Attached`): a section into every owner (with the
    closer), or a column block into one owner per column.
:class:`Pipeline`
    Runs the stages of every segment in order and paces them.

Operation ids follow the order in which the stages are built, so that order is part of
the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt

from optcc_mpi.schedule import Deps, ScheduleBuilder, split

__all__ = ["Pipeline"]

# Channels: row reduce-scatter, row all-gather, column reduce-scatter, column all-gather,
# folds (attached -> owner), closer exchange, returns (owner -> attached).
_C_ROW_RS, _C_ROW_AG, _C_COL_RS, _C_COL_AG, _C_FOLD, _C_CLOSE, _C_RET = range(7)


@dataclass(frozen=True, eq=False)
class _Geometry:
    """Where each segment's data lies, and the scratch regions (:meth:`of`).

    ``blo``/``bhi`` (column c's block) and ``slo``/``shi`` (the section of the owner in
    row i of column c) are (k, a, nb) arrays indexed like the grid. Scratch holds, per
    phase (row, column), one region per segment slot and peer offset, then the attached
    ranks' raw input, one region per segment slot and attached rank (one per owner's
    slot with the column fold); slots rotate over the ``slots`` segments in flight.
    """

    k: int
    blo: np.ndarray
    bhi: np.ndarray
    slo: np.ndarray
    shi: np.ndarray
    slots: int
    row_base: int
    row_stride: int
    col_base: int
    col_stride: int
    fold_base: int
    fold_stride: int
    scratch_end: int

    @classmethod
    def of(
        cls,
        grid: np.ndarray,
        col_share: np.ndarray,
        seg: np.ndarray,
        *,
        slots: int,
        fold_regions: int,
        fold_blocks: bool,
    ) -> _Geometry:
        """Cut segment boundaries ``seg`` into columns' blocks (by ``col_share``) and
        those into the a sections of their rows; ``fold_regions`` raw regions per slot,
        each a block (``fold_blocks``: the column fold) or a section."""
        a, nb = grid.shape
        k = seg.size - 1
        # Per segment: column c's block, then its a sections (one per row).
        cum = np.concatenate(([0.0], np.cumsum(col_share)))
        lo, hi = seg[:-1, None], seg[1:, None]
        blk = lo + np.round(cum[None, :] * (hi - lo)).astype(np.int64)  # (k, nb + 1)
        blk[:, -1] = seg[1:]
        sec = split(blk[:, :-1], blk[:, 1:], a)  # (k, nb, a + 1)
        # As (k, a, nb) arrays indexed like the grid.
        blo = np.broadcast_to(blk[:, None, :-1], (k, a, nb))
        bhi = np.broadcast_to(blk[:, None, 1:], (k, a, nb))
        slo = np.ascontiguousarray(sec[:, :, :-1].transpose(0, 2, 1))
        shi = np.ascontiguousarray(sec[:, :, 1:].transpose(0, 2, 1))
        max_blk = int(np.max(bhi - blo, initial=0))
        max_sec = int(np.max(shi - slo, initial=0))
        col_base = slots * max(nb - 1, 0) * max_blk
        fold_base = col_base + slots * max(a - 1, 0) * max_sec
        fold_stride = max_blk if fold_blocks else max_sec
        return cls(
            k=k,
            blo=blo,
            bhi=bhi,
            slo=slo,
            shi=shi,
            slots=slots,
            row_base=0,
            row_stride=max_blk,
            col_base=col_base,
            col_stride=max_sec,
            fold_base=fold_base,
            fold_stride=fold_stride,
            scratch_end=fold_base + slots * fold_regions * fold_stride,
        )


# Channels (reduce-scatter, all-gather) per phase.
_CH = {"row": (_C_ROW_RS, _C_ROW_AG), "col": (_C_COL_RS, _C_COL_AG)}


class _DirectExchange:
    """The owners' reduce-scatter and all-gather along the rows (``axis=1``) or columns
    (``axis=0``) of the grid, both *direct*: in slot t every member of a group sends to
    the member t places on, so no message waits for another's arrival before it can leave
    (a ring's chain of a-1 hops would wait in every busy NIC queue on its way, and with
    pipelined segments those queues are full)."""

    def __init__(self, b: ScheduleBuilder, grid: np.ndarray, slots: int) -> None:
        self.b = b
        self.grid = grid
        self.a, self.nb = grid.shape
        self.slots = slots
        # Per (phase, segment): the reduces that read its scratch regions, which the
        # segment that reuses them waits for.
        self.reads: dict[tuple[str, int], np.ndarray] = {}

    def _shifted(self, axis: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Index arrays (rows, cols), shape (n-1, a, nb): for slot t = 1..n-1 and member
        x, the member t places on along ``axis``."""
        i = np.arange(self.a)[None, :, None]
        c = np.arange(self.nb)[None, None, :]
        t = np.arange(1, n)[:, None, None]
        if axis == 0:
            return np.broadcast_to((i + t) % self.a, (n - 1, self.a, self.nb)), np.broadcast_to(
                c, (n - 1, self.a, self.nb)
            )
        return np.broadcast_to(i, (n - 1, self.a, self.nb)), np.broadcast_to(
            (c + t) % self.nb, (n - 1, self.a, self.nb)
        )

    def reduce_scatter(
        self,
        L: int,
        axis: int,
        own_lo: np.ndarray,
        own_hi: np.ndarray,
        *,
        name: str,
        base: int,
        stride: int,
        send_deps: Deps,
        reduce_after: npt.ArrayLike,
    ) -> tuple[np.ndarray, npt.ArrayLike]:
        """Direct reduce-scatter of segment ``L`` along ``axis``: every member ends with
        the sum over its group of the range it owns (``own_lo``/``own_hi``, by member).

        In slot t member x sends the range member x+t owns; x+t receives it into scratch
        (``base``, one region of ``stride`` per segment slot and offset) and adds it to
        its own range, slots in order (a fixed order: bit-reproducible sums). Returns the
        sends, shape (n-1, a, nb) by slot and sender, and the last reduce of each member
        (``reduce_after`` where there is none)."""
        b, G = self.b, self.grid
        n = G.shape[axis]
        if n < 2:
            self.reads[(name, L)] = np.zeros((0,) + G.shape, dtype=np.int64)
            return np.zeros((0,) + G.shape, dtype=np.int64), reduce_after
        ri, ci = self._shifted(axis, n)  # slot t, member x -> member x + t
        back_i, back_c = self._shifted(axis, n)
        if axis == 0:
            back_i = (np.arange(self.a)[None, :, None] - np.arange(1, n)[:, None, None]) % n
        else:
            back_c = (np.arange(self.nb)[None, None, :] - np.arange(1, n)[:, None, None]) % n
        slot = L % self.slots
        off = base + (slot * (n - 1) + np.arange(n - 1))[:, None, None] * stride
        old = self.reads.get((name, L - self.slots))
        sends = b.send(
            G, G[ri, ci], own_lo[ri, ci], own_hi[ri, ci], chan=_CH[name][0], deps=send_deps
        )
        # By receiver x, from x - t, into scratch; the region is reused once the reduce of
        # the segment that used it before has read it.
        recvs = b.recv(
            G,
            G[back_i, back_c],
            off,
            off + (own_hi - own_lo),
            chan=_CH[name][0],
            buf=1,
            deps=-1 if old is None else old,
        )
        reads = b.reduce(G, own_lo, own_hi, off, sbuf=1, deps=[recvs, reduce_after])
        # Chain each member's reduces in slot order (the ids grow with the slot).
        chained = np.maximum.accumulate(reads, axis=0)
        b.depend(reads[1:], chained[:-1])
        self.reads[(name, L)] = reads
        last = chained[-1]
        return sends, np.where(last >= 0, last, reduce_after)

    def all_gather(
        self,
        axis: int,
        own_lo: np.ndarray,
        own_hi: np.ndarray,
        *,
        name: str,
        send_deps: Deps,
        rs_sends: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Direct all-gather along ``axis``: every member sends its own range to every
        other member of its group. A receiver overwrites its copy only once its own
        reduce-scatter send of that range (its slot n - t) has left. Returns the sends and
        the receives, shape (n-1, a, nb) by slot and *sender*."""
        b, G = self.b, self.grid
        n = G.shape[axis]
        if n < 2:
            empty = np.zeros((0,) + G.shape, dtype=np.int64)
            return empty, empty
        ri, ci = self._shifted(axis, n)
        # Receiver x+t sent this range to x in its reduce-scatter slot n - t.
        hazard = rs_sends[(n - 1 - np.arange(1, n))[:, None, None], ri, ci]
        sids, rids = b.transfer(
            G,
            G[ri, ci],
            own_lo,
            own_hi,
            chan=_CH[name][1],
            send_deps=send_deps,
            recv_deps=hazard,
        )
        return sids, rids


class _Attached:
    """The attached ranks' traffic (S2/S3 of :mod:`optcc_mpi.algorithms.optcc`): raw input to the
    owners, results back, each attached rank's messages paced per direction.

    A subclass decides who takes what (:class:`_OwnerFold`, :class:`_ColumnFold`) through
    the pipeline's hooks, each called at one point of a segment's stages: ``send_raw``
    (built early, so the owners' receives are posted ahead), ``after_rows`` (the owners'
    row reduce-scatter is done), ``after_columns`` (the column reduce-scatter is done:
    every owner holds its section's sum over the owners), ``join_parts`` and
    ``after_join`` (an owner holds its column's block again, after the column
    all-gather)."""

    def __init__(
        self,
        b: ScheduleBuilder,
        grid: np.ndarray,
        geo: _Geometry,
        attached: np.ndarray,
        *,
        lag: int,
        lookahead: int,
    ) -> None:
        self.b = b
        self.grid = grid
        self.a, self.nb = grid.shape
        self.geo = geo
        self.att = attached
        self.m = attached.size
        self.lag = lag
        self.lookahead = lookahead
        self.streams: dict[tuple[int, str], list[int]] = {}
        self.reads: dict[int, np.ndarray] = {}  # per segment, the reduces of raw input
        self.returns: dict[int, np.ndarray] = {}  # per segment, results sent back
        self.raw: dict[int, np.ndarray] = {}  # per segment, the raw sends
        self.fold_recv: dict[int, np.ndarray] = {}  # per segment, their receives

    def _paced(self, rank: int, direction: str, ids: np.ndarray) -> None:
        """At most ``lookahead`` of ``rank``'s messages in flight in ``direction``."""
        self.b.stream(ids, self.lookahead, self.streams.setdefault((rank, direction), []))

    def _done(self, u: int, L: int) -> Deps:
        """What attached rank ``u``'s raw sends of a later segment wait for: its results
        of segment ``L``, position by position in its order."""
        got = self.returns.get(L)
        if L < 0 or got is None:
            return -1
        return [self._mine(got[u], u)]

    def _mine(self, by_owner: np.ndarray, u: int) -> np.ndarray:
        """``by_owner`` (one attached rank's row of an array) in ``u``'s order."""
        raise NotImplementedError

    def send_raw(self, L: int) -> None:
        """The raw input of segment L into the owners' scratch."""
        raise NotImplementedError

    def after_rows(self, L: int, partial: npt.ArrayLike) -> npt.ArrayLike:
        """Owners' work on segment L after the row reduce-scatter; returns each owner's
        last operation on its block (``partial`` where there is none)."""
        return partial

    def after_columns(self, L: int, final: np.ndarray) -> np.ndarray:
        """Work on segment L after the column reduce-scatter; returns each owner's
        operation after which its section holds the global sum (``final`` if none)."""
        return final

    def join_parts(self, L: int) -> np.ndarray | None:
        """Operations of segment L the owners' row all-gather must also wait for."""
        return None

    def after_join(self, L: int, ready: Deps) -> None:
        """Work on segment L once each owner holds its column's block (``ready``)."""
        return None


class _OwnerFold(_Attached):
    """A section into every owner: each attached rank sends every owner its raw section
    (*folds*), the owner adds it after the column reduce-scatter and returns the finished
    section; with ``pattern="closer"`` one attached rank per segment *closes* instead
    (the owners send it their partial sums, it adds its input and sends the global sums
    back)."""

    def __init__(
        self,
        b: ScheduleBuilder,
        grid: np.ndarray,
        geo: _Geometry,
        attached: np.ndarray,
        *,
        lag: int,
        lookahead: int,
        pattern: str,
    ) -> None:
        super().__init__(b, grid, geo, attached, lag=lag, lookahead=lookahead)
        self.pattern = pattern
        self.ret_sends: dict[int, np.ndarray] = {}  # per segment, (m, a, nb) by owner

    def closer_of(self, L: int) -> int | None:
        """The attached rank (index) that closes segment L, or None."""
        if self.m == 0 or self.pattern == "fold":
            return None
        return L % self.m

    def _order(self, u: int) -> np.ndarray:
        """Owner positions (flattened grid) in the order attached rank ``u`` serves them:
        rotated so that attached ranks address different owners at any moment."""
        h = self.a * self.nb
        start = (u * h) // max(self.m, 1)
        return (np.arange(h) + start) % h

    def _mine(self, by_owner: np.ndarray, u: int) -> np.ndarray:
        return by_owner.ravel()[self._order(u)]

    def send_raw(self, L: int) -> None:
        """Raw sections of segment L from every folding attached rank into the owners'
        scratch."""
        b, geo = self.b, self.geo
        closer = self.closer_of(L)
        slo, shi = geo.slo[L].ravel(), geo.shi[L].ravel()
        slot = L % geo.slots
        old = self.reads.get(L - geo.slots)
        raw = np.full((self.m, self.a, self.nb), -1, dtype=np.int64)
        rec = np.full((self.m, self.a, self.nb), -1, dtype=np.int64)
        for u in range(self.m):
            if u == closer:
                continue
            s = int(self.att[u])
            order = self._order(u)
            g = self.grid.ravel()[order]
            lo, hi = slo[order], shi[order]
            off = geo.fold_base + (slot * self.m + u) * geo.fold_stride
            sids = b.send(s, g, lo, hi, chan=_C_FOLD, deps=self._done(u, L - self.lag))
            rids = b.recv(
                g,
                s,
                off,
                off + (hi - lo),
                chan=_C_FOLD,
                buf=1,
                deps=-1 if old is None else old[u].ravel()[order],
            )
            self._paced(s, "send", sids)
            raw[u].ravel()[order] = sids
            rec[u].ravel()[order] = rids
        self.raw[L] = raw
        self.fold_recv[L] = rec

    def after_columns(self, L: int, final: np.ndarray) -> np.ndarray:
        """The owners add the raw sections, the closer closes, the folding ranks get
        their results; returns each owner's operation after which it holds the global
        sum of its section."""
        final = self._add_raw(L, final)
        rets = np.full((self.m, self.a, self.nb), -1, dtype=np.int64)
        final = self._close(L, final, rets)
        self._return(L, final, rets)
        return final

    def _add_raw(self, L: int, final: np.ndarray) -> np.ndarray:
        """S2/S3 fold: the owners add the raw sections in scratch, in attached-rank order
        (a fixed order: bit-reproducible sums)."""
        geo = self.geo
        rec = self.fold_recv.pop(L, None)
        reads = np.full((self.m, self.a, self.nb), -1, dtype=np.int64)
        if rec is not None:
            for u in range(self.m):
                if (rec[u] < 0).all():
                    continue
                off = geo.fold_base + ((L % geo.slots) * self.m + u) * geo.fold_stride
                red = self.b.reduce(
                    self.grid, geo.slo[L], geo.shi[L], off, sbuf=1, deps=[rec[u], final]
                )
                final = np.where(red >= 0, red, final)
                reads[u] = red
        self.reads[L] = reads
        return final

    def _close(self, L: int, final: np.ndarray, rets: np.ndarray) -> np.ndarray:
        """S2/S3 close: the owner sends the partial, the closer adds its input and
        returns it (its receives recorded in ``rets``)."""
        closer = self.closer_of(L)
        if closer is None:
            return final
        b, geo = self.b, self.geo
        s = int(self.att[closer])
        order = self._order(closer)
        g = self.grid.ravel()[order]
        lo, hi = geo.slo[L].ravel()[order], geo.shi[L].ravel()[order]
        fin = final.ravel()[order]
        up_s, up_r = b.transfer(g, s, lo, hi, chan=_C_CLOSE, reduce=True, send_deps=fin)
        dn_s, dn_r = b.transfer(s, g, lo, hi, chan=_C_CLOSE, send_deps=up_r, recv_deps=up_s)
        self._paced(s, "recv", up_r)
        self._paced(s, "send", dn_s)
        final.ravel()[order] = np.where(dn_r >= 0, dn_r, fin)
        rets[closer].ravel()[order] = dn_s
        return final

    def _return(self, L: int, final: np.ndarray, rets: np.ndarray) -> None:
        """Returns to the folding ranks: each owner sends its finished section, which
        overwrites the raw section once that has left."""
        geo = self.geo
        closer = self.closer_of(L)
        raw = self.raw.pop(L, None)
        ret_sends = np.full((self.m, self.a, self.nb), -1, dtype=np.int64)
        for u in range(self.m):
            if u == closer or raw is None:
                continue
            s = int(self.att[u])
            order = self._order(u)
            sids, rids = self.b.transfer(
                self.grid.ravel()[order],
                s,
                geo.slo[L].ravel()[order],
                geo.shi[L].ravel()[order],
                chan=_C_RET,
                send_deps=final.ravel()[order],
                recv_deps=raw[u].ravel()[order],
            )
            self._paced(s, "recv", rids)
            rets[u].ravel()[order] = rids
            ret_sends[u].ravel()[order] = sids
        self.returns[L] = rets
        self.ret_sends[L] = ret_sends
        self.returns.pop(L - self.lag - 1, None)

    def join_parts(self, L: int) -> np.ndarray | None:
        """The returns' sends of segment L: they read the section the column all-gather
        is about to pass on, so the row all-gather waits for them too."""
        return self.ret_sends.pop(L, None)


class _ColumnFold(_Attached):
    """A column block into one owner per column
    (:func:`optcc_mpi.algorithms.optcc.column_fold`): attached rank u
    sends column c's block to one owner of the column (:meth:`_row_of`), which adds it
    to its row-reduced partial before the column reduce-scatter spreads it over the
    column, and returns the finished block once the column all-gather gave it back. An
    attached rank then sends one message per column instead of one per owner (``a`` times
    fewer operations: at p = 1024 with half the ranks attached that is what bounded the
    segments), and an owner still takes about ``m`` sections' worth per segment."""

    def __init__(
        self,
        b: ScheduleBuilder,
        grid: np.ndarray,
        geo: _Geometry,
        attached: np.ndarray,
        *,
        lag: int,
        lookahead: int,
    ) -> None:
        super().__init__(b, grid, geo, attached, lag=lag, lookahead=lookahead)
        self.per_owner = -(-self.m // self.a)  # attached ranks an owner serves

    def _columns(self, u: int) -> np.ndarray:
        """Columns in the order attached rank ``u`` serves them (rotated, so that
        attached ranks address different columns at any moment)."""
        return (np.arange(self.nb) + (u * self.nb) // max(self.m, 1)) % self.nb

    def _row_of(self, u: int, cols: np.ndarray, L: int) -> np.ndarray:
        """The row of the owner that takes attached rank ``u``'s block of each column in
        segment ``L``: rotating with the segment, so that over ``a`` segments every owner
        of a column serves every attached rank once (equal loads on average), and within
        a segment an owner serves the attached ranks ``u`` with ``(u + c + L) % a`` its
        row, ``u // a`` its slot."""
        return (u + cols + L) % self.a

    def _mine(self, by_owner: np.ndarray, u: int) -> np.ndarray:
        return by_owner[self._columns(u)]

    def send_raw(self, L: int) -> None:
        """Raw blocks of segment L, each into its owner's scratch slot ``u // a``."""
        b, geo = self.b, self.geo
        slot = L % geo.slots
        old = self.reads.get(L - geo.slots)
        raw = np.full((self.m, self.nb), -1, dtype=np.int64)
        rec = np.full((self.per_owner, self.a, self.nb), -1, dtype=np.int64)
        blo, bhi = geo.blo[L][0], geo.bhi[L][0]
        for u in range(self.m):
            s = int(self.att[u])
            cols = self._columns(u)
            rows = self._row_of(u, cols, L)
            j = u // self.a
            off = geo.fold_base + (slot * self.per_owner + j) * geo.fold_stride
            lo, hi = blo[cols], bhi[cols]
            sids = b.send(
                s, self.grid[rows, cols], lo, hi, chan=_C_FOLD, deps=self._done(u, L - self.lag)
            )
            rids = b.recv(
                self.grid[rows, cols],
                s,
                off,
                off + (hi - lo),
                chan=_C_FOLD,
                buf=1,
                deps=-1 if old is None else old[j, rows, cols],
            )
            self._paced(s, "send", sids)
            raw[u, cols] = sids
            rec[j, rows, cols] = rids
        self.raw[L] = raw
        self.fold_recv[L] = rec

    def after_rows(self, L: int, partial: npt.ArrayLike) -> np.ndarray:
        """The owners add the raw blocks of segment L to their row-reduced partials, slot by
        slot (a fixed order); returns each owner's last operation on its block."""
        geo = self.geo
        rec = self.fold_recv.pop(L, None)
        reads = np.full((self.per_owner, self.a, self.nb), -1, dtype=np.int64)
        cur = np.broadcast_to(np.asarray(partial, dtype=np.int64), self.grid.shape).copy()
        if rec is not None:
            blo, bhi = geo.blo[L], geo.bhi[L]
            for j in range(self.per_owner):
                got = rec[j] >= 0
                if not got.any():
                    continue
                off = geo.fold_base + ((L % geo.slots) * self.per_owner + j) * geo.fold_stride
                red = self.b.reduce(
                    self.grid[got], blo[got], bhi[got], off, sbuf=1, deps=[rec[j][got], cur[got]]
                )
                cur[got] = red
                reads[j][got] = red
        self.reads[L] = reads
        return cur

    def after_join(self, L: int, ready: Deps) -> None:
        """Each finished block back to the attached ranks that folded into its owner, once
        the owner holds the whole block (``ready``, by owner)."""
        geo = self.geo
        ready = cast(np.ndarray, ready)  # a > 1 here (column_fold): back()'s copies' ids
        raw = self.raw.pop(L, None)
        rets = np.full((self.m, self.nb), -1, dtype=np.int64)
        if raw is not None:
            blo, bhi = geo.blo[L][0], geo.bhi[L][0]
            for u in range(self.m):
                s = int(self.att[u])
                cols = self._columns(u)
                rows = self._row_of(u, cols, L)
                _, rids = self.b.transfer(
                    self.grid[rows, cols],
                    s,
                    blo[cols],
                    bhi[cols],
                    chan=_C_RET,
                    send_deps=ready[rows, cols],
                    recv_deps=raw[u, cols],
                )
                self._paced(s, "recv", rids)
                rets[u, cols] = rids
        self.returns[L] = rets
        self.returns.pop(L - self.lag - 1, None)


class Pipeline:
    """Builds OptCC's segments into a :class:`ScheduleBuilder` (see
    :mod:`optcc_mpi.algorithms.optcc`): per segment the owners' reduce-scatter
    (:meth:`front`), the attached ranks' traffic (:class:`_Attached`) and the all-gather
    (:meth:`back`), pipelined by :meth:`run`. ``attached`` holds the attached ranks;
    ``colfold`` says whether they fold whole column blocks
    (:func:`optcc_mpi.algorithms.optcc.column_fold`).

    Per segment, per owner: a *final* operation after which it holds the complete sum of
    its section; per attached rank: the receives that finish its segment. These are what
    the pipelining waits for.
    """

    def __init__(
        self,
        b: ScheduleBuilder,
        attached: np.ndarray,
        grid: np.ndarray,
        col_share: np.ndarray,
        seg: np.ndarray,
        *,
        colfold: bool,
        pattern: str,
        depth: int,
        lag: int,
        lookahead: int,
        row_lag: int = 0,
        ag_lag: int = 0,
    ) -> None:
        self.b = b
        self.grid = grid  # (a, nb) ranks
        self.a, self.nb = grid.shape
        att = attached
        self.depth = depth
        self.row_lag = row_lag
        self.ag_lag = ag_lag
        slots = depth + lag + 3  # segments whose scratch may be in use at once
        # With several rows an attached rank folds a whole column block into one owner of
        # the column (``colfold``); otherwise one section into every owner.
        per_owner = -(-att.size // self.a)
        self.geo = _Geometry.of(
            grid,
            col_share,
            seg,
            slots=slots,
            fold_regions=per_owner if colfold else att.size,
            fold_blocks=colfold,
        )
        self.k = self.geo.k
        self.scratch_end = self.geo.scratch_end
        self.exchange = _DirectExchange(b, grid, slots)
        self.attached: _Attached
        if colfold:
            self.attached = _ColumnFold(b, grid, self.geo, att, lag=lag, lookahead=lookahead)
        else:
            self.attached = _OwnerFold(
                b, grid, self.geo, att, lag=lag, lookahead=lookahead, pattern=pattern
            )
        self.final: dict[int, np.ndarray] = {}
        self.rs_row: dict[int, np.ndarray] = {}
        self.rs_col: dict[int, np.ndarray] = {}
        self.done_owner: dict[int, np.ndarray] = {}
        self.row_done: dict[int, np.ndarray] = {}

    def run(self) -> None:
        """Every segment's stages, staggered. Operation ids, and with them each rank's
        program order, follow the order the stages are built: segment L's raw input comes
        one step before its reduce-scatter (the owners' receives are posted ahead), and
        its all-gather ``1 + ag_lag`` steps after it, behind the reduce-scatters of the
        next segments that the attached ranks wait for."""
        for tau in range(self.k + 2 + self.ag_lag):
            self.fold(tau)
            self.front(tau - 1)
            self.back(tau - 2 - self.ag_lag)

    def fold(self, L: int) -> None:
        """The attached ranks' raw input of segment L into the owners' scratch (built
        early, so the owners' receives are posted ahead)."""
        if L < 0 or L >= self.k or self.attached.m == 0:
            return
        self.attached.send_raw(L)

    def front(self, L: int) -> None:
        """Reduce-scatter of segment L (S1), with the attached ranks' folds or close and
        the returns where the attached ranks' pattern puts them."""
        if L < 0 or L >= self.k:
            return
        geo, G = self.geo, self.grid
        # An owner starts segment L once it holds the result of segment L - depth (and,
        # with row_lag, once its row reduce-scatter of segment L - row_lag is done).
        throttle: Deps = self.done_owner.get(L - self.depth, -1)
        if self.row_lag and (L - self.row_lag) in self.row_done:
            throttle = [throttle, self.row_done[L - self.row_lag]]
        # S1: along rows, each owner ends with its column's block; along columns, with
        # its section of that block.
        self.rs_row[L], row_last = self.exchange.reduce_scatter(
            L,
            1,
            geo.blo[L],
            geo.bhi[L],
            name="row",
            base=geo.row_base,
            stride=geo.row_stride,
            send_deps=throttle,
            reduce_after=-1,
        )
        self.row_done[L] = np.broadcast_to(np.asarray(row_last, dtype=np.int64), G.shape)
        self.row_done.pop(L - self.row_lag - 1, None)
        row_last = self.attached.after_rows(L, row_last)
        self.rs_col[L], final = self.exchange.reduce_scatter(
            L,
            0,
            geo.slo[L],
            geo.shi[L],
            name="col",
            base=geo.col_base,
            stride=geo.col_stride,
            send_deps=[row_last, throttle],
            reduce_after=row_last,
        )
        final = np.broadcast_to(np.asarray(final, dtype=np.int64), G.shape).copy()
        final = self.attached.after_columns(L, final)
        self.final[L] = final
        self.done_owner[L] = final
        self.done_owner.pop(L - self.depth - self.ag_lag - 2, None)

    def back(self, L: int) -> None:
        """All-gather of segment L (S4): along each column, then along each row."""
        if L < 0 or L >= self.k:
            return
        geo = self.geo
        final: Deps = self.final.pop(L)
        if self.ag_lag:
            # Defer the all-gather until this owner finished the reduce-scatter of a
            # later segment: reduce-scatters (which the attached ranks wait for) go first.
            later = self.done_owner.get(min(L + self.ag_lag, self.k - 1))
            final = [final, later if later is not None else -1]
        sent, got = self.exchange.all_gather(
            0,
            geo.slo[L],
            geo.shi[L],
            name="col",
            send_deps=final,
            rs_sends=self.rs_col.pop(L),
        )
        # A block goes out along the row once the member has every section of it. With a
        # column, a one-element copy of the block onto itself joins the column
        # all-gather (its receives and sends) and the returns (their reads), so each row
        # send waits for one operation instead of a of them.
        deps: Deps = final
        ret_sends = self.attached.join_parts(L)
        if self.a > 1:
            blo, bhi = geo.blo[L], geo.bhi[L]
            parts: list[Deps] = [final, *sent]
            parts += [np.roll(got[t - 1], t, axis=0) for t in range(1, self.a)]
            if ret_sends is not None:
                parts += list(ret_sends)
            deps = self.b.copy(self.grid, blo, np.minimum(blo + 1, bhi), blo, deps=parts)
        self.attached.after_join(L, deps)
        self.exchange.all_gather(
            1,
            geo.blo[L],
            geo.bhi[L],
            name="row",
            send_deps=deps,
            rs_sends=self.rs_row.pop(L),
        )
