"""The argument check's wire protocol: one collective of fixed shape, the same outcome
everywhere.

A collective whose ranks disagree (counts, types, ops, algorithms, link profiles) would
hang or produce garbage, and a per-rank error (a bad buffer, a bad environment variable on
one node) raised on one rank alone leaves the others waiting in the next collective. So
every call first *agrees*: each rank checks its own arguments, environment variables
included, then one collective of fixed shape tells every rank what every other rank has,
and every rank takes the same decision: go on, or raise the same clear error before any
buffer is modified.

The block
---------
Each rank contributes a 96-byte header (:data:`FIELDS`: protocol version, error flag,
element count, type, op, and checksums of the algorithm, link profile, emulation, array
library and parameters, the message's bytes and the room) followed by ``C`` bytes of room
for data, and the blocks are gathered (:meth:`~optcc_mpi.transports.Transport.allgather_block`).
``C`` is the same on every rank because every rank derives it from the headers of the
previous call on that communicator (the largest message then, rounded up to a power of
two, between :data:`~optcc_mpi.check.state.FOLD_MIN` and ``FOLD_TOTAL / p``): the block's shape
never depends on the arguments of the current call, so the check can never mismatch,
whatever the ranks pass.

When the library's collective is what ``auto`` would run (short messages), the message is
no larger than the communicator's gather limit (:mod:`optcc_mpi.check.crossover`, measured) and
the data fits in ``C``, the data travels in the check itself: every rank then holds every
rank's contribution and reduces them locally in rank order (:func:`reduce_gathered`), so
the result is bit-identical on every rank by construction and the call costs one
collective. The room never exceeds the gather limit, so a larger message leaves the least
room for the next call and goes to the library's AllReduce.
Nothing else travels with the data: a checksum riding in the reduced buffer would change
what the reduction sees.

Above :data:`GATHER_MAX_P` ranks the gathered headers would grow with p, so the check is
instead one element-wise maximum of the header and its negation
(:func:`optcc_mpi.check.agreement.agree_fields`): still one small collective of fixed shape,
without the data. On an error the ranks exchange their words in one more collective, so
that every rank's exception names the rank and value at fault (:func:`disagreement`).
"""

from __future__ import annotations

import zlib
from functools import lru_cache

import numpy as np

from optcc_mpi.check import agreement, crossover, fastcall
from optcc_mpi.check.state import FOLD_MIN, HEADER, HEADER_BYTES, CheckState, room_for
from optcc_mpi.dtypes import DTYPES, NAME_OF, OPS
from optcc_mpi.errors import ArgumentError
from optcc_mpi.reductions import reduce_rows

__all__ = [
    "HEADER",
    "HEADER_BYTES",
    "PROTOCOL",
    "FIELDS",
    "GATHER_MAX_P",
    "DTYPE_CODE",
    "OP_CODE",
    "Mismatch",
    "code",
    "agree_header",
    "extra_fits",
    "gathered_extra",
    "reduce_gathered",
    "disagreement",
]

#: Identifies this version of the protocol (first header field).
PROTOCOL = 0x0C7CC0002
#: The header's fields, in order.
FIELDS = (
    "protocol",
    "error",
    "element count",
    "dtype",
    "op",
    "algorithm",
    "link profile",
    "emulation",
    "array library",
    "params",
    "bytes",
    "capacity",
)
#: Largest communicator whose check gathers the headers (and can carry data).
GATHER_MAX_P = 32
DTYPE_CODE = {name: i for i, name in enumerate(DTYPES)}
OP_CODE = {name: i for i, name in enumerate(OPS)}


