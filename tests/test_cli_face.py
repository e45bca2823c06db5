"""One command-line face: one name per idea (old names kept as aliases), a wrong flag
answered with the command's own usage, help text on every option, the lab's tools as
``optcc-mpi lab TOOL`` over one argument-type module, and ``info`` without MPI.

Serial tests; the lab tools that time MPI calls start their own 2-rank jobs with the
launcher of the library in use (``optcc_mpi.lab.launch``).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import optcc_mpi
from optcc_mpi import units
from optcc_mpi.cli import build_parser, main
from optcc_mpi.lab import launch
from optcc_mpi.lab import ring as ring_lab
from optcc_mpi.lab import testbed as tb

EXE = [sys.executable, "-m", "optcc_mpi"]
ENV = {**os.environ, "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"}
PKG = Path(optcc_mpi.__file__).parent


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 300):
    return subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, env=env or ENV
    )


def status_of(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every (sub-)command's parser, with its words (``("testbed", "up")``)."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


# ----------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("new", "old"),
    [
        (
            ["model", "--ranks", "6", "--links", "1:0.25"],
            ["model", "--p", "6", "--degrade", "1:0.25"],
        ),
        (
            ["model", "--sweep", "--ranks", "4,8", "--losses", "0.5"],
            ["model", "--sweep", "--ps", "4,8", "--losses", "0.5"],
        ),
        (
            ["simulate", "--ranks", "4", "--links", "1:0.5", "--size", "64K"],
            ["simulate", "--p", "4", "--degrade", "1:0.5", "--size", "64K"],
        ),
    ],
)
def test_old_names_are_aliases(
    new: list[str], old: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """--ranks and --links are the names; --p, --ps and --degrade give the same result."""
    assert main([*new, "--json"]) == 0
    got_new = json.loads(capsys.readouterr().out)
    assert main([*old, "--json"]) == 0
    got_old = json.loads(capsys.readouterr().out)
    for rows in (got_new, got_old):  # wall-clock fields differ between two runs
        for r in rows if isinstance(rows, list) else []:
            r.pop("build_s", None), r.pop("simulate_s", None)
    assert got_new == got_old


def test_aliases_parse_to_the_same_place() -> None:
    parser = build_parser()
    for argv, dest, value in (
        (
            ["testbed", "up", "--ranks", "2", "--rate", "1gbit", "--degrade", "1:0.5"],
            "links",
            "1:0.5",
        ),
        (["testbed", "shape", "--degrade", "0:0.5"], "links", "0:0.5"),
        (["report", "--simulate", "--p", "8,16"], "ranks", [8, 16]),
        (["lab", "profiles", "--max-p", "32"], "max_ranks", 32),
        (["lab", "transition", "--degrade", "2:0.5"], "links", optcc_mpi.Links.parse("2:0.5")),
    ):
        assert getattr(parser.parse_args(argv), dest) == value, argv


def test_help_names_the_new_flag_and_notes_the_old() -> None:
    """Only the new name is in the usage line; the help text says the old one works."""
    for path, parser in _parsers(build_parser()):
        usage = parser.format_usage()
        for old in ("--p ", "--ps ", "--degrade ", "--max-p "):
            assert old not in usage, (path, old)
    for words, old in (
        (["model"], "--p"),
        (["simulate"], "--degrade"),
        (["testbed", "up"], "--degrade"),
    ):
        parser = dict(_parsers(build_parser()))[tuple(words)]
        text = " ".join(parser.format_help().split())
        body = text[text.index("options:") :]
        assert re.search(rf"{old}\b(?!-)[^.;]* old name", body), (words, body)


def test_errors_quote_the_flag_as_typed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "--ranks", "4", "--links", "7:0.5"]) == 2
    err = capsys.readouterr().err
    assert "--links 7:0.5" in err and "--ranks 4" in err and "names rank 7" in err
    assert main(["model", "--p", "4", "--degrade", "7:0.5"]) == 2
    err = capsys.readouterr().err
    assert "--degrade 7:0.5" in err and "--p 4" in err
    assert main(["model", "--ranks", "4,8"]) == 2
    assert "give one number of ranks, or several with --sweep" in capsys.readouterr().err


# ----------------------------------------------------------------------------- usage, help


@pytest.mark.parametrize(
    "words",
    [
        ["model"],
        ["simulate"],
        ["bench"],
        ["testbed", "up", "--ranks", "2", "--rate", "1gbit"],
        ["sweep", "status", "res"],
        ["lab", "percall"],
        ["lab", "profiles"],
        ["info"],
    ],
)
def test_wrong_flag_prints_the_commands_usage(
    words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert status_of([*words, "--no-such-flag"]) == 2
    err = capsys.readouterr().err
    command = " ".join(w for w in words if not w.startswith("-") and w not in ("2", "1gbit", "res"))
    assert err.startswith(f"usage: optcc-mpi {command} "), err
    assert f"optcc-mpi {command}: error: unrecognized arguments: --no-such-flag" in err
    # The top level's usage lists commands, not options: it must not be what answered.
    assert "COMMAND ..." not in err


def test_every_option_has_help() -> None:
    missing = [
        f"{' '.join(path)} {action.option_strings or action.dest}"
        for path, parser in _parsers(build_parser())
        for action in parser._actions
        if action.help is None
        and not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
    ]
    assert not missing, missing
    bench = dict(_parsers(build_parser()))[("bench",)].format_help()
    assert "element type" in bench and "reduction (sum)" in bench


# ----------------------------------------------------------------------------- checks


def test_simulate_refuses_an_unknown_param(capsys: pytest.CaptureFixture[str]) -> None:
    from optcc_mpi import algorithms

    base = ["simulate", "--ranks", "4", "--size", "64K"]
    assert main([*base, "--algorithms", "ring", "--param", "bogus=1"]) == 2
    err = capsys.readouterr().err
    with pytest.raises(ValueError) as api:  # the Python API's own check and words
        algorithms.get("ring").check_params({"bogus": 1})
    assert str(api.value) in err
    assert main([*base, "--param", "bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "'bogus': no chosen algorithm takes it" in err and "optcc:" in err
    # A key some chosen algorithm takes is given to those that take it.
    assert main([*base, "--param", "k=4", "--json"]) == 0
    rows = {r["algorithm"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["optcc"]["params"]["k"] == 4 and "k" not in rows["ring"]["params"]


def test_tiny_fraction_warns_and_models(capsys: pytest.CaptureFixture[str]) -> None:
    """A fraction below 1% is modelled as given, with a warning on stderr (decided in
    docs: valid, but more often a loss typed where the share kept was meant)."""
    assert main(["model", "--ranks", "8", "--links", "0:1e-9"]) == 0
    out, err = capsys.readouterr()
    assert "lower bound" in out
    assert "warning" in err and "1e-09 of the healthy rate" in err and "not the share" in err
    assert main(["model", "--ranks", "8", "--links", "0:0.5"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["simulate", "--ranks", "4", "--size", "64K", "--links", "2:0.001"]) == 0
    assert "warning" in capsys.readouterr().err


def test_bench_alone_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """Without a launcher (1 rank) the benchmark refuses, unless --allow-single."""
    argv = ["bench", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0", "--algorithms", "ring"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "1 rank: started without a launcher" in err and "--allow-single" in err
    assert "Out of bounds" not in out
    assert main([*argv, "--allow-single"]) == 0
    assert "Out of bounds values : 0 OK" in capsys.readouterr().out


# ----------------------------------------------------------------------------- rates


def test_rate_parsers_have_distinct_names_and_meanings() -> None:
    assert units.parse_rate("400mbit") == 50e6  # bytes/s, everywhere in the package
    assert tb.parse_bitrate("400mbit") == 400_000_000  # bits/s, what tc takes
    assert tb.format_bitrate(400_000_000) == "400mbit" == units.format_rate(50e6)
    assert not hasattr(tb, "parse_rate") and not hasattr(tb, "format_rate")


# ----------------------------------------------------------------------------- info


def test_info_without_an_mpi_library() -> None:
    """No MPI library loads (mpi4py pointed at none): info still reports everything else,
    says what is missing and how to get it, and exits 0. (.ci/package-check runs it in a
    fresh environment that has no MPI library at all.)"""
    env = {**ENV, "MPI4PY_LIBMPI": "/nonexistent/libmpi.so"}
    res = run(*EXE, "info", env=env)
    assert res.returncode == 0, res.stderr
    rows = {line[:18].strip(): line[18:].strip() for line in res.stdout.splitlines() if line}
    assert rows["MPI library"].startswith("MISSING:")
    assert "pip install 'optcc-mpi[mpich]'" in rows["MPI library"]
    assert rows["NumPy"] and rows["simulator"] in ("compiled", "python")
    assert rows["ranks in this run"] == "- (no MPI)"
    assert "needs an MPI library" in rows["compiled call path"]
    assert "torch" in rows and "GPU" in rows
    res = run(*EXE, "info", "--json", env=env)
    info = json.loads(res.stdout)
    assert info["missing"] == ["MPI library"] and info["mpi_error"]
    assert info["mpi_ranks"] is None and info["cuda_aware_mpi"] is None
    assert info["fastcall"] == {
        "built": info["fastcall"]["built"],
        "in_use": False,
        "reason": "needs an MPI library",
    }
    assert info["numpy"] and info["algorithms"][0] == "auto"


def test_info_reports_torch_and_the_compiled_parts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["missing"] == [] and info["mpi_error"] is None
    assert set(info["fastcall"]) >= {"built", "in_use"}
    assert info["simulator_engine"] in ("compiled", "python")
    try:
        import torch
    except ImportError:
        assert info["torch"] == {"installed": False}
    else:
        assert info["torch"]["version"] == torch.__version__
        assert info["torch"]["cuda_available"] == torch.cuda.is_available()


# ----------------------------------------------------------------------------- lab


def _imported(path: Path) -> list[str]:
    """Absolute names of every module ``path`` (in the package) imports, anywhere."""
    package = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names += [base, *(f"{base}.{a.name}" for a in node.names)]
    return names


def test_the_lab_never_imports_the_cli() -> None:
    """Each lab tool parses its own command line with optcc_mpi.argtypes; the CLI only
    gathers them (``optcc-mpi lab``), so no lab module imports the CLI, anywhere; and
    argtypes, below both, imports neither."""
    offenders = [
        f"{path.name}: {name}"
        for path in sorted((PKG / "lab").glob("*.py"))
        for name in _imported(path)
        if re.match(r"optcc_mpi\.cli\b", name)
    ]
    offenders += [
        f"argtypes.py: {name}"
        for name in _imported(PKG / "argtypes.py")
        if re.match(r"optcc_mpi\.(cli|lab)\b", name)
    ]
    assert not offenders, offenders


def test_lab_help_lists_every_tool(capsys: pytest.CaptureFixture[str]) -> None:
    assert status_of(["lab", "--help"]) == 0
    out = capsys.readouterr().out
    for tool in ("percall", "ring", "calibrate", "transition", "profiles"):
        assert tool in out
    assert status_of(["lab"]) == 2  # no tool: the help, and a failing status


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["lab", "percall", "--sizes", "4,0"], ["--sizes", "at least 1 byte"]),
        (["lab", "percall", "--iters", "0"], ["--iters", "'0'"]),
        (["lab", "ring", "-b", "1M", "-e", "64K"], ["-e/--end 65536", "-b/--begin"]),
        (["lab", "ring", "-f", "1"], ["-f/--factor", "above 1"]),
        (["lab", "calibrate", "--pieces", "1"], ["--pieces", "at least 2"]),
        (["lab", "calibrate", "--bytes", "8", "--pieces", "16"], ["cannot be cut"]),
        (["lab", "transition", "--calls", "1,2"], ["--calls", "three positive counts"]),
        (["lab", "transition", "--links", "0:2"], ["--links", "outside (0, 1]"]),
        (["lab", "profiles", "--draw", "0"], ["--draw", "'0'"]),
        (["lab", "profiles", "--draw", "2", "--large"], ["--draw and --large"]),
        (["lab", "profiles", "--draw", "2", "--max-ranks", "8"], ["--max-ranks of at least 16"]),
        (["lab", "profiles", "--size", "1Q"], ["--size", "'1Q'"]),
    ],
)
def test_lab_tools_refuse_bad_arguments(
    argv: list[str], expect: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert status_of(argv) == 2
    err = capsys.readouterr().err
    for text in expect:
        assert text in err, (text, err)


def test_lab_profiles_both_ways(tmp_path: Path) -> None:
    """``optcc-mpi lab profiles`` and ``python -m optcc_mpi.lab.profiles``: the same parser
    and the same rows; each records the command it was given."""
    args = ["--family", "server", "--max-ranks", "16", "--size", "4M", "--no-progress"]
    new = run(*EXE, "lab", "profiles", *args, "--out", str(tmp_path / "new"))
    old = run(sys.executable, "-m", "optcc_mpi.lab.profiles", *args, "--out", str(tmp_path / "old"))
    assert new.returncode == old.returncode == 0, new.stderr + old.stderr
    assert "Command: `optcc-mpi lab profiles --family server" in new.stdout
    assert "Command: `python -m optcc_mpi.lab.profiles --family server" in old.stdout
    rows = [
        [json.loads(x) for x in (tmp_path / d / "profiles.jsonl").read_text().splitlines()]
        for d in ("new", "old")
    ]
    clock = re.compile(r"seconds|(build|simulate|verify)_s$")  # wall-clock fields

    def same(r: dict) -> dict:
        return {k: v for k, v in r.items() if not clock.search(k)}

    assert [same(r) for r in rows[0]] == [same(r) for r in rows[1]]
    assert len(rows[0]) == 3 and all(r["optcc_verified"] for r in rows[0])


@pytest.mark.timeout(600)
def test_lab_mpi_tools_under_a_launcher(tmp_path: Path) -> None:
    """percall, ring and calibrate on 2 ranks through ``optcc-mpi lab``: tables on
    rank 0, rows that record the command, every result right."""
    mpi = launch.launcher_argv(2)
    pc = tmp_path / "pc.jsonl"
    res = run(
        *mpi,
        *EXE,
        "lab",
        "percall",
        "--sizes",
        "4,1K",
        "--iters",
        "20",
        "--batch",
        "10",
        "--json",
        str(pc),
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "# optcc-mpi lab percall --sizes 4,1K" in res.stdout
    rows = [json.loads(x) for x in pc.read_text().splitlines()]
    assert {r["bytes"] for r in rows} == {4, 1024} and {r["p"] for r in rows} == {2}
    assert all(r["command"].startswith("optcc-mpi lab percall") for r in rows)
    tr = tmp_path / "tr.jsonl"
    res = run(
        *mpi,
        *EXE,
        "lab",
        "ring",
        "-b",
        "64K",
        "-e",
        "64K",
        "-n",
        "2",
        "-w",
        "0",
        "--out",
        str(tr),
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [json.loads(x) for x in tr.read_text().splitlines()]
    assert {r["method"] for r in rows} == set(ring_lab.METHODS)  # every method timed
    assert all(r["wrong"] == 0 for r in rows)
    cal = tmp_path / "cal.jsonl"
    res = run(
        *mpi,
        *EXE,
        "lab",
        "calibrate",
        "--bytes",
        "256K",
        "--pieces",
        "4",
        "--steps",
        "5",
        "--repeats",
        "1",
        "--json",
        str(cal),
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (row,) = [json.loads(x) for x in cal.read_text().splitlines()]
    assert row["p"] == 2 and row["rate_MBps"] > 0 and row["pieces"] == 4


@pytest.mark.timeout(600)
def test_lab_transition_emulated_and_plotted(tmp_path: Path) -> None:
    rows = tmp_path / "t.jsonl"
    res = run(
        *launch.launcher_argv(2),
        *EXE,
        "lab",
        "transition",
        "--size",
        "256K",
        "--links",
        "1:0.5",
        "--calls",
        "1,2,1",
        "--emulate",
        "bw=200MB/s",
        "--out",
        str(rows),
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    got = [json.loads(x) for x in rows.read_text().splitlines()]
    assert [r["phase"] for r in got] == ["healthy", "degraded", "degraded", "recovered"]
    assert got[1]["truth"] == "1:0.5"
    png = tmp_path / "t.png"
    res = run(*EXE, "lab", "transition", "--plot", str(rows), str(png))
    assert res.returncode == 0 and png.stat().st_size > 10_000, res.stderr
