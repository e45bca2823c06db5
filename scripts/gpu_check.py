"""GPU readiness check (``make gpu-check``): the GPU paths, run on a real GPU, in minutes.

On a machine with NVIDIA GPUs it runs each check whose libraries are there, and says why
it skipped the others:

With CuPy (>= 14, bf16 through ml_dtypes) and MPI (mpi4py and an ``mpiexec``):

1. ``allreduce``: every registered AllReduce algorithm on CuPy arrays at 1 and 4 ranks
   (``mpiexec``; with the MPICH wheel, which is not CUDA-aware, messages are staged
   through host memory), float32 and bfloat16, each result checked against a float64
   reference and across ranks;
2. ``gram``: the bf16-in, fp32-out GemmEx Gram (``optcc_mpi.glm.gram.gram_bf16``)
   against a float64 reference;
3. ``training``: recipe C training (``optcc_mpi.glm.fit(..., recipe="C",
   device="gpu")``) against the same run on the CPU;

With a CUDA build of PyTorch (NCCL), and no MPI:

4. ``torch``: the torch.distributed transport on CUDA tensors in an NCCL process group
   of one (made over a ``FileStore``): every registered algorithm and ``auto``; float32,
   bfloat16, float16, float64 and int64; sum, prod, max, min (with NaN and zeros of both
   signs) and bor; in place at four sizes and once out of place. Each result against a
   float64 reference, on the device (in place: in the tensor's own memory), the transport
   NCCL's, and no host synchronisation during the call (``scripts/gpu_check_rank.py``);
5. ``reductions``: the device reductions (``optcc_mpi.reductions.TorchOps`` on CUDA)
   against NumPy's bits (``reduce_with``) on the same inputs: every dtype
   TorchArrayOps reduces and every op defined for it; every bit pattern of float16 and
   bfloat16, random bit patterns and special values (NaN, zeros of both signs,
   infinities, subnormals, rounding ties) for the wider floats, the integer extremes.
   Results agree bit for bit, except that a sum or product that is NaN may be any NaN;

With CuPy and mpi4py:

6. ``timing``: one outer iteration of CA-SGD in recipe C (s steps: bf16 data, the
   GemmEx Gram, one reduction, the recurrence) against the same s steps of fp32 SGD on
   the same rows, and the Gram itself (GemmEx bf16 against CuPy's fp32 GEMM), timed with
   CUDA events: median, min and max of ``--repeats`` runs, printed as ``TIME`` lines
   (recorded, never judged);

With two or more GPUs and PyTorch:

7. ``ranks``: at every GPU count K from 2 to the number of GPUs, ``torchrun
   --nproc-per-node K`` with one GPU per rank and NCCL, no MPI: check 4's calls at K
   ranks (a degraded last rank for the schedules), each result against float64, the same
   bytes on every rank, no host synchronisation in any call that sent messages, and at
   least one NCCL group per such call; a tensor on the wrong device refused on every rank
   with nothing changed; DDP with ``optcc_mpi.torch.comm_hook`` against DDP's own
   all-reduce (20 steps, within 1e-6 relative, identical on every rank). On one GPU it
   is skipped: NCCL refuses two ranks on one GPU (by design, since NCCL 2.5).

With PyTorch:

8. ``backend``: the torch.distributed backend ``optcc`` (``dist.init_process_group
   ("optcc")``) on CUDA tensors, NCCL underneath: a world of one over a FileStore, and
   with two or more GPUs ``torchrun`` at 2 ranks. SUM, AVG, PRODUCT, MAX and MIN on
   float32, float64, bfloat16, float16 and int64 at three sizes against a float64
   reference and the same bits on every rank, the transport NCCL's; an asynchronous
   call's Work; broadcast and all_gather passed through to NCCL; DDP with no hook against
   the same five steps computed by hand in float64 (``scripts/gpu_check_backend.py``).
9. ``staged``: the same at 2 and 4 ranks that all share one GPU (``cuda:0``), with
   ``OPTCC_CARRIER=host``: CUDA tensors staged through pinned host memory on the group's
   side stream and moved by gloo, which NCCL (one rank per GPU) cannot do; also whether
   a kernel queued after an asynchronous all_reduce ran while the reduction was still
   in flight (the side stream's overlap).

It prints one line per check (``PASS``/``FAIL``/``SKIP``, and ``TIME`` for
measurements), a summary, and exits 1 if any check failed. Without a usable GPU it says
why and exits 0 having checked nothing. ``--cpu`` runs what it can on the CPU, to test
this script itself on any machine: 1 on NumPy arrays; 4, 7 and 8 on CPU tensors over gloo,
with the transport made to use NCCL's executor driver (each level's messages posted as
one group, nothing waited for on the host), 7 at 2 to ``--max-ranks`` ranks; 5 on CPU
tensors; 6 with NumPy kernels timed by the clock; 2 and 3 are skipped.

Examples::

    python scripts/gpu_check.py                        # what `make gpu-check` runs
    python scripts/gpu_check.py --only torch,reductions,ranks --json gpu-check.json
    python scripts/gpu_check.py --cpu --only ranks --max-ranks 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RANK_SCRIPT = Path(__file__).resolve().with_name("gpu_check_rank.py")
BACKEND_SCRIPT = Path(__file__).resolve().with_name("gpu_check_backend.py")
SIZES = (1, 4097, 1 << 18)  # elements: one, odd, and past the short-message threshold
CHECKS = (
    "allreduce", "gram", "training", "torch", "reductions", "timing", "ranks", "backend", "staged",
)  # fmt: skip
#: Host synchronisations a call that sent no messages may make: none (short messages are
#: gathered on the device, optcc_mpi.transports.distributed.TorchTransport.gather_rows).
SYNCS_WITHOUT_MESSAGES = 0
#: TorchArrayOps' dtypes (optcc_mpi.arrays), each checked by ``reductions``.
TORCH_DTYPES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "float16", "bfloat16", "float32",
    "float64", "complex64", "complex128",
)  # fmt: skip
#: The problems ``timing`` runs: rows, features, s, b.
TIMING_PROBLEM = {"gpu": (32768, 2048, 16, 32), "cpu": (4096, 256, 8, 16)}
#: Every line printed, for ``--json``.
RECORD: list[dict[str, Any]] = []


def _line(status: str, what: str, detail: str, **numbers: Any) -> None:
    print(f"{status:4}  {what:<34} {detail}", flush=True)
    RECORD.append({"status": status, "what": what, "detail": detail, **numbers})


def algorithms_child(use_cpu: bool) -> int:
    """Under mpiexec: every algorithm on device arrays; one line per algorithm (rank 0)."""
    from mpi4py import MPI

    import optcc_mpi
    from optcc_mpi import algorithms
    from optcc_mpi.dtypes import DTYPES

    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    if use_cpu:
        xp = np
    else:
        import cupy as xp

        xp.cuda.Device(0).use()
    failures = 0
    links = "0:0.5" if p > 1 else None  # a degraded rank: OptCC and R2CCL adapt to it
    for name in algorithms.names():
        worst, t0, err = 0.0, time.perf_counter(), ""
        try:
            for dtype in ("float32", "bfloat16"):
                dt = DTYPES[dtype]
                for n in SIZES:
                    i = np.arange(n)
                    host = ((i * 7 + rank * 13) % 17 - 8).astype(dt)
                    ref = sum(((i * 7 + q * 13) % 17 - 8) for q in range(p)).astype(np.float64)
                    y = optcc_mpi.allreduce(
                        xp.asarray(host), comm=comm, algorithm=name, links=links
                    )
                    got = (xp.asnumpy(y) if xp is not np else y).astype(np.float64)
                    worst = max(worst, float(np.max(np.abs(got - ref))) if n else 0.0)
                    first = comm.bcast(got if rank == 0 else None)
                    if not np.array_equal(first, got):
                        raise AssertionError("results differ across ranks")
        except Exception as exc:  # report, keep checking the others
            err = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        errs = comm.gather(err)
        worsts = comm.gather(worst)
        if rank == 0:
            bad = [f"rank {r}: {e}" for r, e in enumerate(errs) if e]
            # Inputs are small integers: every dtype holds the exact sum.
            ok = not bad and max(worsts) == 0.0
            failures += not ok
            took = time.perf_counter() - t0
            detail = (
                f"p={p} float32+bf16, links {links}, {len(SIZES)} sizes, exact, {took:.1f}s"
                if ok
                else (bad[0] if bad else f"max error {max(worsts):g}")
            )
            _line(
                "PASS" if ok else "FAIL",
                f"allreduce {name} ({'numpy' if use_cpu else 'cupy'})",
                detail,
            )
    return 1 if comm.bcast(failures) else 0


def check_algorithms(ranks: int, use_cpu: bool, timeout: float) -> bool:
    from optcc_mpi.errors import MPIUnavailableError
    from optcc_mpi.lab import launch

    try:  # the project's launching rule: $OPTCC_MPIEXEC, the mpiexec beside python, PATH
        chosen = launch.launcher()
    except MPIUnavailableError as exc:
        _line("FAIL", f"allreduce, {ranks} ranks", str(exc))
        return False
    cmd = [*chosen.argv(ranks), sys.executable, "-m", "mpi4py", __file__, "--child"]
    if use_cpu:
        cmd.append("--cpu")
    env = {**launch.clean_env(), **chosen.env(ranks)}
    try:
        res = subprocess.run(cmd, timeout=timeout, env=env, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        _line("FAIL", f"allreduce, {ranks} ranks", f"timed out after {timeout:.0f}s")
        return False
    except OSError as exc:
        _line("FAIL", f"allreduce, {ranks} ranks", f"cannot start {cmd[0]}: {exc}")
        return False
    sys.stdout.write(res.stdout)
    for text in res.stdout.splitlines():  # the ranks' lines, for --json (_line's columns)
        if text[:4] in ("PASS", "FAIL"):
            RECORD.append({"status": text[:4], "what": text[6:40].strip(), "detail": text[41:]})
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        _line("FAIL", f"allreduce, {ranks} ranks", f"exit {res.returncode}: {tail}")
        return False
    return True


def check_gram() -> bool:
    import cupy as cp
    import ml_dtypes

    from optcc_mpi.glm.gram import gram_bf16

    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    ok = True
    for rows, k in ((64, 1000), (513, 4096)):
        Y = rng.standard_normal((rows, k)).astype(ml_dtypes.bfloat16)
        ref = Y.astype(np.float64) @ Y.astype(np.float64).T
        G = cp.asnumpy(gram_bf16(cp, cp.asarray(Y)))
        # fp32 accumulation of k products: relative error a few k * 2^-24 at most.
        rel = float(np.max(np.abs(G - ref)) / np.max(np.abs(ref)))
        sym = float(np.max(np.abs(G - G.T)))
        ok &= G.dtype == np.float32 and rel < 1e-5 and sym == 0.0
        detail = f"{rows}x{k}: max rel error {rel:.2e}, asymmetry {sym:g}"
        _line("PASS" if ok else "FAIL", "gram_bf16 vs float64", detail)
    _line("PASS" if ok else "FAIL", "gram_bf16 total", f"{time.perf_counter() - t0:.1f}s")
    return ok


def check_training() -> bool:
    from optcc_mpi.glm import fit, make_glm_data

    X, y = make_glm_data("logistic", 8192, 256, seed=1)
    kw = dict(model="logistic", solver="casgd", s=8, b=32, lr=0.5, max_iter=2, tol=None, recipe="C")
    t0 = time.perf_counter()
    gpu = fit(X, y, device="gpu", **kw)
    t_gpu = time.perf_counter() - t0
    cpu = fit(X, y, device="cpu", **kw)
    # Same recipe, same sample sequence: the losses agree to the recipe's rounding.
    diff = abs(gpu.final_loss - cpu.final_loss)
    ok = gpu.final_loss < 0.69 and diff < 1e-2 * max(cpu.final_loss, 1e-3)
    _line(
        "PASS" if ok else "FAIL",
        "recipe C training (casgd, gpu)",
        f"loss {gpu.final_loss:.5f} (cpu {cpu.final_loss:.5f}), {t_gpu:.1f}s",
    )
    return ok


# -- PyTorch: the torch.distributed transport (checks 4 and 7) ----------------------------------
def torch_status() -> dict[str, Any]:
    """Whether PyTorch imports and can run NCCL on a GPU, and what it found."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # ImportError, or a broken CUDA install
        return {"available": False, "reason": f"PyTorch not importable: {exc}"}
    status: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        build = f"CUDA build {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        status.update(available=False, reason=f"torch.cuda.is_available() is False ({build})")
    elif not (dist.is_available() and dist.is_nccl_available()):
        status.update(available=False, reason="this PyTorch has no NCCL")
    else:
        version = torch.cuda.nccl.version()
        status.update(
            available=True,
            devices=torch.cuda.device_count(),
            device=torch.cuda.get_device_name(0),
            nccl=".".join(map(str, version)) if isinstance(version, tuple) else str(version),
        )
    return status


