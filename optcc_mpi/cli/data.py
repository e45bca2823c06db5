"""``optcc-mpi data``: make, convert and inspect HDF5 datasets for CA-SGD training.

Sub-commands: ``convert`` (LIBSVM/svmlight text to HDF5), ``synth`` (synthetic GLM data),
``info`` (describe and check a file), ``add-csc`` (give an old CSR file its CSC copy) and
``list`` (shipped datasets and the default one). The work is done by :mod:`optcc_mpi.data`,
imported only when a sub-command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from optcc_mpi import data

_RAW = argparse.RawDescriptionHelpFormatter

DATA_EPILOG = """\
File layout 1.1 (docs/data.md): X dense (chunked along columns) or CSR (group X with
indptr/indices/data) plus its column-compressed copy X_csc, y float64, file attributes task,
origin, licence, and a fletcher32 checksum on every chunk. Each training rank reads only its
column block (about 1/P of X, from X_csc for sparse data), so any file written here trains on
any number of ranks up to its number of features. Files of layout 1.0 still load.

examples:
  optcc-mpi data convert HIGGS.xz higgs.h5                  # stream LIBSVM text to HDF5
  optcc-mpi data synth --kind poisson --rows 100000 --cols 512 --seed 1 pois.h5
  optcc-mpi data info higgs.h5                              # shape, dtype, task, licence
  optcc-mpi data info rcv1.h5 --check                       # read and check every value
  optcc-mpi data list                                       # shipped real datasets
"""

CONVERT_EPILOG = """\
The text is read twice: the first pass parses and checks every line and counts rows,
features, nonzeros and labels; the second writes X in column-friendly chunks. A line that
does not parse, or holds a value the stored dtype cannot represent (1e39 overflows float32
and bfloat16), stops the conversion with its line number and exit status 2, before anything
is written. Output appears only when complete.

Sparse (CSR) output also gets X_csc, a column-compressed copy from which each training rank
reads only its columns; it doubles the sparse bytes on disk and is built through temporary
spill files beside OUT.h5 (as large as the copy, removed at the end). --no-csc skips it.

Memory stays bounded whatever the file size: about 220 MB resident for 50, 100 and 200 MB of
sparse text alike (measured, docs/data.md), i.e. the interpreter, one 8 MiB text block being
parsed, one 32 MiB column band of the copy, and 16 bytes per feature; dense output adds one
row of chunks (at most 64 MiB).

