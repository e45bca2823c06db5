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

Its size, and the budget
------------------------
The file is in ``/dev/shm``, a RAM file system that the job shares with whatever else
needs it there (a DataLoader's workers hand their batches through it; Docker gives it 64
MiB). A board therefore starts small and grows only for a group whose calls need it,
within a budget:

* *Made small.* A board is made with slots of :data:`BLOCKS_FIRST` (256 KiB) for every
  rank together, in each of its two parities: 516 KiB of ``/dev/shm`` at 2 ranks, 520
  KiB at 4 (whole pages). That holds the check's largest gather (:data:`GATHER_TOTAL`,
  so every check travels on the board from the first call) and a short AllReduce in one
  chunk; a group that makes only such calls (small messages, barriers) never takes more.
* *Grown by the calls, collectively.* An AllReduce longer than a chunk grows the board
  first (:meth:`Board._grow`): to the least size, doubling from :data:`BLOCKS_FIRST`,
  whose chunk holds the call, at most :data:`BLOCKS_TOTAL` (4 MiB, the size every board
  had before: 8 MiB in all). Every rank makes the same call with the same size, so every
  rank decides alike, at the same point of the group's exchanges, from nothing but that
  size and the board's own state; the new file is offered and accepted through the board
  itself, and every rank moves to it or none does. Growing rather than chunking finely:
  the data AllReduce works chunk by chunk anyway, but each chunk is two exchanges, and
  on 2 loaded cores a 4 MiB call through 128 KiB chunks took 5x as long as through 2 MiB
  chunks, 16 MiB 3.3x. A larger board only makes fewer chunks; the bits are the same.
* *The budget* (:func:`budget`), checked by rank 0 alone before it makes a file, as the
  board is made or grows: the boards this process made may hold at most :data:`SHARE`
  (a quarter) of ``/dev/shm``'s size together, and :data:`RESERVE` (half) of it must stay
  free after the file, whoever holds the rest. The first rule keeps one job's boards to
  16 MiB of a 64 MiB ``/dev/shm`` (30 groups of 2 to 8 ranks: 15.1-15.4 MiB), the second
  holds for every process of the machine together: the boards never leave less than
  half of ``/dev/shm`` free for what needs it to run at all. A board the budget refuses
  at the making is none, on every rank (rank 0's refusal travels in the same gather that
  would have carried the file): the group's exchanges go to gloo, slower but the same
  results, and every call's record says so (``board: "none: /dev/shm budget"``,
  :class:`~optcc_mpi.communicators.CallRecord`). A growth refused leaves the board at the
  size it has, for good: the group's long calls take more chunks.

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
whose links must carry their traffic), ``OPTCC_BOARD`` not ``0``, and room in the budget.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import numpy as np

from optcc_mpi import compiled, config
from optcc_mpi.errors import ArgumentError, ExecutionError
from optcc_mpi.reductions import reduce_rows
from optcc_mpi.transports import base
from optcc_mpi.transports.base import boot_id

__all__ = [
    "Board",
    "place",
    "usable",
    "budget",
    "held",
    "slot_bytes",
    "BLOCKS_FIRST",
    "BLOCKS_TOTAL",
    "GATHER_TOTAL",
    "SLOT_EXTRA",
    "SHARE",
    "RESERVE",
]