def _rank_env(**extra: str) -> dict[str, str]:
    """The environment for the torch ranks: no launcher's, no rank variables, no link
    profile or carrier inherited; one thread per rank; then ``extra``."""
    from optcc_mpi.lab import launch

    env = launch.clean_env()
    for var in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OPTCC_LINKS",
        "OPTCC_CARRIER",
    ):  # fmt: skip
        env.pop(var, None)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _run_group(cmd: list[str], timeout: float, **env: str) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group: ``(exit status, stderr)``, or ``(None, ...)``
    after ``timeout`` seconds, with the whole group (torchrun and its ranks) stopped."""
    from optcc_mpi.lab import launch

    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=err, env=_rank_env(**env), text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            launch.stop_group(proc)
            code = None
        err.seek(0)
        return code, err.read()


def first_error(stderr: str) -> str:
    """The line that says what went wrong: the first exception a rank raised (torchrun's
    own summary comes after it and names only the launcher's error), else the last line."""
    lines = stderr.strip().splitlines() or ["(no output)"]
    for line in lines:
        text = line.split("]:", 1)[-1].strip()  # torchrun prefixes "[rank0]:"
        head = text.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and "ChildFailedError" not in head:
            return text
    # No exception: a rank that died of a signal, or aborted in C++; torchrun's summary
    # names its exit code, and the C++ runtime's last words come before it.
    said = [x.strip() for x in lines if x.strip().startswith(("exitcode", "terminate called"))]
    return "; ".join(dict.fromkeys(said)) if said else lines[-1]


def _run_ranks(
    k: int,
    device: str,
    timeout: float,
    what: str,
    script: Path = RANK_SCRIPT,
    more: Sequence[str] = (),
    **env: str,
) -> list[dict[str, Any]] | None:
    """Start ``script`` (``scripts/gpu_check_rank.py``, or the backend's) on ``k`` ranks (a
    world of one over a FileStore, or torchrun), with ``more`` arguments and ``env`` in
    its environment; every rank's record, or None after printing why there is none."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        out = Path(tmp)
        args = ["--device", device, "--out", str(out), *more]
        if k == 1:
            cmd = [sys.executable, str(script), *args, "--store", str(out / "store")]
        else:
            extra = ["--ddp"] if script == RANK_SCRIPT else []
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={k}", str(script), *args, *extra,
            ]  # fmt: skip
        code, err = _run_group(cmd, timeout, **env)
        if code is None:
            _line("FAIL", what, f"timed out after {timeout:.0f}s (every rank stopped)")
            return None
        if code != 0:
            _line("FAIL", what, f"exit {code}: {first_error(err)}")
            return None
        try:
            return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(k)]
        except (OSError, ValueError) as exc:
            _line("FAIL", what, f"a rank wrote no record: {exc}")
            return None


def row_problems(row: dict[str, Any], backend: str, p: int) -> list[str]:
    """What is wrong with one call a rank recorded (empty: nothing)."""
    label = f"{row['dtype']} {row['op']} n={row['n']} {row['kind']}"
    out = []
    if not row["error"] <= row["bound"]:
        out.append(f"{label}: error {row['error']:g} against float64, allowed {row['bound']:g}")
    if not row["on_device"]:
        out.append(f"{label}: the result left the device")
    if row["kind"] == "in place" and not row["same_memory"]:
        out.append(f"{label}: the result is not in the tensor's memory")
    if row["kind"] == "out of place" and (row["same_memory"] or not row["input_kept"]):
        out.append(f"{label}: the input was written to")
    if row["transport"] != backend:
        out.append(f"{label}: ran over {row['transport']}, not {backend}")
    if row["algorithm"] != "auto" and row["ran"] != row["algorithm"]:
        out.append(f"{label}: ran {row['ran']}")
    if row["messages"]:
        if row["observe"] != "grouped" or row["groups"] < 1:
            out.append(
                f"{label}: {row['messages']} messages but no group posted (not NCCL's driver)"
            )
        if row["syncs"] or row["host_copies"]:
            out.append(
                f"{label}: {row['syncs']} host synchronisation(s) and {row['host_copies']} "
                f"copies to the host with {row['messages']} messages"
            )
    elif p == 1 and (row["syncs"] or row["host_copies"]):
        out.append(f"{label}: {row['syncs']} host synchronisation(s) in a world of one")
    elif row["syncs"] > SYNCS_WITHOUT_MESSAGES or row["host_copies"]:
        out.append(
            f"{label}: {row['syncs']} host synchronisation(s) and {row['host_copies']} copies "
            "to the host without messages"
        )
    return out


#: What a judge returns: status, what was checked, the detail, and its numbers.
Verdict = tuple[str, str, str, dict[str, Any]]


def judge_collectives(records: list[dict[str, Any]], backend: str) -> list[Verdict]:
    """One verdict per algorithm, from every rank's record (``rows``: one per call, from
    ``gpu_check_rank.collectives_scenario``)."""
    p, first = len(records), records[0]["rows"]
    out = []
    for alg in dict.fromkeys(r["algorithm"] for r in first):
        idx = [i for i, r in enumerate(first) if r["algorithm"] == alg]
        problems: list[str] = []
        for rank, rec in enumerate(records):
            rows = rec["rows"]
            if len(rows) != len(first):
                problems.append(f"rank {rank} recorded {len(rows)} calls, rank 0 {len(first)}")
                continue
            for i in idx:
                problems += [f"rank {rank}: {x}" for x in row_problems(rows[i], backend, p)]
                if rows[i]["digest"] != first[i]["digest"]:
                    row = rows[i]
                    problems.append(
                        f"rank {rank}: {row['dtype']} {row['op']} n={row['n']}: bytes differ "
                        "from rank 0's"
                    )
        rows = [first[i] for i in idx]
        with_msgs = [r for r in rows if r["messages"]]
        sizes = sorted({r["n"] for r in rows if r["kind"] == "in place"})
        cases = len({(r["dtype"], r["op"]) for r in rows if r["kind"] == "in place"})
        worst = max((r["error"] / r["bound"] for r in rows if r["bound"]), default=0.0)
        numbers = {
            "calls": len(rows),
            "messages": sum(r["messages"] for r in with_msgs),
            "groups": sum(r["groups"] for r in with_msgs),
            "syncs_with_messages": max((r["syncs"] for r in with_msgs), default=0),
            "syncs": max((r["syncs"] for r in rows), default=0),
            "host_copies": max((r["host_copies"] for r in rows), default=0),
            "error_of_bound": worst,
        }
        detail = (
            f"{cases} dtype/op x {len(sizes)} sizes + out of place; {numbers['messages']} "
            f"messages in {numbers['groups']} groups, host syncs {numbers['syncs']}, copies "
            f"{numbers['host_copies']}; " + (f"error {worst:.2g} of bound" if worst else "exact")
        )
        what = f"{backend} p={p} {alg}"
        if problems:
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            out.append(("FAIL", what, problems[0] + more, numbers))
        else:
            out.append(("PASS", what, detail, numbers))
    return out


def judge_errors(records: list[dict[str, Any]], backend: str) -> Verdict:
    """A tensor on the wrong device on the last rank: the same refusal on every rank,
    nothing changed, the next call right."""
    p = len(records)
    problems = []
    for rank, rec in enumerate(records):
        err = rec["errors"]
        if not err["error"] or err["expect"] not in err["error"]:
            problems.append(f"rank {rank}: {err['error'] or 'no error'}")
        if not err["unchanged"]:
            problems.append(f"rank {rank}: the tensor changed")
        if err["after"] != [float(p)] * 8:
            problems.append(f"rank {rank}: the next call gave {err['after'][:2]}...")
    what = f"{backend} p={p} wrong device refused"
    if problems:
        return ("FAIL", what, "; ".join(problems[:2]), {})
    return ("PASS", what, f"on every rank: {records[0]['errors']['expect']}", {})


def judge_ddp(records: list[dict[str, Any]], backend: str) -> Verdict:
    """DDP with the hook against DDP's own all-reduce: within 1e-6 relative after 20 steps,
    the same parameters on every rank, OptCC over the process group's library."""
    p, first = len(records), records[0]["ddp"]
    problems = []
    if first["ran"] != "optcc" or first["transport"] != backend:
        problems.append(f"the hook ran {first['ran']} over {first['transport']}")
    if not first["moved"] > 1e-3:
        problems.append(f"the parameters moved only {first['moved']:g}")
    for rank, rec in enumerate(records):
        d = rec["ddp"]
        if not d["diff"] <= 1e-6 * d["scale"]:
            problems.append(f"rank {rank}: {d['diff']:g} from DDP's ({d['scale']:g} largest)")
        if d["ours"] != first["ours"]:
            problems.append(f"rank {rank}: parameters differ from rank 0's")
    what = f"{backend} p={p} DDP hook vs DDP"
    worst = max(r["ddp"]["diff"] / max(r["ddp"]["scale"], 1e-300) for r in records)
    if problems:
        return ("FAIL", what, "; ".join(problems[:2]), {"relative": worst})
    return (
        "PASS",
        what,
        f"{first['parameters']:,} parameters, 20 steps, links {first['links']}: "
        f"{worst:.1e} relative, identical on every rank",
        {"relative": worst},
    )


