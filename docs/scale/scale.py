"""How the cost of ring, OptCC and the library's own AllReduce grows with p (issue 36).

Two steps, run from the repository root::

    # as root: the namespace testbed at each p (rank 0 at half rate), the benchmark and
    # the executor's calibration (on healthy links) there; one JSON-lines file per p
    python docs/scale/scale.py testbed --ranks 2,4,8,16 --rate 200mbit --size 8M \
        --tag r200 --out docs/scale
    # the simulator from 2 to 256 ranks at the measured per-message cost, the table
    # and the plot of time over the lower bound against p
    python docs/scale/scale.py report --tag r200 --out docs/scale

``testbed`` writes ``testbed-TAG-pP.jsonl`` (the benchmark's rows: time, bound, every
rank's peak RSS, CPU per call and messages) and ``calibrate-TAG-pP.jsonl`` (``optcc-mpi
lab calibrate``: latency per step and cost per message through the executor at that p).
``--throttle 0`` leaves MPICH's idle ranks polling at full speed (the default ``1`` sets
``MPIR_CVAR_CH4_PROGRESS_THROTTLE=1``, as ``make test`` does, so that ranks waiting on a
dependency yield their core). Its own testbed name (``--name``, default ``scale36``)
keeps it apart from anyone else's.

``report`` reads those files, simulates each algorithm from 2 to 256 ranks on the same
links with every message delayed by the cost per message measured at the largest
measured p (``optcc_mpi.simulate``; OptCC's schedule built for the network fabric, as
the testbed's ranks build it), writes ``sim-TAG.jsonl`` and ``scale-TAG.png`` and prints
a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ALGORITHMS = ("ring", "optcc", "native")
SIM_RANKS = (2, 4, 8, 16, 32, 64, 128, 256)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "optcc_mpi", *args]


def _run(argv: list[str], env: dict[str, str]) -> None:
    print("+", shlex.join(argv), flush=True)
    subprocess.run(argv, check=True, env=env, cwd=ROOT)


def testbed(args: argparse.Namespace) -> None:
    """The benchmark and the calibration on the testbed at each p (root)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.throttle:
        env["MPIR_CVAR_CH4_PROGRESS_THROTTLE"] = "1"
    else:
        env.pop("MPIR_CVAR_CH4_PROGRESS_THROTTLE", None)
    tb = ["testbed"]
    name = ["--name", args.name]
    # Passed through `testbed run`, which hands every OPTCC_ variable to the ranks.
    if args.link_rate:
        env["OPTCC_LINK_RATE"] = args.link_rate
    else:
        env.pop("OPTCC_LINK_RATE", None)
    for p in args.ranks:
        rows = out / f"testbed-{args.tag}-p{p}.jsonl"
        cal = out / f"calibrate-{args.tag}-p{p}.jsonl"
        for f in (rows, cal):
            f.unlink(missing_ok=True)
        subprocess.run(_cli(*tb, "down", *name), env=env, cwd=ROOT, capture_output=True)
        try:
            _run(_cli(*tb, "up", *name, "--ranks", str(p), "--rate", args.rate,
                      "--links", args.links), env)  # fmt: skip
            bench = ["bench", "-b", args.size, "-e", args.size, "-n", str(args.iters),
                     "-w", str(args.warmup), "--algorithms", ",".join(ALGORITHMS),
                     "--out", str(rows)]  # fmt: skip
            _run(_cli(*tb, "run", *name, "--timeout", "900", "--", *_cli(*bench)), env)
            _run(_cli(*tb, "shape", *name, "--healthy"), env)
            calib = ["lab", "calibrate", "--repeats", "3", "--json", str(cal)]
            _run(_cli(*tb, "run", *name, "--timeout", "600", "--", *_cli(*calib)), env)
        finally:
            subprocess.run(_cli(*tb, "down", *name), env=env, cwd=ROOT, capture_output=True)


