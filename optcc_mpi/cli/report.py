"""``optcc-mpi report``: join sweep results into one CSV and plots, or reproduce the paper's
setting by simulation."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from optcc_mpi import linklog
from optcc_mpi.argtypes import alias, duration_arg, key_value_arg, rate_arg, size_arg
from optcc_mpi.lab import report, reproduce

EPILOG = """\
Three modes.

1. RESULTS_DIR: the folder a sweep wrote (jobs/submit-sweep.sh; one
   <array job>_<task>.jsonl per task, plus manifest-<job>.json per submission).
   Prints a summary (tasks ok / failed / missing, #wrong, and why each failed task
   failed), writes one CSV with a row per benchmark row or training run (and one per
   failed or missing task), and draws the plots the data allows:
     overhead_vs_loss.png    time over the fault-free ring against bandwidth loss,
                             per algorithm: measured points, model lines, lower bound
     time_vs_size.png        time against message size, per (ranks, loss)
     casgd_loss_vs_time.png  CA-SGD training loss against time, per solver and s
     casgd_speedup_vs_s.png  CA-SGD speedup over SGD (or the smallest s) against s
   A task resubmitted with `submit-sweep.sh TABLE --only-failed DIR` replaces its
   earlier attempt. Exit status 1 when any task failed or is missing, or any #wrong.

2. --simulate: the paper's setting, p up to 1024 and 12.5-50% bandwidth loss, with one
   straggler GPU (g = 1) or one degraded 8-GPU server (g = 8: its 8 GPUs each at 1 - X,
   our reading of one lost NIC rerouted by PXN). The discrete-event simulator runs
   where practical (p <= --sim-max-p), the closed-form model beyond; the `source` column
   says which. Prints a Markdown table of worst-case overheads beside the paper's
   claims (OptCC within 2-6%, R2CCL up to 57%) with notes where ours differ.