@lru_cache(maxsize=512)
def code(text: str) -> int:
    """A header field's checksum of ``text``."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


class Mismatch(Exception):
    """Some rank failed or the ranks disagree (every rank raises it: all saw the same).

    Parameters
    ----------
    table : numpy.ndarray, optional
        Every rank's header fields, one row per rank (the gathered check).
    bounds : tuple of numpy.ndarray, optional
        The element-wise minimum and maximum of the fields over the ranks (the check
        above :data:`GATHER_MAX_P` ranks).
    """

    def __init__(
        self,
        table: np.ndarray | None = None,
        bounds: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        super().__init__()
        self.table, self.bounds = table, bounds


def agree_header(
    st: CheckState,
    fields: tuple[int, ...],
    err: BaseException | None,
    foldable: bool,
    data: np.ndarray | None,
    extra: np.ndarray | None = None,
) -> bool:
    """One collective of fixed shape; returns True if the data travelled with it (then
    the gathered blocks hold every rank's data). ``foldable``: the call is one whose data
    may travel with it, room permitting (then ``data`` is the 1-D NumPy input).
    ``extra``: a small int64 vector to carry in the data room of a call whose data does
    not travel (the watch's observations); read back with :func:`gathered_extra`. Raises
    :class:`Mismatch` on every rank if any rank failed or the ranks disagree."""
    p = st.size
    if not fields:
        fields = (PROTOCOL, 1) + (0,) * (len(FIELDS) - 2)
    if p > GATHER_MAX_P:
        lo, hi = agreement.agree_fields(st.transport, fields)
        if err is not None or hi[1] or not np.array_equal(hi, lo):
            raise Mismatch(bounds=(lo, hi))
        return False
    # The data room agreed at the previous call (the gathered blocks of that call were
    # read before it changed).
    st.prepare()
    cap = st.room
    nbytes = fields[10]
    # Not above the gather limit (a room left larger by a watched call must not change
    # how a message is reduced; until the limit is decided, the least room).
    fold = foldable and nbytes <= cap and nbytes <= st.limit_known
    fields = fields[:11] + (cap * 4 + 2 * int(foldable) + int(fold),)
    hb = HEADER.pack(*fields)
    st.block_mv[:HEADER_BYTES] = hb
    if fold and nbytes and data is not None:
        np.copyto(st.views(data.dtype, nbytes)[0], data)
    elif extra is not None and extra_fits(st, extra.size):
        st.block[HEADER_BYTES : HEADER_BYTES + 8 * extra.size].view("<i8")[:] = extra
    st.transport.allgather_block(st.block, st.gathered)
    heads = st.heads
    if err is None and heads.tobytes() == hb * p:
        # Room for the next call: this call's size if its data could travel with the
        # check, else the least (a large room would only slow the checks of calls whose
        # data never travels with them; a watched call sets its own after running). Every
        # rank is here, with the same headers: the gather limit is decided now if this is
        # the first call that needs it (collective).
        room = FOLD_MIN
        if foldable and nbytes > FOLD_MIN:
            room = room_for(p, nbytes, crossover.decide(st))
        st.agree_next(room)
        return fold
    table = heads.copy().view("<i8")  # (p, fields)
    # Every rank saw the same table: the same next room, then the same error.
    st.agree_next(FOLD_MIN)
    raise Mismatch(table=table)


def extra_fits(st: CheckState, n: int) -> bool:
    """Whether ``n`` int64 travel in the check's data room (the same answer on every
    rank: the room and the size of the communicator are agreed)."""
    return st.size <= GATHER_MAX_P and st.fits(8 * n)


def gathered_extra(st: CheckState, n: int) -> np.ndarray:
    """Every rank's ``extra`` of the last check, one row per rank."""
    return st.gathered[:, HEADER_BYTES : HEADER_BYTES + 8 * n].view("<i8")


def reduce_gathered(
    st: CheckState, opn: str, dtype: np.dtype, nbytes: int, out: np.ndarray
) -> None:
    """Reduce every rank's data from the check's gather into ``out``, in rank order
    (:func:`optcc_mpi.reductions.reduce_rows`; sums the compiled path also does, by its
    C loop)."""
    kind = fastcall.reduce_kind(NAME_OF.get(dtype, "")) if opn == "sum" else 0
    if kind and st.size > 1:
        # The loop of the compiled path, so that both paths give the same bits.
        fastcall.sum_rows(kind, out, st.gathered, HEADER_BYTES)
        return
    reduce_rows(np, opn, out, st.views(dtype, nbytes)[1])


def disagreement(
    st: CheckState,
    err: BaseException | None,
    mismatch: Mismatch,
    shown: dict[str, str],
    what: str = "allreduce",
) -> None:
    """Raise the same error on every rank (they all call this: every rank saw the same
    headers). One more collective carries each rank's own words: a rank that failed
    re-raises its own error, the others name it. ``shown``: what this rank passed, in
    words, by field name."""
    views = agreement.agree(st.transport, err, shown, what=f"{what}: arguments rejected")
    if mismatch.table is not None:
        table = mismatch.table
        if len(set(int(x) for x in table[:, 0])) > 1:
            raise ArgumentError(
                f"{what}: ranks run different versions of optcc_mpi's agreement protocol"
            )
        columns = [table[:, i] for i in range(table.shape[1])]
    else:
        assert mismatch.bounds is not None  # a Mismatch has a table or bounds
        lo, hi = mismatch.bounds
        columns = [np.array([lo[i], hi[i]]) for i in range(len(lo))]
    for i in range(2, len(FIELDS) - 2):
        col = columns[i]
        if col.min() == col.max():
            continue
        field = FIELDS[i]
        groups: dict[str, list[int]] = {}
        for r, view in enumerate(views):
            groups.setdefault(view.get(field, "?"), []).append(r)
        detail = "; ".join(
            f"{value} on {agreement.describe_ranks(rs)}" for value, rs in groups.items()
        )
        # A caller's own argument rides in the params field under its own name.
        name = shown.get(f"{field} name", field)
        raise ArgumentError(f"{what}: {name} differs across ranks: {detail}")
    raise ArgumentError(f"{what}: the ranks' arguments differ")  # pragma: no cover
