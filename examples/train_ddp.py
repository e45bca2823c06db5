"""Train a small convolutional network with PyTorch DDP, gradients averaged by optcc_mpi.

The network classifies the handwritten digits that ship with scikit-learn (1797 images of
8x8 pixels, 10 classes; no download): two convolutions and two linear layers, 0.1 M
parameters. Every rank trains on its own shard of the training images;
``DistributedDataParallel`` computes the gradients and optcc_mpi's communication hook
averages them with the chosen AllReduce algorithm, around a degraded link if one is named.
Rank 0 prints each epoch's last loss (averaged over the ranks), the time of that step and
what the hook ran, and at the end the
accuracy on the held-out images and whether every rank holds the same parameters, bit for
bit. Without scikit-learn (``--data synthetic``) the images are random, drawn around ten
fixed class templates.

Launch it as any PyTorch job; no MPI library is needed::

    torchrun --standalone --nproc-per-node 4 examples/train_ddp.py --links 1:0.5 --compare

    # several nodes: the same on each node, with a rendezvous endpoint
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint node0:29500 examples/train_ddp.py --links 1:0.5

It also runs under an MPI launcher, which starts torch.distributed from the MPI ranks
(``python -m mpi4py`` ends the whole job when one rank raises)::

    mpiexec -n 4 python -m mpi4py examples/train_ddp.py --links 1:0.5
    srun --mpi=pmi2 -n 4 python -m mpi4py examples/train_ddp.py --links 1:0.5

On one machine, without root, ``--emulate`` puts every rank behind a virtual NIC
(:mod:`optcc_mpi.emulation`), the slow ranks those of ``--links`` (or of the spec's own
``degrade=``), so the gain of routing around a slow link shows on a laptop::

    torchrun --standalone --nproc-per-node 4 examples/train_ddp.py \
        --emulate bw=100MB/s --links 0:0.5 --compare

With ``--compare`` the second run stands for DDP's own all-reduce: without emulation it
is DDP's default (gloo's all_reduce); under emulation gloo's own traffic cannot be paced,
so it averages with the ring through the same hook on the same virtual NICs (gloo's
all_reduce runs a ring, held back like it by the slowest link), and both runs pay the
same emulated network. The median step times of both are printed.

The process group is gloo on the CPU. ``--device cuda`` uses NCCL, one GPU per rank
(``LOCAL_RANK``); that path has not run on a GPU yet (docs/torch.md). ``--links watch``
learns the slow link from the training's own messages, and ``--links-log FILE`` records
what it adopts (``optcc-mpi report --links FILE`` draws it). ``--compare`` also trains
with DDP's own all-reduce from the same start and prints how far the two sets of
parameters end up apart. ``--help`` lists every option.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from statistics import median

import torch
import torch.distributed as dist

import optcc_mpi.torch as ot
from optcc_mpi import Emulation, Links, algorithms, collectives, config

#: Variables an MPI launcher gives its ranks (torchrun sets RANK and WORLD_SIZE instead).
MPI_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="train_ddp.py",
        description=(
            "DDP training of a small CNN on scikit-learn's digits with optcc_mpi's gradient "
            "averaging. Launch with torchrun (e.g. `torchrun --standalone --nproc-per-node 4 "
            "examples/train_ddp.py --links 1:0.5`) or an MPI launcher."
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
        "'probe' measures them once, 'watch' learns them from every bucket's messages; "
        "default $OPTCC_LINKS, else all healthy",
    )
    ap.add_argument(
        "--links-log",
        default=None,
        metavar="FILE",
        help="with --links watch: append the profiles adopted and the algorithms run to FILE "
        "(JSON lines, rank 0)",
    )
    ap.add_argument("--epochs", type=_positive, default=8, help="passes over the training set")
    ap.add_argument("--batch", type=_positive, default=32, help="images per rank per step")
    ap.add_argument("--lr", type=_positive_float, default=0.1, help="SGD learning rate")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="dtype of the model, hence of the gradient buckets",
    )
    ap.add_argument("--bucket-mb", type=_positive_float, default=25.0, help="DDP's bucket_cap_mb")
    ap.add_argument(
        "--data",
        choices=("digits", "synthetic"),
        default=None,
        help="the images: scikit-learn's digits (the default when scikit-learn is installed) "
        "or random ones around ten class templates",
    )
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo process group; cuda: NCCL, one GPU per rank (not yet run on a GPU)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the split")
    ap.add_argument(
        "--threads",
        type=_positive,
        default=1,
        help="PyTorch threads per rank (1 suits several ranks per node)",
    )
    ap.add_argument(
        "--compare",
        action="store_true",
        help="also train with DDP's default all-reduce (under --emulate: the ring through "
        "the same hook on the same virtual NICs) and print the step times and the largest "
        "parameter gap",
    )
    ap.add_argument(
        "--emulate",
        default=None,
        metavar="bw=RATE[,latency=TIME][,degrade=RANK:FRACTION]",
        help="software-emulated links (no root): virtual NICs of RATE, the ranks of "
        "--links (or of degrade=) slowed",
    )
    args = ap.parse_args(argv)
    if args.links_log and str(args.links or "").strip().lower() != "watch":
        ap.error("--links-log records what --links watch adopts; add --links watch")
    if args.emulate is not None:
        try:
            args.emulate = emulated(Emulation.parse(args.emulate), args.links)
        except ValueError as exc:
            ap.error(f"--emulate {args.emulate}: {exc}")
        if args.links is None:
            args.links = str(args.emulate.degrade)  # the hook is told the emulated truth
    return args


def emulated(emu: Emulation, links: str | None) -> Emulation:
    """The emulation with its slow ranks made explicit: its own ``degrade=``, else
    ``--links`` (unless ``probe``/``watch``, which learn them), else none."""
    if emu.degrade is not None:
        return emu
    learn = str(links or "").strip().lower() in ("", "probe", "watch")
    return Emulation(emu.bw, emu.latency, Links() if learn else Links.parse(links))


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


# -- the job: who we are, and the process group -------------------------------------------------
def start_process_group(device: str) -> torch.device:
    """Start torch.distributed: from torch's variables under torchrun, from the MPI ranks
    under an MPI launcher. Returns this rank's device."""
    backend = "nccl" if device == "cuda" else "gloo"
    mpi = any(k in os.environ for k in MPI_VARIABLES)
    if not mpi and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)  # torchrun (or srun with torch's variables)
    else:
        ot.init_process_group_from_mpi(backend)  # mpiexec / srun: ranks from MPI
    if device == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


