"""The plan of a call: its links, the link rate, and the schedule chosen and built.

Phase 3 of a call (:mod:`optcc_mpi.collectives`, its module docstring has the five), and
what it is made of:

* the link profile: told (``links=``, ``$OPTCC_LINKS``), probed once per communicator
  (:data:`PROBE`), or learnt from the calls' own messages (:data:`WATCH`,
  :mod:`optcc_mpi.watch`); :func:`_links_of` reads the argument, :func:`_plan_call`
  settles a probed or watched profile after the agreement;
* the rate of a healthy link, which sizes a network's schedules: ``$OPTCC_LINK_RATE``
  (:func:`_rate_of`), or learnt once per communicator where the ranks span machines
  (:func:`_learns_rate`, :func:`_learn_rate`, up to :data:`LEARNT_RATE_MAX`);
* ``$OPTCC_EMULATE`` parsed (:func:`_emulation_from_env`);
* the schedule: the algorithm ``auto`` resolves to (:func:`choose_algorithm`) and its
  schedule, built and cached per communicator (:func:`_plan`,
  :class:`~optcc_mpi.communicators.Plan`).

A plan that is a pure function of arguments that must agree is made on each rank before
the agreement (:class:`optcc_mpi.arguments._Call`); ``"probe"``, ``"watch"`` and a rate
still to learn wait for :func:`_plan_call`, after it, where every rank takes part in
what they measure. The call is seen here through :class:`CheckedCall`: the module that
defines the call builds on this one.
"""

from __future__ import annotations

import dataclasses
import functools
from time import perf_counter
from typing import Any, Protocol

import numpy as np

from optcc_mpi import algorithms, config
from optcc_mpi.algorithms._policy import SMALL_BYTES, Fabric, network
from optcc_mpi.arrays import Array, ArrayOps, result_like
from optcc_mpi.check import protocol
from optcc_mpi.communicators import CommState, Plan
from optcc_mpi.emulation import Emulation
from optcc_mpi.errors import ArgumentError
from optcc_mpi.links import Links
from optcc_mpi.probe import ProbeResult, link_rate, probe
from optcc_mpi.schedule import COLL, Params, Schedule
from optcc_mpi.units import parse_rate
from optcc_mpi.watch import MIN_BYTES

__all__ = ["PROBE", "WATCH", "LEARNT_RATE_MAX", "CheckedCall", "choose_algorithm"]

#: Marker for ``links="probe"``: measure the profile (once per communicator).
PROBE = Links({})
#: Marker for ``links="watch"``: learn the profile from the calls' own messages
#: (:mod:`optcc_mpi.watch`).
WATCH = Links({})
_HEALTHY = Links()


class CheckedCall(Protocol):
    """A call checked on its rank (:class:`optcc_mpi.arguments._Call`): what the planning
    reads of it, and what :func:`_plan_call` sets (the profile settled, whether it is
    watched, when its last collective ended, its plan, its result)."""

    sendbuf: Any
    result: Any
    flat_in: Array
    flat_out: Array | None
    arrays: ArrayOps
    opn: str
    name: str
    count: int
    nbytes: int
    algorithm: str
    params: Params | None
    link_obj: Links
    emu: Emulation | None
    seen: np.ndarray | None
    watched: bool
    epoch: float
    plan: Plan | None


def choose_algorithm(p: int, nbytes: int, links: Links) -> str:
    """What ``algorithm="auto"`` runs: of the registered algorithms that declare
    themselves eligible for this call (the library's AllReduce for short messages, the
    point-to-point schedules for long ones), the one with the smallest modelled time;
    ties go to the one listed first (the ring before OptCC on healthy links)."""
    best, best_t = None, float("inf")
    for alg in algorithms.all_algorithms():
        if not alg.eligible(p, nbytes, links):
            continue
        t = alg.time(p, nbytes, 1.0, links)
        # A relative margin keeps rounding in the cost models from breaking ties.
        if best is None or t < best_t * (1 - 1e-9):
            best, best_t = alg.name, t
    if best is None:
        raise ArgumentError(f"no registered algorithm is eligible for p={p}, {nbytes} bytes")
    return best


def _links_of(st: CommState, links: Links | str | None, nbytes: int) -> Links:
    """This rank's link profile (PROBE for "probe", WATCH for "watch"), in the
    communicator's ranks, for a call of ``nbytes``.

    Told nothing (no ``links``, no ``$OPTCC_LINKS``), a call whose ranks span machines
    learns the links (WATCH) where its messages are long enough to time
    (:data:`~optcc_mpi.watch.MIN_BYTES`); shorter calls, and ranks that share one machine
    (nothing there is a link to watch), take the links as healthy. The same on every rank:
    the transport's kind and the call's size are agreed (the size by the check)."""
    if links is None:
        text = config.rc.links
        if text is None:
            if st.transport.kind == "network" and nbytes >= MIN_BYTES:
                return WATCH
            return _HEALTHY
        links = text
        marker = text.strip().lower()
        if marker not in ("probe", "watch"):
            told = st.links_from_env(text)
            # Healthy links told are the default's: the same paths (the short path, the
            # ride, the compiled path) as links not told at all.
            return _HEALTHY if told.healthy else told
    if isinstance(links, str):
        marker = links.strip().lower()
        if marker == "probe":
            return PROBE
        if marker == "watch":
            return WATCH
    link_obj = Links.coerce(links)
    link_obj.check(st.size)
    return _HEALTHY if link_obj.healthy else link_obj


