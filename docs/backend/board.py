"""The optcc backend on the board against the same on gloo, and gloo's own all_reduce, in
one run (docs/results.md, issue 32).

    torchrun --standalone --nproc-per-node P docs/backend/board.py 4 64K 256K 1M 16M 64M

Blocks of back-to-back ``dist.all_reduce`` calls (float32 SUM, in place, the check on), as
a training loop makes them: on the default gloo group, on an optcc group (every rank on
this machine: its check and its AllReduce through shared memory,
optcc_mpi.transports.board), and on an optcc group made with ``OPTCC_BOARD`` off (both
on gloo), the blocks' order
reversed every round. Rank 0 prints, per size, the median over the rounds of each
block's time per call (min-max) and its ratio to gloo's median.
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist

import optcc_mpi.torch  # noqa: F401  (registers "optcc")
from optcc_mpi import config
from optcc_mpi.units import parse_size

dist.init_process_group("gloo")
torch.set_num_threads(1)
groups = {"gloo": None, "optcc": dist.new_group(backend="optcc")}
config.rc.board = False
groups["optcc noboard"] = dist.new_group(backend="optcc")
config.rc.board = True
rounds = 9
if dist.get_rank() == 0:
    print(f"# {' '.join(sys.argv)}: {dist.get_world_size()} ranks, {rounds} rounds")
for arg in sys.argv[1:]:
    nbytes = parse_size(arg)
    calls = max(3, min(100, (64 << 20) // max(nbytes, 1) // 4))
    t = torch.ones(max(1, nbytes // 4))
    for g in groups.values():
        for _ in range(3):
            dist.all_reduce(t, group=g)
    res: dict[str, list[float]] = {name: [] for name in groups}
    for rnd in range(rounds):
        for name in list(groups) if rnd % 2 else list(groups)[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(t, group=groups[name])
            res[name].append((time.perf_counter() - t0) / calls)
    if dist.get_rank() == 0:
        base = statistics.median(res["gloo"])
        print(f"{arg:>5} ({calls} calls) " + "  ".join(
            f"{k} {statistics.median(v) * 1e3:.3f} ({min(v) * 1e3:.3f}-{max(v) * 1e3:.3f}) "
            f"{statistics.median(v) / base:.2f}x"
            for k, v in res.items()), flush=True)  # fmt: skip
dist.destroy_process_group()
