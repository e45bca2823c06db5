"""The Python between dist.all_reduce and the wire, at one rank (docs/results.md).

    python docs/backend/one_rank.py

A group of one rank runs no collective, so a call's time is its Python alone: the short
path against the whole one (the short path turned off on the same group), us per call.
"""

import timeit, torch, torch.distributed as dist
import optcc_mpi.torch  # noqa: F401  (registers "optcc")

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
g = dist.new_group(backend="optcc")
short, t, n = g._lane, torch.ones(1), 20000
for name, lane in (("short path", short), ("whole path", lambda *a: None)):
    g._lane = lane
    dist.all_reduce(t, group=g)
    print(f"{name}: {timeit.timeit(lambda: dist.all_reduce(t, group=g), number=n) / n * 1e6:.1f} us")
dist.destroy_process_group()
