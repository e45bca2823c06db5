"""The torch.distributed backend ``optcc`` (optcc_mpi.torch.process_group).

In one process (a world of one on a HashStore): registration, the Work, the ordered
worker, options. Under torchrun (tests/torch_backend_worker.py, 2 to 4 ranks, no MPI):
every ReduceOp on every dtype against a float64 reference and bit-identical across ranks,
asynchronous calls, the other collectives passed through, errors on every rank with the
tensor unchanged, DDP with no hook (and its options) and FSDP2's HSDP against gloo,
teardown over and over with no barrier, a killed rank ending the job. Under mpiexec:
``init_process_group_from_mpi("optcc")``.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch_launch import this_checkout
from torch_launch import torchrun as launch_worker

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("this PyTorch has no torch.distributed", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

import optcc_mpi.torch  # noqa: E402, F401  (registers the backend)
from optcc_mpi import algorithms, collectives  # noqa: E402
from optcc_mpi.errors import ArgumentError, ArgumentTypeError  # noqa: E402
from optcc_mpi.lab import launch  # noqa: E402
from optcc_mpi.torch.process_group import (  # noqa: E402
    BACKEND,
    OptccOptions,
    OptccProcessGroup,
    stage_through_host,
)
from optcc_mpi.torch.work import OptccWork  # noqa: E402
from optcc_mpi.torch.worker import OrderedWorker  # noqa: E402

WORKER = Path(__file__).with_name("torch_backend_worker.py")


def torchrun(
    scenario: str, n: int, out: Path, timeout: float = 600, **env_extra: str
) -> list[dict]:
    """Run the worker's ``scenario`` on ``n`` ranks; every rank's record."""
    proc = _torchrun(scenario, n, out, timeout, **env_extra)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads((out / f"{scenario}-{r}.json").read_text()) for r in range(n)]


def _torchrun(
    scenario: str, n: int, out: Path, timeout: float, **env_extra: str
) -> subprocess.CompletedProcess[str]:
    return launch_worker(WORKER, n, scenario, str(out), timeout=timeout, **env_extra)


# -- one process ---------------------------------------------------------------------------------
@pytest.fixture
def world_of_one() -> object:
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_registered_for_cpu_and_cuda() -> None:
    """Importing optcc_mpi.torch makes "optcc" a backend of both devices, once."""
    assert BACKEND.upper() in dist.Backend._plugins
    assert dist.Backend.default_device_backend_map.get("cpu") != BACKEND  # gloo stays
    assert set(dist.Backend.backend_capability[BACKEND]) == {"cpu", "cuda"}
    optcc_mpi.torch.register()  # a second import or call changes nothing
    assert set(dist.Backend.backend_capability[BACKEND]) == {"cpu", "cuda"}


def test_world_of_one(world_of_one: object) -> None:
    """A group of one reduces to itself, returns a real Work, and is what torch reports."""
    assert isinstance(world_of_one, OptccProcessGroup)
    assert dist.get_backend() == BACKEND
    t = torch.arange(10, dtype=torch.float32)
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    assert isinstance(work, OptccWork)
    assert work.wait() is True and work.is_completed() and work.is_success()
    assert torch.equal(t, torch.arange(10, dtype=torch.float32))
    assert work.get_future().value()[0] is t
    assert work.stats["transport"] == "gloo"  # (what carries the data)
    assert world_of_one.optcc_transport().describe() == "optcc process group of 1"
    assert collectives.last_stats()["algorithm"] == work.stats["algorithm"]
    # The other collectives go to gloo underneath.
    out = [torch.empty(3)]
    dist.all_gather(out, torch.ones(3))
    assert out[0].tolist() == [1.0] * 3


def test_a_buffer_is_classified_once_per_call(
    world_of_one: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each buffer of a call is classified once, where the call begins (issue 44, 4): the
    short path's lane says whether it takes the tensor, and reaches the wire with no
    classification below it; the whole path's NumPy views (the tensor's, and the scaled
    copy of an average taken in half precision) are classified by ``as_array`` and taken
    by the collectives as they are, not again by ``buffer_of``."""
    from optcc_mpi import arguments, arrays, compiled_path
    from optcc_mpi.torch import tensors

    seen: list[str] = []

    def counted(module: object, name: str) -> None:
        real = getattr(module, name)

        def spy(*args: object, **kwargs: object) -> object:
            seen.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)

    for module, name in (
        (arrays, "buffer_of"),
        (arguments, "buffer_of"),
        (arguments, "_numpy_flat"),
        (compiled_path, "_numpy_flat"),
        (tensors, "as_array"),
    ):
        counted(module, name)

    def classified(call: object) -> list[str]:
        seen.clear()
        call()
        return sorted(seen)

    t = torch.arange(8, dtype=torch.float32)
    for _ in range(2):  # (the first call of a signature makes its lane)
        assert classified(lambda: dist.all_reduce(t)) == []
        assert classified(lambda: dist.all_reduce(t, async_op=True).wait()) == []
        assert classified(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX)) == ["as_array"]
    h = torch.ones(8, dtype=torch.float16)
    # (the tensor's view, and the view of the divided copy the sum reads)
    assert classified(lambda: dist.all_reduce(h, op=dist.ReduceOp.AVG)) == ["as_array"] * 2
    assert torch.equal(t, torch.arange(8, dtype=torch.float32)) and h.tolist() == [1.0] * 8


