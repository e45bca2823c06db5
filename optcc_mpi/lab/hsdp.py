"""FSDP2 with a replicate dimension (HSDP): the replicate all-reduce on ``optcc`` against
the same mesh on gloo, side by side.

Run on every rank of a job whose ranks fill nodes of ``--shard`` ranks each (on the
testbed: ``testbed up --ranks 8 --ranks-per-node 2``; ``--shard`` then defaults to the
testbed's ranks per node)::

    optcc-mpi testbed up --ranks 8 --ranks-per-node 2 --rate 400mbit --links 1:0.5
    optcc-mpi testbed run -- python -m optcc_mpi lab hsdp --out hsdp.jsonl
    torchrun --standalone --nproc-per-node 4 -m optcc_mpi lab hsdp --shard 2 --steps 4

The mesh is ``(replicas, shard)``: the ranks of one node shard the model (their traffic
stays inside the node), and the ranks with the same place in their nodes form the
replicate groups, whose all-reduce crosses the nodes' links. Two copies of one MLP
(:mod:`optcc_mpi.lab.ddp`'s) are sharded with ``fully_shard`` on every linear layer:

``optcc``
    the replicate dimension on the ``optcc`` backend (``--algorithm``, ``--links``: its
    options; the links default to the testbed's shaping, per node);
``gloo``
    every dimension on gloo.

Their steps alternate and are timed from a barrier to the end of ``optimizer.step()`` on
the slowest rank, the first ``--skip`` left out. Then the **replicate all-reduce alone**:
every replicate group at once (as in training) reduces a float32 buffer of the size FSDP2
reduces per rank (the parameters over the shard size) ``--calls`` times on both backends,
interleaved; on the testbed each call is set against the lower bound of an AllReduce over
the replicas (:func:`optcc_mpi.model.lower_bound`) at the node link's rate divided among
the node's ranks, which all send at once. The parameters of both copies must agree within
``--rtol`` and be the same on every rank (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib
from typing import Any

from optcc_mpi import algorithms, config, model, transports
from optcc_mpi.argtypes import float_above, int_at_least, links_learnt_arg
from optcc_mpi.collectives import last_stats
from optcc_mpi.errors import ArgumentError
from optcc_mpi.lab import testbed, world
from optcc_mpi.lab.ddp import IN_FEATURES, _model
from optcc_mpi.lab.tools import append_rows, tool_main
from optcc_mpi.links import Links

__all__ = ["measure", "add_arguments", "run_args", "main", "SUMMARY"]

#: What ``optcc-mpi lab --help`` says of this tool.
SUMMARY = "FSDP2 HSDP: the replicate all-reduce on the optcc backend against gloo"


def _sharded(args: argparse.Namespace, mesh: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    net = _model(args.width, args.layers, args.seed)
    for layer in net:
        if hasattr(layer, "weight"):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def measure(args: argparse.Namespace, group: Any) -> list[dict[str, Any]]:
    """Train both copies and time the replicate all-reduce (collective); the rows."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import optcc_mpi.torch as ot

    torch.set_num_threads(args.threads)
    wire = transports.of(group)
    rank, p = wire.rank, wire.size
    bed = testbed.current() if config.get("OPTCC_TESTBED_NAME") else None
    shard = args.shard or (bed.ranks_per_node if bed is not None else 2)
    if p % shard or p // shard < 2:
        raise ArgumentError(f"{p} ranks do not make at least 2 replicas of --shard {shard}")
    replicas = p // shard
    links = args.links
    if links is None and bed is not None:
        links = str(Links(dict(bed.degrade)))  # per node = per replica rank
    opts = ot.OptccOptions(algorithm=args.algorithm, links=links)
    names = ("replicate", "shard")
    meshes = {
        "optcc": init_device_mesh(
            "cpu", (replicas, shard), mesh_dim_names=names,
            backend_override={"replicate": ("optcc", opts)},
        ),
        "gloo": init_device_mesh("cpu", (replicas, shard), mesh_dim_names=names),
    }  # fmt: skip
    nets = {name: _sharded(args, mesh) for name, mesh in meshes.items()}
    optims = {k: torch.optim.SGD(v.parameters(), lr=args.lr, momentum=0.9) for k, v in nets.items()}
    gens = {k: torch.Generator().manual_seed(1000 + rank) for k in nets}
    times: dict[str, list[float]] = {k: [] for k in nets}
    ran: dict[str, str] = {}
    for step in range(args.steps):
        for name in ("optcc", "gloo") if step % 2 == 0 else ("gloo", "optcc"):
            x = torch.randn(args.batch, IN_FEATURES, generator=gens[name])
            y = torch.sin(x.sum(dim=1, keepdim=True))
            wire.barrier()
            t0 = time.perf_counter()
            loss = torch.nn.functional.mse_loss(nets[name](x), y)
            optims[name].zero_grad()
            loss.backward()
            optims[name].step()
            dt = max(wire.allgather(time.perf_counter() - t0))
            if name == "optcc":
                ran["step"] = str(last_stats().get("algorithm"))
            if step >= args.skip:
                times[name].append(dt)
    params = {
        k: torch.cat([q.full_tensor().detach().reshape(-1).double() for q in v.parameters()])
        for k, v in nets.items()
    }
    scale = params["gloo"].abs().max().item()
    rel = max(wire.allgather((params["optcc"] - params["gloo"]).abs().max().item() / scale))
    digests = wire.allgather([zlib.crc32(t.numpy().tobytes()) for t in params.values()])
    identical = all(len({d[i] for d in digests}) == 1 for i in range(2))
    # The replicate all-reduce alone, every replicate group at once, as FSDP2 calls it.
    n_params = params["gloo"].numel()
    count = -(-n_params // shard)
    buf = torch.ones(count)
    calls: dict[str, list[float]] = {"optcc": [], "gloo": []}
    for i in range(args.calls + 1):
        for name in ("optcc", "gloo") if i % 2 == 0 else ("gloo", "optcc"):
            grp = meshes[name].get_group("replicate")
            wire.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=grp)
            dt = max(wire.allgather(time.perf_counter() - t0))
            if name == "optcc":
                ran["replicate"] = str(last_stats().get("algorithm"))
            if i > 0:
                calls[name].append(dt)
    bound = None
    if bed is not None:
        # A node's ranks all send at once: each has its share of the node's link.
        per_rank = bed.rate_bit / 8 / bed.ranks_per_node
        bound = model.lower_bound(replicas, count * 4, per_rank, Links(dict(bed.degrade)))
    rows = []
    for name in ("optcc", "gloo"):
        t, c = times[name], calls[name]
        rows.append(
            {
                "mode": name,
                "step_ms": statistics.median(t) * 1e3,
                "step_min_ms": min(t) * 1e3,
                "step_max_ms": max(t) * 1e3,
                "allreduce_ms": statistics.median(c) * 1e3,
                "allreduce_min_ms": min(c) * 1e3,
                "allreduce_max_ms": max(c) * 1e3,
                "bound_ms": bound * 1e3 if bound is not None else None,
                "x_bound": statistics.median(c) / bound if bound else None,
                "replicas": replicas,
                "shard": shard,
                "p": p,
                "params": n_params,
                "allreduce_bytes": count * 4,
                "ran": ran if name == "optcc" else {"replicate": "gloo all_reduce"},
                "links": links if name == "optcc" else None,
                "testbed": bed.describe() if bed is not None else None,
                "rel_gap": rel,
                "identical": identical,
                "steps": args.steps,
                "command": args.command_line,
            }
        )
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``optcc-mpi lab hsdp``."""
    parser.description = (
        "FSDP2 with a replicate dimension: the replicate all-reduce on the optcc backend "
        "against the same mesh on gloo, step by step, then the replicate all-reduce alone "
        "against its lower bound (on the testbed)."
    )
    parser.epilog = (
        "examples:\n"
        "  optcc-mpi testbed up --ranks 8 --ranks-per-node 2 --rate 400mbit --links 1:0.5\n"
        "  optcc-mpi testbed run -- python -m optcc_mpi lab hsdp --out hsdp.jsonl\n"
        "  torchrun --standalone --nproc-per-node 4 -m optcc_mpi lab hsdp --shard 2 "
        "--width 256 --steps 4"
    )
    parser.add_argument("--shard", type=int_at_least(1, "the shard size"), default=None,
                        help="ranks per node, sharding the model (default: the testbed's "
                        "ranks per node, else 2)")  # fmt: skip
    parser.add_argument("--width", type=int_at_least(1, "the width"), default=1600,
                        help="hidden width (1600)")  # fmt: skip
    parser.add_argument("--layers", type=int_at_least(1, "layers"), default=4,
                        help="hidden layers (4: 10.35 M parameters)")  # fmt: skip
    parser.add_argument("--steps", type=int_at_least(1, "steps"), default=10,
                        help="steps of each copy (10)")  # fmt: skip
    parser.add_argument("--skip", type=int_at_least(0, "steps"), default=1,
                        help="first steps of each left out of the times (1)")  # fmt: skip
    parser.add_argument("--calls", type=int_at_least(1, "calls"), default=5,
                        help="timed replicate all-reduces of each (5)")  # fmt: skip
    parser.add_argument("--batch", type=int_at_least(1, "the batch"), default=16,
                        help="samples per rank (16)")  # fmt: skip
    parser.add_argument("--lr", type=float_above(0.0, "the learning rate"), default=0.01,
                        help="SGD lr (0.01)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights (0)")
    parser.add_argument("--algorithm", default=None, choices=("auto", *algorithms.names()),
                        help="the replicate group's algorithm (default $OPTCC_ALGORITHM, "
                        "else auto)")  # fmt: skip
    parser.add_argument("--links", type=links_learnt_arg, default=None,
                        metavar="RANK:FRACTION[,...]|probe|watch",
                        help="the replicate group's links, in replica ranks (default: the "
                        "testbed's shaping per node, else $OPTCC_LINKS)")  # fmt: skip
    parser.add_argument("--rtol", type=float_above(0.0, "the tolerance"), default=1e-6,
                        help="largest parameter gap allowed, relative (1e-6)")  # fmt: skip
    parser.add_argument("--threads", type=int_at_least(1, "threads"), default=1,
                        help="torch threads (1)")  # fmt: skip
    parser.add_argument("--out", help="append rows as JSON lines to this file")


def run_args(args: argparse.Namespace) -> int:
    """Run the tool on every rank; rank 0 prints (and writes ``--out``)."""
    if args.skip >= args.steps:
        raise ArgumentError(f"--skip {args.skip} leaves none of --steps {args.steps} timed")
    group, started = world.torch_group()
    rows = measure(args, group)
    if transports.of(group).rank == 0:
        first = rows[0]
        print(
            f"# {args.command_line}\n# {first['p']} ranks: {first['replicas']} replicas x "
            f"{first['shard']} shards, {first['params'] / 1e6:.2f} M parameters, replicate "
            f"all-reduce {first['allreduce_bytes'] / 2**20:.1f} MiB, links {first['links']}"
        )
        ref = rows[1]
        print(f"{'replicate on':<13} {'step ms':>9} {'x gloo':>7} {'all-reduce ms':>14} "
              f"{'x gloo':>7} {'x bound':>8}  ran")  # fmt: skip
        for r in rows:
            xb = f"{r['x_bound']:.3f}" if r["x_bound"] else "-"
            print(
                f"{r['mode']:<13} {r['step_ms']:>9.1f} {r['step_ms'] / ref['step_ms']:>7.3f} "
                f"{r['allreduce_ms']:>14.1f} {r['allreduce_ms'] / ref['allreduce_ms']:>7.3f} "
                f"{xb:>8}  {r['ran']}"
            )
        print(
            f"# parameters after {args.steps} steps: optcc vs gloo {first['rel_gap']:.3g} "
            f"relative (allowed {args.rtol:g}); identical on every rank: {first['identical']}"
        )
        if args.out:
            append_rows(args.out, rows)
            print(f"# appended {len(rows)} rows to {args.out}")
        sys.stdout.flush()
    ok = rows[0]["rel_gap"] <= args.rtol and rows[0]["identical"]
    world.end(started)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m optcc_mpi.lab.hsdp``: the same as ``optcc-mpi lab hsdp``."""
    return tool_main("optcc_mpi.lab.hsdp", add_arguments, run_args, argv)


if __name__ == "__main__":
    sys.exit(main())
