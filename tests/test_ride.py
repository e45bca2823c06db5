"""The ride (optcc_mpi.check.ride): a repeated short sum agreed inside its own AllReduce.

The state every rank keeps (which signatures ride, which one every rank expects) is tested
here in one process; the rounds themselves on 3 ranks of the ``optcc`` backend with the
board off (tests/ride_worker.py), where every call goes the way it goes across machines.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from torch_launch import torchrun

from optcc_mpi.arrays import NUMPY
from optcc_mpi.check.protocol import DTYPE_CODE, OP_CODE, PROTOCOL, code
from optcc_mpi.check.ride import RIDE_MAX, Ride, serves
from optcc_mpi.transports.base import Capabilities

pytest.importorskip("torch")

WORKER = Path(__file__).with_name("ride_worker.py")


class _Gloo:
    """What Ride reads of a transport: its size, capabilities and exact types."""

    def __init__(self, size: int = 3, ride: bool = True, rank: int = 0) -> None:
        self.size, self.rank = size, rank
        self.caps = Capabilities(library_identical=True, ride=ride)

    def native(self, arrays: object, dtype_name: str, op: str) -> bool:
        return arrays is NUMPY and op == "sum" and dtype_name in ("float32", "float64", "int64")


def header(count: int = 1000, dtype: str = "float32", **over: int) -> tuple[int, ...]:
    """A header as a call's check sends it (protocol.FIELDS, in order; keys are short
    names), with fields ``over``."""
    size = np.dtype(dtype).itemsize
    fields = {
        "protocol": PROTOCOL, "error": 0, "count": count, "dtype": DTYPE_CODE[dtype],
        "op": OP_CODE["sum"], "algorithm": code("auto"), "links": 0, "emulation": 0,
        "arrays": code("numpy"), "params": 0, "bytes": count * size, "room": 0,
    }  # fmt: skip
    assert over.keys() <= fields.keys(), over
    fields.update(over)
    return tuple(fields.values())


def test_which_signatures_ride() -> None:
    ride = Ride(_Gloo())  # type: ignore[arg-type]
    assert ride.takes(header())
    assert ride.takes(header(count=RIDE_MAX // 4))
    assert not ride.takes(header(count=RIDE_MAX // 4 + 1))  # too large: copies cost more
    assert not ride.takes(header(count=0, bytes=0))
    assert not ride.takes(header(dtype="int32"))  # not a type the library sums exactly
    assert not ride.takes(header(op=OP_CODE["max"]))
    assert not ride.takes(header(algorithm=code("ring")))
    assert not ride.takes(header(links=code("watch")))
    assert not ride.takes(header(emulation=code("x")))
    assert not ride.takes(header(arrays=code("torch")))
    assert not ride.takes(header(error=1))
    assert not ride.takes(())  # a call without a check


def test_a_watched_call_rides_where_its_owner_says() -> None:
    """A link code other than healthy's rides only where the owner's hook says so (the
    communicator's watch, quiet), carrying what the hook says."""
    ride = Ride(_Gloo())  # type: ignore[arg-type]
    watched = header(links=code("watch"))
    assert not ride.takes(watched)
    answers: dict[int, int | None] = {code("watch"): 7}
    ride.links_ride = lambda link, nbytes: answers.get(link)
    assert ride.takes(watched) and ride.takes(header())
    assert not ride.takes(header(links=code("0:0.5")))
    answers[code("watch")] = None  # the watch needs the call: it does not ride
    assert not ride.takes(watched)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "float16"])
def test_carried_values_come_back_exact_from_a_sum(dtype: str) -> None:
    """Each rank's int64 values, cut into pieces in its own slot and zeros elsewhere,
    summed in the round's type: every rank's values back, bit for bit (negative ones,
    the watch's -1, and the largest too)."""
    from optcc_mpi.check.ride import _pieces, _pieces_of, _values_of

    p, k = 3, 5
    rng = np.random.default_rng(7)
    values = rng.integers(-(2**62), 2**62, size=(p, k))
    values[0, 0], values[1, 1], values[2, 2] = -1, np.iinfo(np.int64).max, 0
    dt = np.dtype(dtype)
    bits, n = _pieces(dt)
    bufs = np.zeros((p, p * k * n), dtype=dt)
    for r in range(p):
        bufs[r, r * k * n : (r + 1) * k * n] = _pieces_of(values[r], bits, n)
    total = bufs.sum(axis=0, dtype=dt)  # (the library's AllReduce: a sum in the type)
    assert np.array_equal(_values_of(total, bits, n).reshape(p, k), values)


class _Summing(_Gloo):
    """A transport whose every rank passes what this one does (a sum is the buffer times
    ``p``); it records each AllReduce's type and length."""

    def __init__(self) -> None:
        super().__init__()
        self.rounds: list[tuple[str, int]] = []

    def allreduce_now(self, arrays: object, arr: np.ndarray, dtype_name: str, op: str) -> None:
        self.rounds.append((dtype_name, arr.size))
        arr *= self.size


