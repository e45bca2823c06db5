"""torch's own distributed test suite with the ``optcc`` backend in place of gloo (issue 32).

PyTorch checks its CPU backend with ``DistributedTest._DistTestBase``
(``torch/testing/_internal/distributed/distributed_test.py``), one spawned process per rank
and test, driven by ``BACKEND``, ``WORLD_SIZE`` and ``TEMP_DIR`` as PyTorch's
``test/distributed/test_distributed_spawn.py`` drives it. This module runs the tests of
that suite named for the collectives and features the backend touches (:data:`PATTERNS`)
twice per world size: once on plain gloo, once with every process group the suite makes
created as ``optcc`` while the suite still believes it runs on gloo (``BACKEND=gloo``: the
same expectations, skips and tolerances). It then compares the two runs: every test that
passes on gloo must pass on optcc, except the by-design differences listed in
docs/torch.md (section "torch's own test suite"), and each listed difference must still
fail there, so that the list stays true.

Usage (the driver; each run is a worker subprocess of this same file)::

    python tests/torch_suite.py                       # the whole selection at 2 and 3 ranks
    python tests/torch_suite.py --ranks 2 --ci        # the CI selection (CI_TESTS)
    python tests/torch_suite.py -k test_barrier -k test_broadcast --json out.json

Exit status 0 when the comparison holds at every world size, 1 otherwise (the table
printed says why). Needs ``expecttest`` (requirements.txt), which
``torch.testing._internal`` imports.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "torch.md"
# The heading of the section of docs/torch.md whose table lists the known differences.
KNOWN_SECTION = "## torch's own test suite"

# The tests run: every test of _DistTestBase whose name matches one of these (issue 32),
# case-insensitively.
PATTERNS = (
    r"all_?reduce",
    r"ddp",
    r"distributeddataparallel",
    r"barrier",
    r"broadcast",
    r"all_?gather",
    r"reduce_scatter",
    r"coalesced",
    r"new_group",
    r"subgroup",
    r"batch_isend",
    r"monitored",
)
# Named outside the patterns: the two tests of the suite that an earlier run of the whole
# suite found failing on optcc and that no pattern names (the backend's name, and
# ProcessGroup methods called from Python), so that their difference stays tracked.
EXTRA_TESTS = ("test_get_backend", "test_get_future")

# The CI selection (tests/test_torch_suite.py, `make test`): one or two of each family
# that runs on a CPU machine at 2 and 3 ranks (torch's `_group` tests want 8), every known
# difference (to keep their list true), and the tests of the forms that an earlier run
# found failing; two or three minutes on 2 loaded cores. Each passes on gloo.
CI_TESTS = (
    "test_all_reduce_sum",
    "test_all_reduce_full_group_max",
    "test_all_reduce_coalesced_full_group_sum",
    "test_all_reduce_sum_async",
    "test_barrier_full_group",
    "test_broadcast_full_group",
    "test_all_gather_coalesced_full_group",
    "test_all_gather_object_subgroup",
    "test_batch_isend_irecv_gloo",
    "test_DistributedDataParallelCPU",
    "test_ddp_logging_data_cpu",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_sparse_all_reduce_sum",
    "test_get_future",
    "test_get_backend",
    "test_monitored_barrier_gloo",
    "test_monitored_barrier_gloo_subgroup",
    "test_monitored_barrier_gloo_rank_0_timeout",
)

# Outcomes of one test in one run.
PASSED, FAILED, SKIPPED, NOT_RUN = "passed", "failed", "skipped", "not run"

# Seconds before torch's MultiProcessTestCase kills a test's ranks (its default is 300;
# TIMEOUT_OVERRIDE still gives test_DistributedDataParallel and test_ddp_uneven_inputs
# more). A hang then costs one test, not the run.
TEST_TIMEOUT = 120


# -- the known differences, from docs/torch.md ---------------------------------------------------
def known_differences(path: Path = DOCS) -> dict[str, str]:
    """The tests that may fail on optcc while passing on gloo, with their reasons.

    Parameters
    ----------
    path : Path
        The Markdown file holding the list (docs/torch.md).

    Returns
    -------
    dict of str to str
        Test name to the reason given, read from the table rows ``| `test_...` | reason |``
        of the section headed :data:`KNOWN_SECTION`.
    """
    text = path.read_text(encoding="utf-8")
    start = text.find(KNOWN_SECTION)
    if start < 0:
        raise ValueError(f"{path}: no section {KNOWN_SECTION!r}")
    section = text[start + len(KNOWN_SECTION) :]
    end = re.search(r"^## ", section, flags=re.M)
    section = section[: end.start()] if end else section
    known = {}
    for m in re.finditer(r"^\|\s*`(test_\w+)`\s*\|\s*(.+?)\s*\|\s*$", section, flags=re.M):
        known[m.group(1)] = m.group(2)
    if not known:
        raise ValueError(f"{path}: the section {KNOWN_SECTION!r} lists no test")
    return known


def select(names: list[str]) -> list[str]:
    """The tests of the suite that the issue names (:data:`PATTERNS`, :data:`EXTRA_TESTS`).

    Parameters
    ----------
    names : list of str
        Every test name of ``_DistTestBase``.

    Returns
    -------
    list of str
        The selected names, sorted.
    """
    pattern = re.compile("|".join(PATTERNS), flags=re.I)
    return sorted(n for n in names if pattern.search(n) or n in EXTRA_TESTS)


# -- the worker: inside one run, and inside every rank it spawns ---------------------------------
# The driver starts a worker with TORCH_SUITE_BACKEND set; torch's spawn start method
# imports this file again in every rank (as __mp_main__), so that the set-up below runs
# in the ranks too, before torch's test module is imported.
SUITE_BACKEND = os.environ.get("TORCH_SUITE_BACKEND")

if SUITE_BACKEND:
    # torch's test module reads these when imported: the suite runs as gloo's.
    os.environ["BACKEND"] = "gloo"
    os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", str(TEST_TIMEOUT))

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest,
        TestDistBackend,
    )

    if SUITE_BACKEND == "optcc":
        import optcc_mpi.torch  # noqa: F401  (registers the backend "optcc")

        _make_group = c10d._new_process_group_helper

        def _as_optcc(backend: object) -> object:
            """gloo, alone or as the CPU part of a device map, becomes optcc."""
            name = str(backend)
            if name.lower() == "gloo":
                return dist.Backend("optcc")
            if "cpu:gloo" in name.lower():
                return re.sub("cpu:gloo", "cpu:optcc", name, flags=re.I)
            return backend

        def _new_process_group_helper(
            group_size, group_rank, global_ranks, backend, *args, **kwargs
        ):
            # Every group the suite makes (init_process_group, new_group, new_subgroups,
            # device meshes) is made here, after the public function has checked the
            # name "gloo" the suite gave it: the suite's expectations stay gloo's, the
            # groups are optcc's.
            return _make_group(
                group_size, group_rank, global_ranks, _as_optcc(backend), *args, **kwargs
            )

        c10d._new_process_group_helper = _new_process_group_helper
    elif SUITE_BACKEND != "gloo":
        raise SystemExit(f"TORCH_SUITE_BACKEND={SUITE_BACKEND!r}: gloo or optcc")

    class TorchSuite(TestDistBackend, DistributedTest._DistTestBase):
        """torch's distributed tests, each on ``WORLD_SIZE`` spawned ranks."""

        def setUp(self) -> None:
            super().setUp()
            if os.environ.get("TORCH_SUITE_START") == "fork":
                # torch 2.13's MultiProcessTestCase has no fork helper left; its process
                # starter takes any multiprocessing context.
                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            else:
                self._spawn_processes()


