"""``optcc-mpi train``: fit a GLM with SGD or CA-SGD under mpiexec, srun or torchrun."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from optcc_mpi import data, glm
from optcc_mpi.emulation import Emulation
from optcc_mpi.errors import ArgumentError
from optcc_mpi.glm.comm import Group
from optcc_mpi.lab import world
from optcc_mpi.linklog import recording

EPILOG = """\
examples:
  # CA-SGD, recipe C, on 4 ranks, until the loss stops improving (by --tol 1e-3 for
  # --n-iter-no-change 5 epochs; the step is divided by 5 at each such plateau first)
  mpiexec -n 4 optcc-mpi train --data higgs.h5 --model logistic --solver casgd \\
      --s 16 --b 32 --lr 0.5 --recipe C --out run.json

  # the same under torchrun, over torch.distributed's gloo (CPU tensors, no MPI at all);
  # the command as one string: torchrun's parser would take --s for one of its options
  torchrun --standalone --nproc-per-node 4 --no-python sh -c \\
      "optcc-mpi train --data higgs.h5 --s 16 --recipe C"

  # exactly 5 epochs (what --epochs 5 did), plain SGD in fp32 (the reference recipe)
  mpiexec -n 4 optcc-mpi train --data higgs.h5 --solver sgd --max-iter 5 --tol none

  # stop on a held-out 10% of the rows (their accuracy) rather than on the training loss
  mpiexec -n 4 optcc-mpi train --data higgs.h5 --early-stopping --validation-fraction 0.1

  # no --data: the embedded synthetic set (generated on first use)
  mpiexec -n 2 optcc-mpi train --max-iter 2 --tol none

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
  does one AllReduce per outer iteration. --s auto (the default) takes the s the cost
  model finds fastest: 1 on one process (nothing to save), more as latency grows.
  Recipes: fp64, fp32, C, D; slots: data, weights_in, margin_acc, margin, gram_in,
  gram_acc, comm, recurrence, update.
  The progress bar shows the current epoch's running loss (the mean loss of its mini-
  batches so far, each at the margins its step saw); after every epoch rank 0 prints the
  full training loss; the last line gives the accuracy (logistic) or R^2 (linear) / D^2
  (Poisson) on the training rows, the epochs run and why training stopped.
  Over torch.distributed (--transport gloo, the default under torchrun; nccl for CUDA
  tensors, not yet run on a GPU) the data and weights are tensors on the group's device.
  See docs/casgd.md.