def _expecting(transport: _Gloo, h: tuple[int, ...]) -> Ride:
    ride = Ride(transport)  # type: ignore[arg-type]
    for _ in range(3):
        ride.agreed(h)
    assert ride.expected() == h[:11]
    return ride


def test_a_float_round_is_the_data_alone_and_a_nan_first_asks_every_rank() -> None:
    """A float round has no element for the flags (one element more costs gloo's ring a
    step at the shortest sizes): a rank that does not flag it writes NaN first, and a NaN
    first (the data's or a flag's) costs one more AllReduce of one integer, in which every
    rank says whether it flagged. Integers keep their flag element."""
    wire = _Summing()
    h = header(count=1)
    ride = _expecting(wire, h)
    out = np.zeros(1, dtype=np.float32)
    assert ride.guess(h, np.ones(1, dtype=np.float32), out)
    assert wire.rounds == [("float32", 1)] and out[0] == 3.0
    wire.rounds.clear()
    assert ride.guess(h, np.full(1, np.nan, dtype=np.float32), out)  # NaN data: it stands
    assert wire.rounds == [("float32", 1), ("int64", 1)] and np.isnan(out[0])
    wire.rounds.clear()
    out[0] = 5.0
    assert not ride.guess(None, np.ones(1, dtype=np.float32), out)  # not flagged: dropped
    assert wire.rounds == [("float32", 1), ("int64", 1)] and out[0] == 5.0
    assert (ride.hits, ride.misses) == (2, 1)
    ints = _Summing()
    h64 = header(count=1, dtype="int64")
    ride = _expecting(ints, h64)
    got = np.zeros(1, dtype=np.int64)
    assert ride.guess(h64, np.full(1, 7, dtype=np.int64), got)
    assert ints.rounds == [("int64", 2)] and got[0] == 21


def test_only_transports_that_allow_it_ride() -> None:
    assert serves(_Gloo())  # type: ignore[arg-type]
    assert not serves(_Gloo(ride=False))  # type: ignore[arg-type]
    assert not serves(_Gloo(size=1))  # type: ignore[arg-type]


def test_a_guess_needs_the_same_successor_twice() -> None:
    ride = Ride(_Gloo())  # type: ignore[arg-type]
    a, b, big = header(), header(count=333), header(count=RIDE_MAX)
    sig = lambda h: h[:11]  # noqa: E731
    assert ride.expected() is None
    ride.agreed(a)
    ride.agreed(a)
    assert ride.expected() is None  # a -> a seen once
    ride.agreed(a)
    assert ride.expected() == sig(a)
    ride.agreed(b)  # the pattern changed: no guess until it repeats
    assert ride.expected() is None
    ride.agreed(a)
    ride.agreed(b)
    assert ride.expected() is None  # b -> a seen once
    ride.agreed(a)
    assert ride.expected() == sig(b)  # a -> b twice in a row
    ride.agreed(b)
    assert ride.expected() == sig(a)
    ride.reset()  # an error, or a call without a check: nothing follows
    assert ride.expected() is None
    for _ in range(3):
        ride.agreed(big)
    assert ride.expected() is None  # the successor does not ride


def _torchrun(n: int, out: Path) -> list[dict]:
    proc = torchrun(WORKER, n, str(out), OPTCC_BOARD="0")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads((out / f"ride-{r}.json").read_text()) for r in range(n)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _torchrun(3, tmp_path_factory.mktemp("ride"))


def test_calls_ride_across_machines(ranks: list[dict]) -> None:
    """Board off (every call as across machines): gloo's transport rides."""
    assert all(r["rides"] for r in ranks)


def test_every_sum_right_and_the_same_bits_everywhere(ranks: list[dict]) -> None:
    for key in ("calls", "after", "watched"):
        for i, call in enumerate(ranks[0][key]):
            tol = 0.0 if call["call"] // 100 == 4 else 1e-15 if call["call"] // 100 == 5 else 1e-6
            assert call["error"] <= tol, call
            assert len({r[key][i]["digest"] for r in ranks}) == 1, call
            # Every rank saw the same outcome of each round.
            assert len({(r[key][i]["hit"], r[key][i]["miss"]) for r in ranks}) == 1, call


def test_expected_calls_ride_and_give_the_bits_of_a_checked_one(ranks: list[dict]) -> None:
    calls = ranks[0]["calls"]
    loop = calls[:12]
    assert not loop[0]["hit"] and all(c["hit"] for c in loop[3:]), loop
    # The same data at the first call (checked, then reduced with its flag) and the last
    # (expected, one round): the same bits.
    assert loop[0]["digest"] == loop[11]["digest"]
    turns = calls[12:24]  # two sizes in turn: guessed once each had the same successor twice
    assert all(c["hit"] for c in turns[4:]), turns
    assert turns[0]["miss"]  # the pattern changed: one round wasted, then checked
    assert ranks[0]["misses"] <= 8 and ranks[0]["hits"] >= 30


def test_a_rank_on_the_whole_path_joins_the_round(ranks: list[dict]) -> None:
    """Rank 1's call 304 is a tensor of its own type (the whole path, not the lane): it
    flags the expected round as the others do."""
    (call,) = [c for c in ranks[1]["calls"] if c["call"] == 304]
    assert call["hit"]