class _Record(unittest.TestResult):
    """Each test's outcome, seconds and message, appended to a JSON-lines file as it ends
    (so that a worker killed by its timeout still leaves what it ran)."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:  # noqa: N802  (unittest's name)
        super().startTest(test)
        self.started = time.monotonic()
        print(f"  {test.id().rsplit('.', 1)[-1]} ...", end="", flush=True)

    def _write(self, test: unittest.TestCase, outcome: str, message: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        seconds = round(time.monotonic() - self.started, 2)
        print(f" {outcome} ({seconds:.1f} s)", flush=True)
        row = {"test": name, "outcome": outcome, "seconds": seconds, "message": message}
        with self.out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def addSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        super().addSuccess(test)
        self._write(test, PASSED)

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:  # noqa: N802
        super().addSkip(test, reason)
        self._write(test, SKIPPED, reason)

    def addFailure(self, test: unittest.TestCase, err: object) -> None:  # noqa: N802
        super().addFailure(test, err)
        self._write(test, FAILED, self.failures[-1][1][-6000:])

    def addError(self, test: unittest.TestCase, err: object) -> None:  # noqa: N802
        super().addError(test, err)
        self._write(test, FAILED, self.errors[-1][1][-6000:])

    def addExpectedFailure(self, test: unittest.TestCase, err: object) -> None:  # noqa: N802
        super().addExpectedFailure(test, err)
        self._write(test, PASSED, "expected failure (torch's own marking)")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        super().addUnexpectedSuccess(test)
        self._write(test, FAILED, "unexpected success (torch marks it expected to fail)")


def _worker(names: list[str], out: Path) -> None:
    """Run ``names`` (all selected ones if empty) in this process's configuration."""
    if not SUITE_BACKEND:
        raise SystemExit("the worker runs with TORCH_SUITE_BACKEND set (by the driver)")
    every = [n for n in dir(TorchSuite) if n.startswith("test_")]
    if names == ["--list"]:
        print("\n".join(select(every)))
        return
    unknown = sorted(set(names) - set(every))
    if unknown:
        raise SystemExit(f"not tests of torch's suite: {', '.join(unknown)}")
    suite = unittest.TestSuite(TorchSuite(n) for n in names)
    suite.run(_Record(out))