def _report(results: list[Verdict]) -> bool:
    for status, what, detail, numbers in results:
        _line(status, what, detail, **numbers)
    return all(v[0] != "FAIL" for v in results)


def _judge(records: list[dict[str, Any]], backend: str) -> bool:
    """Print the lines of one run; True if all passed."""
    results = judge_collectives(records, backend) + [judge_errors(records, backend)]
    if "ddp" in records[0]:
        results.append(judge_ddp(records, backend))
    if any(r["mpi_loaded"] for r in records):
        results.append(("FAIL", f"{backend} p={len(records)} MPI-free", "a rank loaded MPI", {}))
    return _report(results)


def check_torch(use_cpu: bool, timeout: float) -> bool:
    """Check 4: the transport in a process group of one."""
    device, backend = ("cpu", "gloo") if use_cpu else ("cuda", "nccl")
    records = _run_ranks(1, device, timeout, f"{backend} p=1 (world of one)")
    return records is not None and _judge(records, backend)


def rank_counts(use_cpu: bool, gpus: int, max_ranks: int | None) -> tuple[list[int], str]:
    """The rank counts check 7 runs (2 to the number of GPUs, or to ``max_ranks``; with
    ``--cpu`` 2 to ``max_ranks``, default 3), or why it runs none."""
    top = max_ranks or (3 if use_cpu else gpus)
    if not use_cpu:
        top = min(top, gpus)
    if top >= 2:
        return list(range(2, top + 1)), ""
    if not use_cpu and gpus < 2:
        return [], (
            f"{gpus} GPU: NCCL refuses two ranks on one GPU (by design, since NCCL 2.5); "
            "needs 2 or more GPUs"
        )
    return [], f"--max-ranks {max_ranks}: fewer than 2 ranks"


