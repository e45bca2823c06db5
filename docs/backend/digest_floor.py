"""Would a digest of the argument check cost less than its gather on gloo? (issue 32,
docs/results.md "The short path").

    torchrun --standalone --nproc-per-node 2 docs/backend/digest_floor.py

The check gathers every rank's 96-byte header (and 256 bytes of room for short data);
a digest form would instead reduce two int64 with MAX (a checksum and its negation: equal
on every rank iff max == -max of the negation). Blocks of 200 back-to-back calls of
gloo's own collectives on a plain gloo group, the blocks' order reversed every round;
rank 0 prints the median (min, max) over 7 rounds of the time per call.
"""

import statistics
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceOp

dist.init_process_group("gloo")
p = dist.get_world_size()
g = dist.new_group(backend="gloo")._get_backend(torch.device("cpu"))
cases = {}
x1 = torch.ones(1)
cases["allreduce 1 f32 sum"] = lambda: g.allreduce([x1]).wait()
for n in (2, 3):
    h = torch.ones(n, dtype=torch.int64)
    o = AllreduceOptions()
    o.reduceOp = ReduceOp.MAX
    cases[f"allreduce {n} i64 max"] = lambda h=h, o=o: g.allreduce([h], o).wait()
for nb in (96, 352):
    block, rows = torch.zeros(nb, dtype=torch.uint8), torch.zeros(nb * p, dtype=torch.uint8)
    cases[f"allgather {nb} B"] = lambda b=block, r=rows: g._allgather_base(
        r, b, AllgatherOptions()
    ).wait()
res = {k: [] for k in cases}
for rnd in range(7):
    for k in list(cases) if rnd % 2 else list(cases)[::-1]:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(200):
            cases[k]()
        res[k].append((time.perf_counter() - t0) / 200)
if dist.get_rank() == 0:
    for k, v in res.items():
        med, lo, hi = (statistics.median(v) * 1e6, min(v) * 1e6, max(v) * 1e6)
        print(f"{k:24s} {med:6.0f} us per call (min {lo:.0f}, max {hi:.0f})")
dist.destroy_process_group()
