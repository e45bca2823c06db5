"""Where a DDP step's time goes, per bucket (docs/results.md): copies of ``nothing_set.py``'s
model on gloo, on an ``optcc`` group told healthy links, and (``--no-check``) on one with
``check=False``, stepped in turn on the same data. Each copy's buckets go through a comm
hook that records when DDP handed the bucket over and when its AllReduce completed; the
``optcc`` copies also record when the library's AllReduce of a bucket was posted (after
the check). Rank 0 prints, per copy, the median step, the total over the steps after the
first, and per bucket the medians of those instants (milliseconds from the step's start);
then, over every rank, how far apart the ranks handed over the first bucket (their
backward passes end at different times on shared cores) and how long after the last of
them the first rank posted its AllReduce (the check's round waits for the last rank).

    optcc-mpi testbed up --ranks 4 --rate 400mbit
    optcc-mpi testbed run -- .venv/bin/python docs/testbed/ddp_timeline.py --steps 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from optcc_mpi.torch import OptccOptions
from optcc_mpi.transports import distributed as tdist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nothing_set import model, start, timed_step  # noqa: E402

Event = tuple[int, int, float, float]  # bucket index, bytes, handed over, completed
POSTS: list[tuple[int, float]] = []  # (bytes, when) of the library's AllReduces


def record_posts() -> None:
    """Note when the transport posts the library's AllReduce (the optcc copies)."""
    posted = tdist.TorchTransport.allreduce

    def allreduce(self: Any, arrays: Any, arr: Any, name: str, op: str) -> Any:
        POSTS.append((int(getattr(arr, "nbytes", 0)), time.perf_counter()))
        return posted(self, arrays, arr, name, op)

    tdist.TorchTransport.allreduce = allreduce  # type: ignore[method-assign]


def hook_for(group: Any, p: int, events: list[Event]) -> Callable[..., Any]:
    def hook(state, bucket):  # type: ignore[no-untyped-def]  # (DDP checks annotations)
        buf, t = bucket.buffer(), time.perf_counter()
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()

        def done(f: Any) -> torch.Tensor:
            events.append(
                (bucket.index(), buf.numel() * buf.element_size(), t, time.perf_counter())
            )
            return f.value()[0].div_(p)

        return fut.then(done)

    return hook


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--no-check", action="store_true", help="also a copy with check=False")
    args = ap.parse_args()
    start()
    rank, p = dist.get_rank(), dist.get_world_size()
    groups = {
        "gloo": dist.new_group(backend="gloo"),
        "told healthy": dist.new_group(backend="optcc", pg_options=OptccOptions(links="healthy")),
    }
    if args.no_check:
        groups["check=False"] = dist.new_group(
            backend="optcc", pg_options=OptccOptions(links="healthy", check=False)
        )
    record_posts()
    events: dict[str, list[Event]] = {name: [] for name in groups}
    copies = {}
    for name, group in groups.items():
        ddp, opt = model(group, 1600, 4, args.bucket_cap_mb)
        ddp.register_comm_hook(None, hook_for(group, p, events[name]))
        copies[name] = (ddp, opt)
    gen = torch.Generator().manual_seed(1 + rank)
    steps: dict[str, list[tuple[float, list[Event], list[tuple[int, float]]]]] = {
        name: [] for name in copies
    }
    for _ in range(args.steps):
        x = torch.randn(16, 256, generator=gen)
        y = torch.randint(0, 10, (16,), generator=gen)
        for name, (ddp, opt) in copies.items():
            events[name].clear()
            POSTS.clear()
            t0, took = timed_step(ddp, opt, x, y)
            seen = [(i, n, a - t0, b - t0) for i, n, a, b in events[name]]
            posts = [(n, t - t0) for n, t in POSTS]
            steps[name].append((took, seen, posts))
    # Every rank's first bucket: when DDP handed it over, and when the library's
    # AllReduce of it was posted (the told copy's), per step after the first.
    mine = []
    for _, seen, posts in steps["told healthy"][1:]:
        first = min(seen, key=lambda e: e[2])
        mine.append((first[2], posts[0][1] if posts else float("nan")))
    every: list[Any] = [None] * p
    dist.all_gather_object(every, mine)
    if rank == 0:
        ms = 1e3
        for name, rows in steps.items():
            rows = rows[1:]
            print(
                f"{name}: median step {statistics.median(r[0] for r in rows) * ms:.1f} ms, "
                f"total {sum(r[0] for r in rows):.3f} s"
            )
            for k in range(len(rows[0][1])):
                index, nbytes = rows[0][1][k][0], rows[0][1][k][1]
                handed = statistics.median(r[1][k][2] for r in rows) * ms
                done = statistics.median(r[1][k][3] for r in rows) * ms
                line = f"  bucket {index} ({nbytes / 1e6:.2f} MB): handed over {handed:.1f}"
                posted = [r[2][k][1] for r in rows if len(r[2]) > k]
                if posted:
                    line += f", posted {statistics.median(posted) * ms:.1f}"
                print(f"{line}, done {done:.1f} ms")
        a = np.array(every) * ms  # rank, step, (handed over, posted)
        skew = a[:, :, 0].max(axis=0) - a[:, :, 0].min(axis=0)
        wait = a[:, :, 1].min(axis=0) - a[:, :, 0].max(axis=0)
        print(
            f"first bucket, told healthy: the ranks handed it over {np.median(skew):.1f} ms "
            f"apart (median; {skew.min():.1f}-{skew.max():.1f}); the first post came "
            f"{np.median(wait):.1f} ms after the last rank's (median; clocks per rank)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
