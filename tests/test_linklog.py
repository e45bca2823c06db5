"""The link log (``optcc_mpi.linklog``), the watch's records in it, and ``report --links``.

Serial: the watch is driven through its own interface (the observations of a call as a
vector of rates, as the MPI tests feed it from real calls). The emulated MPI run is in
tests/test_linklog_mpi.py; a run on real shaped links in tests/test_testbed.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from optcc_mpi import config, linklog
from optcc_mpi.cli import main as cli_main
from optcc_mpi.lab import report
from optcc_mpi.links import Links
from optcc_mpi.schedule import ScheduleBuilder
from optcc_mpi.watch import LinkWatch


def sched(name: str, p: int = 4):
    b = ScheduleBuilder(p, 8, name)
    b.transfer(0, 1, 0, 8)
    return b.build()


def test_records_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "links.jsonl"
    log = linklog.LinkLog(path)
    log.adopted(7, 4, Links.parse("2:0.5"), Links.parse("2:0.48"))
    recs = linklog.read(path)
    assert [r["event"] for r in recs] == ["start", "adopt"]
    start, adopt = recs
    assert start["p"] == 4 and start["source"] == "watch" and start["pid"] > 0
    assert adopt["call"] == 7 and adopt["links"] == "2:0.5"
    assert adopt["fractions"] == [1.0, 1.0, 0.5, 1.0]
    assert adopt["measured"] == [1.0, 1.0, 0.48, 1.0]
    assert start["run"] == adopt["run"] == log.run and adopt["time"] >= start["time"]
    # A second log (another run) appends to the same file; its records are its own.
    other = linklog.LinkLog(path)
    other.adopted(1, 4, Links())
    recs = linklog.read(path)
    assert len(recs) == 4 and len(report.link_runs(recs)) == 2


def test_calls_are_written_when_something_changes(tmp_path: Path) -> None:
    """One record per change of algorithm or profile; the same state again only after
    `every` seconds, and the last one held back is written by flush (at exit)."""
    path = tmp_path / "l.jsonl"
    log = linklog.LinkLog(path, every=3600)
    healthy, slow = Links(), Links.parse("1:0.5")
    wrote = [
        log.ran(1, 4, "ring", healthy),
        log.ran(2, 4, "ring", healthy),
        log.ran(3, 4, "optcc", slow),
        log.ran(4, 4, "optcc", slow),
        log.ran(5, 4, "ring", slow, explore=True),
        log.ran(6, 4, "optcc", slow),
        log.ran(7, 4, "optcc", slow),
    ]
    assert wrote == [True, False, True, False, True, True, False]
    log.flush()
    calls = [r for r in linklog.read(path) if r["event"] == "call"]
    assert [c["call"] for c in calls] == [1, 3, 5, 6, 7]
    assert [c["algorithm"] for c in calls] == ["ring", "optcc", "ring", "optcc", "optcc"]
    assert calls[2]["explore"] and not calls[1]["explore"]
    log.flush()  # nothing more held back
    assert len(linklog.read(path)) == 6
    beat = linklog.LinkLog(tmp_path / "b.jsonl", every=0)
    assert beat.ran(1, 2, "ring", healthy) and beat.ran(2, 2, "ring", healthy)


def test_which_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(linklog.ENV_LINKS_LOG, raising=False)
    config.reload()
    assert linklog.from_env() is None
    monkeypatch.setenv(linklog.ENV_LINKS_LOG, str(tmp_path / "env.jsonl"))
    config.reload()
    assert linklog.from_env().path == tmp_path / "env.jsonl"
    with linklog.recording(tmp_path / "given.jsonl"):
        assert linklog.from_env().path == tmp_path / "given.jsonl"
        with linklog.recording(None):  # None changes nothing
            assert linklog.from_env().path == tmp_path / "given.jsonl"
    assert linklog.from_env().path == tmp_path / "env.jsonl"
    with pytest.raises(ValueError, match="is a folder"), linklog.recording(tmp_path):
        pass


def test_bad_files_are_named_with_their_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"event": "start"}\n\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:3: not JSON"):
        linklog.read(path)
    path.write_text('{"event": "start"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=":2: not a link record"):
        linklog.read(path)
    with pytest.raises(FileNotFoundError):
        linklog.read(tmp_path / "none.jsonl")


def watched(p: int, log: linklog.LinkLog, rank: int = 0) -> LinkWatch:
    w = LinkWatch(p, log=log)
    w.record(rank, [], schedule=sched("ring", p))  # call 0 on this rank: learns the rank
    return w


def test_the_watch_records_what_it_adopts_and_runs(tmp_path: Path) -> None:
    """Rank 0's watch: rank 2 measured at half rate in two calls in a row is adopted at
    the second (confirm = 2), with the call number; what each call ran follows."""
    path = tmp_path / "w.jsonl"
    w = watched(4, linklog.LinkLog(path, every=3600))
    rates = np.array([1e8, 1e8, 0.5e8, 1e8])
    for _ in range(2):
        profile = w.agree(rates)
        w.record(0, [], schedule=sched("optcc" if profile.fractions else "ring"))
    assert w.changes == [(2, Links({2: 0.5}))]
    recs = linklog.read(path)
    assert [(r["event"], r.get("call")) for r in recs] == [
        ("start", None),
        ("call", 0),
        ("adopt", 2),
        ("call", 2),
    ]
    assert recs[2]["links"] == "2:0.5" and recs[2]["measured"][2] == 0.5
    assert recs[3]["algorithm"] == "optcc" and recs[3]["links"] == "2:0.5"


def test_other_ranks_and_unwatched_runs_write_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "w.jsonl"
    w = watched(4, linklog.LinkLog(path), rank=1)
    for _ in range(2):
        w.agree(np.array([1e8, 1e8, 0.5e8, 1e8]))
        w.record(1, [], schedule=sched("optcc"))
    assert w.changes and not path.exists()
    monkeypatch.delenv(linklog.ENV_LINKS_LOG, raising=False)
    config.reload()
    assert LinkWatch(4).log is None  # no file named: no log at all
    monkeypatch.setenv(linklog.ENV_LINKS_LOG, str(path))
    config.reload()
    assert LinkWatch(4).log.path == path


def synthetic_log(path: Path) -> None:
    log = linklog.LinkLog(path, every=3600)
    log.ran(1, 4, "ring", Links())
    log.adopted(3, 4, Links.parse("1:0.5"), Links.parse("1:0.47"))
    log.ran(3, 4, "optcc", Links.parse("1:0.5"), Links.parse("1:0.47"))
    log.ran(9, 4, "ring", Links.parse("1:0.5"), explore=True)
    log.adopted(10, 4, Links())
    log.ran(10, 4, "ring", Links())
    log.ran(11, 4, "ring", Links())
    log.flush()
    log.doctor(
        {"status": "healthy", "links": "healthy", "summary": "HEALTHY: 4 nodes",
         "ranks": [{"rank": r, "fraction": 1.0} for r in range(4)]},
        4,
    )  # fmt: skip


def test_report_links_prints_and_draws_the_timeline(tmp_path: Path, capsys) -> None:
    path = tmp_path / "links.jsonl"
    synthetic_log(path)
    text = report.links_summary(linklog.read(path))
    assert "4 ranks" in text and "11 calls recorded" in text
    lines = text.splitlines()
    assert any("call      3  adopted 1:0.5" in line for line in lines)
    assert any("call      3  ran optcc under 1:0.5" in line for line in lines)
    assert any("(exploring: the healthy profile)" in line for line in lines)
    assert any("doctor: HEALTHY: 4 nodes" in line for line in lines)
    assert cli_main(["report", "--links", str(path), "--plots", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    png = tmp_path / "p" / "links_timeline.png"
    assert f"wrote {png}" in out and png.stat().st_size > 10_000
    # Without --plots the picture goes beside the log.
    assert cli_main(["report", "--links", str(path)]) == 0
    assert path.with_suffix(".png").exists()


def test_report_links_errors(tmp_path: Path, capsys) -> None:
    assert cli_main(["report", "--links", str(tmp_path / "none.jsonl")]) == 2
    assert "no link log" in capsys.readouterr().err
    path = tmp_path / "l.jsonl"
    path.write_text(json.dumps({"event": "start", "run": "x"}) + "\n")
    assert cli_main(["report", "--links", str(path), "--simulate"]) == 2
    assert "alone" in capsys.readouterr().err
    # A log with nothing to draw still prints (and says it drew nothing).
    assert cli_main(["report", "--links", str(path)]) == 0
    assert not path.with_suffix(".png").exists()


def test_train_refuses_a_log_without_the_watch(tmp_path: Path, capsys) -> None:
    rc = cli_main(["train", "--links-log", str(tmp_path / "l.jsonl"), "--epochs", "1"])
    assert rc == 2
    assert "--links-log records what --links watch adopts" in capsys.readouterr().err
