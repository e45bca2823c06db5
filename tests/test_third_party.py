"""The shipped contract (:mod:`optcc_mpi.testing`), as other packages use it.

* The package of ``docs/algorithms.md`` ("An algorithm from another package") is built
  from the blocks in that document, installed with pip into a folder of its own, and its
  two-line test file run with pytest (serially and under ``mpiexec``), as its authors
  would: the algorithm arrives through the entry point and meets the contract.
* :func:`check_algorithm` fails an algorithm that breaks the contract, in the check that
  it breaks, and says why; bad names are refused before anything runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from optcc_mpi import algorithms, testing
from optcc_mpi.algorithms.ring import add_ring_allreduce, ring, ring_chunks, ring_time
from optcc_mpi.errors import ArgumentError
from optcc_mpi.lab import launch
from optcc_mpi.links import Links
from optcc_mpi.schedule import Schedule, ScheduleBuilder

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "algorithms.md"
SECTION = "### An algorithm from another package"


def doc_files() -> dict[str, str]:
    """The files of the section, by path: every fenced block there whose first line is a
    comment naming the file."""
    text = DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start)
    blocks = re.findall(r"```\w*\n(.*?)```", text[start : end if end > 0 else None], re.S)
    files = {}
    for block in blocks:
        first, _, _ = block.partition("\n")
        m = re.fullmatch(r"# (\S+\.(?:py|toml))", first.strip())
        if m:
            files[m.group(1)] = block
    return files


@pytest.fixture(scope="module")
def third_party(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The documented package's source, and an environment where it is installed."""
    root = tmp_path_factory.mktemp("third_party")
    src, site = root / "src", root / "site"
    for rel, body in doc_files().items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(body)
    # A real install from the documented pyproject.toml: setuptools writes the entry point
    # into the distribution's metadata, which is how optcc_mpi finds the algorithm.
    pip = subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
            "--no-build-isolation", "--target", str(site), str(src),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert list(site.glob("optcc_smallring-*.dist-info/entry_points.txt"))
    env = {
        **launch.clean_env(),  # a new job, not part of the one that may run this test
        # the installed package first, then this checkout of optcc_mpi
        "PYTHONPATH": f"{site}:{ROOT}",
        "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
    }
    env.pop("OPTCC_LINKS", None)
    return src, env


def _run(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_documented_package_is_complete() -> None:
    files = doc_files()
    assert set(files) == {
        "pyproject.toml",
        "optcc_smallring/__init__.py",
        "optcc_smallring/smallring.py",
        "tests/test_contract.py",
        "check_smallring.py",
    }
    # The test file is the two lines the docs promise: an import and a decorated test.
    code = [ln for ln in files["tests/test_contract.py"].splitlines()[1:] if ln.strip()]
    assert code == [
        "from optcc_mpi.testing import parametrize_with_checks",
        '@parametrize_with_checks(["smallring"])',
        "def test_contract(algorithm, check):",
        "    check(algorithm)",
    ]


def test_its_two_line_test_runs_the_contract(third_party: tuple[Path, dict[str, str]]) -> None:
    src, env = third_party
    py = sys.executable
    out = _run([py, "-c", "from optcc_mpi import algorithms; print(algorithms.names())"], src, env)
    assert out.returncode == 0, out.stderr
    assert "'smallring'" in out.stdout and "'ring'" in out.stdout
    pytest_args = [py, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "tests"]
    ids = _run([*pytest_args, "--collect-only"], src, env)
    assert ids.returncode == 0, ids.stdout + ids.stderr
    for check in testing.CHECKS:
        assert f"test_contract.py::test_contract[smallring-{check}]" in ids.stdout
    out = _run(pytest_args, src, env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"\b6 passed, 1 skipped\b", out.stdout), out.stdout
    assert "smallring mpi_reference" in out.stdout or "with-mpi" in out.stdout


@pytest.mark.timeout(600)
def test_its_contract_runs_under_mpi(third_party: tuple[Path, dict[str, str]]) -> None:
    src, env = third_party
    py = sys.executable
    mpi_pytest = [
        *launch.launcher_argv(2), py, "-m", "mpi4py", "-m", "pytest", "--with-mpi",
        "-p", "no:cacheprovider", "-q", "tests", "-k", "mpi_reference",
    ]  # fmt: skip
    out = _run(mpi_pytest, src, env, timeout=500)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"\b1 passed\b", out.stdout) and "skipped" not in out.stdout, out.stdout
    # check_algorithm outside pytest, as the docs' script calls it: on two ranks every
    # check passes, the MPI one included.
    script = [*launch.launcher_argv(2), py, "-m", "mpi4py", "check_smallring.py"]
    out = _run(script, src, env, timeout=500)
    assert out.returncode == 0, out.stdout + out.stderr
    for check in testing.CHECKS:
        assert out.stdout.count(f"smallring {check} passed") == 2, out.stdout


