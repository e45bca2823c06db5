"""``scripts/gpu_check.py`` (``make gpu-check``) where there is no GPU: its CPU side.

CI has no GPU, so the checks that need one are tested here in two ways: ``--cpu`` runs
them with the device set to the CPU and gloo where NCCL would be (the transport made to
use NCCL's executor driver), and the judging of what the ranks record is tested on
records made to be wrong in each way a GPU run could be (a host synchronisation with
messages in flight, no group posted, bytes differing across ranks, an error past its
bound, a result off the device). ``tests/test_launch.py`` runs the MPI part (check 1).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("this PyTorch has no torch.distributed", allow_module_level=True)

from optcc_mpi import algorithms  # noqa: E402
from optcc_mpi.arrays import TorchArrayOps  # noqa: E402
from optcc_mpi.lab import launch  # noqa: E402
from optcc_mpi.reductions import TorchOps  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gc = _load("gpu_check")
rank = _load("gpu_check_rank")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``gpu_check.py --cpu`` of the torch checks (4 to 9) at 1 and 2 ranks (9: 2 and 4):
    its JSON."""
    out = tmp_path_factory.mktemp("gpu-check") / "run.json"
    argv = [
        sys.executable, str(SCRIPTS / "gpu_check.py"), "--cpu", "--only",
        "torch,reductions,timing,ranks,backend,staged", "--max-ranks", "2", "--repeats", "3",
        "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=launch.clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpu-check: all passed" in done.stdout
    record = json.loads(out.read_text())
    record["stdout"] = done.stdout
    return record


def _lines(run: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    return {x["what"]: x for x in run["lines"] if x["what"].startswith(prefix)}


@pytest.mark.timeout(700)
@pytest.mark.slow
def test_cpu_run_world_of_one(cpu_run: dict[str, Any]) -> None:
    """Check 4 on the CPU: every algorithm and auto pass in a gloo group of one (made over
    a FileStore), nothing sent, no host copy; a tensor on the wrong device is refused."""
    lines = _lines(cpu_run, "gloo p=1 ")
    for name in ("auto", *algorithms.names()):
        line = lines[f"gloo p=1 {name}"]
        assert line["status"] == "PASS", line
        assert line["messages"] == 0 and line["host_copies"] == 0 and line["syncs"] == 0
        assert line["calls"] == len(rank.CASES) * 4 + 1
    assert lines["gloo p=1 wrong device refused"]["status"] == "PASS"


@pytest.mark.timeout(700)
@pytest.mark.slow
def test_cpu_run_two_ranks_use_the_grouped_driver(cpu_run: dict[str, Any]) -> None:
    """Check 7 on the CPU at 2 ranks: the schedules sent messages, in groups (NCCL's driver,
    forced over gloo), with no copy to the host; DDP with the hook matched DDP."""
    lines = _lines(cpu_run, "gloo p=2 ")
    for name in algorithms.names():
        line = lines[f"gloo p=2 {name}"]
        assert line["status"] == "PASS", line
        if name != "native":
            assert line["messages"] > 0 and 0 < line["groups"] <= line["messages"], line
            assert line["syncs_with_messages"] == 0
    # auto's short messages are gathered where they live (the device on NCCL): no copy to
    # the host either.
    assert lines["gloo p=2 auto"]["host_copies"] == 0
    assert lines["gloo p=2 DDP hook vs DDP"]["status"] == "PASS"
    assert lines["gloo p=2 DDP hook vs DDP"]["relative"] <= 1e-6
    assert lines["gloo p=2 wrong device refused"]["status"] == "PASS"
    assert not _lines(cpu_run, "gloo p=3 ")  # --max-ranks 2


@pytest.mark.timeout(700)
@pytest.mark.slow
def test_cpu_run_backend(cpu_run: dict[str, Any]) -> None:
    """Check 8 on the CPU: the optcc backend at 1 and 2 ranks, gloo underneath."""
    lines = _lines(cpu_run, "optcc backend ")
    assert set(lines) == {
        "optcc backend p=1 (gloo underneath)",
        "optcc backend p=2 (gloo underneath)",
        "optcc backend p=2 on one device (host carrier, gloo underneath)",
        "optcc backend p=4 on one device (host carrier, gloo underneath)",
    }
    for line in lines.values():
        assert line["status"] == "PASS", line


def test_backend_judge_fails_what_is_wrong() -> None:
    """The judge of check 8 fails a wrong value, results that differ across ranks, the
    wrong library, a rank's exception."""
    row = {
        "dtype": "torch.float32",
        "op": "sum",
        "n": 1,
        "error": 0.0,
        "allowed": 1e-6,
        "digest": "a",
        "algorithm": "native",
        "transport": "nccl",
        "device": "cuda:0",
    }
    good = {"rows": [row], "async": True, "broadcast": True, "all_gather": True,
            "work": "OptccWork", "ddp_gap": 1e-7, "rank": 0}  # fmt: skip
    assert gc.judge_backend([good], "cuda")[0] == "PASS"
    assert gc.judge_backend([{**good, "rows": [{**row, "error": 1.0}]}], "cuda")[0] == "FAIL"
    assert gc.judge_backend([good, {**good, "rows": [{**row, "digest": "b"}]}], "cuda")[0] == "FAIL"
    assert gc.judge_backend([{**good, "rows": [{**row, "transport": "gloo"}]}], "cuda")[0] == "FAIL"
    assert gc.judge_backend([{"error": "RuntimeError: x", "rank": 0}], "cuda")[0] == "FAIL"
    assert gc.judge_backend([{**good, "ddp_gap": 1e-2}], "cuda")[0] == "FAIL"
    # Check 9's: gloo underneath CUDA tensors, and the overlap of a kernel queued after.
    staged = {**good, "rows": [{**row, "transport": "gloo"}]}
    overlapped = {"compute_ms": 3.0, "reduction_pending": True}
    assert gc.judge_backend([{**staged, "overlap": overlapped}], "cuda", "gloo")[0] == "PASS"
    assert gc.judge_backend([staged], "cuda")[0] == "FAIL"  # (NCCL expected by default)
    serial = {**staged, "overlap": {**overlapped, "reduction_pending": False}}
    verdict = gc.judge_backend([serial], "cuda", "gloo")
    assert verdict[0] == "FAIL" and "no overlap" in verdict[2]


@pytest.mark.timeout(700)
@pytest.mark.slow
def test_cpu_run_reductions_and_timing(cpu_run: dict[str, Any]) -> None:
    """Check 5 covers every dtype of TorchArrayOps; check 6 records numbers (not
    judged: only their consistency is asserted here)."""
    lines = _lines(cpu_run, "reductions ")
    for name in gc.TORCH_DTYPES:
        assert lines[f"reductions {name} (cpu)"]["status"] == "PASS"
    times = [x for x in cpu_run["lines"] if x["status"] == "TIME"]
    measured = [x for x in times if "median_ms" in x]
    assert len(measured) == 4
    for x in measured:
        assert x["runs"] == 3 and 0 < x["min_ms"] <= x["median_ms"] <= x["max_ms"]
    ratio = [x for x in times if "ratio" in x]
    assert len(ratio) == 1 and ratio[0]["ratio"] > 0 and ratio[0]["weight_gap"] < 0.05


def test_without_a_gpu_nothing_is_checked() -> None:
    """No GPU (no CuPy, a CPU build of PyTorch): it says why and exits 0."""
    if gc.torch_status().get("available"):  # pragma: no cover - a GPU machine
        pytest.skip("this machine has a GPU")
    from optcc_mpi.arrays import cupy_status

    if cupy_status().get("available"):  # pragma: no cover
        pytest.skip("this machine has a GPU")
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_check.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=launch.clean_env(),
    )
    assert done.returncode == 0, done.stderr
    assert "no usable GPU" in done.stdout and "nothing checked" in done.stdout
    assert "PyTorch:" in done.stdout


def test_unknown_check_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_check.py"), "--only", "torch,fastest"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "unknown check fastest" in done.stderr


def test_rank_counts() -> None:
    """Every GPU count from 2 up; one GPU: skipped with NCCL's reason."""
    assert gc.rank_counts(False, 4, None) == ([2, 3, 4], "")
    assert gc.rank_counts(False, 8, 3) == ([2, 3], "")
    assert gc.rank_counts(False, 2, 5) == ([2], "")
    counts, why = gc.rank_counts(False, 1, None)
    assert counts == [] and "NCCL refuses two ranks on one GPU" in why
    assert gc.rank_counts(True, 0, None) == ([2, 3], "")
    assert gc.rank_counts(True, 0, 1)[0] == []


# -- judging the ranks' records -----------------------------------------------------------------
def _row(**kw: Any) -> dict[str, Any]:
    row = {
        "algorithm": "ring", "kind": "in place", "dtype": "float32", "op": "sum", "n": 4097,
        "error": 1e-7, "bound": 1e-6, "digest": "abc", "on_device": True, "same_memory": True,
        "input_kept": True, "ran": "ring", "transport": "nccl", "observe": "grouped",
        "syncs": 0, "host_copies": 0, "messages": 4, "groups": 2,
    }  # fmt: skip
    row.update(kw)
    return row


def _records(p: int = 2, **kw: Any) -> list[dict[str, Any]]:
    rec = {
        "rows": [_row(), _row(kind="out of place", same_memory=False)],
        "errors": {
            "expect": "NCCL process group moves CUDA tensors",
            "error": "ArgumentError: an NCCL process group moves CUDA tensors only",
            "unchanged": True,
            "after": [float(p)] * 8,
        },
        "ddp": {
            "ours": "d1",
            "diff": 1e-9,
            "scale": 0.1,
            "moved": 0.05,
            "ran": "optcc",
            "links": f"{p - 1}:0.5",
            "transport": "nccl",
            "parameters": 1051521,
        },  # fmt: skip
        "mpi_loaded": False,
    }
    return [copy.deepcopy(rec) for _ in range(p)]


def test_judge_passes_a_clean_run() -> None:
    [(status, what, detail, numbers)] = gc.judge_collectives(_records(), "nccl")
    assert status == "PASS" and what == "nccl p=2 ring", detail
    assert numbers["messages"] == 8 and numbers["groups"] == 4
    assert gc.judge_errors(_records(), "nccl")[0] == "PASS"
    assert gc.judge_ddp(_records(), "nccl")[0] == "PASS"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"syncs": 1}, "1 host synchronisation(s)"),
        ({"host_copies": 2}, "copies to the host"),
        ({"groups": 0}, "no group posted"),
        ({"observe": "ordered"}, "no group posted"),
        ({"error": 1e-3}, "error 0.001 against float64"),
        ({"on_device": False}, "left the device"),
        ({"same_memory": False}, "not in the tensor's memory"),
        ({"transport": "gloo"}, "ran over gloo, not nccl"),
        ({"ran": "native"}, "ran native"),
        ({"digest": "other"}, "bytes differ from rank 0's"),
        ({"messages": 0, "syncs": 1}, "1 host synchronisation(s) and 0 copies to the host"),
        ({"messages": 0, "host_copies": 1}, "1 copies to the host without messages"),
    ],
)
def test_judge_fails_each_fault(change: dict[str, Any], words: str) -> None:
    """A fault on the last rank fails the algorithm's line and names it."""
    recs = _records(3)
    recs[-1]["rows"][0].update(change)
    [(status, _, detail, _)] = gc.judge_collectives(recs, "nccl")
    assert status == "FAIL" and words in detail and "rank 2" in detail, detail