def test_world_of_one_refuses_with_nothing_changed(world_of_one: object) -> None:
    t = torch.arange(4, dtype=torch.int32)
    with pytest.raises(ArgumentError, match="AVG needs a floating-point tensor"):
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
    with pytest.raises(ArgumentTypeError, match="uint16 is not supported"):
        dist.all_reduce(torch.ones(3, dtype=torch.uint16))
    assert t.tolist() == [0, 1, 2, 3]
    # Still usable afterwards.
    x = torch.ones(2)
    dist.all_reduce(x)
    assert x.tolist() == [1.0, 1.0]


def test_options_are_checked() -> None:
    """Bad options fail when the group is made, with the choices named."""
    with pytest.raises(ArgumentTypeError, match="OptccOptions"):
        dist.init_process_group(
            BACKEND, store=dist.HashStore(), rank=0, world_size=1, pg_options={"algorithm": "ring"}
        )
    if dist.is_initialized():  # pragma: no cover - torch registered it regardless
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="fastest"):
        dist.init_process_group(
            BACKEND, store=dist.HashStore(), rank=0, world_size=1,
            pg_options=OptccOptions(algorithm="fastest"),
        )  # fmt: skip
    if dist.is_initialized():  # pragma: no cover
        dist.destroy_process_group()


def test_algorithm_from_options_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from optcc_mpi import config

    monkeypatch.setenv("OPTCC_ALGORITHM", "ring")
    config.reload()
    try:
        dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=1)
        assert dist.group.WORLD.algorithm == "ring"
        g = dist.new_group(backend=BACKEND, pg_options=OptccOptions(algorithm="optcc"))
        assert g.algorithm == "optcc"
        dist.destroy_process_group()
    finally:
        monkeypatch.delenv("OPTCC_ALGORITHM")
        config.reload()


