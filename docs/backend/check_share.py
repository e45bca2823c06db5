"""What the check costs a call that does not ride (docs/results.md): 40 synchronous
``dist.all_reduce`` calls of COUNT float32 (default 4194304: 16 MiB, above ``RIDE_MAX``) on
an ``optcc`` group, each call's check (``protocol.agree_header``, the round of headers) and
its wait for the library's AllReduce timed apart; then 40 of gloo's own. Rank 0 prints the
medians.

    optcc-mpi testbed run --env OPTCC_LINKS=healthy -- .venv/bin/python docs/backend/check_share.py
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist
from ride_phases import PARTS as TIMES  # (this folder)
from ride_phases import timed

import optcc_mpi.torch
from optcc_mpi.check import protocol
from optcc_mpi.transports import distributed as tdist


def main() -> None:
    optcc_mpi.torch.init_process_group_from_mpi("gloo")
    rank = dist.get_rank()
    optcc = dist.new_group(backend="optcc")
    protocol.agree_header = timed("check", protocol.agree_header)
    tdist.TorchTransport.wait = timed("wait", tdist.TorchTransport.wait)  # type: ignore[method-assign]
    x = torch.ones(int(sys.argv[1]) if len(sys.argv) > 1 else 4194304)
    for _ in range(5):
        dist.all_reduce(x, group=optcc)
    TIMES.clear()
    TIMES.update(check=[], wait=[])
    calls, gloo = [], []
    for _ in range(40):
        t0 = time.perf_counter()
        dist.all_reduce(x, group=optcc)
        calls.append(time.perf_counter() - t0)
    for _ in range(40):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        gloo.append(time.perf_counter() - t0)
    if rank == 0:
        ms = lambda v: f"{statistics.median(v) * 1e3:.2f}" if v else "none"  # noqa: E731
        print(
            f"optcc call {ms(calls)} ms: the check {ms(TIMES['check'])} ({len(TIMES['check'])} "
            f"of 40 calls checked), the waits for the library's AllReduces {ms(TIMES['wait'])}; "
            f"gloo {ms(gloo)} ms",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
