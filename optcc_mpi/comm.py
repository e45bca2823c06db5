"""Communicators: what we cache per communicator, and the mpi4py-style face :class:`Comm`.

Per-communicator cache
----------------------
The first collective call on a communicator creates a :class:`CommState` and caches it as
an MPI attribute of the communicator, so MPI frees it with the communicator. It holds
what every later call would otherwise recompute: the size and rank, a *private
duplicate* on which all our traffic travels (the argument agreement, the schedules'
messages, the probe), so that none of it can ever match a message or a collective of the
user's, the link profile from ``$OPTCC_LINKS`` translated to this communicator's ranks,
the probe's result, the algorithm ``auto`` chose and the schedules built, and the buffers
of the argument agreement (:mod:`optcc_mpi.collectives`). Creating it is collective
(``MPI_Comm_dup``); every rank reaches it at its first call.

``OPTCC_LINKS`` names ranks of ``COMM_WORLD``: on any other communicator the profile is
translated through the groups (``MPI_Group_translate_ranks``), and ranks that are not
members are dropped. A ``links=`` argument names ranks of the communicator it is given
with.

The mpi4py face
---------------
``optcc_mpi.Comm(MPI.COMM_WORLD)`` wraps a communicator: its ``Allreduce(sendbuf, recvbuf,
op=MPI.SUM)`` has mpi4py's signature and semantics and runs :func:`optcc_mpi.allreduce`
with the wrapper's ``algorithm`` and ``links``; every other attribute is the wrapped
communicator's, so an existing code changes one line::

    comm = optcc_mpi.Comm(MPI.COMM_WORLD, algorithm="auto", links="probe")
    comm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)    # ours
    comm.Bcast(weights, root=0)                        # mpi4py's
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from optcc_mpi.errors import ArgumentError, ArgumentTypeError
from optcc_mpi.links import Links

__all__ = ["Comm", "CommState", "check_comm", "state_of", "private_comm"]

#: Fewest bytes of data the argument agreement carries (optcc_mpi.collectives).
FOLD_MIN = 256
#: Most bytes the agreement's gather moves per call, summed over ranks.
FOLD_TOTAL = 256 * 1024
#: Cached schedules per communicator (oldest dropped first).
_PLAN_CACHE = 64

_KEYVAL: list[Any] = []
#: States by communicator handle: a dictionary lookup is four times cheaper than
#: MPI_Comm_get_attr. The attribute's delete callback removes the entry when MPI frees
#: the communicator, so a recycled handle never finds a stale state.
_BY_HANDLE: dict[int, CommState] = {}


def _delete(comm: Any, keyval: Any, st: CommState) -> None:
    _BY_HANDLE.pop(st.handle, None)
    st.free()


class CommState:
    """What we cache for one communicator (see the module docstring)."""

    __slots__ = (
        "comm",
        "handle",
        "size",
        "rank",
        "private",
        "capacity",
        "next_capacity",
        "block",
        "block_mv",
        "gathered",
        "heads",
        "views",
        "env_links",
        "probe",
        "watch",
        "chosen",
        "plans",
        "folds",
        "fast",
        "transport",
        "__weakref__",
    )

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.handle = comm.handle
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        # A plain mpi4py communicator: a Dup of our Comm would be a Comm again, whose
        # Allreduce is ours. With one rank nothing travels: no duplicate needed.
        plain = MPI.Intracomm(comm)
        self.private = plain.Dup() if self.size > 1 else plain
        # What joins the ranks, as the MPI library sees it: all on one node (it moves
        # messages through shared memory) or not. Builders size messages from it.
        self.transport = "shared-memory"
        if self.size > 1:
            local = self.private.Split_type(MPI.COMM_TYPE_SHARED)
            if local.Get_size() != self.size:
                self.transport = "network"
            local.Free()
        self.capacity = 0
        self.next_capacity = FOLD_MIN
        self.block: Any = None
        self.block_mv: Any = None
        self.gathered: Any = None
        self.heads: Any = None
        self.views: dict[Any, Any] = {}
        self.env_links: tuple[str | None, Any] = ("\0", None)
        self.probe: Any = None
        self.watch: Any = None
        self.chosen: dict[Any, str] = {}
        self.plans: dict[Any, Any] = {}
        # The compiled call path (optcc_mpi.fastcall): the plans of the short calls whose
        # data travelled in the check, by (bytes, dtype), and its context for the current
        # check buffers (None until made, and again whenever they are reallocated).
        self.folds: dict[Any, Any] = {}
        self.fast: Any = None

    def free(self) -> None:
        """Free the private duplicate (called by MPI when the communicator is freed)."""
        priv, self.private = self.private, None
        if priv is not None and self.size > 1:
            try:
                priv.Free()
            except Exception:  # pragma: no cover - MPI already finalising
                pass

    # -- OPTCC_LINKS, in COMM_WORLD numbering ---------------------------------------------
    def links_from_env(self, text: str | None) -> Links:
        """The profile ``text`` (ranks of COMM_WORLD) on this communicator's ranks; cached
        per text. ArgumentError if it does not parse or names a rank outside COMM_WORLD."""
        cached_text, value = self.env_links
        if cached_text != text:
            try:
                value = self._translate(Links.parse(text or ""), text or "")
            except (ValueError, TypeError) as exc:
                value = ArgumentError(f"$OPTCC_LINKS={text!r}: {exc}")
            self.env_links = (text, value)
        if isinstance(value, Exception):
            raise value
        return value

    def _translate(self, links: Links, text: str) -> Links:
        if links.healthy:
            return links
        world = MPI.COMM_WORLD
        wsize = world.Get_size()
        bad = [r for r in links.fractions if r >= wsize]
        if bad:
            raise ArgumentError(
                f"names rank {bad[0]}, outside COMM_WORLD of size {wsize} (OPTCC_LINKS uses "
                "COMM_WORLD ranks)"
            )
        if self.comm == world:
            return links
        wgroup, group = world.Get_group(), self.comm.Get_group()
        try:
            ranks = list(links.fractions)
            mine = MPI.Group.Translate_ranks(wgroup, ranks, group)
        finally:
            wgroup.Free()
            group.Free()
        return Links({m: links.fractions[w] for w, m in zip(ranks, mine) if m != MPI.UNDEFINED})

    # -- caches -------------------------------------------------------------------------
    def remember(self, cache: dict[Any, Any], key: Any, value: Any) -> Any:
        """Store ``value`` under ``key`` in one of the bounded caches; returns it."""
        if len(cache) >= _PLAN_CACHE:
            cache.pop(next(iter(cache)))
        cache[key] = value
        return value

    def ensure_capacity(self, capacity: int, header_bytes: int) -> None:
        """(Re)allocate the agreement's buffers for ``capacity`` bytes of data."""
        import numpy as np

        if capacity != self.capacity or self.block is None:
            self.capacity = capacity
            width = header_bytes + capacity
            self.block = np.zeros(width, dtype=np.uint8)
            self.block_mv = memoryview(self.block)
            self.gathered = np.zeros((self.size, width), dtype=np.uint8)
            self.heads = self.gathered[:, :header_bytes]
            self.views = {}
            self.fast = None