def test_carrier_from_options_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``carrier``: "nccl" by default, "host" from the options or $OPTCC_CARRIER, anything
    else refused when the group is made; CPU tensors reduce as ever under "host"."""
    from optcc_mpi import config

    with pytest.raises(ArgumentError, match="carrier must be one of 'nccl', 'host'"):
        dist.init_process_group(
            BACKEND, store=dist.HashStore(), rank=0, world_size=1,
            pg_options=OptccOptions(carrier="pcie"),
        )  # fmt: skip
    if dist.is_initialized():  # pragma: no cover
        dist.destroy_process_group()
    monkeypatch.setenv("OPTCC_CARRIER", "host")
    config.reload()
    try:
        dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=1)
        assert dist.group.WORLD.carrier == "host"
        g = dist.new_group(backend=BACKEND, pg_options=OptccOptions(carrier="nccl"))
        assert g.carrier == "nccl"
        t = torch.arange(5.0)
        dist.all_reduce(t)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        dist.destroy_process_group()
    finally:
        monkeypatch.delenv("OPTCC_CARRIER")
        config.reload()


def test_staging_through_host_copies_waits_reduces_and_copies_back() -> None:
    """The host-staged carrier's steps, in order: copies to host buffers of their own,
    the wait for them, the reduction of the host copies, the copies back; a reduction that
    fails leaves the tensors as they were."""
    tensors = [torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.int64)]
    steps: list[str] = []
    seen: list[torch.Tensor] = []

    def reduce(hosts: list[torch.Tensor]) -> str:
        steps.append("reduce")
        assert all(h.device.type == "cpu" and h.shape == t.shape for h, t in zip(hosts, tensors))
        assert all(h.data_ptr() != t.data_ptr() for h, t in zip(hosts, tensors))
        seen.extend(h.clone() for h in hosts)
        for h in hosts:
            h.mul_(3)
        return "record"

    result = stage_through_host(tensors, reduce, lambda: steps.append("synchronize"))
    assert result == "record" and steps == ["synchronize", "reduce"]
    assert torch.equal(seen[0], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(tensors[0], 3 * torch.arange(6.0).reshape(2, 3))
    assert torch.equal(tensors[1], torch.full((4,), 3, dtype=torch.int64))

    def fail(hosts: list[torch.Tensor]) -> None:
        for h in hosts:
            h.zero_()
        raise ArgumentError("element count differs")

    before = [t.clone() for t in tensors]
    with pytest.raises(ArgumentError, match="differs"):
        stage_through_host(tensors, fail, lambda: None)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


def test_ordered_worker_keeps_order_and_reports_errors() -> None:
    worker = OrderedWorker("test")
    seen: list[int] = []
    futures = []
    for i in range(50):
        fut: torch.futures.Future[object] = torch.futures.Future()
        worker.submit(lambda i=i: seen.append(i), fut)
        futures.append(fut)
    bad: torch.futures.Future[object] = torch.futures.Future()
    worker.submit(lambda: 1 / 0, bad)
    for fut in futures:
        fut.wait()
    assert seen == list(range(50))
    with pytest.raises(ZeroDivisionError):
        bad.wait()
    assert worker.close()
    with pytest.raises(ArgumentError, match="destroyed"):
        worker.submit(lambda: None, torch.futures.Future())


def test_a_job_run_in_the_callers_thread_ends_before_the_next_starts() -> None:
    """A job run in its caller's thread (run_here, the short path of a waited call;
    steal) holds the group's turn: a job queued meanwhile from another thread starts on
    the group's thread only after it ended, and then runs."""
    worker = OrderedWorker("test")
    seen: list[str] = []
    inside, release, queued_ran = threading.Event(), threading.Event(), threading.Event()

    def here() -> str:
        seen.append("here")
        inside.set()
        assert release.wait(10)
        seen.append("here done")
        return "ran"

    result: list[object] = []
    caller = threading.Thread(target=lambda: result.append(worker.run_here(here)))
    caller.start()
    assert inside.wait(10)
    fut: torch.futures.Future[object] = torch.futures.Future()
    worker.submit(lambda: (seen.append("queued"), queued_ran.set()), fut)
    # While the caller's job runs, the queued one must not start.
    assert not queued_ran.wait(0.3)
    release.set()
    caller.join(10)
    fut.wait()
    assert seen == ["here", "here done", "queued"]
    assert result == [(True, "ran")]
    # With a job pending, nothing runs here: the caller submits it instead.
    blocker, unblock = threading.Event(), threading.Event()
    pending: torch.futures.Future[object] = torch.futures.Future()
    worker.submit(lambda: (blocker.set(), unblock.wait(10)), pending)
    assert blocker.wait(10)
    assert worker.run_here(lambda: "no") == (False, None)
    unblock.set()
    pending.wait()
    assert worker.close()


def test_work_wait_times_out_rather_than_hanging() -> None:
    fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    work = OptccWork(fut, datetime.timedelta(seconds=30))
    with pytest.raises(RuntimeError, match="not complete after"):
        work.wait(datetime.timedelta(milliseconds=50))
    assert not work.is_completed() and work.exception() is None
    threading.Timer(0.05, lambda: fut.set_result([torch.ones(1)])).start()
    assert work.wait()


