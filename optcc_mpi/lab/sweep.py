"""Parameter sweeps as Slurm job arrays: tables, array tasks, per-task records, status.

A sweep is a CSV table with one row per array task (task id = row index, from 0). The
job scripts under ``jobs/`` stay thin: they find Python and call this module, which turns
the row into an ``optcc-mpi bench`` or ``optcc-mpi train`` command, launches it with the
launcher of :mod:`optcc_mpi.lab.launch` (``srun`` inside Slurm, else the ``mpiexec`` of the
MPI library in use, MPICH or Open MPI), and writes one JSON-lines file per task::

    RESULTS/<array_job_id>_<array_task_id>.jsonl
      {"record": "task", "status": "ok" | "failed", "params": {...}, "slurm": {...},
       "mpi": {...}, "optcc_mpi": {...}, "exit_code": 0, "log_tail": [...], ...}
      {"record": "bench", "algorithm": "optcc", "size": 1048576, "wrong": 0, ...}
      ...

The first line says how the task went and where it ran; the others are the benchmark
rows (``bench``) or the training summary (``train``). Every line carries
``array_job_id`` and ``array_task_id`` so that a file is readable on its own.
``jobs/submit-sweep.sh`` also leaves a ``manifest-<array_job_id>.json`` naming the tasks it
submitted, which is how :func:`collect` tells a task that never reported (``missing``)
from one that was not asked for.

The command line is ``optcc-mpi sweep`` (:mod:`optcc_mpi.cli.sweep`; the job scripts use
it as ``python -m optcc_mpi sweep``). ``python -m optcc_mpi.lab.sweep``, its old name, now
only says so: the lab does not import the CLI.
"""

from __future__ import annotations

import collections
import csv
import datetime as _dt
import hashlib
import io
import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optcc_mpi import config
from optcc_mpi.lab import launch, provenance

__all__ = [
    "KINDS",
    "Kind",
    "Table",
    "TaskState",
    "SweepStatus",
    "read_table",
    "task_argv",
    "task_env",
    "run_task",
    "task_command",
    "exec_command",
    "write_manifest",
    "collect",
    "array_spec",
    "parse_array_spec",
    "expand",
    "error_line",
]

#: Lines of a failed command's output kept in its record.
LOG_TAIL_LINES = 40
#: Seconds a terminated task's launcher gets to end its ranks before they are killed.
STOP_GRACE_S = 10.0

# The checkout (optcc_mpi/lab/sweep.py -> the repository), where jobs/ lives.
_REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- kinds


@dataclass(frozen=True)
class Kind:
    """One kind of sweep: its job script and the table columns it understands.

    Attributes
    ----------
    name : str
        The value of the table's ``kind`` column.
    script : str
        Job script under ``jobs/`` that runs one task of this kind.
    columns : mapping of str to str
        Known columns and their defaults (strings, as in the CSV file).
    signature : tuple of str
        Columns that identify this kind when the table has no ``kind`` column.
    """

    name: str
    script: str
    columns: Mapping[str, str]
    signature: tuple[str, ...]


# Columns shared by both kinds: where the job runs and how the network is degraded.
_COMMON = {
    "ranks": "4",
    "algorithm": "",
    "loss": "0",  # fraction X of the straggler's bandwidth that is lost
    "stragglers": "0",  # ranks that lose it: "0", "0-7", "0,5"
    "links": "",  # an explicit link profile; overrides loss/stragglers
    "emulate": "",  # software network emulation, e.g. "bw=200MB/s,latency=20us"
    "degrade": "emulate",  # how the loss is made real: emulate | ucx | tc
    "extra": "",  # further options for the command, shell-quoted
    "label": "",  # free text, carried into the results
}

KINDS: dict[str, Kind] = {
    "allreduce": Kind(
        "allreduce",
        "allreduce-sweep.sbatch",
        {
            **_COMMON,
            "algorithm": "optcc",
            "size": "1M",  # one size, or a range "64K:16M" stepped by `factor`
            "factor": "2",
            "iters": "20",
            "warmup": "5",
            "dtype": "float32",
            "op": "sum",
        },
        ("size", "iters", "warmup", "dtype", "op", "factor"),
    ),
    "casgd": Kind(
        "casgd",
        "casgd-sweep.sbatch",
        {
            **_COMMON,
            "algorithm": "mpi",
            "solver": "casgd",
            "s": "16",
            "b": "32",
            "recipe": "C",
            "dataset": "synthetic",  # a .h5 file, a shipped name, or synthetic
            "model": "",
            "lr": "0.5",
            "epochs": "5",
            "lambda": "0",
            "seed": "0",
            "rows": "",
        },
        ("solver", "s", "b", "recipe", "dataset", "epochs", "lr"),
    ),
}