def _load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measured(out: Path, tag: str) -> dict[int, dict[str, Any]]:
    """Per p: each algorithm's time over the bound, every rank's peak RSS, CPU per call,
    messages per rank, and the calibration."""
    res: dict[int, dict[str, Any]] = {}
    for f in sorted(out.glob(f"testbed-{tag}-p*.jsonl")):
        rows = _load(f)
        p = int(rows[0]["p"])
        cal = out / f"calibrate-{tag}-p{p}.jsonl"
        entry: dict[str, Any] = {"calibrate": _load(cal)[-1] if cal.exists() else None}
        for r in rows:
            cpu = r.get("cpu_s_ranks") or []
            msgs = r.get("messages_ranks") or []
            entry[r["algorithm"]] = {
                "time_ms": r["time_us"] / 1e3,
                "over_bound": r["time_us"] / r["bound_us"],
                "over_ff": r["ratio_fault_free"],
                "rss_mib": (min(r["rss_peak_mib_ranks"]), max(r["rss_peak_mib_ranks"])),
                "cpu_over_wall": r.get("cpu_over_wall"),
                "cpu_ms": statistics.median(cpu) * 1e3 if cpu else None,
                "messages": max(msgs) if msgs else None,
                "k": (r.get("schedule_params") or {}).get("k"),
                "wrong": r["wrong"],
                "load": r.get("load"),
            }
        res[p] = entry
    return res