# -- the data and the model ---------------------------------------------------------------------
def load_data(kind: str | None, seed: int) -> tuple[torch.Tensor, ...]:
    """Training and test images (N x 1 x 8 x 8, scaled to [0, 1]) and labels: the same
    split on every rank."""
    if kind in (None, "digits"):
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            if kind == "digits":
                raise SystemExit(
                    "--data digits needs scikit-learn (pip install 'optcc-mpi[sklearn]'); "
                    "or pass --data synthetic"
                ) from None
            kind = "synthetic"
    if kind == "synthetic":
        g = torch.Generator().manual_seed(seed + 7)
        templates = torch.rand(10, 64, generator=g)
        y = torch.randint(0, 10, (1800,), generator=g)
        x = (templates[y] + 0.35 * torch.randn(1800, 64, generator=g)).clamp(0, 1)
    else:
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order].reshape(-1, 1, 8, 8), y[order]
    n_test = len(y) // 5
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def make_model(seed: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same start on every rank (DDP also broadcasts rank 0's)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(64 * 4 * 4, 96),
        torch.nn.ReLU(),
        torch.nn.Linear(96, 10),
    ).to(device=device, dtype=dtype)


# -- training -----------------------------------------------------------------------------------
def train(
    args: argparse.Namespace, data: tuple[torch.Tensor, ...], hook: object, verbose: bool
) -> tuple[torch.Tensor, float, list[float]]:
    """Train for ``args.epochs``; the final parameters as one float64 vector, the
    accuracy on the test images (every rank evaluates its share; the counts are summed),
    and every step's time on the slowest rank."""
    rank, p = dist.get_rank(), dist.get_world_size()
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    x_train, y_train, x_test, y_test = data
    # This rank's shard of the training images.
    xs, ys = x_train[rank::p].to(device, dtype), y_train[rank::p].to(device)
    model = torch.nn.parallel.DistributedDataParallel(
        make_model(args.seed, dtype, device), bucket_cap_mb=args.bucket_mb
    )
    if hook is not None:
        model.register_comm_hook(state=None, hook=hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Every rank the same number of steps (DDP needs it): the smallest shard's.
    steps = _min_over_ranks(len(ys) // args.batch, device)
    if verbose and rank == 0:
        n_params = sum(q.numel() for q in model.parameters())
        print(
            f"# {p} ranks, {n_params} parameters ({args.dtype}), {len(y_train)} training "
            f"images, batch {args.batch} per rank, {steps} steps per epoch",
            flush=True,
        )
        print(f"{'epoch':>5} {'loss':>10} {'ms/step':>8}  allreduce (last bucket)", flush=True)
    times = []
    for epoch in range(args.epochs):
        for step in range(steps):
            lo = step * args.batch
            xb, yb = xs[lo : lo + args.batch], ys[lo : lo + args.batch]
            dist.barrier()  # every rank starts the step together: its time is the step's
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(xb).float(), yb)
            opt.zero_grad()
            loss.backward()  # the hook averages the gradient buckets here
            opt.step()
            dt = time.perf_counter() - t0
            times.append(dt)
            if step == steps - 1:
                # What the hook ran for the last bucket (read before the next call).
                st = collectives.last_stats() if hook is not None else {}
                used = f"{st['algorithm']}, links {st['links']}" if st else "DDP's own"
                # The loss every rank saw, averaged over the ranks (float64, one element).
                mean = ot.allreduce(loss.detach().double().reshape(1), average=True)
                if verbose and rank == 0:
                    print(f"{epoch:>5} {mean.item():>10.4f} {dt * 1e3:>8.1f}  {used}", flush=True)
    with torch.no_grad():
        xt, yt = x_test[rank::p].to(device, dtype), y_test[rank::p].to(device)
        right = (model(xt).argmax(dim=1) == yt).sum().double().reshape(1)
        counts = ot.allreduce(torch.cat([right, torch.tensor([float(len(yt))], device=device)]))
    params = torch.cat([q.detach().reshape(-1).double().cpu() for q in model.parameters()])
    slowest = ot.allreduce(torch.tensor(times, dtype=torch.float64), op="max")
    return params, (counts[0] / counts[1]).item(), slowest.tolist()


def _min_over_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    return int(ot.allreduce(t, op="min").item())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start_process_group(args.device)
    rank = dist.get_rank()
    if args.emulate is not None:
        config.rc.emulate = str(args.emulate)  # every AllReduce of this process, paced
    try:
        # The hook checks its arguments now (on every rank alike), before any training.
        hook = ot.comm_hook(algorithm=args.algorithm, links=args.links, links_log=args.links_log)
        data = load_data(args.data, args.seed)
        ours, accuracy, our_times = train(args, data, hook, verbose=True)
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, zlib.crc32(ours.numpy().tobytes()))
        same = len(set(digests)) == 1
        if rank == 0:
            print(f"# test accuracy: {accuracy:.3f}", flush=True)
            print(f"# parameters identical on all {len(digests)} ranks: {same}", flush=True)
        if args.compare:
            # Under emulation DDP's own gloo traffic would not be paced: the ring through
            # the same hook on the same virtual NICs stands for it (the module docstring).
            plain = None if args.emulate is None else ot.comm_hook("ring", links=args.links)
            name = "DDP's own all-reduce" if plain is None else "the ring, emulated like it"
            theirs, acc, their_times = train(args, data, plain, verbose=False)
            gap = (ours - theirs).abs().max().item()
            if rank == 0:
                a, b = median(our_times[1:]), median(their_times[1:])
                print(
                    f"# {name}: test accuracy {acc:.3f}; largest parameter gap to it "
                    f"{gap:.3g}\n# median step: optcc_mpi's hook {a * 1e3:.1f} ms, {name} "
                    f"{b * 1e3:.1f} ms: {a / b:.2f}x",
                    flush=True,
                )
        return 0 if same else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