@pytest.mark.timeout(120)
def test_a_timeout_names_the_optcc_group() -> None:
    """An optcc group's errors name the optcc group, not the gloo groups underneath it.
    Two ranks as threads of one process (on one store, so the board carries the check):
    rank 1 stops after the first call, and rank 0's next call times out with the error
    naming "optcc process group of 2"; rank 1's later call raises too (the board is broken),
    naming the rank at fault as well."""
    from optcc_mpi.errors import ExecutionError
    from optcc_mpi.transports import board

    if not board.usable():
        pytest.skip("no board here (no C compiler): gloo's own timeout names no group")
    store = dist.HashStore()
    gone = threading.Event()
    seen: list[object] = [None, None]

    def rank_main(rank: int) -> None:
        group = None
        try:
            group = OptccProcessGroup(store, rank, 2, datetime.timedelta(seconds=1))
            described = group.optcc_transport().describe()
            group.allreduce([torch.ones(4)]).wait()  # both ranks: the groups connected
            if rank == 1:
                gone.wait(60)
            try:
                group.allreduce([torch.ones(4)]).wait()
                seen[rank] = (described, "completed")
            except ExecutionError as exc:
                seen[rank] = (described, str(exc))
            finally:
                gone.set()
        except BaseException as exc:  # reported to the test
            seen[rank] = exc
        finally:
            if group is not None:
                group.shutdown()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(90)
    assert not any(th.is_alive() for th in threads), "a rank hung"
    (named0, error0), (named1, error1) = seen  # type: ignore[misc]
    assert named0 == named1 == "optcc process group of 2"
    assert error0.startswith("optcc process group of 2: rank 1 did not join"), error0
    assert error1.startswith("optcc process group of 2: rank 1 did not join"), error1  # (named)
    assert "gloo" not in error0 + error1


# -- torchrun --------------------------------------------------------------------------------------
@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [2, 3])
def test_every_op_and_dtype(tmp_path: Path, n: int) -> None:
    ranks = torchrun("ops", n, tmp_path)
    rows = ranks[0]["rows"]
    assert {r["op"] for r in rows} == {"sum", "avg", "premul_sum", "product", "max", "min"}
    assert len({r["dtype"] for r in rows}) == 12
    for row in rows:
        assert row["error"] <= row["bound"], row
    for other in ranks[1:]:
        assert [r["digest"] for r in other["rows"]] == [r["digest"] for r in rows]
    # auto chose; something other than the library's own AllReduce ran for long messages.
    assert any(r["algorithm"] != "native" for r in rows if r["n"] > 50_000)
    for rank, rec in enumerate(ranks):
        assert rec["work_type"] == "OptccWork" and rec["work_class_ok"]
        assert rec["board"]  # every rank on this machine: the checks on the board
        assert rec["async"] == [float(sum(range(n)) + n * i) for i in range(4)]
        assert rec["future"] == [float(n)] * 8
        assert rec["coalesced"] == [[float(sum(range(1, n + 1)))] * 3, [2.0 * n] * 5, [3.0 * n]]
        assert rec["ring"] == ["ring", float(n)]
        assert rank >= 2 or rec["pair"] == 2.0
        assert rec["ot_allreduce"] == 1.0 and rec["backend"] == BACKEND
        assert rec["again"] == float(n)


@pytest.mark.timeout(600)
def test_environment_chooses_the_algorithm(tmp_path: Path) -> None:
    """``OPTCC_ALGORITHM`` reaches the backend's calls; with ``OPTCC_BOARD=0`` the checks
    travel on gloo, with the same results (every op and dtype within its bound, the same
    bits on every rank)."""
    ranks = torchrun("ops", 2, tmp_path, OPTCC_ALGORITHM="optcc", OPTCC_BOARD="0")
    assert ranks[0]["env_algorithm"] == "optcc"
    assert {r["algorithm"] for r in ranks[0]["rows"]} == {"optcc"}
    assert not any(rec["board"] for rec in ranks)
    for row in ranks[0]["rows"]:
        assert row["error"] <= row["bound"], row
    assert [r["digest"] for r in ranks[1]["rows"]] == [r["digest"] for r in ranks[0]["rows"]]


