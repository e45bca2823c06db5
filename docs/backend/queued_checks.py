"""Queued reductions with a check each, on gloo alone: do the checks gain from being in flight together? (docs/results.md)

    torchrun --standalone --nproc-per-node 2 docs/backend/queued_checks.py

100 all-reduces of 1 MiB: gloo's own (all queued, then waited); each preceded by an
allgather of a 352-byte check block on a second group, waited for, the data then posted
(up to 8 in flight: what the optcc group's thread does); and the checks of up to 8 calls
posted at once ahead of their data. Median of 7 rounds, the order reversed every round.
"""
import time, statistics, torch, torch.distributed as dist, collections
from torch._C._distributed_c10d import AllgatherOptions
dist.init_process_group("gloo")
r = dist.get_rank(); p = dist.get_world_size()
C = dist.new_group(backend="gloo")._get_backend(torch.device("cpu"))
D = dist.new_group(backend="gloo")._get_backend(torch.device("cpu"))
N, M = 100, 8
ts = [torch.ones(1 << 18) for _ in range(N)]
blocks = [(torch.zeros(352, dtype=torch.uint8), torch.zeros(352 * p, dtype=torch.uint8)) for _ in range(N)]
def gloo():
    ws = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in ws: w.wait()
def serial_checks():
    infl = collections.deque()
    for i in range(N):
        b, g = blocks[i]
        C._allgather_base(g, b, AllgatherOptions()).wait()
        infl.append(D.allreduce([ts[i]]))
        if len(infl) >= M: infl.popleft().wait()
    while infl: infl.popleft().wait()
def piped_checks():
    chk = collections.deque(); infl = collections.deque(); i = 0; nxt = 0
    while nxt < N or chk or infl:
        while nxt < N and len(chk) < M:
            b, g = blocks[nxt]; chk.append((nxt, C._allgather_base(g, b, AllgatherOptions()))); nxt += 1
        if chk:
            k, w = chk.popleft(); w.wait()
            infl.append(D.allreduce([ts[k]]))
            if len(infl) >= M: infl.popleft().wait()
        else:
            infl.popleft().wait()
fs = {"gloo": gloo, "serial checks": serial_checks, "pipelined checks": piped_checks}
res = {k: [] for k in fs}
for rnd in range(7):
    for k in (list(fs) if rnd % 2 else list(fs)[::-1]):
        dist.barrier(); t0 = time.perf_counter(); fs[k](); res[k].append(time.perf_counter() - t0)
if r == 0:
    base = statistics.median(res["gloo"])
    for k, v in res.items(): print(f"{k:18s} {statistics.median(v)*1e3:7.1f} ms {statistics.median(v)/base:.2f}x")
dist.destroy_process_group()
