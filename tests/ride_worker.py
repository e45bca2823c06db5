"""One rank of tests/test_ride.py, started by torchrun with ``OPTCC_BOARD=0`` (every call
goes the way it goes across machines: check.ride). Writes ``OUTDIR/ride-RANK.json``;
the test judges.

``python -m torch.distributed.run --standalone --nproc-per-node N tests/ride_worker.py OUTDIR``

Each phase records, per call, a digest of the result's bytes (the same on every rank),
whether it equals the exact sum, and the communicator's ride counters after it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import optcc_mpi.torch  # noqa: F401  (registers the optcc backend)
from optcc_mpi import collectives
from optcc_mpi.errors import ArgumentError
from optcc_mpi.torch import OptccOptions
from optcc_mpi.transports.distributed import group_of

OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
P = int(os.environ["WORLD_SIZE"])


def data(call: int, rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input of ``call``: random floats of mixed scale (sums whose bits
    depend on the order of the additions) or integers."""
    rng = np.random.default_rng(1000 * call + rank)
    if dtype.is_floating_point:
        x = rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count)
    else:
        x = rng.integers(-1000, 1000, count)
    return torch.from_numpy(x).to(dtype)


def exact(call: int, count: int, dtype: torch.dtype) -> np.ndarray:
    """The sum of every rank's input: exact for integers, in float64 for floats."""
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    return np.asarray(sum(data(call, r, count, dtype).to(wide).numpy() for r in range(P)))


