"""What a call that carries the argument check costs on gloo at the smallest sizes (docs/results.md).

    torchrun --standalone --nproc-per-node 2 docs/backend/gloo_floor.py
    torchrun --standalone --nproc-per-node 2 docs/backend/gloo_floor.py digest

Blocks of 200 back-to-back calls of gloo's own collectives on a plain gloo group, the
blocks' order reversed every round; rank 0 prints the median over 7 rounds of the time
per call. By default: gloo's AllReduce of 1, 2, 8 and 64 elements, and the allgather of
the optcc check's block (96-byte header and 256-byte room) that a short optcc call makes
instead. With ``digest``: would a digest of the check cost less than its gather? gloo's
MAX of 2 and 3 int64 (a checksum and its negation: equal on every rank iff max == -max
of the negation) against the allgather of the header alone and of the whole block, beside
the one-element AllReduce, each with its min and max over the rounds.
"""

import statistics, sys, time, torch, torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceOp

digest = sys.argv[1:] == ["digest"]
dist.init_process_group("gloo")
p = dist.get_world_size()
g = dist.new_group(backend="gloo")._get_backend(torch.device("cpu"))
cases = {}
for n in (1,) if digest else (1, 2, 8, 64):
    x = torch.ones(n)
    cases[f"gloo allreduce, {n} float32"] = lambda x=x: g.allreduce([x]).wait()
if digest:
    for n in (2, 3):
        h, o = torch.ones(n, dtype=torch.int64), AllreduceOptions()
        o.reduceOp = ReduceOp.MAX
        cases[f"gloo allreduce MAX, {n} int64"] = lambda h=h, o=o: g.allreduce([h], o).wait()
for nb in (96, 352) if digest else (352,):
    block, rows = torch.zeros(nb, dtype=torch.uint8), torch.zeros(nb * p, dtype=torch.uint8)
    cases[f"gloo allgather, the check's {nb} B"] = lambda b=block, r=rows: g._allgather_base(
        r, b, AllgatherOptions()).wait()
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
        spread = f" (min {min(v) * 1e6:.0f}, max {max(v) * 1e6:.0f})" if digest else ""
        print(f"{k:36s} {statistics.median(v) * 1e6:6.0f} us per call{spread}")
dist.destroy_process_group()