def test_judge_world_of_one_allows_no_sync() -> None:
    recs = _records(1)
    for row in recs[0]["rows"]:
        row.update(messages=0, groups=0)
    assert gc.judge_collectives(recs, "nccl")[0][0] == "PASS"
    recs[0]["rows"][0]["syncs"] = 1
    assert gc.judge_collectives(recs, "nccl")[0][0] == "FAIL"


def test_judge_out_of_place_must_keep_its_input() -> None:
    recs = _records()
    recs[0]["rows"][1]["input_kept"] = False
    [(status, _, detail, _)] = gc.judge_collectives(recs, "nccl")
    assert status == "FAIL" and "input was written" in detail


def test_judge_errors_and_ddp_faults() -> None:
    recs = _records()
    recs[1]["errors"]["error"] = None
    assert "no error" in gc.judge_errors(recs, "nccl")[2]
    recs = _records()
    recs[0]["errors"]["unchanged"] = False
    assert "the tensor changed" in gc.judge_errors(recs, "nccl")[2]
    recs = _records()
    recs[1]["ddp"]["diff"] = 1e-5
    assert gc.judge_ddp(recs, "nccl")[0] == "FAIL"
    recs = _records()
    recs[1]["ddp"]["ours"] = "d2"
    assert "differ from rank 0's" in gc.judge_ddp(recs, "nccl")[2]
    recs = _records()
    recs[0]["ddp"]["transport"] = "gloo"
    assert gc.judge_ddp(recs, "nccl")[0] == "FAIL"


