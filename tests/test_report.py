"""Tests of sweep tables and records (``optcc_mpi.lab.sweep``) and of the report
(``optcc_mpi.lab.report``, ``optcc-mpi report``). Serial, no Slurm and no MPI: commands are
stood in for by small Python programs written into the test's folder."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import textwrap
from pathlib import Path

import pytest

from optcc_mpi import config, model
from optcc_mpi.cli import main as cli_main
from optcc_mpi.lab import report, reproduce, sweep

# A program that behaves like `optcc-mpi bench` as far as the sweep runner can tell: it
# writes rows to --out, and rejects an unknown algorithm as the real command does.
FAKE_BENCH = textwrap.dedent("""\
    import json, sys
    args = sys.argv[1:]
    out = args[args.index("--out") + 1]
    alg = args[args.index("--algorithms") + 1]
    if alg not in ("ring", "optcc", "r2ccl", "native", "auto"):
        print("some output first")
        print(f"optcc-mpi bench: error: unknown algorithm {alg!r}", file=sys.stderr)
        sys.exit(2)
    links = args[args.index("--links") + 1] if "--links" in args else ""
    with open(out, "w") as f:
        for size in (1 << 20, 1 << 21):
            for name in ("ring (fault-free)", alg):
                f.write(json.dumps({"algorithm": name, "size": size, "p": 4, "wrong": 0,
                                    "links": "" if name.startswith("ring (") else links,
                                    "time_us": 100.0 * size / (1 << 20),
                                    "ratio_fault_free": 1.0 if name.startswith("ring (") else 1.5,
                                    "model_us": 90.0, "bound_us": 80.0}) + "\\n")
""")


@pytest.fixture
def fake_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run sweep tasks without MPI: no launcher, the fake bench as the program."""
    prog = tmp_path / "fake_bench.py"
    prog.write_text(FAKE_BENCH)
    monkeypatch.setenv("OPTCC_LAUNCHER", "env OPTCC_FAKE_RANKS={ranks}")
    config.reload()
    monkeypatch.setenv("OPTCC_PROGRAM", f"{sys.executable} {prog}")
    config.reload()
    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def _table(tmp_path: Path, text: str, name: str = "t.csv") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# ----------------------------------------------------------------------------- tables


def test_table_kind_from_column_and_defaults(tmp_path: Path) -> None:
    t = sweep.read_table(
        _table(
            tmp_path,
            """\
        # a comment line, then a blank one

        kind,algorithm,loss,ranks
        allreduce,ring,0.5,8
        allreduce,optcc,,4
        """,
        )
    )
    assert t.kind.name == "allreduce"
    assert len(t.rows) == 2
    assert t.rows[1]["loss"] == "0"  # empty cell -> default
    assert t.rows[0]["size"] == "1M"
    assert t.max_ranks == 8
    assert t.kind.script == "allreduce-sweep.sbatch"


def test_table_kind_from_header(tmp_path: Path) -> None:
    t = sweep.read_table(_table(tmp_path, "solver,s,b,recipe\ncasgd,8,32,C\n"))
    assert t.kind.name == "casgd"
    assert t.kind.script == "casgd-sweep.sbatch"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kind,algorithm,bogus\nallreduce,ring,1\n", "unknown column"),
        ("kind,algorithm\nallreduce,ring\ncasgd,ring\n", "same kind"),
        ("kind,algorithm\nnosuch,ring\n", "unknown kind"),
        ("label\nx\n", "cannot tell the sweep kind"),
        ("kind,loss\nallreduce,1.5\n", "fraction of bandwidth lost"),
        ("kind,ranks\nallreduce,0\n", "at least 1"),
        ("kind,degrade\nallreduce,magic\n", "degrade"),
        ("# only a comment\n", "empty"),
    ],
)
def test_table_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sweep.read_table(_table(tmp_path, text))


def test_bad_algorithm_is_left_to_the_command(tmp_path: Path) -> None:
    # Only the command knows its algorithms: the row must fail as a task, with a record.
    t = sweep.read_table(_table(tmp_path, "kind,algorithm\nallreduce,no-such-algorithm\n"))
    assert t.rows[0]["algorithm"] == "no-such-algorithm"