@pytest.mark.timeout(600)
def test_links_from_the_environment_are_watched_and_logged(tmp_path: Path) -> None:
    """OPTCC_LINKS=watch reaches the backend's calls; OPTCC_LINKS_LOG records, on rank 0,
    which algorithm they ran under which profile."""
    log = tmp_path / "links.jsonl"
    ranks = torchrun("linklog", 2, tmp_path, OPTCC_LINKS="watch", OPTCC_LINKS_LOG=str(log))
    from optcc_mpi import linklog

    records = [r for r in linklog.read(log) if r["event"] == "call"]
    assert records and all(r["source"] == "watch" and r["p"] == 2 for r in records)
    assert records[-1]["algorithm"] == ranks[0]["algorithm"]
    assert {r["algorithm"] for r in records} <= {"auto", "native", *algorithms.names()}


@pytest.mark.timeout(600)
def test_errors_on_every_rank_nothing_changed(tmp_path: Path) -> None:
    n = 3
    ranks = torchrun("errors", n, tmp_path)
    expect = {
        "count": "element count differs",
        "dtype": "dtype differs",
        "op": "op differs",
        "avg_vs_sum": "average differs",
        "uint16": "uint16 is not supported",
        "avg_int": "AVG needs a floating-point tensor",
        "one_rank_bad_dtype": "uint32 is not supported",
        "complex_max": "complex",
        "ddp": "algorithm differs",
        "mixed_count": "element count differs",
        "mixed_avg": "average differs",
    }
    for rank, rec in enumerate(ranks):
        for key, words in expect.items():
            assert rec[key]["error"] is not None and words in rec[key]["error"], (
                rank,
                key,
                rec[key],
            )
            assert key == "ddp" or rec[key]["unchanged"], (rank, key)  # (DDP's own buckets)
        assert rec["after"] == [float(n)] * 8
    # The short path and the whole one on different ranks: bit-identical results.
    assert len({tuple(rec["mixed"]) for rec in ranks}) == 1
    assert all(rec["mixed_error"] < 1e-6 for rec in ranks)


@pytest.mark.timeout(600)
def test_other_collectives_pass_through(tmp_path: Path) -> None:
    for rec in torchrun("passthrough", 3, tmp_path):
        failed = [name for name, ok in rec.items() if ok is not True]
        assert not failed, failed


@pytest.mark.timeout(900)
def test_ddp_without_a_hook_matches_gloo(tmp_path: Path) -> None:
    """DDP on an optcc group (no hook) with each of DDP's options, and the asynchronous
    hook on gloo: the parameters equal gloo's within 1e-6 relative, the same everywhere."""
    ranks = torchrun("ddp", 3, tmp_path)
    variants = ranks[0]["variants"]
    assert set(variants) == {
        "plain",
        "static_graph",
        "gradient_as_bucket_view",
        "find_unused_parameters",
        "no_sync",
    }
    for rec in ranks:
        for name, v in rec["variants"].items():
            assert v["moved"] > 1e-3, name
            assert v["diff"] <= 1e-6 * v["scale"], (name, v)
            assert v["digest"] == variants[name]["digest"], name
        assert rec["hook"]["diff"] <= 1e-6 * rec["hook"]["scale"]
        assert rec["hook"]["digest"] == ranks[0]["hook"]["digest"]


@pytest.mark.timeout(900)
def test_hsdp_replicate_dimension_on_optcc(tmp_path: Path) -> None:
    """FSDP2 on a 2 x 2 mesh with the replicate dimension on optcc trains to gloo's
    parameters."""
    ranks = torchrun("hsdp", 4, tmp_path)
    for rec in ranks:
        assert rec["replicate_backend"] == BACKEND
        assert rec["ran"] == "ring"  # the replicate all-reduce ran on optcc, with its options
        assert rec["diff"] <= 1e-6 * rec["scale"], rec
        assert rec["digest"] == ranks[0]["digest"]