# -- the rank's counters and references ---------------------------------------------------------
def test_host_syncs_counts_and_restores() -> None:
    before = (TorchArrayOps.synchronize, TorchArrayOps.to_host)
    arrays = TorchArrayOps("cpu")
    with rank.HostSyncs(cuda=False) as seen:
        arrays.synchronize()
        arrays.to_host(torch.ones(3))
        arrays.to_host(torch.ones(3))
    assert (seen.syncs, seen.host_copies) == (1, 2)
    assert (TorchArrayOps.synchronize, TorchArrayOps.to_host) == before
    arrays.synchronize()  # no longer counted
    assert seen.syncs == 1


def test_group_counter() -> None:
    class Wire:
        def batch(self, posts: list[Any]) -> list[Any]:
            return [None] * len(posts)

    wire = Wire()
    groups = rank.GroupCounter(wire)
    assert wire.batch([1, 2]) == [None, None] and wire.batch([]) == []
    assert groups.count == 2


def test_reference_follows_the_package_rules() -> None:
    """The float64 reference orders -0.0 below +0.0 and propagates NaN for max/min."""
    xs = [torch.tensor([-0.0, 1.0, 2.0]), torch.tensor([0.0, float("nan"), 1.0])]
    ref = rank.reference(xs, "max")
    assert not np.signbit(ref[0]) and np.isnan(ref[1]) and ref[2] == 2.0
    assert rank.error_of(torch.tensor([-0.0, float("nan"), 2.0]), ref, True) == float("inf")
    assert rank.error_of(torch.tensor([0.0, float("nan"), 2.0]), ref, True) == 0.0
    assert rank.error_of(torch.tensor([0.0, 1.0, 2.0]), ref, True) == float("inf")


