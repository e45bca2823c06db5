"""``optcc-mpi bench-glm``: time to fp32 SGD's loss for SGD, CA-SGD (sweep of s), scikit-learn."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
import warnings
from pathlib import Path
from typing import Any

from .train import _PARSERS, command_line, report_errors_once

EPILOG = """\
what it measures:
  1. fp32 SGD (the reference) runs --epochs epochs; its final full training loss L is the
     target, reached when a run's loss is within --tolerance (0.5%) of it: loss <= L*(1+tol).
  2. CA-SGD runs for every s in --s and every recipe in --recipes, on the same sample
     sequence. Each run records its full loss every --eval-every steps; the time to
     target is its training time (loss evaluations excluded) at the first record that
     meets the target. Speedup = fp32 SGD's time to target / the run's, the median over
     --repeats sweeps (each sweep runs every setting once, so a speedup pairs runs made
     close together in time).
  3. scikit-learn on rank 0 alone (SGDClassifier / SGDRegressor / PoissonRegressor, same
     objective, no intercept): the time until it reaches the same loss.
  Every AllReduce pays --latency per message on the log2(P) rounds of its critical path.

examples:
  # the recorded benchmark: P = 8, 50 us per message, logistic, s in 4..64
  mpiexec -n 8 optcc-mpi bench-glm --latency 50us --out bench_p8.jsonl

  # P = 4 at 20 and 50 us, Poisson
  mpiexec -n 4 optcc-mpi bench-glm --model poisson --lr 0.2 --latency 20us,50us

  # over OptCC with a degraded rank instead of the MPI library's AllReduce
  mpiexec -n 8 optcc-mpi bench-glm --algorithm optcc --links 3:0.5
