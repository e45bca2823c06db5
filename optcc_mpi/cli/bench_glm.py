"""``optcc-mpi bench-glm``: time to fp32 SGD's loss for SGD, CA-SGD and scikit-learn.

The command's face only: options, their validation and the printing. The benchmark
itself is :mod:`optcc_mpi.lab.glm_bench`.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from optcc_mpi import glm
from optcc_mpi.glm.comm import Group
from optcc_mpi.lab import glm_bench, glm_defaults, glm_measure, glm_plots, glm_projection
from optcc_mpi.units import parse_duration, parse_rate

from ..errors import ArgumentError
from .train import _PARSERS, TRANSPORTS, command_line, report_errors_once

EPILOG = """\
what it measures:
  1. fp32 SGD (the reference) runs --epochs epochs; its final full training loss L is the
     target, reached when a run's loss is within --tolerance (0.5%) of it: loss <= L*(1+tol).
  2. CA-SGD runs for every s in --s and every recipe in --recipes, on the same sample
     sequence, recording its full loss every --eval-every steps (evaluations not timed).
  3. scikit-learn on rank 0 alone (SGDClassifier and LogisticRegression(lbfgs) for
     logistic, SGDRegressor, PoissonRegressor; same objective, no intercept).

the network (emulated, derived (ours)):
  every AllReduce of n bytes on P ranks is charged the modelled time of the library's own
  AllReduce (optcc_mpi.model.library_allreduce): the faster of recursive doubling,
  R(P) * (latency + n / bw) with R = log2 P (+2 if P is not a power of 2), and
  Rabenseifner's, 2 ceil(log2 P) * latency + 2 (P-1)/P * n / bw. The rank sleeps (never
  spins) until that deadline, so ranks sharing cores leave them to the ranks still
  computing; a sleep's overshoot shortens the next wait.

two clocks per run:
  t_wall   the run's own training time under the emulated network (machine load and
           rank oversubscription included);
  t_crit   critical path: per AllReduce, the slowest rank's CPU time since the previous
           one plus the charge. CPU time does not grow when ranks share cores, so this is
           the time with one core per rank and the modelled network.
  Speedups are medians of per-sweep ratios to fp32 SGD (--repeats sweeps).

