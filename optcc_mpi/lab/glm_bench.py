"""The GLM benchmark of ``optcc-mpi bench-glm``: time to fp32 SGD's loss for SGD, CA-SGD and
scikit-learn, measured under an emulated alpha-beta network.

Each run is timed on two clocks, wall and critical path (:mod:`optcc_mpi.lab.glm_measure`);
the scikit-learn baselines are :mod:`optcc_mpi.lab.glm_baselines`, the projection to larger P
:mod:`optcc_mpi.lab.glm_projection` and its plot :mod:`optcc_mpi.lab.glm_plots`.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .. import glm
from ..emulation import Emulation
from ..glm.comm import Group
from .glm_baselines import sklearn_baselines
from .glm_measure import CallRecorder, bw_text, critical_path_times, thread_limiter, time_to_target

__all__ = ["format_table", "run_bench", "write_rows"]


def run_bench(args: Any, comm: Any, command: str, print_fn: Any = print) -> list[dict[str, Any]]:
    """The measured benchmark of ``optcc-mpi bench-glm`` (see its ``--help``).

    ``comm`` is the job's ranks: an mpi4py communicator or a torch.distributed process
    group (gloo: NumPy data become CPU tensors, and every AllReduce is the group's).
    ``args`` carries the command's options, already validated (lists parsed:
    ``s_values``, ``recipes``, ``latencies``, ``bws``). Returns the rows (rank 0; other
    ranks return them too, without the scikit-learn rows).
    """
    group = Group(comm)
    rank, size = group.rank, group.size
    K = args.m // args.b
    s_max = max(args.s_values)
    eval_every = args.eval_every or max(1, (K // 8) // s_max) * s_max
    X, y = glm.make_glm_data(args.model, args.m, args.n, seed=args.seed)

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
        "host": platform.node(),
        "backend": group.library,
        "net_model": "library",
        # Other jobs on the machine inflate wall times; the load average says how much.
        "loadavg_start": os.getloadavg()[0],
    }

    def one(solver: str, recipe: str, s: int, latency: float, bw: float | None) -> Any:
        rec = CallRecorder(size, latency, bw)
        emulate = Emulation(latency=latency, bw=bw) if (latency or bw) else None
        group.barrier()
        try:
            res = glm.fit(
                X,
                y,
                model=args.model,
                solver=solver,
                s=s,
                recipe=recipe,
                comm=comm,
                allreduce=rec,
                emulate=emulate,
                eval_every=eval_every,
                on_record=rec.mark,
                b=args.b,
                lr=args.lr,
                max_iter=args.epochs,
                tol=None,
                lam=args.lam,
                seed=args.seed,
            )
        except glm.DivergenceError as exc:
            return str(exc)
        segs = np.asarray(group.allgather(rec.segments))
        losses = [h["loss"] for h in res.history]
        crit = critical_path_times(segs, rec.costs, rec.records)
        walls = [h["train_s"] for h in res.history]
        return {
            "res": res,
            "losses": losses,
            "wall": walls,
            "crit": crit,
            "compute_max_cpu_s": float(np.sum(np.max(segs, axis=0))),
            "compute_mean_cpu_s": float(np.mean(np.sum(segs, axis=1))),
        }

    settings = [("sgd", "fp32", 1)] + [("casgd", r, s) for r in args.recipes for s in args.s_values]
    repeats = max(1, args.repeats)
    rows: list[dict[str, Any]] = []
    with thread_limiter(size):
        for latency in args.latencies:
            for bw in args.bws:
                runs: dict[tuple[str, str, int], list[Any]] = {key: [] for key in settings}
                # Repeats outermost: sweeping every setting once per repeat exposes them
                # all to the same drift of the machine's load (the speedups are paired).
                for rep in range(repeats):
                    for key in settings:
                        if runs[key] and isinstance(runs[key][-1], str):
                            continue  # diverged once: it will again
                        if rank == 0 and args.verbose:
                            print_fn(
                                f"[{time.strftime('%H:%M:%S')}] latency {latency * 1e6:g} us "
                                f"bw {bw_text(bw)} repeat {rep + 1}/{repeats}: {key}",
                                flush=True,
                            )
                        runs[key].append(one(*key, latency, bw))
                rows.extend(_rows(base, settings, runs, latency, bw, args.tolerance, repeats))
                if not args.no_sklearn:
                    rows.extend(_sklearn_rows(args, group, X, y, base, rows[-len(settings)]))
    if rank == 0:
        for row in rows:
            row["loadavg_end"] = os.getloadavg()[0]
    return rows


def _rows(
    base: dict[str, Any],
    settings: list[tuple[str, str, int]],
    runs: dict[tuple[str, str, int], list[Any]],
    latency: float,
    bw: float | None,
    tolerance: float,
    repeats: int,
) -> list[dict[str, Any]]:
    ref_runs = runs[settings[0]]
    if isinstance(ref_runs[-1], str):
        raise RuntimeError(f"the fp32 SGD reference diverged: {ref_runs[-1]}; lower --lr")
    ref_loss = ref_runs[0]["losses"][-1]
    target = ref_loss * (1 + tolerance) if ref_loss >= 0 else ref_loss * (1 - tolerance)

    def ttt(run: dict[str, Any], clock: str) -> Any:
        return time_to_target(run[clock], run["losses"], target)

    ref = {c: [ttt(r, c) for r in ref_runs] for c in ("wall", "crit")}
    out = []
    for key in settings:
        solver, recipe, s = key
        row = {
            **base,
            "latency_s": latency,
            "bw": bw,
            "solver": solver,
            "recipe": recipe,
            "s": s,
            "repeats": repeats,
            "target_loss": target,
            "reference_loss": ref_loss,
        }
        if isinstance(runs[key][-1], str):
            out.append({**row, "error": runs[key][-1]})
            continue
        last = runs[key][-1]
        st = last["res"].stats
        for clock, name in (("wall", "time_to_target_s"), ("crit", "critical_s")):
            times = [ttt(r, clock) for r in runs[key]]
            reached = all(t is not None for t in times)
            row[name] = float(np.median(times)) if reached else None
            row[name.replace("_s", "_all_s")] = times
            pairs = zip(ref[clock], times, strict=True)
            row["speedup" if clock == "wall" else "critical_speedup"] = (
                float(np.median([a / t for a, t in pairs])) if reached else None
            )

        def median(stat: str, rs: list[Any] = runs[key]) -> float:
            return float(np.median([r["res"].stats[stat] for r in rs]))

        final = last["losses"][-1]
        row.update(
            final_loss=final,
            loss_gap=abs(final - ref_loss) / abs(ref_loss) if ref_loss else None,
            train_s=median("train_s"),
            compute_s=median("compute_s"),
            comm_s=median("comm_s"),
            compute_max_cpu_s=float(np.median([r["compute_max_cpu_s"] for r in runs[key]])),
            compute_mean_cpu_s=float(np.median([r["compute_mean_cpu_s"] for r in runs[key]])),
            allreduce_calls=st["allreduce_calls"],
            allreduce_bytes=st["allreduce_bytes"],
            **{k: v for k, v in st.items() if k.startswith("net_")},
        )
        out.append(row)
    return out


def _sklearn_rows(
    args: Any, group: Group, X: Any, y: Any, base: dict[str, Any], ref_row: dict[str, Any]
) -> list[dict[str, Any]]:
    rank = group.rank
    rows: list[dict[str, Any]] = []
    if rank == 0:
        target = ref_row["target_loss"]
        per_est: dict[str, list[dict[str, Any]]] = {}
        for _ in range(max(1, args.repeats)):
            found = sklearn_baselines(
                args.model, X, y, args.lam, args.lr, args.b, target, args.seed,
                lbfgs=not args.no_lbfgs,
            )  # fmt: skip
            for r in found:
                per_est.setdefault(r.get("estimator", "sklearn"), []).append(r)
        for tries in per_est.values():
            sk = dict(tries[-1])
            times = [t.get("time_to_target_s") for t in tries]
            if all(t is not None for t in times):
                sk["time_to_target_s"] = float(np.median(times))
                sk["time_to_target_all_s"] = times
            ref_t = ref_row.get("time_to_target_s")
            ttt = sk.get("time_to_target_s")
            rows.append(
                {
                    **base,
                    "latency_s": ref_row["latency_s"],
                    "bw": ref_row["bw"],
                    "P": 1,
                    "recipe": "fp64",
                    "s": None,
                    "repeats": args.repeats,
                    "target_loss": target,
                    "reference_loss": ref_row["reference_loss"],
                    "speedup": (ref_t / ttt) if ttt and ref_t else None,
                    **sk,
                }
            )
    group.barrier()  # rank 0 alone runs scikit-learn; the others wait without spinning
    return rows


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(rows: Iterable[dict[str, Any]]) -> str:
    """The rows as the printed table."""
    lines = [
        f"{'latency':>8} {'bw':>8} {'solver':>8} {'recipe':>6} {'s':>4} {'t_wall(s)':>9} "
        f"{'speedup':>7} {'t_crit(s)':>9} {'crit.sp':>7} {'final loss':>11} {'gap':>8} "
        f"{'calls':>6} {'MiB':>8} {'charged(s)':>10}"
    ]
    for r in rows:
        head = (
            f"{r['latency_s'] * 1e6:6.0f}us {bw_text(r.get('bw')):>8} "
            f"{r.get('estimator', r['solver'])[:8] if r['solver'] == 'sklearn' else r['solver']:>8}"
            f" {r.get('recipe') or '':>6} {_fmt(r.get('s'), 'd'):>4}"
        )
        if "error" in r:
            lines.append(f"{head}  {r['error']}")
            continue
        mib = r.get("allreduce_bytes")
        lines.append(
            f"{head} {_fmt(r.get('time_to_target_s'), '.3f'):>9} "
            f"{_fmt(r.get('speedup'), '.2f'):>7} {_fmt(r.get('critical_s'), '.3f'):>9} "
            f"{_fmt(r.get('critical_speedup'), '.2f'):>7} {_fmt(r.get('final_loss'), '.6g'):>11} "
            f"{_fmt(r.get('loss_gap'), '.1e'):>8} {_fmt(r.get('allreduce_calls'), 'd'):>6} "
            f"{_fmt(mib and mib / 2**20, '.2f'):>8} {_fmt(r.get('net_charged_s'), '.3f'):>10}"
        )
    return "\n".join(lines)


def write_rows(rows: list[dict[str, Any]], out: str | os.PathLike) -> None:
    """Append the rows to a JSON-lines file."""
    with Path(out).open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