#: The fastest learnt rate (bytes/s: 200 Mbit/s) that sizes a network's schedules; above
#: it the default model's (a 10 Gbit/s NIC's, 97.7 KiB sections) serves. Measured on the
#: namespace testbed (2 cores): at 16 ranks the rate took OptCC from 1.45x to 1.07x the
#: bound at 50 Mbit/s and from 1.52x to 1.09x at 200 (docs/testbed.md 1.6j,
#: docs/results.md), at 2 ranks and 200 Mbit/s it changed nothing (1.009x, 1.012x); but at
#: 8 ranks and 400 Mbit/s the learnt 37 MB/s cut a 25 MiB call into 128 segments of 25 KB
#: sections, 2.10 s a call against 1.47 s with the default's 37 (the ranks' TCP there
#: keeps both cores busy, and every message's cost is more than the model's 40 us times
#: the ranks per core: ours, not a model yet). ``$OPTCC_LINK_RATE`` has no such cap.
LEARNT_RATE_MAX = 25e6


def _learns_rate(st: CommState, call: CheckedCall) -> bool:
    """Whether the call's schedule is sized by a link rate the communicator learns: its
    ranks span machines (transport kind ``network``, not emulated), ``$OPTCC_LINK_RATE``
    is not set, and the call may run a schedule of ours (``auto`` from
    :data:`~optcc_mpi.algorithms._policy.SMALL_BYTES` on, or an algorithm whose cost
    model takes the fabric). The same on every rank: each input is agreed by the
    check (the transport's kind is the same everywhere)."""
    if st.size < 2 or st.transport.kind != "network" or call.emu is not None:
        return False
    if config.rc.link_rate is not None:
        return False
    if call.algorithm == "auto":
        return call.nbytes >= SMALL_BYTES
    try:
        return "fabric" in algorithms.get(call.algorithm).params
    except ArgumentError:  # (an unknown name: the check says so on every rank)
        return False


def _learn_rate(st: CommState, call: CheckedCall, probed: ProbeResult | None = None) -> None:
    """Learn a healthy link's rate the first time a call needs it (:func:`_learns_rate`):
    the reference of the probe this call just ran (``probed``: it measured every link),
    else measured now (:func:`optcc_mpi.probe.link_rate`, collective: every rank is here
    at the same call, as the check agreed); the communicator keeps it.
    ``$OPTCC_LINK_RATE`` overrides."""
    if st.rate is None and _learns_rate(st, call):
        got = probed.reference if probed is not None else 0.0
        st.rate = got if got > 0 else (link_rate(st.transport) or 0.0)


@functools.lru_cache(maxsize=8)
def _rate_of(text: str) -> float:
    """``$OPTCC_LINK_RATE``'s value in bytes/s (a bad one is this rank's error, which the
    check then agrees on)."""
    try:
        return parse_rate(text)
    except ArgumentError as exc:
        raise ArgumentError(f"OPTCC_LINK_RATE={text!r}: {exc}") from None


def _emulation_from_env(text: str | None) -> Emulation | None:
    text = (text or "").strip()
    return _parse_emulation(text) if text else None


@functools.lru_cache(maxsize=32)
def _parse_emulation(text: str) -> Emulation:
    """``$OPTCC_EMULATE``'s value, parsed once per text (a pure function of it)."""
    return Emulation.parse(text)


