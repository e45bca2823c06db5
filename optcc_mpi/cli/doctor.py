"""``optcc-mpi doctor``: which node's link is slow? (under mpiexec, srun, torchrun or the
testbed)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import textwrap
from pathlib import Path
from typing import Any

from optcc_mpi import config, linklog, linkrates, transports
from optcc_mpi import doctor as dr
from optcc_mpi.argtypes import (
    alias,
    duration_arg,
    emulation_arg,
    int_at_least,
    positive_size_arg,
    rate_with_unit_arg,
)
from optcc_mpi.cli._common import leave_now, torchrun_report
from optcc_mpi.doctor.diagnosis import bitrate
from optcc_mpi.errors import mark_everywhere
from optcc_mpi.lab import world

DESCRIPTION = """\
Measure the send and receive rate of every rank's and every node's link, repeatedly,
and say which are degraded relative to the median link (or to --expect). Ranks with the
same host name share a node: each rank's path is measured alone (one flow per node),
each node's NIC with all its ranks at once, and what stays inside a node separately;
a slow NIC is blamed on its node, not on a rank. Run it under mpiexec, srun, torchrun
(over torch.distributed's gloo, no MPI library needed) or `optcc-mpi testbed run`; rank 0
prints the table (slowest first) and a one-line verdict.

What it sends: SIZE-byte messages in rounds between barriers, every rank to a partner
node (PARTNERS node shifts, spread round the ring), each round REPEATS times. With one
rank per node every rank sends and receives SIZE x REPEATS x PARTNERS bytes (defaults:
8 MiB x 5 x 3 = 120 MiB) in REPEATS x PARTNERS rounds; that takes about
SIZE x REPEATS x PARTNERS / RATE, 0.1 s at 10 Gbit/s and 2.5 s at 400 Mbit/s, plus
2 barriers a round. With L ranks per node add the all-ranks-at-once rounds (a node's L
flows share its NIC) and the intra-node rounds: about 2 L times as long. At p = 64 on a
10 Gbit/s network the default takes 0.1 s of transfers (--estimate shows the simulated
time for any p, L and rate).
"""


def _statuses(table: dict[int, str]) -> str:
    """An exit-status table for the epilog, from the doctor's own (one source)."""
    return "\n".join(
        textwrap.fill(text, 88, initial_indent=f"  {code}  ", subsequent_indent="     ")
        for code, text in sorted(table.items())
    )


EPILOG = (
    "verdicts (per rank):\n"
    + "\n".join(f"  {name:<11} {text}" for name, text in dr.RANK_VERDICTS.items())
    + """

fewer than 3 nodes: the median of two links cannot say whether either is slow, so the
link is judged against an expected rate: --expect, else the emulated rate (--emulate),
else the speed every node's interface reports (a physical NIC's
/sys/class/net/IF/speed; --iface), else --baseline (an earlier healthy run's --json).
With 2 nodes every message crosses both ends: the slow end is named only where the two
interfaces report different speeds; otherwise the verdict is the link between them.

exit status (the same on every rank; under torchrun rank 0's alone, the others exit 0,
and torchrun itself exits 1 when rank 0 does not exit 0):
"""
    + _statuses(dr.EXIT_STATUSES)
    + """

exit status of --check:
"""
    + _statuses(dr.CHECK_STATUSES)
    + """

examples:
  # 16 nodes, one task each; the JSON for a health check, a plot for people
  srun --mpi=pmi2 -N 16 --ntasks-per-node=1 optcc-mpi doctor --json doctor.json --plot doctor.png

  # one task per GPU: the 8 ranks of a node share its NIC(s); nodes are named
  srun --mpi=pmi2 -N 4 --ntasks-per-node=8 optcc-mpi doctor

  # two nodes: judged against the rate a link should carry
  srun --mpi=pmi2 -N 2 --ntasks-per-node=1 optcc-mpi doctor --expect 100gbit

  # on the namespace testbed (root): rank 0's link at half rate
  optcc-mpi testbed up --ranks 8 --rate 400mbit --degrade 0:0.5
  optcc-mpi testbed run -- python -m optcc_mpi doctor

  # software emulation (no root, one machine): rank 2 at 0.5 of 200 MB/s
  mpiexec -n 4 optcc-mpi doctor --emulate bw=200MB/s,degrade=2:0.5

  # a PyTorch job's launcher, no MPI: the messages travel over gloo
  torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      -m optcc_mpi doctor
  torchrun --standalone --nproc-per-node 4 -m optcc_mpi doctor --emulate bw=200MB/s,degrade=2:0.5

  # how long would it take? (the simulator, no MPI)
  optcc-mpi doctor --estimate --p 64 --bw 10gbit
  optcc-mpi doctor --estimate --p 64 --ranks-per-node 8 --bw 100gbit --size 64M

  # a node's own health check, from the last job's JSON (exit 3 if this host is named)
  optcc-mpi doctor --check /shared/doctor.json

See docs/doctor.md (Slurm health checks and prologs, what it cannot see).
"""
)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction must be in (0, 1]")
    return value


def register(subparsers: Any) -> None:
    """Add the ``doctor`` command."""

    p = subparsers.add_parser(
        "doctor",
        help="find the slow link: every rank's and node's rates, and a verdict",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("measurement")
    m.add_argument(
        "--size",
        type=positive_size_arg,
        default=dr.DEFAULT_SIZE,
        help="bytes per message (default 8M; at 100 Gbit/s and more use 64M, so that a "
        "message lasts milliseconds)",
    )
    m.add_argument(
        "--partners",
        type=int_at_least(1, "partners"),
        default=dr.DEFAULT_PARTNERS,
        help="partner nodes per rank (node shifts; default %(default)s)",
    )
    m.add_argument(
        "--repeats",
        type=int_at_least(1, "repeats"),
        default=dr.DEFAULT_REPEATS,
        help="times every round runs; a link is flagged only when all its measurements are "
        "below the threshold (default %(default)s)",
    )
    m.add_argument(
        "--group",
        choices=("host", "rank"),
        default=None,
        help="what shares a NIC: ranks on one host (default), or nothing (rank: every rank "
        "its own NIC; the default under --emulate)",
    )
    m.add_argument(
        "--transport",
        choices=("mpi", "gloo"),
        default=None,
        help="what the messages travel over: mpi (the default under mpiexec, srun and the "
        "testbed) or gloo (torch.distributed; the default under torchrun, which needs no "
        "MPI library)",
    )
    m.add_argument(
        "--emulate",
        type=emulation_arg,
        default=None,
        metavar="SPEC",
        help="software emulation, e.g. bw=200MB/s,degrade=2:0.5 (default $OPTCC_EMULATE)",
    )
    v = p.add_argument_group("verdict")
    v.add_argument(
        "--threshold",
        type=_fraction,
        default=linkrates.HEALTHY_ABOVE,
        help="fraction of the reference below which a link is degraded (default %(default)s)",
    )
    v.add_argument(
        "--expect",
        type=rate_with_unit_arg,
        default=None,
        metavar="RATE",
        help="judge against the rate one link should carry (with its unit: 10gbit, "
        "1.25GB/s; a node's NIC, or a rank's own rail) instead of the median link",
    )
    v.add_argument(
        "--baseline",
        metavar="FILE.json",
        default=None,
        help="an earlier healthy run's --json: its median link is the expected rate where "
        "fewer than 3 nodes leave nothing else to judge against",
    )
    v.add_argument(
        "--iface",
        default=None,
        metavar="NAME",
        help="the interface whose reported speed is the expected rate of fewer than 3 "
        "nodes (default: the one $GLOO_SOCKET_IFNAME, $NCCL_SOCKET_IFNAME, "
        "$UCX_NET_DEVICES or $OMPI_MCA_btl_tcp_if_include names, else the default "
        "route's)",
    )
    v.add_argument(
        "--judge-intra",
        action="store_true",
        help="also flag ranks slow inside their node (host memory copies, which follow the "
        "CPU load; reported either way)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write the full result as JSON (- for stdout)")
    o.add_argument("--plot", metavar="FILE.png", help="draw the rates, threshold and verdicts")
    o.add_argument(
        "--links-log",
        metavar="FILE",
        help="append the verdict to this JSON-lines link log (default $OPTCC_LINKS_LOG)",
    )
    o.add_argument("--quiet", "-q", action="store_true", help="print the verdict line only")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    e = p.add_argument_group("--estimate (the simulator, no MPI)")
    e.add_argument(
        "--estimate",
        action="store_true",
        help="print the plan and its simulated duration instead of measuring",
    )
    ranks = e.add_argument(
        "--ranks",
        type=int_at_least(2, "ranks"),
        default=64,
        help="ranks (default 64; --p is the old name)",
    )
    alias(e, ranks, "--p")
    e.add_argument(
        "--ranks-per-node",
        type=int_at_least(1, "ranks per node"),
        default=1,
        help="ranks sharing a node's NIC (default 1)",
    )
    e.add_argument(
        "--bw", type=rate_with_unit_arg, default=10e9 / 8, help="link rate (default 10gbit)"
    )
    e.add_argument(
        "--latency",
        type=duration_arg,
        default=5e-6,
        help="per-message latency (default 5us)",
    )
    c = p.add_argument_group("--check (a node's own health check)")
    c.add_argument(
        "--check",
        metavar="FILE.json",
        help="read a doctor's --json and say what it found of HOST: exit 0 healthy, 3 named "
        "degraded, 4 neither (no MPI; statuses below)",
    )
    c.add_argument(
        "--host",
        default=None,
        help="the node to look up with --check (default: this machine's host name)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``optcc-mpi doctor``."""
    if args.check:
        return _check(args)
    if args.estimate:
        return _estimate(args)
    comm, started = world.start(args.transport)
    ctrl = transports.of(comm)
    rank = ctrl.rank
    if ctrl.size == 1:
        raise ValueError(_alone())
    # Before anything is measured: rank 0 (which writes every output) checks where it will
    # write and reads the baseline, and every rank learns the outcome.
    problem: str | None = None
    base: float | None = None
    if rank == 0:
        try:
            _check_outputs(args)
            base = dr.baseline_rate(args.baseline) if args.baseline else None
        except (ValueError, OSError) as exc:
            problem = str(exc)
    problem, base = ctrl.allgather((problem, base))[0]
    if problem is not None:
        raise mark_everywhere(ValueError(problem), problem)
    with linklog.recording(args.links_log):
        diag = dr.doctor(
            comm,
            size=args.size,
            partners=args.partners,
            repeats=args.repeats,
            healthy_above=args.threshold,
            expect=args.expect,
            group=args.group,
            emulate=args.emulate,
            judge_intra=args.judge_intra,
            progress=not args.no_progress and not args.quiet,
            baseline=base,
            iface=args.iface,
        )
    if rank == 0:
        # With --json - the JSON alone goes to standard output; the table to standard error.
        out = sys.stderr if args.json == "-" else sys.stdout
        if args.quiet:
            print(diag.summary, file=out)
        else:
            print(diag.header(), file=out)
            print(diag.table(), file=out)
        if args.json:
            text = json.dumps(diag.to_dict(), indent=1)
            if args.json == "-":
                print(text)
            else:
                Path(args.json).write_text(text + "\n")
                if not args.quiet:
                    print(f"wrote {args.json}", file=out)
        if args.plot:
            print(f"wrote {dr.plot(diag, args.plot)}", file=out)
    sys.stdout.flush()
    world.end(started)
    status = diag.exit_status
    if world.started_by() == "torchrun":
        # torchrun reports every worker that exits non-zero as a failure of its own, with a
        # block each, and stops the workers still running once one has failed (listing
        # them as ended by SIGTERM): rank 0 alone carries the verdict (its summary in that
        # block), and the others leave at once, before rank 0 can have failed.
        if rank == 0:
            if status != dr.EXIT_HEALTHY:
                torchrun_report(diag.summary)
            return status
        leave_now(dr.EXIT_HEALTHY)
    return status


def _alone() -> str:
    """What to run instead, in a world of one rank."""
    tasks = os.environ.get("SLURM_NTASKS") or os.environ.get("SLURM_NPROCS") or ""
    if tasks.isdigit() and int(tasks) > 1:
        return (
            f"srun started {tasks} tasks (SLURM_NTASKS={tasks}), but each is an MPI job of "
            "one rank, so there is no link to measure: srun needs the MPI plugin of the MPI "
            "library mpi4py loads, e.g. `srun --mpi=pmi2 optcc-mpi doctor` for MPICH, "
            "`--mpi=pmix` for Open MPI (`srun --mpi=list` shows the plugins); "
            "jobs/doctor.sbatch picks it"
        )
    return (
        "1 rank: no link to measure. Run it on every node of a job, one task per node: "
        "`srun --mpi=pmi2 -N 3 --ntasks-per-node=1 optcc-mpi doctor`, `mpiexec -n 3 -hosts "
        "a,b,c optcc-mpi doctor`, or `torchrun --nnodes 3 --nproc-per-node 1 "
        "--rdzv-backend c10d --rdzv-endpoint a:29500 -m optcc_mpi doctor`; on one machine, "
        "emulated links: `mpiexec -n 4 optcc-mpi doctor --emulate bw=200MB/s,degrade=2:0.5`"
    )


def _check_outputs(args: argparse.Namespace) -> None:
    """Every file the run will write can be written (ValueError naming the flag if not),
    and --plot can draw: checked before anything is measured."""
    targets = [("--json", args.json), ("--plot", args.plot)]
    for flag, name in targets:
        if not name or name == "-":
            continue
        path = Path(name)
        folder = path.parent
        if path.is_dir():
            raise ValueError(f"{flag} {name} is a folder; give a file name")
        if not folder.is_dir():
            raise ValueError(f"{flag} {name}: no folder {folder} to write it in (nothing measured)")
        if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise ValueError(f"{flag} {name}: not writable here (nothing measured)")
    log = args.links_log or config.get(linklog.ENV_LINKS_LOG)
    if log:
        try:
            linklog.LinkLog(log)
        except (ValueError, OSError) as exc:
            raise ValueError(f"--links-log {log}: {exc}") from None
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(
                "--plot needs matplotlib (pip install matplotlib); nothing measured"
            ) from None


def _estimate(args: argparse.Namespace) -> int:

    if args.ranks % args.ranks_per_node:
        raise ValueError(
            f"--ranks {args.ranks} is not a multiple of --ranks-per-node {args.ranks_per_node}"
        )
    layout = dr.Layout.uniform(args.ranks, args.ranks_per_node)
    the_plan = dr.plan(layout, size=args.size, partners=args.partners, repeats=args.repeats)
    est = dr.estimate(the_plan, args.bw, args.latency)
    print(f"plan: {the_plan.describe()}")
    print(
        f"simulated at {bitrate(args.bw)}, {args.latency * 1e6:g} us per message: "
        f"{est['seconds']:.2f} s ({est['transfer_seconds']:.2f} s of transfers: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in est["per_phase"].items() if v)
        + f"; {est['barrier_seconds'] * 1e3:.1f} ms of barriers)"
    )
    sent = the_plan.bytes_sent()
    print(
        f"per rank: {sent.max() / 2**20:.0f} MiB sent, "
        f"{the_plan.bytes_received().max() / 2**20:.0f} MiB received (at most)"
    )
    return 0


def _fraction_arg(row: dict[str, Any]) -> str:
    f = row.get("fraction")
    return "?" if f is None else f"{f:.2f}"


def _check(args: argparse.Namespace) -> int:
    """One host's verdict in a doctor's JSON: named degraded (3), healthy (0), or neither
    (4: unresolved, unmeasured, unjudged, not in the file)."""
    path = Path(args.check)
    if not path.is_file():
        raise FileNotFoundError(f"no doctor result {path}")
    try:
        data = json.loads(path.read_text())
        nodes = data["nodes"]
        ranks = data["ranks"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not the --json of optcc-mpi doctor ({exc})") from None
    host = args.host or socket.gethostname()
    mine = [r for r in ranks if r.get("host") == host]
    summary = data.get("summary", "")
    if not mine:
        print(f"{host}: not in {path} (measured: {', '.join(n['name'] for n in nodes)})")
        return dr.EXIT_INCONCLUSIVE

    def verdict(r: dict[str, Any]) -> str:
        # A record from before "unmeasured" existed called an unmeasured rank healthy.
        v = str(r.get("verdict"))
        return "unmeasured" if v == "healthy" and r.get("fraction") is None else v

    def said(rows: list[dict[str, Any]]) -> str:
        return ", ".join(f"rank {r['rank']} {verdict(r)} at {_fraction_arg(r)}" for r in rows)

    named = [r for r in mine if verdict(r) in ("degraded", "node", "intra")]
    if named:
        print(f"{host}: DEGRADED ({said(named)}); {summary}")
        return dr.EXIT_DEGRADED
    unresolved = [r for r in mine if verdict(r) == "unresolved"]
    if unresolved:
        print(
            f"{host}: UNRESOLVED ({said(unresolved)}): a slow link with this host at one "
            f"end, its slow end not told; {summary}"
        )
        return dr.EXIT_INCONCLUSIVE
    other = [r for r in mine if verdict(r) != "healthy"]
    if other:
        print(f"{host}: {verdict(other[0]).upper()} ({said(other)}); {summary}")
        return dr.EXIT_INCONCLUSIVE
    print(f"{host}: healthy in {path} ({len(mine)} ranks)")
    return dr.EXIT_HEALTHY
