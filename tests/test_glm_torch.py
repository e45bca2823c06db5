"""CA-SGD over torch.distributed: under torchrun (gloo, no MPI at all) and beside MPI.

The torchrun test starts ``tests/glm_torch_worker.py`` once on 2 ranks and checks what
every rank saw: the trainer's arrays stayed tensors, fp64 equals the run on one process to
roundoff, recipes C and D stay within their tolerance of it, everything is identical on
every rank, the estimator and ``optcc-mpi train`` work over the group, and bad input ends
in the same error on every rank with nothing changed. The MPI test (``mpi`` marker) puts
the two transports side by side in the same processes: the same fit over the MPI
communicator and over a gloo group made from it, and a communicator whose ranks are not
the group's.

There is no GPU here: NCCL (CUDA tensors) runs the same code, but has not run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("this PyTorch has no torch.distributed", allow_module_level=True)

from optcc_mpi.glm import fit, make_glm_data  # noqa: E402

WORKER = Path(__file__).with_name("glm_torch_worker.py")
REPO = Path(__file__).resolve().parents[1]
KW = dict(model="logistic", s=4, b=16, lr=0.5, max_iter=2, tol=None)
#: Recipes C and D over torch against the same recipe over NumPy (derived from the runs:
#: 1e-6 and 7e-5 measured): the bf16 roundings are the same, the float32 sums are not
#: taken in the same order (and the partial margins of 2 ranks are rounded to bf16 each,
#: one process's once), so a few roundings differ.
C_LOSS_RTOL = 1e-4
C_COEF_RTOL = 1e-3


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("glm_torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "MPI"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("OPTCC_LINKS", "OPTCC_EMULATE", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node=2", str(WORKER), str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads((out / f"glm-{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(700)
def test_fit_over_gloo_equals_one_process_and_every_rank(ranks: list[dict]) -> None:
    first = ranks[0]
    assert not any(r["mpi_loaded"] for r in ranks), "an MPI library was loaded"
    fp64 = first["fp64"]
    # The trainer's own arrays were torch tensors (on the CPU: gloo), over the group.
    assert (fp64["kernels"], fp64["backend"], fp64["local"]) == ("torch", "gloo", ["torch", "cpu"])
    X, y = make_glm_data("logistic", 512, 24, seed=3, dtype="float64")
    one = fit(X, y, recipe="fp64", **KW)
    assert rel(fp64["coef"], one.coef) <= 1e-12
    assert fp64["loss"] == pytest.approx(one.final_loss, rel=1e-12)
    assert fp64["calls"] == one.stats["allreduce_calls"]  # same outer iterations
    for recipe in ("C", "D"):
        ref = fit(X.astype(np.float32), y, recipe=recipe, **KW)
        got = first[recipe]
        assert got["loss"] == pytest.approx(ref.final_loss, rel=C_LOSS_RTOL), recipe
        assert rel(got["coef"], ref.coef) <= C_COEF_RTOL, recipe
    assert first["X_unchanged"]
    # Identical on every rank, bit for bit.
    for other in ranks[1:]:
        assert other["fp64"]["coef"] == fp64["coef"]
        for key in ("C", "D", "auto", "clf"):
            assert other[key] == first[key], key


@pytest.mark.timeout(700)
def test_defaults_converge_and_choose_s_over_gloo(ranks: list[dict]) -> None:
    auto, clf = ranks[0]["auto"], ranks[0]["clf"]
    # 50 us per message emulated on 2 ranks: the model takes s > 1, and the stopping rule
    # ends the fit before max_iter. Every AllReduce was paced and charged the model
    # (recursive doubling on 2 ranks: one message of 50 us each).
    assert auto["s"] > 1 and auto["stop"] == "converged" and auto["n_iter"] < 1000
    assert auto["net_calls"] == auto["calls"]
    assert auto["charged"] == pytest.approx(auto["calls"] * 50e-6, rel=0.05)
    # The estimator over the group: converged (the worker turned warnings into errors).
    assert clf["score"] > 0.97 and clf["stop"] == "converged" and clf["s"] >= 1


@pytest.mark.timeout(700)
def test_bad_input_over_gloo_is_the_same_error_on_every_rank(ranks: list[dict]) -> None:
    errors = [r["errors"] for r in ranks]
    for key in ("nan", "device", "split", "labels"):
        assert errors[0][key] is not None, key
        assert all(e[key] == errors[0][key] for e in errors), key
    assert "X contains NaN or inf (rank 1)" in errors[0]["nan"]
    assert "meta" in errors[0]["device"] and "(rank 1)" in errors[0]["device"]
    assert "split for another communicator" in errors[0]["split"]
    assert "different labels" in errors[0]["labels"]
    assert all(e["nan_untouched"] for e in errors)  # nothing changed


@pytest.mark.timeout(700)
def test_train_command_over_gloo(ranks: list[dict]) -> None:
    assert all(r["train"]["status"] == 0 for r in ranks)
    out = ranks[0]["train"]["out"]
    assert "gloo, 2 ranks" in out and "AllReduce (native over gloo)" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("result: accuracy 0.9") and "on the 569 training rows" in last
    assert "stopped because" in last
    assert ranks[1]["train"]["out"] == ""  # rank 0 alone prints


# --------------------------------------------------------------------------------- MPI


@pytest.fixture(scope="module")
def gloo_from_mpi() -> object:
    """torch.distributed's default group over COMM_WORLD (gloo)."""
    import datetime

    import torch.distributed as dist

    import optcc_mpi.torch as ot

    group = ot.init_process_group_from_mpi("gloo", timeout=datetime.timedelta(seconds=120))
    yield group
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_the_same_fit_over_mpi_and_over_gloo(gloo_from_mpi: object) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    X, y = make_glm_data("logistic", 256, 16, seed=5, dtype="float64")
    kw = dict(model="logistic", s=4, b=8, lr=0.5, max_iter=1, tol=None)
    for recipe in ("fp64", "C"):
        over_mpi = fit(X, y, recipe=recipe, comm=comm, **kw)
        over_gloo = fit(X, y, recipe=recipe, comm=gloo_from_mpi, **kw)
        assert over_mpi.config["kernels"] == "numpy" and over_gloo.config["kernels"] == "torch"
        if recipe == "fp64":
            assert rel(over_gloo.coef, over_mpi.coef) <= 1e-12
        else:
            assert over_gloo.final_loss == pytest.approx(over_mpi.final_loss, rel=C_LOSS_RTOL)
            assert rel(over_gloo.coef, over_mpi.coef) <= C_COEF_RTOL
        assert len(set(comm.allgather(over_gloo.coef.tobytes()))) == 1


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_blocks_of_an_mpi_communicator_that_is_not_the_group(gloo_from_mpi: object) -> None:
    from mpi4py import MPI

    from optcc_mpi.data import column_block

    world = MPI.COMM_WORLD
    # The same processes in the opposite order: MPI rank r is the group's rank p-1-r.
    backwards = world.Split(0, world.size - 1 - world.rank)
    try:
        X, y = make_glm_data("logistic", 128, 16, seed=5, dtype="float64")
        cols = column_block(16, backwards.size, backwards.rank)
        with pytest.raises(ValueError, match="split for another communicator") as err:
            fit(X[:, cols], y, cols=cols, n_features=16, comm=gloo_from_mpi, **KW)
        # The same words on every rank.
        assert len(set(world.allgather(str(err.value)))) == 1
        # A subset of the processes: every rank but the last, split as MPI would.
        sub = world.Split(0 if world.rank < world.size - 1 else MPI.UNDEFINED, world.rank)
        if sub != MPI.COMM_NULL:
            cols = column_block(16, sub.size, sub.rank)
            with pytest.raises(ValueError, match="split for another communicator"):
                fit(X[:, cols], y, cols=cols, n_features=16, comm=gloo_from_mpi, **KW)
            sub.Free()
        else:
            cols = column_block(16, world.size, world.rank)
            with pytest.raises(ValueError, match="split for another communicator"):
                fit(X[:, cols], y, cols=cols, n_features=16, comm=gloo_from_mpi, **KW)
    finally:
        backwards.Free()
