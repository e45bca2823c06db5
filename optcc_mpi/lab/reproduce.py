"""The paper's setting by simulation: p up to 1024, 12.5% to 50% bandwidth loss, one or
several GPUs per server, set beside the paper's claims (``optcc-mpi report --simulate``).

Several GPUs per server (our reading, not the paper's statement)
----------------------------------------------------------------
An 8-GPU server with one NIC per GPU that loses some NICs keeps running by rerouting the
affected GPUs' traffic over the surviving NICs (NCCL's PXN). Rerouting spreads the loss:
every GPU of that server then sees the server's lost fraction X of its bandwidth. We model
the degraded server's g GPUs as g ranks, each at ``1 - X`` of the healthy rate, in one
flat job of p ranks. Other readings exist (``docs/report.md``); the numbers depend on it.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from optcc_mpi import algorithms, model
from optcc_mpi import algorithms as registry
from optcc_mpi.lab.report import algorithm_style, pyplot
from optcc_mpi.links import Links
from optcc_mpi.progress import Progress
from optcc_mpi.simulate import simulate

__all__ = [
    "PAPER",
    "reproduce",
    "reproduction_markdown",
    "write_reproduction_csv",
    "plot_reproduction",
]

#: The paper's claims (arXiv 2606.01680, abstract), as fractions of the fault-free time.
PAPER = {
    "optcc": (0.02, 0.06),  # "within 2-6% of NCCL's fault-free ring", up to 50% loss
    "r2ccl": (None, 0.57),  # the previous state of the art: "up to 57%"
    "max_loss": 0.5,
}


def _simulate_one(
    alg: str,
    p: int,
    count: int,
    links: Links,
    *,
    bw: float,
    latency: float,
    params: Mapping[str, Any],
) -> tuple[float, dict[str, Any]]:

    # Built directly, not through the registry's cache: at p = 1024 a schedule takes
    # gigabytes, and each is dropped once timed.
    entry = algorithms.get(alg)
    entry.check_params(params)
    sched = entry.build(p, count, links, **params)
    res = simulate(sched, links, bw=bw, latency=latency)
    info = {"ops": int(sched.n_ops)}
    k = sched.params.get("k")
    if k:
        info["k"] = ",".join(map(str, k)) if isinstance(k, (tuple, list)) else str(k)
    del sched
    return res.time, info


def reproduce(
    ps: Sequence[int] = (8, 16, 32, 64, 128, 256, 512, 1024),
    losses: Sequence[float] = (0.125, 0.25, 0.375, 0.5),
    gpus_per_server: Sequence[int] = (1, 8),
    *,
    algorithms: Sequence[str] = ("ring", "r2ccl", "optcc"),
    size: int = 1 << 30,
    bw: float = 50e9,
    latency: float = 0.0,
    sim_max_p: int | Mapping[str, int] = 1024,
    params: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """The paper's setting: overhead over the fault-free ring for each configuration.

    Parameters
    ----------
    ps : sequence of int
        Total ranks (GPUs). Configurations with ``p < 2 g`` are skipped: the degraded
        server would be (more than) the whole job.
    losses : sequence of float
        Fraction X of the degraded server's bandwidth that is lost.
    gpus_per_server : sequence of int
        g: the degraded server's GPUs, modelled as ranks 0..g-1 each at ``1 - X``
        (the module docstring says why).
    algorithms : sequence of str
        Among ring, r2ccl, optcc.
    size : int
        Bytes per rank (only the simulator's segment and chunk sizes depend on it).
    bw : float
        Healthy NIC rate, bytes/s per direction (50e9: a 400 Gb/s NIC).
    latency : float
        Seconds per message in the simulator (0: the fluid model's setting).
    sim_max_p : int or mapping of str to int
        Largest p simulated, per algorithm or for all; beyond it the closed-form model
        gives the number and the ``source`` column says so.
    params : mapping, optional
        Schedule parameters for the simulator, each given to the algorithms that take it
        (e.g. ``{"k": 32}``: OptCC's pipeline segments, ``{"pattern": "closer"}``),
        recorded in the ``params`` column of those algorithms.
    progress : bool
        Print a progress bar to standard error.

    Returns
    -------
    list of dict
        One row per (g, p, X, algorithm): ``overhead`` (time / fault-free - 1) from the
        ``source`` (``simulator`` or ``model``), both ``overhead_model`` and
        ``overhead_sim`` (None where not simulated), ``overhead_bound`` (the lower bound's),
        the paper's claim and a note.
    """

    limits = (
        dict(sim_max_p)
        if isinstance(sim_max_p, Mapping)
        else {a: int(sim_max_p) for a in algorithms}
    )
    configs = [(g, p, x) for g in gpus_per_server for p in ps for x in losses if p >= 2 * g]
    rows: list[dict[str, Any]] = []
    bar = Progress(len(configs) * len(algorithms), "simulating", enabled=progress, unit="run")
    itemsize = 4
    count = size // itemsize
    for g, p, x in configs:
        links = Links({r: 1.0 - x for r in range(g)})
        ff = model.fault_free(p, size, bw)
        bound = model.lower_bound(p, size, bw, links) / ff - 1
        for alg in algorithms:
            mine = {k: v for k, v in (params or {}).items() if k in registry.get(alg).params}
            t_model = registry.get(alg).time(p, size, bw, links, **mine)
            row: dict[str, Any] = {
                "gpus_per_server": g,
                "p": p,
                "loss": x,
                "algorithm": alg,
                "overhead_model": t_model / ff - 1,
                "overhead_sim": None,
                "overhead_bound": bound,
                "size": size,
                "bw": bw,
                "latency": latency,
            }
            if p <= limits.get(alg, 0):
                t_sim, info = _simulate_one(
                    alg,
                    p,
                    count,
                    links,
                    bw=bw,
                    latency=latency,
                    params=mine,
                )
                row["overhead_sim"] = t_sim / ff - 1
                row.update(info)
                if mine:
                    row["params"] = ",".join(f"{k}={v}" for k, v in sorted(mine.items()))
                row["source"] = "simulator"
                row["overhead"] = row["overhead_sim"]
            else:
                row["source"] = "model"
                row["overhead"] = row["overhead_model"]
            claim = PAPER.get(alg)
            if claim:
                lo, hi = claim
                row["paper_claim"] = (
                    f"{100 * lo:g}-{100 * hi:g}%" if lo is not None else f"up to {100 * hi:g}%"
                )
            rows.append(row)
            bar.update(1, postfix=f"g={g} p={p} X={x:g} {alg}")
    bar.close()
    return rows


def write_reproduction_csv(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """The reproduction rows as CSV (overheads as fractions, e.g. 0.0323 = 3.23%)."""
    cols = [
        "gpus_per_server",
        "p",
        "loss",
        "algorithm",
        "overhead",
        "source",
        "overhead_model",
        "overhead_sim",
        "overhead_bound",
        "paper_claim",
        "k",
        "params",
        "ops",
        "size",
        "bw",
        "latency",
    ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in cols})
    return path


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _cell(
    rows: Sequence[Mapping[str, Any]], g: int, p: int, alg: str, key: str, loss: float | None = None
) -> float | None:
    """One value: at ``loss``, or the worst over the losses up to the paper's 50% ("with up
    to 50% bandwidth loss") when ``loss`` is None."""
    vals = [
        r[key]
        for r in rows
        if r["gpus_per_server"] == g
        and r["p"] == p
        and r["algorithm"] == alg
        and r.get(key) is not None
        and (
            r["loss"] <= PAPER["max_loss"] + 1e-9 if loss is None else abs(r["loss"] - loss) < 1e-9
        )
    ]
    return max(vals) if vals else None


def reproduction_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The comparison with the paper's claims, as Markdown: two tables and notes.

    Table 1 gives, per (g, p), the worst overhead over the losses simulated (the claims are
    "with up to 50% loss"): the lower bound, then each algorithm's closed-form model and,
    where p was small enough, the discrete-event simulation of our schedule. Table 2 breaks
    OptCC's simulated overhead down by loss, which is where model and simulation part.
    """
    gs = sorted({r["gpus_per_server"] for r in rows})
    algs = [a for a in ("optcc", "r2ccl", "ring") if any(r["algorithm"] == a for r in rows)]
    names = {"optcc": "OptCC", "r2ccl": "R2CCL", "ring": "ring"}
    out = [
        "Overhead = time / fault-free ring - 1, worst over bandwidth losses up to 50%. "
        "`model`: closed-form fluid model; `sim`: discrete-event simulation of our schedule "
        "(`-`: p above --sim-max-p). Paper: OptCC within 2-6%, R2CCL up to 57%.",
        "",
    ]
    params = sorted({r["params"] for r in rows if r.get("params")})
    if params:
        out[-1:-1] = [f"OptCC's schedule in the simulator ran with {'; '.join(params)}."]
    head = ["g", "p", "bound"]
    for a in algs:
        head += [f"{names[a]} model", f"{names[a]} sim"]
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    for g in gs:
        for p in sorted({r["p"] for r in rows if r["gpus_per_server"] == g}):
            cells = [str(g), str(p), _pct(_cell(rows, g, p, algs[0], "overhead_bound"))]
            for a in algs:
                cells += [
                    _pct(_cell(rows, g, p, a, "overhead_model")),
                    _pct(_cell(rows, g, p, a, "overhead_sim")),
                ]
            out.append("| " + " | ".join(cells) + " |")
    sims = [r for r in rows if r["algorithm"] == "optcc" and r.get("overhead_sim") is not None]
    if sims:
        losses = sorted({r["loss"] for r in rows})
        out += ["", "OptCC by bandwidth loss where simulated: sim (model).", ""]
        out.append("| g | p | " + " | ".join(f"X = {100 * x:g}%" for x in losses) + " |")
        out.append("|" + "---|" * (2 + len(losses)))
        for g, p in sorted({(r["gpus_per_server"], r["p"]) for r in sims}):
            cells = [str(g), str(p)]
            for x in losses:
                s, m = (
                    _cell(rows, g, p, "optcc", k, x) for k in ("overhead_sim", "overhead_model")
                )
                cells.append(f"{_pct(s)} ({_pct(m)})")
            out.append("| " + " | ".join(cells) + " |")
    out += ["", *_notes(rows)]
    return "\n".join(out) + "\n"


def _notes(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Notes comparing our numbers with the paper's, computed from the rows."""
    out = ["Notes:", ""]
    lo_claim, hi_claim = PAPER["optcc"]
    xmax = max(r["loss"] for r in rows)
    for g in sorted({r["gpus_per_server"] for r in rows}):
        ps = sorted({r["p"] for r in rows if r["gpus_per_server"] == g})
        bound = {p: _cell(rows, g, p, "optcc", "overhead_bound") for p in ps}
        if any(v is None for v in bound.values()):
            continue
        shown = ", ".join(f"{_pct(bound[p])} at p = {p}" for p in ps[:4])
        if len(ps) > 4:
            shown += f", ..., {_pct(bound[ps[-1]])} at p = {ps[-1]}"
        text = (
            f"- g = {g}: the lower bound (no schedule beats it in our model) is {shown} "
            f"(worst loss {100 * xmax:g}%)."
        )
        above = [p for p in ps if bound[p] > hi_claim + 1e-9]
        if above:
            rest = [p for p in ps if p > max(above)]
            text += (
                f' Up to p = {max(above)} it exceeds the paper\'s 6%, so "within 2-6%" '
                "cannot hold there under this model"
                + (f"; from p = {rest[0]} on it can." if rest else ".")
            )
        out.append(text)
        opt = {p: _cell(rows, g, p, "optcc", "overhead_model") for p in ps}
        within = [p for p in ps if opt[p] is not None and lo_claim <= opt[p] <= hi_claim + 1e-9]
        below = [p for p in ps if opt[p] is not None and opt[p] < lo_claim]
        if within or below:
            out.append(
                f"- g = {g}: OptCC's model meets the bound (its plan of per-rank shares), so it is "
                f"within 2-6% at p = {', '.join(map(str, within)) or 'none of these'}"
                + (f" and below 2% from p = {below[0]} on." if below else ".")
            )
        r2 = [_cell(rows, g, p, "r2ccl", "overhead_model") for p in ps]
        if all(v is not None for v in r2):
            out.append(
                f"- g = {g}: R2CCL's model gives {_pct(min(r2))} to {_pct(max(r2))}; the "
                "paper's \"up to 57%\" is R2CCL's own model at p = 8, X = 50% (p/(2(p-1)))."
            )
        sim = [
            r
            for r in rows
            if r["gpus_per_server"] == g
            and r["algorithm"] == "optcc"
            and r.get("overhead_sim") is not None
        ]
        if not sim:
            continue
        at_max = [r for r in sim if abs(r["loss"] - xmax) < 1e-9]
        others = [r for r in sim if abs(r["loss"] - xmax) >= 1e-9]
        ring = {
            (r["p"], r["loss"]): r["overhead_sim"]
            for r in rows
            if r["gpus_per_server"] == g
            and r["algorithm"] == "ring"
            and r.get("overhead_sim") is not None
        }
        worse = [r for r in sim if r["overhead_sim"] > ring.get((r["p"], r["loss"]), math.inf)]
        # The fluid model leaves out the pipeline's head and tail, about 1/k of the time for
        # k segments: a gap up to a few percent is that; anything larger is the schedule.
        pipeline_gap = 0.05
        if at_max:
            gap = max(r["overhead_sim"] - r["overhead_model"] for r in at_max)
            if gap <= pipeline_gap:
                out.append(
                    f"- g = {g}, simulated: at X = {100 * xmax:g}% our OptCC schedule is at most "
                    f"{_pct(gap)} (absolute) above its model: the pipeline's head and tail "
                    "(about 1/k of the time for k segments), which the fluid model leaves out."
                )
            else:
                out.append(
                    f"- g = {g}, simulated: at X = {100 * xmax:g}% our OptCC schedule is up to "
                    f"{_pct(gap)} (absolute) above its model, far more than the pipeline's "
                    "head and tail explain."
                )
        at_max_fine = bool(at_max) and all(
            r["overhead_sim"] - r["overhead_model"] <= pipeline_gap for r in at_max
        )
        if others and at_max_fine:
            # Only where the largest loss is fine does a larger gap at smaller losses point
            # at the plan's small shares for the degraded ranks rather than the schedule.
            gap = max(r["overhead_sim"] - r["overhead_model"] for r in others)
            if gap > pipeline_gap:
                out.append(
                    f"- g = {g}, simulated: at smaller losses, where the plan gives the "
                    "degraded ranks small shares of every segment, our schedule is up to "
                    f"{_pct(gap)} (absolute) above the model. A gap of our implementation, "
                    "not of OptCC's bound."
                )
        if worse:
            out.append(
                f"- g = {g}, simulated: in {len(worse)} of {len(sim)} configurations our OptCC "
                "schedule is slower than the plain ring (e.g. "
                + ", ".join(
                    f"p = {r['p']}, X = {100 * r['loss']:g}%: {_pct(r['overhead_sim'])}"
                    for r in worse[:2]
                )
                + ") although the model's plan for the same split is within the bound. Treat "
                "these simulated numbers as a defect of our schedule with several degraded "
                "ranks, to be fixed, not as OptCC's cost."
            )
    out += [
        "- Several GPUs per server is our reading: the degraded server's g GPUs are g ranks, "
        "each at 1 - X of the healthy rate (one NIC lost on an 8-NIC server, rerouted by PXN, "
        "slows every GPU of that server). The paper's own multi-GPU model is not available; "
        "if it treats the server as one straggler node with g times the bandwidth, its "
        "overheads would be closer to our g = 1 column at p / g ranks.",
        "- The paper's numbers come from SimAI; ours from a fluid model and our own "
        "discrete-event simulator of our schedules (full-duplex NICs, no congestion, no "
        "packets, latency as given). The paper's message sizes and NIC rates are unknown.",
    ]
    return out


def plot_reproduction(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Overhead against p, one panel per g, log scales: the worst over losses up to 50% for
    the models (lines) and the simulations (filled markers), the simulation at the largest
    loss (hollow markers), the lower bound, and the paper's claims as a band and a line.
    """
    plt = pyplot()
    gs = sorted({r["gpus_per_server"] for r in rows})
    xmax = max(r["loss"] for r in rows)
    fig, axes = plt.subplots(1, len(gs), figsize=(6.2 * len(gs), 5.6), squeeze=False)
    for ax, g in zip(axes[0], gs):
        ps = sorted({r["p"] for r in rows if r["gpus_per_server"] == g})
        lo, hi = PAPER["optcc"]
        ax.axhspan(
            100 * lo, 100 * hi, color="tab:blue", alpha=0.12, label="paper: OptCC within 2-6%"
        )
        ax.axhline(
            100 * PAPER["r2ccl"][1],
            color="tab:orange",
            ls="-.",
            lw=1,
            label="paper: R2CCL up to 57%",
        )
        yb = [_cell(rows, g, p, "optcc", "overhead_bound") for p in ps]
        # Wide and pale under the model lines: OptCC's model meets the bound.
        ax.plot(
            ps,
            [100 * v for v in yb],
            color="0.3",
            ls="--",
            lw=3.2,
            alpha=0.45,
            zorder=1,
            label="lower bound",
        )
        for alg in ("ring", "r2ccl", "optcc"):
            if not any(r["algorithm"] == alg for r in rows):
                continue
            color, marker = algorithm_style(alg)
            ym = [_cell(rows, g, p, alg, "overhead_model") for p in ps]
            ax.plot(
                ps, [100 * v for v in ym], color=color, lw=1.6, label=f"{alg} model, worst loss"
            )
            for loss, filled in ((None, True), (xmax, False)):
                sp = [(p, _cell(rows, g, p, alg, "overhead_sim", loss)) for p in ps]
                sp = [(p, v) for p, v in sp if v is not None]
                if not sp or (not filled and alg != "optcc"):
                    continue
                ax.scatter(
                    [p for p, _ in sp],
                    [100 * max(v, 1e-4) for _, v in sp],
                    marker=marker,
                    s=48 if filled else 90,
                    zorder=3,
                    color=color if filled else "none",
                    edgecolors=color,
                    linewidths=1.4,
                    label=f"{alg} simulated, "
                    + ("worst loss" if filled else f"X = {100 * xmax:g}% only"),
                )
        simulated = [
            r["p"] for r in rows if r["gpus_per_server"] == g and r.get("overhead_sim") is not None
        ]
        if simulated and max(simulated) < ps[-1]:
            ax.axvline(max(simulated), color="0.5", ls=":", lw=1)
            ax.text(
                max(simulated) * 1.05,
                0.07,
                "simulated up to here;\nmodel beyond",
                fontsize=7,
                color="0.35",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_ylim(0.05, 300)
        ax.set_xticks(ps)
        ax.set_xticklabels([str(p) for p in ps])
        ax.set_xlabel("GPUs (ranks) p")
        ax.set_ylabel("worst overhead over fault-free ring, loss <= 50% (%)")
        what = "one straggler GPU" if g == 1 else f"one server: {g} GPUs each at 1 - X"
        ax.set_title(f"g = {g}: {what}")
        ax.grid(alpha=0.3, which="both")
    # One legend for every panel, below them, so that it covers no data.
    seen: dict[str, Any] = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    fig.legend(
        list(seen.values()), list(seen), loc="lower center", ncol=5, fontsize=8, frameon=False
    )
    fig.suptitle(
        "The paper's setting: overhead of OptCC, R2CCL and the ring under one "
        "degraded server (OptCC's model coincides with the bound)",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
