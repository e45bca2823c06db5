"""``optcc-mpi train``: fit a GLM with SGD or CA-SGD under mpiexec or srun."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from optcc_mpi import data
from optcc_mpi.emulation import Emulation
from optcc_mpi.linklog import recording

EPILOG = """\
examples:
  # CA-SGD, recipe C, on 4 ranks; per-epoch loss, time split and AllReduce counts
  mpiexec -n 4 optcc-mpi train --data higgs.h5 --model logistic --solver casgd \\
      --s 16 --b 32 --lr 0.5 --epochs 5 --recipe C --out run.json

  # the same data with plain SGD in fp32 (the reference recipe)
  mpiexec -n 4 optcc-mpi train --data higgs.h5 --solver sgd --b 32 --recipe fp32

  # no --data: the embedded synthetic set (generated on first use)
  mpiexec -n 2 optcc-mpi train --epochs 2

  # recipe C with the packed buffer communicated in bf16 (that is recipe D)
  mpiexec -n 8 optcc-mpi train --data higgs.h5 --recipe C --slot comm=bf16

  # over a degraded network: OptCC AllReduce, rank 3 at half bandwidth, 50 us latency
  mpiexec -n 8 optcc-mpi train --data higgs.h5 --algorithm optcc --links 3:0.5 \\
      --emulate latency=50us

  # follow the links while training (links=watch) and keep a record of what it adopted
  # and ran; `optcc-mpi report --links links.jsonl` draws the timeline
  mpiexec -n 8 optcc-mpi train --data higgs.h5 --algorithm auto --links watch \\
      --links-log links.jsonl

  # checkpoint every 20 outer iterations; after a kill, the same command with --resume
  # continues exactly where it stopped (same final weights, bit for bit)
  srun --mpi=pmi2 -n 8 optcc-mpi train --data higgs.h5 --checkpoint ck.h5 \\
      --checkpoint-every 20 --resume

notes:
  The objective is mean loss + (lambda/2)||w||^2, without an intercept. --lambda equals
  scikit-learn's alpha for SGDClassifier/SGDRegressor/PoissonRegressor.
  An epoch is m // b mini-batches of a fresh permutation shared by all ranks; CA-SGD groups
  them into outer iterations of s steps (the last one of an epoch may be shorter) and
  does one AllReduce per outer iteration. Recipes: fp64, fp32, C, D; slots: data,
  weights_in, margin_acc, margin, gram_in, gram_acc, comm, recurrence, update.
  See docs/casgd.md.
"""


def common_fit_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The :func:`optcc_mpi.glm.fit` arguments that ``train`` and ``bench-glm`` share."""
    return {
        "b": args.b,
        "lr": args.lr,
        "epochs": args.epochs,
        "lam": args.lam,
        "seed": args.seed,
        "allreduce": args.algorithm,
        "links": args.links,
    }


#: The sub-parser of each command, for :func:`command_line`.
_PARSERS: dict[str, argparse.ArgumentParser] = {}