# -- the driver -----------------------------------------------------------------------------------
def _env(backend: str, ranks: int, temp: str, start: str = "fork") -> dict[str, str]:
    # No MPI launcher's variables, and no OPTCC_* setting of the caller's: the optcc groups
    # run the package's defaults (algorithm auto, healthy links), as a user's would.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "OPTCC_"))}
    # torch's test module reads these when imported; TEMP_DIR and INIT_METHOD are set
    # again per test by its setUp (a fresh directory each).
    env.update(
        TORCH_SUITE_BACKEND=backend,
        TORCH_SUITE_START=start,
        BACKEND="gloo",
        WORLD_SIZE=str(ranks),
        TEMP_DIR=temp,
        # One intra-op thread per rank: 3 ranks on a shared 2-core machine.
        OMP_NUM_THREADS="1",
        # The comparison is of CPU backends; on a machine with fewer GPUs than ranks
        # torch's suite would skip every test.
        CUDA_VISIBLE_DEVICES="",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    return env


def list_tests() -> list[str]:
    """The selected tests, as the worker's torch names them."""
    with tempfile.TemporaryDirectory() as temp:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", temp, "--list"],
            env=_env("gloo", 2, temp),
            capture_output=True,
            text=True,
            timeout=300,
        )
    if proc.returncode:
        raise RuntimeError(f"listing torch's tests failed:\n{proc.stderr[-4000:]}")
    return proc.stdout.split()


