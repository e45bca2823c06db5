"""DDP with nothing told (issue 42): gloo, the ``optcc`` backend with no options and no
``OPTCC_*`` variable, and (``--told``) an ``optcc`` group told the true profile, stepped in
turn on the same data; per copy the total time of every step after the first (what a user
pays over the run: learning and probes included) and the ratios of those totals.

Run on the testbed (as root)::

    optcc-mpi testbed up --ranks 4 --rate 400mbit --links 0:0.5
    optcc-mpi testbed run -- .venv/bin/python docs/testbed/nothing_set.py --steps 30 --told 0:0.5

The model is ``lab ddp``'s default (10.35 M parameters), ``bucket_cap_mb=25`` unless
``--bucket-cap-mb`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import optcc_mpi.torch as ot
from optcc_mpi.torch import OptccOptions

QUIET = ("OPTCC_TESTBED", "OPTCC_LINKS_LOG")


def model(group: object, width: int, layers: int, bucket_mb: float) -> tuple[object, object]:
    torch.manual_seed(0)
    mods = [torch.nn.Linear(256, width), torch.nn.ReLU()]
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    mods += [torch.nn.Linear(width, 10)]
    ddp = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*mods), process_group=group, bucket_cap_mb=bucket_mb
    )
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01)


def start() -> None:
    """One thread of compute per rank, and the default group: under torchrun, or over MPI
    (``mpiexec``, the testbed's ``run``)."""
    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        ot.init_process_group_from_mpi("gloo")


def timed_step(ddp: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """One training step of ``ddp`` between two barriers: when it started
    (``time.perf_counter``) and how long it took, seconds."""
    dist.barrier()
    t0 = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    dist.barrier()
    return t0, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--told", default=None, help="also a group told this profile")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    ap.add_argument("--out", default=None, help="append the row as a JSON line")
    args = ap.parse_args()
    # (the testbed's own variables name it; a links log records, it tells nothing)
    told = [k for k in os.environ if k.startswith("OPTCC_") and not k.startswith(QUIET)]
    assert not told, f"nothing may be set: {told}"
    start()
    rank = dist.get_rank()
    groups = {"gloo": dist.new_group(backend="gloo"), "optcc": dist.new_group(backend="optcc")}
    if args.told:
        groups["told"] = dist.new_group(backend="optcc", pg_options=OptccOptions(links=args.told))
    copies = {
        name: model(g, args.width, args.layers, args.bucket_cap_mb) for name, g in groups.items()
    }
    times: dict[str, list[float]] = {name: [] for name in copies}
    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(args.steps):
        x = torch.randn(16, 256, generator=gen)
        y = torch.randint(0, 10, (16,), generator=gen)
        for name, (ddp, opt) in copies.items():
            times[name].append(timed_step(ddp, opt, x, y)[1])
    params = {
        name: torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
        for name, (ddp, _) in copies.items()
    }
    gap = max(float((params[n] - params["gloo"]).abs().max()) for n in params)
    if rank == 0:
        total = {name: sum(t[1:]) for name, t in times.items()}
        row = {
            "ranks": dist.get_world_size(),
            "steps": args.steps,
            "told": args.told,
            "bucket_cap_mb": args.bucket_cap_mb,
            "total_s": {n: round(v, 3) for n, v in total.items()},
            "median_s": {n: round(statistics.median(t[1:]), 4) for n, t in times.items()},
            "max_s": {n: round(max(t[1:]), 4) for n, t in times.items()},
            "step_s": {n: [round(v, 3) for v in t] for n, t in times.items()},
            "optcc_over_gloo": round(total["optcc"] / total["gloo"], 3),
            "parameter_gap": gap,
        }
        if args.told:
            row["optcc_over_told"] = round(total["optcc"] / total["told"], 3)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
