"""HDF5 datasets for CA-SGD: the file layout, partitioned loading, converters and generators.

A dataset is one HDF5 file holding a design matrix ``X`` (m samples by n features) and a label
vector ``y``; the layout (version 1.1) is specified in ``docs/data.md``. CA-SGD splits ``X``
by columns (1D block-column layout): rank p of P owns the features ``column_block(n, P, p)``
for all rows, so :func:`load_partition` reads only that column block, with plain serial h5py
(no parallel HDF5 needed): about ``1/P`` of a dense ``X``, or of a sparse one through its CSC
copy, and ``m * n / P`` elements of memory per rank.

Modules
-------
``layout``      format constants and versions, dtypes, :func:`column_block`, :func:`chunk_shape`
``validation``  structure checks (headers, sparse arrays), corrupt-chunk errors
``reading``     :func:`validate`, :class:`Partition`, :func:`load_partition`, :func:`load_dense`
``writing``     :func:`write_dataset`, :func:`add_csc`, filters and checksums, the CSC copy
``svmlight``    :func:`convert_svmlight`, the streaming LIBSVM converter
``synthetic``   :func:`synth`, :func:`synth_arrays`
``shipped``     :func:`default_dataset`, :func:`shipped`, :func:`data_home`

Label domains (:func:`check_labels`, :func:`infer_task`) live in :mod:`optcc_mpi.labels`,
below this package and :mod:`optcc_mpi.glm`, which both apply them; they are importable from
here too. This package never imports the trainer (nor mpi4py).

Public API
----------
``column_block(n_features, size, rank)``  the column slice rank ``rank`` of ``size`` owns
``Partition``                            one rank's block of ``X``, the labels and metadata
``load_partition(path, comm=..., ...)``  read this rank's column block
``load_dense(path)``                     read the whole ``X`` and ``y`` on one process
``write_dataset(path, X, y, ...)``       write in-memory arrays in the layout
``add_csc(path)``                        add the CSC copy to a CSR file of layout 1.0
``convert_svmlight(src, dst, ...)``      stream LIBSVM/svmlight text to HDF5, bounded memory
``synth(kind, rows, cols, seed, path)``  write a synthetic GLM dataset, bounded memory
``synth_arrays(kind, rows, cols, seed)`` the same synthetic data, in memory
``default_dataset(comm=None)``           the synthetic set ``train`` uses by default (cached)
``shipped(name)``                        a real dataset shipped in the repository's ``data/``
``validate(path, ...)``                  check a file's structure (and optionally its values)
``check_labels(y, task)``                check and normalise labels for a GLM task
``DatasetError``                         raised for any bad input (a ``ValueError``)
"""

from __future__ import annotations

from optcc_mpi.errors import DatasetError
from optcc_mpi.labels import check_labels, infer_task

from .layout import (
    CSC_COPY,
    DTYPES,
    LAYOUT_MINOR,
    LAYOUT_VERSION,
    TASKS,
    chunk_shape,
    column_block,
)
from .reading import Partition, load_dense, load_partition, validate
from .shipped import DEFAULT_SYNTH, SHIPPED, data_home, default_dataset, shipped
from .svmlight import convert_svmlight
from .synthetic import SYNTH_KINDS, SYNTH_VERSION, synth, synth_arrays
from .writing import add_csc, write_dataset

__all__ = [
    "LAYOUT_VERSION",
    "LAYOUT_MINOR",
    "CSC_COPY",
    "TASKS",
    "DTYPES",
    "SHIPPED",
    "SYNTH_KINDS",
    "SYNTH_VERSION",
    "DEFAULT_SYNTH",
    "DatasetError",
    "Partition",
    "column_block",
    "chunk_shape",
    "load_partition",
    "load_dense",
    "write_dataset",
    "add_csc",
    "convert_svmlight",
    "synth",
    "synth_arrays",
    "default_dataset",
    "data_home",
    "shipped",
    "validate",
    "check_labels",
    "infer_task",
]