_DEGRADE = ("emulate", "ucx", "tc")


# ----------------------------------------------------------------------------- tables


@dataclass
class Table:
    """A parsed sweep table.

    Attributes
    ----------
    path : Path
        Where it was read from (absolute).
    kind : Kind
        The sweep kind, from the ``kind`` column or the header.
    rows : list of dict
        One dict per data row (= array task), every known column filled in.
    given : list of str
        Columns present in the file (the others took their defaults).
    sha256 : str
        Hash of the file's bytes, so records can tell which version of a table ran.
    """

    path: Path
    kind: Kind
    rows: list[dict[str, str]]
    given: list[str]
    sha256: str

    @property
    def name(self) -> str:
        """The sweep's name: the table's file name without ``.csv``."""
        return self.path.stem

    def row(self, task: int) -> dict[str, str]:
        """The parameter row of array task ``task``."""
        if not 0 <= task < len(self.rows):
            raise ValueError(
                f"{self.path}: task {task} is out of range; the table has {len(self.rows)} "
                f"rows (tasks 0-{len(self.rows) - 1})"
            )
        return self.rows[task]

    @property
    def max_ranks(self) -> int:
        """The most ranks any row asks for (the job's ``--ntasks``)."""
        return max((int(r["ranks"]) for r in self.rows), default=1)


def _detect_kind(header: Sequence[str], kinds_in_rows: set[str], path: Path) -> Kind:
    if kinds_in_rows:
        if len(kinds_in_rows) > 1:
            raise ValueError(
                f"{path}: one table is one job array, so all rows need the same kind; "
                f"found {', '.join(sorted(kinds_in_rows))}"
            )
        (name,) = kinds_in_rows
        if name not in KINDS:
            raise ValueError(f"{path}: unknown kind {name!r}; use one of {', '.join(KINDS)}")
        return KINDS[name]
    scores = {k.name: sum(c in header for c in k.signature) for k in KINDS.values()}
    best = max(scores.values())
    winners = [name for name, s in scores.items() if s == best]
    if best == 0 or len(winners) > 1:
        raise ValueError(
            f"{path}: cannot tell the sweep kind from the header {list(header)}; add a first "
            f"column 'kind' with one of {', '.join(KINDS)}"
        )
    return KINDS[winners[0]]


def read_table(path: str | os.PathLike[str]) -> Table:
    """Read and check a sweep table.

    Blank lines and lines starting with ``#`` are ignored (comments). Values are stripped;
    an empty cell takes the column's default.

    Parameters
    ----------
    path : path-like
        The CSV file.

    Returns
    -------
    Table

    Raises
    ------
    ValueError
        Unknown columns, an unknown or mixed kind, or a value that cannot be right
        whatever the command (ranks, loss, degrade). Values that only the command can judge
        (an algorithm's name, a dataset) are left to it, so such a row fails as a task with
        a record saying why.
    """
    p = Path(path).resolve()
    raw = p.read_bytes()
    text = raw.decode("utf-8-sig")
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise ValueError(f"{p}: the table is empty")
    reader = csv.reader(io.StringIO("\n".join(lines)))
    header = [h.strip().lower() for h in next(reader)]
    if len(set(header)) != len(header):
        raise ValueError(f"{p}: repeated column names in {header}")
    cells = [[c.strip() for c in r] for r in reader]
    for i, r in enumerate(cells):
        if len(r) > len(header):
            raise ValueError(f"{p}: row {i} has {len(r)} cells but the header {len(header)}")
    dicts = [dict(itertools.zip_longest(header, r, fillvalue="")) for r in cells]
    kind = _detect_kind(header, {d["kind"] for d in dicts if d.get("kind")}, p)
    unknown = [h for h in header if h != "kind" and h not in kind.columns]
    if unknown:
        raise ValueError(
            f"{p}: unknown column(s) {', '.join(unknown)} for a {kind.name} sweep; known: "
            f"kind, {', '.join(kind.columns)}"
        )
    rows = []
    for i, d in enumerate(dicts):
        row = {c: (d.get(c) or default) for c, default in kind.columns.items()}
        _check_row(row, f"{p}: row {i}")
        rows.append(row)
    given = [h for h in header if h != "kind"]
    return Table(p, kind, rows, given, hashlib.sha256(raw).hexdigest())