def test_links_and_argv() -> None:
    kind = sweep.KINDS["allreduce"]
    row = dict(
        kind.columns,
        algorithm="optcc",
        loss="0.25",
        stragglers="0-3,9",
        size="64K:16M",
        emulate="bw=200MB/s",
        extra="--no-reference",
    )
    assert sweep.links_for(row) == "0-3:0.75,9:0.75"
    argv = sweep.task_argv(kind, row, "/x/out.jsonl")
    assert argv[:7] == ["bench", "-b", "64K", "-e", "16M", "-f", "2"]
    assert argv[argv.index("--links") + 1] == "0-3:0.75,9:0.75"
    assert argv[argv.index("--emulate") + 1] == "bw=200MB/s"
    assert argv[argv.index("--out") + 1] == "/x/out.jsonl"
    assert argv[-1] == "--no-reference"
    assert sweep.links_for(dict(row, loss="0")) == ""
    assert sweep.links_for(dict(row, links="5:0.5")) == "5:0.5"

    ck = sweep.KINDS["casgd"]
    crow = dict(ck.columns, solver="casgd", s="8", dataset="higgs.h5", recipe="D")
    cargv = sweep.task_argv(ck, crow, "o.json")
    assert cargv[0] == "train"
    assert cargv[cargv.index("--s") + 1] == "8"
    assert cargv[cargv.index("--data") + 1] == "higgs.h5"
    assert "--links" not in cargv
    assert "--data" not in sweep.task_argv(ck, dict(crow, dataset="synthetic"), "o.json")


