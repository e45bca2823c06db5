"""One rank of the torch.distributed tests (tests/test_torch_dist.py), started by torchrun.

``python -m torch.distributed.run --standalone --nproc-per-node N tests/torch_worker.py
SCENARIO OUTDIR``. No MPI: mpi4py is made unimportable before optcc_mpi is imported
(except in the ``mismatch`` scenario, which needs an MPI communicator to mismatch). Each
rank writes what it saw to ``OUTDIR/SCENARIO-RANK.json``; the test compares the ranks.

Scenarios
---------
``collectives``
    Every registered algorithm and ``auto``, over gloo, on tensors (several dtypes, ops
    and sizes, a degraded profile) and NumPy arrays, both executor drivers (the gloo one,
    and NCCL's level-by-level groups run over gloo): the largest error against a float64
    (or exact) reference and a digest of every result's bytes.
``out_of_place``
    Every algorithm and ``auto`` over gloo on both executor drivers: ``allreduce(t, out)``
    (the executor reading the send tensor where the input is first needed) against
    ``allreduce(IN_PLACE, t)``, bit for bit, tensors and NumPy arrays, and the send buffer
    left as it was.
``errors``
    Bad input on one rank, or ranks that disagree: each rank's error message, and whether
    its tensor changed.
``slow``
    A ring whose messages each take about a second to arrive: the sum and its digest.
``ddp``
    A small model trained with DDP and the hook, then with DDP's own all-reduce: the final
    parameters of both.
``mismatch``
    The hook given an MPI communicator that is not the process group (under torchrun MPI
    starts a singleton per process), and a call before torch.distributed is initialised.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import zlib
from pathlib import Path

SCENARIO, OUT = sys.argv[1], Path(sys.argv[2])
if SCENARIO != "mismatch":
    sys.modules["mpi4py"] = None  # type: ignore[assignment]  # import mpi4py -> ImportError

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import optcc_mpi  # noqa: E402
import optcc_mpi.torch as ot  # noqa: E402
from optcc_mpi import algorithms, collectives, transports  # noqa: E402
from optcc_mpi.probe import probe  # noqa: E402
from optcc_mpi.transports import Completion  # noqa: E402

RANK = int(os.environ["RANK"])
P = int(os.environ["WORLD_SIZE"])


def digest(t: object) -> str:
    raw = t.numpy().tobytes() if isinstance(t, torch.Tensor) else np.asarray(t).tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


def inputs(dtype: torch.dtype, n: int, seed: int) -> list[torch.Tensor]:
    """Every rank's contribution (each rank makes them all: the reference needs them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(P):
        if dtype.is_floating_point:
            x = torch.randn(n, generator=g, dtype=torch.float64)
            x[:: max(1, n // 7)] = 0.0
            out.append(x.to(dtype))
        elif dtype == torch.bool:
            out.append(torch.randint(0, 2, (n,), generator=g).bool())
        else:
            out.append(torch.randint(-50, 50, (n,), generator=g).to(dtype))
    return out


def reference(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    stack = torch.stack([x.double() for x in xs])
    if op == "sum":
        return stack.sum(0)
    if op == "max":
        return stack.max(0).values
    if op == "min":
        return stack.min(0).values
    if op == "prod":
        return stack.prod(0)
    if op == "lor":
        return (stack != 0).any(0).double()
    raise ValueError(op)


def bound(xs: list[torch.Tensor], op: str, dtype: torch.dtype) -> float:
    """Largest error allowed against float64: exact for integers, max, min and logical
    ops; for a float sum, p - 1 additions each rounding (twice for 16-bit types)."""
    if not dtype.is_floating_point or op not in ("sum", "prod"):
        return 0.0
    unit = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
    u = unit.get(dtype, 2.0**-53)
    scale = torch.stack([x.double().abs() for x in xs]).sum(0).max().item()
    return 2 * P * u * scale + 1e-300


def collectives_scenario() -> dict:
    group = dist.group.WORLD
    wire = transports.of(group)
    rows = []
    cases = [
        (torch.float32, "sum"),
        (torch.float64, "sum"),
        (torch.bfloat16, "sum"),
        (torch.float16, "sum"),
        (torch.int64, "sum"),
        (torch.int32, "sum"),
        (torch.float32, "max"),
        (torch.float64, "min"),
        (torch.int8, "max"),
        (torch.float32, "prod"),
        (torch.bool, "lor"),
    ]
    sizes = (1, P + 1, 1009, 70001)
    names = ["auto", *algorithms.names()]
    for driver in ("ordered", "grouped"):
        wire.caps = dataclasses.replace(
            wire.caps, completion=Completion(driver)
        )  # NCCL's driver, run over gloo
        for alg in names:
            links = f"{P - 1}:0.5" if alg != "native" else None
            for dtype, op in cases:
                if op == "prod" and dtype != torch.float32:
                    continue
                for n in sizes:
                    xs = inputs(dtype, n, seed=zlib.crc32(f"{dtype}{op}{n}".encode()))
                    if op == "prod":
                        xs = [1 + x.abs() / 8 for x in xs]
                    t = xs[RANK].clone()
                    got = ot.allreduce(t, op, algorithm=alg, links=links)
                    ref = reference(xs, op)
                    err = (got.double() - ref).abs().max().item()
                    rows.append(
                        {
                            "driver": driver,
                            "algorithm": alg,
                            "ran": collectives.last_stats().get("algorithm"),
                            "transport": collectives.last_stats().get("transport"),
                            "dtype": str(dtype),
                            "op": op,
                            "n": n,
                            "error": err,
                            "bound": bound(xs, op, dtype),
                            "digest": digest(got.view(torch.uint8)),
                            "same_memory": got.data_ptr() == t.data_ptr(),
                        }
                    )
            # NumPy arrays over gloo, out of place, reduced by NumPy.
            xs = [x.numpy() for x in inputs(torch.float32, 4099, 5)]
            y = optcc_mpi.allreduce(xs[RANK], comm=group, algorithm=alg, links=links)
            ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
            rows.append(
                {
                    "driver": driver,
                    "algorithm": alg,
                    "ran": collectives.last_stats().get("algorithm"),
                    "transport": collectives.last_stats().get("transport"),
                    "dtype": "numpy float32",
                    "op": "sum",
                    "n": 4099,
                    "error": float(np.abs(y - ref).max()),
                    "bound": 2 * P * 2.0**-24 * float(np.sum(np.abs(xs), axis=0).max()),
                    "digest": digest(y),
                    "same_memory": False,
                }
            )
    # The probe over each driver: it times the messages (the grouped driver waits for each
    # level on the host when tracing), and healthy links are healthy.
    probes = {}
    for driver in ("ordered", "grouped"):
        wire.caps = dataclasses.replace(wire.caps, completion=Completion(driver))
        result = probe(group, nbytes=1 << 20, repeats=2)
        probes[driver] = {
            "links": str(result.links),
            "rates": [float(x) for x in result.recv_rate],
        }
    wire.caps = dataclasses.replace(wire.caps, completion=Completion("ordered"))
    return {"rows": rows, "probes": probes, "mpi_loaded": "mpi4py.MPI" in sys.modules}


def out_of_place_scenario() -> dict:
    group = dist.group.WORLD
    wire = transports.of(group)
    rows = []
    cases = [(torch.float32, "sum"), (torch.bfloat16, "sum"), (torch.float64, "max")]
    cases += [(torch.int32, "sum"), (torch.float32, "prod")]
    for driver in ("ordered", "grouped"):
        wire.caps = dataclasses.replace(wire.caps, completion=Completion(driver))
        for alg in ["auto", *algorithms.names()]:
            for links in (None, f"{P - 1}:0.5", "0:0.3"):
                for dtype, op in cases:
                    for n in (P + 1, 4099, 70001):
                        x = inputs(dtype, n, seed=zlib.crc32(f"{dtype}{op}{n}".encode()))[RANK]
                        if op == "prod":
                            x = 1 + x.abs() / 8
                        kept = x.clone()
                        ref = x.clone()
                        optcc_mpi.allreduce(
                            optcc_mpi.IN_PLACE, ref, op=op, comm=group, algorithm=alg, links=links
                        )
                        out = torch.full_like(x, 3)
                        optcc_mpi.allreduce(x, out, op=op, comm=group, algorithm=alg, links=links)
                        rows.append(
                            {
                                "driver": driver,
                                "algorithm": alg,
                                "links": links,
                                "dtype": str(dtype),
                                "n": n,
                                "same": bool(
                                    torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
                                ),
                                "kept": bool(
                                    torch.equal(x.view(torch.uint8), kept.view(torch.uint8))
                                ),
                                "digest": digest(out.view(torch.uint8)),
                            }
                        )
            xs = [x.numpy() for x in inputs(torch.float32, 70001, 9)]
            ref = xs[RANK].copy()
            optcc_mpi.allreduce(optcc_mpi.IN_PLACE, ref, comm=group, algorithm=alg, links="0:0.5")
            out = np.zeros_like(ref)
            optcc_mpi.allreduce(xs[RANK], out, comm=group, algorithm=alg, links="0:0.5")
            rows.append(
                {
                    "driver": driver,
                    "algorithm": alg,
                    "links": "0:0.5",
                    "dtype": "numpy float32",
                    "n": 70001,
                    "same": bool(np.array_equal(out.view(np.uint8), ref.view(np.uint8))),
                    "kept": bool(
                        np.array_equal(xs[RANK], inputs(torch.float32, 70001, 9)[RANK].numpy())
                    ),
                    "digest": digest(out),
                }
            )
    wire.caps = dataclasses.replace(wire.caps, completion=Completion("ordered"))
    return {"rows": rows}


def errors_scenario() -> dict:
    out = {}

    def attempt(key: str, t: torch.Tensor, **kw: object) -> None:
        before = t.clone() if t.device.type != "meta" else None
        try:
            ot.allreduce(t, **kw)
        except (ValueError, TypeError) as exc:
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
        else:
            out[key] = {"error": None}
        if before is not None:
            out[key]["unchanged"] = bool(torch.equal(t, before))

    last = RANK == P - 1
    attempt("count", torch.ones(5 + last))
    attempt("dtype", torch.ones(8, dtype=torch.float64 if last else torch.float32))
    attempt("algorithm", torch.ones(8), algorithm="ring" if last else "optcc")
    attempt("links", torch.ones(8), links="0:0.5" if last else "0:0.25")
    attempt("average", torch.ones(8, dtype=torch.bfloat16), average=not last)
    attempt("noncontiguous", torch.ones(4, 3).t() if last else torch.ones(3, 4))
    attempt("device", torch.ones(8, device="meta") if last else torch.ones(8))
    attempt("unknown_algorithm", torch.ones(8), algorithm="fastest" if last else "ring")
    # Still usable afterwards: nobody was left inside a collective.
    t = torch.ones(8)
    ot.allreduce(t)
    out["after"] = t.tolist()
    return out


def slow_scenario() -> dict:
    """Messages that take longer to arrive than the transport's poll (0.5 s): a ring whose
    every message is paced at 1 MB/s (1 MiB each), over this gloo group's transport."""
    n = P << 18  # float32: P chunks of 1 MiB
    xs = [np.arange(n, dtype=np.float32) * (r + 1) for r in range(P)]
    y = optcc_mpi.allreduce(xs[RANK], comm=dist.group.WORLD, algorithm="ring", emulate="bw=1MB/s")
    ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
    return {"error": float(np.abs(y - ref).max() / ref.max()), "digest": digest(y)}


def train(hook: object, steps: int = 20) -> torch.Tensor:
    """DDP training of a small model (about 1 M parameters), the same weights everywhere,
    per-rank data; the final parameters as one float64 vector."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 960),
        torch.nn.Tanh(), torch.nn.Linear(960, 1),
    )  # fmt: skip
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1)
    if hook is not None:
        model.register_comm_hook(state=None, hook=hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + RANK)
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([q.detach().reshape(-1).double() for q in model.parameters()])


def ddp_scenario() -> dict:
    ours = train(ot.comm_hook(algorithm="optcc", links=f"{P - 1}:0.5"))
    ran = collectives.last_stats()
    theirs = train(None)
    start = train(None, steps=0)
    return {
        "ours": digest(ours),
        "diff": (ours - theirs).abs().max().item(),
        "scale": theirs.abs().max().item(),
        "moved": (ours - start).abs().max().item(),
        "ran": ran.get("algorithm"),
        "links": str(ran.get("links")),
        "transport": ran.get("transport"),
        "parameters": ours.numel(),
    }


def mismatch_scenario() -> dict:
    from mpi4py import MPI

    out = {"mpi_size": MPI.COMM_WORLD.Get_size()}
    try:
        ot.allreduce(torch.ones(4))
    except ValueError as exc:
        out["before_init"] = str(exc)
    dist.init_process_group("gloo")
    hook = ot.comm_hook(comm=MPI.COMM_WORLD)

    class Bucket:
        def buffer(self) -> torch.Tensor:
            return self.t

    b = Bucket()
    b.t = torch.ones(4)
    try:
        hook(None, b)
    except ValueError as exc:
        out["hook"] = str(exc)
    out["unchanged"] = bool(torch.equal(b.t, torch.ones(4)))
    # The default hook (no comm) averages over the process group.
    b.t = torch.full((4,), float(RANK))
    ot.comm_hook()(None, b).wait()
    out["averaged"] = b.t.tolist()
    return out


def main() -> None:
    if SCENARIO != "mismatch":
        dist.init_process_group("gloo")
    result = {
        "collectives": collectives_scenario,
        "out_of_place": out_of_place_scenario,
        "errors": errors_scenario,
        "slow": slow_scenario,
        "ddp": ddp_scenario,
        "mismatch": mismatch_scenario,
    }[SCENARIO]()
    (OUT / f"{SCENARIO}-{RANK}.json").write_text(json.dumps(result))
    # No barrier first: a rank that finishes early tears its groups down while the others
    # still work, as in users' scripts.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