def simulated(links: str, size: int, bw: float, cost: float) -> list[dict[str, Any]]:
    """Each algorithm from 2 to 256 ranks in the simulator, with no per-message delay and
    with every message ``cost`` late; schedules built for the network fabric, as the
    testbed's ranks build them (at ``$OPTCC_LINK_RATE`` when set)."""
    from optcc_mpi import algorithms, model
    from optcc_mpi.simulate import simulate

    rows = []
    for p in SIM_RANKS:
        bound = model.lower_bound(p, size, bw, links)
        for name in ALGORITHMS:
            alg = algorithms.get(name)
            kw = {"fabric": "network"} if "fabric" in alg.params else {}
            sched = alg.build(p, size // 4, links, itemsize=4, **kw)
            for latency in (0.0, cost):
                r = simulate(sched, links, bw=bw, latency=latency, itemsize=4)
                rows.append({"algorithm": name, "p": p, "latency_us": latency * 1e6,
                             "time_ms": r.time * 1e3, "over_bound": r.time / bound,
                             "messages": r.messages, "k": sched.params.get("k")})  # fmt: skip
    return rows


def _per_message(entry: dict[str, Any]) -> float:
    """OptCC's CPU seconds per message on the median rank: its CPU per call over its
    messages per call. An upper bound on the executor's cost per message, since it also
    holds the time MPI's progress engine polled while waiting."""
    o = entry.get("optcc") or {}
    if not o.get("messages") or o.get("cpu_ms") is None:
        return float("nan")
    return o["cpu_ms"] * 1e-3 / o["messages"]


def report(args: argparse.Namespace) -> None:
    """The simulator beyond the measured p, a Markdown table, and the plot."""
    if args.link_rate:
        os.environ["OPTCC_LINK_RATE"] = args.link_rate
    from optcc_mpi import config
    from optcc_mpi.units import parse_rate, parse_size

    config.reload()
    out = Path(args.out)
    meas = measured(out, args.tag)
    if not meas:
        raise SystemExit(f"no testbed-{args.tag}-p*.jsonl in {out}")
    before = measured(out, args.compare) if args.compare else {}
    cost = _per_message(meas[max(meas)])
    size = parse_size(args.size)
    sim = simulated(args.links, size, parse_rate(args.rate), cost)
    with open(out / f"sim-{args.tag}.jsonl", "w") as fh:
        for r in sim:
            fh.write(json.dumps(r) + "\n")
    nan = float("nan")
    print("| p | ring x bound | OptCC x bound | native x bound | OptCC k, messages per rank "
          "| CPU / wall (ring, OptCC) | OptCC CPU per message (us) | calibrated cost per "
          "message (us) | peak RSS per rank (MiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for p, e in sorted(meas.items()):
        o, ring, nat = e.get("optcc", {}), e.get("ring", {}), e.get("native", {})
        cal = e["calibrate"]["message_cost_us"] if e["calibrate"] else nan
        rss = [v["rss_mib"] for v in e.values() if isinstance(v, dict) and "rss_mib" in v]
        print(f"| {p} | {ring.get('over_bound', nan):.3f} | {o.get('over_bound', nan):.3f} | "
              f"{nat.get('over_bound', nan):.3f} | {o.get('k')}, {o.get('messages')} | "
              f"{ring.get('cpu_over_wall') or nan:.2f}, {o.get('cpu_over_wall') or nan:.2f} | "
              f"{_per_message(e) * 1e6:.0f} | {cal:.0f} | "
              f"{min(a for a, _ in rss):.0f}-{max(b for _, b in rss):.0f} |")  # fmt: skip
    print(f"\nsimulated, time over the bound (every message {cost * 1e6:.0f} us late, and not):")
    print("| p | ring | OptCC (k) | native | OptCC, no delay |")
    print("|---|---|---|---|---|")
    for p in SIM_RANKS:
        at = {(r["algorithm"], r["latency_us"] > 0): r for r in sim if r["p"] == p}
        late = cost > 0
        print(f"| {p} | {at['ring', late]['over_bound']:.3f} | "
              f"{at['optcc', late]['over_bound']:.3f} ({at['optcc', late]['k']}) | "
              f"{at['native', late]['over_bound']:.3f} | "
              f"{at['optcc', False]['over_bound']:.3f} |")  # fmt: skip
    _plot(meas, before, sim, cost, out / f"scale-{args.tag}.png", args)


def _plot(meas: dict[int, Any], before: dict[int, Any], sim: list[dict[str, Any]],
          cost: float, path: Path, args: argparse.Namespace) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from optcc_mpi.lab.report import algorithm_style

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in ALGORITHMS:
        colour, _ = algorithm_style(name)
        ps = sorted(p for p in meas if name in meas[p])
        ax.plot(ps, [meas[p][name]["over_bound"] for p in ps], "o-", color=colour,
                label=f"{name}, testbed, {args.tag}")  # fmt: skip
        if name == "optcc" and before:
            pb = sorted(p for p in before if name in before[p])
            ax.plot(pb, [before[p][name]["over_bound"] for p in pb], "x:", color=colour,
                    label=f"{name}, testbed, {args.compare}")  # fmt: skip
        srows = [r for r in sim if r["algorithm"] == name and (r["latency_us"] > 0) == (cost > 0)]
        label = f"{name}, simulator ({cost * 1e6:.0f} us per message)"
        ax.plot([r["p"] for r in srows], [r["over_bound"] for r in srows], "--", color=colour,
                alpha=0.7, label=label)  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.10, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks p")
    ax.set_ylabel("time / lower bound")
    ax.set_title(f"{args.size} per rank, {args.rate} links, rank 0 at half rate ({args.links})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("testbed", "report"):
        s = sub.add_parser(name)
        s.add_argument("--tag", required=True)
        s.add_argument("--out", default="docs/scale")
        s.add_argument("--rate", default="200mbit")
        s.add_argument("--links", default="0:0.5")
        s.add_argument("--size", default="8M")
        s.add_argument("--link-rate", default="", help="OPTCC_LINK_RATE for the ranks")
    sub.choices["report"].add_argument("--compare", default="", help="another tag's OptCC")
    t = sub.choices["testbed"]
    t.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8, 16])
    t.add_argument("--iters", type=int, default=3)
    t.add_argument("--warmup", type=int, default=1)
    t.add_argument("--throttle", type=int, choices=(0, 1), default=1)
    t.add_argument("--name", default="scale36")
    args = ap.parse_args()
    {"testbed": testbed, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
