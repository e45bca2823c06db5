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

    def __init__(self, size: int = 3, ride: bool = True) -> None:
        self.size = size
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
    for key in ("calls", "after"):
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
