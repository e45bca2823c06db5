"""``optcc-mpi simulate``: build a schedule, verify it, and time it by discrete events."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from optcc_mpi import algorithms, model
from optcc_mpi.argtypes import algorithms_arg, key_value_arg
from optcc_mpi.cli._common import add_network_args, network_links, print_table
from optcc_mpi.errors import ArgumentError
from optcc_mpi.simulate import simulate
from optcc_mpi.verify import verify

EPILOG = """\
Every algorithm is a schedule: per rank, a program of point-to-point operations. This
command builds the schedule for --ranks ranks and --size bytes, optionally proves it correct
(--verify: every rank ends with every contribution exactly once, no deadlock, no race),
and times it in the simulator's link model (per-rank full-duplex NICs, each side a FIFO
server of bytes; --latency per message), next to the closed-form model.

--param KEY=VALUE goes to every chosen algorithm that takes KEY (window=4 reaches ring,
optcc and r2ccl); a KEY that none of them takes is an error.

examples:
  optcc-mpi simulate --ranks 8 --links 0:0.5                   # all algorithms
  optcc-mpi simulate --algorithms optcc --ranks 8 --links 0:0.5 --param k=64
  optcc-mpi simulate --ranks 1024 --algorithms ring --size 1G --bw 50GB/s
  optcc-mpi simulate --ranks 16 --links 0:0.5,5:0.75 --verify --json

--p and --degrade are the old names of --ranks and --links, and still work.
"""


def run(args: argparse.Namespace) -> int:

    p = args.ranks
    links = network_links(args, p)
    given = dict(args.param)
    chosen = [algorithms.get(name) for name in args.algorithms]
    check_params(given, chosen)
    itemsize = 4
    count = args.size // itemsize
    ff = model.fault_free(p, args.size, args.bw)
    bound = model.lower_bound(p, args.size, args.bw, links)
    results = []
    for alg in chosen:
        name = alg.name
        # --param applies to the algorithms that take it (check_params: at least one does).
        params = {k: v for k, v in given.items() if k in alg.params}
        t0 = time.perf_counter()
        # Built directly, not through the registry's cache: a 1024-rank schedule takes
        # gigabytes, and each is dropped once timed.
        sched = alg.build(p, count, links, itemsize=itemsize, **params)
        built = time.perf_counter() - t0
        ok = None
        if args.verify:
            ok = verify(sched, raise_on_error=False)
        t0 = time.perf_counter()
        res = simulate(sched, links, bw=args.bw, latency=args.latency, itemsize=itemsize)
        simulated = time.perf_counter() - t0
        mod = alg.time(p, args.size, args.bw, links, latency=args.latency, **params)
        n_ops, sched_params = sched.n_ops, sched.params
        del sched
        results.append(
            {
                "algorithm": name,
                "p": p,
                "size": args.size,
                "links": str(links),
                "sim_s": res.time,
                "model_s": mod,
                "fault_free_s": ff,
                "bound_s": bound,
                "ratio_fault_free": res.time / ff if ff else 1.0,
                "ratio_bound": res.time / bound if bound else 1.0,
                "sim_over_model": res.time / mod if mod else 1.0,
                "ops": n_ops,
                "messages": res.messages,
                "params": sched_params,
                "build_s": built,
                "simulate_s": simulated,
                "verified": None if ok is None else ok.ok,
                "errors": None if ok is None else ok.errors[:5],
            }
        )
    if args.json:
        print(json.dumps(results, default=str))
    else:
        print(
            f"p={p}  size={args.size} B  bw={args.bw / 1e9:g} GB/s  "
            f"latency={args.latency * 1e6:g} us  degraded: {links}"
        )
        rows = []
        for r in results:
            rows.append(
                [
                    r["algorithm"],
                    f"{r['sim_s'] * 1e3:.3f}",
                    f"{r['model_s'] * 1e3:.3f}",
                    f"{r['ratio_fault_free']:.3f}",
                    f"{r['ratio_bound']:.3f}",
                    r["messages"],
                    {None: "-", True: "ok", False: "FAILED"}[r["verified"]],
                    f"{r['build_s'] + r['simulate_s']:.1f}s",
                ]
            )
        print_table(
            [
                "algorithm",
                "sim (ms)",
                "model (ms)",
                "x fault-free",
                "x bound",
                "messages",
                "verified",
                "took",
            ],
            rows,
        )
        for r in results:
            for e in r["errors"] or []:
                print(f"{r['algorithm']}: {e}")
    return 0 if all(r["verified"] is not False for r in results) else 1


def check_params(params: dict[str, Any], chosen: list[Any]) -> None:
    """Refuse a ``--param`` key that none of the chosen algorithms takes.

    With one algorithm this is :meth:`Algorithm.check_params`, the Python API's own check
    (and its message); with several, a key is refused when no chosen algorithm takes it,
    since ``window=4`` is meant for every algorithm that has a window.

    Raises
    ------
    ArgumentError
        Naming the key and what each chosen algorithm takes.
    """
    if len(chosen) == 1:
        chosen[0].check_params(params)
        return
    unknown = sorted(k for k in params if not any(k in alg.params for alg in chosen))
    if unknown:
        takes = "; ".join(f"{a.name}: {', '.join(sorted(a.params)) or 'none'}" for a in chosen)
        raise ArgumentError(
            f"--param {', '.join(map(repr, unknown))}: no chosen algorithm takes it "
            f"(their parameters: {takes})"
        )


def register(subparsers: Any) -> None:

    names = list(algorithms.names())
    p = subparsers.add_parser(
        "simulate",
        help="time (and verify) algorithm schedules in the link model",
        description="Build schedules, verify them symbolically if asked, and time them by "
        "discrete-event simulation next to the closed-form model.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--algorithms",
        type=algorithms_arg,
        default=names,
        help=f"comma-separated, from {','.join(names)} (default: all)",
    )
    add_network_args(p)
    p.add_argument(
        "--param",
        type=key_value_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="schedule parameter, e.g. k=64 (repeatable); given to every chosen algorithm "
        "that takes it, refused if none does",
    )
    p.add_argument("--verify", action="store_true", help="also prove each schedule correct")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)