#: The bytes of data every rank's slot together holds on a board as it is made (each of
#: the two parities): what the argument check's largest gather needs (:data:`GATHER_TOTAL`)
#: and the chunk of a short :meth:`Board.allreduce`. Each slot has :data:`SLOT_EXTRA` more
#: for a header: 516 KiB of /dev/shm at 2 ranks, so that 30 groups' boards hold 15.1 MiB.
BLOCKS_FIRST = 256 << 10
#: The most every rank's slot together grows to (:meth:`Board.allreduce`), each parity: 8
#: MiB and a little more in all, what every board held before boards were sized (a chunk
#: of 2 MiB per rank at 2 ranks, 1 MiB at 4; smaller chunks cost more exchanges: a 4 MiB
#: call through 128 KiB chunks took 5x as long as through 2 MiB chunks on 2 loaded cores).
BLOCKS_TOTAL = 4 << 20
#: Every rank's data together up to which a short message travels in the argument check
#: on a board (gathered, then reduced on every rank: one exchange, p copies out) rather
#: than through :meth:`Board.allreduce` (two exchanges, one copy out): what a board holds
#: as it is made (:data:`BLOCKS_FIRST`), so that every check travels on it from the first
#: call (256 KiB, 512 KiB and 1 MiB compared on 2 cores at 2 and 4 ranks were within noise
#: of each other: docs/results.md).
GATHER_TOTAL = BLOCKS_FIRST
#: Room in each slot beyond its share of the blocks, for the check's header (96 bytes) and
#: its least room (256 bytes) where many ranks make that share smaller, and for the offer
#: of a larger file (:meth:`Board.allreduce`).
SLOT_EXTRA = 512
#: The share of ``/dev/shm``'s size that the boards this process made may hold together
#: (module docstring: the budget).
SHARE = 0.25
#: The share of ``/dev/shm``'s size that must stay free after a board is made or grows,
#: whoever holds the rest (module docstring: the budget).
RESERVE = 0.5
#: How long a rank spins (yielding its core) for a peer before it sleeps, where every
#: rank has a core.
SPIN = 50e-6
#: Where the shared file is made (a RAM file system on Linux).
SHM = Path("/dev/shm")
# The control line and one line per rank's sequence number precede the slots (_board.c).
_LINE = 64
# The offer of a larger file (Board._grow): made, rank 0's process and descriptor, the
# file's device and inode.
_OFFER = struct.Struct("<5q")


def _never() -> bool:
    return False


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    lib = compiled.library(Path(__file__).parent, "_board")
    if lib is None:
        return None
    i32, i64, ptr, dbl = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
    lib.optcc_board_post.restype = None
    lib.optcc_board_post.argtypes = [ptr, ptr, i32, i32, i64, i64, ptr, i64]
    lib.optcc_board_wait.restype = i32
    lib.optcc_board_wait.argtypes = [ptr, ptr, i32, i64, i64, ptr, i64, dbl, dbl]
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


