"""GPU readiness check (``make gpu-check``): the GPU paths, run on a real GPU, in minutes.

On a machine with one NVIDIA GPU and CuPy (>= 14, bf16 through ml_dtypes) it runs:

1. every registered AllReduce algorithm on CuPy arrays at 1 and 4 ranks (``mpiexec``; with
   the MPICH wheel, which is not CUDA-aware, messages are staged through host memory),
   float32 and bfloat16, each result checked against a float64 reference and across ranks;
2. the bf16-in, fp32-out GemmEx Gram (``optcc_mpi.glm.gram.gram_bf16``) against a float64
   reference;
3. recipe C training (``optcc_mpi.glm.fit(..., recipe="C", device="gpu")``) against the
   same run on the CPU.

It prints one summary line per check (``PASS``/``FAIL``/``SKIP``) and exits 1 if any check
failed. Without a usable GPU it says why and exits 0 having checked nothing. ``--cpu``
runs check 1 with NumPy arrays instead, to test this script itself on any machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SIZES = (1, 4097, 1 << 18)  # elements: one, odd, and past the short-message threshold


def _line(status: str, what: str, detail: str) -> None:
    print(f"{status:4}  {what:<34} {detail}", flush=True)


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
    kw = dict(model="logistic", solver="casgd", s=8, b=32, lr=0.5, epochs=2, recipe="C")
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="NumPy arrays for check 1 (test the script)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per mpiexec run")
    args = ap.parse_args(argv)
    if args.child:
        return algorithms_child(args.cpu)
    from optcc_mpi.backend import cupy_status

    status = cupy_status()
    if not args.cpu and not status.get("available"):
        why = status.get("reason") or ("CuPy not installed" if not status.get("installed") else "")
        print(
            f"gpu-check: no usable GPU ({why or 'cupy.is_available() is False'}); nothing checked"
        )
        return 0
    if not args.cpu:
        dev, cc = status.get("device"), status.get("compute_capability")
        print(f"gpu-check: {dev} (cc {cc}), CuPy {status.get('version')}")
    t0 = time.perf_counter()
    results = [check_algorithms(n, args.cpu, args.timeout) for n in (1, 4)]
    if args.cpu:
        _line("SKIP", "gram_bf16, recipe C training", "--cpu: need a GPU")
    else:
        for check in (check_gram, check_training):
            try:
                results.append(check())
            except Exception as exc:
                _line("FAIL", check.__name__, f"{type(exc).__name__}: {exc}")
                results.append(False)
    failed = results.count(False)
    print(
        f"gpu-check: {'all passed' if not failed else f'{failed} check(s) failed'} "
        f"in {time.perf_counter() - t0:.0f}s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
