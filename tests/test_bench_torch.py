"""The measuring commands over torch.distributed (gloo): bench, doctor, ``lab ddp``, and the
DDP hook's link log, launched as users launch them.

* ``optcc-mpi bench --transport gloo`` under ``torchrun`` (no MPI library: mpi4py is made
  unimportable, ``tests/no_mpi.py``) and under ``mpiexec`` (the process group started from
  the MPI ranks), with ``--emulate``; every result checked, gloo's own ``all_reduce`` a row.
* ``optcc-mpi doctor`` under ``torchrun`` with emulation at 3 ranks: the rank at 0.5 is
  found, nothing else, and the command fails (torchrun reports any non-zero status).
* ``optcc-mpi lab ddp`` under ``torchrun``: the hook's parameters equal plain DDP's.
* ``comm_hook(links="watch", links_log=FILE)`` records what the watch adopts.
* On the namespace testbed (root; skipped with the reason elsewhere): the bench over gloo
  puts its bytes on the shaped links, as the byte counters of every rank's ``eth0`` show.

No test asserts a time or a ratio of times: the benchmarks record those (docs/testbed.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from optcc_mpi.errors import ArgumentError
from optcc_mpi.lab import world

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("this PyTorch has no torch.distributed", allow_module_level=True)

HERE = Path(__file__).resolve().parent
NO_MPI = HERE / "no_mpi.py"
HOOK_WORKER = HERE / "torch_hook_log_worker.py"
ROOT = HERE.parent


def _env(**extra: str) -> dict[str, str]:
    """This environment without any MPI launcher's variables or link settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OMPI_", "PMI_", "PMIX_", "MPI", "HYDRA_"))
        and k not in ("OPTCC_LINKS", "OPTCC_EMULATE", "OPTCC_LINKS_LOG")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def torchrun(n: int, *args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=timeout, env=_env(**env)
    )


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------- who runs with whom


