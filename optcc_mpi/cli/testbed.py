"""``optcc-mpi testbed``: shaped per-rank links on one machine (namespaces + veth + tc)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from optcc_mpi.argtypes import alias, key_values
from optcc_mpi.cli._common import print_help
from optcc_mpi.lab import testbed as tb

DESCRIPTION = """\
Give every MPI rank its own network namespace and a veth link into a bridge, and limit
each link with tc tbf in both directions, so that one machine behaves like a cluster
whose chosen ranks have slow NICs. MPI jobs run over TCP across these links (MPICH hydra,
UCX_TLS=tcp,self, UCX_NET_DEVICES=eth0), so a degraded rank really is slow on the wire.

Needs root. Everything created carries the testbed name as a prefix (default `optcctb`,
or OPTCC_TESTBED_NAME) and is listed in /run/optcc-testbed/<name>.json; `down` removes
exactly that, also after a crash, and never touches other namespaces.
"""

EPILOG = """\
examples:
  optcc-mpi testbed up --ranks 8 --rate 400mbit --links 0:0.5
      8 namespaces; every link 400 Mbit/s each way, rank 0 at 200 Mbit/s each way
  optcc-mpi testbed up --ranks 8 --ranks-per-node 2 --rate 400mbit --links 1:0.5
      4 nodes of 2 ranks sharing one link; node 1 (ranks 2 and 3) at 200 Mbit/s
  optcc-mpi testbed status
      namespaces, links, qdisc rates, byte counters; exit 1 if inconsistent
  optcc-mpi testbed run -- .venv/bin/python -m optcc_mpi bench
      an 8-rank MPI job, rank i in namespace optcctb-r<i>; exit status is the job's
  optcc-mpi testbed run --ranks 4 --env OPTCC_SEED=1 -- .venv/bin/python prog.py
  optcc-mpi testbed shape --links 0:0.25,3:0.5       change rates in place
  optcc-mpi testbed shape --healthy                  every link back to full rate
  optcc-mpi testbed down                             remove everything (safe twice)

From Python (e.g. rank 0 of a job inside the testbed):
  from optcc_mpi.lab import testbed
  testbed.set_shaping(None); ...; testbed.set_shaping({0: 0.5})

