"""Reports: sweep results joined into one table, and their plots.

Two jobs, each usable from Python and through ``optcc-mpi report`` (the simulated
reproduction of the paper's setting is :mod:`optcc_mpi.lab.reproduce`):

* :func:`load` / :func:`write_csv`: read a results folder written by the sweep job
  scripts (``optcc_mpi.lab.sweep``) into flat rows, one per benchmark row or training run,
  plus one row for every task that failed or never reported, so nothing disappears
  silently. Every row carries ``array_job_id``, ``array_task_id``, ``status`` and
  ``wrong``.
* :func:`plot_results`: the usual pictures (PNG, matplotlib's Agg backend): AllReduce
  overhead against bandwidth loss with the model and the lower bound, time against message
  size, CA-SGD loss against time, and CA-SGD speedup against s.
* :func:`links_summary` / :func:`plot_links`: the timeline of a link log
  (:mod:`optcc_mpi.linklog`): every rank's fraction over time, the algorithm each call
  ran, and the doctor's verdicts.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optcc_mpi import algorithms, model
from optcc_mpi.lab import sweep as _sweep
from optcc_mpi.links import Links

__all__ = [
    "Results",
    "load",
    "write_csv",
    "plot_results",
    "link_runs",
    "links_summary",
    "plot_links",
]

#: Columns that lead the joined CSV, in this order; the others follow as first seen.
LEAD_COLUMNS = (
    "table",
    "array_job_id",
    "array_task_id",
    "status",
    "wrong",
    "exit_code",
    "kind",
    "algorithm",
    "chosen",
    "p",
    "loss",
    "links",
    "size",
    "time_us",
    "ratio_fault_free",
    "model_us",
    "bound_us",
    "rss_peak_mib",
    "solver",
    "s",
    "b",
    "recipe",
    "dataset",
    "final_loss",
    "train_s",
    "compute_s",
    "comm_s",
)

#: Label the benchmark gives the healthy reference ring it times in every run.
REFERENCE = "ring (fault-free)"


# ----------------------------------------------------------------------------- loading


@dataclass
class Results:
    """A results folder, read.

    Attributes
    ----------
    rows : list of dict
        Flat rows for the CSV: result rows of the tasks that count (the latest submission
        of each), and one row per failed task without results or missing task.
    status : optcc_mpi.lab.sweep.SweepStatus
        Per-task states (ok, failed, missing), for the summary.
    histories : list of dict
        One per training run: its parameters and loss curve (``history``), which the CSV
        leaves out.
    """

    rows: list[dict[str, Any]]
    status: _sweep.SweepStatus
    histories: list[dict[str, Any]]

    @property
    def ok(self) -> bool:
        """Every task succeeded and no row has wrong values."""
        return self.status.ok

    def summary(self) -> str:
        """Task counts, #wrong, and one line per failed or missing task."""
        return self.status.summary()


def _loss_of(row: Mapping[str, Any], params: Mapping[str, Any]) -> float | None:
    """Bandwidth lost by the slowest rank: the table's ``loss``, else from ``links``."""
    if params.get("loss") not in (None, ""):
        try:
            return float(params["loss"])
        except (TypeError, ValueError):
            pass
    text = row.get("links") if row.get("links") is not None else params.get("links")
    p = row.get("p") or params.get("ranks")
    if text in (None, "") or not p:
        return 0.0 if text == "" else None
    try:
        return float(1.0 - Links.parse(str(text)).vector(int(p)).min())
    except (ValueError, TypeError):
        return None


def _flat(value: Any) -> Any:
    # CSV cells: numbers and strings as they are, lists and dicts as compact JSON.
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return value