@pytest.mark.timeout(900)
def test_teardown_never_aborts(tmp_path: Path) -> None:
    """Six makings and destructions per job, with the backend, the hook on it and the hook
    on gloo, a reduction left in flight each time, no barrier: three jobs, every one exits
    0 (torchrun reports any rank that aborts)."""
    for job in range(3):
        out = tmp_path / str(job)
        out.mkdir()
        ranks = torchrun("teardown", 3, out)
        assert ranks[0]["rounds"] == ["optcc", "gloo+hook", "optcc+hook"] * 2


@pytest.mark.timeout(600)
def test_killed_rank_ends_the_job(tmp_path: Path) -> None:
    """A rank killed in the middle of the job: torchrun ends it (non-zero), no hang. The
    time from the kill to the end is recorded in docs/torch.md, not asserted."""
    t0 = time.time()
    proc = _torchrun("kill", 3, tmp_path, timeout=300)
    ended = time.time()
    assert proc.returncode != 0
    killed_at = json.loads((tmp_path / "kill-started-1.json").read_text())["at"]
    assert t0 <= killed_at <= ended
    assert not (tmp_path / "kill-0.json").exists()  # the survivors did not finish


@pytest.mark.timeout(600)
def test_started_as_srun_starts_it(tmp_path: Path) -> None:
    """No torchrun: each process started with torch's variables, as ``srun`` with
    ``RANK=$SLURM_PROCID ...`` starts it (rank 0 serves the store): the backend and the
    other collectives work."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = 2
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "MPI", "OPTCC_"))
    }
    procs = []
    for r in range(n):
        env = {
            **base,
            "RANK": str(r),
            "WORLD_SIZE": str(n),
            "LOCAL_RANK": str(r),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        env = this_checkout(env)
        argv = [sys.executable, str(WORKER), "passthrough", str(tmp_path)]
        procs.append(
            subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * n, "\n".join(o[-2000:] for o in outs)
    for r in range(n):
        rec = json.loads((tmp_path / f"passthrough-{r}.json").read_text())
        assert all(v is True for v in rec.values()), rec


@pytest.mark.timeout(600)
def test_from_mpi(tmp_path: Path) -> None:
    """Under mpiexec: init_process_group_from_mpi("optcc") and an all_reduce."""
    pytest.importorskip("mpi4py")
    n = 2
    argv = [*launch.launcher_argv(n), sys.executable, str(WORKER), "from_mpi", str(tmp_path)]
    env = this_checkout(launch.clean_env({**os.environ, "OMP_NUM_THREADS": "1"}))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(n):
        rec = json.loads((tmp_path / f"from_mpi-{r}.json").read_text())
        assert rec == {**rec, "value": 1.0, "backend": BACKEND, "size": n}


@pytest.mark.timeout(900)
def test_semantics_as_gloo(tmp_path: Path) -> None:
    """What a user sees of each behaviour that once differed from gloo's, the same script
    on a gloo and an optcc default group (2 ranks): every value equal; on optcc the records
    are per work, the options' timeout holds, ``dist.monitored_barrier`` is torch's own
    refusal (the group's method works), and an abort fails queued and running work at
    once and the job still exits 0 (torchrun reports any rank that aborts)."""
    seen = {}
    for name in ("gloo", "optcc"):
        out = tmp_path / name
        out.mkdir()
        seen[name] = torchrun("semantics", 2, out, SEMANTICS_BACKEND=name)
    for r in range(2):
        gloo, ours = seen["gloo"][r], seen["optcc"][r]
        for key, value in gloo.items():
            if key == "dist.monitored_barrier":
                continue
            assert ours[key] == value, (r, key, ours[key], value)
        assert ours["dist.monitored_barrier"].startswith("refused: monitored_barrier is only")
        assert ours["group.monitored_barrier"] == "ok"
        assert ours["stats per work"] == {"ring": ["ring"], "optcc": ["optcc"]}
        assert ours["options timeout"] == 7.0
    assert seen["optcc"][0]["abort: queued work"] == ["AbortedError"]
