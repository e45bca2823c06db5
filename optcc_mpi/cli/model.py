"""``optcc-mpi model``: modelled times, ratios to fault-free and to the lower bound."""

from __future__ import annotations

import argparse
import json
from typing import Any

from optcc_mpi import algorithms
from optcc_mpi.argtypes import losses_arg, typed_flag
from optcc_mpi.cli._common import TINY_FRACTION, add_network_args, network_links, print_table

EPILOG = f"""\
The model is the fluid (bandwidth-only) model: per-rank full-duplex NICs, the degraded
ranks at FRACTION of --bw: the share of the rate they keep (0:0.5 is rank 0 at half
rate). A FRACTION below {TINY_FRACTION:g} is modelled as given, with a warning: it is more
often a loss typed by mistake. Times are for one AllReduce of --size bytes per rank.
  fault-free  2(p-1)/p * n/B, the ring with every link healthy
  bound       max(n / (B min f), 2(p-1) n / (B sum f))  (derived; docs/model.md)
  one row per registered algorithm, by the cost it declares (`optcc-mpi simulate --help`
  lists them); --latency adds each algorithm's per-message latency term

examples:
  optcc-mpi model --ranks 8 --links 0:0.5 --size 256M --bw 25GB/s
  optcc-mpi model --ranks 64 --links 0:0.5,9:0.75 --json
  optcc-mpi model --sweep          # the README table: p x bandwidth loss
  optcc-mpi model --sweep --ranks 8,64 --losses 0.5

--p, --ps and --degrade are the old names of --ranks and --links, and still work.
"""


def sweep(size: int, bw: float, ps: list[int], losses: list[float]) -> list[dict[str, Any]]:
    """Modelled overheads over fault-free for every (p, loss): the README table."""
    rows = []
    for p in ps:
        for loss in losses:
            t = algorithms.table(p, size, bw, {0: 1.0 - loss})
            rows.append(
                {
                    "p": p,
                    "loss": loss,
                    **{a: r["ratio_fault_free"] for a, r in t["algorithms"].items()},
                    "bound": t["bound_ratio_fault_free"],
                }
            )
    return rows


def run(args: argparse.Namespace) -> int:
    ranks = args.ranks
    if args.sweep:
        rows = sweep(args.size, args.bw, ranks or [8, 16, 32, 64, 128], args.losses)
        if args.json:
            print(json.dumps(rows))
            return 0
        pct = lambda r: f"{100 * (r - 1):+.1f}%"  # noqa: E731
        names = algorithms.names()
        print_table(
            ["p", "loss", *names, "bound"],
            [
                [r["p"], f"{100 * r['loss']:g}%", *(pct(r[a]) for a in names), pct(r["bound"])]
                for r in rows
            ],
        )
        return 0
    ranks = ranks or [8]
    if len(ranks) != 1:
        raise ValueError(
            f"{typed_flag(args, 'ranks', '--ranks')} {','.join(map(str, ranks))}: give one "
            "number of ranks, or several with --sweep"
        )
    p = ranks[0]
    links = network_links(args, p)
    t = algorithms.table(p, args.size, args.bw, links, latency=args.latency)
    if args.json:
        print(json.dumps(t))
        return 0
    print(f"p={p}  size={args.size} B  bw={args.bw / 1e9:g} GB/s  degraded: {links}")
    rows = [
        [
            "fault-free ring",
            f"{t['fault_free_s'] * 1e3:.3f}",
            "1.000",
            f"{t['fault_free_s'] / t['bound_s']:.3f}" if t["bound_s"] else "-",
        ]
    ]
    for name, a in t["algorithms"].items():
        rows.append(
            [
                name,
                f"{a['time_s'] * 1e3:.3f}",
                f"{a['ratio_fault_free']:.3f}",
                f"{a['ratio_bound']:.3f}",
            ]
        )
    rows.append(
        ["lower bound", f"{t['bound_s'] * 1e3:.3f}", f"{t['bound_ratio_fault_free']:.3f}", "1.000"]
    )
    print_table(["algorithm", "time (ms)", "x fault-free", "x bound"], rows)
    for alg in algorithms.all_algorithms():
        if alg.explain is not None:
            print(f"{alg.name} plan: {alg.explain(p, links)}")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "model",
        help="modelled AllReduce times, ratios to fault-free and to the lower bound",
        description="Print the fluid-model time of each algorithm for one AllReduce, with "
        "its ratio to the fault-free optimum and to the lower bound.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_network_args(p, ranks_list=True)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="table over --ranks and --losses (rank 0 degraded) instead",
    )
    p.add_argument(
        "--losses",
        type=losses_arg,
        default=[0.125, 0.25, 0.5],
        metavar="LOSS[,LOSS...]",
        help="bandwidth losses of rank 0 for --sweep, each in [0, 1): 0.25 means rank 0 "
        "keeps 75%% of the healthy rate (default 0.125,0.25,0.5)",
    )
    p.set_defaults(func=run)
