"""One rank of the CA-SGD tests over torch.distributed (tests/test_glm_torch.py), started
by torchrun.

``python -m torch.distributed.run --standalone --nproc-per-node N tests/glm_torch_worker.py
OUTDIR``. No MPI: mpi4py is made unimportable before optcc_mpi is imported. One launch
runs every scenario (launches are slow); each rank writes what it saw to
``OUTDIR/glm-RANK.json`` and the test compares the ranks with each other and with runs on
one process.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
import warnings
from pathlib import Path

OUT = Path(sys.argv[1])
sys.modules["mpi4py"] = None  # type: ignore[assignment]  # import mpi4py -> ImportError

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

RANK = int(os.environ["RANK"])
P = int(os.environ["WORLD_SIZE"])


def digest(a: object) -> str:
    arr = a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()[:16]


def error_of(call: object) -> str | None:
    try:
        call()  # type: ignore[operator]
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def scenario() -> dict[str, object]:
    from sklearn.datasets import load_breast_cancer
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from optcc_mpi.data import column_block
    from optcc_mpi.glm import CASGDClassifier, fit, make_glm_data

    out: dict[str, object] = {}
    X, y = make_glm_data("logistic", 512, 24, seed=3, dtype="float64")
    kw = dict(model="logistic", s=4, b=16, lr=0.5, max_iter=2, tol=None)

    # fp64 on NumPy data, comm left out (torch's default group): the kernels are torch's.
    r = fit(X, y, recipe="fp64", **kw)
    out["fp64"] = {
        "coef": r.coef.tolist(),
        "loss": r.final_loss,
        "kernels": r.config["kernels"],
        "backend": r.config["backend"],
        "local": [type(r.coef_local).__module__, str(r.coef_local.device)],
        "calls": r.stats["allreduce_calls"],
    }
    # Recipes C and D on a float32 tensor, which stays a tensor (the block is a view).
    Xt = torch.from_numpy(X.astype(np.float32))
    before = digest(Xt)
    for recipe in ("C", "D"):
        r = fit(Xt, y, recipe=recipe, comm=dist.group.WORLD, **kw)
        out[recipe] = {"coef": r.coef.tolist(), "loss": r.final_loss, "digest": digest(r.coef)}
    out["X_unchanged"] = digest(Xt) == before

    # The defaults: the stopping rule, and s chosen by the cost model under 50 us latency.
    r = fit(Xt, y, b=16, lr=0.5, recipe="C", emulate="latency=50us")
    out["auto"] = {
        "s": r.config["s"],
        "n_iter": r.n_iter,
        "stop": r.stop_reason,
        "digest": digest(r.coef),
        "net_calls": r.stats.get("net_calls"),
        "charged": r.stats.get("net_charged_s"),
        "calls": r.stats["allreduce_calls"],
    }

    # The scikit-learn estimator with comm= a process group.
    Xb, yb = load_breast_cancer(return_X_y=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ConvergenceWarning: the defaults converge
        clf = make_pipeline(StandardScaler(), CASGDClassifier(comm=dist.group.WORLD)).fit(Xb, yb)
    est = clf[-1]
    out["clf"] = {
        "coef": digest(est.coef_),
        "intercept": float(est.intercept_[0]),
        "score": float(clf.score(Xb, yb)),
        "n_iter": est.n_iter_,
        "stop": est.stop_reason_,
        "b": est.b_,
        "s": est.s_,
    }

    # Bad input, on one rank or across ranks: the same error on every rank, X untouched.
    errors: dict[str, object] = {}
    Xbad = X.copy()
    if RANK == P - 1:
        Xbad[3, 0] = np.nan
    errors["nan"] = error_of(lambda: fit(Xbad, y, **kw))
    errors["nan_untouched"] = bool(np.isnan(Xbad[3, 0])) == (RANK == P - 1)
    # Tensors on different devices across ranks ("meta" stands for a GPU here: gloo
    # moves CPU tensors only).
    Xdev = torch.empty(512, 24, device="meta") if RANK == 1 else Xt
    errors["device"] = error_of(lambda: fit(Xdev, y, **kw))
    # Blocks split for another communicator (as an MPI communicator of P + 1 ranks would
    # have split them) given to this group: the columns do not add up.
    cols = column_block(24, P + 1, RANK)
    errors["split"] = error_of(lambda: fit(X[:, cols], y, cols=cols, n_features=24, **kw))
    # Ranks that hold different labels.
    ybad = y.copy()
    if RANK == 0:
        ybad[0] = 1 - ybad[0]
    errors["labels"] = error_of(lambda: fit(X, ybad, **kw))
    out["errors"] = errors

    # optcc-mpi train under torchrun: the group is torch's, the last line the verdict.
    from optcc_mpi.cli import main

    text = io.StringIO()
    argv = ["train", "--data", "breast_cancer", "--intercept", "--b", "16", "--recipe", "C"]
    with contextlib.redirect_stdout(text):
        status = main([*argv, "--no-progress"])
    out["train"] = {"status": status, "out": text.getvalue()}
    out["mpi_loaded"] = bool(sys.modules.get("mpi4py"))
    return out


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = scenario()
    (OUT / f"glm-{RANK}.json").write_text(json.dumps(result))
    # Every rank done before any tears its groups down.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