def load(results: str | os.PathLike[str]) -> Results:
    """Read a results folder (see the module docstring).

    Parameters
    ----------
    results : path-like
        The folder holding ``<job>_<task>.jsonl`` records and ``manifest-*.json`` files.

    Returns
    -------
    Results
    """
    st = _sweep.collect(results)
    rows: list[dict[str, Any]] = []
    histories: list[dict[str, Any]] = []
    for t in st.tasks:
        rec = t.record or {}
        params = dict(rec.get("params") or {})
        mpi = rec.get("mpi") or {}
        slurm = rec.get("slurm") or {}
        pkg = rec.get("optcc_mpi") or {}
        base = {
            "table": rec.get("table") or Path(t.sweep).stem,
            "array_job_id": t.job,
            "array_task_id": t.task,
            "status": t.status,
            "exit_code": rec.get("exit_code"),
            "kind": rec.get("kind"),
            "attempts": len(t.attempts),
            "nodelist": slurm.get("nodelist"),
            "mpi_vendor": mpi.get("vendor"),
            "mpi_version": mpi.get("version"),
            "optcc_mpi_version": pkg.get("version"),
            "git_rev": pkg.get("git_rev"),
            "wall_s": rec.get("wall_s"),
            "note": rec.get("note"),
        }
        param_cols = {k: v for k, v in params.items() if k not in ("row",)}
        if not t.rows:
            # A failed or missing task still gets its line: status and parameters, with
            # `wrong` unknown (empty), so the CSV shows every task that was asked for.
            row = {**base, "wrong": None, **param_cols}
            if t.status == "failed":
                why = _sweep.error_line(rec.get("log_tail") or [])
                row["error_line"] = why[:300] if why else None
            rows.append(row)
            continue
        for r in t.rows:
            row = dict(base)
            for k, v in r.items():
                if k in ("record", "history"):
                    continue
                row[k] = _flat(v)
            # Parameters fill only what the command did not report itself: the result
            # row says what actually ran.
            for k, v in param_cols.items():
                row.setdefault(k, v)
            row["loss"] = _loss_of(r, params)
            if r.get("record") == "train":
                row.setdefault("dataset", params.get("dataset"))
                histories.append({**row, "history": r.get("history") or []})
            rows.append(row)
    return Results(rows, st, histories)


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write rows as CSV, the lead columns first (``LEAD_COLUMNS``), then the rest."""
    seen: dict[str, None] = {}
    for c in LEAD_COLUMNS:
        if any(c in r for r in rows) or c in ("array_job_id", "array_task_id", "wrong"):
            seen[c] = None
    for r in rows:
        for c in r:
            seen.setdefault(c, None)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(seen), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in r.items()})
    return path


# ----------------------------------------------------------------------------- plotting


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on cluster nodes or CI
    import matplotlib.pyplot as plt

    return plt


#: Colours and markers of what is not a registered algorithm.
STYLE = {
    "auto": ("tab:green", "v"),
    "gloo": ("tab:brown", "P"),
    REFERENCE: ("black", "x"),
}
#: Colours and markers given to the registered algorithms in listing order, so every
#: figure shows one algorithm alike.
_PALETTE = (
    ("tab:red", "s"),
    ("tab:blue", "o"),
    ("tab:orange", "^"),
    ("tab:gray", "D"),
    ("tab:purple", "*"),
    ("tab:pink", "h"),
    ("tab:olive", "X"),
    ("tab:cyan", "p"),
)


def algorithm_style(name: str) -> tuple[str, str]:

    if name in STYLE:
        return STYLE[name]
    names = algorithms.names()
    i = names.index(name) if name in names else len(names)
    return _PALETTE[i % len(_PALETTE)]


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _bench_rows(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [
        r
        for r in rows
        if r.get("kind") == "allreduce"
        and r.get("status") == "ok"
        and _num(r.get("time_us")) is not None
    ]


def _panels(n: int) -> tuple[int, int]:
    cols = min(n, 3)
    return (n + cols - 1) // cols, cols


def _grid(plt: Any, n: int, w: float = 5.2, h: float = 4.0) -> tuple[Any, list[Any]]:
    nr, nc = _panels(n)
    fig, axes = plt.subplots(nr, nc, figsize=(w * nc, h * nr), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def plot_overhead_vs_loss(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Overhead over the fault-free ring against bandwidth loss, one panel per p.

    Points: measured ``ratio_fault_free`` at the largest message size of each run (the
    bandwidth-bound end, which the model describes). Lines: the fluid model of each
    algorithm with the measured run's straggler set, and the lower bound (dashed).
    """

    pts = [
        r
        for r in _bench_rows(rows)
        if r.get("algorithm") != REFERENCE
        and _num(r.get("ratio_fault_free")) is not None
        and _num(r.get("loss")) is not None
    ]
    if not pts:
        return None
    largest: dict[tuple[Any, ...], float] = {}
    for r in pts:
        key = (r.get("table"), r.get("array_job_id"), r.get("array_task_id"), r["algorithm"])
        largest[key] = max(largest.get(key, 0.0), float(r["size"]))
    pts = [
        r
        for r in pts
        if float(r["size"])
        == largest[(r.get("table"), r.get("array_job_id"), r.get("array_task_id"), r["algorithm"])]
    ]
    ps = sorted({int(r["p"]) for r in pts})
    plt = pyplot()
    fig, axes = _grid(plt, len(ps))
    for ax, p in zip(axes, ps):
        mine = [r for r in pts if int(r["p"]) == p]
        algs = sorted({r["algorithm"] for r in mine})
        # The model lines use the straggler set of the runs (rank 0 unless said otherwise).
        stragglers = _stragglers_of(mine)
        xmax = max(0.5, max(float(r["loss"]) for r in mine))
        grid = [i / 100 * xmax for i in range(0, 101)]
        for alg in algs:
            color, marker = algorithm_style(alg)
            xs = [100 * float(r["loss"]) for r in mine if r["algorithm"] == alg]
            ys = [100 * (float(r["ratio_fault_free"]) - 1) for r in mine if r["algorithm"] == alg]
            ax.scatter(xs, ys, color=color, marker=marker, s=42, zorder=3, label=f"{alg} measured")
            fn = algorithms.get(alg).time if alg in algorithms.names() else None
            if fn is not None and p > 2:
                free = model.fault_free(p, 1.0, 1.0)
                ys_m = [
                    100 * (fn(p, 1.0, 1.0, _slow_links(stragglers, x)) / free - 1) for x in grid
                ]
                ax.plot(
                    [100 * x for x in grid],
                    ys_m,
                    color=color,
                    lw=1.4,
                    alpha=0.8,
                    label=f"{alg} model",
                )
        if p > 1:
            yb = [
                100
                * (
                    model.lower_bound(p, 1.0, 1.0, _slow_links(stragglers, x))
                    / model.fault_free(p, 1.0, 1.0)
                    - 1
                )
                for x in grid
            ]
            # Wide and pale, under the model lines: OptCC's model meets the bound, and
            # both must stay visible where they coincide.
            ax.plot(
                [100 * x for x in grid],
                yb,
                color="0.3",
                ls="--",
                lw=3.2,
                alpha=0.45,
                zorder=1,
                label="lower bound",
            )
        ax.axhline(0, color="0.6", lw=0.8)
        ax.set_title(f"p = {p} ranks, degraded: {_describe(stragglers)}")
        ax.set_xlabel("bandwidth lost by the degraded rank(s) (%)")
        ax.set_ylabel("time over fault-free ring (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        "AllReduce overhead against bandwidth loss (points: measured at the "
        "largest size; lines: fluid model)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _stragglers_of(rows: Sequence[Mapping[str, Any]]) -> tuple[int, ...]:
    for r in rows:
        text = r.get("links")
        if text:
            try:
                return Links.parse(str(text)).degraded
            except ValueError:
                continue
    return (0,)


def _slow_links(stragglers: Sequence[int], loss: float) -> Links:
    if loss <= 0:
        return Links()
    return Links({r: 1.0 - loss for r in stragglers})


def _describe(ranks: Sequence[int]) -> str:
    if not ranks:
        return "none"
    if len(ranks) > 1 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return (
        "rank " + ",".join(map(str, ranks))
        if len(ranks) == 1
        else "ranks " + ",".join(map(str, ranks))
    )


def plot_time_vs_size(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Median time against message size, one panel per (p, loss), log-log, with the
    fault-free reference ring and (dotted) each algorithm's modelled time when known."""
    pts = _bench_rows(rows)
    if not pts:
        return None
    keys = sorted({(int(r["p"]), round(float(r.get("loss") or 0), 4)) for r in pts})
    plt = pyplot()
    fig, axes = _grid(plt, len(keys))
    for ax, (p, loss) in zip(axes, keys):
        mine = [r for r in pts if int(r["p"]) == p and round(float(r.get("loss") or 0), 4) == loss]
        for alg in sorted({r["algorithm"] for r in mine}, key=lambda a: (a == REFERENCE, a)):
            color, marker = algorithm_style(alg)
            by_size: dict[float, list[float]] = defaultdict(list)
            model_us: dict[float, list[float]] = defaultdict(list)
            for r in mine:
                if r["algorithm"] == alg:
                    by_size[float(r["size"])].append(float(r["time_us"]))
                    m = _num(r.get("model_us"))
                    if m is not None:
                        model_us[float(r["size"])].append(m)
            xs = sorted(by_size)
            ax.plot(
                xs,
                [statistics.median(by_size[x]) for x in xs],
                color=color,
                marker=marker,
                ls="--" if alg == REFERENCE else "-",
                label=alg,
            )
            xm = sorted(model_us)
            if len(xm) > 1 and alg != REFERENCE:
                ax.plot(
                    xm,
                    [statistics.median(model_us[x]) for x in xm],
                    color=color,
                    ls=":",
                    lw=1.2,
                    alpha=0.8,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        _readable_axes(ax, sorted({float(r["size"]) for r in mine}))
        ax.set_title(f"p = {p}, bandwidth loss {100 * loss:g}%")
        ax.set_xlabel("message size per rank")
        ax.set_ylabel("time per AllReduce (ms)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(
        "AllReduce time against message size (solid: measured median; dotted: model)", fontsize=11
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _size_label(nbytes: float) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}"


def _readable_axes(ax: Any, sizes: Sequence[float]) -> None:
    """Sizes as 256K, 1M, ... at the measured sizes; times in ms as plain numbers, where
    matplotlib's log axes would print 9.8x10^4."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_xticks(sizes)
    ax.set_xticklabels([_size_label(s) for s in sizes])
    ax.xaxis.set_minor_formatter(NullFormatter())
    if len(sizes) == 1:
        ax.set_xlim(sizes[0] / 2, sizes[0] * 2)
    lo, hi = ax.get_ylim()
    if hi / max(lo, 1e-300) < 4:
        # Less than a factor 4 apart: a log axis would show one tick or none.
        ax.set_yscale("linear")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e3:g}"))
        return

    def ms(v: float, minor: bool) -> str:
        x = v / 1e3
        if minor and f"{x:e}"[0] not in "25":  # 2 and 5 between the decades suffice
            return ""
        return f"{x:.0f}" if x >= 10 else f"{x:.2g}"

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: ms(v, False)))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ms(v, True)))


def _run_label(h: Mapping[str, Any]) -> str:
    parts = [str(h.get("solver") or "?")]
    if h.get("solver") == "casgd":
        parts.append(f"s={h.get('s')}")
    parts += [f"b={h.get('b')}", str(h.get("recipe") or "")]
    if h.get("algorithm") not in (None, "", "mpi"):
        parts.append(str(h["algorithm"]))
    return " ".join(p for p in parts if p)


def plot_casgd_loss(histories: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Training loss against training time, one line per run, one panel per (dataset, p)."""
    runs = [h for h in histories if h.get("status") == "ok" and h.get("history")]
    if not runs:
        return None
    keys = sorted(
        {(str(h.get("dataset") or h.get("data") or "?"), int(h.get("p") or 0)) for h in runs}
    )
    plt = pyplot()
    fig, axes = _grid(plt, len(keys), w=6.0)
    for ax, (data, p) in zip(axes, keys):
        mine = [
            h
            for h in runs
            if (str(h.get("dataset") or h.get("data") or "?"), int(h.get("p") or 0)) == (data, p)
        ]
        mine.sort(key=lambda h: (str(h.get("solver")), int(h.get("s") or 0), str(h.get("recipe"))))
        cmap = plt.get_cmap("viridis")
        for i, h in enumerate(mine):
            pts = [
                (float(e["train_s"]), float(e["loss"]))
                for e in h["history"]
                if _num(e.get("train_s")) is not None and _num(e.get("loss")) is not None
            ]
            if not pts:
                continue
            color = "tab:red" if h.get("solver") == "sgd" else cmap(i / max(1, len(mine) - 1))
            ax.plot(*zip(*pts), marker="o", ms=3, color=color, label=_run_label(h))
        ax.set_title(f"{Path(data).name}, p = {p}")
        ax.set_xlabel("training time (s, loss evaluation excluded)")
        ax.set_ylabel("training loss (full objective)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("CA-SGD: loss against time, per solver and s", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_casgd_speedup(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Speedup of CA-SGD against s: training time and communication time.

    Runs are grouped by (dataset, p, b, recipe, algorithm). A group's baseline is its own
    SGD run, else an SGD run of the same (dataset, p, b, algorithm) in another recipe
    (named in the legend), else the group's smallest s. A group whose only run is its own
    baseline says nothing and is left out.
    """
    runs = [
        r
        for r in rows
        if r.get("kind") == "casgd" and r.get("status") == "ok" and _num(r.get("train_s"))
    ]
    if not runs:
        return None

    def med(rs: Iterable[Mapping[str, Any]], key: str) -> float | None:
        vals = [float(r[key]) for r in rs if _num(r.get(key))]
        return statistics.median(vals) if vals else None

    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = defaultdict(list)
    for r in runs:
        key = (str(r.get("dataset")), r.get("p"), r.get("b"), r.get("recipe"), r.get("algorithm"))
        groups[key].append(r)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.8, 4.6))
    all_s: set[int] = set()
    plotted = 0
    for key, mine in sorted(groups.items(), key=lambda kv: str(kv[0])):
        data, p, b, recipe, alg = key
        ca = [r for r in mine if r.get("solver") == "casgd"]
        base = [r for r in mine if r.get("solver") == "sgd"]
        base_name = "SGD"
        if not base:
            base = [
                r
                for r in runs
                if r.get("solver") == "sgd"
                and (str(r.get("dataset")), r.get("p"), r.get("b"), r.get("algorithm"))
                == (data, p, b, alg)
            ]
            base_name = f"SGD {base[0].get('recipe')}" if base else ""
        if not base and ca:
            s0 = min(int(r.get("s") or 1) for r in ca)
            base = [r for r in ca if int(r.get("s") or 1) == s0]
            base_name = f"s={s0}"
        ss = sorted({int(r.get("s") or 1) for r in ca})
        if not base or not ss or (base_name.startswith("s=") and len(ss) < 2):
            continue
        t0, c0 = med(base, "train_s"), med(base, "comm_s")
        color = plt.get_cmap("tab10")(plotted % 10)
        label = f"{Path(data).name} p={p} b={b} {recipe}" + (
            f" {alg}" if alg not in (None, "", "mpi") else ""
        )
        at = {s: [r for r in ca if int(r.get("s") or 1) == s] for s in ss}
        ax.plot(
            ss,
            [t0 / med(at[s], "train_s") for s in ss],
            marker="o",
            color=color,
            label=f"{label}: training time vs {base_name}",
        )
        if c0:
            cc = [c0 / c if (c := med(at[s], "comm_s")) else math.nan for s in ss]
            ax.plot(
                ss,
                cc,
                marker="s",
                ls="--",
                color=color,
                alpha=0.7,
                label=f"{label}: communication vs {base_name}",
            )
        all_s.update(ss)
        plotted += 1
    if not plotted:
        plt.close(fig)
        return None
    ax.axhline(1, color="0.5", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(all_s))
    ax.set_xticklabels([str(s) for s in sorted(all_s)])
    ax.xaxis.set_minor_formatter(_null_formatter())
    ax.set_xlabel("s (SGD steps per AllReduce)")
    ax.set_ylabel("speedup over the baseline (> 1: faster)")
    ax.set_title("CA-SGD speedup against s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _null_formatter() -> Any:
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def plot_results(res: Results, outdir: str | os.PathLike[str]) -> list[Path]:
    """Draw every plot the results allow into ``outdir``; returns the files written."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    made = [
        plot_overhead_vs_loss(res.rows, out / "overhead_vs_loss.png"),
        plot_time_vs_size(res.rows, out / "time_vs_size.png"),
        plot_casgd_loss(res.histories, out / "casgd_loss_vs_time.png"),
        plot_casgd_speedup(res.rows, out / "casgd_speedup_vs_s.png"),
    ]
    return [m for m in made if m is not None]


# ----------------------------------------------------------------------------- link logs


def link_runs(records: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """The records of a link log grouped by run (in the order the runs start), each run's
    in file order."""
    runs: dict[str, list[Mapping[str, Any]]] = {}
    for rec in records:
        runs.setdefault(str(rec.get("run")), []).append(rec)
    return list(runs.values())


def _when(t: float) -> str:
    import time as _time

    return _time.strftime("%Y-%m-%d %H:%M:%S", _time.localtime(t))


def links_summary(records: Sequence[Mapping[str, Any]]) -> str:
    """A text account of a link log: per run, where and when it ran, then one line per
    change (profile adopted, algorithm run, doctor's verdict), with the time since the
    run started and the call number."""
    lines = []
    for run in link_runs(records):
        start = run[0]
        t0 = float(start.get("time", 0.0))
        head = run[0] if run[0].get("event") == "start" else {}
        p = next((r.get("p") for r in run if r.get("p") is not None), "?")
        where = f"{head.get('host', '?')} pid {head.get('pid', '?')}"
        if head.get("job"):
            where += f", job {head['job']}"
        calls = [r for r in run if r.get("call") is not None and r.get("source") == "watch"]
        last = max((int(r["call"]) for r in calls), default=0)
        lines.append(
            f"run {start.get('run')} ({where}): {p} ranks, started {_when(t0)}"
            + (f", {last} calls recorded" if calls else "")
        )
        for rec in run:
            ev = rec.get("event")
            dt = f"+{float(rec.get('time', t0)) - t0:8.1f} s"
            call = rec.get("call")
            at = f"call {call:>6}" if call is not None else " " * 11
            if ev == "adopt":
                text = f"adopted {rec.get('links')}"
                if rec.get("why"):
                    text += f": {rec['why']}"
            elif ev == "probe":
                text = f"probed on suspecting {rec.get('suspected')}: found {rec.get('links')}"
                if not rec.get("adopted"):
                    text += ", the profile stays"
            elif ev == "call":
                text = f"ran {rec.get('algorithm')} under {rec.get('links')}"
                if rec.get("explore"):
                    text += " (exploring: the healthy profile)"
            elif ev == "doctor":
                text = f"doctor: {rec.get('summary') or rec.get('status')}"
            else:
                continue
            lines.append(f"  {dt}  {at}  {text}")
    return "\n".join(lines)


def plot_links(records: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path | None:
    """Draw a link log's timeline, one panel pair per run: every rank's fraction over
    time (the profile in force as a step line, the measurements the watch made at its
    records as dots, the doctor's verdicts as diamonds; ranks that were healthy
    throughout as one grey line), and a strip of the algorithm each call ran. Returns the
    file, or None when the log holds nothing to draw."""
    runs = [r for r in link_runs(records) if any(x.get("fractions") for x in r)]
    if not runs:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(
        2 * len(runs), 1, figsize=(10, 4.2 * len(runs)), squeeze=False,
        gridspec_kw={"height_ratios": [4, 1] * len(runs)},
    )  # fmt: skip
    colours = plt.get_cmap("tab10")
    for k, run in enumerate(runs):
        ax, strip = axes[2 * k][0], axes[2 * k + 1][0]
        t0 = float(run[0].get("time", 0.0))
        rows = [r for r in run if r.get("fractions")]
        t_end = max(float(r.get("time", t0)) for r in run) - t0
        t_end = t_end if t_end > 0 else 1.0
        p = len(rows[0]["fractions"])
        profile = [r for r in rows if r.get("event") in ("adopt", "call")]
        doctor = [r for r in rows if r.get("event") == "doctor"]
        slow = sorted(
            {i for r in rows for i, f in enumerate(r["fractions"]) if f is not None and f < 1}
            | {
                i
                for r in rows
                for i, f in enumerate(r.get("measured") or [])
                if f is not None and f < 1
            }
        )
        for j, rank in enumerate(slow):
            c = colours(j % 10)
            # Ranks adopted together would hide each other: a small offset apiece.
            dy = 0.008 * (j - (len(slow) - 1) / 2)
            if profile:
                ts = [float(r["time"]) - t0 for r in profile] + [t_end]
                fs = [r["fractions"][rank] + dy for r in profile]
                ax.step(ts, fs + fs[-1:], where="post", color=c, lw=2, label=f"rank {rank}")
                meas = [
                    (float(r["time"]) - t0, r["measured"][rank])
                    for r in profile
                    if r.get("measured")
                ]
                if meas:
                    ax.plot(*zip(*meas), ".", color=c, alpha=0.5, ms=5)
            if doctor:
                ax.plot(
                    [float(r["time"]) - t0 for r in doctor],
                    [r["fractions"][rank] for r in doctor],
                    "D", color=c, ms=7, mec="k",
                    label=None if profile else f"rank {rank} (doctor)",
                )  # fmt: skip
        healthy = [i for i in range(p) if i not in slow]
        if healthy:
            ax.axhline(1.0, color="0.6", lw=1.5, label=f"{len(healthy)} ranks healthy throughout")
        for r in run:
            if r.get("event") == "adopt":
                ax.axvline(float(r["time"]) - t0, color="0.85", lw=0.8, zorder=0)
                ax.annotate(
                    f"call {r.get('call')}", (float(r["time"]) - t0, 1.02),
                    fontsize=7, rotation=90, va="bottom", ha="center",
                )  # fmt: skip
        ax.set_ylim(0, 1.15)
        ax.set_xlim(0, t_end)
        ax.set_ylabel("bandwidth fraction")
        head = run[0] if run[0].get("event") == "start" else {}
        ax.set_title(
            f"run {run[0].get('run')}: {p} ranks on {head.get('host', '?')}, started {_when(t0)}",
            fontsize=9,
        )
        ax.legend(fontsize=7, loc="lower left", ncol=2)
        # The algorithm strip: a span per stretch of calls that ran the same algorithm.
        # A call record is written when the call has run; the call began when its profile
        # was adopted, if it was adopted then.
        began = {r.get("call"): float(r["time"]) for r in run if r.get("event") == "adopt"}
        calls = [r for r in run if r.get("event") == "call" and r.get("algorithm")]
        starts = [began.get(r.get("call"), float(r["time"])) - t0 for r in calls]
        seen: dict[str, Any] = {}
        for i, r in enumerate(calls):
            a = str(r["algorithm"]) + (" (explore)" if r.get("explore") else "")
            x0 = starts[i]
            x1 = starts[i + 1] if i + 1 < len(calls) else t_end
            colour = algorithm_style(str(r["algorithm"]))[0]
            strip.axvspan(x0, x1, color=colour, alpha=0.35 if r.get("explore") else 0.8,
                          label=a if a not in seen else None)  # fmt: skip
            seen[a] = True
        strip.set_xlim(0, t_end)
        strip.set_yticks([])
        strip.set_xlabel("seconds since the run started")
        strip.set_ylabel("algorithm", fontsize=8)
        if seen:
            strip.legend(fontsize=7, loc="upper left", ncol=min(4, len(seen)))
        else:
            strip.text(0.5, 0.5, "no algorithm recorded", ha="center", va="center",
                       transform=strip.transAxes, fontsize=8)  # fmt: skip
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
