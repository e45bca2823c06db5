"""Make the real datasets shipped in data/ (run once; the .h5 files are committed).

    .venv/bin/python -m pip install statsmodels -c requirements.txt   # only for this script
    .venv/bin/python data/make_datasets.py

Sources: scikit-learn's bundled breast cancer and diabetes sets, and statsmodels' bundled
RAND Health Insurance Experiment extract (randhie). Nothing is downloaded.

Every feature is standardised to a z-score over all rows, ``(x - mean) / std`` with the
population standard deviation (ddof = 0), because SGD needs comparable feature scales and
the raw features differ by up to four orders of magnitude (breast cancer: area ~ 10^3,
smoothness ~ 10^-1). The means and standard deviations are stored as datasets
``feature_mean`` and ``feature_scale``, so ``X * feature_scale + feature_mean`` gives the raw
values back. Labels are stored raw. The output is deterministic (no randomness involved).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from optcc_mpi.data import write_dataset

HERE = Path(__file__).resolve().parent

STANDARDIZATION = (
    "z-scores over all rows: (x - mean) / std, population std (ddof=0); raw values = "
    "X * feature_scale + feature_mean"
)


def standardize(X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return z-scored X and the column means and standard deviations used."""
    X = np.asarray(X, dtype=np.float64)
    mean = X.mean(axis=0)
    scale = X.std(axis=0)
    if np.any(scale == 0):
        raise SystemExit(f"constant column(s) {np.flatnonzero(scale == 0)}: cannot standardise")
    return (X - mean) / scale, mean, scale


def write(name: str, X: np.ndarray, y: np.ndarray, names: list[str], **meta: str) -> None:
    Z, mean, scale = standardize(X)
    path = write_dataset(
        HERE / f"{name}.h5",
        Z,
        y,
        dtype="float64",
        compression="gzip",
        extra={"feature_mean": mean, "feature_scale": scale},
        feature_names=[str(n) for n in names],
        standardized=True,
        standardization=STANDARDIZATION,
        made_by="data/make_datasets.py",
        **meta,
    )
    print(f"{path.relative_to(HERE.parent)}: {Z.shape[0]} x {Z.shape[1]}, {path.stat().st_size} B")


def main() -> int:
    import sklearn
    from sklearn.datasets import load_breast_cancer, load_diabetes

    try:
        import statsmodels
        import statsmodels.api as sm
    except ImportError:
        print(
            "statsmodels is needed: .venv/bin/python -m pip install statsmodels "
            "-c requirements.txt",
            file=sys.stderr,
        )
        return 1

    bc = load_breast_cancer()
    write(
        "breast_cancer",
        bc.data,
        bc.target,
        list(bc.feature_names),
        task="binary",
        title="Breast Cancer Wisconsin (Diagnostic)",
        target_name="benign (1) vs malignant (0)",
        origin=(
            "UCI Machine Learning Repository, Breast Cancer Wisconsin (Diagnostic), by W. H. "
            "Wolberg, W. N. Street, O. L. Mangasarian (1995); copy bundled with scikit-learn "
            f"{sklearn.__version__} (sklearn.datasets.load_breast_cancer)"
        ),
        licence=(
            "CC BY 4.0 (UCI Machine Learning Repository); redistributed in scikit-learn "
            "(BSD-3-Clause)"
        ),
        citation=(
            "W. N. Street, W. H. Wolberg, O. L. Mangasarian, Nuclear feature extraction for "
            "breast tumor diagnosis, IS&T/SPIE Electronic Imaging 1905, 861-870, 1993"
        ),
    )

    db = load_diabetes(scaled=False)
    write(
        "diabetes",
        db.data,
        db.target,
        list(db.feature_names),
        task="regression",
        title="Diabetes (Efron, Hastie, Johnstone, Tibshirani 2004)",
        target_name="disease progression one year after baseline",
        origin=(
            "Data of Efron, Hastie, Johnstone, Tibshirani, Least Angle Regression, Annals of "
            "Statistics 32(2), 407-499, 2004; unscaled copy bundled with scikit-learn "
            f"{sklearn.__version__} (sklearn.datasets.load_diabetes(scaled=False))"
        ),
        licence=(
            "no licence stated by the original authors; redistributed in scikit-learn "
            "(BSD-3-Clause)"
        ),
    )

    rh = sm.datasets.randhie.load_pandas()
    write(
        "randhie",
        rh.exog.to_numpy(),
        rh.endog.to_numpy(),
        list(rh.exog.columns),
        task="counts",
        title="RAND Health Insurance Experiment (extract)",
        target_name="mdvis: number of outpatient visits to a medical doctor",
        origin=(
            "RAND Corporation Health Insurance Experiment, extract used in Cameron and "
            "Trivedi, Microeconometrics: Methods and Applications (2005); copy bundled with "
            f"statsmodels {statsmodels.__version__} (statsmodels.datasets.randhie)"
        ),
        licence="public domain (statsmodels: 'This is in the public domain.')",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