--defaults (one process, the estimators' defaults):
  CASGDClassifier(), LogisticRegression() (lbfgs) and SGDClassifier(log_loss) on
  make_classification(--m, --n) standardised: the wall time of each one's fit, its
  max_iter doubled until its log loss is within --tolerance (use 0.01) of
  LogisticRegression's converged loss; also each full default fit. One BLAS thread.

--project (a PROJECTION, not a measurement):
  times one rank's compute between AllReduces on this machine for the ceil(n/P)
  columns it would hold at each P (strong scaling: the same problem split further),
  adds the modelled AllReduce, and reports speedup over fp32 SGD on one rank, assuming
  the same number of steps to the target (exact for fp32 CA-SGD).

examples:
  # measured: P = 8, 5 and 50 us per message, 25 GB/s links, recipe C
  mpiexec -n 8 optcc-mpi bench-glm --latency 5us,50us --bw 25GB/s --recipes C \\
      --s 8,16,32 --out bench_p8.jsonl

  # projected to P = 8..1024, with a plot
  optcc-mpi bench-glm --project --n 8192 --s 16,32 --latency 5us,50us --bw 25GB/s \\
      --plot projection.png --out projection.json

  # against scikit-learn on a larger problem, P = 2
  mpiexec -n 2 optcc-mpi bench-glm --m 1000000 --n 256 --s 16 --recipes C --repeats 1

  # the defaults against scikit-learn's on one process, 100k x 100, within 1%
  optcc-mpi bench-glm --defaults --m 100000 --n 100 --tolerance 0.01 --repeats 3

  # the same measurement under torchrun, over torch.distributed's gloo (CPU tensors); the
  # command as one string (torchrun's own parser would take --s, --m, --n for its options)
  torchrun --standalone --nproc-per-node 8 --no-python sh -c "optcc-mpi bench-glm \\
      --latency 50us --bw 25GB/s --recipes C --s 8,16,32 --no-sklearn"
"""


def register(subparsers: Any) -> None:
    """Add the ``bench-glm`` command."""
    p = subparsers.add_parser(
        "bench-glm",
        help="benchmark SGD vs CA-SGD and scikit-learn to the same loss (measured or projected)",
        description=(
            "Time to reach fp32 SGD's final training loss (within a tolerance) for SGD, "
            "CA-SGD over a sweep of s and precision recipes, and scikit-learn on one "
            "process, on synthetic data, under an emulated alpha-beta network (latency per "
            "message plus bytes over bandwidth). Run it under mpiexec at the size to "
            "measure, or with --project to project the measured compute to P = 8..1024."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        choices=("logistic", "linear", "poisson"),
        default="logistic",
        help="the GLM trained, and the synthetic labels drawn for it (default logistic)",
    )
    p.add_argument("--m", type=int, default=16384, help="rows of the synthetic set (default 16384)")
    p.add_argument("--n", type=int, default=256, help="features (default 256)")
    p.add_argument("--b", type=int, default=32, help="mini-batch size (default 32)")
    p.add_argument("--lr", type=float, default=0.5, help="step size (default 0.5)")
    p.add_argument("--lambda", dest="lam", type=float, default=0.0, help="L2 strength (default 0)")
    p.add_argument("--epochs", type=int, default=3, help="epochs of the reference run (default 3)")
    p.add_argument("--s", default="4,8,16,32", help="CA-SGD s values (default 4,8,16,32)")
    p.add_argument("--recipes", default="fp32,C", help="CA-SGD recipes (default fp32,C)")
    p.add_argument(
        "--latency",
        default="5us,50us",
        help="emulated latency per message, comma list (default 5us,50us; 0 for none)",
    )
    p.add_argument(
        "--bw",
        default="25GB/s",
        help="emulated link bandwidth, comma list (default 25GB/s; 'inf' for no "
        "bandwidth term). 1 GB = 10^9 bytes",
    )
    p.add_argument("--tolerance", type=float, default=0.005, help="relative loss tolerance (0.005)")
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="STEPS",
        help="loss records every STEPS steps (default: an eighth of an epoch, "
        "rounded to a multiple of the largest s)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="sweeps over all settings (default 3); medians of times and of paired speedups",
    )
    p.add_argument("--seed", type=int, default=0, help="data and sampling seed")
    p.add_argument("--no-sklearn", action="store_true", help="skip the scikit-learn baselines")
    p.add_argument(
        "--no-lbfgs", action="store_true", help="skip LogisticRegression(lbfgs) (logistic only)"
    )
    p.add_argument(
        "--defaults",
        action="store_true",
        help="one process: the estimators' defaults against LogisticRegression and "
        "SGDClassifier, time to within --tolerance of LogisticRegression's loss",
    )
    p.add_argument(
        "--project",
        action="store_true",
        help="projection mode: time one rank's compute here, apply the modelled AllReduce "
        "at each of --P (one process; no mpiexec needed)",
    )
    p.add_argument(
        "--P",
        dest="p_values",
        default="8,16,32,64,128,256,512,1024",
        help="ranks to project to (default 8,16,...,1024)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="with --project: speedup-vs-P plot")
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        help="what joins the ranks: mpi (default under mpiexec/srun), gloo (torch."
        "distributed, CPU tensors; default under torchrun) or nccl (CUDA tensors)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument(
        "--out", metavar="FILE", help="append one JSON line per run (--project: one document)"
    )
    p.set_defaults(func=run)
    _PARSERS["bench-glm"] = p


def _ints(text: str, flag: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ArgumentError(
            f"{flag} needs a comma list of integers, e.g. {flag} 8,16; got {text!r}"
        ) from None
    if not values or min(values) < minimum:
        raise ArgumentError(f"{flag} needs integers >= {minimum}; got {text!r}")
    return values


def _bandwidths(text: str) -> list[float | None]:

    out: list[float | None] = []
    for item in filter(None, (v.strip() for v in text.split(","))):
        if item.lower() in ("inf", "none"):
            out.append(None)
            continue
        bw = parse_rate(item)
        if not (bw > 0 and math.isfinite(bw)):
            raise ArgumentError(f"--bw {item!r} must be positive (or 'inf' for no term)")
        out.append(bw)
    if not out:
        raise ArgumentError("--bw needs at least one bandwidth, e.g. --bw 25GB/s")
    return out


def checked_options(args: argparse.Namespace) -> argparse.Namespace:
    """Check and parse the options; raises :class:`ArgumentError` with the fix."""
    for flag, value in (("--m", args.m), ("--n", args.n), ("--b", args.b)):
        if value < 1:
            raise ArgumentError(f"{flag} must be a positive integer, got {value}")
    if args.epochs < 1 or args.repeats < 1:
        raise ArgumentError("--epochs and --repeats must be >= 1")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ArgumentError(f"--lr must be a positive number, got {args.lr}")
    if not 0 < args.tolerance < 1:
        raise ArgumentError(f"--tolerance must be in (0, 1), got {args.tolerance}")
    if args.eval_every < 0:
        raise ArgumentError("--eval-every must be >= 0 (0: an eighth of an epoch)")
    args.s_values = _ints(args.s, "--s")
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if not args.recipes:
        raise ArgumentError("--recipes needs at least one recipe, e.g. --recipes C")
    for r in args.recipes:
        glm.get_recipe(r)
    args.latencies = [parse_duration(v) for v in args.latency.split(",") if v.strip()]
    if not args.latencies:
        raise ArgumentError("--latency needs at least one duration, e.g. --latency 50us")
    args.bws = _bandwidths(args.bw)
    args.p_values = _ints(args.p_values, "--P", minimum=2)
    if args.plot and not args.project:
        raise ArgumentError("--plot draws the projection: add --project")
    if args.defaults and args.project:
        raise ArgumentError("--defaults and --project are two different benchmarks: pick one")
    if not (args.project or args.defaults) and max(args.s_values) * args.b > args.m:
        raise ArgumentError(
            f"s * b = {max(args.s_values) * args.b} exceeds the {args.m} rows (--m): "
            "lower --s or --b, or raise --m"
        )
    args.verbose = not args.quiet
    return args


def run(args: argparse.Namespace) -> int:
    """Run ``optcc-mpi bench-glm``."""
    return report_errors_once("bench-glm", _bench, args)


def _bench(args: argparse.Namespace, comm: Any) -> int:
    group = Group(comm)
    # The command from the options as given: checked_options() turns the lists into values.
    command = command_line(args, group.size)
    checked_options(args)
    if args.project:
        return _project(args, group, command)
    if args.defaults:
        return _defaults(args, group, command)
    rows = glm_bench.run_bench(args, comm, command)
    if group.rank == 0:
        print(glm_bench.format_table(rows))
        if args.out:
            glm_bench.write_rows(rows, args.out)
            print(f"appended {len(rows)} lines to {args.out}")
    return 0


def _defaults(args: argparse.Namespace, group: Group, command: str) -> int:
    if group.rank:
        return 0  # one process measures; the others have nothing to do
    rows = glm_defaults.run_defaults_bench(
        args.m,
        args.n,
        seed=args.seed,
        tolerance=args.tolerance,
        repeats=args.repeats,
        command=command,
        say=None if args.quiet else lambda msg: print(msg, flush=True),
    )
    print(glm_defaults.format_defaults(rows))
    if args.out:
        glm_bench.write_rows(rows, args.out)
        print(f"appended {len(rows)} lines to {args.out}")
    return 0


def _project(args: argparse.Namespace, group: Group, command: str) -> int:
    if group.rank:
        return 0  # one process measures; the others have nothing to do
    networks = [(lat, bw) for lat in args.latencies for bw in args.bws]
    recipe = args.recipes[-1]
    projections, inputs = glm_projection.run_projection(
        args.model,
        args.n,
        args.b,
        args.s_values,
        recipe,
        args.p_values,
        networks,
        lr=args.lr,
        seed=args.seed,
        progress=None if args.quiet else lambda msg: print(f"timing {msg}", flush=True),
    )
    print(f"PROJECTION (measured compute + modelled AllReduce), n = {args.n}, b = {args.b}")
    for proj in projections:
        print(f"latency {proj.latency * 1e6:g} us, bw {glm_measure.bw_text(proj.bw)}:")
        print(f"  {'P':>6} " + " ".join(f"{k:>18}" for k in proj.speedup))
        for i, p in enumerate(proj.p_values):
            cells = " ".join(f"{proj.speedup[k][i]:17.2f}x" for k in proj.speedup)
            print(f"  {p:>6} {cells}")
    if args.plot:
        glm_plots.plot_projection(
            projections,
            args.plot,
            f"PROJECTION: {args.model}, n = {args.n}, b = {args.b}, recipe {recipe}\n"
            "compute timed on this machine, AllReduce modelled (the library's)",
        )
        print(f"wrote {args.plot}")
    if args.out:
        doc = {
            "bench": "glm-projection",
            "command": command,
            "projection": True,
            "scaling": "strong (columns split over P)",
            "net_model": "library",
            **inputs,
            "networks": [
                {
                    "latency_s": pr.latency,
                    "bw": pr.bw,
                    "p_values": pr.p_values,
                    "per_step_s": pr.per_step,
                    "speedup": pr.speedup,
                }
                for pr in projections
            ],
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"wrote {args.out}")
    return 0