def _check_row(row: Mapping[str, str], where: str) -> None:
    try:
        ranks = int(row["ranks"])
    except ValueError:
        raise ValueError(f"{where}: ranks {row['ranks']!r} is not an integer") from None
    if ranks < 1:
        raise ValueError(f"{where}: ranks must be at least 1, got {ranks}")
    try:
        loss = float(row["loss"])
    except ValueError:
        raise ValueError(f"{where}: loss {row['loss']!r} is not a number") from None
    if not 0.0 <= loss < 1.0:
        raise ValueError(f"{where}: loss is the fraction of bandwidth lost, in [0, 1); got {loss}")
    if row["degrade"] not in _DEGRADE:
        raise ValueError(f"{where}: degrade {row['degrade']!r} is not one of {', '.join(_DEGRADE)}")
    try:
        shlex.split(row["extra"])
    except ValueError as exc:
        raise ValueError(f"{where}: extra {row['extra']!r}: {exc}") from None


def _rank_list(spec: str) -> list[str]:
    """``"0,3,5-7"`` -> ``["0", "3", "5-7"]``: items of a rank list, for a link profile."""
    items = [s.strip() for s in spec.replace(";", ",").split(",") if s.strip()]
    for item in items:
        if not re.fullmatch(r"\d+(-\d+)?", item):
            raise ValueError(f"stragglers: {item!r} is not a rank or a range like 4-7")
    return items


def links_for(row: Mapping[str, str]) -> str:
    """The link profile a row describes: ``links`` verbatim, else ``stragglers`` at
    ``1 - loss``; empty when every link is healthy."""
    if row.get("links"):
        return row["links"]
    loss = float(row.get("loss") or 0)
    if loss <= 0:
        return ""
    frac = f"{1.0 - loss:.6g}"
    return ",".join(f"{item}:{frac}" for item in _rank_list(row.get("stragglers") or "0"))


def _size_range(spec: str) -> tuple[str, str]:
    lo, sep, hi = spec.partition(":")
    return lo.strip(), (hi.strip() if sep else lo.strip())


# ----------------------------------------------------------------------------- commands


def program_argv() -> list[str]:
    """How to start ``optcc-mpi``: ``$OPTCC_PROGRAM`` (shell words) or this Python with
    ``-m optcc_mpi``, so the job uses the interpreter the job script chose."""
    custom = (config.get("OPTCC_PROGRAM") or "").strip()
    return shlex.split(custom) if custom else [sys.executable, "-m", "optcc_mpi"]


def task_argv(kind: Kind, row: Mapping[str, str], out: str | os.PathLike[str]) -> list[str]:
    """The ``optcc-mpi`` arguments (after the program) that run one row.

    Parameters
    ----------
    kind : Kind
        The sweep kind.
    row : mapping
        A complete row (every column of the kind present).
    out : path-like
        Where the command writes its results (JSON lines for bench, JSON for train).
    """
    links = links_for(row)
    common: list[str] = []
    if links:
        common += ["--links", links]
    if row["emulate"]:
        common += ["--emulate", row["emulate"]]
    if kind.name == "allreduce":
        lo, hi = _size_range(row["size"])
        argv = [
            "bench",
            "-b",
            lo,
            "-e",
            hi,
            "-f",
            row["factor"],
            "-n",
            row["iters"],
            "-w",
            row["warmup"],
            "-d",
            row["dtype"],
            "-o",
            row["op"],
            "--algorithms",
            row["algorithm"],
            *common,
            "--out",
            str(out),
        ]
    elif kind.name == "casgd":
        argv = [
            "train",
            "--solver",
            row["solver"],
            "--s",
            row["s"],
            "--b",
            row["b"],
            "--recipe",
            row["recipe"],
            "--lr",
            row["lr"],
            # A fixed number of epochs, every run alike: the sweep compares runs of one
            # length (the stopping rule would end each at its own).
            "--max-iter",
            row["epochs"],
            "--tol",
            "none",
            "--lambda",
            row["lambda"],
            "--seed",
            row["seed"],
            "--algorithm",
            row["algorithm"],
            *common,
            "--no-progress",
            "--out",
            str(out),
        ]
        if row["dataset"] and row["dataset"] != "synthetic":
            argv += ["--data", row["dataset"]]
        if row["model"]:
            argv += ["--model", row["model"]]
        if row["rows"]:
            argv += ["--rows", row["rows"]]
    else:  # pragma: no cover - KINDS is closed
        raise ValueError(f"unknown kind {kind.name!r}")
    return argv + shlex.split(row["extra"])