def _keyval() -> Any:
    if not _KEYVAL:
        _KEYVAL.append(MPI.Comm.Create_keyval(delete_fn=_delete))
    return _KEYVAL[0]


def check_comm(comm: Any) -> Any:
    """``comm`` (None: COMM_WORLD) if it is an mpi4py intracommunicator we can use.

    Raises
    ------
    ArgumentTypeError
        ``comm`` is not an mpi4py communicator.
    ArgumentError
        ``comm`` is ``MPI.COMM_NULL`` or an intercommunicator.
    """
    if comm is None:
        return MPI.COMM_WORLD
    if not isinstance(comm, MPI.Comm):
        raise ArgumentTypeError(
            f"comm must be an mpi4py communicator (e.g. MPI.COMM_WORLD), not "
            f"{type(comm).__module__}.{type(comm).__name__}"
        )
    if comm == MPI.COMM_NULL:
        raise ArgumentError(
            "comm is MPI.COMM_NULL: this process is not a member of that communicator "
            "(e.g. Split with color MPI.UNDEFINED); call only on members"
        )
    if comm.Is_inter():
        raise ArgumentError(
            "intercommunicators are not supported; reduce within each group, or over "
            "comm.Merge() (an intracommunicator of both groups)"
        )
    return comm


def state_of(comm: Any) -> CommState:
    """The cached :class:`CommState` of ``comm`` (None: COMM_WORLD), created on first use
    (collective then: it duplicates the communicator). Errors as :func:`check_comm`."""
    if comm is None:
        comm = MPI.COMM_WORLD
    elif not isinstance(comm, MPI.Comm):
        check_comm(comm)
    st = _BY_HANDLE.get(comm.handle)
    if st is not None:
        return st
    check_comm(comm)
    key = _keyval()
    st = comm.Get_attr(key)
    if st is None:
        st = CommState(comm)
        comm.Set_attr(key, st)
    _BY_HANDLE[st.handle] = st
    return st