"""


def register(subparsers: Any) -> None:
    """Add the ``bench-glm`` command."""
    p = subparsers.add_parser(
        "bench-glm",
        help="benchmark SGD vs CA-SGD (sweep of s, recipes) and scikit-learn to the same loss",
        description=(
            "Time to reach fp32 SGD's final training loss (within a tolerance) for SGD, "
            "CA-SGD over a sweep of s and precision recipes, and scikit-learn on one "
            "process, on synthetic data, under emulated per-message network latency. Run "
            "it under mpiexec at the size to measure."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", choices=("logistic", "linear", "poisson"), default="logistic")
    p.add_argument("--m", type=int, default=16384, help="rows of the synthetic set (default 16384)")
    p.add_argument("--n", type=int, default=256, help="features (default 256)")
    p.add_argument("--b", type=int, default=32, help="mini-batch size (default 32)")
    p.add_argument("--lr", type=float, default=0.5, help="step size (default 0.5)")
    p.add_argument("--lambda", dest="lam", type=float, default=0.0, help="L2 strength (default 0)")
    p.add_argument("--epochs", type=int, default=3, help="epochs of the reference run (default 3)")
    p.add_argument("--s", default="4,8,16,32,64", help="CA-SGD s values (default 4,8,16,32,64)")
    p.add_argument("--recipes", default="fp32,C,D", help="CA-SGD recipes (default fp32,C,D)")
    p.add_argument(
        "--latency",
        default="50us",
        help="emulated latency per message, comma list (default 50us; 0 for none)",
    )
    p.add_argument("--algorithm", default="mpi", help="AllReduce (mpi or an optcc_mpi algorithm)")
    p.add_argument("--links", metavar="SPEC", help="link profile for optcc_mpi algorithms")
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
    p.add_argument("--no-sklearn", action="store_true", help="skip the scikit-learn baseline")
    p.add_argument("--out", metavar="FILE.jsonl", help="append one JSON line per run")
    p.set_defaults(func=run)
    _PARSERS["bench-glm"] = p


def _time_to_target(history: list[dict[str, Any]], target: float) -> float | None:
    for rec in history:
        if rec["loss"] <= target:
            return rec["train_s"]
    return None


def _polite_wait(comm: Any) -> None:
    """Wait for rank 0 without busy-polling, so a rank-0-only job gets the cores."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def _sklearn(
    model: str,
    X: Any,
    y: Any,
    lam: float,
    lr: float,
    b: int,
    target: float,
    seed: int,
    max_epochs: int = 100,
    budget_s: float = 120.0,
) -> dict[str, Any]:
    """Time until scikit-learn on this process reaches ``target`` (fit time only)."""
    import numpy as np

    from ..glm import get_model

    loss_fn = get_model(model).loss

    def objective(w: Any) -> float:
        return float(np.mean(loss_fn(X.astype(np.float64) @ w, y)) + 0.5 * lam * (w @ w))

    try:
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import PoissonRegressor, SGDClassifier, SGDRegressor
    except ImportError:
        return {"solver": "sklearn", "error": "scikit-learn is not installed"}
    elapsed, loss, reached = 0.0, float("nan"), None
    if model == "poisson":
        est_name, max_iter = "PoissonRegressor(lbfgs)", 1
        while max_iter <= 4096 and elapsed < budget_s:
            est = PoissonRegressor(alpha=lam, fit_intercept=False, max_iter=max_iter, tol=0.0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                t0 = time.perf_counter()
                est.fit(X, y)
                elapsed = time.perf_counter() - t0
            loss = objective(est.coef_.astype(np.float64))
            if loss <= target:
                reached = elapsed
                break
            max_iter *= 2
        detail = {"max_iter": max_iter}
    else:
        common = dict(
            penalty="l2" if lam > 0 else None,
            alpha=lam if lam > 0 else 0.0001,
            fit_intercept=False,
            learning_rate="constant",
            eta0=lr / b,  # our step is lr times the mean of b gradients: lr/b per sample
            random_state=seed,
        )
        if model == "logistic":
            est, est_name = SGDClassifier(loss="log_loss", **common), "SGDClassifier(log_loss)"
        else:
            est, est_name = SGDRegressor(loss="squared_error", **common), "SGDRegressor"
        epochs = 0
        while epochs < max_epochs and elapsed < budget_s:
            t0 = time.perf_counter()
            if model == "logistic":
                est.partial_fit(X, y, classes=np.array([0.0, 1.0]))
            else:
                est.partial_fit(X, y)
            elapsed += time.perf_counter() - t0
            epochs += 1
            loss = objective(est.coef_.ravel().astype(np.float64))
            if loss <= target:
                reached = elapsed
                break
        detail = {"epochs": epochs, "eta0": lr / b}
    return {
        "solver": "sklearn",
        "estimator": est_name,
        "time_to_target_s": reached,
        "final_loss": loss,
        "sklearn_s": elapsed,
        **detail,
    }


def run(args: argparse.Namespace) -> int:
    """Run ``optcc-mpi bench-glm``."""
    return report_errors_once("bench-glm", _bench, args)


def _bench(args: argparse.Namespace, comm: Any) -> int:
    import numpy as np

    from .. import glm
    from ..emulation import Emulation
    from ..links import parse_duration
    from .train import common_fit_kwargs

    rank, size = comm.rank, comm.size
    s_values = [int(v) for v in args.s.split(",") if v.strip()]
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    latencies = [parse_duration(v) for v in args.latency.split(",") if v.strip()]
    for r in recipes:
        glm.get_recipe(r)
    if not s_values or min(s_values) < 1:
        raise ValueError("--s needs positive integers")
    K = args.m // args.b
    eval_every = args.eval_every or max(1, (K // 8) // max(s_values)) * max(s_values)
    command = command_line(args, size)

    X, y = glm.make_glm_data(args.model, args.m, args.n, seed=args.seed)
    # One BLAS thread per rank: P ranks share the cores, and more threads only fight.
    try:
        from threadpoolctl import threadpool_limits

        limiter: Any = threadpool_limits(limits=1) if size > 1 else contextlib.nullcontext()
    except ImportError:
        limiter = contextlib.nullcontext()

    rows: list[dict[str, Any]] = []
    base = {
        "bench": "glm",
        "command": command,
        "P": size,
        "model": args.model,
        "m": args.m,
        "n": args.n,
        "b": args.b,
        "lr": args.lr,
        "lam": args.lam,
        "epochs": args.epochs,
        "algorithm": args.algorithm,
        "links": args.links,
        "host": platform.node(),
        # Other jobs on the machine inflate every time; the load average says how much.
        "loadavg_start": os.getloadavg()[0],
    }

    def one(solver: str, recipe: str, s: int, emulate: Any) -> Any:
        comm.Barrier()
        try:
            return glm.fit(
                X,
                y,
                model=args.model,
                solver=solver,
                s=s,
                recipe=recipe,
                comm=comm,
                emulate=emulate,
                eval_every=eval_every,
                **common_fit_kwargs(args),
            )
        except glm.DivergenceError as exc:
            return str(exc)

    settings = [("sgd", "fp32", 1)] + [("casgd", r, s) for r in recipes for s in s_values]
    repeats = max(1, args.repeats)
    with limiter:
        for latency in latencies:
            emulate = Emulation(latency=latency) if latency > 0 else None
            runs: dict[tuple[str, str, int], list[Any]] = {key: [] for key in settings}
            # Repeats outermost: the machine's load drifts, and sweeping every setting once
            # per repeat exposes them all to the same drift (the speedups are paired).
            for _ in range(repeats):
                for key in settings:
                    if runs[key] and isinstance(runs[key][-1], str):
                        continue  # diverged once: it will again
                    runs[key].append(one(*key, emulate))
            ref_runs = runs[settings[0]]
            if isinstance(ref_runs[-1], str):
                raise RuntimeError(f"the fp32 SGD reference diverged: {ref_runs[-1]}; lower --lr")
            ref_loss = ref_runs[0].final_loss
            target = (
                ref_loss * (1 + args.tolerance)
                if ref_loss >= 0
                else ref_loss * (1 - args.tolerance)
            )
            ref_ttts = [_time_to_target(r.history, target) for r in ref_runs]
            ref_time = float(np.median(ref_ttts))
            for key in settings:
                solver, recipe, s = key
                row = {
                    **base,
                    "latency_s": latency,
                    "solver": solver,
                    "recipe": recipe,
                    "s": s,
                    "repeats": repeats,
                    "target_loss": target,
                    "reference_loss": ref_loss,
                }
                if isinstance(runs[key][-1], str):
                    rows.append({**row, "error": runs[key][-1]})
                    continue
                ttts = [_time_to_target(r.history, target) for r in runs[key]]
                reached = all(t is not None for t in ttts)
                last = runs[key][-1]
                st = last.stats

                def median(stat: str, runs: list[Any] = runs[key]) -> float:
                    return float(np.median([r.stats[stat] for r in runs]))

                row.update(
                    time_to_target_s=float(np.median(ttts)) if reached else None,
                    time_to_target_all_s=ttts,
                    speedup=float(np.median([a / t for a, t in zip(ref_ttts, ttts, strict=True)]))
                    if reached
                    else None,
                    final_loss=last.final_loss,
                    loss_gap=abs(last.final_loss - ref_loss) / abs(ref_loss) if ref_loss else None,
                    train_s=median("train_s"),
                    compute_s=median("compute_s"),
                    comm_s=median("comm_s"),
                    emulated_wait_s=median("emulated_wait_s"),
                    allreduce_calls=st["allreduce_calls"],
                    allreduce_bytes=st["allreduce_bytes"],
                    eval_every=eval_every,
                )
                rows.append(row)

            if not args.no_sklearn:
                sk = None
                if rank == 0:
                    tries = [
                        _sklearn(args.model, X, y, args.lam, args.lr, args.b, target, args.seed)
                        for _ in range(repeats)
                    ]
                    sk = tries[-1]
                    times = [t.get("time_to_target_s") for t in tries]
                    if all(t is not None for t in times):
                        sk["time_to_target_s"] = float(np.median(times))
                        sk["time_to_target_all_s"] = times
                if size > 1 and rank:
                    _polite_wait(comm)
                elif size > 1:
                    comm.Ibarrier().Wait()
                if rank == 0:
                    ttt = sk.get("time_to_target_s")
                    rows.append(
                        {
                            **base,
                            "latency_s": latency,
                            "P": 1,
                            "recipe": "fp64",
                            "s": None,
                            "repeats": repeats,
                            "target_loss": target,
                            "reference_loss": ref_loss,
                            "speedup": (ref_time / ttt) if ttt else None,
                            **sk,
                        }
                    )

    if rank == 0:
        for row in rows:
            row["loadavg_end"] = os.getloadavg()[0]
        _print_table(rows)
        if args.out:
            with Path(args.out).open("a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
            print(f"appended {len(rows)} lines to {args.out}")
    return 0


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'latency':>8} {'solver':>8} {'recipe':>6} {'s':>4} {'t_target(s)':>11} "
        f"{'speedup':>7} {'final loss':>11} {'gap':>8} {'calls':>6} {'MiB':>8} "
        f"{'compute(s)':>10} {'comm(s)':>8}"
    )
    for r in rows:
        if "error" in r:
            print(
                f"{r['latency_s'] * 1e6:6.0f}us {r['solver']:>8} {r.get('recipe') or '':>6} "
                f"{_fmt(r.get('s'), 'd'):>4}  {r['error']}"
            )
            continue
        print(
            f"{r['latency_s'] * 1e6:6.0f}us {r['solver']:>8} {r.get('recipe') or '':>6} "
            f"{_fmt(r.get('s'), 'd'):>4} {_fmt(r.get('time_to_target_s'), '.3f'):>11} "
            f"{_fmt(r.get('speedup'), '.2f'):>7} {_fmt(r.get('final_loss'), '.6g'):>11} "
            f"{_fmt(r.get('loss_gap'), '.1e'):>8} {_fmt(r.get('allreduce_calls'), 'd'):>6} "
            f"{_fmt(r.get('allreduce_bytes') and r['allreduce_bytes'] / 2**20, '.2f'):>8} "
            f"{_fmt(r.get('compute_s'), '.3f'):>10} {_fmt(r.get('comm_s'), '.3f'):>8}"
        )
