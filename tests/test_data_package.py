"""The data package: every public name where the docs put it, one topic per module, and
label semantics in ``optcc_mpi.glm.labels``."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import optcc_mpi.data as data
from optcc_mpi.errors import DatasetError
from optcc_mpi.glm import labels

# Every optcc_mpi.data name the docs, the CLI, the trainer and the tests use.
PUBLIC = [
    "LAYOUT_VERSION", "LAYOUT_MINOR", "CSC_COPY", "TASKS", "DTYPES", "SHIPPED", "SYNTH_KINDS",
    "SYNTH_VERSION", "DEFAULT_SYNTH", "DatasetError", "Partition", "column_block", "chunk_shape",
    "load_partition", "load_dense", "write_dataset", "add_csc", "convert_svmlight", "synth",
    "synth_arrays", "default_dataset", "data_home", "shipped", "validate", "check_labels",
    "infer_task",
]  # fmt: skip


def test_public_names_are_importable_from_optcc_mpi_data() -> None:
    for name in PUBLIC:
        assert hasattr(data, name), name
    assert set(PUBLIC) == set(data.__all__)
    assert set(PUBLIC) <= set(dir(data))
    assert data.DatasetError is DatasetError
    assert data.check_labels is labels.check_labels and data.infer_task is labels.infer_task
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        data.nope  # noqa: B018


def test_importing_data_does_not_import_the_trainer_or_mpi() -> None:
    code = (
        "import sys, optcc_mpi.data as d; d.column_block(10, 2, 0); "
        "print('mpi4py' in sys.modules, 'optcc_mpi.glm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_label_scan_matches_check_labels_and_infer_task() -> None:
    cases = [[0, 1, 1], [-1, 1], [0, 3, 7], [0.5, -2], [1, 1], [-1, 0, 1], [2.0, np.nan]]
    for y in cases:
        scan = labels.LabelScan()
        scan.add(np.array(y[:1], float), np.array([1]))
        scan.add(np.array(y[1:], float), np.arange(2, len(y) + 1))  # in two pieces
        assert scan.task() == labels.infer_task(y), y
    scan = labels.LabelScan()
    scan.add(np.array([-1.0, 0, 1]), np.array([10, 20, 30]))
    with pytest.raises(
        DatasetError, match="f: task 'binary' .*line 10 has label -1, line 20 has label 0"
    ):
        scan.encoding("binary", "f")
    assert scan.encoding("regression", "f") is None
    with pytest.raises(DatasetError, match="line 10 has -1"):
        scan.encoding("counts", "f")
    assert np.array_equal(labels.binary_to_01(np.array([-1.0, 1, 1])), [0, 1, 1])
    assert np.array_equal(labels.binary_to_01(np.array([0.0, 2])), [0, 2])  # left for check