def register(subparsers: Any) -> None:
    """Add the ``train`` command."""
    p = subparsers.add_parser(
        "train",
        help="train a GLM (logistic, linear, Poisson) with SGD or CA-SGD",
        description=(
            "Train a generalized linear model by mini-batch SGD or communication-avoiding "
            "SGD in the 1D block-column layout (each rank holds a block of columns). Run "
            "it under mpiexec or srun; rank 0 prints the progress and the results."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = p.add_argument_group("data and model")
    d.add_argument(
        "--data",
        metavar="FILE.h5",
        help="dataset file (or a shipped name: breast_cancer, diabetes, randhie); "
        "default: the embedded synthetic set",
    )
    d.add_argument("--rows", type=int, metavar="N", help="use only the first N rows")
    d.add_argument(
        "--intercept",
        action="store_true",
        help="append a column of ones (a bias term, penalised like the others)",
    )
    d.add_argument(
        "--model",
        choices=("logistic", "linear", "poisson"),
        help="GLM; default: the one matching the dataset's task",
    )
    d.add_argument(
        "--lambda",
        dest="lam",
        type=float,
        default=0.0,
        metavar="L",
        help="L2 strength lambda (default 0)",
    )
    s = p.add_argument_group("solver")
    s.add_argument("--solver", choices=("sgd", "casgd"), default="casgd", help="default casgd")
    s.add_argument("--s", type=int, default=16, help="steps per outer iteration (default 16)")
    s.add_argument("--b", type=int, default=32, help="mini-batch size (default 32)")
    s.add_argument("--lr", type=float, default=0.5, help="step size eta (default 0.5)")
    s.add_argument("--epochs", type=int, default=5, help="passes over the data (default 5)")
    s.add_argument("--seed", type=int, default=0, help="seed of the shared sample sequence")
    s.add_argument("--recipe", default="fp32", help="precision preset: fp64, fp32 (default), C, D")
    s.add_argument(
        "--slot",
        action="append",
        default=[],
        metavar="SLOT=PREC",
        help="override one precision slot, e.g. comm=bf16 (repeatable)",
    )
    s.add_argument(
        "--gram-layout",
        choices=("lower", "full"),
        default="lower",
        help="send only the Gram blocks the recurrence reads (lower, default) "
        "or the whole sb x sb matrix (full)",
    )
    s.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="STEPS",
        help="also record the full loss every STEPS SGD steps",
    )
    s.add_argument(
        "--device",
        choices=("cpu", "gpu", "auto"),
        default="cpu",
        help="where the local kernels run (default cpu)",
    )
    c = p.add_argument_group("communication")
    c.add_argument(
        "--algorithm",
        default="mpi",
        help="AllReduce: mpi (the MPI library's, default) or an optcc_mpi "
        "algorithm (ring, optcc, r2ccl, native, auto)",
    )
    c.add_argument(
        "--links",
        metavar="SPEC",
        help="link profile for optcc_mpi algorithms, e.g. 3:0.5, or watch (learn it from "
        "the calls themselves)",
    )
    c.add_argument(
        "--links-log",
        metavar="FILE",
        help="with --links watch: append the profiles adopted and the algorithm each call "
        "ran to FILE (JSON lines, rank 0; default $OPTCC_LINKS_LOG); see `optcc-mpi report "
        "--links`",
    )
    c.add_argument(
        "--emulate",
        metavar="SPEC",
        help="emulate a slow network, e.g. latency=50us or bw=200MB/s,latency=20us",
    )
    o = p.add_argument_group("checkpoints and output")
    o.add_argument("--checkpoint", metavar="FILE.h5", help="checkpoint file")
    o.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="write the checkpoint every N outer iterations (and at the end)",
    )
    o.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    o.add_argument("--out", metavar="FILE.json", help="write config, losses, timings, counts")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    _PARSERS["train"] = p