class _Own(torch.Tensor):
    """A tensor type of the user's own: its calls take the whole path, not the lane."""


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.as_subclass(torch.Tensor).numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    dist.init_process_group("optcc")
    pg = group_of(None)
    state = collectives.comm_state(pg.optcc_transport())
    ride = state.ride
    out: dict[str, object] = {"rides": ride is not None}
    if ride is None:
        (OUT / f"ride-{RANK}.json").write_text(json.dumps(out))
        dist.destroy_process_group()
        return
    calls: list[dict[str, object]] = []

    def one(
        call: int,
        count: int,
        dtype: torch.dtype = torch.float32,
        strided: bool = False,
        into: list[dict[str, object]] = calls,
    ) -> None:
        t = data(call, RANK, count, dtype)
        if strided:  # (a tensor's subclass: not the short path, the whole path)
            t = t.as_subclass(_Own)
        before = (ride.hits, ride.misses)
        dist.all_reduce(t)
        ref = exact(call, count, dtype)
        got = t.as_subclass(torch.Tensor).numpy().astype(np.float64)
        err = np.abs(got - ref.astype(np.float64)).max()
        scale = np.abs(ref.astype(np.float64)).max() + 1e-30
        into.append(
            {
                "call": call,
                "count": count,
                "digest": digest(t),
                "error": float(err / scale),
                "hit": ride.hits > before[0],
                "miss": ride.misses > before[1],
            }
        )

    # 1. One signature, 12 times; the same data at call 0 and call 11 (not expected, then
    #    expected): the same bits.
    for i in range(12):
        one(0 if i in (0, 11) else i, 1000)
    # 2. Two signatures in turn (a bucket pattern), then a third once, then the first.
    for i in range(12):
        one(100 + i, 1000 if i % 2 else 333)
    one(200, 4096)
    one(201, 1000)
    # 3. This rank alone on the whole path (a strided tensor) while expected: the same
    #    collectives, right sums.
    for i in range(6):
        one(300 + i, 1000, strided=RANK == 1 and i == 4)
    # 4. Integers; float64; a size above RIDE_MAX (not riding) between riding ones.
    for i in range(5):
        one(400 + i, 257, torch.int64)
    for i in range(4):
        one(500 + i, 3000, torch.float64)
    one(600, 600_000)  # 2.4 MB of float32: above RIDE_MAX
    for i in range(4):
        one(700 + i, 1000)
    out["calls"] = calls

    # 5. A call expected where one rank passes another size: the same error on every rank,
    #    every tensor unchanged; then the loop goes on.
    for i in range(4):
        one(800 + i, 1000)
    bad = data(900, RANK, 1001 if RANK == P - 1 else 1000, torch.float32)
    kept = bad.clone()
    try:
        dist.all_reduce(bad)
        out["mismatch"] = None
    except ArgumentError as exc:
        out["mismatch"] = str(exc)
    out["unchanged"] = bool(torch.equal(bad, kept))
    after: list[dict[str, object]] = []
    for i in range(5):
        one(1000 + i, 1000, into=after)
    out["after"] = after
    out["hits"], out["misses"] = ride.hits, ride.misses

    # 7. A NaN first in rank 0's data of an expected call: every rank flagged the round, so
    #    it stands (one more AllReduce says so); then, expected again, rank P-1 passes
    #    another size while rank 0's data starts with NaN: the check's error on every
    #    rank, every tensor unchanged.
    for i in range(4):
        one(1200 + i, 1000, into=after)
    t = data(1300, RANK, 1000, torch.float32)
    if RANK == 0:
        t[0] = float("nan")
    before = (ride.hits, ride.misses)
    dist.all_reduce(t)
    ref = exact(1300, 1000, torch.float32)[1:]
    got = t.numpy()[1:].astype(np.float64)
    out["nan"] = {
        "first": bool(np.isnan(t[0].item())),
        "error": float(np.abs(got - ref).max() / np.abs(ref).max()),
        "hit": ride.hits > before[0],
        "digest": digest(t),
    }
    for i in range(3):
        one(1310 + i, 1000, into=after)
    bad = data(1320, RANK, 1001 if RANK == P - 1 else 1000, torch.float32)
    if RANK == 0:
        bad[0] = float("nan")
    kept = bad.numpy().tobytes()
    before = (ride.hits, ride.misses)
    try:
        dist.all_reduce(bad)
        out["nan_mismatch"] = None
    except ArgumentError as exc:
        out["nan_mismatch"] = str(exc)
    out["nan_dropped"] = ride.misses > before[1]
    out["nan_unchanged"] = bad.numpy().tobytes() == kept

    # 6. A group whose links are watched (what a job across machines gets by default):
    #    calls the watch needs nothing of ride, carrying what an observed call measured.
    wg = dist.new_group(backend="optcc", pg_options=OptccOptions(links="watch"))
    wst = collectives.comm_state(group_of(wg).optcc_transport())
    wride = wst.ride
    assert wride is not None
    watched: list[dict[str, object]] = []
    for i in range(24):
        before = (wride.hits, wride.misses)
        t = data(1100 + i, RANK, 65536, torch.float32)  # 256 KiB: the watch times them
        if RANK == 1 and i in (9, 14, 16):  # (rank 1 alone on the whole path: the same rounds)
            t = t.as_subclass(_Own)
        dist.all_reduce(t, group=wg)
        ref = exact(1100 + i, 65536, torch.float32)
        got = t.as_subclass(torch.Tensor).numpy().astype(np.float64)
        watch = wst.watch
        watched.append(
            {
                "call": 1100 + i,
                "digest": digest(t),
                "error": float(np.abs(got - ref).max() / np.abs(ref).max()),
                "hit": wride.hits > before[0],
                "miss": wride.misses > before[1],
                "carried": wride.hits > before[0] and wride.carried is not None,
                "algorithm": collectives.last_stats()["algorithm"],
                "watch_calls": watch.calls if watch is not None else -1,
                "profile": str(watch.profile) if watch is not None else "",
                "measured": str(watch.measured) if watch is not None else "",
                "armed": watch is not None and watch.armed(65536 * 4),
            }
        )
    out["watched"] = watched
    big = data(1200, RANK, 600_000, torch.float32)  # above RIDE_MAX: never rides
    dist.all_reduce(big, group=wg)
    ref = exact(1200, 600_000, torch.float32)
    out["watched_big_error"] = float(np.abs(big.numpy() - ref).max() / np.abs(ref).max())
    # Above RIDE_MAX the library's AllReduce is left in flight: its time, taken when its
    # wait returns, arms the tripwire as a riding call's does. Pairs posted together make
    # the second call's contribution while the first may still be in flight on some ranks
    # only: that time is then set aside on every rank alike.
    bigs = []
    for i in range(0, 24, 2):
        ts = [data(1300 + i + k, RANK, 600_000, torch.float32) for k in range(2)]
        if i % 4:
            works = [dist.all_reduce(t, group=wg, async_op=True) for t in ts]
            for w in works:
                w.wait()
        else:
            for t in ts:
                dist.all_reduce(t, group=wg)
        for k, t in enumerate(ts):
            ref = exact(1300 + i + k, 600_000, torch.float32)
            watch = wst.watch
            assert watch is not None
            bigs.append(
                {
                    "digest": digest(t),
                    "error": float(np.abs(t.numpy() - ref).max() / np.abs(ref).max()),
                    "armed": watch.armed(600_000 * 4),
                    "healthy": not watch.profile.fractions,
                }
            )
    out["watched_bigs"] = bigs
    # (the calls took the short path of a watched signature, collectives.Prepared, but
    # one that cannot ride did not: the whole path leaves its AllReduce in flight)
    lanes = group_of(wg)._lanes
    out["watched_lanes"] = {
        str(key[1]): ln is not None and ln.prepared.watched for key, ln in lanes.items()
    }
    (OUT / f"ride-{RANK}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