def run_config(
    backend: str,
    ranks: int,
    names: list[str],
    timeout: float,
    log: Path | None = None,
    start: str = "fork",
) -> tuple[dict[str, dict], float]:
    """Run ``names`` on ``backend`` at ``ranks`` ranks in a worker.

    Parameters
    ----------
    backend : {"gloo", "optcc"}
        Which backend the suite's groups are made with.
    ranks : int
        The world size.
    names : list of str
        The tests.
    timeout : float
        Seconds for the whole worker; the tests it did not reach are recorded as not run.
    log : Path, optional
        Where the worker's output goes (default: discarded).
    start : {"fork", "spawn"}
        How each test's ranks start: forked from the worker, which has imported torch and
        the suite once (about a second a test on this machine), or spawned as PyTorch's CI
        runs the suite (each rank imports torch and the suite again: 5 to 20 seconds a
        test on 2 loaded cores). The tests are the same either way.

    Returns
    -------
    results : dict of str to dict
        Test name to ``{"outcome", "seconds", "message"}``.
    seconds : float
        The worker's wall-clock time.
    """
    with tempfile.TemporaryDirectory(prefix="optcc-torch-suite-") as temp:
        out = Path(temp) / "results.jsonl"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out), *names]
        started = time.monotonic()
        sink = log.open("w", encoding="utf-8") if log else subprocess.DEVNULL
        try:
            # Its own session, so that a timeout ends the worker's ranks with it.
            proc = subprocess.Popen(
                cmd, env=_env(backend, ranks, temp, start), stdout=sink, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=temp,
            )  # fmt: skip
            try:
                proc.wait(timeout=timeout)
                ended = f"the worker ended with status {proc.returncode} before it"
            except subprocess.TimeoutExpired:
                ended = f"the worker was stopped after {timeout:.0f} s before it"
            finally:
                # Timed out, or the driver interrupted: the worker and its ranks go too.
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                    proc.wait()
        finally:
            if log:
                sink.close()
        seconds = time.monotonic() - started
        rows = out.read_text(encoding="utf-8").splitlines() if out.exists() else []
    results = {}
    for line in rows:
        row = json.loads(line)
        results[row.pop("test")] = row
    for name in names:
        results.setdefault(
            name,
            {"outcome": NOT_RUN, "seconds": 0.0, "message": ended},
        )
    return results, seconds


