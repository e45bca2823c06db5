"""``optcc-mpi demo``: the main job on an embedded default (what ``make demo`` runs).

As root on a machine where network namespaces work it builds the testbed (8 ranks, 400
Mbit/s links, rank 0 at half rate, real kernel shaping), otherwise it uses software
emulation with the same rates, and says which. It runs the benchmark (ring, r2ccl,
optcc, auto, native against the fault-free ring and the bound), draws measured and
modelled time against message size, prints the model table, and tears the testbed down.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from optcc_mpi import algorithms


def _use_testbed(args: argparse.Namespace) -> tuple[bool, str]:
    if args.network == "emulation":
        return False, "emulation requested"
    from optcc_mpi.lab import testbed

    if os.geteuid() != 0:
        return False, "not root, so no kernel shaping"
    ok, why = testbed.namespaces_supported()
    if not ok:
        return False, f"network namespaces unavailable ({why})"
    return True, "root: real kernel shaping in network namespaces"


def run(args: argparse.Namespace) -> int:
    from optcc_mpi.lab import launch, testbed

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "bench.jsonl"
    rows_path.unlink(missing_ok=True)
    bench = [
        sys.executable,
        "-m",
        "optcc_mpi",
        "bench",
        "-b",
        args.begin,
        "-e",
        args.end,
        "-f",
        "2",
        "-n",
        str(args.iters),
        "-w",
        "1",
        "--algorithms",
        ",".join([*algorithms.names(), "auto"]),
        "--links",
        args.links,
        "--out",
        str(rows_path),
    ]
    # Ranks beyond the cores poll each other's progress engines; throttling idle progress
    # makes oversubscribed MPICH runs an order of magnitude faster (launch.oversubscription_env).
    extra = launch.oversubscription_env(args.ranks)
    use_tb, why = _use_testbed(args)
    t0 = time.perf_counter()
    if use_tb:
        print(
            f"network: testbed ({why}); {args.ranks} ranks at {args.rate}, degraded {args.links}",
            flush=True,
        )
        print(f"MPI: {launch.mpi_library()}", flush=True)
        testbed.down()  # a leftover from an interrupted run
        tb = testbed.up(args.ranks, args.rate, degrade=args.links)
        try:
            print("$ optcc-mpi testbed run -- " + shlex.join(bench[1:]), flush=True)
            status = tb.run(bench, env=extra)
        finally:
            testbed.down()
            print("testbed removed", flush=True)
    else:
        rate = testbed.parse_bitrate(args.rate) / 8
        bench += ["--emulate", f"bw={rate / 1e6:g}MB/s"]
        print(
            f"network: software emulation ({why}); {args.ranks} ranks with "
            f"{rate / 1e6:g} MB/s virtual NICs, degraded {args.links}",
            flush=True,
        )
        chosen = launch.launcher()
        cmd = [*chosen.argv(args.ranks), *bench]
        print(f"launcher: {chosen.describe()}", flush=True)
        print("$ " + shlex.join(cmd), flush=True)
        status = subprocess.call(cmd, env={**os.environ, **extra, **chosen.env(args.ranks)})
    took = time.perf_counter() - t0
    if rows_path.exists():
        rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line]
        png = _plot(rows, out / "time-vs-size.png")
        if png:
            print(f"plot: {png}")
    print(f"benchmark took {took:.0f} s; rows in {rows_path}\n")
    from optcc_mpi.cli import main

    print(f"$ optcc-mpi model --ranks {args.ranks} --links {args.links} --size 256M --bw 25GB/s")
    main(
        [
            "model",
            "--ranks",
            str(args.ranks),
            "--links",
            args.links,
            "--size",
            "256M",
            "--bw",
            "25GB/s",
        ]
    )
    return status


def _plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Measured (solid) and modelled (dotted) time against size, and the bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    algs = list(dict.fromkeys(r["algorithm"] for r in rows))
    for i, alg in enumerate(algs):
        mine = sorted((r for r in rows if r["algorithm"] == alg), key=lambda r: r["size"])
        xs = [r["size"] for r in mine]
        color = f"C{i}"
        ax.plot(xs, [r["time_us"] / 1e3 for r in mine], "o-", color=color, label=alg)
        ax.fill_between(
            xs,
            [r["time_min_us"] / 1e3 for r in mine],
            [r["time_max_us"] / 1e3 for r in mine],
            color=color,
            alpha=0.12,
        )
        model = [r.get("model_us") for r in mine]
        if alg != "ring (fault-free)" and all(m == m and m is not None for m in model):
            ax.plot(xs, [m / 1e3 for m in model], ":", color=color, lw=1.3)
    bounds = sorted(
        {
            (r["size"], r["bound_us"])
            for r in rows
            if r["algorithm"] != "ring (fault-free)" and r.get("bound_us") == r.get("bound_us")
        }
    )
    if bounds:
        ax.plot(
            [b[0] for b in bounds], [b[1] / 1e3 for b in bounds], "k--", lw=1, label="lower bound"
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size per rank (bytes)")
    ax.set_ylabel("time per AllReduce (ms)")
    p = rows[0]["p"] if rows else "?"
    ax.set_title(
        f"{p} ranks, {rows[0]['network'] if rows else ''}, degraded "
        f"{rows[-1]['links'] if rows else ''}\n(solid: measured median, band: "
        "min-max; dotted: model)",
        fontsize=10,
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="the main job: benchmark every algorithm over a degraded link, with a plot",
        description="Run the benchmark on 8 ranks with rank 0 at half bandwidth: on the "
        "network-namespace testbed with real kernel shaping when run as root, otherwise "
        "with software emulation (it says which). Prints the table against the fault-free "
        "ring and the bound, writes a PNG of measured and modelled time against message "
        "size, prints the model table, and removes the testbed.",
        epilog="examples:\n  optcc-mpi demo\n  optcc-mpi demo --network emulation\n"
        "  optcc-mpi demo --ranks 4 --links 1:0.25 --end 32M",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ranks", type=int, default=8, help="MPI ranks (default 8)")
    p.add_argument("--rate", default="400mbit", help="healthy link rate (default 400mbit)")
    p.add_argument("--links", default="0:0.5", help="degraded ranks (default 0:0.5)")
    p.add_argument("--begin", default="4M", help="smallest message per rank (4M)")
    p.add_argument("--end", default="16M", help="largest message per rank (16M)")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per point (3)")
    p.add_argument(
        "--network",
        choices=("auto", "testbed", "emulation"),
        default="auto",
        help="auto: the testbed when root, else emulation",
    )
    p.add_argument("--out", default="demo-results", help="folder for rows and the plot")
    p.set_defaults(func=run)
