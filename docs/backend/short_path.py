"""The optcc backend's short path against its whole path and gloo, in one run (docs/results.md).

    for b in 4 65536 1048576 16777216; do
        torchrun --standalone --nproc-per-node 2 docs/backend/short_path.py $b; done

Blocks of back-to-back ``dist.all_reduce`` calls (float32 SUM, in place, the check on):
on the default gloo group, on an optcc group, and on the same optcc group with its short
path turned off (every call takes the whole path: tensors.start_tensor, collectives.start_call,
the group's job), the blocks' order reversed every round. Rank 0 prints the median over
the rounds of the time per call, and its ratio to gloo's.
"""

import statistics, sys, time, torch, torch.distributed as dist
import optcc_mpi.torch  # noqa: F401  (registers "optcc")

dist.init_process_group("gloo")
g = dist.new_group(backend="optcc")
short = g._lane
nbytes = int(sys.argv[1])
calls = 100 if nbytes <= 1 << 20 else 10
t = torch.ones(nbytes // 4)
for _ in range(5):
    dist.all_reduce(t, group=g)
res = {"gloo": [], "short path": [], "whole path": []}
for rnd in range(9):
    for name in list(res) if rnd % 2 else list(res)[::-1]:
        g._lane = short if name == "short path" else (lambda *a: None)
        group = None if name == "gloo" else g
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(t, group=group)
        res[name].append((time.perf_counter() - t0) / calls)
if dist.get_rank() == 0:
    base = statistics.median(res["gloo"])
    print(f"{nbytes:>9} B  " + "  ".join(
        f"{k} {statistics.median(v) * 1e3:.3f} ms ({statistics.median(v) / base:.2f}x)"
        for k, v in res.items()))
dist.destroy_process_group()
