"""A DDP training step with optcc_mpi's communication hook against plain DDP, side by side.

Run on every rank of a job, launched by ``torchrun``, ``mpiexec`` or ``optcc-mpi testbed
run`` (the gloo process group is started from whichever launched it,
:mod:`optcc_mpi.lab.world`)::

    torchrun --standalone --nproc-per-node 4 -m optcc_mpi lab ddp --links 0:0.5
    optcc-mpi testbed run -- python -m optcc_mpi lab ddp --out ddp.jsonl

Two copies of one model (an MLP of ``--layers`` hidden layers of ``--width``; the
defaults give 10.35 M parameters, 41 MB of float32 gradients) start from the same
weights and train on the same per-rank data with SGD and momentum, each wrapped in
``DistributedDataParallel`` with ``--bucket-mb`` buckets over the default process group:

``hook``
    gradients averaged by :func:`optcc_mpi.torch.comm_hook` (``--algorithm``, ``--links``;
    on the testbed the links default to its shaping, as ``optcc-mpi bench`` does);
``backend`` (``--backend``, in place of ``hook``)
    DDP with no hook on a process group of the ``optcc`` backend
    (:mod:`optcc_mpi.torch.process_group`; ``--algorithm`` and ``--links`` are its options):
    what any framework's all-reduce reaches, overlapped with the backward pass;
``ddp``
    DDP's own averaging (gloo's ``all_reduce``, overlapped with the backward pass);
``backend told`` (``--told``, with ``--backend`` and ``--links watch``)
    the same backend told the true profile (the testbed's shaping, the emulation's
    ``degrade=``, else ``$OPTCC_LINKS``): what learning the links costs, step for step.

Their steps alternate (hook, ddp, then ddp, hook, ...), so that both see the same machine
and network, and every step is timed from a barrier to the end of ``optimizer.step()``
on the slowest rank. The first ``--skip`` steps of each (one-time setup: the plans, gloo's
connections) are left out of the times. After ``--steps`` steps the parameters of the
two must agree within ``--rtol`` (largest difference over largest parameter), and each
model's parameters must be the same bits on every rank; exit status 1 otherwise.

``--fault-free`` also times plain DDP with every link healthy (the testbed's shaping
switched off for those steps), the reference a degraded link is judged against.

``--emulate bw=RATE[,latency=TIME][,degrade=RANK:FRACTION]`` runs on software-emulated
links instead (:mod:`optcc_mpi.emulation`; one machine, no root): every rank a virtual
NIC of that rate, the slow ranks those of ``degrade=`` (else of ``--links``), and the
hook is told them (``--links`` defaults to them, as to the testbed's shaping). Plain
DDP's gloo traffic cannot be paced by the emulation, so there ``ddp`` is DDP averaging
its buckets with the **ring** through the same hook, on the same virtual NICs: the ring
is what gloo's ``all_reduce`` runs, and like it the ring waits at every step for the
slowest link. Both copies then pay the same emulated network and differ only in the
algorithm (docs/testbed.md compares this with the testbed on the same profile).
``ddp fault-free`` is that ring with every virtual NIC healthy.

Output: a table on rank 0 and, with ``--out``, one JSON object per mode: median, minimum
and maximum step time, the steps, the parameters and buckets, what the hook ran, the
parameter gap, the load average before and after, and the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import zlib
from collections import Counter
from typing import Any

from optcc_mpi import algorithms, config, transports
from optcc_mpi.argtypes import emulation_arg, float_above, int_at_least, links_learnt_arg
from optcc_mpi.collectives import last_stats
from optcc_mpi.emulation import Emulation
from optcc_mpi.errors import ArgumentError
from optcc_mpi.lab import testbed, world
from optcc_mpi.lab.provenance import load_average
from optcc_mpi.lab.tools import append_rows, tool_main
from optcc_mpi.links import Links

__all__ = ["add_arguments", "run_args", "main", "SUMMARY", "measure"]

#: What ``optcc-mpi lab --help`` says of this tool.
SUMMARY = "DDP training steps with the optcc_mpi hook against plain DDP (gloo), side by side"

IN_FEATURES = 64
#: The row of the copy told the true profile (``--told``).
TOLD = "backend told"


def _model(width: int, layers: int, seed: int) -> Any:
    import torch

    torch.manual_seed(seed)  # the same start on every rank and for both copies
    mods: list[Any] = [torch.nn.Linear(IN_FEATURES, width), torch.nn.Tanh()]
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    mods.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*mods)


class _Copy:
    """One DDP copy of the model, its optimiser and its per-rank data stream; under
    emulation, the emulated network its averaging runs on (``emulate``: the spec that
    ``$OPTCC_EMULATE`` holds during its steps)."""

    def __init__(
        self,
        args: argparse.Namespace,
        rank: int,
        hook: Any,
        emulate: str | None = None,
        group: Any = None,
        record: dict[str, Any] | None = None,
    ) -> None:
        import torch

        self.torch = torch
        self.emulate = emulate
        self.model = torch.nn.parallel.DistributedDataParallel(
            _model(args.width, args.layers, args.seed),
            bucket_cap_mb=args.bucket_mb,
            process_group=group,
        )
        # A copy on the optcc backend has no hook to watch: what its last bucket ran is
        # read after each step.
        self.record = record
        if hook is not None:
            self.model.register_comm_hook(state=None, hook=hook)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.gen = torch.Generator().manual_seed(1000 + rank)
        self.batch = args.batch
        self.times: list[float] = []

    def step(self) -> None:
        torch = self.torch
        x = torch.randn(self.batch, IN_FEATURES, generator=self.gen)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()  # the buckets are averaged here (by the hook, or by DDP)
        self.opt.step()
        if self.record is not None:
            st = last_stats()
            self.record["ran"] = [str(st.get("algorithm"))]
            self.record["links"] = str(st.get("links"))
            emu = st.get("emulate")
            self.record["emulate"] = str(emu) if emu is not None else None

    def parameters(self) -> Any:
        torch = self.torch
        return torch.cat([q.detach().reshape(-1).double() for q in self.model.parameters()])


def _emulated(emulate: Emulation | None, given: Any) -> Emulation | None:
    """The emulated network with its truth made explicit: ``degrade=`` as given, else
    the ``--links`` profile (not ``probe``/``watch``, which learn; then every virtual NIC
    is healthy unless ``degrade=`` says otherwise)."""
    if emulate is None or emulate.degrade is not None:
        return emulate
    learn = isinstance(given, str) and given.strip().lower() in ("probe", "watch")
    truth = Links() if given is None or learn else Links.coerce(given)
    return dataclasses.replace(emulate, degrade=truth)


def _links_for(given: Any, emulate: Emulation | None = None) -> Any:
    """The hook's link profile: as given, else the emulated truth or the testbed's
    shaping in force, else None (``$OPTCC_LINKS``)."""
    if given is not None:
        return given
    if emulate is not None and emulate.degrade is not None:
        return str(emulate.degrade)
    if config.get("OPTCC_TESTBED_NAME"):
        bed = testbed.current()
        if bed is not None:
            return str(Links(dict(bed.degrade)))
    return None


def measure(args: argparse.Namespace, group: Any) -> list[dict[str, Any]]:
    """Train both copies over ``group`` (collective); the rows, on every rank."""
    import torch

    import optcc_mpi.torch as ot

    torch.set_num_threads(args.threads)
    wire = transports.of(group)
    rank, p = wire.rank, wire.size
    emu = _emulated(getattr(args, "emulate", None), args.links)
    links = _links_for(args.links, emu)
    spec = str(emu) if emu is not None else None
    first = "backend" if args.backend else "hook"
    if args.backend:
        import torch.distributed as dist

        # DDP with no hook on an optcc group: the backend's all_reduce, overlapped with
        # the backward pass as DDP overlaps any library's.
        seen: dict[str, Any] = {"ran": [], "links": "-", "emulate": None}
        group_optcc = dist.new_group(
            backend="optcc", pg_options=ot.OptccOptions(algorithm=args.algorithm, links=links)
        )
        ours = _Copy(args, rank, None, spec, group=group_optcc, record=seen)
    else:
        hook, seen = _recorded(ot.comm_hook(algorithm=args.algorithm, links=links))
        ours = _Copy(args, rank, hook, spec)
    # Under emulation the baseline averages with the ring on the same virtual NICs (gloo's
    # own traffic cannot be paced): the module docstring says why that is fair.
    plain, plain_seen = (
        (None, None)
        if emu is None
        else _recorded(ot.comm_hook(algorithm="ring", links=str(emu.degrade)))
    )
    trainers = {first: ours, "ddp": _Copy(args, rank, plain, spec)}
    records = {first: seen, "ddp": plain_seen}
    if getattr(args, "told", False):
        import torch.distributed as dist

        # The same backend told the truth the watch has to learn: what learning costs.
        truth = _links_for(None, emu)
        told_seen: dict[str, Any] = {"ran": [], "links": "-", "emulate": None}
        group_told = dist.new_group(
            backend="optcc", pg_options=ot.OptccOptions(algorithm=args.algorithm, links=truth)
        )
        trainers[TOLD] = _Copy(args, rank, None, spec, group=group_told, record=told_seen)
        records[TOLD] = told_seen
    bed = testbed.current() if config.get("OPTCC_TESTBED_NAME") else None
    healthy: _Copy | None = None
    if args.fault_free:
        if emu is None:
            healthy = _Copy(args, rank, None)
        else:
            fine = dataclasses.replace(emu, degrade=Links())
            ring, records["ddp fault-free"] = _recorded(
                ot.comm_hook(algorithm="ring", links="healthy")
            )
            healthy = _Copy(args, rank, ring, str(fine))
    load0 = load_average()
    order = list(trainers)
    for step in range(args.steps):
        for name in order if step % 2 == 0 else order[::-1]:
            _timed_step(wire, trainers[name], step >= args.skip)
    if healthy is not None:
        # Plain DDP with every link healthy: the shaping off for these steps only.
        if bed is not None and rank == 0:
            testbed.set_shaping(None)
        wire.barrier()
        for step in range(args.steps):
            _timed_step(wire, healthy, step >= args.skip)
        if bed is not None and rank == 0:
            testbed.set_shaping(dict(bed.degrade))
        wire.barrier()
    params = [tr.parameters() for tr in trainers.values()]
    ours_p, theirs = params[0], params[1]
    scale = theirs.abs().max().item()
    # Every copy of ours against plain DDP's: the largest gap.
    gap = max((q - theirs).abs().max().item() for i, q in enumerate(params) if i != 1)
    digests = wire.allgather([zlib.crc32(t.numpy().tobytes()) for t in params])
    identical = {name: len({d[i] for d in digests}) == 1 for i, name in enumerate(trainers)}
    # Every rank judges from the same gathered numbers: the worst rank's gap.
    rel = max(wire.allgather(gap / scale if scale > 0 else gap))
    n_params = ours_p.numel()
    buckets = len(seen["ran"]) if not args.backend else _buckets(ours.model)
    load1 = load_average()
    command = args.command_line
    rows = []
    network = "testbed" if bed is not None else "emulation" if emu is not None else "none"
    baseline = "ring (the hook, emulated)" if emu is not None else "gloo all_reduce"
    for name, tr in [*trainers.items(), *([("ddp fault-free", healthy)] if healthy else [])]:
        t = tr.times
        rows.append(
            {
                "mode": name,
                "step_ms": statistics.median(t) * 1e3,
                "step_min_ms": min(t) * 1e3,
                "step_max_ms": max(t) * 1e3,
                "steps": args.steps,
                "timed_steps": len(t),
                "p": p,
                "params": n_params,
                "bucket_mb": args.bucket_mb,
                "buckets": buckets,
                "batch": args.batch,
                "algorithm": args.algorithm if name in (first, TOLD) else baseline,
                "ran": dict(Counter(records[name]["ran"])) if records.get(name) else None,
                "links": "healthy"
                if name == "ddp fault-free"
                else (records[name] if name == TOLD else seen)["links"],
                "network": network,
                "emulate": tr.emulate,
                # The emulation the last averaging call of this copy ran on (its pacer's).
                "paced": records[name]["emulate"] if records.get(name) else None,
                "testbed": bed.describe() if bed is not None else None,
                "rel_gap": rel,
                "rtol": args.rtol,
                "identical": identical.get(name, identical.get(name.split()[0])),
                "load": [load0, load1],
                "command": command,
            }
        )
    return rows


def _buckets(model: Any) -> int:
    """How many gradient buckets DDP made for ``model`` (its reducer's buckets, as zeros:
    a copy of the gradients' size, once)."""
    return len(model.reducer._get_zeros_like_grad_buckets())


def _recorded(inner: Any) -> tuple[Any, dict[str, Any]]:
    """``inner`` (a DDP communication hook of optcc_mpi) and what its calls ran, kept in
    the returned dict: ``ran`` (the algorithm of each bucket of the last step),
    ``links`` and ``emulate`` (those of its last call)."""
    seen: dict[str, Any] = {"ran": [], "links": "-", "emulate": None}

    def hook(state: Any, bucket: Any) -> Any:
        if bucket.index() == 0:
            seen["ran"].clear()

        def note(done: Any) -> Any:
            # Run where the bucket's reduction completed (the group's thread, after the
            # call; or here, for a hook that reduced before returning): its record.
            st = last_stats()
            seen["ran"].append(str(st.get("algorithm")))
            seen["links"] = str(st.get("links"))
            emu = st.get("emulate")
            seen["emulate"] = str(emu) if emu is not None else None
            return done.value()

        return inner(state, bucket).then(note)

    # DDP reads the hook's annotations; keep the inner hook's real objects.
    hook.__annotations__ = dict(inner.__annotations__)
    return hook, seen


def _timed_step(wire: Any, tr: _Copy, keep: bool) -> None:
    """One step of ``tr`` from a barrier, timed on the slowest rank (under emulation on
    its emulated network, set for this step only)."""
    if tr.emulate is not None:
        before = config.get("OPTCC_EMULATE")
        config.rc.emulate = tr.emulate
    wire.barrier()
    t0 = time.perf_counter()
    try:
        tr.step()
    finally:
        if tr.emulate is not None:
            config.rc.emulate = before
    dt = max(wire.allgather(time.perf_counter() - t0))
    if keep:
        tr.times.append(dt)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``optcc-mpi lab ddp`` (and ``python -m optcc_mpi.lab.ddp``)."""
    parser.description = (
        "DDP training steps with optcc_mpi's communication hook against plain DDP (gloo's "
        "all_reduce), alternating step by step on the same data; the parameters of both "
        "compared at the end (run under torchrun, mpiexec or the testbed). Exit status 1 "
        "if they differ by more than --rtol or differ between ranks."
    )
    parser.epilog = (
        "examples:\n"
        "  torchrun --standalone --nproc-per-node 4 -m optcc_mpi lab ddp --links 0:0.5 "
        "--steps 5\n"
        "  optcc-mpi testbed up --ranks 4 --rate 400mbit --links 0:0.5\n"
        "  optcc-mpi testbed run -- python -m optcc_mpi lab ddp --fault-free --out ddp.jsonl\n"
        "  mpiexec -n 2 python -m optcc_mpi lab ddp --width 256 --layers 2 --steps 5\n"
        "  # no root, one machine: 100 MB/s virtual NICs, rank 0 at half rate\n"
        "  torchrun --standalone --nproc-per-node 4 -m optcc_mpi lab ddp "
        "--emulate bw=100MB/s,degrade=0:0.5 --width 1024 --steps 6"
    )
    parser.add_argument(
        "--width", type=int_at_least(1, "the width"), default=1600, help="hidden width (1600)"
    )
    parser.add_argument(
        "--layers",
        type=int_at_least(1, "hidden layers"),
        default=4,
        help="hidden width x width layers (4: with --width 1600, 10.35 M parameters)",
    )
    parser.add_argument(
        "--bucket-mb", type=float_above(0.0, "the bucket size"), default=25.0, help="DDP's "
        "bucket_cap_mb (25)",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=int_at_least(1, "steps"), default=20, help="steps of each copy (20)"
    )
    parser.add_argument(
        "--skip",
        type=int_at_least(0, "skipped steps"),
        default=1,
        help="first steps of each copy left out of the times (1)",
    )
    parser.add_argument(
        "--batch", type=int_at_least(1, "the batch"), default=16, help="samples per rank (16)"
    )
    parser.add_argument(
        "--lr", type=float_above(0.0, "the learning rate"), default=0.01, help="SGD lr (0.01)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights (0)")
    parser.add_argument(
        "--algorithm",
        default="auto",
        choices=("auto", *algorithms.names()),
        help="the hook's algorithm (auto)",
    )
    parser.add_argument(
        "--links",
        type=links_learnt_arg,
        default=None,
        metavar="RANK:FRACTION[,...]|probe|watch",
        help="the hook's (or the backend's) link profile, or probe/watch to learn it; "
        "default the testbed's shaping, else $OPTCC_LINKS",
    )
    parser.add_argument(
        "--emulate",
        type=emulation_arg,
        default=None,
        metavar="bw=RATE[,latency=TIME][,degrade=RANK:FRACTION]",
        help="software-emulated links (no root): the slow ranks of degrade= (else of "
        "--links), which the hook is told; then 'ddp' averages with the ring through the "
        "same hook on the same virtual NICs (what gloo's all_reduce runs; gloo's own "
        "traffic cannot be paced)",
    )
    parser.add_argument(
        "--backend",
        action="store_true",
        help="train our copy with DDP and no hook on a process group of the 'optcc' "
        "torch.distributed backend (--algorithm and --links its options) instead of the "
        "hook; the row is 'backend'",
    )
    parser.add_argument(
        "--told",
        action="store_true",
        help="with --backend and --links watch (or probe): also train a copy on an optcc "
        "group told the true profile (the testbed's shaping, the emulation's degrade=, "
        "else $OPTCC_LINKS), stepped in turn with the others; its row is 'backend told' "
        "and the table gives every copy against it (what learning the links costs)",
    )
    parser.add_argument(
        "--fault-free",
        action="store_true",
        help="also time plain DDP with every link healthy (on the testbed: shaping off; "
        "under --emulate: the ring on healthy virtual NICs)",
    )
    parser.add_argument(
        "--rtol",
        type=float_above(0.0, "the tolerance"),
        default=1e-6,
        help="largest parameter gap allowed, relative to the largest parameter (1e-6)",
    )
    parser.add_argument(
        "--threads", type=int_at_least(1, "threads"), default=1, help="torch threads (1)"
    )
    parser.add_argument("--out", help="append rows as JSON lines to this file")


def run_args(args: argparse.Namespace) -> int:
    """Run the tool on every rank; rank 0 prints (and writes ``--out``)."""
    if args.skip >= args.steps:
        raise ArgumentError(f"--skip {args.skip} leaves none of --steps {args.steps} timed")
    if args.told:
        learnt = isinstance(args.links, str) and args.links.strip().lower() in ("probe", "watch")
        if not (args.backend and learnt):
            raise ArgumentError(
                "--told compares a copy that learns its links with one told them: it needs "
                "--backend and --links watch (or probe)"
            )
        emu = _emulated(args.emulate, args.links)
        truth = _links_for(None, emu) or config.get("OPTCC_LINKS")
        if truth is None or str(truth).strip().lower() in ("probe", "watch"):
            raise ArgumentError(
                "--told: no true profile to tell (run on the testbed, give --emulate "
                "...,degrade=RANK:FRACTION, or set OPTCC_LINKS to a profile such as 0:0.5)"
            )
    group, started = world.torch_group()
    rows = measure(args, group)
    wire = transports.of(group)
    if wire.rank == 0:
        first = rows[0]
        print(
            f"# {args.command_line}\n# {first['p']} ranks, {first['params'] / 1e6:.2f} M "
            f"parameters, {first['buckets']} buckets of at most {args.bucket_mb:g} MB, "
            f"batch {args.batch}, links {first['links']}, network {first['network']}, "
            f"load {first['load'][0]:.1f} -> {first['load'][1]:.1f}"
        )
        if first["network"] == "emulation":
            print(
                f"# emulated: {first['emulate']}; 'ddp' averages with the ring on the same "
                "virtual NICs (gloo's all_reduce runs a ring; its own traffic cannot be paced)"
            )
        ref = next(r for r in rows if r["mode"] == "ddp")["step_ms"]
        told = next((r["step_ms"] for r in rows if r["mode"] == TOLD), None)
        extra = f" {'x told':>6}" if told else ""
        print(f"{'mode':<16} {'median ms':>10} {'min':>9} {'max':>9} {'x ddp':>6}{extra}  ran")
        for r in rows:
            ran = ", ".join(f"{k} x{v}" for k, v in (r["ran"] or {}).items())
            vs_told = f" {r['step_ms'] / told:>6.3f}" if told else ""
            print(
                f"{r['mode']:<16} {r['step_ms']:>10.1f} {r['step_min_ms']:>9.1f} "
                f"{r['step_max_ms']:>9.1f} {r['step_ms'] / ref:>6.2f}{vs_told}  {ran}  "
                f"links {r['links']}"
            )
        print(
            f"# parameters after {args.steps} steps: {first['mode']} vs ddp "
            f"{first['rel_gap']:.3g} relative (allowed {args.rtol:g}); identical on every "
            f"rank: {first['mode']} {rows[0]['identical']}, ddp {rows[1]['identical']}"
        )
        if args.out:
            append_rows(args.out, rows)
            print(f"# appended {len(rows)} rows to {args.out}")
        sys.stdout.flush()
    ok = rows[0]["rel_gap"] <= args.rtol and all(
        r["identical"] for r in rows if r["mode"] != "ddp fault-free"
    )
    world.end(started)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m optcc_mpi.lab.ddp``: the same as ``optcc-mpi lab ddp``."""
    return tool_main("optcc_mpi.lab.ddp", add_arguments, run_args, argv)


if __name__ == "__main__":
    sys.exit(main())
