"""The data package: every public name where the docs put it, one topic per module, and
label semantics in ``optcc_mpi.labels``, below both the data package and the trainer."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import optcc_mpi.data as data
from optcc_mpi import labels
from optcc_mpi.errors import DatasetError

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


def _imported(path: Path, package: str) -> set[str]:
    """Absolute names of the modules ``path`` imports, anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_data_never_imports_glm_and_labels_sit_below_both() -> None:
    root = Path(data.__file__).parent
    for path in sorted(root.glob("*.py")):
        names = _imported(path, "optcc_mpi.data")
        assert not any(n == "optcc_mpi.glm" or n.startswith("optcc_mpi.glm.") for n in names), (
            path.name
        )
        assert "importlib" not in names, path.name  # no import resolved at run time
    below = {n for n in _imported(Path(labels.__file__), "optcc_mpi") if n.startswith("optcc_")}
    assert below <= {"optcc_mpi.errors", "optcc_mpi.errors.DatasetError"}, below
    # Where the names were importable before, they still are, as the same objects.
    from optcc_mpi.glm import labels as glm_labels
    from optcc_mpi.glm import models

    for name in labels.__all__:
        assert getattr(glm_labels, name) is getattr(labels, name), name
    assert data.TASKS is labels.TASKS and data.layout.TASKS is labels.TASKS
    assert models.check_labels is labels.check_labels


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
