"""The argument check's state per communicator: its buffers, its room, the sizing rule.

Every collective call first agrees on its arguments in one collective of fixed shape
(:mod:`optcc_mpi.check.protocol`): each rank contributes a header of :data:`HEADER_BYTES`
followed by a *room* for data, and the blocks are gathered. What that check keeps from one
call to the next on a communicator is a :class:`CheckState`:

* the room agreed for the next check (the same on every rank: every rank derives it from
  the headers of the previous call) and the buffers allocated for the room in use;
* the communicator's *gather limit* (:mod:`optcc_mpi.check.crossover`): the largest short
  message whose data travels in the check;
* the compiled call path's context over those buffers (:mod:`optcc_mpi.check.fastcall`), which
  is dropped whenever the buffers, the limit or the communicator go away.

Each field is written by the methods of :class:`CheckState` alone. The object itself
belongs to the communicator's :class:`~optcc_mpi.communicators.CommState`, which the
collectives layer owns.

The sizing rule
---------------
A room is :data:`FOLD_MIN` times a power of two, up to a limit (:func:`rooms`); a message
of ``n`` bytes asks for the least room that holds it, or for the least room if none up to
the limit does (:func:`room_for`). The compiled path does not carry a copy of the rule: it
is handed the sizes its context's room serves (:func:`served`), computed here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from optcc_mpi.transports.base import Transport

__all__ = [
    "CheckState",
    "FOLD_MIN",
    "FOLD_TOTAL",
    "HEADER",
    "HEADER_BYTES",
    "rooms",
    "room_for",
    "served",
]

#: The argument check's header, 12 int64 fields (what each holds: optcc_mpi.check.protocol), at
#: the start of the check's block; here, below the protocol and the gather limit's
#: measurement (optcc_mpi.check.crossover), so that both size the check's buffers from one
#: definition.
HEADER = struct.Struct("<12q")
HEADER_BYTES = HEADER.size
#: Fewest bytes of data the argument check carries: the least room.
FOLD_MIN = 256
#: Most bytes the check's gather moves per call, summed over ranks.
FOLD_TOTAL = 256 * 1024


def rooms(p: int, limit: int | None = None, total: int | None = None) -> tuple[int, ...]:
    """The rooms the check can have on ``p`` ranks, smallest first: :data:`FOLD_MIN`
    times a power of two, up to ``limit`` (default ``total / p``, at least
    :data:`FOLD_MIN`; ``total``: the transport's
    :attr:`~optcc_mpi.transports.Transport.gather_total`, default :data:`FOLD_TOTAL`).
    The least room is always one."""
    total = FOLD_TOTAL if total is None else total
    top = max(FOLD_MIN, total // max(p, 1)) if limit is None else limit
    out = [FOLD_MIN]
    while out[-1] * 2 <= top:
        out.append(out[-1] * 2)
    return tuple(out)


def room_for(p: int, nbytes: int, limit: int | None = None) -> int:
    """The room a message of ``nbytes`` asks for: the least of :func:`rooms` ``(p,
    limit)`` that holds it, or :data:`FOLD_MIN` if none does."""
    for room in rooms(p, limit):
        if nbytes <= room:
            return room
    return FOLD_MIN


def served(p: int, room: int, limit: int) -> tuple[int, int]:
    """``(lo, hi)``: the message sizes ``lo < n <= hi`` for which :func:`room_for` ``(p, n,
    limit)`` is ``room`` and the message fits in it (empty, ``(0, 0)``, for a room that is
    not among :func:`rooms` ``(p, limit)``). The compiled path takes its calls by this
    range rather than by a copy of the rule."""
    table = rooms(p, limit)
    if room not in table:
        return 0, 0
    i = table.index(room)
    return (table[i - 1] if i else 0), room


class CheckState:
    """What the argument check keeps for one communicator (module docstring).

    Parameters
    ----------
    transport : Transport
        The communicator's transport: the check's collectives travel on it.
    """

    __slots__ = (
        "transport",
        "size",
        "rank",
        "_agreed",
        "_room",
        "_block",
        "_block_mv",
        "_gathered",
        "_heads",
        "_views",
        "_limit",
        "_compiled",
        "_closed",
    )

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.size = transport.size
        self.rank = transport.rank
        self._agreed = FOLD_MIN
        self._room = 0
        self._block = np.zeros(0, dtype=np.uint8)
        self._block_mv = memoryview(self._block)
        self._gathered = np.zeros((0, 0), dtype=np.uint8)
        self._heads = self._gathered
        self._views: dict[tuple[np.dtype, int], tuple[np.ndarray, list[np.ndarray]]] = {}
        self._limit: int | None = None
        self._compiled: object | None = None
        self._closed = False

    # -- the room --------------------------------------------------------------------------
    @property
    def agreed(self) -> int:
        """The room every rank agreed for the next check."""
        return self._agreed

    @property
    def room(self) -> int:
        """The room of the buffers in use (0 before the first check)."""
        return self._room

    @property
    def ready(self) -> bool:
        """Whether the buffers in use have the agreed room (the next check needs none
        allocated)."""
        return self._room == self._agreed

    def agree_next(self, room: int) -> None:
        """The room of the next check: every rank calls this with the same value, derived
        from what every rank saw in the same check."""
        self._agreed = room

    def prepare(self) -> None:
        """Buffers with the agreed room, for the check about to run."""
        if self._room != self._agreed:
            self._allocate(self._agreed)

    def use_room(self, room: int) -> None:
        """Buffers with ``room`` for one call's gather (not a check: the next check
        allocates the agreed room again)."""
        if self._room != room:
            self._allocate(room)

    def _allocate(self, room: int) -> None:
        width = HEADER_BYTES + room
        self._room = room
        self._block = np.zeros(width, dtype=np.uint8)
        self._block_mv = memoryview(self._block)
        self._gathered = np.zeros((self.size, width), dtype=np.uint8)
        self._heads = self._gathered[:, :HEADER_BYTES]
        self._views = {}
        self._compiled = None  # it points into the old buffers

    @property
    def block(self) -> np.ndarray:
        """This rank's block: the header, then the room."""
        return self._block

    @property
    def block_mv(self) -> memoryview:
        """:attr:`block` as a memoryview (the header is written through it)."""
        return self._block_mv

    @property
    def gathered(self) -> np.ndarray:
        """Every rank's block, one row per rank, after the check's gather."""
        return self._gathered

    @property
    def heads(self) -> np.ndarray:
        """The headers of :attr:`gathered`."""
        return self._heads

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit in the room in use."""
        return self._room > 0 and nbytes <= self._room

    def views(self, dtype: np.dtype, nbytes: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """Typed views of the room: this rank's block, and every rank's gathered row
        (cached until the room changes)."""
        key = (dtype, nbytes)
        hit = self._views.get(key)
        if hit is not None:
            return hit
        lo, hi = HEADER_BYTES, HEADER_BYTES + nbytes
        made = (
            self._block[lo:hi].view(dtype),
            [self._gathered[r, lo:hi].view(dtype) for r in range(self.size)],
        )
        if len(self._views) > 16:
            self._views.clear()
        self._views[key] = made
        return made

    # -- the gather limit ------------------------------------------------------------------
    @property
    def gather_limit(self) -> int | None:
        """The communicator's gather limit once decided (the same on every rank), else
        None."""
        return self._limit

    @property
    def limit_known(self) -> int:
        """The gather limit if decided, else the least room (asks nobody)."""
        return self._limit if self._limit is not None else FOLD_MIN

    def decide_limit(self, limit: int) -> None:
        """Record the gather limit every rank decided (:func:`optcc_mpi.check.crossover.decide`)."""
        self._limit = limit
        self._compiled = None  # made again, with the limit

    # -- the compiled path's context ---------------------------------------------------------
    @property
    def compiled(self) -> object | None:
        """The compiled path's context over the buffers in use, if made."""
        return self._compiled

    def make_compiled(self, make: Callable[[CheckState], object | None]) -> None:
        """Make the compiled path's context with ``make(self)`` unless one is there (or
        the communicator is gone)."""
        if self._compiled is None and not self._closed:
            self._compiled = make(self)

    def close(self) -> None:
        """The communicator is gone: nothing may reach its library handles again."""
        self._closed = True
        self._compiled = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed
