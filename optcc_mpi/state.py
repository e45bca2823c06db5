"""What the collectives cache per communicator (or process group).

The first collective call on a communicator makes its :class:`CommState` and hangs it on
the communicator's transport (:attr:`optcc_mpi.transports.Transport.state`), which is
cached with the communicator itself, so both are freed together. It holds what every
later call would otherwise recompute: the link profile from ``$OPTCC_LINKS`` translated to
this communicator's ranks, the probe's result, the watch, the schedules built, the
buffers of the argument check (:mod:`optcc_mpi.protocol`), including the short call's
compiled path (:mod:`optcc_mpi.fastcall`), and the gather limit measured for it
(:mod:`optcc_mpi.crossover`).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from optcc_mpi import transports
from optcc_mpi.errors import ArgumentError
from optcc_mpi.links import Links
from optcc_mpi.transports import Transport

__all__ = ["CommState", "state_of", "FOLD_MIN", "FOLD_TOTAL", "HEADER", "HEADER_BYTES"]

#: The argument check's header, 12 int64 fields (what each holds: optcc_mpi.protocol), at
#: the start of the check's block; here, below both, so that the protocol and the gather
#: limit's measurement (optcc_mpi.crossover) size the check's buffers from one definition.
HEADER = struct.Struct("<12q")
HEADER_BYTES = HEADER.size
#: Fewest bytes of data the argument check carries (optcc_mpi.protocol).
FOLD_MIN = 256
#: Most bytes the check's gather moves per call, summed over ranks.
FOLD_TOTAL = 256 * 1024
#: Cached schedules per communicator (oldest dropped first).
_PLAN_CACHE = 64


class CommState:
    """What we cache for one communicator (see the module docstring)."""

    __slots__ = (
        "transport",
        "size",
        "rank",
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
        "plans",
        "folds",
        "fast",
        "gather_limit",
        "__weakref__",
    )

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.size = transport.size
        self.rank = transport.rank
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
        self.plans: dict[Any, Any] = {}
        # The compiled call path (optcc_mpi.fastcall): the plans of the short calls whose
        # data travelled in the check, by (bytes, dtype), and its context for the current
        # check buffers (None until made, and again whenever they are reallocated).
        self.folds: dict[Any, Any] = {}
        self.fast: Any = None
        #: The largest short message gathered rather than handed to the library's
        #: AllReduce (optcc_mpi.crossover), once decided; the same on every rank.
        self.gather_limit: int | None = None

    # -- OPTCC_LINKS, in the job's numbering ------------------------------------------------
    def links_from_env(self, text: str | None) -> Links:
        """The profile ``text`` (the job's ranks) on this communicator's ranks; cached per
        text. ArgumentError if it does not parse or names a rank outside the job."""
        cached_text, value = self.env_links
        if cached_text != text:
            try:
                value = self.transport.job_links(Links.parse(text or ""))
            except (ValueError, TypeError) as exc:
                value = ArgumentError(f"$OPTCC_LINKS={text!r}: {exc}")
            self.env_links = (text, value)
        if isinstance(value, Exception):
            raise value
        return value

    # -- caches -------------------------------------------------------------------------
    def remember(self, cache: dict[Any, Any], key: Any, value: Any) -> Any:
        """Store ``value`` under ``key`` in one of the bounded caches; returns it."""
        if len(cache) >= _PLAN_CACHE:
            cache.pop(next(iter(cache)))
        cache[key] = value
        return value

    def ensure_capacity(self, capacity: int, header_bytes: int) -> None:
        """(Re)allocate the check's buffers for ``capacity`` bytes of data."""
        if capacity != self.capacity or self.block is None:
            self.capacity = capacity
            width = header_bytes + capacity
            self.block = np.zeros(width, dtype=np.uint8)
            self.block_mv = memoryview(self.block)
            self.gathered = np.zeros((self.size, width), dtype=np.uint8)
            self.heads = self.gathered[:, :header_bytes]
            self.views = {}
            self.fast = None


def state_of(comm: Any) -> CommState:
    """The cached :class:`CommState` of ``comm`` (an mpi4py communicator, None for
    COMM_WORLD, a torch.distributed process group, or a transport), made on first use
    (collective then). Errors as :func:`optcc_mpi.transports.of`."""
    t = comm if isinstance(comm, Transport) else transports.of(comm)
    st = t.state
    if st is None:
        st = t.state = CommState(t)
    return st