def check_ranks(use_cpu: bool, counts: list[int], timeout: float) -> bool:
    """Check 7: torchrun at each rank count, one GPU per rank."""
    device, backend = ("cpu", "gloo") if use_cpu else ("cuda", "nccl")
    ok = True
    for k in counts:
        records = _run_ranks(k, device, timeout, f"{backend} p={k} (torchrun)")
        ok &= records is not None and _judge(records, backend)
    return ok


# -- check 8: the torch.distributed backend "optcc" ------------------------------------------
def judge_backend(
    records: list[dict[str, Any]], device: str, library: str | None = None, what: str = ""
) -> Verdict:
    """Every row within its bound and the same bits on every rank, on ``library`` (default
    the device's: NCCL on CUDA, else gloo); the Work, the pass-through collectives and DDP
    with no hook right; on a GPU, a kernel queued after an async all_reduce not waiting
    for it."""
    p = len(records)
    library = library or ("nccl" if device == "cuda" else "gloo")
    what = what or f"optcc backend p={p} ({library} underneath)"
    problems = [f"rank {r['rank']}: {r['error']}" for r in records if "error" in r]
    if problems:
        return ("FAIL", what, problems[0], {})
    first = records[0]
    for rank, rec in enumerate(records):
        for row in rec["rows"]:
            if not row["error"] <= row["allowed"]:
                problems.append(f"rank {rank}: {row['dtype']} {row['op']} n={row['n']} off by "
                                f"{row['error']:g}")  # fmt: skip
            if row["transport"] != library or not row["device"].startswith(device):
                problems.append(f"{row['dtype']} {row['op']}: ran on {row['transport']}, "
                                f"{row['device']}")  # fmt: skip
        if [r["digest"] for r in rec["rows"]] != [r["digest"] for r in first["rows"]]:
            problems.append(f"rank {rank}: results differ from rank 0's")
        for key in ("async", "broadcast", "all_gather"):
            if rec[key] is not True:
                problems.append(f"rank {rank}: {key} wrong")
        if rec["work"] != "OptccWork":
            problems.append(f"rank {rank}: all_reduce returned a {rec['work']}")
        if not rec["ddp_gap"] <= 1e-5:
            problems.append(f"rank {rank}: DDP {rec['ddp_gap']:g} from the float64 steps")
        if "overlap" in rec and not rec["overlap"]["reduction_pending"]:
            problems.append(
                f"rank {rank}: the kernel queued after an async all_reduce ended after it "
                f"({rec['overlap']['compute_ms']:.2f} ms): no overlap"
            )
    if problems:
        return ("FAIL", what, "; ".join(problems[:2]), {})
    ran = sorted({str(r["algorithm"]) for r in first["rows"]})
    return (
        "PASS",
        what,
        f"{len(first['rows'])} op/dtype/size rows within bounds, identical on every rank "
        f"(ran {', '.join(ran)}); async, broadcast, all_gather; DDP no hook "
        f"{max(r['ddp_gap'] for r in records):.1e} from float64",
        {},
    )