def test_a_mismatch_while_expected_is_the_checks_error(ranks: list[dict]) -> None:
    """One rank passes another count where every rank expects a call: the round is
    dropped, and the check's error is raised on every rank, the tensors unchanged."""
    errors = {r["mismatch"] for r in ranks}
    assert len(errors) == 1
    (message,) = errors
    assert message is not None and "element count differs" in message and "rank 2" in message
    assert all(r["unchanged"] for r in ranks)
    assert all(c["error"] <= 1e-6 for c in ranks[0]["after"])


def test_a_nan_in_the_data_stands_and_a_mismatch_beside_one_is_the_checks_error(
    ranks: list[dict],
) -> None:
    """Float rounds carry no flag element: a rank that does not flag one writes NaN first.
    A NaN first in the data of a call every rank flagged stands (every rank says so in
    one more AllReduce); beside a rank whose call differs, it is the check's error on
    every rank, every tensor unchanged."""
    assert all(r["nan"]["hit"] and r["nan"]["first"] for r in ranks), [r["nan"] for r in ranks]
    assert all(r["nan"]["error"] <= 1e-6 for r in ranks)
    assert len({r["nan"]["digest"] for r in ranks}) == 1
    errors = {r["nan_mismatch"] for r in ranks}
    assert len(errors) == 1
    (message,) = errors
    assert message is not None and "element count differs" in message
    assert all(r["nan_dropped"] and r["nan_unchanged"] for r in ranks)


def test_watched_calls_the_watch_needs_nothing_of_ride(ranks: list[dict]) -> None:
    """A group with ``links="watch"``: the calls the watch leaves to the library ride
    (one round, no check), every call is counted by the watch, a call it observes (every
    fourth on healthy links, until the library's times arm the tripwire) runs its
    schedule and never rides, and the call after one carries what it measured in the
    round: the watch reads a profile from it."""
    calls = ranks[0]["watched"]
    # (the short path of watched calls, but not for a size that cannot ride)
    assert all(r["watched_lanes"] == {"65536": True, "600000": False} for r in ranks), ranks
    assert all(r["watched_big_error"] <= 1e-6 for r in ranks)
    assert [c["watch_calls"] for c in calls] == list(range(1, len(calls) + 1))
    hits = [i for i, c in enumerate(calls) if c["hit"]]
    degraded = [c for c in calls if c["profile"] != "healthy"]
    served = {calls[i]["algorithm"] for i in hits}
    assert len(served) == 1, calls
    observed = {i for i, c in enumerate(calls) if c["algorithm"] not in served}
    assert not observed & set(hits), calls  # (an observed call never rides)
    # A round after an observed call carries what it measured: the watch reads it. (A
    # round after one that rode carries every rank's time of it: the tripwire's.)
    after = [c for i, c in enumerate(calls) if c["hit"] and i - 1 in observed]
    assert all(c["carried"] and c["measured"] != "None" for c in after), calls
    if degraded:
        # Three ranks on two loaded cores can make the watch hold a rank slow (the probe
        # times the CPUs' noise too; test_the_library_calls_left_in_flight_are_timed_too):
        # that profile's plan then serves the calls, which do not ride, and the sample
        # and the tripwire below are not what they test.
        return
    assert len(hits) >= len(calls) // 3, calls
    # Every fourth call is sampled until five of the size's calls that rode were timed
    # (the watch's calls count from 1: the one before call i was its i-th); then the
    # library's times are the tripwire and the sample is thinner (test_watch.py).
    armed = next(i for i, c in enumerate(calls) if c["armed"])
    assert all(i in observed for i in range(0, armed, 4)), calls
    assert 0 < armed < 16, calls
    assert after, calls
    assert any(c["carried"] for i, c in enumerate(calls) if c["hit"] and i - 1 not in observed)


def test_the_library_calls_left_in_flight_are_timed_too(ranks: list[dict]) -> None:
    """Above RIDE_MAX a watched call's AllReduce is the library's, left in flight: its
    time on each rank (posting to the wait's return) travels in the next call's header
    and arms the tripwire as a riding call's does (the sample then thins); a call
    still in flight when the next one is checked (pairs posted together) is set aside on
    every rank alike. Every sum right, the same bits on every rank."""
    bigs = [r["watched_bigs"] for r in ranks]
    assert all(b["error"] <= 1e-6 for rank in bigs for b in rank), bigs
    assert all([b["digest"] for b in rank] == [b["digest"] for b in bigs[0]] for rank in bigs)
    armed = [[b["armed"] for b in rank] for rank in bigs]
    assert all(a == armed[0] for a in armed), armed
    # Times are taken on links held healthy. Three ranks on two loaded cores can make the
    # watch hold a rank slow for a while (and a new profile starts its times afresh):
    # where it held them healthy throughout, the 24 calls armed it, and it stayed armed.
    # (The calls waited for at once are always timed, the observed ones are not; how
    # thin the sample then is, test_watch.py tests without the machine's noise.)
    if all(b["healthy"] for b in bigs[0]):
        first = armed[0].index(True)
        assert all(armed[0][first:]), armed
