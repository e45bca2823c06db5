"""gloo's own AllReduce against its element count (docs/results.md, "Float rounds carry
no flag element"): the mean of 300 synchronous ``dist.all_reduce`` calls of 1 to
1024 elements of float32, float64 and int64 on the default gloo group. Below ``2p``
elements gloo's ring sends one segment per element, so an element more is a step more.

    optcc-mpi testbed run -- .venv/bin/python docs/backend/gloo_counts.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import optcc_mpi.torch

COUNTS = (1, 2, 3, 4, 5, 7, 8, 12, 16, 17, 64, 256, 1024)


def mean_us(x: torch.Tensor, n: int = 300, warmup: int = 20) -> float:
    """The mean of ``n`` synchronous AllReduces of ``x``, in us."""
    for _ in range(warmup):
        dist.all_reduce(x)
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:  # (the testbed starts ranks as MPI does)
        optcc_mpi.torch.init_process_group_from_mpi("gloo")
    for dtype in (torch.float32, torch.float64, torch.int64):
        row = {c: mean_us(torch.ones(c, dtype=dtype)) for c in COUNTS}
        if dist.get_rank() == 0:
            print(dtype, "  ".join(f"{c}: {v:.0f} us" for c, v in row.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