def short(message: str) -> str:
    """The line of a test's failure that says what went wrong (the last exception raised
    in a rank), for the table."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    picked = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
    return (picked[-1] if picked else (lines[-1] if lines else ""))[:300]


def compare(
    gloo: dict[str, dict], optcc: dict[str, dict], known: dict[str, str]
) -> dict[str, list[str]]:
    """What the two runs of one world size say.

    Parameters
    ----------
    gloo, optcc : dict of str to dict
        The outcomes of each test on each backend (:func:`run_config`).
    known : dict of str to str
        The known differences (:func:`known_differences`).

    Returns
    -------
    dict of str to list of str
        ``"regressions"``: passed on gloo, not on optcc, not listed (the check fails);
        ``"stale"``: listed, yet passed on both (the check fails: the list is not true);
        ``"known"``: listed, passed on gloo, failed on optcc (as documented);
        ``"gloo_only_fail"``: passed on optcc but not on gloo (reported only).
    """
    passed_gloo = {n for n, r in gloo.items() if r["outcome"] == PASSED}
    passed_optcc = {n for n, r in optcc.items() if r["outcome"] == PASSED}
    return {
        "regressions": sorted(passed_gloo - passed_optcc - set(known)),
        "stale": sorted(passed_gloo & passed_optcc & set(known)),
        "known": sorted((passed_gloo - passed_optcc) & set(known)),
        "gloo_only_fail": sorted(passed_optcc - passed_gloo),
    }


def _counts(results: dict[str, dict]) -> dict[str, int]:
    counts = dict.fromkeys((PASSED, FAILED, SKIPPED, NOT_RUN), 0)
    for r in results.values():
        counts[r["outcome"]] += 1
    return counts


def report(runs: dict[int, dict], known: dict[str, str]) -> tuple[str, bool]:
    """The table of every world size's two runs, and whether the comparison holds.

    Parameters
    ----------
    runs : dict of int to dict
        World size to ``{"gloo": (results, seconds), "optcc": (results, seconds)}``.
    known : dict of str to str
        The known differences.

    Returns
    -------
    text : str
        The table and the details of every failing comparison.
    ok : bool
        No regression and no stale listing at any world size.
    """
    lines = [
        "| ranks | backend | tests | passed | failed | skipped | not run | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    details = []
    ok = True
    for ranks, pair in sorted(runs.items()):
        for backend in ("gloo", "optcc"):
            results, seconds = pair[backend]
            c = _counts(results)
            lines.append(
                f"| {ranks} | {backend} | {len(results)} | {c[PASSED]} | {c[FAILED]} | "
                f"{c[SKIPPED]} | {c[NOT_RUN]} | {seconds:.0f} |"
            )
        diff = compare(pair["gloo"][0], pair["optcc"][0], known)
        ok = ok and not diff["regressions"] and not diff["stale"]
        optcc = pair["optcc"][0]
        for name in diff["regressions"]:
            details.append(
                f"{ranks} ranks: REGRESSION {name}: passes on gloo, {optcc[name]['outcome']} "
                f"on optcc: {short(optcc[name]['message'])}"
            )
        for name in diff["stale"]:
            details.append(
                f"{ranks} ranks: STALE {name}: listed in docs/torch.md ({known[name]}) "
                "but passes on optcc: remove it from the list"
            )
        for name in diff["known"]:
            details.append(f"{ranks} ranks: known {name}: {known[name]}")
        for name in diff["gloo_only_fail"]:
            details.append(f"{ranks} ranks: note {name}: passes on optcc, not on gloo")
    verdict = "holds" if ok else "FAILS"
    text = "\n".join(lines + [""] + details + ["", f"passes on gloo => passes on optcc: {verdict}"])
    return text, ok


def main(argv: list[str] | None = None) -> int:
    """The driver's command line (module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _worker(argv[2:], Path(argv[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--ci", action="store_true", help="only the CI selection (CI_TESTS)")
    parser.add_argument("-k", dest="tests", action="append", default=[], help="one test")
    parser.add_argument(
        "--start",
        choices=("spawn", "fork"),
        default="fork",
        help="how each test's ranks start (default fork; spawn as PyTorch's CI)",
    )
    parser.add_argument("--json", type=Path, help="write every outcome here")
    parser.add_argument("--logs", type=Path, help="a folder for each worker's output")
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds for each worker (default 1800)"
    )
    parser.add_argument("--report", type=Path, help="only report a --json file again")
    args = parser.parse_args(argv)
    # `timeout` (make test-torch-suite) ends the driver with SIGTERM: exiting through
    # run_config's cleanup ends the running worker and its ranks too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    known = known_differences()
    if args.report:
        data = json.loads(args.report.read_text(encoding="utf-8"))
        runs = {
            int(r): {b: (v["results"], v["seconds"]) for b, v in pair.items()}
            for r, pair in data.items()
        }
        text, ok = report(runs, known)
        print(text)
        return 0 if ok else 1
    names = args.tests or (list(CI_TESTS) if args.ci else list_tests())
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    runs: dict[int, dict] = {}
    for ranks in args.ranks:
        runs[ranks] = {}
        for backend in ("gloo", "optcc"):
            print(f"== {len(names)} tests on {backend}, {ranks} ranks ==", flush=True)
            log = args.logs / f"{backend}-{ranks}.log" if args.logs else None
            runs[ranks][backend] = run_config(backend, ranks, names, args.timeout, log, args.start)
    text, ok = report(runs, known)
    print(text)
    if args.json:
        data = {
            str(r): {b: {"seconds": s, "results": res} for b, (res, s) in pair.items()}
            for r, pair in runs.items()
        }
        args.json.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
