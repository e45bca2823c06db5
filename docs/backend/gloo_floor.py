"""What a call that carries the argument check costs on gloo at the smallest sizes (docs/results.md).

    torchrun --standalone --nproc-per-node 2 docs/backend/gloo_floor.py

Blocks of 200 back-to-back calls of gloo's own collectives on a plain gloo group, the
blocks' order reversed every round; rank 0 prints the median over 7 rounds of the time
per call: gloo's AllReduce of 1, 2, 8 and 64 elements, and the allgather of the optcc
check's block (96-byte header and 256-byte room) that a short optcc call makes instead.
"""

import statistics, time, torch, torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

dist.init_process_group("gloo")
p = dist.get_world_size()
g = dist.new_group(backend="gloo")._get_backend(torch.device("cpu"))
cases = {}
for n in (1, 2, 8, 64):
    x = torch.ones(n)
    cases[f"gloo allreduce, {n} float32"] = lambda x=x: g.allreduce([x]).wait()
block, rows = torch.zeros(352, dtype=torch.uint8), torch.zeros(352 * p, dtype=torch.uint8)
cases["gloo allgather, the check's 352 B"] = lambda: g._allgather_base(
    rows, block, AllgatherOptions()).wait()
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
        print(f"{k:36s} {statistics.median(v) * 1e6:6.0f} us per call")
dist.destroy_process_group()
