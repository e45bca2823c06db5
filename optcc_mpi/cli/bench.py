"""``optcc-mpi bench``: the AllReduce benchmark (nccl-tests style), under mpiexec, srun or
torchrun, over MPI or torch.distributed's gloo."""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Any

from optcc_mpi import algorithms, transports
from optcc_mpi.argtypes import (
    duration_arg,
    emulation_arg,
    float_above,
    int_at_least,
    links_or_probe_arg,
    positive_size_arg,
    rate_arg,
)
from optcc_mpi.dtypes import DTYPES
from optcc_mpi.lab import bench, world

#: Element types and reductions the benchmark's exact check covers (lab.bench._inputs).
BENCH_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
BENCH_OPS = ("sum", "max", "min")

EPILOG = """\
Run it under mpiexec, srun, torchrun or `optcc-mpi testbed run`: started alone (1 rank) it
says so and exits with status 2, unless --allow-single. The algorithms run over MPI
(--transport mpi, the default under an MPI launcher) or over a torch.distributed process
group on gloo (--transport gloo, the default under torchrun; under mpiexec the group is
started from the MPI ranks), where the row `gloo` is gloo's own all_reduce on the same
buffers. For every size it first times the
ring with every link healthy (the fault-free reference: under --emulate the degradation is
dropped, on the testbed the shaping is switched off for that part), then each algorithm
on the degraded network. Rows: nccl-tests' columns (busbw with the 2(p-1)/p factor for
every algorithm, #wrong summed over ranks), the ratio to the fault-free ring measured in
this run, and the modelled time and lower bound (given --bw, the emulated rate, or the
testbed's rate). Exit status 1 if any result is wrong.

examples:
  # software emulation: 200 MB/s virtual NICs, 20 us per message, rank 0 at half rate
  mpiexec -n 8 optcc-mpi bench -b 1M -e 16M -f 2 --links 0:0.5 --emulate bw=200MB/s,latency=20us

  # real shaping on this machine (as root): 400 Mbit/s links, rank 0 at 200 Mbit/s
  optcc-mpi testbed up --ranks 8 --rate 400mbit --degrade 0:0.5
  optcc-mpi testbed run -- optcc-mpi bench -b 16M -e 64M -f 2 -n 3 --out tb.jsonl

  # where the bubbles are: per-rank busy fractions, traces and the slow rank's timeline
  optcc-mpi testbed run -- optcc-mpi bench -b 32M -e 32M --algorithms optcc --trace tb-trace

  # let the probe find the slow rank, and keep the results
  mpiexec -n 8 optcc-mpi bench --links probe --emulate bw=100MB/s,degrade=3:0.5 --out r.csv

  # over torch.distributed (gloo): PyTorch's launcher, no MPI needed; gloo's all_reduce beside
  torchrun --standalone --nproc-per-node 4 -m optcc_mpi bench --links 0:0.5 \
      --emulate bw=100MB/s -b 4M -e 16M --algorithms ring,optcc,gloo
  optcc-mpi testbed run -- optcc-mpi bench --transport gloo -b 32M -e 64M -n 5
"""


def check_args(args: argparse.Namespace) -> None:
    """Checks that involve several arguments (each alone was checked by its type);
    ValueError naming what the user typed. Runs before MPI is touched."""
    itemsize = DTYPES[args.dtype].itemsize
    for flag, value in (("-b/--begin", args.begin), ("-e/--end", args.end)):
        if value < itemsize:
            raise ValueError(
                f"{flag} {value} bytes is less than one {args.dtype} element "
                f"({itemsize} bytes): nothing to reduce"
            )
    if args.end < args.begin:
        raise ValueError(f"-e/--end {args.end} is smaller than -b/--begin {args.begin}")
    if args.begin != args.end and args.factor <= 1:
        raise ValueError(f"-f/--factor {args.factor:g} must be above 1 to step from -b to -e")


def default_algorithms(transport: str) -> list[str]:
    """Every registered algorithm and ``auto``; over gloo also gloo's own all_reduce."""
    return [*algorithms.names(), "auto", *(["gloo"] if transport == "gloo" else [])]


def run(args: argparse.Namespace) -> int:
    check_args(args)
    transport = args.transport or world.default_transport()
    comm, started = world.start(transport)
    ctrl = transports.of(comm)
    if ctrl.size == 1 and not args.allow_single:
        # Not an error of the arguments: nothing was started to run with. One rank moves no
        # data, so every time and ratio it would print measures only the Python overhead.
        raise ValueError(
            "1 rank: started without a launcher (or with -n 1), so "
            "there is nothing to reduce across and the table would measure only overhead. "
            "Run it under a launcher, e.g. `mpiexec -n 4 optcc-mpi bench`, `torchrun "
            "--nproc-per-node 4 -m optcc_mpi bench`, `srun`, or "
            "`optcc-mpi testbed run -- python -m optcc_mpi bench`; or pass --allow-single "
            "for a one-rank smoke test"
        )
    cfg = bench.BenchConfig(
        sizes=bench.sizes(args.begin, args.end, args.factor),
        algorithms=args.algorithms or default_algorithms(transport),
        iters=args.iters,
        warmup=args.warmup,
        dtype=args.dtype,
        op=args.op,
        links=args.links,
        emulate=args.emulate,
        bw=args.bw,
        reference=not args.no_reference,
        command="optcc-mpi " + " ".join(sys.argv[1:]),
        trace=args.trace,
        latency=args.latency,
        efficiency=args.efficiency,
        transport=transport,
    )
    rows = bench.run(cfg, comm)
    if ctrl.rank == 0:
        net = rows[0]["network"] if rows else "-"
        print(
            f"# optcc-mpi bench: {ctrl.size} ranks over {ctrl.describe()}, {cfg.dtype} "
            f"{cfg.op}, network: {net}, links: {rows[-1]['links'] if rows else '-'}"
            + (f", emulate: {cfg.emulate}" if cfg.emulate else "")
        )
        print(bench.rows_table(rows))
        for note in bench.notes(rows):
            print(
                textwrap.fill(
                    note, 96, initial_indent="# note: ", subsequent_indent="#   ",
                    break_on_hyphens=False,
                )
            )  # fmt: skip
        wrong = sum(r["wrong"] for r in rows)
        print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        if args.trace:
            print(
                f"# busy fractions of rank {rows[0].get('busy_rank', 0) if rows else 0} "
                f"(all ranks in the JSON rows); traces and timelines in {args.trace}/"
            )
        if args.out:
            bench.write(rows, args.out)
            print(f"# wrote {len(rows)} rows to {args.out}")
        sys.stdout.flush()
    world.end(started)
    return 1 if any(r["wrong"] for r in rows) else 0