def _nodes() -> int:
    return int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)


def task_env(row: Mapping[str, str], ranks: int) -> dict[str, str]:
    """Variables a task adds to the environment.

    * What the launcher needs for ``ranks`` ranks on this job's nodes
      (:meth:`optcc_mpi.lab.launch.Launcher.env`): ``MPIR_CVAR_CH4_PROGRESS_THROTTLE=1``
      when the ranks on a node outnumber its cores (MPICH ranks otherwise spin in their
      progress engines and steal the cores the others need; ten times slower on 2 cores;
      left alone if already set), Open MPI's consent to run as root under ``srun``.
    * For ``degrade`` = ``ucx`` or ``tc``, the settings ``jobs/degrade-wrapper.sh`` reads:
      the straggler ranks, their fraction and the method.
    """
    env: dict[str, str] = launch.oversubscription_env(ranks, nodes=_nodes())
    if row.get("degrade") in ("ucx", "tc") and float(row.get("loss") or 0) > 0:
        env["OPTCC_STRAGGLER_PROCIDS"] = ",".join(_rank_list(row.get("stragglers") or "0"))
        env["OPTCC_STRAGGLER_FRACTION"] = f"{1.0 - float(row['loss']):.6g}"
        env["OPTCC_DEGRADE_METHOD"] = row["degrade"]
    return env


def wrapper_argv(env: Mapping[str, str]) -> list[str]:
    """``[jobs/degrade-wrapper.sh]`` when any rank is to be degraded by it, else ``[]``."""
    if env.get("OPTCC_STRAGGLER_PROCIDS") or env.get("OPTCC_STRAGGLER_NODEIDS"):
        home = Path(config.get("OPTCC_HOME") or _REPO)
        wrapper = home / "jobs" / "degrade-wrapper.sh"
        if not wrapper.exists():
            raise FileNotFoundError(f"degrading ranks needs {wrapper}; set OPTCC_HOME")
        return ["bash", str(wrapper)]
    return []


# ----------------------------------------------------------------------------- running


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _ids(job: str | None, task: int | None) -> tuple[str, int]:
    """(array job id, task id) from the arguments or Slurm; a local id outside Slurm."""
    job = job or os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if not job:
        job = "local" + _dt.datetime.now().strftime("%Y%m%d%H%M%S")
    if task is None:
        task = int(os.environ.get("SLURM_ARRAY_TASK_ID") or 0)
    return str(job), int(task)


class _Terminated(Exception):
    """SIGTERM arrived (Slurm's time limit or scancel)."""


def _run_streaming(argv: Sequence[str], env: Mapping[str, str]) -> tuple[int, list[str], str]:
    """Run ``argv``, echoing its output (into the Slurm log) and keeping the last lines.

    Returns (exit status, last lines, note). On SIGTERM the child's process group gets
    SIGTERM, then SIGKILL, and the status is 128 + 15, so the record still gets written.
    """
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    note = ""

    def on_term(signum: int, frame: Any) -> None:
        raise _Terminated

    old = signal.signal(signal.SIGTERM, on_term)
    proc = None
    try:
        try:
            proc = subprocess.Popen(
                list(argv),
                env=dict(env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                text=True,
                errors="replace",
                bufsize=1,
            )
        except OSError as exc:
            return 127, [f"cannot start {argv[0]}: {exc}"], "launch failed"
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))
        status = proc.wait()
    except _Terminated:
        note = "terminated by SIGTERM (time limit or scancel)"
        tail.append(f"[optcc_mpi.lab.sweep] {note}")
        if proc is not None:
            launch.stop_group(proc, grace=STOP_GRACE_S)
        status = 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, old)
    if status < 0:  # killed by a signal: report it the way shells do
        status = 128 - status
    return status, list(tail), note


def _read_output(kind: str, path: Path) -> tuple[list[dict[str, Any]], str]:
    """Result rows the command wrote, and a note when there are none or they are bad."""
    if not path.exists():
        return [], f"the command wrote no {path.name}"
    text = path.read_text(errors="replace")
    rows: list[dict[str, Any]] = []
    if kind == "allreduce":
        if path.suffix == ".csv":
            rows = [dict(r) for r in csv.DictReader(io.StringIO(text))]
        else:
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    return rows, f"{path.name} line {n} is not JSON"
        return [{"record": "bench", **r} for r in rows], ""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return [], f"{path.name} is not JSON"
    return [{"record": "train", **_train_row(doc)}], ""