--degrade, the old name of --links, still works.
See docs/testbed.md, which also covers degrading real clusters (jobs/degrade-wrapper.sh).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``testbed`` command and its sub-commands to ``subparsers``."""
    parser = subparsers.add_parser(
        "testbed",
        help="per-rank shaped links on one machine (network namespaces + tc); needs root",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=lambda args: print_help(parser))
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--name",
        default=None,
        help=f"testbed name, the prefix of its namespaces (default: $OPTCC_TESTBED_NAME or "
        f"{tb.DEFAULT_NAME})",
    )
    sub = parser.add_subparsers(dest="testbed_command", metavar="SUBCOMMAND")

    p_up = sub.add_parser(
        "up",
        parents=[common],
        help="create the namespaces, links and shapers",
        description="Create one namespace per rank, veth links into a bridge, and tbf "
        "shapers on both ends of every link. Refuses if the testbed exists (see --force).",
        epilog="examples:\n"
        "  optcc-mpi testbed up --ranks 8 --rate 400mbit --links 0:0.5\n"
        "  optcc-mpi testbed up --ranks 4 --rate 1gbit --links 1:0.25,2:0.5 --force\n"
        "  optcc-mpi testbed up --ranks 4 --rate 50MB/s --burst 128KiB --latency 20ms\n"
        "  optcc-mpi testbed up --ranks 8 --ranks-per-node 2 --rate 400mbit --links 0:0.5\n\n"
        "units (optcc_mpi.units): kbit, mbit, gbit are bits/s; KB/s, MB/s, GB/s bytes/s; "
        "KiB, MiB binary, KB, MB decimal",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p_up.add_argument("--ranks", "-n", type=int, required=True, help="number of ranks (1-250)")
    p_up.add_argument(
        "--ranks-per-node",
        type=int,
        default=1,
        help="ranks sharing one namespace and its shaped link, as a server's GPUs share "
        "its NIC (a divisor of --ranks; default 1). --links then names nodes",
    )
    p_up.add_argument("--rate", required=True, help="healthy link rate, e.g. 400mbit, 1gbit")
    links = p_up.add_argument(
        "--links",
        default=None,
        metavar="RANK:FRACTION[,...]",
        help="ranks (nodes, with --ranks-per-node) whose link runs at FRACTION "
        "(0 < FRACTION <= 1) of --rate, both ways; --degrade is the old name",
    )
    alias(p_up, links, "--degrade")
    p_up.add_argument("--burst", default=None, help="tbf bucket, e.g. 64KiB (default: 2 ms)")
    p_up.add_argument("--latency", default=None, help="tbf queue latency (default: 50ms)")
    p_up.add_argument(
        "--mtu",
        type=int,
        default=tb.DEFAULT_MTU,
        help="MTU of every link (default: %(default)s, jumbo frames; at 1500 TCP/IP headers "
        "and ACKs take about 7%% of each shaped link)",
    )
    p_up.add_argument(
        "--congestion",
        default=tb.DEFAULT_CONGESTION,
        choices=["reno", "bbr", "cubic", ""],
        help="TCP congestion control in the rank namespaces (default: %(default)s, which "
        "keeps a shaped link full; '' keeps the kernel's)",
    )
    p_up.add_argument(
        "--force", action="store_true", help="tear down an existing testbed of this name first"
    )
    p_up.set_defaults(func=cmd_up)

    p_down = sub.add_parser(
        "down",
        parents=[common],
        help="remove everything the testbed created (safe to repeat)",
        description="Remove the namespaces (and with them veths, bridge and qdiscs), the "
        "/etc/netns entries, the launcher and the state file. Also cleans up after a crash: "
        "any namespace with the testbed's prefix and marker goes; others are left alone.",
    )
    p_down.add_argument(
        "--kill",
        action="store_true",
        help="end processes still running inside the namespaces (SIGTERM, then SIGKILL)",
    )
    p_down.set_defaults(func=cmd_down)

    p_status = sub.add_parser(
        "status",
        parents=[common],
        help="show namespaces, links, qdisc rates and consistency",
        description="Show what exists of the testbed and check it against the state file. "
        "Exit status: 0 consistent (or nothing exists), 1 inconsistent.",
    )
    p_status.add_argument("--json", action="store_true", help="print the full record as JSON")
    p_status.set_defaults(func=cmd_status)

    p_run = sub.add_parser(
        "run",
        parents=[common],
        help="run an MPI job with one rank per namespace",
        description="Run CMD as an MPI job (MPICH hydra) with rank i in namespace "
        "<name>-r<i>, over TCP through the shaped links. OPTCC_*, UCX_*, MPIR_CVAR_*, PATH, "
        "VIRTUAL_ENV and PYTHONPATH are passed to every rank. Exit status is the job's.",
        epilog="examples:\n"
        "  optcc-mpi testbed run -- .venv/bin/python prog.py\n"
        "  optcc-mpi testbed run --ranks 2 --env OPTCC_SEED=3 -- .venv/bin/python prog.py\n"
        "  optcc-mpi testbed run --print -- .venv/bin/python prog.py   # just show the argv",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p_run.add_argument("--ranks", "-n", type=int, default=None, help="ranks (default: all)")
    p_run.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for every rank (repeatable)",
    )
    p_run.add_argument("--timeout", type=float, default=None, help="kill the job after SECONDS")
    p_run.add_argument(
        "--print", dest="print_only", action="store_true", help="print the argv, do not run"
    )
    p_run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p_run.set_defaults(func=cmd_run)

    p_shape = sub.add_parser(
        "shape",
        parents=[common],
        help="change link rates in place (no teardown)",
        description="Change the rates of a running testbed; jobs keep running. Exactly the "
        "Python call testbed.set_shaping().",
        epilog="examples:\n"
        "  optcc-mpi testbed shape --links 0:0.5\n"
        "  optcc-mpi testbed shape --healthy\n"
        "  optcc-mpi testbed shape --rate 1gbit --healthy",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = p_shape.add_mutually_exclusive_group(required=True)
    links = group.add_argument(
        "--links",
        metavar="RANK:FRACTION[,...]",
        help="new degraded ranks; --degrade is the old name",
    )
    alias(group, links, "--degrade")
    group.add_argument("--healthy", action="store_true", help="every link at the full rate")
    p_shape.add_argument("--rate", default=None, help="new healthy rate (default: unchanged)")
    p_shape.set_defaults(func=cmd_shape)


def cmd_up(args: argparse.Namespace) -> int:
    """``testbed up``."""
    try:
        bed = tb.up(
            args.ranks,
            args.rate,
            args.links,
            burst=args.burst,
            latency=args.latency,
            name=args.name,
            force=args.force,
            mtu=args.mtu,
            congestion=args.congestion,
            ranks_per_node=args.ranks_per_node,
        )
    except tb.TestbedExists as exc:
        print(f"optcc-mpi testbed up: {exc}", file=sys.stderr)
        return 1
    last = bed.nodes - 1
    what = "ranks" if bed.ranks_per_node == 1 else "nodes"
    print(f"testbed {bed.name!r} is up: {bed.describe()} (each direction)")
    print(f"  {what:<10} {bed.rank_ns(0)} .. {bed.rank_ns(last)}, eth0 = {bed.rank_addr(0)} ..")
    print(f"  hub        {bed.hub_ns} (bridge {tb.BRIDGE}, {tb.HUB_ADDR}/24, runs mpiexec)")
    print(f"  state      {bed.state_path}")
    print("  run a job  optcc-mpi testbed run -- .venv/bin/python prog.py")
    print("  tear down  optcc-mpi testbed down")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    """``testbed down``."""
    summary = tb.down(args.name, kill=args.kill)
    name = summary["name"]
    if summary["removed_namespaces"] or summary["removed_state"]:
        print(f"testbed {name!r} removed: {len(summary['removed_namespaces'])} namespaces")
    else:
        print(f"testbed {name!r}: nothing to remove")
    for ns, pids in summary["busy"].items():
        print(
            f"  warning: processes {' '.join(map(str, pids))} still run in {ns}; it lives on "
            "(unnamed) until they exit (use --kill)",
            file=sys.stderr,
        )
    if summary["foreign"]:
        print(
            f"  note: left alone (not ours, no marker): {', '.join(summary['foreign'])}",
            file=sys.stderr,
        )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """``testbed status``."""
    info = tb.status(args.name)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0 if info["consistent"] is not False else 1
    print(_format_status(info))
    return 0 if info["consistent"] is not False else 1


def _rate_arg(q: dict[str, Any] | None) -> str:
    if q is None:
        return "-"
    if q["rate_bit"] is None:
        return f"{q['kind']} (!)"
    return f"{q['kind']} {tb.format_bitrate(q['rate_bit'])}" + ("" if q["ok"] else " (!)")


def _format_status(info: dict[str, Any]) -> str:
    name = info["name"]
    lines = []
    data = info["testbed"]
    if data is None and not info["exists"]:
        lines.append(f"testbed {name!r}: none (state file {info['state_file']} absent)")
    elif data is None:
        lines.append(f"testbed {name!r}: no state file, but namespaces exist")
    else:
        bed = tb.Testbed.from_dict(data)
        lines.append(f"testbed {name!r}: {bed.describe()}   state {info['state_file']}")
    if info["ranks"]:
        label = "node" if any(len(r.get("ranks", [0])) > 1 for r in info["ranks"]) else "rank"
        header = f"  {label:>4}  {'namespace':<18} {'address':<12} {'expected':>9}  "
        header += f"{'egress (eth0)':<16} {'ingress (hub)':<16} {'tx bytes':>12} {'rx bytes':>12}"
        lines.append(header)
        for r in info["ranks"]:
            tx = "-" if r["tx_bytes"] is None else f"{r['tx_bytes']:,}"
            rx = "-" if r["rx_bytes"] is None else f"{r['rx_bytes']:,}"
            lines.append(
                f"  {r['rank']:>4}  {r['namespace']:<18} {r['addr']:<12} "
                f"{tb.format_bitrate(r['rate_bit']):>9}  {_rate_arg(r['egress']):<16} "
                f"{_rate_arg(r['ingress']):<16} {tx:>12} {rx:>12}"
            )
    elif info["namespaces"]:
        lines.append("  namespaces: " + ", ".join(info["namespaces"]))
    for ns in info["foreign"]:
        lines.append(f"  not ours (no marker, left alone): {ns}")
    if info["consistent"] is None:
        lines.append("  needs root to inspect links and qdiscs: run as root")
    elif info["consistent"]:
        if info["exists"]:
            lines.append("  consistent: yes")
    else:
        lines.append("  consistent: NO")
        lines.extend(f"    - {p}" for p in info["problems"])
        lines.append("  fix: optcc-mpi testbed down   (then up again)")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    """``testbed run``; returns the job's exit status."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("no command given; use `optcc-mpi testbed run -- COMMAND [ARGS...]`")
    env = key_values(args.env, typed=False, what="--env KEY=VALUE")
    bed = tb.current(args.name)
    if bed is None:
        raise RuntimeError(
            f"no testbed {tb.resolve_name(args.name)!r}; create one with `optcc-mpi testbed up`"
        )
    if args.print_only:
        import shlex

        print(shlex.join(bed.launch_argv(cmd, args.ranks, env)))
        return 0
    try:
        return tb.run(cmd, args.ranks, env, name=args.name, timeout=args.timeout)
    except KeyboardInterrupt:
        # The job's process group has already been ended; report it as a shell would.
        print("optcc-mpi testbed run: interrupted", file=sys.stderr)
        return 130


def cmd_shape(args: argparse.Namespace) -> int:
    """``testbed shape``."""
    bed = tb.set_shaping(None if args.healthy else args.links, rate=args.rate, name=args.name)
    print(f"testbed {bed.name!r}: {bed.describe()}")
    return 0
