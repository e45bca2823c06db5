"""Where one short dist.all_reduce on an optcc group spends its time (docs/results.md).

    torchrun --standalone --nproc-per-node 2 docs/backend/profile_call.py

Rank 0 prints cProfile's table of 500 calls of a 4-byte float32 SUM, by own time.
"""

import os, sys, time, cProfile, pstats, torch, torch.distributed as dist, io
import optcc_mpi.torch as ot
dist.init_process_group("gloo")
g = dist.new_group(backend="optcc")
t = torch.ones(1)
for _ in range(20): dist.all_reduce(t, group=g)
r=dist.get_rank()
pr = cProfile.Profile(); pr.enable()
for _ in range(500): dist.all_reduce(t, group=g)
pr.disable()
if r==0:
    s=io.StringIO(); st=pstats.Stats(pr, stream=s); st.sort_stats("tottime").print_stats(40); print("\n".join(l[:160] for l in s.getvalue().splitlines()[6:50]))
dist.destroy_process_group()