Task detection: labels all in {0,1} or all in {-1,+1} -> binary (stored as {0,1});
non-negative integers -> counts; anything else -> regression. Override with --task.
Index base: zero-based if any index 0 occurs, else one-based (LIBSVM's convention).

examples:
  optcc-mpi data convert epsilon_normalized.bz2 epsilon.h5 --dtype bfloat16
  optcc-mpi data convert rcv1.svm rcv1.h5 --layout csr --licence "see LIBSVM site"
  optcc-mpi data convert test.svm test.h5 --n-features 2000   # match the training set
  optcc-mpi data convert counts.svm counts.h5 --task counts --zero-based yes
"""

SYNTH_EPILOG = """\
Generator (ours): X_ij ~ N(0, 1/n), w* ~ N(0, I) stored as dataset w_true, and
  logistic: y ~ Bernoulli(sigmoid(X w*))   (task binary)
  linear:   y = X w* + 0.1 N(0, 1)         (task regression)
  poisson:  y ~ Poisson(exp(0.5 X w*))     (task counts)
The file depends only on kind, rows, cols, seed and dtype; it is written in row chunks, so
any size fits in memory.

examples:
  optcc-mpi data synth --kind logistic --rows 1000000 --cols 1024 --seed 0 big.h5
  optcc-mpi data synth --kind linear --rows 5000 --cols 64 --seed 3 --dtype float64 lin.h5
"""

INFO_EPILOG = """\
FILE may also name a shipped dataset (breast_cancer, diabetes, randhie) or 'default' (the
synthetic set train uses, created on first use).

Without --check only the structure is read (datasets, shapes, types, version). --check reads
every value once, in bounded memory: X and y finite, labels in the task's domain, CSR arrays
well formed (indptr from 0 to nnz and never decreasing, indices in range and strictly
increasing within a row), the CSC copy holding exactly the entries of X, and every chunk's
checksum. Any problem exits with status 2 and names the file, dataset and position.

examples:
  optcc-mpi data info data/randhie.h5
  optcc-mpi data info breast_cancer
  optcc-mpi data info big.h5 --check        # also read every value: NaN/inf, label domain
  optcc-mpi data info big.h5 --ranks 64     # would 64 ranks fit? show rank 0's block
"""


ADD_CSC_EPILOG = """\
Files converted before layout 1.1 store a sparse X as CSR only, so every training rank reads
all of X/indices. This reads X twice in slabs, checking it, spills its entries by column band
to temporary files beside FILE.h5 and writes the copy under a temporary name, renamed into
place at the end; memory stays bounded. A file that already has the copy is left alone.

examples:
  optcc-mpi data add-csc rcv1.h5
  optcc-mpi data info rcv1.h5 --check       # the copy holds exactly the entries of X
"""


def register(subparsers: Any) -> None:
    """Add the ``data`` command and its sub-commands to ``subparsers``."""
    p = subparsers.add_parser(
        "data",
        help="make, convert and inspect HDF5 datasets (LIBSVM, synthetic, shipped)",
        description="Datasets for CA-SGD training: convert LIBSVM/svmlight text to HDF5, "
        "write synthetic GLM data, and describe dataset files.",
        epilog=DATA_EPILOG,
        formatter_class=_RAW,
    )
    p.set_defaults(func=lambda args: _usage(p))
    sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")

    c = sub.add_parser(
        "convert",
        help="stream LIBSVM/svmlight text (optionally .gz/.bz2/.xz) into an HDF5 dataset",
        description="Convert LIBSVM/svmlight text to an HDF5 dataset in bounded memory.",
        epilog=CONVERT_EPILOG,
        formatter_class=_RAW,
    )
    c.add_argument("src", metavar="IN.svm", help="svmlight text file (.gz, .bz2, .xz read too)")
    c.add_argument("dst", metavar="OUT.h5", help="HDF5 file to write")
    c.add_argument(
        "--layout",
        choices=("auto", "dense", "csr"),
        default="auto",
        help="X storage: dense, CSR, or auto = dense when >= 25%% of entries are nonzero "
        "(default: auto)",
    )
    c.add_argument(
        "--dtype",
        choices=("float32", "float64", "bfloat16"),
        default="float32",
        help="stored type of X; bfloat16 rounds to nearest even; values beyond the type's "
        "range are rejected with their line number (default: float32)",
    )
    c.add_argument(
        "--task",
        choices=("binary", "regression", "counts"),
        help="GLM task of the labels (default: detected from the labels)",
    )
    c.add_argument(
        "--zero-based",
        choices=("auto", "yes", "no"),
        default="auto",
        help="whether feature index 0 is the first column (default: auto)",
    )
    c.add_argument(
        "--n-features",
        type=int,
        metavar="N",
        help="number of columns, if more than the largest index (e.g. a test split)",
    )
    c.add_argument(
        "--compression",
        choices=("none", "gzip", "lzf"),
        default="none",
        help="HDF5 compression filter (default: none, fastest to read)",
    )
    c.add_argument(
        "--chunk-cols",
        type=int,
        metavar="W",
        help="chunk width in columns for dense X (default: n/64 clipped to 1..8)",
    )
    c.add_argument(
        "--no-csc",
        dest="csc",
        action="store_false",
        help="for CSR output, do not write the CSC copy X_csc (half the disk; every training "
        "rank then reads all of X/indices)",
    )
    c.add_argument(
        "--no-checksum",
        dest="checksum",
        action="store_false",
        help="do not store fletcher32 checksums (they cost 4 bytes per chunk and are checked "
        "on every read)",
    )
    c.add_argument("--origin", help="provenance to record (default: the source file name)")
    c.add_argument("--licence", help="licence of the data, recorded in the file")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=_convert)

    s = sub.add_parser(
        "synth",
        help="write a synthetic logistic, linear or Poisson dataset",
        description="Write a synthetic GLM dataset, deterministic for a seed.",
        epilog=SYNTH_EPILOG,
        formatter_class=_RAW,
    )
    s.add_argument(
        "--kind",
        choices=("logistic", "linear", "poisson"),
        required=True,
        help="the model the labels follow: 0/1 labels, real values, or counts",
    )
    s.add_argument("--rows", type=int, required=True, metavar="M", help="samples")
    s.add_argument("--cols", type=int, required=True, metavar="N", help="features")
    s.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default: 0)")
    s.add_argument(
        "--dtype",
        choices=("float32", "float64", "bfloat16"),
        default="float32",
        help="stored type of X (default: float32)",
    )
    s.add_argument(
        "--compression", choices=("none", "gzip", "lzf"), default="none", help="HDF5 filter"
    )
    s.add_argument(
        "--no-checksum",
        dest="checksum",
        action="store_false",
        help="do not store fletcher32 checksums",
    )
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.add_argument("path", metavar="OUT.h5", help="HDF5 file to write")
    s.set_defaults(func=_synth)

    i = sub.add_parser(
        "info",
        help="print a dataset's shape, dtype, layout, task, origin and licence",
        description="Describe a dataset file.",
        epilog=INFO_EPILOG,
        formatter_class=_RAW,
    )
    i.add_argument("file", metavar="FILE", help="HDF5 dataset, shipped name, or 'default'")
    i.add_argument(
        "--check",
        action="store_true",
        help="read every value: finite X and y, labels fit the task, sparse structure, CSC "
        "copy matches X, checksums",
    )
    i.add_argument("--ranks", type=int, metavar="P", help="check the file splits over P ranks")
    i.set_defaults(func=_info)

    a = sub.add_parser(
        "add-csc",
        help="add the CSC copy X_csc to a CSR file that lacks it (files of layout 1.0)",
        description="Add the column-compressed copy X_csc to a CSR dataset file, so that each "
        "training rank reads only its columns.",
        epilog=ADD_CSC_EPILOG,
        formatter_class=_RAW,
    )
    a.add_argument("file", metavar="FILE.h5", help="dataset file with a CSR X")
    a.add_argument(
        "--no-checksum", dest="checksum", action="store_false", help="no checksums on the copy"
    )
    a.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    a.set_defaults(func=_add_csc)

    ls = sub.add_parser(
        "list",
        help="list the shipped real datasets and the default synthetic one",
        description="List the real datasets shipped in data/ and the default synthetic set.",
        formatter_class=_RAW,
    )
    ls.set_defaults(func=_list)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _compression(value: str) -> str | None:
    return None if value == "none" else value


def _convert(args: argparse.Namespace) -> int:

    zero_based = {"auto": "auto", "yes": True, "no": False}[args.zero_based]
    summary = data.convert_svmlight(
        args.src,
        args.dst,
        dtype=args.dtype,
        layout=args.layout,
        task=args.task,
        zero_based=zero_based,
        n_features=args.n_features,
        progress=not args.quiet,
        compression=_compression(args.compression),
        checksum=args.checksum,
        csc=args.csc,
        chunk_cols=args.chunk_cols,
        origin=args.origin,
        licence=args.licence,
    )
    enc = f", labels {summary['label_encoding']}" if summary["label_encoding"] else ""
    layout = summary["layout"] + (" with CSC copy" if summary["csc"] else "")
    print(
        f"wrote {summary['path']}: {summary['rows']} x {summary['n_features']} "
        f"{layout} {summary['dtype']}, {summary['nnz']} nonzeros "
        f"(density {summary['density']:.3g}), task {summary['task']}{enc}, "
        f"{'zero' if summary['zero_based'] else 'one'}-based indices; "
        f"{summary['seconds']:.1f} s, {summary['rows_per_second']:.3g} rows/s"
    )
    return 0


def _synth(args: argparse.Namespace) -> int:

    path = data.synth(
        args.kind,
        args.rows,
        args.cols,
        args.seed,
        args.path,
        dtype=args.dtype,
        progress=not args.quiet,
        compression=_compression(args.compression),
        checksum=args.checksum,
    )
    print(
        f"wrote {path}: {args.rows} x {args.cols} {args.dtype}, kind {args.kind}, "
        f"task {data.SYNTH_KINDS[args.kind]}, seed {args.seed}"
    )
    return 0


def _resolve(name: str) -> Any:
    from pathlib import Path

    if Path(name).exists():
        return Path(name)
    if name in data.SHIPPED:
        return data.shipped(name)
    if name == "default":
        return data.default_dataset()
    return Path(name)  # validate() reports the missing file


def _info(args: argparse.Namespace) -> int:

    path = _resolve(args.file)
    info = data.validate(path, size=args.ranks, scan=args.check)
    m, n = info["n_samples"], info["n_features"]
    layout = info["layout"]
    if layout == "csr":
        nnz = info["nnz"]
        layout += f", {nnz} nonzeros (density {nnz / (m * n):.3g}), "
        layout += "with CSC copy X_csc" if info["csc"] else "no CSC copy (see data add-csc)"
    else:
        layout += f", chunks {info['chunks']}"
    if info["compression"]:
        layout += f", {info['compression']}"
    version = info["layout_version"]
    version = "absent" if version is None else f"{version}.{info['layout_minor'] or 0}"
    attrs = info["attrs"]
    rows = [
        ("file", str(path)),
        ("shape", f"{m} x {n}"),
        ("dtype", f"X {info['dtype']}, y float64"),
        ("layout", f"{layout} (optcc_layout {version})"),
        ("checksums", "fletcher32 on X and y" if info["checksums"] else "none"),
        ("task", info["task"] or "not recorded (inferred at load)"),
        ("origin", info["origin"] or "not recorded"),
        ("licence", info["licence"] or "not recorded"),
    ]
    if info["extra"]:
        rows.append(("datasets", ", ".join(info["extra"])))
    skip = {"optcc_layout", "optcc_layout_minor", "task", "origin", "licence"}
    skip |= {"n_samples", "n_features"}
    for key in sorted(k for k in attrs if k not in skip):
        value = attrs[key]
        text = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
        if len(text) > 200:
            text = text[:197] + "..."
        rows.append((key, text))
    if args.ranks:
        block = data.column_block(n, args.ranks, 0)
        rows.append(("ranks", f"{args.ranks}: rank 0 holds columns {block.start}:{block.stop}"))
    if args.check:
        what = "all values finite; labels fit the task"
        if info["layout"] == "csr":
            what += "; CSR well formed" + ("; CSC copy matches X" if info["csc"] else "")
        if info["checksums"]:
            what += "; checksums match"
        rows.append(("check", what))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _add_csc(args: argparse.Namespace) -> int:

    added = data.add_csc(args.file, checksum=args.checksum, progress=not args.quiet)
    print(f"{args.file}: {'added the CSC copy X_csc' if added else 'already has X_csc'}")
    return 0


def _list(args: argparse.Namespace) -> int:

    for name in data.SHIPPED:
        try:
            info = data.validate(data.shipped(name))
        except FileNotFoundError as exc:
            print(f"{name:<14} missing: {exc}")
            continue
        print(
            f"{name:<14} {info['n_samples']:>6} x {info['n_features']:<3} {info['task']:<10} "
            f"{info['attrs'].get('title', '')}"
        )
    s = data.DEFAULT_SYNTH
    print(
        f"{'default':<14} {s['rows']:>6} x {s['cols']:<3} synthetic {s['kind']}, seed "
        f"{s['seed']}, {s['dtype']}; made on first use in {data.data_home()}"
    )
    return 0