def _load(args: argparse.Namespace, comm: Any, data_dtype: str) -> tuple[Any, str]:
    """Load this rank's partition; every rank agrees on success before going on."""
    from ..glm import agree

    part, path, error = None, None, None
    try:
        if args.data is None:
            path = data.default_dataset(comm)
        elif not Path(args.data).exists() and args.data in ("breast_cancer", "diabetes", "randhie"):
            path = data.shipped(args.data)
        else:
            path = args.data
            if not Path(path).exists():
                raise FileNotFoundError(f"no such dataset file: {path}")
        rows = None if args.rows is None else slice(0, args.rows)
        part = data.load_partition(
            path, comm=comm, dtype=data_dtype, rows=rows, intercept=args.intercept
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        error = f"{type(exc).__name__}: {exc}" if isinstance(exc, KeyError) else str(exc)
    agree(comm, error)
    return part, str(path)


def command_line(args: argparse.Namespace, size: int) -> str:
    """The command that reproduces this run, launcher size included.

    Rebuilt from the parsed options (every option that differs from its default), so it
    is right however the command was started (console script, ``python -m``, ``main()``).
    """
    parser = _PARSERS[args.command]
    words = ["mpiexec", "-n", str(size), "optcc-mpi", args.command]
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, None)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value:
                words += [flag, str(item)]
        else:
            words += [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


def report_errors_once(name: str, body: Any, args: argparse.Namespace) -> int:
    """Run ``body(args, comm)``; an error raised on every rank is printed by rank 0 only.

    The trainer raises input errors on all ranks at once (they agree first), so printing
    them once keeps an 8-rank job's output readable. Exit status 2, like the CLI's own.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    try:
        return body(args, comm)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        if comm.rank == 0:
            print(f"optcc-mpi {name}: error: {exc}", file=sys.stderr, flush=True)
        return 2


def run(args: argparse.Namespace) -> int:
    """Run ``optcc-mpi train``."""
    return report_errors_once("train", _train, args)


def _train(args: argparse.Namespace, comm: Any) -> int:
    from .. import glm

    rank, size = comm.rank, comm.size
    if args.links_log and str(args.links or "").strip().lower() != "watch":
        raise ValueError(
            "--links-log records what --links watch adopts; add --links watch (and an "
            "optcc_mpi --algorithm)"
        )
    recipe = glm.get_recipe(args.recipe, args.slot)  # same on every rank: fails everywhere
    emulate = Emulation.parse(args.emulate) if args.emulate else None
    data_dtype = "float64" if "fp64" in (recipe.data, recipe.update) else "float32"
    part, path = _load(args, comm, data_dtype)
    model = args.model or glm.model_for_task(part.task)

    def show(rec: dict[str, Any]) -> None:
        if rank == 0 and rec["epoch_end"]:
            print(
                f"epoch {rec['epoch']:.0f}  loss {rec['loss']:.8g}  "
                f"(steps {rec['steps']}, train {rec['train_s']:.2f} s)",
                flush=True,
            )

    if rank == 0:
        print(
            f"optcc-mpi train: {model}, {args.solver}"
            + (f" s={args.s}" if args.solver == "casgd" else "")
            + f" b={args.b} lr={args.lr} lambda={args.lam} recipe {recipe.name}; "
            f"data {path}: m={part.n_samples} n={part.n_features}; P={size}, "
            f"AllReduce {args.algorithm}",
            flush=True,
        )
    with recording(args.links_log):
        res = glm.fit(
            part.X,
            part.y,
            cols=part.cols,
            model=model,
            solver=args.solver,
            s=args.s,
            recipe=recipe,
            comm=comm,
            emulate=emulate,
            **common_fit_kwargs(args),
            gram_layout=args.gram_layout,
            eval_every=args.eval_every,
            checkpoint=args.checkpoint,
            checkpoint_every=args.checkpoint_every,
            resume=args.resume,
            progress=not args.no_progress,
            on_record=show,
            device=args.device,
        )
    st = res.stats
    if rank == 0:
        if res.resumed_from:
            print(f"resumed from {args.checkpoint} at step {res.resumed_from['steps']}")
        print(
            f"final loss {res.final_loss:.8g} after {args.epochs} epochs "
            f"({st['steps']} steps, {st['outer_iterations']} outer iterations)"
        )
        print(
            f"time: train {st['train_s']:.3f} s = compute {st['compute_s']:.3f} s + "
            f"communication {st['comm_s']:.3f} s  (max over ranks: train "
            f"{st['train_s_max']:.3f} s, communication {st['comm_s_max']:.3f} s)"
        )
        print(
            f"AllReduce ({st['allreduce']}): {st['allreduce_calls']} calls, "
            f"{st['allreduce_bytes'] / 2**20:.3f} MiB; loss evaluation: {st['eval_calls']} "
            f"calls, {st['eval_s']:.3f} s"
        )
        if args.out:
            doc = {
                "command": command_line(args, size),
                "data": path,
                **res.as_dict(),
            }
            Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
            print(f"wrote {args.out}")
    return 0
