"""``optcc-mpi sweep``: parameter sweeps as Slurm job arrays (plan, run, record, status).

The job scripts under ``jobs/`` call these subcommands; they are handy by hand too. The work
is done by :mod:`optcc_mpi.lab.sweep`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Mapping
from typing import Any

from optcc_mpi.argtypes import key_values
from optcc_mpi.lab import sweep
from optcc_mpi.lab.sweep import KINDS

EPILOG = """\
A sweep is a CSV table, one row per array task (task id = row index). Each task launches
`optcc-mpi bench` or `optcc-mpi train` with srun inside Slurm (the PMI plugin of the MPI in
use: pmi2 for MPICH, pmix for Open MPI; OPTCC_SRUN_MPI overrides) or the library's own
mpiexec elsewhere (OPTCC_LAUNCHER replaces either), and writes RESULTS/<job>_<task>.jsonl:
a task record (status, parameters, where and with what it ran), then the result rows.

examples:
  optcc-mpi sweep expand allreduce algorithm=ring,optcc loss=0,0.25,0.5 > t.csv
  optcc-mpi sweep plan t.csv                      # what jobs/submit-sweep.sh would submit
  optcc-mpi sweep run t.csv 3 --results res       # array task 3, by hand (no Slurm needed)
  optcc-mpi sweep exec --ranks 4 --results res -- -b 1M -e 16M --links 0:0.5
  optcc-mpi sweep status res                      # ok / failed / missing per task
  jobs/submit-sweep.sh t.csv --results res --wait # the whole sweep as one job array
See docs/slurm.md.
"""


def _shell(assignments: Mapping[str, Any]) -> str:
    return "\n".join(f"{k}={shlex.quote(str(v))}" for k, v in assignments.items())


def _cmd_plan(a: argparse.Namespace) -> int:

    t = sweep.read_table(a.table)
    tasks = sweep.failed_tasks(a.only_failed, t.path) if a.only_failed else list(range(len(t.rows)))
    plan = {
        "kind": t.kind.name,
        "script": t.kind.script,
        "table": str(t.path),
        "name": t.name,
        "rows": len(t.rows),
        "count": len(tasks),
        "array": sweep.array_spec(tasks),
        "max_ranks": max((int(t.rows[i]["ranks"]) for i in tasks), default=1),
    }
    print(_shell(plan) if a.shell else json.dumps(plan, indent=2))
    return 0


def _cmd_run(a: argparse.Namespace) -> int:

    t = sweep.read_table(a.table)
    if a.kind and t.kind.name != a.kind:
        raise ValueError(
            f"{t.path} is a {t.kind.name} table but this is the {a.kind} job script; submit "
            f"it with jobs/{t.kind.script} (jobs/submit-sweep.sh picks it for you)"
        )
    return sweep.run_task(t, a.task, a.results, job=a.job)


def _cmd_exec(a: argparse.Namespace) -> int:

    args = list(a.args)
    if args and args[0] == "--":
        args = args[1:]
    return sweep.exec_command(a.kind, a.ranks, args, a.results, job=a.job)


def _cmd_manifest(a: argparse.Namespace) -> int:

    tasks = sweep.parse_array_spec(a.tasks)
    print(sweep.write_manifest(a.results, a.table, a.job, tasks, script=a.script, argv=a.sbatch))
    return 0


def _cmd_status(a: argparse.Namespace) -> int:

    st = sweep.collect(a.results)
    if a.job:
        st = sweep.SweepStatus([t for t in st.tasks if t.job == a.job], st.unreadable, st.manifests)
    print(st.summary())
    return 0 if st.ok else 1


def _cmd_expand(a: argparse.Namespace) -> int:

    columns = key_values(a.axes, typed=False, what="COLUMN=V1,V2,...")
    axes = {k.lower(): [v.strip() for v in values.split(",")] for k, values in columns.items()}
    sys.stdout.write(sweep.expand(a.kind, axes))
    return 0


def register(subparsers: Any) -> None:
    """Add the ``sweep`` command and its subcommands."""

    p = subparsers.add_parser(
        "sweep",
        help="parameter sweeps as Slurm job arrays: plan, run a task, record, status",
        description="Plan, run and record parameter sweeps: one CSV table row per Slurm "
        "array task, one JSON-lines record file per task. The job scripts under jobs/ call "
        "these subcommands.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="sweep_command", metavar="SUBCOMMAND")

    def usage(_: argparse.Namespace) -> int:
        p.print_help(sys.stderr)
        return 2

    p.set_defaults(func=usage)

    s = sub.add_parser("plan", help="what submit-sweep.sh submits for a table")
    s.add_argument("table", help="the sweep table (CSV)")
    s.add_argument("--only-failed", metavar="RESULTS", help="only failed or missing tasks")
    s.add_argument("--shell", action="store_true", help="print shell assignments, not JSON")
    s.set_defaults(func=_cmd_plan)

    s = sub.add_parser("run", help="run one array task of a table and record it")
    s.add_argument("table", help="the sweep table (CSV)")
    s.add_argument("task", type=int, help="array task id = row index, from 0")
    s.add_argument("--results", required=True, help="folder of the record files")
    s.add_argument("--job", help="array job id (default: from Slurm, else a local id)")
    s.add_argument("--kind", choices=tuple(KINDS), help="fail unless the table is this kind")
    s.set_defaults(func=_cmd_run)

    s = sub.add_parser(
        "exec",
        help="run one command (no table) and record it",
        description="Run `optcc-mpi bench` (allreduce) or `optcc-mpi train` (casgd) with the "
        "arguments after -- on --ranks ranks, and record it like a sweep task.",
    )
    s.add_argument(
        "--kind",
        choices=tuple(KINDS),
        default="allreduce",
        help="allreduce runs `optcc-mpi bench`, casgd `optcc-mpi train` (default allreduce)",
    )
    s.add_argument("--ranks", type=int, required=True, help="MPI ranks")
    s.add_argument("--results", required=True, help="folder of the record file")
    s.add_argument("--job", help="job id (default: from Slurm, else a local id)")
    s.add_argument("args", nargs=argparse.REMAINDER, help="-- then the command's arguments")
    s.set_defaults(func=_cmd_exec)

    s = sub.add_parser("manifest", help="record a submission (used by submit-sweep.sh)")
    s.add_argument("--results", required=True, help="folder of the record files")
    s.add_argument("--table", required=True, help="the sweep table submitted")
    s.add_argument("--job", required=True, help="the array job id")
    s.add_argument("--tasks", required=True, help="the --array value")
    s.add_argument("--script", default="", help="the job script submitted")
    s.add_argument("sbatch", nargs="*", help="the sbatch command line")
    s.set_defaults(func=_cmd_manifest)

    s = sub.add_parser("status", help="summarise a results folder; exit 1 unless all ok")
    s.add_argument("results", help="a sweep's results folder")
    s.add_argument("--job", help="only the tasks whose latest submission is this array job")
    s.set_defaults(func=_cmd_status)

    s = sub.add_parser("expand", help="write a table over a Cartesian product")
    s.add_argument("kind", choices=tuple(KINDS), help="the kind of table (its first column)")
    s.add_argument(
        "axes",
        nargs="+",
        metavar="COLUMN=V1,V2,...",
        help="a column and its values; the table has a row per combination",
    )
    s.set_defaults(func=_cmd_expand)