def check_staged(use_cpu: bool, timeout: float) -> bool:
    """Check 9: the optcc backend at 2 and 4 ranks on one GPU, CUDA tensors staged through
    host memory (``OPTCC_CARRIER=host``; gloo underneath)."""
    device = "cpu" if use_cpu else "cuda"
    ok = True
    for k in (2, 4):
        what = f"optcc backend p={k} on one device (host carrier, gloo underneath)"
        records = _run_ranks(
            k, device, timeout, what, BACKEND_SCRIPT, ["--share-device"], OPTCC_CARRIER="host"
        )
        ok &= records is not None and _report([judge_backend(records, device, "gloo", what)])
    return ok


def check_backend(use_cpu: bool, gpus: int, timeout: float) -> bool:
    """Check 8: the optcc backend at one rank, and at two where there are two GPUs (or
    with ``--cpu``)."""
    device = "cpu" if use_cpu else "cuda"
    ok = True
    for k in (1, 2) if (use_cpu or gpus >= 2) else (1,):
        records = _run_ranks(k, device, timeout, f"optcc backend p={k}", BACKEND_SCRIPT)
        ok &= records is not None and _report([judge_backend(records, device)])
    return ok


# -- check 5: the device reductions against NumPy's bits ---------------------------------------
def _float_specials(dt: np.dtype) -> np.ndarray:
    """NaNs (both signs, one with a payload), zeros of both signs, infinities, the
    smallest subnormal and normal numbers, the largest finite, ones, and eps and eps/2
    (with 1: a sum that is a rounding tie)."""
    finfo = np.finfo(dt)
    bits = np.dtype(f"u{dt.itemsize}")
    quiet = np.array([np.nan], dtype=dt).view(bits)[0]
    top = bits.type(1) << bits.type(8 * dt.itemsize - 1)
    nans = np.array([quiet, quiet | top, quiet | bits.type(1)], dtype=bits).view(dt)
    tiny, big = finfo.smallest_subnormal, finfo.max
    values = [0.0, -0.0, np.inf, -np.inf, tiny, -tiny, finfo.smallest_normal, big, -big]
    values += [1.0, -1.0, finfo.eps, finfo.eps / 2]
    return np.concatenate([nans, np.array(values, dtype=dt)])