def _algorithms_arg(text: str) -> list[str]:
    """argparse type: registered algorithm names, ``auto`` and ``gloo``."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    every = [*algorithms.names(), "auto", "gloo"]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected algorithm names")
    for name in names:
        if name not in every:
            raise argparse.ArgumentTypeError(
                f"unknown algorithm {name!r} in {text!r}; choose from {','.join(every)}"
            )
    return names


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="AllReduce benchmark in the style of nccl-tests (run under mpiexec/srun)",
        description="Time every requested algorithm for each message size against the "
        "fault-free ring measured in the same run, check every result, and report "
        "nccl-tests' columns plus the modelled time and the lower bound.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-b", "--begin", type=positive_size_arg, default=1 << 20, help="smallest size (1M)"
    )
    p.add_argument(
        "-e", "--end", type=positive_size_arg, default=16 << 20, help="largest size (16M)"
    )
    p.add_argument(
        "-f",
        "--factor",
        type=float_above(0.0, "the size step factor"),
        default=2.0,
        help="size step factor, above 1 unless -b equals -e (2)",
    )
    p.add_argument(
        "-n",
        "--iters",
        type=int_at_least(1, "timed iterations"),
        default=5,
        help="timed iterations (5)",
    )
    p.add_argument(
        "-w",
        "--warmup",
        type=int_at_least(0, "warm-up iterations"),
        default=1,
        help="warm-up iterations (1)",
    )
    p.add_argument(
        "-d",
        "--dtype",
        choices=BENCH_DTYPES,
        default="float32",
        help="element type of the buffers (float32); the sizes are in bytes, so -b and -e "
        "must hold at least one element",
    )
    p.add_argument(
        "-o",
        "--op",
        choices=BENCH_OPS,
        default="sum",
        help="reduction (sum); every result is checked exactly against it",
    )
    every = [*algorithms.names(), "auto"]
    p.add_argument(
        "--transport",
        choices=("mpi", "gloo"),
        default=None,
        help="what the algorithms run over: mpi (MPI point-to-point; the default under "
        "mpiexec/srun) or gloo (a torch.distributed process group on gloo, CPU tensors; "
        "the default under torchrun, started from the MPI ranks under mpiexec)",
    )
    p.add_argument(
        "--algorithms",
        type=_algorithms_arg,
        default=None,
        help=f"comma-separated from {','.join(every)},gloo (default: all; gloo, "
        "torch.distributed's own all_reduce called directly, is in the default with "
        "--transport gloo; with --transport mpi it runs over a gloo group started from the "
        "MPI ranks, when torch is installed)",
    )
    p.add_argument(
        "--links",
        type=links_or_probe_arg,
        default=None,
        metavar="RANK:FRACTION[,...]|probe",
        help="degraded ranks, or 'probe' to measure them; default $OPTCC_LINKS, "
        "or the testbed's shaping",
    )
    p.add_argument(
        "--emulate",
        type=emulation_arg,
        default=None,
        metavar="bw=RATE,latency=TIME[,degrade=...]",
        help="software link emulation (the --links ranks are slowed)",
    )
    p.add_argument(
        "--bw",
        type=rate_arg,
        default=None,
        help="healthy link rate for the model columns (default: from the emulation or the testbed)",
    )
    p.add_argument("--no-reference", action="store_true", help="skip the fault-free ring reference")
    p.add_argument(
        "--trace",
        nargs="?",
        const="trace",
        default=None,
        metavar="DIR",
        help="report, for the last iteration of every row, the fraction of the run each "
        "rank's send and receive sides were busy (from the executor's timestamps; "
        "docs/bench.md defines busy), and write per-message traces and a timeline PNG of "
        "the degraded rank to DIR (default ./trace)",
    )
    p.add_argument(
        "--latency",
        type=duration_arg,
        default=None,
        help="per-message cost for the model column (default: the emulated latency, else 0)",
    )
    p.add_argument(
        "--efficiency",
        type=float,
        default=1.0,
        help="fraction of the nominal rate the transport delivers, for the model column "
        "(measure it: the fault-free ring's model / its time); rows also give the bound at "
        "that delivered rate (bound_delivered_us)",
    )
    p.add_argument("--out", help="write rows as JSON lines (CSV if the name ends in .csv)")
    p.add_argument(
        "--allow-single",
        action="store_true",
        help="run on 1 rank too (a smoke test: one rank reduces nothing, so the times and "
        "ratios mean nothing); without it, 1 rank is refused with exit status 2",
    )
    p.set_defaults(func=run)
