"""Policy shared by the algorithm modules: which sizes ``auto`` hands to whom, and how
large a message should be on each kind of fabric.

A point-to-point schedule costs at least 2(p-1) message latencies plus our executor's
per-message work, the MPI library's short-message algorithms about 2 log2(p) latencies in
compiled code; below :data:`SMALL_BYTES` per rank ``auto`` therefore leaves the call to
the library (``native``) and above it to the point-to-point schedules.

Message size by fabric (measured, docs/bench.md): a builder that declares a ``fabric``
parameter is told by :func:`optcc_mpi.allreduce` which kind of fabric joins the
communicator's ranks (its transport's :attr:`~optcc_mpi.transports.Transport.kind`),
``"shared-memory"`` (MPI says every rank shares one node) or ``"network"`` (anything
else, and every emulated network), or is given a measured :class:`Fabric`
(``params={"fabric": Fabric(...)}``, e.g. from ``python -m optcc_mpi.lab.calibrate``).
A :class:`Fabric` is a small model of what joins the ranks: a latency per step ``alpha``,
a fixed cost per message ``beta``, the rate ``bw`` it delivers, and whether it moves data
while the CPU reduces (``overlap``). The message size follows from it (derived, ours):

* with overlap (a NIC), a section cut into messages of ``m`` bytes pipelines the reduction
  of one message with the transfer of the next; the messages' fixed cost stays below a
  fraction ``eps`` of their transfer when ``m >= beta * bw / eps``, and the ``window - 1``
  other messages in flight keep the link busy while the receiver takes ``alpha`` to react
  when ``m >= alpha * bw / (window - 1)``. The larger of the two, rounded up to a power of
  two and at least :data:`MIN_MESSAGE_BYTES`, is the message size; the defaults give
  :data:`NETWORK_MESSAGE_BYTES`;
* without overlap (shared memory: the transfer *is* CPU copying, progressed only inside
  MPI calls) a section of ``S`` bytes in ``c`` messages costs ``S / bw + c * beta``, least
  at ``c = 1``: a section travels as one message. Measured at p = 2: the ring with 1 MiB
  messages took 1.18-1.23x a blocking ``Sendrecv`` ring at 16-64 MiB, with one message
  per section 1.04-1.07x.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from optcc_mpi import config
from optcc_mpi.errors import ArgumentError
from optcc_mpi.links import Links
from optcc_mpi.units import parse_rate

__all__ = [
    "MAX_AUTO_OPS",
    "SMALL_BYTES",
    "NETWORK_MESSAGE_BYTES",
    "FABRICS",
    "MIN_MESSAGE_BYTES",
    "EPS",
    "Fabric",
    "NETWORK",
    "SHARED_MEMORY",
    "fabric_of",
    "network",
    "small_messages",
    "large_messages",
    "message_bytes",
]

#: Operations per schedule the automatic choices (OptCC's segments, R2CCL's broadcast
#: rounds) stay under: about 0.2 KiB each while building and simulating, so 14 million
#: take about 2.7 GiB and, on a 2-core machine, about 40 s; p = 1024 with one straggler
#: then gets 43 OptCC segments, within 1% of the bound.
MAX_AUTO_OPS = 14_000_000

#: Bytes per rank below which ``auto`` uses the MPI library's AllReduce.
SMALL_BYTES = 256 * 1024
#: Message size over a network: small enough to overlap the reduction of one message
#: with the transfer of the next, large enough that per-message costs stay small.
NETWORK_MESSAGE_BYTES = 1 << 20
#: Smallest message over a network with overlap: on the testbed (p = 4, 400 Mbit/s, rank 0
#: at half rate) OptCC took 1.17-1.22x the bound with 64 KiB messages, 1.07-1.11x with
#: 300 KiB (our Python's cost per message, which a two-flow calibration does not show).
MIN_MESSAGE_BYTES = 256 * 1024
#: Largest share of a message's transfer time its fixed cost may take (with overlap).
EPS = 0.05


@dataclass(frozen=True)
class Fabric:
    """A small model of what joins the ranks (module docstring).

    Parameters
    ----------
    name : str
        A label (``"network"``, ``"shared-memory"``, ``"calibrated"``, ...).
    latency : float
        Seconds per ring step for a small message (the receiver's reaction included).
    message_cost : float
        Fixed seconds per message, beyond its bytes.
    rate : float
        Bytes per second one direction delivers.
    overlap : bool
        Whether the fabric moves data while the CPU reduces (a NIC: yes; shared
        memory, where MPI copies with the CPU inside its calls: no).
    section_min : int
        Bytes below which no section is cut, whatever the model says: a watched call's
        messages must stay long enough to time (:data:`optcc_mpi.watch.MIN_BYTES`).
    """

    name: str
    latency: float
    message_cost: float
    rate: float
    overlap: bool = True
    section_min: int = 0

    def __post_init__(self) -> None:
        ok = (
            math.isfinite(self.latency)
            and math.isfinite(self.message_cost)
            and self.latency >= 0
            and self.message_cost >= 0
            and self.rate > 0
        )
        if not ok:
            raise ArgumentError(
                "Fabric: need finite latency, message_cost >= 0 and rate > 0 (got "
                f"latency={self.latency}, message_cost={self.message_cost}, rate={self.rate})"
            )

    def message_bytes(self, section_bytes: float, window: int = 2, eps: float = EPS) -> int:
        """Target size of one message when a section of ``section_bytes`` is sent
        (module docstring): at most the section, at least one byte."""
        section = max(1, int(section_bytes))
        if not self.overlap:
            return section
        if not (0 < eps < 1):
            raise ArgumentError(f"eps must be in (0, 1), got {eps}")
        m = self.message_cost * self.rate / eps
        if window >= 2:
            m = max(m, self.latency * self.rate / (window - 1))
        m = max(float(MIN_MESSAGE_BYTES), m)
        if m >= section:
            return section
        return min(section, 1 << max(0, math.ceil(math.log2(m))))

    def messages(self, section_bytes: float, window: int = 2) -> int:
        """Messages per section of ``section_bytes`` (0 for an empty section)."""
        if section_bytes <= 0:
            return 0
        return max(1, math.ceil(section_bytes / self.message_bytes(section_bytes, window)))

    def __str__(self) -> str:
        return (
            f"{self.name}: latency {self.latency * 1e6:.1f} us per step, "
            f"{self.message_cost * 1e6:.1f} us per message, {self.rate / 1e6:.0f} MB/s, "
            f"{'overlapping' if self.overlap else 'not overlapping'} the reduction"
        )


#: Default model of a network (10 Gbit/s, 50 us per step, 40 us per message): messages of
#: NETWORK_MESSAGE_BYTES. Pass a calibrated :class:`Fabric` for another network.
NETWORK = Fabric("network", latency=50e-6, message_cost=40e-6, rate=1.25e9, overlap=True)
#: Default model of shared memory (one node): CPU copies, no overlap, so one message per
#: section. The figures are what ``python -m optcc_mpi.lab.calibrate`` measured at p = 2 on
#: the development machine (12 us per step, 196 us per 512 KiB message, 6.7 GB/s).
SHARED_MEMORY = Fabric(
    "shared-memory", latency=12e-6, message_cost=200e-6, rate=6.5e9, overlap=False
)
#: The kinds of fabric a builder's ``fabric`` parameter may name (the kinds a transport
#: reports, :attr:`optcc_mpi.transports.Transport.kind`).
FABRICS = ("network", "shared-memory")
_BY_NAME = {"network": NETWORK, "shared-memory": SHARED_MEMORY}


def fabric_of(fabric: str | Fabric) -> Fabric:
    """The :class:`Fabric` a builder's ``fabric`` parameter names (or is):
    ``"network"`` is :data:`NETWORK`, at the rate ``$OPTCC_LINK_RATE`` says when it is set
    (:func:`network`)."""
    if isinstance(fabric, Fabric):
        return fabric
    if fabric == "network":
        return network()
    got = _BY_NAME.get(fabric) if isinstance(fabric, str) else None
    if got is None:
        raise ArgumentError(
            f"fabric must be one of {', '.join(map(repr, FABRICS))} or a Fabric, got {fabric!r}"
        )
    return got


def network(crowding: float = 1.0, rate: float | None = None) -> Fabric:
    """The network model in force: the same model as :data:`NETWORK` at
    ``$OPTCC_LINK_RATE`` (one healthy link's rate, e.g. ``200mbit``) where it is set, else
    at ``rate`` (bytes/s: the rate the collectives learnt, :mod:`optcc_mpi.planning`),
    else :data:`NETWORK` itself, whose rate is a 10 Gbit/s NIC's.

    The rate sizes what a message's fixed cost is weighed against: OptCC's smallest
    section (``optcc.section_floor``, ``2 * message_cost * rate``) and the ring's message
    (:meth:`Fabric.message_bytes`). At 10 Gbit/s the floor is 97.7 KiB, which at 16
    ranks leaves an 8 MiB message 5 segments (1/5 of pipeline head and tail); on 200
    Mbit/s links a message's 40 us moves 1 KB, and 34 segments took 1.15x the bound on
    the testbed where 5 took 1.52x (docs/testbed.md, issue 36). It is the job's to set,
    the same on every rank (the ranks build their schedules from it and must build the
    same one): told, the job's to set; learnt, measured collectively, hence the same.

    Parameters
    ----------
    crowding : float, optional
        Ranks per core (:attr:`optcc_mpi.transports.Transport.crowding`). With a rate
        told or learnt, a message's fixed cost is charged that many times: a dependent
        message waits for its receiver to be scheduled once the ranks outnumber the cores
        (derived, ours: on the 16-rank testbed on 2 cores, 8 ranks per core, the sections
        that did best carried about ``2 x 8 x 40 us`` of a healthy link's time at 50 and
        at 200 Mbit/s; docs/testbed.md 1.6j). Without a rate the default model's 10
        Gbit/s already gives the largest sections, and crowding is not applied.
    rate : float, optional
        A healthy link's rate in bytes/s, learnt; ``$OPTCC_LINK_RATE`` overrides it.
    """
    text = config.get("OPTCC_LINK_RATE")
    if text is not None:
        return _network_at(text, max(1.0, float(crowding)))
    if rate is None:
        return NETWORK
    return _network_of(float(rate), max(1.0, float(crowding)))


@functools.lru_cache(maxsize=8)
def _network_at(text: str, crowding: float = 1.0) -> Fabric:
    try:
        rate = parse_rate(text)
    except ArgumentError as exc:
        raise ArgumentError(f"OPTCC_LINK_RATE={text!r}: {exc}") from None
    return _network_of(rate, crowding)


@functools.lru_cache(maxsize=16)
def _network_of(rate: float, crowding: float = 1.0) -> Fabric:
    return dataclasses.replace(NETWORK, rate=rate, message_cost=NETWORK.message_cost * crowding)


def small_messages(p: int, nbytes: float, links: Links) -> bool:
    """``auto`` predicate of the library's AllReduce: short messages, or a single rank."""
    return p < 2 or nbytes < SMALL_BYTES


def large_messages(p: int, nbytes: float, links: Links) -> bool:
    """``auto`` predicate of point-to-point schedules: messages of SMALL_BYTES or more."""
    return not small_messages(p, nbytes, links)


def message_bytes(section_bytes: int, fabric: str | Fabric = "network", window: int = 2) -> int:
    """Target size of one message when a section of ``section_bytes`` is sent over
    ``fabric`` (see the module docstring)."""
    return fabric_of(fabric).message_bytes(section_bytes, window)