def private_comm(comm: Any) -> Any:
    """The private duplicate of ``comm`` on which our messages travel (cached)."""
    return state_of(comm).private


_UNSET: Any = object()


class Comm(MPI.Intracomm):
    """An mpi4py intracommunicator whose ``Allreduce`` is ours (module docstring).

    A subclass of ``mpi4py.MPI.Intracomm`` sharing the wrapped communicator's handle: it
    *is* that communicator for every other method and for any code that takes an mpi4py
    communicator. ``Dup`` and ``Create``-style methods that mpi4py makes of the same class
    give wrappers with the default settings.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        The communicator to wrap (default ``COMM_WORLD``). Wrapping a :class:`Comm` copies
        its settings unless given here.
    algorithm : str
        What ``Allreduce`` runs: ``"auto"`` (default) or a registered algorithm.
    links : Links or str, optional
        Link profile for ``Allreduce`` in ranks of ``comm``, or ``"probe"``; default
        ``$OPTCC_LINKS`` (ranks of COMM_WORLD, translated).
    emulate, params, check
        As for :func:`optcc_mpi.allreduce`.

    Examples
    --------
    >>> from mpi4py import MPI
    >>> comm = Comm(MPI.COMM_WORLD, links="0:0.5")  # doctest: +SKIP
    >>> comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)  # doctest: +SKIP
    """

    algorithm: str = "auto"
    links: Links | str | None = None
    emulate: Any = None
    params: dict[str, Any] | None = None
    check: bool = True

    def __new__(cls, comm: Any = None, **settings: Any) -> Comm:
        # mpi4py's constructor takes only the communicator.
        return super().__new__(cls, check_comm(comm))

    def __init__(
        self,
        comm: Any = None,
        *,
        algorithm: str = _UNSET,
        links: Links | str | None = _UNSET,
        emulate: Any = _UNSET,
        params: dict[str, Any] | None = _UNSET,
        check: bool = _UNSET,
    ) -> None:
        given = {
            "algorithm": algorithm,
            "links": links,
            "emulate": emulate,
            "params": params,
            "check": check,
        }
        for name, value in given.items():
            if value is _UNSET:
                value = getattr(comm, name) if isinstance(comm, Comm) else getattr(Comm, name)
            setattr(self, name, value)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> None:  # noqa: N802
        """mpi4py's ``Comm.Allreduce``: reduce ``sendbuf`` of every rank into ``recvbuf``.

        ``sendbuf`` may be ``MPI.IN_PLACE`` or None (reduce ``recvbuf`` in place), as may
        ``sendbuf is recvbuf``; buffers are anything mpi4py accepts there (arrays, objects
        with the buffer protocol, ``[buf, MPI.DOUBLE]``, ``[buf, count, MPI.DOUBLE]``)
        plus PyTorch tensors; ``op`` an ``MPI.Op`` (default ``MPI.SUM``) or a name.
        Returns None, as mpi4py does.
        """
        from optcc_mpi.collectives import allreduce

        if recvbuf is None:
            raise ArgumentError("Allreduce needs a recvbuf (as in mpi4py)")
        allreduce(
            sendbuf,
            recvbuf,
            op="sum" if op is None else op,
            comm=self,
            algorithm=self.algorithm,
            links=self.links,
            emulate=self.emulate,
            params=self.params,
            check=self.check,
        )

    def __repr__(self) -> str:
        return (
            f"<optcc_mpi.Comm size={self.Get_size()} algorithm={self.algorithm!r} "
            f"links={self.links!r}>"
        )