def _plan(st: CommState, call: CheckedCall, links: Links) -> Plan:
    """What the call runs (:class:`~optcc_mpi.communicators.Plan`); cached per
    communicator.

    A builder that declares a ``fabric`` parameter (and was not given one) is told the
    communicator's: the network model (:func:`~optcc_mpi.algorithms._policy.network`, at
    the transport's ranks per core) under emulation or where the transport reports a
    network, else the kind of fabric the transport reports (its ``kind``)."""
    emulated = call.emu is not None
    itemsize = call.flat_in.dtype.itemsize
    params = call.params
    pkey = repr(sorted(params.items())) if params else ""
    algorithm = call.algorithm
    # On healthy links a library whose AllReduce is already bandwidth-optimal (gloo's and
    # NCCL's rings) serves every size it reduces exactly as we do: a schedule of ours
    # could only match it, at a cost per message in Python.
    served_all = (
        algorithm == "auto"
        and links.healthy
        # (the watch learns from the messages of a schedule: on healthy links it asks
        # for one every few calls, the library serving the others)
        and not (call.watched and _observes(st, call))
        and not emulated
        and st.transport.caps.library_optimal
        and st.transport.native(call.arrays, call.name, call.opn)
    )
    # (a network's schedules are sized by the rate learnt, where it is: _learns_rate,
    # and slow enough for the model: LEARNT_RATE_MAX)
    rate = None if emulated or not st.rate or st.rate > LEARNT_RATE_MAX else st.rate
    key = (
        algorithm, call.count, itemsize, links.key(), pkey, emulated, served_all, rate,
        call.watched,
    )  # fmt: skip
    hit = st.plans.get(key)
    if hit is not None:
        return hit
    p = st.size
    if algorithm == "auto":
        # (served_all: what auto runs for a message too short for any schedule)
        name = choose_algorithm(p, 0 if served_all else call.nbytes, links)
    else:
        name = algorithm
    given = dict(params or {})
    if "fabric" in algorithms.get(name).params and "fabric" not in given:
        kind = "network" if emulated else st.transport.kind
        # (over a network, the model at the rate told or learnt, weighed by the ranks per
        # core)
        fabric: Fabric | str = kind
        if kind == "network":
            fabric = network(st.transport.crowding, rate)
            if call.watched and fabric.section_min < MIN_BYTES:
                # The watch times only messages of MIN_BYTES or more: sections cut finer
                # (the model's floor on slow links, 4-16 KB) would leave a watched call
                # nothing to read, and a link that recovers under the plan unseen
                # (the 4-rank testbed stayed at 1:0.5 for 14 calls after rank 1 healed).
                fabric = dataclasses.replace(fabric, section_min=MIN_BYTES)
        given["fabric"] = fabric
    sched = algorithms.build(name, p, call.count, links, itemsize=itemsize, **given)
    coll_only = bool(sched.n_ops) and bool(np.all(sched.kind == COLL))
    return st.plans.put(key, Plan(name, sched, coll_only))


def _observes(st: CommState, call: CheckedCall) -> bool:
    """Whether the watch times this watched call (:meth:`~optcc_mpi.watch.LinkWatch.
    observes`)."""
    watch = st.watch_made()
    return watch.observes(watch.timeable(call.nbytes), call.nbytes)


def _plan_call(st: CommState, call: CheckedCall) -> None:
    """Settle the profile every rank agreed on ("probe": measured now; "watch": from the
    observations every rank gathered) and the link rate (learnt now where the schedule
    needs it and it is not known yet), and plan for them."""
    probed = None
    settled = call.link_obj is PROBE or call.link_obj is WATCH
    if call.link_obj is PROBE:
        # Every rank agreed on "probe" above, so all of them take part in it.
        if st.probe is None:
            st.probe = probed = probe(st.transport, emulate=call.emu)
        call.link_obj = st.probe.links
    elif call.link_obj is WATCH:
        # Each rank brings its side of what its last call measured, and every rank reads
        # the same gathered rows, hence decides the same profile at the same call.
        watch = st.watch_made()
        call.watched = True
        seen = call.seen
        if seen is not None and protocol.extra_fits(st.check, seen.size):
            rows = protocol.gathered_extra(st.check, seen.size)
        else:  # no check ran, or its room was too small: one small collective more
            rows = np.array(st.transport.allgather(watch.contribution()), dtype=np.int64)
            call.epoch = perf_counter()
        # Where the traffic suspects a change, every rank probes on the transport.
        call.link_obj = watch.agree(rows, st.transport, call.emu, watch.timeable(call.nbytes))
    if settled or call.plan is None:
        # (a profile told, and a rate to learn first, leaves the plan to here: _settings)
        _learn_rate(st, call, probed)
        call.plan = _plan(st, call, call.link_obj)
    if call.flat_out is None:
        call.result, call.flat_out = result_like(call.sendbuf, call.flat_in, call.arrays)


def settle_ridden(st: CommState, call: CheckedCall, carried: np.ndarray | None) -> None:
    """A watched call that rode (:mod:`optcc_mpi.check.ride`: the watch was quiet, the
    library's AllReduce served it): the plan it ran, and the watch given what
    :func:`_plan_call` would have given it (:func:`watch_ridden`)."""
    # (call.watched still False: the plan a healthy call the library serves runs)
    call.plan = _plan(st, call, _HEALTHY)
    call.watched = True
    watch_ridden(st, call.plan.schedule, call.nbytes, carried)
    call.link_obj = _HEALTHY


def watch_ridden(
    st: CommState, schedule: Schedule, nbytes: int, carried: np.ndarray | None
) -> None:
    """Give the watch a watched call of ``nbytes`` that rode and ran ``schedule`` (the
    library's): every rank's ``carried`` observations of the last call (None: nothing to
    tell), agreed alike on every rank, then the call as one it did not observe, and its
    round's time here (:meth:`~optcc_mpi.watch.LinkWatch.served`). What they decide (a
    probe, a departure to confirm) holds from the next call on."""
    watch = st.watch_made()
    watch.agree(carried, st.transport, None, watch.timeable(nbytes))
    assert st.ride is not None  # (it rode)
    watch.served(st.rank, schedule, nbytes, st.ride.took)
