"""One rank of tests/test_bench_torch.py's link-log test, started by torchrun without MPI.

``python -m torch.distributed.run --standalone --nproc-per-node N
tests/torch_hook_log_worker.py LOG OUT``: a small model trained with DDP and
``comm_hook(links="watch", links_log=LOG)`` under the emulation of ``$OPTCC_EMULATE``; each
rank writes ``OUT/rank-R.json``: what the hook ran last, and the refusal of a
``links_log`` without ``links="watch"``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.modules["mpi4py"] = None  # type: ignore[assignment]  # no MPI in this job

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import optcc_mpi.torch as ot  # noqa: E402
from optcc_mpi import collectives  # noqa: E402

LOG, OUT = Path(sys.argv[1]), Path(sys.argv[2])
RANK = int(os.environ["RANK"])


def main() -> None:
    dist.init_process_group("gloo")
    out: dict[str, object] = {}
    try:
        ot.comm_hook(links="1:0.5", links_log=LOG)
    except ValueError as exc:
        out["refused"] = str(exc)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1))
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1)
    model.register_comm_hook(state=None, hook=ot.comm_hook(links="watch", links_log=LOG))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(RANK)
    for _ in range(int(os.environ.get("STEPS", "12"))):
        x = torch.randn(16, 64, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    st = collectives.last_stats()
    out.update(algorithm=st.get("algorithm"), links=str(st.get("links")))
    (OUT / f"rank-{RANK}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