3. --links FILE: the link log of a run (OPTCC_LINKS_LOG, `optcc-mpi train --links-log`,
   `optcc-mpi doctor --links-log`; docs/doctor.md). Prints every change (profile adopted,
   algorithm run, doctor's verdict) with the time since the run started and the call
   number, and draws links_timeline.png (into --plots DIR, else beside FILE): every
   rank's bandwidth fraction over time and a strip of the algorithm each call ran.

examples:
  optcc-mpi report results/                          # summary only
  optcc-mpi report results/ --csv all.csv --plots plots/
  optcc-mpi report --simulate --plots plots/ --csv repro.csv --markdown repro.md
  optcc-mpi report --simulate --ranks 8,16,32 --loss 0.5 --gpus-per-server 1 --sim-max-p 32
  optcc-mpi report --simulate --sim-max-p 64                    # model beyond p = 64, faster
  optcc-mpi report --simulate --ranks 16,32,64 --param pattern=closer  # another OptCC pattern
  optcc-mpi report --links links.jsonl --plots plots/   # a training run's link record
"""


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 8,16,32, got {text!r}") from None


def _float_list(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 0.25,0.5, got {text!r}") from None
    if any(not 0 < v < 1 for v in vals):
        raise argparse.ArgumentTypeError("losses are fractions of bandwidth lost, in (0, 1)")
    return vals


def register(subparsers: Any) -> None:
    """Add the ``report`` command."""
    p = subparsers.add_parser(
        "report",
        help="join sweep results into a CSV and plots; --simulate: the paper's setting",
        description=(
            "Aggregate the JSON-lines records of a sweep into one CSV and PNG plots, "
            "reporting failed and missing tasks; or, with --simulate, reproduce the "
            "paper's evaluation setting by simulation and compare with its claims."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("results", nargs="?", metavar="RESULTS_DIR", help="a sweep's results folder")
    p.add_argument(
        "--csv", metavar="OUT.csv", help="write the joined rows (or the reproduction table) as CSV"
    )
    p.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument(
        "--links",
        metavar="FILE",
        help="a link log (JSON lines): print its changes and draw the timeline",
    )
    s = p.add_argument_group("--simulate (the paper's setting)")
    s.add_argument("--simulate", action="store_true", help="simulate instead of reading results")
    ranks = s.add_argument(
        "--ranks",
        type=_int_list,
        default=[8, 16, 32, 64, 128, 256, 512, 1024],
        metavar="LIST",
        help="GPU counts, i.e. ranks (default 8,16,...,1024); --p is the old name",
    )
    alias(s, ranks, "--p")
    s.add_argument(
        "--loss",
        type=_float_list,
        default=[0.125, 0.25, 0.375, 0.5],
        metavar="LIST",
        help="bandwidth losses X (default 0.125,0.25,0.375,0.5)",
    )
    s.add_argument(
        "--gpus-per-server",
        type=_int_list,
        default=[1, 8],
        metavar="LIST",
        help="degraded GPUs g: 1 (one straggler) and 8 (one 8-GPU server); default 1,8",
    )
    s.add_argument(
        "--sim-max-p",
        type=int,
        default=1024,
        metavar="P",
        help="simulate up to P ranks, model beyond (default 1024: every configuration; "
        "p = 1024 takes about 20 s and 2.5 GiB per loss and g)",
    )
    s.add_argument(
        "--segments",
        type=int,
        metavar="K",
        help="OptCC pipeline segments in the simulator (default: its own choice)",
    )
    s.add_argument(
        "--param",
        type=key_value_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an OptCC schedule parameter in the simulator, e.g. k=64 or pattern=closer "
        "(repeatable)",
    )
    s.add_argument("--size", type=size_arg, default=1 << 30, help="bytes per rank (default 1G)")
    s.add_argument(
        "--bw",
        type=rate_arg,
        default=50e9,
        help="healthy NIC rate per direction (default 50GB/s = 400 Gb/s)",
    )
    s.add_argument(
        "--latency",
        type=duration_arg,
        default=0.0,
        help="per-message latency in the simulator (default 0, as the model)",
    )
    s.add_argument("--markdown", metavar="OUT.md", help="also write the comparison as Markdown")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``optcc-mpi report``."""
    if args.links:
        if args.results or args.simulate:
            raise ValueError("give --links FILE alone (not with RESULTS_DIR or --simulate)")
        return _links_arg(args)
    if args.simulate:
        if args.results:
            raise ValueError("give either RESULTS_DIR or --simulate, not both")
        return _simulate(args)
    if not args.results:
        raise ValueError("give a results folder (RESULTS_DIR) or --simulate; see --help")
    return _aggregate(args)


def _aggregate(args: argparse.Namespace) -> int:

    folder = Path(args.results)
    if not folder.is_dir():
        raise FileNotFoundError(f"no results folder {folder}")
    res = report.load(folder)
    if not res.status.tasks:
        print(f"{folder}: no task records (*.jsonl) or manifests found", file=sys.stderr)
        return 1
    print(res.summary())
    if args.csv:
        path = report.write_csv(res.rows, args.csv)
        print(f"wrote {path} ({len(res.rows)} rows)")
    if args.plots:
        for path in report.plot_results(res, args.plots):
            print(f"wrote {path}")
    return 0 if res.ok else 1


def _links_arg(args: argparse.Namespace) -> int:

    path = Path(args.links)
    if not path.is_file():
        raise FileNotFoundError(f"no link log {path}")
    records = linklog.read(path)
    if not records:
        print(f"{path}: no records", file=sys.stderr)
        return 1
    print(report.links_summary(records))
    out = Path(args.plots) / "links_timeline.png" if args.plots else path.with_suffix(".png")
    made = report.plot_links(records, out)
    if made is not None:
        print(f"wrote {made}")
    return 0


def _simulate(args: argparse.Namespace) -> int:

    rows = reproduce.reproduce(
        args.ranks,
        args.loss,
        args.gpus_per_server,
        size=args.size,
        bw=args.bw,
        latency=args.latency,
        sim_max_p=args.sim_max_p,
        params={**({"k": args.segments} if args.segments else {}), **dict(args.param)},
        progress=not args.no_progress,
    )
    if not rows:
        raise ValueError("no configuration left: every p is below 2 x gpus-per-server")
    text = reproduce.reproduction_markdown(rows)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
        print(f"wrote {args.markdown}")
    if args.csv:
        print(f"wrote {reproduce.write_reproduction_csv(rows, args.csv)}")
    if args.plots:
        out = Path(args.plots)
        print(f"wrote {reproduce.plot_reproduction(rows, out / 'reproduction.png')}")
    return 0