def _train_row(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A training run as one row: the summary numbers flat, the loss curve kept whole.

    ``wrong`` is 1 when the final loss is not a finite number (a diverged or broken run),
    so that every result row answers "did it work" in the same column.
    """
    stats = dict(doc.get("stats") or {})
    cfg = dict(doc.get("config") or {})
    recipe = cfg.get("recipe")
    loss = doc.get("final_loss")
    finite = isinstance(loss, (int, float)) and math.isfinite(loss)
    return {
        "final_loss": loss,
        "wrong": 0 if finite else 1,
        **{k: v for k, v in stats.items() if not isinstance(v, (dict, list))},
        "solver": cfg.get("solver"),
        "s": cfg.get("s"),
        "b": cfg.get("b"),
        "recipe": recipe.get("name") if isinstance(recipe, dict) else recipe,
        "p": cfg.get("P"),
        "model": cfg.get("model"),
        "data": doc.get("data"),
        "epoch_losses": doc.get("epoch_losses"),
        "history": doc.get("history"),
        "command": doc.get("command"),
    }


def task_command(
    kind: str,
    ranks: int,
    argv_after_program: Sequence[str],
    out: Path,
    params: Mapping[str, Any],
    results: str | os.PathLike[str],
    *,
    extra_env: Mapping[str, str] | None = None,
    job: str | None = None,
    task: int | None = None,
    table: Table | None = None,
    sweep: str | None = None,
) -> int:
    """Launch one command, then write its JSON-lines record file.

    Parameters
    ----------
    kind : {"allreduce", "casgd"}
        What the command is (how to read its output).
    ranks : int
        MPI processes.
    argv_after_program : sequence of str
        Arguments after ``optcc-mpi`` (``bench ...`` or ``train ...``).
    out : Path
        The file the command writes its results to.
    params : mapping
        The parameter row, recorded as it is.
    results : path-like
        Folder of the record files.
    extra_env : mapping, optional
        Variables added for the command (see :func:`task_env`).
    job, task : optional
        Array job and task ids; from Slurm by default.
    table : Table, optional
        The sweep table, recorded by name, path, hash and row count.
    sweep : str, optional
        The sweep's identity when there is no table (a single run: ``run:<job id>``).

    Returns
    -------
    int
        The command's exit status (0 when it and every check passed).
    """
    results = Path(results)
    results.mkdir(parents=True, exist_ok=True)
    job_id, task_id = _ids(job, task)
    chosen = launch.launcher()
    extra_env = {**chosen.env(ranks, nodes=_nodes()), **(extra_env or {})}
    env = {**os.environ, **extra_env}
    argv = [*chosen.argv(ranks), *wrapper_argv(env), *program_argv(), *argv_after_program]
    started, t0 = _now(), time.monotonic()
    print(f"[optcc_mpi.lab.sweep] task {job_id}_{task_id}: {shlex.join(argv)}", flush=True)
    status, tail, note = _run_streaming(argv, env)
    wall = time.monotonic() - t0
    rows, out_note = _read_output(kind, out)
    if status == 0 and not rows:
        # A command that "succeeds" without results is a failure of the experiment.
        status, note = 1, out_note or "the command wrote no result rows"
    elif out_note and not note:
        note = out_note
    ids = {"array_job_id": job_id, "array_task_id": task_id}
    record: dict[str, Any] = {
        "record": "task",
        **ids,
        "status": "ok" if status == 0 else "failed",
        "exit_code": status,
        "kind": kind,
        "params": dict(params),
        "ranks": ranks,
        "command": shlex.join(argv),
        "extra_env": dict(extra_env),
        "started": started,
        "finished": _now(),
        "wall_s": round(wall, 3),
        **provenance.record(),
    }
    if sweep is not None:
        record["sweep"] = sweep
    if table is not None:
        record.update(
            sweep=str(table.path),
            table=table.name,
            table_sha256=table.sha256,
            table_rows=len(table.rows),
        )
    if note:
        record["note"] = note
    if status != 0:
        record["log_tail"] = tail
    _write_jsonl(results / f"{job_id}_{task_id}.jsonl", [record, *({**ids, **r} for r in rows)])
    try:
        out.unlink()
        out.parent.rmdir()
    except OSError:
        pass
    verdict = "ok" if status == 0 else f"FAILED (exit {status}{'; ' + note if note else ''})"
    print(
        f"[optcc_mpi.lab.sweep] task {job_id}_{task_id}: {verdict}, {len(rows)} result rows, "
        f"{wall:.1f} s -> {results / f'{job_id}_{task_id}.jsonl'}",
        flush=True,
    )
    return status


def _write_jsonl(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as f:
        for r in records:
            f.write(json.dumps(r, default=str, allow_nan=True) + "\n")
    os.replace(tmp, path)  # readers never see half a file


def _work_file(results: Path, job: str, task: int, name: str) -> Path:
    # On the shared results folder, not node-local /tmp: rank 0 may run on another node.
    work = results / ".work" / f"{job}_{task}"
    work.mkdir(parents=True, exist_ok=True)
    out = work / name
    out.unlink(missing_ok=True)
    return out


def run_task(
    table: str | os.PathLike[str] | Table,
    task: int,
    results: str | os.PathLike[str],
    *,
    job: str | None = None,
) -> int:
    """Run array task ``task`` of a sweep table and record it (see :func:`task_command`)."""
    t = table if isinstance(table, Table) else read_table(table)
    results = Path(results)
    job_id, task_id = _ids(job, task)
    row = t.row(task_id)
    out = _work_file(
        results, job_id, task_id, "bench.jsonl" if t.kind.name == "allreduce" else "train.json"
    )
    ranks = int(row["ranks"])
    return task_command(
        t.kind.name,
        ranks,
        task_argv(t.kind, row, out),
        out,
        {"row": task_id, **row},
        results,
        extra_env=task_env(row, ranks),
        job=job_id,
        task=task_id,
        table=t,
    )


# ----------------------------------------------------------------------------- status


def array_spec(ids: Iterable[int]) -> str:
    """Compact Slurm ``--array`` list: ``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    out = []
    for _, grp in itertools.groupby(enumerate(sorted(set(ids))), lambda t: t[1] - t[0]):
        g = [v for _, v in grp]
        out.append(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}")
    return ",".join(out)


def parse_array_spec(spec: str) -> list[int]:
    """Task ids of a Slurm ``--array`` value (``"0-7:2,9"``; a ``%N`` limit is ignored)."""
    ids: list[int] = []
    for item in spec.split("%")[0].split(","):
        item = item.strip()
        if not item:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", item)
        if not m:
            raise ValueError(f"bad --array item {item!r} in {spec!r}")
        lo = int(m[1])
        hi = int(m[2]) if m[2] else lo
        ids.extend(range(lo, hi + 1, int(m[3] or 1)))
    return sorted(set(ids))


def write_manifest(
    results: str | os.PathLike[str],
    table: str | os.PathLike[str],
    job: str,
    tasks: Sequence[int],
    *,
    script: str = "",
    argv: Sequence[str] = (),
) -> Path:
    """Record a submission: which tasks of which table went into array job ``job``.

    A copy of the table is kept beside it (``tables/<sha>.csv``), so the results folder
    says exactly what ran even after the table is edited.
    """
    results = Path(results)
    t = read_table(table)
    copies = results / "tables"
    copies.mkdir(parents=True, exist_ok=True)
    copy = copies / f"{t.name}-{t.sha256[:12]}.csv"
    if not copy.exists():
        shutil.copyfile(t.path, copy)
    doc = {
        "array_job_id": str(job),
        "sweep": str(t.path),
        "table": t.name,
        "table_sha256": t.sha256,
        "table_copy": str(copy.relative_to(results)),
        "table_rows": len(t.rows),
        "kind": t.kind.name,
        "tasks": sorted(int(x) for x in tasks),
        "script": script,
        "sbatch": list(argv),
        "submitted": _now(),
        "host": socket.gethostname(),
    }
    path = results / f"manifest-{job}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def _job_key(job: str) -> tuple[int, str]:
    # Slurm job ids grow with time; local ids sort after none of them by accident.
    return (int(job), "") if str(job).isdigit() else (-1, str(job))


@dataclass
class TaskState:
    """What is known about one task of a sweep (its latest submission counts).

    Attributes
    ----------
    sweep : str
        The table's path when it was submitted (the sweep's identity).
    task : int
        Array task id (= table row).
    status : {"ok", "failed", "missing"}
        ``missing``: the latest submission of this task left no record (still queued or
        running, or killed before it could write one).
    job : str
        Array job id of the latest submission (or of the record, without a manifest).
    record : dict or None
        The task record of that submission.
    rows : list of dict
        Its result rows.
    attempts : list of (job, status)
        Every submission of the task, oldest first.
    """

    sweep: str
    task: int
    status: str
    job: str
    record: dict[str, Any] | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class SweepStatus:
    """Everything :func:`collect` found in a results folder."""

    tasks: list[TaskState]
    unreadable: list[str]
    manifests: list[dict[str, Any]]

    def by_status(self, status: str) -> list[TaskState]:
        """The tasks in ``status``."""
        return [t for t in self.tasks if t.status == status]

    @property
    def wrong(self) -> int:
        """Sum of ``wrong`` over the result rows of the tasks that count."""
        total = 0
        for t in self.tasks:
            for r in t.rows:
                try:
                    total += int(float(r.get("wrong") or 0))
                except (TypeError, ValueError):
                    total += 1  # a row that cannot say it is right is counted as wrong
        return total

    @property
    def ok(self) -> bool:
        """True when every task reported success and no row has wrong values."""
        return bool(self.tasks) and all(t.status == "ok" for t in self.tasks) and not self.wrong

    def summary(self) -> str:
        """Human-readable lines: counts, then each failed or missing task."""
        n = len(self.tasks)
        counts = collections.Counter(t.status for t in self.tasks)
        lines = [
            f"{n} tasks: {counts.get('ok', 0)} ok, {counts.get('failed', 0)} failed, "
            f"{counts.get('missing', 0)} missing; #wrong {self.wrong}"
        ]
        for t in self.tasks:
            if t.status == "ok":
                continue
            name = Path(t.sweep).name
            what = f"  {t.status:7s} {name} task {t.task} (job {t.job})"
            rec = t.record or {}
            if t.status == "failed":
                what += f": exit {rec.get('exit_code')}"
                if rec.get("note"):
                    what += f", {rec['note']}"
                why = error_line(rec.get("log_tail") or [])
                if why:
                    what += f"; {why[:200]}"
            else:
                what += ": no record (queued, running, or killed before writing one)"
            lines.append(what)
        lines.extend(f"  unreadable record file: {u}" for u in self.unreadable)
        return "\n".join(lines)


# Lines the launchers add when one rank fails and they tear the rest down: they mention
# "error" but never say why the program failed (srun's own messages, slurmstepd's
# "*** STEP 89.0 ON vm CANCELLED ***", Open MPI's prterun banners, Hydra's summaries).
_LAUNCHER_LINE = re.compile(
    r"^(srun:|slurmstepd|prte|mpiexec|mpirun|\[mpiexec@|\*\*\*|=+ *$|-+ *$)",
    re.IGNORECASE,
)


def error_line(lines: Iterable[str]) -> str | None:
    """The line of a log tail that best says why a task failed: the last one that mentions
    an error and is the program's own (launchers such as srun, slurmstepd and mpiexec add
    their own lines after the program's message), else the last non-empty line."""
    kept = [str(ln).strip() for ln in lines if str(ln).strip()]
    for ln in reversed(kept):
        low = ln.lower()
        telling = "error" in low or "traceback" in low or "exception" in low
        if telling and not _LAUNCHER_LINE.search(ln):
            return ln
    return kept[-1] if kept else None


def _read_record_file(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    if not lines:
        raise ValueError("empty")
    docs = [json.loads(ln) for ln in lines]
    head = docs[0]
    if head.get("record") != "task":
        raise ValueError("the first line is not a task record")
    return head, docs[1:]


def collect(results: str | os.PathLike[str]) -> SweepStatus:
    """Gather every task record and manifest under ``results`` (not recursive).

    For each (sweep, task) the latest submission counts: its record if it wrote one, else
    ``missing``. Submissions are known from the manifests; record files without a manifest
    (a script submitted with plain ``sbatch``) count by themselves, and the array's task
    range from their Slurm variables names the tasks that should have reported.
    """
    results = Path(results)
    if not results.is_dir():
        raise FileNotFoundError(f"no results folder {results}")
    manifests = []
    for path in sorted(results.glob("manifest-*.json")):
        try:
            manifests.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    records: dict[tuple[str, str, int], tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    unreadable = []
    for path in sorted(results.glob("*.jsonl")):
        try:
            head, rows = _read_record_file(path)
        except (OSError, ValueError) as exc:
            unreadable.append(f"{path.name} ({exc})")
            continue
        sweep = str(head.get("sweep") or head.get("table") or "")
        key = (sweep, str(head.get("array_job_id")), int(head.get("array_task_id") or 0))
        records[key] = (head, rows)
    # submissions[(sweep, task)] = set of jobs that included the task
    submissions: dict[tuple[str, int], set[str]] = collections.defaultdict(set)
    for m in manifests:
        for task in m.get("tasks", []):
            submissions[(m["sweep"], int(task))].add(str(m["array_job_id"]))
    jobs_with_manifest = {str(m["array_job_id"]) for m in manifests}
    for (sweep, job, task), (head, _) in records.items():
        submissions[(sweep, task)].add(job)
        if job in jobs_with_manifest:
            continue
        # Without a manifest, the array's own range says which tasks were asked for.
        slurm = head.get("slurm") or {}
        lo, hi = slurm.get("array_task_min"), slurm.get("array_task_max")
        if lo is not None and hi is not None:
            for t in range(int(lo), int(hi) + 1):
                submissions[(sweep, t)].add(job)
    states = []
    for (sweep, task), jobs in sorted(submissions.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        ordered = sorted(jobs, key=_job_key)
        attempts = []
        for job in ordered:
            rec = records.get((sweep, job, task))
            attempts.append((job, rec[0].get("status", "failed") if rec else "missing"))
        job = ordered[-1]
        rec = records.get((sweep, job, task))
        if rec is None:
            states.append(TaskState(sweep, task, "missing", job, None, [], attempts))
        else:
            head, rows = rec
            status = "ok" if head.get("status") == "ok" else "failed"
            states.append(TaskState(sweep, task, status, job, head, rows, attempts))
    return SweepStatus(states, unreadable, manifests)


def failed_tasks(results: str | os.PathLike[str], table: str | os.PathLike[str]) -> list[int]:
    """Tasks of ``table`` whose latest submission failed or left no record.

    A table never submitted to ``results`` has every row to do. Tasks are matched by the
    table's path, so a table can be corrected (e.g. a misspelt algorithm) and its failed
    rows resubmitted.
    """
    t = read_table(table)
    st = collect(results)
    mine = [s for s in st.tasks if s.sweep == str(t.path)]
    if not mine:
        return list(range(len(t.rows)))
    done = {s.task for s in mine if s.status == "ok"}
    return [i for i in range(len(t.rows)) if i not in done]


# ----------------------------------------------------------------------------- expand


def expand(kind: str, axes: Mapping[str, Sequence[str]]) -> str:
    """A sweep table (CSV text) over the Cartesian product of ``axes``.

    Parameters
    ----------
    kind : str
        ``allreduce`` or ``casgd``.
    axes : mapping of column to values
        E.g. ``{"algorithm": ["ring", "optcc"], "loss": ["0", "0.5"]}``; the first axis
        varies slowest.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    bad = [c for c in axes if c not in KINDS[kind].columns]
    if bad:
        raise ValueError(f"unknown column(s) for {kind}: {', '.join(bad)}")
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["kind", *axes])
    for combo in itertools.product(*axes.values()):
        w.writerow([kind, *combo])
    return buf.getvalue()


# ----------------------------------------------------------------------------- CLI


def exec_command(
    kind: str,
    ranks: int,
    args: Sequence[str],
    results: str | os.PathLike[str],
    *,
    job: str | None = None,
) -> int:
    """Run one ``optcc-mpi bench`` (``kind="allreduce"``) or ``train`` (``"casgd"``) with
    ``args`` on ``ranks`` ranks, without a table, and record it like a sweep task
    (``optcc-mpi sweep exec``, used by ``jobs/allreduce.sbatch``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    if not args:
        raise ValueError("exec: give the optcc-mpi arguments after --, e.g. -- -b 1M -e 64M")
    results = Path(results)
    job_id, task = _ids(job, None)
    out = _work_file(results, job_id, task, "bench.jsonl" if kind == "allreduce" else "train.json")
    argv = ["bench" if kind == "allreduce" else "train", *args, "--out", str(out)]
    if kind == "casgd":
        argv.insert(1, "--no-progress")
    params = {"ranks": str(ranks), "args": shlex.join(args)}
    return task_command(
        kind, ranks, argv, out, params, results, job=job_id, task=task, sweep=f"run:{job_id}"
    )


if __name__ == "__main__":
    # The old command line of this module is `optcc-mpi sweep` now; the lab never imports
    # the CLI, so it cannot run it from here: say where it went.
    sys.exit(
        "python -m optcc_mpi.lab.sweep is now `optcc-mpi sweep` "
        "(also `python -m optcc_mpi sweep`), with the same arguments"
    )