# ------------------------------------------------------------ the contract catches breaks


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the registry that algorithms may be added to for one test."""
    algorithms.names()  # discovery first, so that it does not run into the copy later
    monkeypatch.setattr(algorithms, "_REGISTRY", dict(algorithms._REGISTRY))


def _half_ring_time(p: int, nbytes: float, bw: float, links: Links, **kw: object) -> float:
    return ring_time(p, nbytes, bw, links, **kw) / 2


def _nothing(p: int, count: int, links: Links | None = None, *, itemsize: int = 4) -> Schedule:
    return ScheduleBuilder(p, count, "nothing").build()


def _status(name: str, **kw: object) -> dict[str, testing.Outcome]:
    return {o.check: o for o in testing.check_algorithm(name, raise_on_failure=False, **kw)}


def _smallring(
    p: int, count: int, links: Links | None = None, *, itemsize: int = 4, chunk_bytes: int = 2**20
) -> Schedule:
    chunks = ring_chunks(-(-count // max(p, 1)), itemsize, chunk_bytes)
    b = ScheduleBuilder(p, count, "smallring", chunks=chunks)
    add_ring_allreduce(b, range(p), 0, count, chunks=chunks)
    return b.build()


def test_a_sound_algorithm_passes_and_the_mpi_check_says_why_it_is_skipped(
    registry: None,
) -> None:
    algorithms.register("t_small", summary="ring, small messages", cost=ring_time)(_smallring)
    got = _status("t_small")
    assert [o.status for o in got.values()] == ["passed"] * 6 + ["skipped"]
    assert "more than one rank" in got["mpi_reference"].message


def test_a_cost_below_the_bound_fails_the_cost_checks(registry: None) -> None:
    algorithms.register("t_half", summary="ring, half the cost", cost=_half_ring_time)(_smallring)
    got = _status("t_half")
    assert got["cost"].status == "failed" and "below the lower bound" in got["cost"].message
    assert got["simulated_cost"].status == "failed"
    assert "declared cost" in got["simulated_cost"].message
    assert got["verifies"].status == "passed" and got["registration"].status == "passed"
    with pytest.raises(testing.ContractError, match=r"'t_half' breaks the contract") as err:
        testing.check_algorithm("t_half", checks=["cost", "registration"])
    assert "t_half cost failed" in str(err.value) and "registration" not in str(err.value)


def test_a_schedule_that_reduces_nothing_fails_the_verifier(registry: None) -> None:
    algorithms.register("t_nothing", summary="does nothing", cost=ring_time)(_nothing)
    got = _status("t_nothing", checks=["verifies", "simulated_cost"])
    assert got["verifies"].status == "failed" and "p=2" in got["verifies"].message
    assert got["simulated_cost"].status == "failed"


def test_declared_defaults_that_are_not_the_builders_fail_parameters(registry: None) -> None:
    # The cost would be told chunk_bytes=65536 while the schedule runs with the builder's
    # 1 MiB: the declared parameters must be the builder's.
    algorithms.register("t_params", summary="ring", cost=ring_time, params={"chunk_bytes": 65536})(
        _smallring
    )
    got = _status("t_params", checks=["parameters"])
    assert got["parameters"].status == "failed"
    assert "declared defaults" in got["parameters"].message


def test_an_auto_predicate_must_be_a_pure_bool(registry: None) -> None:
    answers = iter(range(10**6))
    algorithms.register(
        "t_moody", summary="ring", cost=ring_time, auto=lambda p, n, links: next(answers) % 2 == 0
    )(ring)
    got = _status("t_moody", checks=["eligibility"])
    assert (
        got["eligibility"].status == "failed" and "changed its answer" in got["eligibility"].message
    )
    algorithms.register("t_maybe", summary="ring", cost=ring_time, auto=lambda *a: "yes")(ring)
    got = _status("t_maybe", checks=["eligibility"])
    assert got["eligibility"].status == "failed" and "not a bool" in got["eligibility"].message


def test_a_cost_gap_exempts_profiles_and_gives_the_reason(registry: None) -> None:
    def gap(p: int, links: Links) -> str | None:
        return "halved on purpose" if links.degraded else None

    algorithms.register(
        "t_gap", summary="ring, half the cost when degraded", cost=ring_time, cost_gap=gap
    )(_smallring)
    held, exempt = testing.cost_profiles(4, "t_gap")
    assert held == [Links()] and all(reason == "halved on purpose" for _, reason in exempt)
    assert len(exempt) == len(testing.profiles(4)) - 1


def test_bad_names_are_refused_before_anything_runs() -> None:
    with pytest.raises(ArgumentError, match="unknown algorithm 'nope'.*ring"):
        testing.check_algorithm("nope")
    with pytest.raises(ValueError, match="unknown check.*'speed'.*verifies"):
        testing.check_algorithm("ring", checks=["speed"])
    with pytest.raises(ArgumentError, match="unknown algorithm 'nope'"):
        testing.parametrize_with_checks(["nope"])
    mark = testing.parametrize_with_checks("ring", checks="cost")
    assert [p.id for p in mark.args[1]] == ["ring-cost"]


def test_check_algorithm_needs_no_pytest() -> None:
    """pytest is a test-time dependency: without it check_algorithm and the fake device
    still import and run, and only the pytest helper says what is missing."""
    code = (
        "import sys; sys.modules['pytest'] = None\n"  # as if pytest were not installed
        "from optcc_mpi import testing\n"
        "print(testing.check_algorithm('native', checks=['registration'])[0].status)\n"
        "print(type(testing.device_array([1.0])).__name__)\n"
        "try:\n"
        "    testing.parametrize_with_checks\n"
        "except ImportError as exc:\n"
        "    print('ImportError', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**launch.clean_env(), "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[:2] == ["passed", "HostDeviceArray"]
    assert "ImportError" in out.stdout and "pytest" in out.stdout