def slot_bytes(size: int, total: int) -> int:
    """The bytes of one rank's slot on a board of ``size`` ranks whose slots hold
    ``total`` bytes together (a share, :data:`SLOT_EXTRA` more, whole lines)."""
    return -(-(total // size + SLOT_EXTRA) // _LINE) * _LINE


# The bytes of /dev/shm (whole pages) held by the board files this process made and still
# maps (the budget's share); a file's count goes when its mapping here goes.
_held = 0
_held_lock = threading.Lock()


def held() -> int:
    """Bytes of ``/dev/shm`` (whole pages) that the board files this process made hold
    while it maps them (the files of the boards of which it is rank 0)."""
    return _held


def _hold(memory: mmap.mmap, nbytes: int) -> None:
    """Count ``nbytes`` against this process's share while ``memory`` is mapped."""
    global _held
    with _held_lock:
        _held += nbytes
    weakref.finalize(memory, _let_go, nbytes)


def _let_go(nbytes: int) -> None:
    global _held
    with _held_lock:
        _held -= nbytes


def _pages(nbytes: int) -> int:
    """The bytes of a RAM file system a file of ``nbytes`` takes: whole pages."""
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def budget(nbytes: int) -> str | None:
    """None where a file of ``nbytes`` fits the budget (module docstring), else why not.

    Two rules. The boards this process made may hold at most :data:`SHARE` of
    ``/dev/shm``'s size together (:func:`held`): a job's groups have one rank 0, or a few,
    whose boards together stay within it. And after the file, :data:`RESERVE` of the size
    must stay free, whoever holds the rest (other jobs' boards, a DataLoader's tensors):
    the boards of every process together never take ``/dev/shm`` below it. A file system
    that reports no size (a tmpfs made without a limit) is held to neither.
    """
    try:
        st = os.statvfs(SHM)
    except OSError:  # (SHM is a directory: usable(); posix_fallocate still checks room)
        return None
    pages = _pages(nbytes)
    size = st.f_blocks * st.f_frsize
    if size <= 0:
        return None
    if _held + pages > SHARE * size or st.f_bavail * st.f_frsize - pages < RESERVE * size:
        return "/dev/shm budget"
    return None


def _make(nbytes: int) -> tuple[int, tuple[str, int, int] | str]:
    """Rank 0's part of making a board file of ``nbytes``: ``(descriptor, offer)``, the
    offer ``(path, device, inode)`` for the peers, or why there is none (then no
    descriptor, -1)."""
    why = budget(nbytes)
    if why is not None:
        return -1, why
    made = -1
    try:
        made = os.open(SHM, os.O_TMPFILE | os.O_RDWR, 0o600)
        # The pages reserved now: a RAM file system that fills up later would end a rank
        # that touches an unreserved page with SIGBUS.
        os.posix_fallocate(made, 0, nbytes)
        st = os.fstat(made)
    except (OSError, AttributeError) as exc:  # no room, or no O_TMPFILE: the library
        if made >= 0:
            os.close(made)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return -1, "no room in /dev/shm"
        return -1, "no shared file (O_TMPFILE)"
    return made, (f"/proc/{os.getpid()}/fd/{made}", st.st_dev, st.st_ino)


def _mapped(made: int, offer: object, nbytes: int) -> mmap.mmap | None:
    """The file that rank 0 ``offer``-ed (its own descriptor ``made`` on rank 0), mapped,
    or None where it cannot be (rank 0 gone, another user's process, no room to map, not
    the file offered)."""
    if not isinstance(offer, tuple):
        return None
    path, dev, ino = cast("tuple[str, int, int]", offer)
    try:
        fd = os.dup(made) if made >= 0 else os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (dev, ino) and st.st_size >= nbytes:
                return mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
    except OSError:
        pass
    return None


class Board:
    """A shared-memory allgather of fixed blocks among the ranks of one machine (module
    docstring). Made collectively by :meth:`open`; use :meth:`allgather_block` and
    :meth:`allreduce` from one thread at a time, in the same order on every rank (as every
    collective).

    Parameters
    ----------
    memory : mmap.mmap
        The shared mapping, laid out as ``_board.c`` describes, its slots after the
        sequence numbers.
    rank, size : int
        This process's rank and the number of ranks.
    total : int
        Every rank's slot together, in bytes (:func:`slot_bytes`).
    pids : sequence of int
        Every rank's process number (to tell a rank gone from a rank late).
    spin : float
        Seconds a wait spins before it sleeps.
    """

    def __init__(
        self,
        memory: mmap.mmap,
        rank: int,
        size: int,
        total: int,
        pids: Sequence[int],
        spin: float,
    ) -> None:
        lib = _lib()
        assert lib is not None  # open() made it, so the library loaded
        self._lib = lib
        # The mapping as bytes, and its address for C; the view keeps the mapping open for
        # as long as this object lives (a thread may be inside a wait on it).
        self._bytes = np.frombuffer(memory, dtype=np.uint8)
        self._addr = self._bytes.ctypes.data
        self.rank, self.size = rank, size
        head = _LINE * (1 + size)
        #: Every rank's slot together (each parity), and one rank's slot, in bytes: what
        #: one chunk of :meth:`allreduce` moves per rank, and the largest block
        #: :meth:`allgather_block` takes.
        self.total, self.slot = total, slot_bytes(size, total)
        # The slots (the mapping's, after the sequence numbers, until the board grows into
        # a file of its own: _grow) and their address for C.
        self._slots = self._bytes[head : head + 2 * size * self.slot]
        self._slots_addr = self._slots.ctypes.data
        #: Bytes of /dev/shm this board's files hold (the first, and the larger one it grew
        #: into, if it did).
        self.nbytes = len(memory)
        self._first = len(memory)
        # Whether a larger call may still grow the board (not at its largest, and no
        # growth refused).
        self.growing = total < BLOCKS_TOTAL
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
        """The board of ``size`` ranks, or None on every rank where they cannot share one
        (:meth:`opened`, without the reason)."""
        return cls.opened(rank, size, places, allgather, crowding)[0]

    @classmethod
    def opened(
        cls,
        rank: int,
        size: int,
        places: Sequence[tuple[str, ...] | None],
        allgather: Callable[[object], list[object]],
        crowding: float = 1.0,
    ) -> tuple[Board | None, str]:
        """``(board, state)``: the board of ``size`` ranks and ``"on"``, or None and why
        there is none (``"none: ..."``), the same on every rank.

        Collective: ``places`` is every rank's :func:`place` (gathered by the caller), and
        ``allgather`` the transport's own gather, which carries the file from rank 0 and
        every rank's success. Rank 0 alone decides whether the board fits the budget
        (:func:`budget`), and the others learn it in the same gather that carries the
        file: every rank has a board, or none does, for the same reason.

        The file never has a name, so that nothing can outlive the job in ``/dev/shm``,
        whatever is killed when. Rank 0 makes it nameless (``O_TMPFILE``) in ``/dev/shm``,
        so that its pages count against ``/dev/shm``'s room as a named file's would (a
        ``memfd`` would take them from elsewhere, past the limit the machine set for
        shared memory), and the others open it through rank 0's descriptor
        (``/proc/PID/fd/N``, checked to be that file). A named file, unlinked once every
        rank mapped it, stays behind for good if rank 0 is killed between making it and
        the unlink (and a peer that finds rank 0 dead cannot remove a name it was never
        sent); a nameless one is freed by the kernel once no rank holds it. Where the
        budget refuses it, ``O_TMPFILE`` or ``/proc`` is missing, or rank 0's descriptor
        cannot be opened (another user, a process that is not dumpable), every rank gets
        None and the library carries the exchanges."""
        if size < 2:
            return None, "none: one rank"
        if any(p is None for p in places):
            return None, "none: unavailable on some rank (OPTCC_BOARD=0, no C library or /proc)"
        if any(p != places[0] for p in places):
            return None, "none: not one machine"
        total = BLOCKS_FIRST
        nbytes = _LINE * (1 + size) + 2 * size * slot_bytes(size, total)
        made, offer = _make(nbytes) if rank == 0 else (-1, "")
        try:
            got = allgather(offer)[0]
            memory = _mapped(made, got, nbytes)
            # What every rank sent: whether it mapped the file, and its process number.
            gathered = allgather((memory is not None, os.getpid()))
            answers = cast("list[tuple[bool, int]]", gathered)
        finally:
            # Every rank opened it (or one failed: the gather raised): the mappings hold
            # it from now on, and the last one to go frees it.
            if made >= 0:
                os.close(made)
        if isinstance(got, str):
            return None, f"none: {got}"
        if memory is None or not all(ok for ok, _ in answers):
            return None, "none: the file could not be mapped on every rank"
        if rank == 0:
            _hold(memory, _pages(nbytes))
        pids = [int(pid) for _, pid in answers]
        return cls(memory, rank, size, total, pids, SPIN if crowding <= 1.0 else 0.0), "on"

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
        if arr.nbytes > self.slot and self.growing:
            self._grow(arr.nbytes)
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
        at = ((seq & 1) * self.size + r) * self.slot
        return self._slots[at : at + n * dtype.itemsize].view(dtype)

    def _grow(self, nbytes: int) -> None:
        """Move the slots into a larger file, for a call of ``nbytes`` per rank (every
        rank's call of :meth:`allreduce` with the same ``nbytes``: collective, and decided
        alike on every rank, from that size and the board's own state).

        The size: the least :data:`BLOCKS_FIRST` times a power of two whose slot holds
        ``nbytes`` (the call in one chunk), at most :data:`BLOCKS_TOTAL`. Rank 0 makes
        the file if the budget (:func:`budget`) allows it and offers it through the board
        itself (one exchange), every rank maps it and says whether it could (another);
        then every rank moves its slots there, or, where the budget refused the file or a
        rank could not map it, every rank keeps the slots it has and the board grows no
        more. The control line and the sequence numbers stay in the first mapping
        (``_board.c``), so that the exchanges run on across the move and a mark made on
        any rank before it ends the waits after it. The first file's slots stay reserved
        (unused) while the board lives; the slots of an earlier growth are freed with the
        last rank's mapping of them."""
        p = self.size
        total = self.total
        while total < BLOCKS_TOTAL and slot_bytes(p, total) < nbytes:
            total *= 2
        total = min(total, BLOCKS_TOTAL)
        slot = slot_bytes(p, total)
        size = 2 * p * slot
        made, offer = _make(size) if self.rank == 0 else (-1, "")
        try:
            block = np.zeros(_OFFER.size, np.uint8)
            if isinstance(offer, tuple):  # (the path is rank 0's process and descriptor)
                _OFFER.pack_into(block, 0, 1, os.getpid(), made, offer[1], offer[2])
            rows = np.zeros((p, _OFFER.size), np.uint8)
            self._wait(self._post(block.ctypes.data, block.nbytes), rows.ctypes.data, block.nbytes)
            ok, pid, fd, dev, ino = _OFFER.unpack(rows[0].tobytes())
            got = (f"/proc/{pid}/fd/{fd}", dev, ino) if ok else None
            memory = _mapped(made, got, size)
            mine = np.array([memory is not None], np.uint8)
            oks = np.zeros((p, 1), np.uint8)
            self._wait(self._post(mine.ctypes.data, 1), oks.ctypes.data, 1)
        finally:
            if made >= 0:
                os.close(made)
        if memory is None or not oks.all():
            # (the same on every rank: rank 0's offer and every rank's answer)
            self.growing = False
            return
        if self.rank == 0:
            _hold(memory, _pages(size))
        # Every block from here on is in the new slots, on every rank: each moves after
        # the exchange above, and none posts again before it moved.
        self._slots = np.frombuffer(memory, dtype=np.uint8)
        self._slots_addr = self._slots.ctypes.data
        self.total, self.slot = total, slot
        self.nbytes = self._first + size
        self.growing = total < BLOCKS_TOTAL

    def _post(self, src: int, n: int) -> int:
        """Post the next block (``n`` bytes from address ``src``; none: the slot was
        written in place); its sequence number."""
        if self._closed:  # destroyed here: this rank posts nothing more
            raise ExecutionError(self._why(_mark(DESTROYED, self.rank, self.rank)))
        seq = self._seq = self._seq + 1
        self._lib.optcc_board_post(
            self._addr, self._slots_addr, self.size, self.rank, self.slot, seq, src, n
        )
        return seq

    def _wait(self, seq: int, out: int, n: int) -> None:
        """Wait for every rank's block ``seq``, copying each one's first ``n`` bytes to
        address ``out`` (rank by rank), looking at the group between slices."""
        lib, addr, what = self._lib, self._addr, self.what
        start = time.monotonic()
        # (read at each wait, not bound at import: one value for every transport's waits)
        poll = base.ABORT_POLL
        while True:
            missing = lib.optcc_board_wait(
                addr, self._slots_addr, self.size, self.slot, seq, out, n, poll, self.spin
            )
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