"""


def _s_value(text: str) -> int | str:
    """``--s``: ``auto`` or a positive integer."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _tol(text: str) -> float | None:
    """``--tol``: a number >= 0, or ``none`` (run --max-iter epochs)."""
    if text.strip().lower() in ("none", "off"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or none, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (or none), got {text!r}")
    return value


#: The transports ``train`` runs over: MPI, or torch.distributed's gloo (CPU) or NCCL (GPU).
TRANSPORTS = ("mpi", "gloo", "nccl")


#: The sub-parser of each command, for :func:`command_line`.
_PARSERS: dict[str, argparse.ArgumentParser] = {}


def register(subparsers: Any) -> None:
    """Add the ``train`` command."""
    p = subparsers.add_parser(
        "train",
        help="train a GLM (logistic, linear, Poisson) with SGD or CA-SGD",
        description=(
            "Train a generalized linear model by mini-batch SGD or communication-avoiding "
            "SGD in the 1D block-column layout (each rank holds a block of columns), until "
            "the loss stops improving. Run it under mpiexec or srun (MPI), or torchrun "
            "(torch.distributed: gloo, or NCCL for CUDA tensors); rank 0 prints the "
            "progress and the results, the last line the score and why training stopped."
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
    s.add_argument(
        "--s",
        type=_s_value,
        default="auto",
        help="steps per outer iteration, or auto (default): the cost model's fastest",
    )
    s.add_argument("--b", type=int, default=32, help="mini-batch size (default 32)")
    s.add_argument("--lr", type=float, default=0.5, help="step size eta (default 0.5)")
    s.add_argument("--seed", type=int, default=0, help="seed of the shared sample sequence")
    st = p.add_argument_group("when to stop")
    st.add_argument(
        "--max-iter", type=int, default=1000, metavar="EPOCHS", help="epochs at most (1000)"
    )
    st.add_argument(
        "--tol",
        type=_tol,
        default=1e-3,
        help="stop after --n-iter-no-change epochs that improve the training loss by less "
        "than this (default 1e-3); none: run --max-iter epochs",
    )
    st.add_argument(
        "--n-iter-no-change",
        type=int,
        default=5,
        metavar="EPOCHS",
        help="epochs without improvement that make a plateau (default 5)",
    )
    st.add_argument(
        "--learning-rate",
        choices=("adaptive", "constant"),
        default="adaptive",
        help="adaptive (default): divide the step by 5 at a plateau, stop when that no "
        "longer helps; constant: stop at the first plateau",
    )
    st.add_argument(
        "--early-stopping",
        action="store_true",
        help="hold out --validation-fraction of the rows and stop on their score "
        "(accuracy, R^2, D^2) instead of the training loss",
    )
    st.add_argument(
        "--validation-fraction",
        type=float,
        default=0.1,
        metavar="F",
        help="share of the rows held out with --early-stopping (default 0.1)",
    )
    st.add_argument(
        "--epochs",
        type=int,
        metavar="N",
        help="deprecated: exactly N epochs; use --max-iter N --tol none",
    )
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
        help="where the local kernels run: over MPI the CPU (default) or a GPU via CuPy; "
        "over torch.distributed the group's device (gloo: cpu, nccl: gpu)",
    )
    c = p.add_argument_group("communication")
    c.add_argument(
        "--transport",
        choices=TRANSPORTS,
        help="what joins the ranks: mpi (default under mpiexec/srun), gloo (torch."
        "distributed on CPU tensors; default under torchrun) or nccl (CUDA tensors)",
    )
    c.add_argument(
        "--algorithm",
        default="native",
        help="AllReduce: native (the library's own: MPI_Allreduce, or gloo's/NCCL's; "
        "default; mpi is the same) or an optcc_mpi algorithm (ring, optcc, r2ccl, auto)",
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


def start_group(transport: str | None) -> tuple[Any, bool]:
    """The ranks a command runs over (``--transport``; default: gloo under torchrun, else
    MPI), started if needed. Returns the communicator or process group and whether this
    call started it (for :func:`end_group`).

    NCCL: the process group is started on the GPU of the rank's ``LOCAL_RANK`` (torchrun)
    or of its rank modulo the visible GPUs (an MPI launcher). Not yet run on a GPU.
    """
    transport = transport or world.default_transport()
    if transport != "nccl":
        return world.start(transport)
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.group.WORLD, False
    if not torch.cuda.is_available():
        raise ArgumentError("--transport nccl needs a CUDA device; this process sees none")
    how = world.started_by()
    if how == "torchrun":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    elif how == "mpi":
        from mpi4py import MPI  # an MPI launcher started this process

        from optcc_mpi.torch import init_process_group_from_mpi

        torch.cuda.set_device(MPI.COMM_WORLD.Get_rank() % torch.cuda.device_count())
        init_process_group_from_mpi("nccl")
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD, True


def end_group(started: bool) -> None:
    """End a process group that :func:`start_group` started."""
    world.end(started)


def _load_data(args: argparse.Namespace, comm: Any, data_dtype: str) -> tuple[Any, str]:
    """Load this rank's partition; every rank agrees on success before going on."""
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
    glm.agree(comm, error)
    return part, str(path)


def command_line(args: argparse.Namespace, size: int) -> str:
    """The command that reproduces this run, launcher size included.

    Rebuilt from the parsed options (every option that differs from its default), so it
    is right however the command was started (console script, ``python -m``, ``main()``).
    Under torchrun the command goes in as one string through ``--no-python sh -c``:
    torchrun's own parser reads every option of its command line, those after the script
    too, and refuses ``--s``, ``--m`` or ``--n`` as abbreviations of its own.
    """
    parser = _PARSERS[args.command]
    words = ["optcc-mpi", args.command]
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
    inner = " ".join(shlex.quote(w) for w in words)
    if world.started_by() == "torchrun":
        launch = f"torchrun --standalone --nproc-per-node={size} --no-python sh -c"
        return f"{launch} {shlex.quote(inner)}"
    return f"mpiexec -n {size} {inner}"


def report_errors_once(name: str, body: Any, args: argparse.Namespace) -> int:
    """Run ``body(args, comm)`` over the ranks of ``args.transport``; an error raised on
    every rank is printed by rank 0 only.

    The trainer raises input errors on all ranks at once (they agree first), so printing
    them once keeps an 8-rank job's output readable. Exit status 2, like the CLI's own.
    """
    comm, started = start_group(getattr(args, "transport", None))
    rank = Group(comm).rank
    try:
        return body(args, comm)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        if rank == 0:
            print(f"optcc-mpi {name}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        end_group(started)


def run(args: argparse.Namespace) -> int:
    """Run ``optcc-mpi train``."""
    return report_errors_once("train", _train_command, args)


def _stopping(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """The stopping options as :func:`optcc_mpi.glm.fit` takes them (``--epochs N``,
    deprecated, is ``--max-iter N --tol none``)."""
    if args.epochs is not None:
        if rank == 0:
            print(
                f"optcc-mpi train: --epochs is deprecated and will be removed; use "
                f"--max-iter {args.epochs} --tol none for exactly that many epochs",
                file=sys.stderr,
                flush=True,
            )
        max_iter, tol = args.epochs, None
    else:
        max_iter, tol = args.max_iter, args.tol
    return {
        "max_iter": max_iter,
        "tol": tol,
        "n_iter_no_change": args.n_iter_no_change,
        "learning_rate": args.learning_rate,
        "early_stopping": args.early_stopping,
        "validation_fraction": args.validation_fraction,
    }


def result_line(res: Any, model: str) -> str:
    """The last line of ``train``: the score on the training rows (and on the held-out
    ones), the epochs run and why training stopped."""
    name = {"logistic": "accuracy", "linear": "R^2", "poisson": "D^2"}[model]
    text = f"{name} {res.train_score:.4f} on the {res.config['m_train']} training rows"
    if res.val_score is not None:
        held = res.config["m"] - res.config["m_train"]
        text += f", {res.val_score:.4f} on the {held} held out"
    epochs = f"{res.n_iter} epoch{'s' if res.n_iter != 1 else ''}"
    tol = res.config.get("tol")
    why = res.stop_text.replace("tol", f"tol={tol:g}") if tol is not None else res.stop_text
    why = why.replace("n_iter_no_change", str(res.config.get("n_iter_no_change")))
    return f"result: {text}; {epochs}, stopped because {why}"


def _train_command(args: argparse.Namespace, comm: Any) -> int:
    group = Group(comm)
    rank, size = group.rank, group.size
    if args.links_log and str(args.links or "").strip().lower() != "watch":
        raise ValueError(
            "--links-log records what --links watch adopts; add --links watch (and an "
            "optcc_mpi --algorithm)"
        )
    recipe = glm.get_recipe(args.recipe, args.slot)  # same on every rank: fails everywhere
    emulate = Emulation.parse(args.emulate) if args.emulate else None
    stopping = _stopping(args, rank)
    data_dtype = "float64" if "fp64" in (recipe.data, recipe.update) else "float32"
    part, path = _load_data(args, comm, data_dtype)
    model = args.model or glm.model_for_task(part.task)

    def show(rec: dict[str, Any]) -> None:
        if rank == 0 and rec["epoch_end"]:
            extra = f", validation {rec['val_score']:.4f}" if "val_score" in rec else ""
            print(
                f"epoch {rec['epoch']:.0f}  loss {rec['loss']:.8g}{extra}  "
                f"(steps {rec['steps']}, lr {rec['lr']:.4g}, train {rec['train_s']:.2f} s)",
                flush=True,
            )

    if rank == 0:
        print(
            f"optcc-mpi train: {model}, {args.solver}"
            + (f" s={args.s}" if args.solver == "casgd" else "")
            + f" b={args.b} lr={args.lr} lambda={args.lam} recipe {recipe.name}; "
            f"data {path}: m={part.n_samples} n={part.n_features}; {group.describe()}, "
            f"AllReduce {args.algorithm}",
            flush=True,
        )
    with recording(args.links_log):
        res = glm.fit_partition(
            part,
            model=model,
            solver=args.solver,
            s=args.s,
            b=args.b,
            lr=args.lr,
            lam=args.lam,
            seed=args.seed,
            recipe=recipe,
            comm=comm,
            allreduce=args.algorithm,
            links=args.links,
            emulate=emulate,
            **stopping,
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
        s_used = f", s={res.config['s']}" if args.solver == "casgd" else ""
        print(
            f"final loss {res.final_loss:.8g} after {res.n_iter} epochs ({st['steps']} steps, "
            f"{st['outer_iterations']} outer iterations{s_used})"
        )
        print(
            f"time: train {st['train_s']:.3f} s = compute {st['compute_s']:.3f} s + "
            f"communication {st['comm_s']:.3f} s  (max over ranks: train "
            f"{st['train_s_max']:.3f} s, communication {st['comm_s_max']:.3f} s)"
        )
        print(
            f"AllReduce ({st['allreduce']} over {group.library}): {st['allreduce_calls']} "
            f"calls, {st['allreduce_bytes'] / 2**20:.3f} MiB; loss evaluation: "
            f"{st['eval_calls']} calls, {st['eval_s']:.3f} s"
        )
        if args.out:
            doc = {
                "command": command_line(args, size),
                "data": path,
                **res.as_dict(),
            }
            Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
            print(f"wrote {args.out}")
        print(result_line(res, model), flush=True)
    return 0