def reduction_inputs(name: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(dst, src)`` NumPy arrays of dtype ``name`` for check 5 (module docstring)."""
    from optcc_mpi.dtypes import DTYPES

    dt = DTYPES[name]
    rng = np.random.default_rng(seed)
    if name == "bool":
        return rng.integers(0, 2, 4096).astype(bool), rng.integers(0, 2, 4096).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        ends = np.array([info.min, info.min + 1, -1 if info.min else 2, 0, 1, info.max], dtype=dt)
        a, b = np.meshgrid(ends, ends)
        rand = rng.integers(info.min, info.max, 2 * 65536, dtype=dt, endpoint=True)
        return np.concatenate([a.ravel(), rand[::2]]), np.concatenate([b.ravel(), rand[1::2]])
    if dt.kind == "c":
        part = np.dtype(f"f{dt.itemsize // 2}")
        d, s = reduction_inputs(part.name, seed)
        n = d.size // 2 * 2
        return d[:n].view(dt), s[:n].view(dt)
    bits = np.dtype(f"u{dt.itemsize}")
    if dt.itemsize == 2:  # every bit pattern, against a shuffle of them and a shifted copy
        every = np.arange(1 << 16, dtype=np.uint16)
        a = np.concatenate([every, every]).view(dt)
        b = np.concatenate([rng.permutation(every), np.roll(every, 1)]).view(dt)
        pattern_d = pattern_s = np.zeros(0, dtype=dt)
    else:  # the specials against each other, and random bit patterns (every exponent)
        a, b = np.meshgrid(_float_specials(dt), _float_specials(dt))
        top = np.iinfo(bits).max
        pattern_d = rng.integers(0, top, 65536, dtype=bits, endpoint=True).view(dt)
        pattern_s = rng.integers(0, top, 65536, dtype=bits, endpoint=True).view(dt)
    normal_d = rng.standard_normal(16384).astype(dt)
    normal_s = rng.standard_normal(16384).astype(dt)
    near = (-normal_d.astype(np.float64) * (1 + rng.uniform(-1e-3, 1e-3, 16384))).astype(dt)
    return (
        np.concatenate([a.ravel(), pattern_d, normal_d, normal_d]),
        np.concatenate([b.ravel(), pattern_s, normal_s, near]),
    )


def _to_torch(torch: Any, arr: np.ndarray, name: str, device: Any) -> Any:
    """The same bits as a tensor on ``device``."""
    if name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(arr.copy()).to(device)


def _to_numpy(torch: Any, t: Any, name: str) -> np.ndarray:
    from optcc_mpi.dtypes import DTYPES

    host = t.cpu()
    if name == "bfloat16":
        return host.view(torch.int16).numpy().view(DTYPES[name])
    return host.numpy()


def bit_mismatches(got: np.ndarray, ref: np.ndarray, op: str) -> np.ndarray:
    """Indices where ``got`` is not ``ref``'s bits; a NaN of a sum or product may be any
    NaN (which NaN an addition returns is the hardware's), so only NaN-ness counts there.
    Complex numbers: each component on its own."""
    if got.dtype.kind == "c":
        part = np.dtype(f"f{got.dtype.itemsize // 2}")
        bad = bit_mismatches(got.view(part), ref.view(part), op)
        return np.unique(bad // 2)
    width = got.dtype.itemsize
    bits = np.dtype(f"u{width}")
    differ = got.view(bits) != ref.view(bits)
    floating = got.dtype.kind == "f" or got.dtype.name == "bfloat16"
    if floating and op in ("sum", "prod"):
        nan_g = np.isnan(got.astype(np.float32) if width == 2 else got)
        nan_r = np.isnan(ref.astype(np.float32) if width == 2 else ref)
        differ = (nan_g != nan_r) | (~nan_r & differ)
    return np.flatnonzero(differ)


def complex_product_mismatches(
    got: np.ndarray, ref: np.ndarray, dst: np.ndarray, src: np.ndarray
) -> tuple[np.ndarray, int]:
    """Indices where a complex product ``got`` is not ``ref``'s value, and how many
    products were not judged.

    A complex product has no fixed bits: NumPy's multiply loops use fused multiply-adds
    where the CPU has them, a GPU compiler contracts ``a*b - c*d`` as it likes, and
    neither follows C's Annex G where the partial products overflow. So each component
    may differ by two roundings of its two terms (``|a b| + |c d|``) plus the smallest
    subnormal, zeros of either sign are equal, and products whose inputs are not finite
    or whose partial products overflow are not judged.
    """
    part = np.dtype(f"f{got.dtype.itemsize // 2}")
    finfo, wide = np.finfo(part), np.longdouble
    g, r = got.view(part).reshape(-1, 2), ref.view(part).reshape(-1, 2)
    a = dst.view(part).reshape(-1, 2)
    b = src.view(part).reshape(-1, 2)
    with np.errstate(all="ignore"):
        a, b = a.astype(wide), b.astype(wide)
        scale = np.stack(
            [np.abs(a[:, 0] * b[:, 0]) + np.abs(a[:, 1] * b[:, 1]),
             np.abs(a[:, 0] * b[:, 1]) + np.abs(a[:, 1] * b[:, 0])],
            axis=1,
        )  # fmt: skip
        judged = (np.isfinite(a).all(axis=1) & np.isfinite(b).all(axis=1))[:, None] & (
            scale <= wide(finfo.max)
        )
        allowed = 2 * wide(finfo.eps) * scale + wide(finfo.smallest_subnormal)
        far = ~(np.abs(g.astype(wide) - r.astype(wide)) <= allowed)  # NaN is far
    bad = (judged & far).any(axis=1)
    return np.flatnonzero(bad), int((~judged.all(axis=1)).sum())


def check_reductions(use_cpu: bool) -> bool:
    """Check 5, one line per dtype."""
    import torch

    from optcc_mpi.dtypes import OPS, VALID_PAIRS
    from optcc_mpi.reductions import TorchOps, reduce_with

    device = torch.device("cpu") if use_cpu else torch.device("cuda", 0)
    ops = TorchOps(torch)
    ok = True
    for name in TORCH_DTYPES:
        dst, src = reduction_inputs(name)
        problems: list[str] = []
        done: list[str] = []
        loose: list[str] = []  # complex products: how many were not NumPy's bits
        for op in OPS:
            if (op, name) not in VALID_PAIRS:
                continue
            ref = dst.copy()
            with np.errstate(all="ignore"):
                reduce_with(np, op, ref, src)
            d = _to_torch(torch, dst, name, device)
            ops.reduce(op, d, _to_torch(torch, src, name, device))
            got = _to_numpy(torch, d, name)
            bad = bit_mismatches(got, ref, op)
            if dst.dtype.kind == "c" and op == "prod" and bad.size:
                inexact = bad.size
                bad, unjudged = complex_product_mismatches(got, ref, dst, src)
                loose.append(
                    f"prod: {inexact} not NumPy's bits, within two roundings where judged "
                    f"({unjudged} non-finite or overflowing not judged)"
                )
            done.append(op)
            if bad.size:
                i = bad[0]
                problems.append(
                    f"{op}: {bad.size} of {dst.size} differ, first {dst[i]!r} with {src[i]!r}: "
                    f"{got[i]!r} on {device.type}, {ref[i]!r} by NumPy"
                )
        what = f"reductions {name} ({device.type})"
        if problems:
            ok = False
            _line("FAIL", what, "; ".join(problems))
        elif loose:
            _line(
                "PASS",
                what,
                f"{' '.join(done)} on {dst.size:,} pairs: NumPy's bits; {'; '.join(loose)}",
            )
        else:
            _line("PASS", what, f"{' '.join(done)} on {dst.size:,} pairs: NumPy's bits")
    return ok


# -- check 6: recipe C against fp32 SGD, timed -------------------------------------------------
class Timer:
    """Times a callable: CUDA events on CuPy's current stream on a GPU, the clock on the
    CPU; milliseconds per run, after ``warmup`` untimed runs."""

    def __init__(self, xp: Any, repeats: int, warmup: int = 3) -> None:
        self.xp, self.repeats, self.warmup = xp, repeats, warmup
        self.gpu = xp is not np
        self.clock = "CUDA events" if self.gpu else "the clock"

    def __call__(self, fn: Callable[[], Any]) -> list[float]:
        for _ in range(self.warmup):
            fn()
        out = []
        for _ in range(self.repeats):
            if self.gpu:
                start, end = self.xp.cuda.Event(), self.xp.cuda.Event()
                start.record()
                fn()
                end.record()
                end.synchronize()
                out.append(float(self.xp.cuda.get_elapsed_time(start, end)))
            else:
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e3)
        return out


def summary(ms: list[float]) -> dict[str, float]:
    """Median, min and max of times in milliseconds."""
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}


def _time_line(what: str, ms: list[float], clock: str, extra: str = "") -> dict[str, float]:
    st = summary(ms)
    detail = (
        f"median {st['median_ms']:.4g} ms, min {st['min_ms']:.4g}, max {st['max_ms']:.4g} "
        f"({len(ms)} runs, {clock}){extra}"
    )
    _line("TIME", what, detail, **st, runs=len(ms))
    return st


def check_timing(use_cpu: bool, repeats: int) -> bool:
    """Check 6: recorded, not judged; False only if something failed to run."""
    from mpi4py import MPI

    from optcc_mpi.glm import make_glm_data
    from optcc_mpi.glm.comm import Group, Reducer
    from optcc_mpi.glm.kernels import LocalData
    from optcc_mpi.glm.models import get_model
    from optcc_mpi.glm.precision import get_recipe
    from optcc_mpi.glm.sampler import Sampler
    from optcc_mpi.glm.solvers import TrainConfig, Trainer

    if use_cpu:
        xp: Any = np
    else:
        import cupy as xp

        from optcc_mpi.glm.gram import gram_bf16
    m, n, s, b = TIMING_PROBLEM["cpu" if use_cpu else "gpu"]
    X, y = make_glm_data("logistic", m, n, seed=3)
    sampler = Sampler(m, b, s, seed=3)
    rows, steps = sampler.block(sampler.permutation(0), 0)
    timer = Timer(xp, repeats)

    def trainer(recipe: str, solver: str) -> Trainer:
        rc = get_recipe(recipe)
        cfg = TrainConfig("logistic", solver, s, b, 0.5, 0.0, 3, rc)
        local = LocalData(X, rc, xp=xp)
        group = Group(MPI.COMM_SELF)
        return Trainer(group, local, y, get_model("logistic"), cfg, Reducer(group))

    ca, sgd = trainer("C", "casgd"), trainer("fp32", "sgd")
    w_ca = ca.local.device(ca.initial_weights())
    w_sgd = sgd.local.device(sgd.initial_weights())
    problem = f"{m}x{n} logistic, s={s}, b={b}"
    Y16, Y32 = ca.local.gather(rows), sgd.local.gather(rows)
    sb = Y16.shape[0]
    if use_cpu:  # no GemmEx: the CPU's recipe-C Gram (bf16 values, fp32 BLAS), packed
        _time_line(
            f"gram C {sb}x{n} (cpu, packed)",
            timer(lambda: ca.local.gram_packed(Y16, s, b)),
            timer.clock,
        )
    else:
        _time_line(f"gram_bf16 {sb}x{n} (GemmEx)", timer(lambda: gram_bf16(xp, Y16)), timer.clock)
    _time_line(
        f"gram fp32 {sb}x{n} ({'numpy' if use_cpu else 'cupy'})",
        timer(lambda: Y32 @ Y32.T),
        timer.clock,
    )
    t_ca = summary(timer(lambda: ca.casgd_block(w_ca, rows, steps, ca.cfg.lr)))
    t_sgd = summary(timer(lambda: sgd.sgd_block(w_sgd, rows, steps, sgd.cfg.lr)))
    w1, _ = ca.casgd_block(w_ca, rows, steps, ca.cfg.lr)
    w2, _ = sgd.sgd_block(w_sgd, rows, steps, sgd.cfg.lr)
    w1, w2 = np.asarray(ca.local.host(w1), float), np.asarray(sgd.local.host(w2), float)
    if not (np.isfinite(w1).all() and np.isfinite(w2).all()):
        _line("FAIL", "recipe C step vs fp32 SGD", "non-finite weights after one step")
        return False
    gap = float(np.max(np.abs(w1 - w2)) / max(np.max(np.abs(w2)), 1e-30))
    for what, st in (
        (f"casgd C, 1 outer iteration ({steps} steps)", t_ca),
        (f"sgd fp32, {steps} steps", t_sgd),
    ):
        _line(
            "TIME", what,
            f"median {st['median_ms']:.4g} ms, min {st['min_ms']:.4g}, max {st['max_ms']:.4g} "
            f"({repeats} runs, {timer.clock}); {problem}",
            **st, runs=repeats,
        )  # fmt: skip
    ratio = t_sgd["median_ms"] / t_ca["median_ms"]
    _line(
        "TIME",
        "sgd fp32 / casgd C (medians)",
        f"{ratio:.2f}x on one {'CPU' if use_cpu else 'GPU'}; weights after the step "
        f"{gap:.1e} apart (relative); the CA-SGD paper's headline: 5.1-6.8x on A100s",
        ratio=ratio,
        weight_gap=gap,
    )
    if not use_cpu:  # give the memory back before the torch ranks start on this GPU
        del ca, sgd, Y16, Y32, w_ca, w_sgd
        xp.get_default_memory_pool().free_all_blocks()
    return True


EPILOG = """\
checks (--only), in order, and what each needs:
  allreduce   every algorithm on CuPy arrays over MPI, 1 and 4 ranks     CuPy, MPI
  gram        the bf16 GemmEx Gram against float64                        CuPy
  training    recipe C training on the GPU against the CPU                CuPy, mpi4py
  torch       the NCCL transport on CUDA tensors, a world of one          PyTorch (CUDA)
  reductions  TorchOps on the GPU against NumPy's bits                    PyTorch (CUDA)
  timing      one recipe-C CA-SGD step against fp32 SGD, CUDA events      CuPy, mpi4py
  ranks       torchrun at 2..N GPUs over NCCL, no MPI; the DDP hook       PyTorch, 2+ GPUs
  backend     the "optcc" backend on CUDA tensors, 1 rank (2 on 2+ GPUs)   PyTorch (CUDA)
A check whose libraries are missing prints SKIP with the reason; any FAIL exits 1.

examples:
  python scripts/gpu_check.py                                # all (make gpu-check)
  python scripts/gpu_check.py --only torch,reductions,ranks --json out.json
  python scripts/gpu_check.py --only timing --repeats 50
  python scripts/gpu_check.py --cpu                          # test the script, no GPU

docs/gpu/README.md says which checks have run on a GPU.
"""


def _selected(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown check {', '.join(unknown) or '(none)'}; choose from {', '.join(CHECKS)}"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    ap.add_argument(
        "--cpu", action="store_true", help="run what can run without a GPU (test the script)"
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--timeout", type=float, default=120.0, help="seconds per mpiexec run (x4 per torch run)"
    )
    ap.add_argument(
        "--only",
        type=_selected,
        default=list(CHECKS),
        metavar="CHECKS",
        help=f"comma-separated checks to run (default: all of {','.join(CHECKS)})",
    )
    ap.add_argument("--repeats", type=int, default=20, help="timed runs per measurement (timing)")
    ap.add_argument(
        "--max-ranks",
        type=int,
        default=None,
        help="largest rank count for ranks (default: the number of GPUs; --cpu: 3)",
    )
    ap.add_argument("--json", type=Path, help="also write every line, with its numbers, here")
    args = ap.parse_args(argv)  # fmt: skip
    if args.child:
        return algorithms_child(args.cpu)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    from optcc_mpi.arrays import cupy_status

    cupy_st = cupy_status()
    torch_st = torch_status()
    if not args.cpu and not cupy_st.get("available") and not torch_st.get("available"):
        why = cupy_st.get("reason") or (
            "CuPy not installed" if not cupy_st.get("installed") else ""
        )
        print(
            f"gpu-check: no usable GPU (CuPy: {why or 'cupy.is_available() is False'}; "
            f"PyTorch: {torch_st['reason']}); nothing checked"
        )
        return 0
    if not args.cpu:
        if cupy_st.get("available"):
            dev, cc = cupy_st.get("device"), cupy_st.get("compute_capability")
            print(f"gpu-check: {dev} (cc {cc}), CuPy {cupy_st.get('version')}")
        if torch_st.get("available"):
            print(
                f"gpu-check: PyTorch {torch_st['version']} (CUDA {torch_st['cuda']}, NCCL "
                f"{torch_st['nccl']}), {torch_st['devices']} GPU(s), {torch_st['device']}"
            )
    t0 = time.perf_counter()
    results: list[bool] = []
    skipped = 0

    def need(what: str, status: dict[str, Any], library: str) -> bool:
        nonlocal skipped
        if args.cpu or status.get("available"):
            return True
        reason = status.get("reason") or f"{library} has no usable GPU"
        _line("SKIP", what, f"{library}: {reason}")
        skipped += 1
        return False

    def attempt(what: str, check: Callable[[], bool]) -> None:
        try:
            results.append(check())
        except Exception as exc:  # report, keep checking the others
            _line("FAIL", what, f"{type(exc).__name__}: {exc}")
            results.append(False)

    only = args.only
    if "allreduce" in only and need("allreduce (MPI, CuPy)", cupy_st, "CuPy"):
        results += [check_algorithms(n, args.cpu, args.timeout) for n in (1, 4)]
    for name, check in (("gram", check_gram), ("training", check_training)):
        if name not in only:
            continue
        if args.cpu:
            _line("SKIP", name, "--cpu: needs a GPU")
            skipped += 1
        elif need(name, cupy_st, "CuPy"):
            attempt(name, check)
    torch_timeout = 4 * args.timeout
    if "torch" in only and need("torch transport, world of one", torch_st, "PyTorch"):
        attempt("torch", lambda: check_torch(args.cpu, torch_timeout))
    if "reductions" in only and need("reductions (TorchOps)", torch_st, "PyTorch"):
        attempt("reductions", lambda: check_reductions(args.cpu))
    if "timing" in only and need("timing (recipe C vs fp32 SGD)", cupy_st, "CuPy"):
        try:  # the GLM trainer is built on mpi4py (a communicator of one here)
            import mpi4py  # noqa: F401
        except ImportError as exc:
            _line("SKIP", "timing (recipe C vs fp32 SGD)", f"mpi4py: {exc}")
            skipped += 1
        else:
            attempt("timing", lambda: check_timing(args.cpu, args.repeats))
    if "ranks" in only and need("ranks (torchrun, NCCL)", torch_st, "PyTorch"):
        counts, why = rank_counts(args.cpu, int(torch_st.get("devices", 0)), args.max_ranks)
        if not counts:
            _line("SKIP", "ranks (torchrun, NCCL)", why)
            skipped += 1
        else:
            attempt("ranks", lambda: check_ranks(args.cpu, counts, torch_timeout))
    if "backend" in only and need("optcc backend (NCCL underneath)", torch_st, "PyTorch"):
        gpus = int(torch_st.get("devices", 0))
        attempt("backend", lambda: check_backend(args.cpu, gpus, torch_timeout))
    if "staged" in only and need("optcc backend, ranks sharing a GPU", torch_st, "PyTorch"):
        attempt("staged", lambda: check_staged(args.cpu, torch_timeout))
    failed = results.count(False)
    took = time.perf_counter() - t0
    verdict = "all passed" if not failed else f"{failed} check(s) failed"
    print(f"gpu-check: {verdict}{f', {skipped} skipped' if skipped else ''} in {took:.0f}s")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "command": [sys.executable, *sys.argv],
                    "cpu": args.cpu,
                    "cupy": cupy_st,
                    "torch": torch_st,
                    "failed": failed,
                    "skipped": skipped,
                    "seconds": took,
                    "lines": RECORD,
                },
                indent=1,
                default=str,
            )
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
