"""The scikit-learn estimators: check_estimator, tools, weights, multiclass, MPI.

Serial: ``python -m pytest -q tests/test_estimators.py``. MPI (marked ``mpi``):
``mpiexec -n N python -m mpi4py -m pytest --with-mpi --only-mpi -q tests/test_estimators.py``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
from mpi4py import MPI

pytest.importorskip("sklearn")

from sklearn.base import clone  # noqa: E402
from sklearn.datasets import (  # noqa: E402
    load_breast_cancer,
    load_diabetes,
    load_digits,
    load_iris,
    load_wine,
)
from sklearn.exceptions import ConvergenceWarning, NotFittedError  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402
from sklearn.metrics import d2_log_loss_score, d2_tweedie_score, r2_score  # noqa: E402
from sklearn.model_selection import GridSearchCV, StratifiedKFold, cross_val_score  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402
from sklearn.utils.estimator_checks import (  # noqa: E402
    check_estimator,
    check_sample_weight_equivalence_on_dense_data,
    check_sample_weight_equivalence_on_sparse_data,
)

from optcc_mpi.errors import DivergenceError  # noqa: E402
from optcc_mpi.glm import GLM, CASGDClassifier, CASGDRegressor, fit, make_glm_data  # noqa: E402
from optcc_mpi.glm.estimator import (  # noqa: E402
    EXPECTED_FAILED_CHECKS,
    auto_batch,
    auto_lr,
    expected_failed_checks,
)

SELF = MPI.COMM_SELF


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


# --------------------------------------------------------------------------------------
# scikit-learn's own checks
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "estimator",
    [CASGDClassifier(), CASGDRegressor(), CASGDRegressor(model="poisson"), GLM(model="linear")],
    ids=repr,
)
def test_check_estimator(estimator):
    expected = expected_failed_checks(estimator)
    assert len(expected) <= 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = check_estimator(
            estimator, expected_failed_checks=expected, on_fail=None, on_skip=None
        )
    status = {r["check_name"]: r["status"] for r in results}
    failed = {
        r["check_name"]: str(r["exception"])[:200] for r in results if r["status"] == "failed"
    }
    assert not failed, failed
    # The documented failures are real (a check that starts passing must leave the list).
    assert {name for name, st in status.items() if st == "xfail"} == set(expected)
    passed = sum(st == "passed" for st in status.values())
    # Skipped: pandas and array-API checks when those are not installed.
    assert passed >= len(status) - len(expected) - 4, status


SW_CHECKS = [
    check_sample_weight_equivalence_on_dense_data,
    check_sample_weight_equivalence_on_sparse_data,
]


@pytest.mark.parametrize(
    "estimator",
    [
        CASGDClassifier(),
        CASGDClassifier(recipe="fp64"),
        CASGDRegressor(recipe="fp64"),
        CASGDClassifier(b=10**6),
        CASGDClassifier(b=10**6, recipe="fp64"),
        CASGDRegressor(b=10**6, recipe="fp64"),
        CASGDRegressor(model="poisson", b=10**6, recipe="fp64"),
        GLM(model="linear", b=10**6, recipe="fp64"),
    ],
    ids=repr,
)
def test_sample_weight_equivalence_checks_fail_exactly_where_declared(estimator):
    # Declared: with b="auto" (mini-batches on the check's few rows), and for the float32
    # classifier (roundoff) whatever its batch. In full batch and fp64 every estimator
    # passes them: a weight of k is then exactly k copies of the row.
    expected = expected_failed_checks(estimator)
    mini = isinstance(estimator.b, str)
    low = isinstance(estimator, CASGDClassifier) and estimator.recipe != "fp64"
    assert set(expected) <= {c.__name__ for c in SW_CHECKS}
    assert bool(expected) == (mini or low)
    if low:
        assert set(expected) == set(EXPECTED_FAILED_CHECKS)
    for check in SW_CHECKS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if check.__name__ in expected:
                with pytest.raises(AssertionError, match="not equivalent"):
                    check(type(estimator).__name__, estimator)
            else:
                check(type(estimator).__name__, estimator)


@pytest.mark.parametrize("model", ["logistic", "linear", "poisson"])
def test_auto_lr_in_full_batch_treats_a_weight_of_k_as_k_copies(model):
    rng = np.random.default_rng(5)
    X = rng.uniform(size=(15, 30))
    y = rng.integers(0, 2, 15).astype(float) if model == "logistic" else rng.uniform(0, 3, 15)
    w = rng.integers(0, 5, 15)
    Xr, yr = np.repeat(X, w, axis=0), np.repeat(y, w)
    weighted = auto_lr(X, y, model, b=15, sample_weight=w.astype(float))
    repeated = auto_lr(Xr, yr, model, b=w.sum())
    assert weighted == pytest.approx(repeated, rel=1e-12)
    # With mini-batches the row term stays: a batch of one row may be that row alone.
    assert auto_lr(X, y, model, b=1, sample_weight=w.astype(float)) < 0.5 * weighted


# --------------------------------------------------------------------------------------
# Pipeline, GridSearchCV, cross_val_score
# --------------------------------------------------------------------------------------


def test_grid_search_over_a_pipeline_gives_finite_scores():
    X, y = load_iris(return_X_y=True)
    pipe = make_pipeline(StandardScaler(), CASGDClassifier(max_iter=10, tol=None, comm=SELF))
    grid = GridSearchCV(
        pipe,
        {"casgdclassifier__lam": [0.0, 1e-3], "casgdclassifier__b": [8, 32]},
        cv=3,
        error_score="raise",
    )
    grid.fit(X, y)
    scores = grid.cv_results_["mean_test_score"]
    assert scores.shape == (4,) and np.isfinite(scores).all()
    assert grid.best_score_ > 0.8 and grid.best_score_ == scores.max()
    assert grid.score(X, y) > 0.85


def test_cross_val_score_for_every_estimator():
    X, y = load_diabetes(return_X_y=True)
    Xs = StandardScaler().fit_transform(X)
    r2 = cross_val_score(CASGDRegressor(max_iter=20, tol=None, comm=SELF), Xs, y, cv=3)
    assert np.isfinite(r2).all() and r2.mean() > 0.3
    # Poisson on the same (positive, non-integer after scaling) targets.
    d2 = cross_val_score(
        CASGDRegressor(model="poisson", max_iter=20, tol=None, comm=SELF), Xs, y / 100, cv=3
    )
    assert np.isfinite(d2).all() and d2.mean() > 0.2
    Xi, yi = load_iris(return_X_y=True)
    acc = cross_val_score(make_pipeline(StandardScaler(), CASGDClassifier(comm=SELF)), Xi, yi)
    assert np.isfinite(acc).all() and acc.mean() > 0.8


# --------------------------------------------------------------------------------------
# sample_weight
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["classifier", "linear", "poisson"])
def test_integer_weights_equal_repeated_rows_in_fp64_full_batch(kind):
    rng = np.random.default_rng(4)
    X = rng.normal(size=(40, 5))
    if kind == "classifier":
        y = rng.integers(0, 3, 40)  # three classes: one-vs-rest
        est = CASGDClassifier(lr=0.3, max_iter=30, tol=None, b=10**6, recipe="fp64", comm=SELF)
    elif kind == "linear":
        y = X @ rng.normal(size=5) + rng.normal(size=40)
        est = CASGDRegressor(lr=0.1, max_iter=30, tol=None, b=10**6, recipe="fp64", comm=SELF)
    else:
        y = rng.poisson(np.exp(0.3 * X[:, 0])) + 0.5
        est = CASGDRegressor(
            "poisson", lr=0.1, max_iter=30, tol=None, b=10**6, recipe="fp64", comm=SELF
        )
    w = rng.integers(0, 4, 40)  # 0 removes a row, 2 doubles it ...
    weighted = clone(est).fit(X, y, sample_weight=w)
    repeated = clone(est).fit(np.repeat(X, w, axis=0), np.repeat(y, w))
    assert weighted.b_ == 40 and repeated.b_ == w.sum()  # both full batch
    assert rel(weighted.coef_, repeated.coef_) <= 1e-12
    np.testing.assert_allclose(weighted.intercept_, repeated.intercept_, rtol=1e-12, atol=1e-14)
    assert weighted.result_.final_loss == pytest.approx(repeated.result_.final_loss, rel=1e-12)


def test_unit_weights_are_no_weights_and_weights_matter():
    X, y = make_glm_data("linear", 300, 6, seed=2, dtype="float64")
    est = CASGDRegressor(s=4, b=16, comm=SELF)
    plain = clone(est).fit(X, y)
    ones = clone(est).fit(X, y, sample_weight=np.full(300, 3.0))
    np.testing.assert_array_equal(ones.coef_, plain.coef_)
    w = np.r_[np.full(150, 5.0), np.ones(150)]
    assert rel(clone(est).fit(X, y, sample_weight=w).coef_, plain.coef_) > 1e-3


@pytest.mark.parametrize("model", ["logistic", "linear", "poisson"])
def test_weighted_casgd_equals_weighted_sgd_fp64(model):
    X, y = make_glm_data(model, 256, 12, seed=3, dtype="float64")
    w = np.random.default_rng(0).uniform(0, 3, 256)
    kw = dict(model=model, b=8, lr=0.2, max_iter=2, tol=None, lam=0.01, recipe="fp64", comm=SELF)
    sgd = fit(X, y, solver="sgd", s=1, sample_weight=w, **kw)
    ca = fit(X, y, solver="casgd", s=6, sample_weight=w, **kw)
    assert rel(ca.coef, sgd.coef) <= 1e-12
    assert rel(ca.coef, fit(X, y, solver="casgd", s=6, **kw).coef) > 1e-3


@pytest.mark.parametrize(
    "weights, match",
    [
        (np.full(30, -1.0), "[Nn]egative"),
        (np.zeros(30), "zero|sum"),
        (np.ones(29), "shape|inconsistent|number"),
        (np.r_[np.nan, np.ones(29)], "NaN|nan|finite"),
    ],
)
def test_bad_weights_are_rejected(weights, match):
    X, y = make_glm_data("linear", 30, 3, seed=0, dtype="float64")
    with pytest.raises(ValueError, match=match):
        CASGDRegressor(comm=SELF).fit(X, y, sample_weight=weights)
    with pytest.raises(ValueError):
        fit(X, y, model="linear", b=4, s=2, sample_weight=weights, comm=SELF)


# --------------------------------------------------------------------------------------
# multiclass, Poisson targets, scores
# --------------------------------------------------------------------------------------


def test_multiclass_is_one_vs_rest_trained_jointly():
    X, y = load_iris(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    labels = np.array(["setosa", "versicolor", "virginica"])[y]
    kw = dict(s=4, b=10, lr=0.5, max_iter=5, tol=None, recipe="fp64", comm=SELF)
    clf = CASGDClassifier(**kw).fit(X, labels)
    np.testing.assert_array_equal(clf.classes_, ["setosa", "versicolor", "virginica"])
    assert clf.coef_.shape == (3, 4) and clf.intercept_.shape == (3,)
    proba = clf.predict_proba(X)
    assert proba.shape == (150, 3)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-12)
    np.testing.assert_array_equal(clf.predict(X), clf.classes_[proba.argmax(axis=1)])
    assert clf.score(X, labels) > 0.85
    # Each class's row is the binary fit of that class against the rest, same sequence.
    for k, name in enumerate(clf.classes_):
        binary = CASGDClassifier(**kw).fit(X, labels == name)
        assert rel(clf.coef_[k], binary.coef_[0]) <= 1e-12
        assert clf.intercept_[k] == pytest.approx(binary.intercept_[0], rel=1e-12, abs=1e-14)
    # One shared Gram: the same AllReduce count as one binary problem.
    assert clf.result_.stats["allreduce_calls"] == binary.result_.stats["allreduce_calls"]


def test_joint_outputs_equal_separate_fits_in_fit():
    X, y = make_glm_data("logistic", 256, 10, seed=5, dtype="float64")
    Y = np.column_stack([y, 1 - y, (X[:, 0] > 0).astype(float)])
    kw = dict(
        model="logistic", b=8, lr=0.5, max_iter=2, tol=None, lam=0.02, recipe="fp64", comm=SELF
    )
    for solver, s in (("casgd", 5), ("sgd", 1)):
        joint = fit(X, Y, solver=solver, s=s, **kw)
        assert joint.coef.shape == (10, 3)
        separate = [fit(X, Y[:, k], solver=solver, s=s, **kw) for k in range(3)]
        for k in range(3):
            assert rel(joint.coef[:, k], separate[k].coef) <= 1e-12
        assert joint.final_loss == pytest.approx(sum(r.final_loss for r in separate), rel=1e-12)


def test_one_class_is_a_clear_error():
    X = np.random.default_rng(0).normal(size=(20, 3))
    with pytest.raises(ValueError, match="one class"):
        CASGDClassifier(comm=SELF).fit(X, np.ones(20))
    with pytest.raises(ValueError, match="Unknown label type"):
        CASGDClassifier(comm=SELF).fit(X, np.linspace(0, 1, 20))


def test_poisson_accepts_non_integer_targets_and_rejects_negative_ones():
    X, y = make_glm_data("poisson", 512, 6, seed=1, dtype="float64")
    rates = y + 0.25  # non-negative, not integers
    reg = CASGDRegressor(model="poisson", max_iter=10, tol=None, comm=SELF).fit(X, rates)
    assert np.all(reg.predict(X) > 0) and 0 < reg.score(X, rates) <= 1
    with pytest.raises(ValueError, match="non-negative"):
        CASGDRegressor(model="poisson", comm=SELF).fit(X, rates - 1)


def test_score_of_every_model_matches_scikit_learn_metrics():
    rng = np.random.default_rng(0)
    w = rng.uniform(0.5, 2.0, 512)
    for model in ("linear", "poisson", "logistic"):
        X, y = make_glm_data(model, 512, 6, seed=2, dtype="float64")
        est = GLM(model=model, comm=SELF).fit(X, y)
        pred = est.predict(X)
        metric = {
            "linear": lambda t, p, sw: r2_score(t, p, sample_weight=sw),
            "poisson": lambda t, p, sw: d2_tweedie_score(t, p, power=1, sample_weight=sw),
            "logistic": lambda t, p, sw: d2_log_loss_score(
                t, np.column_stack([1 - p, p]), sample_weight=sw
            ),
        }[model]
        for sw in (None, w):
            assert est.score(X, y, sample_weight=sw) == pytest.approx(
                metric(y, pred, sw), rel=1e-9
            ), model
        assert 0 < est.score(X, y) < 1


# --------------------------------------------------------------------------------------
# defaults, parameters, errors
# --------------------------------------------------------------------------------------


def test_defaults_work_on_small_data_and_any_scale():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(5, 3))
    reg = CASGDRegressor(b=32, s=16, comm=SELF).fit(X, X @ [1.0, 2.0, 3.0])
    assert (reg.b_, reg.s_) == (5, 1)  # b = 32 and s = 16 clipped to 5 rows
    X, y = make_glm_data("linear", 100, 4, seed=0, dtype="float64")
    reg = CASGDRegressor(b=32, s=16, comm=SELF).fit(X, y)
    assert (reg.b_, reg.s_) == (32, 3)
    # "auto": the critical batch of the data (intercept column included) and, on one
    # process, s = 1: there is no communication to save.
    reg = CASGDRegressor(comm=SELF).fit(X, y)
    assert reg.b_ == auto_batch(np.hstack([X, np.ones((100, 1))])) and reg.s_ == 1
    assert 1 <= reg.b_ <= 100
    # lr="auto" adapts to the scale of the features: the same fit on 1000 X converges too.
    steps = []
    Xs, ys = make_glm_data("linear", 1000, 8, seed=1, dtype="float64")
    for scale in (1.0, 1000.0):
        reg = CASGDRegressor(max_iter=20, tol=None, comm=SELF).fit(scale * Xs, ys)
        assert reg.score(scale * Xs, ys) > 0.9, scale
        steps.append(reg.lr_)
    assert steps[1] < 1e-4 * steps[0]
    assert CASGDRegressor(lr=0.05, comm=SELF).fit(X, y).lr_ == 0.05


def test_not_fitted_and_init_only_stores():
    X, y = make_glm_data("linear", 64, 3, seed=0, dtype="float64")
    for est in (CASGDClassifier(), CASGDRegressor(), GLM()):
        with pytest.raises(NotFittedError):
            est.predict(X)
    bad = CASGDRegressor(model="logistic", s=-1, lr="fast")  # stored, not checked
    assert bad.get_params()["s"] == -1
    with pytest.raises(ValueError, match="linear, poisson"):
        bad.set_params(comm=SELF).fit(X, y)
    with pytest.raises(ValueError, match="lr must be"):
        CASGDRegressor(lr="fast", comm=SELF).fit(X, y)
    with pytest.raises(TypeError, match="communicator"):
        CASGDRegressor(comm="world").fit(X, y)
    clf = CASGDClassifier(comm=SELF).fit(X, y > 0)
    with pytest.raises(ValueError, match="features"):
        clf.predict(X[:, :2])


def test_sparse_input_equals_dense():
    X, y = make_glm_data("logistic", 256, 8, seed=3, dtype="float64")
    X[np.abs(X) < 0.2] = 0.0
    kw = dict(s=4, b=8, lr=0.5, max_iter=2, tol=None, recipe="fp64", comm=SELF)
    dense = CASGDClassifier(**kw).fit(X, y)
    sparse = CASGDClassifier(**kw).fit(sp.csr_matrix(X), y)
    assert rel(sparse.coef_, dense.coef_) <= 1e-12
    np.testing.assert_array_equal(sparse.predict(sp.csr_matrix(X)), dense.predict(X))


def test_a_user_communicator_is_shared_by_clones():
    comm = SELF.Dup()
    try:
        est = CASGDRegressor(max_iter=2, tol=None, comm=comm)
        twin = clone(est)
        assert twin.comm is comm and twin.get_params()["max_iter"] == 2
        X, y = make_glm_data("linear", 90, 3, seed=0, dtype="float64")
        scores = cross_val_score(est, X, y, cv=3)
        assert np.isfinite(scores).all()
    finally:
        comm.Free()


def test_estimator_reports_divergence_with_advice():
    X, y = load_diabetes(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    # Full-batch gradient descent with too large a step: stopped with advice, not run on.
    too_big = CASGDRegressor(lr=1.5, b=10**6, max_iter=200, tol=None, recipe="fp64", comm=SELF)
    with pytest.raises(DivergenceError, match="lr = 0.75 or smaller"):
        too_big.fit(X, y)
    ok = CASGDRegressor(b=10**6, max_iter=200, tol=None, recipe="fp64", comm=SELF).fit(
        X, y
    )  # lr="auto"
    assert ok.score(X, y) > 0.45


# --------------------------------------------------------------------------------------
# MPI: the same object trains distributed
# --------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_mpi_fit_is_identical_on_every_rank_and_matches_one_process():
    comm = MPI.COMM_WORLD
    X, y = load_iris(return_X_y=True)
    X = StandardScaler().fit_transform(X)  # 4 features + intercept: up to 5 ranks
    if comm.size > X.shape[1] + 1:
        X = np.hstack([X, np.random.default_rng(0).normal(size=(150, comm.size))])
    w = np.random.default_rng(1).uniform(0.5, 2.0, 150)
    cases = [
        (CASGDClassifier(s=4, b=10, max_iter=3, tol=None, recipe="fp64"), y),
        (CASGDRegressor(s=4, b=10, max_iter=3, tol=None, recipe="fp64"), X[:, 0] * 2 + y),
        (CASGDRegressor("poisson", s=4, b=10, max_iter=3, tol=None, recipe="fp64"), y + 0.5),
    ]
    for est, target in cases:
        dist = clone(est).fit(X, target, sample_weight=w)  # COMM_WORLD: distributed
        single = clone(est).set_params(comm=MPI.COMM_SELF).fit(X, target, sample_weight=w)
        state = (dist.coef_.tobytes(), np.asarray(dist.intercept_).tobytes(), dist.lr_)
        assert len(set(comm.allgather(state))) == 1, est
        assert dist.result_.config["P"] == comm.size
        both = np.append(dist.coef_, dist.intercept_)
        assert rel(both, np.append(single.coef_, single.intercept_)) <= 1e-12, est


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_mpi_bad_input_on_one_rank_stops_every_rank():
    comm = MPI.COMM_WORLD
    X, y = make_glm_data("linear", 64, 8, seed=0, dtype="float64")
    Xr = X.copy()
    if comm.rank == comm.size - 1:
        Xr[3, 2] = np.nan
    with pytest.raises(ValueError, match="NaN" if comm.rank == comm.size - 1 else "rank"):
        CASGDRegressor().fit(Xr, y)
    # All ranks still in step: a good fit afterwards completes everywhere.
    assert np.isfinite(CASGDRegressor(max_iter=1, tol=None).fit(X, y).coef_).all()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_mpi_divergence_stops_every_rank_together():
    X, y = load_diabetes(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    est = CASGDRegressor(lr=1.5, b=10**6, max_iter=200, tol=None, recipe="fp64")
    with pytest.raises(DivergenceError, match="10 times its best"):
        est.fit(X, y)
    MPI.COMM_WORLD.Barrier()  # every rank got here: none is left in an AllReduce


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        (np.ones((20, 1)), "one weight per row"),
        (np.ones(19), "one weight per row"),
        (-np.ones(20), "negative"),
        (np.zeros(20), "zero for every row"),
        (np.full(20, np.nan), "NaN"),
    ],
)
def test_bad_sample_weight_is_refused_before_fitting(weights: np.ndarray, match: str) -> None:
    """Bad weights raise ValueError with a message naming the problem, and leave the
    estimator unfitted."""
    X, y = make_glm_data("logistic", 20, 3, seed=0, dtype="float64")
    est = CASGDClassifier(max_iter=1, tol=None)
    with pytest.raises(ValueError, match=match):
        est.fit(X, y, sample_weight=weights)
    assert not hasattr(est, "coef_")


def test_scalar_sample_weight_is_every_row() -> None:
    """A number weighs every row alike: the same model as no weights at all (the loss's
    weighted mean does not change when every weight is scaled)."""
    X, y = make_glm_data("logistic", 40, 3, seed=1, dtype="float64")
    a = CASGDClassifier(max_iter=2, tol=None).fit(X, y).coef_
    b = CASGDClassifier(max_iter=2, tol=None).fit(X, y, sample_weight=2.5).coef_
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-9)


# --------------------------------------------------------------------------------------
# Convergence with the defaults (scikit-learn's SGD conventions)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("load", [load_iris, load_digits, load_wine, load_breast_cancer])
def test_defaults_match_logistic_regression_under_cross_validation(load):
    # 5-fold CV with a StandardScaler: the defaults (b, lr, s "auto"; tol 1e-3) reach
    # LogisticRegression's accuracy within 0.02, without a ConvergenceWarning.
    X, y = load(return_X_y=True)
    cv = StratifiedKFold(5, shuffle=True, random_state=0)
    ref = cross_val_score(make_pipeline(StandardScaler(), LogisticRegression()), X, y, cv=cv)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        pipe = make_pipeline(StandardScaler(), CASGDClassifier(comm=SELF))
        ours = cross_val_score(pipe, X, y, cv=cv)
    assert ours.mean() >= ref.mean() - 0.02, (ours.mean(), ref.mean())


def test_max_iter_ends_the_fit_with_a_convergence_warning():
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    with pytest.warns(ConvergenceWarning, match="max_iter=2"):
        clf = CASGDClassifier(max_iter=2, comm=SELF).fit(X, y)
    assert clf.n_iter_ == 2 and clf.stop_reason_ == "max_iter"
    # tol=None: exactly max_iter epochs, and no warning (nothing was asked to converge).
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        fixed = CASGDClassifier(max_iter=3, tol=None, comm=SELF).fit(X, y)
    assert fixed.n_iter_ == 3 and fixed.stop_reason_ == "max_iter"
    # The defaults stop by themselves, well before max_iter.
    free = CASGDClassifier(comm=SELF).fit(X, y)
    assert free.stop_reason_ == "converged" and free.n_iter_ < 1000
    losses = free.result_.epoch_losses()
    assert len(losses) == free.n_iter_ and losses[-1] < losses[0]


def test_early_stopping_holds_out_a_stratified_share():
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    clf = CASGDClassifier(early_stopping=True, validation_fraction=0.2, comm=SELF).fit(X, y)
    res = clf.result_
    assert clf.stop_reason_ == "no_validation_improvement"
    assert res.config["m_train"] == 569 - 113  # 42 of 212 and 71 of 357 held out
    assert 0.9 < res.val_score <= 1.0 and all("val_score" in h for h in res.history)
    with pytest.raises(ValueError, match="validation_fraction"):
        CASGDClassifier(early_stopping=True, validation_fraction=1.5, comm=SELF).fit(X, y)


def test_epochs_still_works_with_a_deprecation_warning():
    X, y = make_glm_data("linear", 200, 4, seed=0, dtype="float64")
    with pytest.warns(FutureWarning, match="epochs=3 is deprecated"):
        old = CASGDRegressor(epochs=3, comm=SELF).fit(X, y)
    new = CASGDRegressor(max_iter=3, tol=None, comm=SELF).fit(X, y)
    assert old.n_iter_ == 3
    np.testing.assert_array_equal(old.coef_, new.coef_)


def test_early_stopping_on_tiny_classes_keeps_the_batch_within_the_training_rows():
    # Three classes of five rows, 10%: one row of each class is held out (at least one),
    # so twelve rows train; b="auto" is clipped to them.
    rng = np.random.default_rng(0)
    X = rng.normal(size=(15, 3))
    y = np.repeat([0, 1, 2], 5)
    clf = CASGDClassifier(early_stopping=True, b=10**6, comm=SELF).fit(X, y)
    assert clf.result_.config["m_train"] == 12 and clf.b_ == 12