def test_bit_mismatches() -> None:
    nan = np.array([np.nan], dtype=np.float32).view(np.uint32)[0]
    other = np.array([nan | 1, 0x80000000], dtype=np.uint32).view(np.float32)  # NaN, -0.0
    ref = np.array([nan, 0], dtype=np.uint32).view(np.float32)  # canonical NaN, +0.0
    # A sum's NaN may be any NaN; a zero's sign always counts; max/min fix every bit.
    assert gc.bit_mismatches(other, ref, "sum").tolist() == [1]
    assert gc.bit_mismatches(other, ref, "max").tolist() == [0, 1]


def test_complex_product_mismatches() -> None:
    dst = np.array([1 + 2j, 3 - 1j, complex(np.inf, 0)], dtype=np.complex64)
    src = np.array([2 - 1j, 1 + 1j, 1 + 0j], dtype=np.complex64)
    with np.errstate(invalid="ignore"):
        ref = dst * src  # inf * (1 + 0j): the imaginary part is NaN
    near = ref.copy()
    near.real[0] = np.nextafter(near.real[0], np.float32(10))  # one rounding away
    far = ref.copy()
    far.imag[1] += 0.01
    assert gc.complex_product_mismatches(near, ref, dst, src)[0].size == 0
    bad, unjudged = gc.complex_product_mismatches(far, ref, dst, src)
    assert bad.tolist() == [1] and unjudged == 1  # the infinite input is not judged


def test_reduction_inputs_cover_every_16_bit_pattern() -> None:
    for name in ("float16", "bfloat16"):
        dst, src = gc.reduction_inputs(name)
        assert np.unique(dst.view(np.uint16)).size == 1 << 16
        assert np.unique(src.view(np.uint16)).size == 1 << 16
    dst, _ = gc.reduction_inputs("float32")
    bits = dst.view(np.uint32)
    assert np.isnan(dst).any() and (bits == 0x80000000).any() and (bits == 1).any()


def test_torch_complex_sum_is_the_componentwise_sum() -> None:
    """TorchOps adds complex tensors part by part: torch's own complex add (dst + 1 * src)
    would turn inf into NaN and -0.0 into +0.0, which NumPy does not."""
    inf = float("inf")
    re = torch.tensor([1.0, -0.0, 2.0], dtype=torch.float64)
    dst = torch.complex(re, torch.tensor([0.0, -0.0, 3.0], dtype=torch.float64))
    src = torch.complex(
        torch.tensor([inf, -0.0, 1.0], dtype=torch.float64),
        torch.tensor([inf, -0.0, 1.0], dtype=torch.float64),
    )
    want = dst.numpy() + src.numpy()
    TorchOps(torch).reduce("sum", dst, src)
    assert dst.numpy().view(np.uint64).tolist() == want.view(np.uint64).tolist()


def test_first_error_names_the_ranks_exception() -> None:
    stderr = (
        "W1204 12:00:00 torch/distributed/run.py: setting OMP_NUM_THREADS\n"
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "scripts/gpu_check_rank.py", line 9, in <module>\n'
        "[rank1]: ValueError: boom on rank 1\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "============================================================\n"
    )
    assert gc.first_error(stderr) == "ValueError: boom on rank 1"
    assert gc.first_error("just a line\nlast line\n") == "last line"
    assert gc.first_error("") == "(no output)"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(60)
def test_a_run_past_its_time_is_stopped_whole(tmp_path: Path) -> None:
    """A launcher that outlives its time is stopped with its children (no orphan ranks)."""
    pid_file = tmp_path / "child"
    code, _ = gc._run_group(["sh", "-c", f"sleep 30 & echo $! > {pid_file}; wait"], timeout=1.0)
    assert code is None
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