def test_launcher_is_read_from_the_environment() -> None:
    assert world.started_by({"PMI_RANK": "0", "PMI_SIZE": "2"}) == "mpi"
    assert world.started_by({"OMPI_COMM_WORLD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "2"}) == "mpi"
    assert world.started_by({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "x"}) == "torchrun"
    assert world.started_by({}) == "none" and world.started_by({"RANK": "0"}) == "none"
    assert world.default_transport({"RANK": "1", "WORLD_SIZE": "4"}) == "gloo"
    assert world.default_transport({"PMI_RANK": "1"}) == "mpi"


def test_mpi_under_torchrun_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun starts every process as an MPI job of its own: asking for MPI there would
    run WORLD_SIZE one-rank jobs, so it is refused before MPI is touched."""
    for k in world.MPI_VARIABLES:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ArgumentError, match="--transport gloo"):
        world.start("mpi")
    with pytest.raises(ArgumentError, match="unknown transport"):
        world.start("nccl-over-pigeons")


def test_testbed_jobs_bind_gloo_to_the_shaped_interface() -> None:
    """Both launchers give every rank GLOO_SOCKET_IFNAME=eth0, so a gloo group started
    inside a testbed job uses the shaped veth (the root test below checks the bytes)."""
    from optcc_mpi.lab import testbed as tb

    bed = tb.Testbed(name="optcctbargv", ranks=4, rate_bit=400_000_000)
    hydra = bed.launch_argv(["prog"], mpiexec=("/x/bin/mpiexec", "hydra"))
    genv = {hydra[i + 1]: hydra[i + 2] for i, a in enumerate(hydra) if a == "-genv"}
    assert genv["GLOO_SOCKET_IFNAME"] == tb.RANK_DEV
    ompi = bed.launch_argv(["prog"], mpiexec=("/x/bin/mpiexec", "openmpi"))
    assert f"GLOO_SOCKET_IFNAME={tb.RANK_DEV}" in [
        ompi[i + 1] for i, a in enumerate(ompi) if a == "-x"
    ]


# ------------------------------------------------------------------------------- bench


@pytest.mark.timeout(600)
def test_bench_over_gloo_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    done = torchrun(
        3, str(NO_MPI), "optcc_mpi", "bench", "-b", "256K", "-e", "1M", "-f", "4", "-n", "2",
        "--links", "2:0.5", "--emulate", "bw=200MB/s", "--algorithms", "ring,optcc,auto,gloo",
        "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "over gloo process group of 3" in done.stdout
    rows = _rows(out)
    labels = ["ring (fault-free)", "ring", "optcc", "auto", "gloo"]
    assert [r["algorithm"] for r in rows] == labels * 2
    for r in rows:
        assert r["transport"] == "gloo" and r["p"] == 3 and r["network"] == "emulation"
        assert r["wrong"] == 0, r  # every timed result checked, all exact
        assert r["time_min_us"] <= r["time_us"] <= r["time_max_us"]
        assert r["command"].startswith("optcc-mpi bench")
    degraded = [r for r in rows if r["algorithm"] != "ring (fault-free)"]
    assert all(r["links"] == "2:0.5" for r in degraded)
    assert {r["chosen"] for r in rows if r["algorithm"] == "gloo"} == {"gloo"}
    # gloo's row is modelled as a library AllReduce (the slowest rank's rate), ours by theirs.
    assert all(r["model_us"] > 0 for r in rows)


@pytest.mark.timeout(600)
def test_bench_over_gloo_under_mpiexec(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    from optcc_mpi.lab import launch

    out = tmp_path / "rows.jsonl"
    argv = launch.launcher().argv(2)
    cmd = [*argv, sys.executable, "-m", "optcc_mpi", "bench", "--transport", "gloo"]
    cmd += ["-b", "512K", "-e", "512K", "-n", "2", "--links", "1:0.5"]
    cmd += ["--emulate", "bw=200MB/s", "--out", str(out)]
    env = launch.clean_env(_env(MPIR_CVAR_CH4_PROGRESS_THROTTLE="1"))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = _rows(out)
    # The default with --transport gloo: every algorithm, auto, and gloo's own all_reduce.
    from optcc_mpi import algorithms

    assert [r["algorithm"] for r in rows] == [
        "ring (fault-free)", *algorithms.names(), "auto", "gloo",
    ]  # fmt: skip
    assert all(r["transport"] == "gloo" and r["wrong"] == 0 for r in rows), rows


@pytest.mark.timeout(600)
def test_an_error_every_worker_meets_is_printed_once_under_torchrun() -> None:
    """A link profile naming rank 3 of 2: every worker raises it, worker 0 alone prints
    it, every worker exits with status 2 and gives torchrun the same one line, which
    torchrun's own failure report shows in place of a traceback (docs/bench.md)."""
    done = torchrun(
        2, str(NO_MPI), "optcc_mpi", "bench", "-b", "4K", "-e", "4K", "-n", "1",
        "--links", "3:0.5", "--algorithms", "ring",
    )  # fmt: skip
    line = "optcc-mpi bench: error: link profile names rank 3, outside the communicator of size 2"
    ours = [x for x in done.stderr.splitlines() if x.startswith("optcc-mpi bench:")]
    assert done.returncode != 0 and len(ours) == 1 and ours[0].startswith(line), done.stderr
    # torchrun stops the other workers once one has failed: one may be listed as ended
    # by its signal (SIGTERM) if it had not yet left.
    assert done.stderr.count(f"traceback : {line}") >= 1, done.stderr
    assert done.stderr.count("exitcode  : 2") >= 1, done.stderr
    assert "optcc_mpi/" not in done.stderr, done.stderr  # no traceback of ours


# ------------------------------------------------------------------------------ doctor


@pytest.mark.timeout(600)
def test_doctor_under_torchrun_finds_the_half_rate_rank(tmp_path: Path) -> None:
    """No MPI library: the doctor's messages travel over gloo. Rank 2 at half of the
    emulated rate is found (its fraction within 0.1), nothing else is flagged, and rank
    0's non-zero status (3, degraded) makes torchrun fail the job, its report showing
    the verdict once."""
    out = tmp_path / "doctor.json"
    done = torchrun(
        3, str(NO_MPI), "optcc_mpi", "doctor", "--emulate", "bw=50MB/s,degrade=2:0.5",
        "--size", "1M", "--repeats", "3", "--json", str(out), "--no-progress",
    )  # fmt: skip
    assert done.returncode != 0, done.stdout[-3000:]
    # One verdict per job: rank 0 alone exits with the status and gives torchrun its
    # summary line; the others exit 0 (docs/doctor.md, "Under torchrun").
    assert done.stderr.count("exitcode  : 3") == 1, done.stderr[-3000:]
    assert done.stderr.count("traceback : DEGRADED: node") == 1, done.stderr[-3000:]
    assert "optcc_mpi/" not in done.stderr, done.stderr[-3000:]  # no traceback of ours
    diag = json.loads(out.read_text())
    assert diag["status"] == "degraded", done.stdout
    flagged = [r["rank"] for r in diag["ranks"] if r["verdict"] != "healthy"]
    assert flagged == [2], done.stdout
    slow = next(r for r in diag["ranks"] if r["rank"] == 2)
    assert slow["fraction"] == pytest.approx(0.5, abs=0.1)
    # The doctor's own accounting: 1 MiB x 3 repeats x 2 partners per rank.
    assert diag["bytes_sent"] == [6 << 20] * 3


# ------------------------------------------------------------------------ DDP and its log


@pytest.mark.timeout(600)
def test_lab_ddp_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "ddp.jsonl"
    done = torchrun(
        3, str(NO_MPI), "optcc_mpi", "lab", "ddp", "--width", "192", "--layers", "2",
        "--steps", "6", "--bucket-mb", "0.05", "--links", "2:0.5", "--algorithm", "optcc",
        "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    hook, plain = _rows(out)
    assert hook["mode"] == "hook" and plain["mode"] == "ddp"
    assert hook["ran"] and set(hook["ran"]) == {"optcc"} and hook["buckets"] >= 2
    assert hook["links"] == "2:0.5" and hook["p"] == 3 and hook["timed_steps"] == 5
    assert hook["rel_gap"] <= 1e-6 and hook["identical"] and plain["identical"]


@pytest.mark.timeout(600)
def test_lab_ddp_under_emulation_charges_both_copies_the_same_network(tmp_path: Path) -> None:
    """--emulate: the hook is told the emulated slow rank; the baseline averages with
    the ring through the same hook on the same virtual NICs (every call of both paced by
    the same emulation), the fault-free copy with every virtual NIC healthy; the
    parameters still equal within rtol and are the same bits on every rank."""
    out = tmp_path / "ddp.jsonl"
    done = torchrun(
        3, str(NO_MPI), "optcc_mpi", "lab", "ddp", "--width", "192", "--layers", "2",
        "--steps", "4", "--bucket-mb", "0.05", "--emulate", "bw=200MB/s,degrade=2:0.5",
        "--algorithm", "optcc", "--fault-free", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "'ddp' averages with the ring on the same virtual NICs" in done.stdout
    hook, plain, healthy = _rows(out)
    spec = "bw=200MB/s,degrade=2:0.5"
    assert hook["network"] == plain["network"] == healthy["network"] == "emulation"
    assert hook["links"] == "2:0.5" and set(hook["ran"]) == {"optcc"}
    assert hook["paced"] == plain["paced"] == spec and hook["emulate"] == spec
    assert set(plain["ran"]) == {"ring"} and plain["algorithm"] == "ring (the hook, emulated)"
    assert set(healthy["ran"]) == {"ring"}
    assert healthy["paced"] == "bw=200MB/s,degrade=healthy"
    assert hook["rel_gap"] <= 1e-6 and hook["identical"] and plain["identical"]


@pytest.mark.timeout(600)
def test_lab_ddp_told_trains_a_copy_told_the_truth_beside_the_one_that_learns(
    tmp_path: Path,
) -> None:
    """--told (issue 35, Deliver 2): beside the backend copy that learns its links
    (--links watch) a copy on a second optcc group is told the emulated truth; all three
    copies train to the same parameters, the same bits on every rank, and the told row
    says what it was told. Without --backend and a learnt profile it is refused."""
    out = tmp_path / "ddp.jsonl"
    done = torchrun(
        3, str(NO_MPI), "optcc_mpi", "lab", "ddp", "--width", "192", "--layers", "2",
        "--steps", "4", "--bucket-mb", "0.05", "--emulate", "bw=200MB/s,degrade=2:0.5",
        "--backend", "--links", "watch", "--told", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "x told" in done.stdout
    learnt, plain, told = _rows(out)
    assert (learnt["mode"], plain["mode"], told["mode"]) == ("backend", "ddp", "backend told")
    assert told["links"] == "2:0.5" and told["timed_steps"] == learnt["timed_steps"] == 3
    assert learnt["rel_gap"] <= 1e-6
    assert learnt["identical"] and plain["identical"] and told["identical"]
    refused = torchrun(
        3, str(NO_MPI), "optcc_mpi", "lab", "ddp", "--width", "64", "--layers", "1",
        "--steps", "2", "--links", "2:0.5", "--told",
    )  # fmt: skip
    assert refused.returncode != 0
    assert "--told compares a copy that learns its links" in refused.stdout + refused.stderr


@pytest.mark.timeout(600)
def test_hook_records_the_link_log(tmp_path: Path) -> None:
    """``comm_hook(links="watch", links_log=FILE)``: rank 0 records what the watch adopts
    (rank 1 emulated at half rate) and what the buckets ran; a log without the watch is
    refused when the hook is made."""
    log = tmp_path / "links.jsonl"
    done = torchrun(
        3, str(HOOK_WORKER), str(log), str(tmp_path), OPTCC_EMULATE="bw=50MB/s,degrade=1:0.5"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]
    for rec in ranks:
        assert "links_log records what links='watch' adopts" in rec["refused"]
        assert rec["links"] == "1:0.5"
    from optcc_mpi import linklog

    records = linklog.read(log)
    assert len({r["run"] for r in records}) == 1  # one writer: rank 0
    assert records[0]["event"] == "start" and records[0]["source"] == "watch"
    assert records[0]["p"] == 3
    adopted = [r for r in records if r["event"] == "adopt"]
    assert adopted and adopted[0]["links"] == "1:0.5"
    assert any(r["event"] == "call" for r in records)


# ------------------------------------------------------------------------------- testbed


@pytest.mark.root
@pytest.mark.timeout(600)
def test_bench_over_gloo_crosses_the_shaped_links(tmp_path: Path) -> None:
    """Inside ``optcc-mpi testbed run``: gloo binds to every rank's shaped eth0 (its
    MASTER_ADDR is rank 0's namespace address), so every byte of the bench goes through
    the veths: each rank's counters rise by at least what the rows moved."""
    from optcc_mpi.lab import launch
    from optcc_mpi.lab import testbed as tb

    launcher_vars = [k for k in world.MPI_VARIABLES if k in os.environ]
    if launcher_vars:
        pytest.skip(f"running under an MPI launcher ({launcher_vars[0]} is set); run serially")
    ok, why = tb.namespaces_supported()
    if not ok:
        pytest.skip(f"namespace testbed unavailable: {why}")
    pytest.importorskip("mpi4py")
    name = "optcctbgloo"
    tb.down(name, kill=True)
    bed = tb.up(3, "400mbit", {0: 0.5}, name=name)
    try:
        out = tmp_path / "rows.jsonl"
        size, iters, warmup = 2 << 20, 2, 1
        cmd = [sys.executable, "-m", "optcc_mpi", "bench", "--transport", "gloo"]
        cmd += ["-b", str(size), "-e", str(size), "-n", str(iters), "-w", str(warmup)]
        cmd += ["--algorithms", "ring,gloo", "--out", str(out)]
        before = bed.counters()
        env = {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        }
        done = subprocess.run(
            bed.launch_argv(cmd, env=env), capture_output=True, text=True, timeout=400,
            env=launch.clean_env(),
        )  # fmt: skip
        after = bed.counters()
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        rows = _rows(out)
        assert [r["algorithm"] for r in rows] == ["ring (fault-free)", "ring", "gloo"]
        assert all(r["network"] == "testbed" and r["wrong"] == 0 for r in rows)
        assert rows[1]["links"] == "0:0.5"
        # Ring and gloo's all_reduce alike send and receive 2(p-1)/p of the buffer per call.
        p = 3
        payload = len(rows) * (iters + warmup) * 2 * (p - 1) / p * size
        moved = {
            (rank, key): after[rank][key] - before[rank][key]
            for rank in range(p)
            for key in ("tx", "rx")
        }
        print("eth0 bytes / payload:", {k: round(v / payload, 3) for k, v in moved.items()})
        for (rank, key), value in moved.items():
            assert value >= 0.98 * payload, (rank, key, value, payload)
        assert tb.current(name).degrade == {0: 0.5}  # the shaping is back after the reference
    finally:
        tb.down(name, kill=True)


# ------------------------------------------------------------------------------- example


@pytest.mark.timeout(600)
@pytest.mark.parametrize("emulate", [None, "bw=200MB/s"])
def test_example_trains_under_torchrun_without_mpi(emulate: str | None) -> None:
    """--compare against DDP's own all-reduce; under --emulate against the ring through
    the same hook on the same virtual NICs (the slow rank of --links), step times beside."""
    example = ROOT / "examples" / "train_ddp.py"
    done = torchrun(
        2, str(NO_MPI), str(example), "--epochs", "1" if emulate else "2",
        "--links", "1:0.5", "--data", "synthetic", "--compare",
        *(["--emulate", emulate] if emulate else []),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "parameters identical on all 2 ranks: True" in done.stdout
    assert "links 1:0.5" in done.stdout
    baseline = "the ring, emulated like it" if emulate else "DDP's own all-reduce"
    assert f"# {baseline}: test accuracy" in done.stdout
    assert "# median step: optcc_mpi's hook" in done.stdout and f"ms, {baseline}" in done.stdout


@pytest.mark.timeout(600)
def test_example_trains_under_mpiexec() -> None:
    pytest.importorskip("mpi4py")
    from optcc_mpi.lab import launch

    cmd = [*launch.launcher().argv(2), sys.executable, "-m", "mpi4py"]
    cmd += [str(ROOT / "examples" / "train_ddp.py"), "--epochs", "1", "--data", "synthetic"]
    cmd += ["--links", "watch", "--algorithm", "ring"]
    env = launch.clean_env(_env(MPIR_CVAR_CH4_PROGRESS_THROTTLE="1"))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "parameters identical on all 2 ranks: True" in done.stdout
    assert "ring, links" in done.stdout
