"""The board: the exchanges of a torch group's ranks on one machine, through shared memory.

Every call of the ``optcc`` backend starts with the argument check, one gather of a small
block from every rank (:mod:`optcc_mpi.check.protocol`), and a short message travels in
that block. Over gloo that gather is a TCP exchange even between processes of one
machine: 0.2-0.5 ms at 2 ranks and 2.5 ms at 4 on a 2-core machine
(``docs/backend/gloo_floor.py``), more than gloo's own AllReduce of a few elements. Where
every rank of a group is on one machine, :class:`Board` does the same gather through a
mapping of one shared file instead: each rank copies its block into its slot and raises
its sequence number, then waits until every rank's number reached the call's and copies
every slot out. The result is what the gloo gather gives, byte for byte, so the layers
above cannot tell the two apart, and a rank never needs to know which one its peers used
(they all use the same: the choice is made once, collectively, when the transport opens).

The same mapping carries the group's AllReduce of host data (:meth:`Board.allreduce`, in
place of gloo's): chunk by chunk, each rank posts its chunk, reduces its p-th of every
rank's in rank order and posts that part, then copies every part out: each element
reduced once, by one rank, in rank order, so that every rank holds the same bits. Short
messages (up to :data:`GATHER_TOTAL` over p) travel in the check itself instead.

The synchronisation is in C (``_board.c``, loaded with ctypes, which releases the GIL
while a rank waits): release/acquire ordering of the data and the sequence numbers, a
short spin for a peer about to arrive (none where ranks outnumber the cores: there a
spinning rank would take the core its peer needs), then a futex sleep. Where no C
compiler is available there is no board, and gloo carries the exchange.

Nothing hangs: a wait wakes every :data:`~optcc_mpi.transports.base.ABORT_POLL` seconds
to see whether the group was aborted (here, or on another rank: an abort marks the board
broken for every rank), whether the ranks it waits for still run (a rank that exited
counts as gone whether or not its parent reaped it), and whether the group's timeout
passed; each ends the wait with an error on this rank, and marks the board broken, so the
other ranks raise too instead of waiting for a rank that will not come. The mark says why
and names the rank at fault (the rank that exited or never came, the rank aborted), so
that every rank's error names it, not only the rank that saw it. Any exception that
leaves an exchange (KeyboardInterrupt, MemoryError between a post and the next) marks it
too, before this rank can post again: its sequence numbers may be behind the others', and
a later block of its own must never be taken for this call's part. A group destroyed on
one rank (:meth:`Board.close`) ends at once every other rank's wait that needs a block of
it, naming that rank, while the exchanges it completed still complete everywhere.

Used only where it carries the exchange faithfully: every rank on one machine with one
``/dev/shm``, one process namespace (so that a process number names a rank) and one
network namespace (ranks in namespaces of their own are the testbed's emulated machines,
whose links must carry their traffic), and ``OPTCC_BOARD`` not ``0``.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import numpy as np

from optcc_mpi import compiled, config
from optcc_mpi.errors import ArgumentError, ExecutionError
from optcc_mpi.reductions import reduce_rows
from optcc_mpi.transports import base
from optcc_mpi.transports.base import boot_id

__all__ = ["Board", "place", "usable", "BLOCKS_TOTAL", "GATHER_TOTAL", "SLOT_EXTRA"]

#: The bytes of data every rank's slot together holds: the largest gather the board
#: carries (larger ones go to the library), and the chunk of :meth:`Board.allreduce`;
#: each slot has :data:`SLOT_EXTRA` more for a header, and the mapping holds two sets of
#: slots (8 MiB and a little more in all).
BLOCKS_TOTAL = 4 << 20
#: Every rank's data together up to which a short message travels in the argument check
#: on a board (gathered, then reduced on every rank: one exchange, p copies out) rather
#: than through :meth:`Board.allreduce` (two exchanges, one copy out): 256 KiB, 512 KiB
#: and 1 MiB compared on 2 cores at 2 and 4 ranks, within noise of each other, 1 MiB the
#: least (docs/results.md).
GATHER_TOTAL = 1 << 20
#: Room in each slot beyond its share of :data:`BLOCKS_TOTAL`, for the check's header.
SLOT_EXTRA = 4096
#: How long a rank spins (yielding its core) for a peer before it sleeps, where every
#: rank has a core.
SPIN = 50e-6
#: Where the shared file is made (a RAM file system on Linux).
SHM = Path("/dev/shm")
# The control line and one line per rank's sequence number precede the slots (_board.c).
_LINE = 64


def _never() -> bool:
    return False


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    lib = compiled.library(Path(__file__).parent, "_board")
    if lib is None:
        return None
    i32, i64, ptr, dbl = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
    lib.optcc_board_post.restype = None
    lib.optcc_board_post.argtypes = [ptr, i32, i32, i64, i64, ptr, i64]
    lib.optcc_board_wait.restype = i32
    lib.optcc_board_wait.argtypes = [ptr, i32, i64, i64, ptr, i64, dbl, dbl]
    lib.optcc_board_break.restype = None
    lib.optcc_board_break.argtypes = [ptr, i64]
    lib.optcc_board_mark.restype = i64
    lib.optcc_board_mark.argtypes = [ptr]
    lib.optcc_board_wakes.restype = i64
    lib.optcc_board_wakes.argtypes = []
    return lib


# Why a board is broken: its mark (_board.c) holds the reason, the rank that marked it and
# the rank at fault, so that every rank's error names the culprit, not only the rank that
# saw it first.
#: The group was aborted on the marking rank.
ABORTED = 1
#: The rank at fault exited while the marking rank waited for it.
EXITED = 2
#: The rank at fault did not come within the group's timeout.
TIMED_OUT = 3
#: An exception left an exchange on the marking rank (its sequence numbers are out of step).
FAILED = 4
#: The group was destroyed on the marking rank (a soft mark: _board.c).
DESTROYED = 5
_SOFT = 1 << 62


def _mark(reason: int, by: int, culprit: int) -> int:
    """The mark of ``reason``, set by rank ``by``, naming rank ``culprit``."""
    soft = _SOFT if reason == DESTROYED else 0
    return soft | reason << 48 | (by + 1) << 24 | (culprit + 1)


def _unmark(mark: int) -> tuple[int, int, int]:
    """``(reason, by, culprit)`` of a mark (:func:`_mark`)."""
    return (mark >> 48) & 0xFF, ((mark >> 24) & 0xFFFFFF) - 1, (mark & 0xFFFFFF) - 1


def wakes() -> int:
    """The futex wake-ups this process's boards issued so far (0 without a board)."""
    lib = _lib()
    return int(lib.optcc_board_wakes()) if lib is not None else 0


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has exited, reaped by its parent or not.

    ``kill(pid, 0)`` fails only once the process is reaped: a rank whose parent (a
    launcher, a user's script, a test) has not collected it yet is a zombie, dead but still
    found, and would be waited for until the timeout. Its state in ``/proc/PID/stat``
    says so ('Z', or 'X' while it is being reaped); without ``/proc``, only ``kill``
    tells.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, owned by another user: its state tells
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:  # no /proc here (or reaped just now: the next look's kill says so)
        return False
    # "PID (COMMAND) STATE ...": the command may hold spaces and parentheses.
    end = stat.rfind(b")")
    return stat[end + 2 : end + 3] in (b"Z", b"X")


def usable() -> bool:
    """Whether this process can use a board (the C library loads, ``OPTCC_BOARD``)."""
    return bool(config.rc.board) and SHM.is_dir() and _lib() is not None


def place() -> tuple[str, ...] | None:
    """What must be the same on every rank for a board to join them (the machine's boot,
    the ``/dev/shm`` file system, the process and network namespaces), or None where this
    process cannot use one. Ranks compare these at set-up (:meth:`Board.open`)."""
    if not usable():
        return None
    try:
        boot = boot_id()
        shm = SHM.stat()
        spaces = tuple(os.readlink(f"/proc/self/ns/{ns}") for ns in ("pid", "net"))
    except OSError:  # not Linux, or no /proc: no way to know the ranks share memory
        return None
    return (boot, f"{shm.st_dev}:{shm.st_ino}", *spaces)


class Board:
    """A shared-memory allgather of fixed blocks among the ranks of one machine (module
    docstring). Made collectively by :meth:`open`; use :meth:`allgather_block` from one
    thread at a time, in the same order on every rank (as every collective).

    Parameters
    ----------
    memory : mmap.mmap
        The shared mapping, laid out as ``_board.c`` describes.
    rank, size : int
        This process's rank and the number of ranks.
    slot : int
        The bytes of one rank's block at most.
    pids : sequence of int
        Every rank's process number (to tell a rank gone from a rank late).
    spin : float
        Seconds a wait spins before it sleeps.
    """

    def __init__(
        self, memory: mmap.mmap, rank: int, size: int, slot: int, pids: Sequence[int], spin: float
    ) -> None:
        lib = _lib()
        assert lib is not None  # open() made it, so the library loaded
        self._lib = lib
        # The mapping as bytes, and its address for C; the view keeps the mapping open for
        # as long as this object lives (a thread may be inside a wait on it).
        self._bytes = np.frombuffer(memory, dtype=np.uint8)
        self._addr = self._bytes.ctypes.data
        self.rank, self.size, self.slot = rank, size, slot
        self.pids = list(pids)
        self.spin = spin
        self._seq = 0
        # Destroyed on this rank (close): no more posts.
        self._closed = False
        #: Seconds a wait may last (the group's timeout; the owner sets it).
        self.timeout = 1800.0
        #: Whether the owner was aborted (a wait then raises at its next look).
        self.aborted: Callable[[], bool] = _never
        #: What the errors name (the owner's description).
        self.what = "board"

    @classmethod
    def open(
        cls,
        rank: int,
        size: int,
        places: Sequence[tuple[str, ...] | None],
        allgather: Callable[[object], list[object]],
        crowding: float = 1.0,
    ) -> Board | None:
        """The board of ``size`` ranks, or None on every rank where they cannot share one.

        Collective: ``places`` is every rank's :func:`place` (gathered by the caller), and
        ``allgather`` the transport's own gather, which carries the file from rank 0 and
        every rank's success.

        The file never has a name, so that nothing can outlive the job in ``/dev/shm``,
        whatever is killed when. Rank 0 makes it nameless (``O_TMPFILE``) in ``/dev/shm``,
        so that its pages count against ``/dev/shm``'s room as a named file's would (a
        ``memfd`` would take them from elsewhere, past the limit the machine set for
        shared memory), and the others open it through rank 0's descriptor
        (``/proc/PID/fd/N``, checked to be that file). A named file, unlinked once every
        rank mapped it, leaves 8 MiB behind for good if rank 0 is killed between making
        it and the unlink (and a peer that finds rank 0 dead cannot remove a name it was
        never sent); a nameless one is freed by the kernel once no rank holds it. Where
        ``O_TMPFILE`` or ``/proc`` is missing, or rank 0's descriptor cannot be opened
        (another user, a process that is not dumpable), every rank gets None and the
        library carries the exchanges."""
        if size < 2 or places[0] is None or any(p != places[0] for p in places):
            return None
        slot = -(-(BLOCKS_TOTAL // size + SLOT_EXTRA) // _LINE) * _LINE
        nbytes = _LINE * (1 + size) + 2 * size * slot
        made = -1  # rank 0's descriptor of the file
        offer: tuple[str, int, int] | None = None
        if rank == 0:
            try:
                made = os.open(SHM, os.O_TMPFILE | os.O_RDWR, 0o600)
                # The pages reserved now: a RAM file system that fills up later would
                # end a rank that touches an unreserved page with SIGBUS.
                os.posix_fallocate(made, 0, nbytes)
                st = os.fstat(made)
                offer = (f"/proc/{os.getpid()}/fd/{made}", st.st_dev, st.st_ino)
            except (OSError, AttributeError):  # no room, or no O_TMPFILE: the library
                offer = None
        try:
            got = allgather(offer)[0]
            memory: mmap.mmap | None = None
            if isinstance(got, tuple):
                path, dev, ino = cast("tuple[str, int, int]", got)
                try:
                    fd = os.dup(made) if rank == 0 else os.open(path, os.O_RDWR)
                    try:
                        st = os.fstat(fd)
                        if (st.st_dev, st.st_ino) == (dev, ino) and st.st_size >= nbytes:
                            memory = mmap.mmap(fd, nbytes)
                    finally:
                        os.close(fd)
                except OSError:  # rank 0 gone, another user's process, or no room to map
                    memory = None
            # What every rank sent: whether it mapped the file, and its process number.
            gathered = allgather((memory is not None, os.getpid()))
            answers = cast("list[tuple[bool, int]]", gathered)
        finally:
            # Every rank opened it (or one failed: the gather raised): the mappings hold
            # it from now on, and the last one to go frees it.
            if made >= 0:
                os.close(made)
        if memory is None or not all(ok for ok, _ in answers):
            return None
        pids = [int(pid) for _, pid in answers]
        return cls(memory, rank, size, slot, pids, SPIN if crowding <= 1.0 else 0.0)

    def fits(self, nbytes: int) -> bool:
        """Whether blocks of ``nbytes`` travel on the board (the same on every rank)."""
        return nbytes <= self.slot

    def allgather_block(self, block: np.ndarray, out: np.ndarray) -> None:
        """Every rank's ``block`` (contiguous bytes, the same size everywhere, at most
        :attr:`slot`) into the rows of ``out``, in rank order.

        Raises
        ------
        ArgumentError
            The group was aborted on this rank (:attr:`aborted`; as the transport's waits
            say it).
        ExecutionError
            The group was aborted or destroyed on another rank, a rank it waits for
            exited, :attr:`timeout` seconds passed, or an exception left an exchange on
            another rank; the board is then broken for every rank, and every rank's error
            names the rank at fault.
        """
        try:
            n = block.nbytes
            seq = self._post(block.ctypes.data, n)
            self._wait(seq, out.ctypes.data, n)
        except BaseException:
            self._failed()
            raise

    def allreduce(self, arr: np.ndarray, op: str) -> None:
        """``arr`` (1-D, contiguous, the same size and type on every rank) replaced in
        place by every rank's, reduced element-wise in rank order
        (:func:`optcc_mpi.reductions.reduce_rows`, as every Python path), so that every
        rank holds the same bits. Chunk by chunk: every rank posts its chunk, reduces its
        p-th of it from every rank's slot and posts that part in its slot of the other
        parity, then copies every rank's part out (a reduce-scatter and an allgather
        through the mapping, each rank reading each element once). Raises as
        :meth:`allgather_block`."""
        try:
            self._allreduce(arr, op)
        except BaseException:
            self._failed()
            raise

    def _failed(self) -> None:
        """An exception is leaving an exchange (an error of the board's, or anything
        raised between a post and its wait: KeyboardInterrupt, MemoryError): this rank's
        sequence numbers may now be behind the others', and its next post would be taken
        for a part of this call. The board is marked broken (hard: _board.c) before this
        rank can post again, so every rank's wait, now or later, raises instead; a mark
        already there (the error's own) stays. Not after :meth:`close`: a closed board
        posts nothing more, and its soft mark already ends the waits it leaves short."""
        if not self._closed:
            self.broken(FAILED, self.rank)

    def _allreduce(self, arr: np.ndarray, op: str) -> None:
        p, item = self.size, arr.dtype.itemsize
        flat = arr.view(np.uint8)
        # Elements per chunk: a multiple of p, so that every part is whole elements.
        per = max(p, (self.slot // item) // p * p)
        count = arr.size
        for lo in range(0, count, per):
            m = min(per, count - lo)
            cut = [lo + (m * r) // p for r in range(p + 1)]
            mine = slice(cut[self.rank] - lo, cut[self.rank + 1] - lo)
            seq = self._post(flat[lo * item :].ctypes.data, m * item)
            self._wait(seq, 0, 0)
            rows = [self._row(seq, r, arr.dtype, m) for r in range(p)]
            part = self._row(seq + 1, self.rank, arr.dtype, mine.stop - mine.start)
            # (part is in the other parity's slots: it never overlaps a row. An overflow
            # is the result, not a warning raised as an error on one rank alone.)
            reduce_rows(np, op, part, [row[mine] for row in rows])
            self._wait(self._post(0, 0), 0, 0)
            for r in range(p):
                width = cut[r + 1] - cut[r]
                arr[cut[r] : cut[r + 1]] = self._row(seq + 1, r, arr.dtype, width)

    def _row(self, seq: int, r: int, dtype: np.dtype, n: int) -> np.ndarray:
        """Rank ``r``'s slot of block ``seq`` as ``n`` elements of ``dtype``."""
        at = _LINE * (1 + self.size) + ((seq & 1) * self.size + r) * self.slot
        return self._bytes[at : at + n * dtype.itemsize].view(dtype)

    def _post(self, src: int, n: int) -> int:
        """Post the next block (``n`` bytes from address ``src``; none: the slot was
        written in place); its sequence number."""
        if self._closed:  # destroyed here: this rank posts nothing more
            raise ExecutionError(self._why(_mark(DESTROYED, self.rank, self.rank)))
        seq = self._seq = self._seq + 1
        self._lib.optcc_board_post(self._addr, self.size, self.rank, self.slot, seq, src, n)
        return seq

    def _wait(self, seq: int, out: int, n: int) -> None:
        """Wait for every rank's block ``seq``, copying each one's first ``n`` bytes to
        address ``out`` (rank by rank), looking at the group between slices."""
        lib, addr, what = self._lib, self._addr, self.what
        start = time.monotonic()
        # (read at each wait, not bound at import: one value for every transport's waits)
        poll = base.ABORT_POLL
        while True:
            missing = lib.optcc_board_wait(addr, self.size, self.slot, seq, out, n, poll, self.spin)
            if missing == -1:
                return
            if missing == -2:
                raise ExecutionError(self._why(int(lib.optcc_board_mark(addr))))
            if self.aborted():
                self.broken(ABORTED, self.rank)
                raise ArgumentError(f"{what}: the process group was aborted")
            pid = self.pids[missing]
            if _exited(pid):
                self.broken(EXITED, missing)
                raise ExecutionError(
                    f"{what}: rank {missing} (process {pid}) exited while this rank waited for it"
                )
            if time.monotonic() - start > self.timeout:
                self.broken(TIMED_OUT, missing)
                raise ExecutionError(
                    f"{what}: rank {missing} did not join the exchange within "
                    f"{self.timeout:g} s (the group's timeout)"
                )

    def _why(self, mark: int) -> str:
        """The error of a wait that the board's mark ended: what happened, and which rank
        is at fault (the same rank named on every rank, from the mark)."""
        reason, by, culprit = _unmark(mark)
        what = self.what
        seen = f"seen by rank {by}" if by != self.rank else "seen by this rank"
        if reason == DESTROYED:
            where = f"rank {by}" if by != self.rank else f"this rank (rank {by})"
            return f"{what}: the group was destroyed on {where}; this exchange cannot complete"
        if reason == ABORTED:
            return f"{what}: the group was aborted on rank {by}"
        if reason == EXITED and 0 <= culprit < self.size:
            pid = self.pids[culprit]
            return f"{what}: rank {culprit} (process {pid}) exited ({seen})"
        if reason == TIMED_OUT:
            return (
                f"{what}: rank {culprit} did not join an exchange within the group's "
                f"timeout ({seen})"
            )
        if reason == FAILED:
            return (
                f"{what}: an exception left an exchange on rank {culprit} (its error says "
                "which), so the board no longer carries the group's exchanges"
            )
        return f"{what}: the board was broken (mark {mark:#x})"

    def broken(self, reason: int = ABORTED, culprit: int | None = None) -> None:
        """Mark the board broken, for ``reason`` (:data:`ABORTED`, :data:`EXITED`,
        :data:`TIMED_OUT`, :data:`FAILED`; :data:`DESTROYED` is :meth:`close`'s), naming
        rank ``culprit`` (default: this rank): every rank's wait, now or later, raises,
        with an error that names the culprit. The first mark stays (a hard one replaces
        a destroy's)."""
        culprit = self.rank if culprit is None else culprit
        self._lib.optcc_board_break(self._addr, _mark(reason, self.rank, culprit))

    def close(self) -> None:
        """The group was destroyed on this rank: it posts nothing more, its own waits
        raise, and every other rank's wait that needs a block of this rank raises at
        once, naming this rank (a soft mark: an exchange this rank completed before still
        completes on every rank, so that ranks destroying a group one after another at the
        end of a job see no error). The mapping goes with the last reference."""
        if not self._closed:
            self._closed = True
            self._lib.optcc_board_break(self._addr, _mark(DESTROYED, self.rank, self.rank))
