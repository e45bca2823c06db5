"""Train a small network with PyTorch DDP, gradients averaged by optcc_mpi.

Every rank holds a shard of a synthetic regression problem (targets from a fixed random
"teacher" network plus noise). DistributedDataParallel computes gradients; the
communication hook from ``optcc_mpi.torch.comm_hook`` averages them with the chosen
AllReduce algorithm, taking a degraded link into account. Rank 0 prints the loss
(averaged over all ranks) at every step; at the end every rank's parameters are compared
bit for bit.

Run it with any MPI launcher; ``python -m mpi4py`` makes an exception on one rank abort
the whole job instead of leaving the others waiting::

    mpiexec -n 4 python -m mpi4py examples/train_ddp.py --links 1:0.5 --steps 20

    srun --mpi=pmi2 -n 4 python -m mpi4py examples/train_ddp.py --links 1:0.5

(with the ``mpich`` wheel from PyPI, Slurm launches the ranks directly through PMI-2).
``--compare`` also trains with DDP's own all-reduce from the same start and prints how
far the two sets of parameters end up apart. ``--help`` lists every option.
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib

import torch

from optcc_mpi import algorithms  # the registry; importing it does not start MPI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="train_ddp.py",
        description=(
            "DDP training with optcc_mpi's gradient averaging. Launch under MPI, e.g. "
            "`mpiexec -n 4 python -m mpi4py examples/train_ddp.py --links 1:0.5`."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--algorithm",
        default="auto",
        choices=("auto", *algorithms.names()),
        help="AllReduce algorithm: auto lets the cost model choose per bucket "
        "(see `optcc-mpi model`)",
    )
    ap.add_argument(
        "--links",
        default=None,
        help="degraded ranks as RANK:FRACTION[,...] of the healthy bandwidth, e.g. 1:0.5; "
        "'probe' measures them; default $OPTCC_LINKS, else all healthy",
    )
    ap.add_argument("--steps", type=_positive, default=20, help="training steps")
    ap.add_argument("--batch", type=_positive, default=64, help="samples per rank per step")
    ap.add_argument("--lr", type=_positive_float, default=0.05, help="SGD learning rate")
    ap.add_argument("--hidden", type=_positive, default=256, help="width of the hidden layers")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="dtype of the model, hence of the gradient buckets",
    )
    ap.add_argument("--bucket-mb", type=_positive_float, default=25.0, help="DDP's bucket_cap_mb")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    ap.add_argument(
        "--threads",
        type=_positive,
        default=1,
        help="PyTorch threads per rank (1 suits several ranks per node)",
    )
    ap.add_argument(
        "--compare",
        action="store_true",
        help="also train with DDP's default all-reduce and print the largest parameter gap",
    )
    return ap.parse_args(argv)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def make_data(
    rank: int, p: int, n_per_rank: int, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of a regression problem whose targets come from a fixed random
    teacher network (the same teacher on every rank) plus a little noise."""
    teacher = torch.Generator().manual_seed(seed + 12345)
    w1 = torch.randn(32, 64, generator=teacher) / 32**0.5
    w2 = torch.randn(64, 1, generator=teacher) / 64**0.5
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank)  # each rank its own shard
    x = torch.randn(n_per_rank, 32, generator=g)
    y = torch.tanh(x @ w1) @ w2 + 0.01 * torch.randn(n_per_rank, 1, generator=g)
    return x.to(dtype), y.to(dtype)


def make_model(hidden: int, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same start on every rank (DDP also broadcasts rank 0's)
    return torch.nn.Sequential(
        torch.nn.Linear(32, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 1),
    ).to(dtype)


def train(args: argparse.Namespace, hook: object, label: str, verbose: bool) -> torch.Tensor:
    """Train for ``args.steps`` steps; return the final parameters as one vector."""
    from mpi4py import MPI

    import optcc_mpi
    import optcc_mpi.torch as ot

    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    dtype = getattr(torch, args.dtype)
    x, y = make_data(rank, p, args.batch * 8, args.seed, dtype)
    model = torch.nn.parallel.DistributedDataParallel(
        make_model(args.hidden, args.seed, dtype), bucket_cap_mb=args.bucket_mb
    )
    if hook is not None:
        model.register_comm_hook(state=None, hook=hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if verbose and rank == 0:
        n_params = sum(q.numel() for q in model.parameters())
        print(
            f"# {label}: {p} ranks, {n_params} parameters ({args.dtype}), "
            f"batch {args.batch} per rank, {args.steps} steps",
            flush=True,
        )
        print(f"{'step':>5} {'loss':>12} {'ms/step':>8}  allreduce", flush=True)
    for step in range(args.steps):
        lo = (step * args.batch) % x.shape[0]
        xb, yb = x[lo : lo + args.batch], y[lo : lo + args.batch]
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()  # the hook averages the gradient buckets here
        opt.step()
        dt = time.perf_counter() - t0
        # What the hook ran for the last gradient bucket (read before the next call).
        st = optcc_mpi.collectives.last_stats() if hook is not None else {}
        used = f"{st['algorithm']}, links {st['links']}" if st else ""
        # The loss every rank saw, averaged over the ranks (in float64, one element).
        mean_loss = ot.allreduce(loss.detach().double().reshape(1), average=True)
        if verbose and rank == 0:
            print(f"{step:>5} {mean_loss.item():>12.6f} {dt * 1e3:>8.1f}  {used}", flush=True)
    return torch.cat([q.detach().reshape(-1).double() for q in model.parameters()])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)

    from mpi4py import MPI

    import optcc_mpi.torch as ot

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    # The hook checks its arguments now (on every rank alike), before any training.
    hook = ot.comm_hook(algorithm=args.algorithm, links=args.links)
    ot.init_process_group_from_mpi("gloo")
    try:
        ours = train(args, hook, f"DDP + optcc_mpi ({args.algorithm})", verbose=True)
        digests = comm.allgather(zlib.crc32(ours.numpy().tobytes()))
        same = len(set(digests)) == 1
        if rank == 0:
            print(f"# parameters identical on all {len(digests)} ranks: {same}", flush=True)
        if args.compare:
            theirs = train(args, None, "DDP's own all-reduce", verbose=False)
            gap = (ours - theirs).abs().max().item()
            if rank == 0:
                print(f"# largest gap to DDP's own all-reduce: {gap:.3g}", flush=True)
        return 0 if same else 1
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