def test_task_env_throttles_oversubscribed_mpich(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MPIR_CVAR_CH4_PROGRESS_THROTTLE", raising=False)
    monkeypatch.delenv("SLURM_JOB_NUM_NODES", raising=False)
    row = dict(sweep.KINDS["allreduce"].columns)
    cores = len(os.sched_getaffinity(0))
    assert sweep.task_env(row, cores + 1)["MPIR_CVAR_CH4_PROGRESS_THROTTLE"] == "1"
    assert "MPIR_CVAR_CH4_PROGRESS_THROTTLE" not in sweep.task_env(row, 1)
    env = sweep.task_env(dict(row, loss="0.5", stragglers="2", degrade="ucx"), 1)
    assert env["OPTCC_STRAGGLER_PROCIDS"] == "2"
    assert env["OPTCC_STRAGGLER_FRACTION"] == "0.5"
    assert env["OPTCC_DEGRADE_METHOD"] == "ucx"


def test_array_spec_round_trip() -> None:
    assert sweep.array_spec([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert sweep.array_spec([3]) == "3"
    assert sweep.parse_array_spec("0-2,5,7-8%2") == [0, 1, 2, 5, 7, 8]
    assert sweep.parse_array_spec("0-6:3") == [0, 3, 6]
    with pytest.raises(ValueError):
        sweep.parse_array_spec("a-b")


def test_expand_product() -> None:
    text = sweep.expand("allreduce", {"algorithm": ["ring", "optcc"], "loss": ["0", "0.5"]})
    rows = list(csv.DictReader(text.splitlines()))
    assert [(r["algorithm"], r["loss"]) for r in rows] == [
        ("ring", "0"),
        ("ring", "0.5"),
        ("optcc", "0"),
        ("optcc", "0.5"),
    ]
    assert {r["kind"] for r in rows} == {"allreduce"}
    with pytest.raises(ValueError, match="unknown column"):
        sweep.expand("allreduce", {"bogus": ["1"]})


# ----------------------------------------------------------------------------- tasks


def _records(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def test_run_task_writes_record_and_rows(fake_env: Path) -> None:
    table = _table(fake_env, "kind,algorithm,loss,ranks\nallreduce,optcc,0.5,4\n")
    res = fake_env / "res"
    assert sweep.run_task(table, 0, res, job="77") == 0
    recs = _records(res / "77_0.jsonl")
    head, rows = recs[0], recs[1:]
    assert head["record"] == "task" and head["status"] == "ok" and head["exit_code"] == 0
    assert head["params"]["algorithm"] == "optcc" and head["params"]["row"] == 0
    assert head["table"] == "t" and head["table_rows"] == 1
    assert head["mpi"].get("vendor") or head["mpi"].get("error")
    assert head["optcc_mpi"]["version"]
    assert "git_rev" in head["optcc_mpi"]
    assert "--links 0:0.5" in head["command"]
    assert len(rows) == 4
    assert all(
        r["record"] == "bench" and r["array_job_id"] == "77" and r["array_task_id"] == 0
        for r in rows
    )
    assert not (res / ".work" / "77_0").exists()  # the command's own output is folded in


def test_run_task_failure_leaves_a_failed_record(fake_env: Path) -> None:
    table = _table(fake_env, "kind,algorithm\nallreduce,ring\nallreduce,no-such-algorithm\n")
    res = fake_env / "res"
    assert sweep.run_task(table, 1, res, job="78") == 2
    (head,) = _records(res / "78_1.jsonl")
    assert head["status"] == "failed"
    assert head["exit_code"] == 2
    assert any("unknown algorithm" in ln for ln in head["log_tail"])


@pytest.mark.parametrize(
    "tail, expected",
    [
        # srun cancels the other ranks' step after the program's own message
        (
            [
                "optcc-mpi bench: error: unknown algorithm 'x'",
                "srun: error: vm: task 1: Exited with exit code 2",
                "slurmstepd-vm: error: *** STEP 89.0 ON vm CANCELLED AT 2026-12-03T19:21:00 ***",
            ],
            "optcc-mpi bench: error: unknown algorithm 'x'",
        ),
        (
            [
                "Traceback (most recent call last):",
                "ValueError: bad size",
                "[mpiexec@vm] Press Ctrl-C again to force abort",
                "prterun detected that one or more processes exited with non-zero status, error",
            ],
            "ValueError: bad size",
        ),
        (["no message at all", "last line"], "last line"),
        ([], None),
    ],
)
def test_error_line_skips_launcher_lines(tail: list[str], expected: str | None) -> None:
    assert sweep.error_line(tail) == expected


def test_run_task_without_rows_is_a_failure(
    fake_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPTCC_PROGRAM", f"{sys.executable} -c pass")
    config.reload()
    table = _table(fake_env, "kind,algorithm\nallreduce,ring\n")
    assert sweep.run_task(table, 0, fake_env / "res", job="79") == 1
    (head,) = _records(fake_env / "res" / "79_0.jsonl")
    assert head["status"] == "failed" and "no" in head["note"]


def test_task_out_of_range(fake_env: Path) -> None:
    table = _table(fake_env, "kind,algorithm\nallreduce,ring\n")
    with pytest.raises(ValueError, match="out of range"):
        sweep.run_task(table, 3, fake_env / "res", job="80")


# ----------------------------------------------------------------------------- collecting


def test_missing_failed_and_resubmitted(fake_env: Path) -> None:
    table = _table(
        fake_env,
        """\
        kind,algorithm,loss
        allreduce,ring,0.5
        allreduce,no-such-algorithm,0.5
        allreduce,optcc,0.5
        """,
    )
    res = fake_env / "res"
    sweep.write_manifest(res, table, "100", [0, 1, 2])
    sweep.run_task(table, 0, res, job="100")
    sweep.run_task(table, 1, res, job="100")
    # task 2 never reports: it must show as missing, not vanish
    st = sweep.collect(res)
    assert [(t.task, t.status) for t in st.tasks] == [(0, "ok"), (1, "failed"), (2, "missing")]
    assert not st.ok
    assert "missing" in st.summary() and "unknown algorithm" in st.summary()
    assert sweep.failed_tasks(res, table) == [1, 2]
    assert (res / "tables").is_dir() and list((res / "tables").iterdir())

    res_load = report.load(res)
    assert not res_load.ok
    by_task = {}
    for r in res_load.rows:
        by_task.setdefault(r["array_task_id"], []).append(r)
    assert by_task[1][0]["status"] == "failed" and by_task[1][0]["wrong"] is None
    assert by_task[2][0]["status"] == "missing"
    assert "unknown algorithm" in by_task[1][0]["error_line"]

    # Fix the table, resubmit only what failed (as submit-sweep.sh --only-failed does).
    table.write_text(table.read_text().replace("no-such-algorithm", "r2ccl"))
    todo = sweep.failed_tasks(res, table)
    sweep.write_manifest(res, table, "101", todo)
    for task in todo:
        assert sweep.run_task(table, task, res, job="101") == 0
    st = sweep.collect(res)
    assert st.ok and st.wrong == 0
    assert [(t.task, t.job) for t in st.tasks] == [(0, "100"), (1, "101"), (2, "101")]
    assert st.tasks[1].attempts == [("100", "failed"), ("101", "ok")]
    assert sweep.failed_tasks(res, table) == []


def test_records_without_manifest_use_the_array_range(
    fake_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = _table(fake_env, "kind,algorithm\nallreduce,ring\nallreduce,optcc\n")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "0")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MAX", "1")
    sweep.run_task(table, 0, fake_env / "res", job="200")
    st = sweep.collect(fake_env / "res")
    assert [(t.task, t.status) for t in st.tasks] == [(0, "ok"), (1, "missing")]


def test_unreadable_record_is_reported(tmp_path: Path) -> None:
    (tmp_path / "5_0.jsonl").write_text("not json\n")
    st = sweep.collect(tmp_path)
    assert st.unreadable and "5_0.jsonl" in st.summary()


# ----------------------------------------------------------------------------- the CSV


def test_csv_rows_carry_ids_and_wrong(fake_env: Path) -> None:
    table = _table(fake_env, "kind,algorithm,loss\nallreduce,ring,0.5\nallreduce,optcc,0.25\n")
    res = fake_env / "res"
    sweep.write_manifest(res, table, "300", [0, 1])
    for task in (0, 1):
        sweep.run_task(table, task, res, job="300")
    out = fake_env / "all.csv"
    assert cli_main(["report", str(res), "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 8  # 2 tasks x 2 sizes x (reference + algorithm)
    header = list(rows[0])
    assert header[:5] == ["table", "array_job_id", "array_task_id", "status", "wrong"]
    assert all(
        r["array_job_id"] == "300" and r["wrong"] == "0" and r["status"] == "ok" for r in rows
    )
    assert {r["array_task_id"] for r in rows} == {"0", "1"}
    assert {r["loss"] for r in rows if r["algorithm"] == "optcc"} == {"0.25"}
    assert all(r["mpi_vendor"] for r in rows)


def test_cli_exit_status_reports_failures(fake_env: Path, capsys: pytest.CaptureFixture) -> None:
    table = _table(fake_env, "kind,algorithm\nallreduce,no-such-algorithm\n")
    sweep.run_task(table, 0, fake_env / "res", job="400")
    assert cli_main(["report", str(fake_env / "res")]) == 1
    out = capsys.readouterr().out
    assert "1 failed" in out and "exit 2" in out


def test_cli_help_teaches() -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["report", "--help"])
    assert exc.value.code == 0


def test_cli_help_text(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        cli_main(["report", "--help"])
    text = capsys.readouterr().out
    assert "examples:" in text and "--simulate" in text and "--only-failed" in text


def test_cli_needs_a_mode(capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["report"]) == 2
    assert "RESULTS_DIR" in capsys.readouterr().err


# ----------------------------------------------------------------------------- plots


def _bench_row(alg: str, size: int, loss: float, ratio: float, p: int = 8) -> dict:
    return {
        "kind": "allreduce",
        "status": "ok",
        "algorithm": alg,
        "size": size,
        "p": p,
        "loss": loss,
        "links": f"0:{1 - loss}" if loss and alg != report.REFERENCE else "",
        "time_us": 1e3 * ratio * size / 2**20,
        "ratio_fault_free": ratio,
        "model_us": 1e3 * size / 2**20,
        "table": "t",
        "array_job_id": "1",
        "array_task_id": hash((alg, loss)) % 100,
    }


def test_plots_are_written(tmp_path: Path) -> None:
    rows = []
    for loss in (0.0, 0.25, 0.5):
        for alg, ratio in (("ring", 1 / (1 - loss)), ("optcc", 1.05), (report.REFERENCE, 1.0)):
            for size in (2**20, 2**22):
                rows.append(_bench_row(alg, size, loss, ratio))
    hist = []
    for solver, s, t in (("sgd", 1, 2.0), ("casgd", 4, 1.0), ("casgd", 16, 0.6)):
        r = {
            "kind": "casgd",
            "status": "ok",
            "solver": solver,
            "s": s,
            "b": 32,
            "recipe": "C",
            "p": 4,
            "dataset": "synthetic",
            "algorithm": "mpi",
            "train_s": t,
            "comm_s": t / 2,
            "final_loss": 0.5,
        }
        rows.append(r)
        hist.append({**r, "history": [{"train_s": 0.0, "loss": 0.69}, {"train_s": t, "loss": 0.5}]})
    res = report.Results(rows, sweep.SweepStatus([], [], []), hist)
    made = report.plot_results(res, tmp_path / "plots")
    names = sorted(p.name for p in made)
    assert names == [
        "casgd_loss_vs_time.png",
        "casgd_speedup_vs_s.png",
        "overhead_vs_loss.png",
        "time_vs_size.png",
    ]
    for p in made:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_no_plots_without_data(tmp_path: Path) -> None:
    res = report.Results([], sweep.SweepStatus([], [], []), [])
    assert report.plot_results(res, tmp_path) == []


# ----------------------------------------------------------------------------- reproduction


def test_reproduce_sources_and_oracles() -> None:
    rows = reproduce.reproduce(
        ps=(4, 8, 16), losses=(0.25, 0.5), gpus_per_server=(1, 4), sim_max_p=8, size=1 << 24
    )
    get = {(r["gpus_per_server"], r["p"], r["loss"], r["algorithm"]): r for r in rows}
    # p < 2g is skipped: the degraded server would be the whole job
    assert (4, 4, 0.5, "optcc") not in get and (4, 8, 0.5, "optcc") in get
    assert get[(1, 8, 0.5, "optcc")]["source"] == "simulator"
    assert get[(1, 16, 0.5, "optcc")]["source"] == "model"
    assert get[(1, 16, 0.5, "optcc")]["overhead_sim"] is None
    # the bound at p = 8, X = 1/2 is 1/(p-1) = 14.3% (the paper's "tension")
    assert get[(1, 8, 0.5, "ring")]["overhead_bound"] == pytest.approx(1 / 7)
    assert get[(1, 8, 0.5, "ring")]["overhead_model"] == pytest.approx(1.0)
    # R2CCL's model is 8/14 = 57.1% for K -> infinity; our schedule pipelines its tail in
    # K = 16 chunks, and its registered cost says so: T3 = Y n / (f B) = n/B grows by 1/16,
    # over T_ff = 14/8 n/B.
    want = 8 / 14 + (1 / 16) / (14 / 8)
    assert get[(1, 8, 0.5, "r2ccl")]["overhead_model"] == pytest.approx(want)
    for r in rows:
        assert r["overhead_model"] >= r["overhead_bound"] - 1e-9
        if r["overhead_sim"] is not None:
            assert r["overhead_sim"] >= r["overhead_bound"] - 1e-6
            assert r["overhead"] == r["overhead_sim"]
    # the g-GPU reading: 4 ranks at 1 - X
    links = {r: 0.5 for r in range(4)}
    assert get[(4, 16, 0.5, "ring")]["overhead_bound"] == pytest.approx(
        model.lower_bound(16, 1.0, 1.0, links) / model.fault_free(16, 1.0, 1.0) - 1
    )
    text = reproduce.reproduction_markdown(rows)
    assert "14.3%" in text and "2-6%" in text and "our reading" in text


def test_reproduction_files(tmp_path: Path) -> None:
    rows = reproduce.reproduce(ps=(8, 32), losses=(0.5,), gpus_per_server=(1,), sim_max_p=0)
    assert {r["source"] for r in rows} == {"model"}
    csv_path = reproduce.write_reproduction_csv(rows, tmp_path / "r.csv")
    got = list(csv.DictReader(csv_path.open()))
    assert len(got) == 6 and {g["source"] for g in got} == {"model"}
    opt = [g for g in got if g["algorithm"] == "optcc" and g["p"] == "32"][0]
    assert math.isclose(float(opt["overhead"]), 1 / 31, rel_tol=1e-6)
    png = reproduce.plot_reproduction(rows, tmp_path / "r.png")
    assert png.stat().st_size > 10_000


def test_cli_simulate(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    md = tmp_path / "r.md"
    assert (
        cli_main(
            [
                "report",
                "--simulate",
                "--p",
                "8,16",
                "--loss",
                "0.5",
                "--gpus-per-server",
                "1",
                "--sim-max-p",
                "8",
                "--size",
                "16M",
                "--no-progress",
                "--markdown",
                str(md),
                "--csv",
                str(tmp_path / "r.csv"),
                "--plots",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| g | p | bound |" in out and md.read_text().startswith("Overhead = ")
    assert (tmp_path / "reproduction.png").exists()
