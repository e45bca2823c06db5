"""The ride: a repeated short sum agreed inside its own AllReduce, with no check's round.

Every call agrees on its arguments before any buffer changes (:mod:`~optcc_mpi.check.protocol`),
which costs one collective of its own. Across machines, where a short sum goes to the
library's AllReduce after that check, the check's round is most of what a call costs over
gloo's own (about 0.3 ms of a 1 MiB call's 1 ms on two ranks). Most calls repeat: a
training loop's gradients, the same buckets in the same order at every step. So where the
transport allows it (:attr:`~optcc_mpi.transports.base.Capabilities.ride`: an AllReduce that
gives every rank the same bits, and no compiled path that would skip this module), a sum
of a signature that *rides* (:meth:`Ride.takes`) carries each rank's flag of agreement:
in integers, one more element, 1 or 0; in floats, no element of its own (at one element
or two, gloo's ring takes a step more for each element): a rank that does not flag the
round writes NaN as its first element, and a NaN in the sum's first element, which may
also be the data's, makes every rank say whether it flagged in one more AllReduce of one
integer (:meth:`Ride._flagged`).

- After a checked call, the data's AllReduce is that of the data and its flag, in a
  scratch buffer, copied into the result (:meth:`Ride.reduce`).
- Before a call, every rank knows the signature every rank expects next
  (:meth:`Ride.expected`): the one that followed the last call's signature the last two
  times it was seen, from the agreed headers alone, so the same on every rank. If there is
  one, every rank's call starts with one AllReduce of that signature's shape
  (:meth:`Ride.guess`): a rank whose call is of that signature contributes its data and a
  flag of 1, any other rank (another signature, an error of its own, a call that skips the
  check) zeros and a flag of 0 (the NaN, in floats). The flags' sum is the same on every
  rank: ``p`` means every rank's arguments equal the expected header, field by field,
  which is what the check would have established, and the call is complete; anything
  less and every rank drops the round and checks the call as usual (its error, if any, is
  the check's, on every rank). The user's buffer is written only after a round every rank
  flagged.

So a rank never waits in a collective its peers did not post: every rank posts the same
round, of the same shape, whatever it was passed. The result of a riding signature is the
library's AllReduce of the same elements (the data's, then the flag's, if any) whether or
not the call was expected, so what a call returns never depends on the calls before it.
A signature's route follows from the signature (sums of the transport's exact types up to
:data:`RIDE_MAX` bytes, ``auto``, healthy links, no emulation, NumPy data): its data never
travels in the check (the fold) nor is gathered in rank order, since the library's
AllReduce gives every rank the same bits already.

The cost of a wrong guess is one round of the expected shape, data wasted; a guess needs
the same successor twice in a row, so a changed pattern stops guessing at once.

A call whose link code is not healthy's rides where the owner says so
(:attr:`Ride.links_ride`, a function of what every rank agreed): the communicator's watch,
on links it holds healthy, for a call that needs no schedule of its own
(:meth:`optcc_mpi.watch.LinkWatch.quiet`). What such a call owes the next one (the
watch's observations, int64 values, the same count on every rank) travels in the round
too: each rank writes its values into a slot of its own, cut into 16-bit pieces (8-bit
for 2-byte floats), and every other rank writes zeros there, so the sum is every rank's
values exactly (such a piece plus zeros is exact in every type that rides): an allgather
inside the AllReduce (:attr:`Ride.carried`).
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter

import numpy as np

from optcc_mpi.arrays import NUMPY
from optcc_mpi.check.protocol import FIELDS, OP_CODE, code
from optcc_mpi.dtypes import DTYPES
from optcc_mpi.transports.base import Transport

__all__ = ["RIDE_MAX", "Ride", "serves"]

#: The largest message (bytes) that rides: a riding call copies its data into a scratch
#: buffer and back (two copies of 1 MiB: about 0.05 ms here), which is below a round of
#: the check (0.3 ms over gloo) up to a few MiB; above, the copies cost what they save,
#: and a wrong guess wastes more.
RIDE_MAX = 2 * 1024 * 1024
#: Where the header's fields are (protocol.FIELDS).
_ERROR, _COUNT, _DTYPE, _OP, _ALGORITHM, _LINKS, _EMULATION, _ARRAYS, _BYTES = (
    FIELDS.index(name)
    for name in (
        "error", "element count", "dtype", "op", "algorithm", "link profile", "emulation",
        "array library", "bytes",
    )
)  # fmt: skip
#: The fields a signature is made of: every field of the header but the last (the room,
#: which the check itself fills in).
_SIGNATURE = FIELDS.index("capacity")
#: How many signatures' successors are remembered (a loop's calls are a handful).
_REMEMBERED = 256
_SUM, _AUTO, _NUMPY = OP_CODE["sum"], code("auto"), code("numpy")
#: The element types by their header code (protocol.DTYPE_CODE's order).
_NAMES = tuple(DTYPES)

Signature = tuple[int, ...]


def serves(transport: Transport) -> bool:
    """Whether calls over ``transport`` ride (the same answer on every rank: it follows
    from the transport's kind and the group's board, which are the group's)."""
    return transport.caps.ride and transport.size > 1


class Ride:
    """One communicator's rides: the signatures seen, the one expected next, the scratch
    buffer (module docstring). Every method that changes it is called on every rank with
    the same arguments, in the same order (the agreed headers), so that every rank
    expects the same.

    Parameters
    ----------
    transport : Transport
        The communicator's transport (:func:`serves` it).
    """

    __slots__ = (
        "transport", "size", "rank", "_last", "_next", "_scratch", "hits", "misses",
        "links_ride", "carried", "took",
    )  # fmt: skip

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.size = transport.size
        self.rank = transport.rank
        #: For a link code other than healthy's (0) and a size in bytes: None where such a
        #: call does not ride now, else how many int64 values each rank carries in its
        #: round (0: none). The
        #: owner's (the communicator's watch); it must read only what every rank agreed,
        #: so that every rank expects the same.
        self.links_ride: Callable[[int, int], int | None] | None = None
        #: What every rank carried in the last guessed round, one row per rank (None:
        #: nothing was carried).
        self.carried: np.ndarray | None = None
        #: Seconds this rank's last round took from posting to completion.
        self.took = 0.0
        # The last agreed call's signature (None: none, or the chain was broken).
        self._last: Signature | None = None
        # Each signature's successor the last time and how many times in a row it was.
        self._next: dict[Signature, tuple[Signature, int]] = {}
        self._scratch = np.zeros(0, dtype=np.uint8)
        #: Calls completed by a guessed round, and guessed rounds dropped.
        self.hits = self.misses = 0

    # -- which signatures ride ------------------------------------------------------------
    def takes(self, fields: tuple[int, ...]) -> bool:
        """Whether a call whose header is ``fields`` rides: a sum of a type the
        transport's AllReduce reduces exactly, ``auto`` on healthy links without
        emulation, of NumPy data, of 1 to :data:`RIDE_MAX` bytes."""
        if len(fields) < _SIGNATURE or fields[_ERROR]:
            return False
        if not (
            fields[_OP] == _SUM
            and fields[_ALGORITHM] == _AUTO
            and self._carries(fields[_LINKS], fields[_BYTES]) is not None
            and fields[_EMULATION] == 0
            and fields[_ARRAYS] == _NUMPY
            and 0 < fields[_BYTES] <= RIDE_MAX
        ):
            return False
        name = _NAMES[fields[_DTYPE]] if 0 <= fields[_DTYPE] < len(_NAMES) else ""
        return self.transport.native(NUMPY, name, "sum")

    def _carries(self, link: int, nbytes: int) -> int | None:
        """None where a call of link code ``link`` and ``nbytes`` does not ride; else the
        int64 values each rank carries in its round (:attr:`links_ride`; healthy links:
        0)."""
        if link == 0:
            return 0
        hook = self.links_ride
        return None if hook is None else hook(link, nbytes)

    # -- what every rank expects ----------------------------------------------------------
    def expected(self) -> Signature | None:
        """The signature every rank expects of the next call, or None (then the call is
        checked as usual)."""
        last = self._last
        if last is None:
            return None
        seen = self._next.get(last)
        if seen is None or seen[1] < 2 or not self.takes(seen[0]):
            return None
        return seen[0]

    def expects(self, fields: tuple[int, ...]) -> Signature | None:
        """The signature every rank expects of the next call where it is that of header
        ``fields``, else None; :meth:`guess` given it (``expected``) makes the round
        without working it out again."""
        sig = self.expected()
        return sig if sig is not None and tuple(fields[:_SIGNATURE]) == sig else None

    def agreed(self, fields: tuple[int, ...]) -> None:
        """Record a call every rank agreed on by the check (its header)."""
        self._follow(tuple(fields[:_SIGNATURE]))

    def _follow(self, sig: Signature) -> None:
        """``sig`` followed the last agreed call."""
        last = self._last
        if last is not None:
            seen = self._next.get(last)
            if len(self._next) >= _REMEMBERED and seen is None:
                self._next.clear()
            self._next[last] = (sig, seen[1] + 1 if seen is not None and seen[0] == sig else 1)
        self._last = sig

    def reset(self) -> None:
        """Forget the last call (an error every rank raised, or a call without a check:
        nothing agreed to follow)."""
        self._last = None

    # -- the rounds -----------------------------------------------------------------------
    def _buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        """The scratch buffer as ``count`` elements of ``dtype``."""
        nbytes = count * dtype.itemsize
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
        return self._scratch[:nbytes].view(dtype)

    def _round(
        self,
        dtype: np.dtype,
        name: str,
        count: int,
        data: np.ndarray | None,
        carry: int = 0,
        values: np.ndarray | None = None,
    ) -> np.ndarray:
        """One AllReduce of ``count`` elements, the flag (:func:`_flag_element`) and
        ``carry`` int64 values per rank (:func:`_pieces`) in the scratch buffer: ``data``,
        1 and ``values`` in this rank's slot, or (``data`` None) zeros, 0 and a NaN as
        the first element where the flag is not an element of its own; the buffer,
        summed."""
        bits, n = _pieces(dtype)
        slot = carry * n
        flag = _flag_element(dtype)
        buf = self._buffer(dtype, count + flag + self.size * slot)
        if data is None:
            buf.fill(0)
            if not flag:
                buf[0] = np.nan
        else:
            np.copyto(buf[:count], data)
            if flag:
                buf[count] = 1
            if slot:
                rest = buf[count + flag :]
                rest.fill(0)
                assert values is not None and values.size == carry  # (guess: mine)
                at = self.rank * slot
                rest[at : at + slot] = _pieces_of(values, bits, n)
        t0 = perf_counter()
        self.transport.allreduce_now(NUMPY, buf, name, "sum")
        self.took = perf_counter() - t0
        return buf

    def _flagged(self, buf: np.ndarray, count: int, mine: bool) -> bool:
        """Whether every rank flagged the round summed in ``buf`` (``mine``: this rank
        did); the same answer on every rank, since every rank holds the same bits. A
        float round whose first element is NaN may be a NaN of the data: every rank then
        says in one more AllReduce (of one integer) whether it flagged."""
        if _flag_element(buf.dtype):
            return int(buf[count]) == self.size
        if not np.isnan(buf[0]):
            return True
        votes = np.array([int(mine)], dtype=np.int64)
        self.transport.allreduce_now(NUMPY, votes, "int64", "sum")
        return int(votes[0]) == self.size

    def guess(
        self,
        fields: tuple[int, ...] | None,
        data: np.ndarray | None,
        out: np.ndarray | Callable[[], np.ndarray],
        values: np.ndarray | None = None,
        expected: Signature | None = None,
    ) -> bool:
        """The round of the signature every rank expects (:meth:`expected`, or
        ``expected`` where the caller has it from :meth:`expects` just now), where there is
        one; True if every rank flagged it (then ``out`` holds the sum), False with
        nothing communicated where nothing is expected. ``fields``: this rank's header
        (None: its call is checked otherwise, or not at all); ``data``: its 1-D NumPy
        input; ``out``: where the result goes, a writable array of ``data``'s type and
        length (or a function of no arguments returning one, made only if every rank
        flagged); ``values``: the int64 values this rank carries, where the expected
        signature carries some (:attr:`links_ride`; every rank's, as rows, in
        :attr:`carried` after a round every rank flagged)."""
        sig = self.expected() if expected is None else expected
        if sig is None:
            return False
        count = sig[_COUNT]
        name = _NAMES[sig[_DTYPE]]
        dtype = DTYPES[name]
        carry = self._carries(sig[_LINKS], sig[_BYTES]) or 0
        mine = (
            fields is not None
            and data is not None
            and tuple(fields[:_SIGNATURE]) == sig
            and data.dtype == dtype
            and (not carry or (values is not None and values.size == carry))
        )
        buf = self._round(
            dtype, name, count, data if mine else None, carry, values if mine else None
        )
        if not self._flagged(buf, count, mine):
            self.misses += 1
            return False
        self.hits += 1
        self.carried = None
        if carry:
            bits, n = _pieces(dtype)
            rest = buf[count + _flag_element(dtype) :]
            self.carried = _values_of(rest, bits, n).reshape(self.size, carry)
        target = out() if callable(out) else out
        np.copyto(target, buf[:count])
        self._follow(sig)
        return True

    def reduce(self, data: np.ndarray, out: np.ndarray, name: str) -> None:
        """The data's AllReduce of a riding call every rank agreed on: ``data`` and a
        flag, in the scratch buffer, the sum into ``out`` (the same elements, so the same
        bits, as a guessed round of the same data); ``name``: the type's name."""
        count = data.shape[0]
        np.copyto(out, self._round(data.dtype, name, count, data)[:count])


def _flag_element(dtype: np.dtype) -> int:
    """1 where a round of ``dtype`` carries the flags as an element of their own (integers),
    0 where a rank that does not flag it poisons the first element with NaN (floats): an
    element more can cost gloo's ring a whole step at the shortest sizes (one element or
    two: 1.0 against 1.35 ms on the 4-rank testbed, docs/results.md)."""
    return 0 if dtype.kind == "f" else 1


def _pieces(dtype: np.dtype) -> tuple[int, int]:
    """How carried int64 values are cut for a round of ``dtype``: ``(bits, pieces)``, an
    integer of ``bits`` bits being exact in it (2-byte floats: 8 bits of 11 or 8)."""
    return (8, 8) if dtype.kind == "f" and dtype.itemsize < 4 else (16, 4)


def _pieces_of(values: np.ndarray, bits: int, n: int) -> np.ndarray:
    """``values`` (int64) as ``n`` unsigned pieces of ``bits`` bits each, low first."""
    u = values.astype(np.int64).view(np.uint64)
    shifts = np.arange(n, dtype=np.uint64) * np.uint64(bits)
    return ((u[:, None] >> shifts) & np.uint64((1 << bits) - 1)).ravel()


def _values_of(pieces: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The int64 values that :func:`_pieces_of` cut into ``pieces``."""
    parts = np.rint(pieces.astype(np.float64)).astype(np.uint64).reshape(-1, n)
    shifts = np.arange(n, dtype=np.uint64) * np.uint64(bits)
    return np.bitwise_or.reduce(parts << shifts, axis=1).view(np.int64)
