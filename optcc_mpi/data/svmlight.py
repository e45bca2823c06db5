"""The LIBSVM / svmlight text converter: two streaming passes, bounded memory.

:func:`convert_svmlight` reads ``label [qid:q] index:value ... [# comment]`` text (plain or
``.gz``, ``.bz2``, ``.xz``) twice, in blocks of whole lines parsed with vectorised NumPy:

1. **scan**: parse and check every line, including that every value fits the stored dtype
   (``1e39`` does not fit float32 or bfloat16: the error names the file and line); count
   rows, nonzeros and nonzeros per column; record the label domains
   (:class:`optcc_mpi.labels.LabelScan`);
2. **write**: parse again and write ``X`` (dense, one row of chunks at a time; or CSR,
   appended block by block) and ``y`` into a temporary file renamed over the output at the
   end. For CSR output the entries are also spilled, by column band, to temporary files
   beside the output and then sorted band by band into the CSC copy ``X_csc``
   (:class:`~optcc_mpi.data.writing.CSCBuilder`).

Memory does not grow with the number of rows; ``docs/data.md`` gives the measured peaks.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import re
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import h5py
import numpy as np

from optcc_mpi.errors import DatasetError, FileMissingError
from optcc_mpi.labels import LabelScan
from optcc_mpi.progress import Progress

from .layout import (
    TASKS,
    cast_to,
    first_true,
    largest_finite,
    numpy_dtype,
    storage_dtype_name,
    storage_view,
)
from .writing import (
    CSCBuilder,
    atomic_h5,
    create_csc,
    create_csr,
    create_dense,
    create_y,
    h5_filters,
    write_common_attrs,
)

__all__ = ["convert_svmlight"]

# Bytes of svmlight text parsed at a time; the parsed block takes a few times this in memory.
_TEXT_BLOCK_BYTES = 8 << 20
# Density at or above which layout='auto' stores X dense. Dense float32 costs 4 bytes per
# element and CSR about 8 per nonzero, and dense products are much faster than sparse ones at
# such densities; below it CSR wins on both counts.
_DENSE_MIN_DENSITY = 0.25
# Most features for which the converter counts nonzeros per column (8 bytes each) to build
# the CSC copy: 2**28 columns need 2 GiB of counts. Wider files are written without the copy.
_CSC_MAX_FEATURES = 1 << 28
# Largest feature index for which a block's column counts use np.bincount (a temporary of
# one int64 per column up to the largest index); beyond it, np.unique.
_BINCOUNT_MAX_INDEX = 1 << 22


_QID = re.compile(rb"(?<!\S)qid:\S*")


@dataclass
class _Block:
    labels: np.ndarray  # float64, one per row
    counts: np.ndarray  # int64, nonzeros per row
    idx: np.ndarray  # int64 feature indices as written in the file
    val: np.ndarray  # values, already rounded to the stored dtype
    lines: np.ndarray  # int64 line number (1-based) of each row


def _open_text(src: Path) -> tuple[IO[bytes], IO[bytes]]:
    """Open a possibly compressed text file; return (raw file, decompressed stream)."""
    raw = open(src, "rb")  # noqa: SIM115 - closed by the caller
    suffix = src.suffix.lower()
    if suffix == ".gz":
        return raw, gzip.GzipFile(fileobj=raw)
    if suffix == ".bz2":
        return raw, bz2.BZ2File(raw)
    if suffix in (".xz", ".lzma"):
        return raw, lzma.LZMAFile(raw)
    return raw, raw


def _text_blocks(src: Path) -> Iterator[tuple[bytes, int, int]]:
    """Yield (block of whole lines, number of its first line, raw bytes consumed so far)."""
    raw, stream = _open_text(src)
    try:
        carry = b""
        line = 1
        while True:
            try:
                chunk = stream.read(_TEXT_BLOCK_BYTES)
            except (OSError, EOFError, zlib.error, lzma.LZMAError) as exc:
                # A truncated or corrupt .gz/.bz2/.xz: name the file and how far it got.
                raise DatasetError(
                    f"{src}: cannot decompress the text after line {line - 1}: {exc}"
                ) from None
            if not chunk:
                break
            chunk = carry + chunk
            cut = chunk.rfind(b"\n")
            if cut < 0:
                carry = chunk
                continue
            block, carry = chunk[: cut + 1], chunk[cut + 1 :]
            yield block, line, raw.tell()
            line += block.count(b"\n")
        if carry:
            yield carry + b"\n", line, raw.tell()
    finally:
        if stream is not raw:
            stream.close()
        raw.close()


def _line_error(src: Path, lineno: int, line: bytes, why: str) -> DatasetError:
    text = line.decode("utf-8", "replace").rstrip("\r\n")
    if len(text) > 120:
        text = text[:117] + "..."
    return DatasetError(f"{src}: line {lineno}: {why}: {text!r}")


def _find_bad_line(block: bytes, first_line: int, src: Path) -> DatasetError:
    """Parse a block line by line, strictly, to name the line the fast parser choked on."""
    number = re.compile(
        r"[+-]?(\d+\.?\d*([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?|inf|nan)", re.IGNORECASE
    )
    for k, line in enumerate(block.split(b"\n")):
        lineno = first_line + k
        body = line.split(b"#", 1)[0]
        try:
            tokens = body.decode("ascii").split()
        except UnicodeDecodeError:
            return _line_error(src, lineno, line, "non-ASCII bytes")
        if not tokens:
            continue
        label = tokens[0]
        if "," in label:
            return _line_error(src, lineno, line, "multi-label lines are not supported")
        if not number.fullmatch(label):
            return _line_error(src, lineno, line, f"cannot parse label {label!r}")
        for tok in tokens[1:]:
            if tok.startswith("qid:"):
                continue
            key, sep, value = tok.partition(":")
            if not sep:
                return _line_error(src, lineno, line, f"expected index:value, got {tok!r}")
            if not key.isdigit():
                return _line_error(src, lineno, line, f"bad feature index {key!r}")
            if not number.fullmatch(value):
                return _line_error(src, lineno, line, f"cannot parse value {value!r}")
    last = first_line + block.count(b"\n") - 1
    return DatasetError(f"{src}: lines {first_line}-{last}: could not parse this svmlight text")


def _parse_block(block: bytes, first_line: int, src: Path, dtype: str) -> _Block:
    """Parse whole lines of svmlight text with vectorised NumPy, validating as it goes.

    Lines are ``label [qid:q] index:value ... [# comment]``. The text is classified byte by
    byte to count tokens and colons per line, every number is parsed in one C call
    (``np.fromstring``), and the label / index / value roles follow from the counts. Anything
    that does not fit sends the block to a strict line-by-line parser that names the line.
    Values are rounded to ``dtype``; one that overflows it (``1e39`` in float32) is an error
    naming its line, as a NaN would be.
    """
    text = block
    if b"#" in text:
        text = b"\n".join(line.split(b"#", 1)[0] for line in text.split(b"\n"))
    if b"qid:" in text:
        text = _QID.sub(b"", text)
    buf = np.frombuffer(text, dtype=np.uint8)
    # Space and every control byte separate tokens (a lookup table is 10x slower). Control
    # bytes other than C's isspace() set then fail np.fromstring and reach the strict parser.
    ws = buf <= 32
    colon = buf == ord(":")
    # Tokens are runs of bytes that are neither space nor colon; a well-formed line has a
    # label and one index and one value per colon, each colon glued to both of them.
    nonsep = ~ws
    nonsep &= ~colon
    starts = np.empty_like(nonsep)
    starts[0] = nonsep[0]
    np.greater(nonsep[1:], nonsep[:-1], out=starts[1:])  # token starts: separator -> byte
    del ws
    cpos = np.flatnonzero(colon)
    if cpos.size and (cpos[0] == 0 or not (nonsep[cpos - 1].all() and nonsep[cpos + 1].all())):
        raise _find_bad_line(block, first_line, src)
    del nonsep
    # Every line, the last included, ends with a newline, so each segment is non-empty and
    # reduceat counts per line without a full-length cumulative sum.
    begins = np.concatenate(([0], np.flatnonzero(buf == ord("\n"))[:-1] + 1))
    ntok = np.add.reduceat(starts, begins, dtype=np.int32).astype(np.int64)
    ncol = np.add.reduceat(colon, begins, dtype=np.int32).astype(np.int64)
    del starts, colon
    rows = ntok > 0
    bad = rows & (ntok != 1 + 2 * ncol)
    if bad.any():
        raise _find_bad_line(block, first_line, src)
    ntok, ncol = ntok[rows], ncol[rows]
    lines = np.flatnonzero(rows).astype(np.int64) + first_line
    expected = int(ntok.sum())
    if expected == 0:
        empty = np.zeros(0)
        return _Block(empty, np.zeros(0, np.int64), empty, empty, lines)
    try:
        numbers = np.fromstring(text.replace(b":", b" "), dtype=np.float64, sep=" ")
    except ValueError:
        raise _find_bad_line(block, first_line, src) from None
    if numbers.size != expected:
        raise _find_bad_line(block, first_line, src)
    label_pos = np.concatenate(([0], np.cumsum(ntok)[:-1]))
    labels = numbers[label_pos]
    is_pair = np.ones(expected, dtype=bool)
    is_pair[label_pos] = False
    pairs = numbers[is_pair].reshape(-1, 2)
    del numbers, is_pair
    counts = ncol
    idx, val = pairs[:, 0], pairs[:, 1]
    row_start = np.cumsum(counts) - counts  # position of each row's first pair

    def fail(pair: int | None, why: str, row: int | None = None) -> DatasetError:
        if row is None:
            row = int(np.searchsorted(row_start, pair, side="right") - 1)
        k = int(lines[row]) - first_line
        return _line_error(src, int(lines[row]), block.split(b"\n")[k], why)

    badlab = ~np.isfinite(labels)
    if badlab.any():
        r = first_true(badlab)
        raise fail(None, f"label {labels[r]} is not finite", row=r)
    badidx = (idx < 0) | (idx != np.floor(idx)) | (idx >= 2**62)
    if badidx.any():
        k = first_true(badidx)
        raise fail(k, f"feature index {idx[k]:g} is not a non-negative integer")
    badval = ~np.isfinite(val)
    if badval.any():
        k = first_true(badval)
        raise fail(k, f"feature value {val[k]} is not finite")
    stored = cast_to(val, dtype)
    over = ~np.isfinite(stored)
    if over.any():
        k = first_true(over)
        raise fail(
            k,
            f"feature value {val[k]:g} overflows {dtype} (largest finite value "
            f"{largest_finite(dtype):g}); store as float64 (--dtype float64) or rescale the "
            "feature",
        )
    if idx.size > 1:
        unsorted = idx[1:] <= idx[:-1]
        first = row_start[(row_start > 0) & (counts > 0)]
        unsorted[first - 1] = False  # a row's first index is not compared with the last row
        if unsorted.any():
            k = first_true(unsorted) + 1
            raise fail(
                k,
                f"feature indices must be strictly increasing (index {idx[k]:g} follows "
                f"{idx[k - 1]:g})",
            )
    return _Block(labels, counts, idx.astype(np.int64), stored, lines)


@dataclass
class _Scan:
    """What the first pass learns: sizes, index range, labels, nonzeros per column."""

    labels: LabelScan
    rows: int = 0
    nnz: int = 0
    min_idx: int | None = None
    max_idx: int | None = None
    zero_line: int | None = None
    max_line: int | None = None
    bytes_text: int = 0
    # Nonzeros per raw feature index (before the index base is known), for the CSC copy;
    # None once the indices grow past _CSC_MAX_FEATURES.
    col_counts: np.ndarray | None = field(default_factory=lambda: np.zeros(0, np.int64))

    def add(self, blk: _Block) -> None:
        self.rows += blk.labels.size
        self.nnz += blk.idx.size
        if blk.idx.size:
            lo, hi = int(blk.idx.min()), int(blk.idx.max())
            row_of = np.repeat(np.arange(blk.counts.size), blk.counts)
            if lo == 0 and self.zero_line is None:
                self.zero_line = int(blk.lines[row_of[first_true(blk.idx == 0)]])
            if self.max_idx is None or hi > self.max_idx:
                self.max_idx = hi
                self.max_line = int(blk.lines[row_of[int(np.argmax(blk.idx))]])
            self.min_idx = lo if self.min_idx is None else min(self.min_idx, lo)
            self._count_columns(blk.idx, hi)
        self.labels.add(blk.labels, blk.lines)

    def _count_columns(self, idx: np.ndarray, hi: int) -> None:
        if self.col_counts is None:
            return
        if hi >= _CSC_MAX_FEATURES:
            self.col_counts = None
            return
        if hi >= self.col_counts.size:
            grown = np.zeros(max(hi + 1, 2 * self.col_counts.size), np.int64)
            grown[: self.col_counts.size] = self.col_counts
            self.col_counts = grown
        if hi < _BINCOUNT_MAX_INDEX:
            counts = np.bincount(idx)
            self.col_counts[: counts.size] += counts
        else:
            u, c = np.unique(idx, return_counts=True)
            self.col_counts[u] += c


def _check_unchanged(src: Path, rows: int, expected: int, final: bool = False) -> None:
    """Stop if the second pass sees other rows than the first (the file changed meanwhile)."""
    if rows > expected or (final and rows != expected):
        raise DatasetError(
            f"{src}: the file changed during conversion ({expected} rows in the first pass, "
            f"{'at least ' if not final else ''}{rows} in the second)"
        )


def convert_svmlight(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype: Any = "float32",
    layout: str = "auto",
    task: str | None = None,
    zero_based: bool | str = "auto",
    n_features: int | None = None,
    progress: bool = True,
    compression: str | None = None,
    checksum: bool = True,
    csc: bool = True,
    chunk_cols: int | None = None,
    origin: str | None = None,
    licence: str | None = None,
) -> dict[str, Any]:
    """Convert LIBSVM/svmlight text to a dataset file, streaming in bounded memory.

    Two passes over the text. The first parses and validates every line (a value that
    overflows ``dtype`` is an error naming its line) and collects the row count, feature
    index range, nonzeros (per column too) and label set, so errors surface before the
    output is created. The second parses again and writes ``X`` in whole chunk rows (dense)
    or appends to the CSR arrays, into a temporary file renamed to ``dst`` at the end; CSR
    output also gets its CSC copy, built from a spill by column band. Memory is a few times
    the 8 MiB text block plus, for dense output, one row of chunks (at most 64 MiB;
    :func:`chunk_shape`), or, for the CSC copy, 16 bytes per feature and one column band
    (about 32 MiB of entries), whatever the file size.

    Parameters
    ----------
    src : path-like
        Text file, optionally compressed (``.gz``, ``.bz2``, ``.xz``). Lines are
        ``label [qid:n] index:value ...`` with strictly increasing indices; ``#`` starts a
        comment; blank lines are skipped; ``qid`` is ignored.
    dst : path-like
        Output HDF5 file.
    dtype : {'float32', 'float64', 'bfloat16'}
        Stored type of ``X``; bfloat16 is rounded to nearest even from the parsed float64.
        Values beyond the type's largest finite value are rejected.
    layout : {'auto', 'dense', 'csr'}
        'auto' stores dense when at least 25% of the entries are nonzero, else CSR.
    task : {None, 'binary', 'regression', 'counts'}
        None detects it: binary if labels are all in {0, 1} or all in {-1, +1} (the latter
        stored as {0, 1}), counts if all are non-negative integers, else regression.
    zero_based : {'auto', True, False}
        Whether index 0 is the first feature. 'auto': zero-based if any index 0 occurs, else
        one-based (LIBSVM's usual convention).
    n_features : int, optional
        Number of columns, at least the largest index seen (a test set may lack the last
        features of its training set).
    progress : bool
        Draw a progress bar on standard error.
    compression : {None, 'gzip', 'lzf'}
        HDF5 compression filter.
    checksum : bool
        Store a fletcher32 checksum with every chunk (verified on every read).
    csc : bool
        For CSR output, also write the CSC copy ``X_csc`` so that each training rank reads
        only its columns (doubles the sparse bytes on disk; needs as much temporary disk
        beside ``dst`` while converting).
    chunk_cols : int, optional
        Chunk width for dense output (:func:`chunk_shape`).
    origin, licence : str, optional
        File attributes; default to the source file name and 'unknown (not recorded)'.

    Returns
    -------
    dict
        ``path``, ``rows``, ``n_features``, ``nnz``, ``density``, ``layout``, ``csc``
        (whether the copy was written), ``dtype``, ``task``, ``zero_based``,
        ``label_encoding``, ``checksum``, ``seconds``, ``text_bytes``, ``rows_per_second``.

    Raises
    ------
    FileNotFoundError
        ``src`` does not exist.
    DatasetError
        A line that does not parse or holds a value that overflows ``dtype`` (its line
        number and text are in the message), a corrupt compressed input, labels that do not
        fit a forced task, an ``n_features`` smaller than the indices, unknown options.
    """
    t0 = time.perf_counter()
    name = storage_dtype_name(dtype)
    if layout not in ("auto", "dense", "csr"):
        raise DatasetError(f"unknown layout {layout!r}; expected auto, dense or csr")
    if zero_based not in ("auto", True, False):
        raise DatasetError(f"zero_based must be 'auto', True or False, got {zero_based!r}")
    if task is not None and task not in TASKS:
        raise DatasetError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    h5_filters(compression)
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise FileMissingError(f"svmlight file not found: {src}")

    scan = _scan_pass(src, name, progress)
    plan = _decide_output(
        scan,
        src,
        task=task,
        zero_based=zero_based,
        n_features=n_features,
        layout=layout,
        csc=csc,
        storage=_Storage(name, compression, bool(checksum), chunk_cols),
    )
    attrs = {
        "source_file": src.name,
        "zero_based": plan.zero_based,
        "label_encoding": plan.encoding,
    }
    # The CSC copy's spill files go beside the output: same file system, which must hold
    # the output anyway, and not a /tmp that may be small or in memory.
    dst.parent.mkdir(parents=True, exist_ok=True)
    spill = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".spill", dir=dst.parent))
    try:
        with (
            atomic_h5(dst, rdcc_nbytes=16 << 20) as f,
            Progress(plan.m, "convert 2/2 write", enabled=progress, unit="rows") as bar,
        ):
            if plan.layout == "dense":
                rows = _write_dense(f, src, plan, bar)
            else:
                rows = _write_csr(f, src, plan, spill, bar)
            _check_unchanged(src, rows, plan.m, final=True)
            write_common_attrs(
                f,
                task=plan.task,
                origin=origin or f"converted from svmlight file {src.name}",
                licence=licence or "unknown (not recorded at conversion)",
                m=plan.m,
                n=plan.n,
                attrs=attrs,
            )
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    seconds = time.perf_counter() - t0
    return {
        "path": str(dst),
        "rows": plan.m,
        "n_features": plan.n,
        "nnz": plan.nnz,
        "density": plan.density,
        "layout": plan.layout,
        "csc": plan.csc_counts is not None,
        "dtype": name,
        "task": plan.task,
        "zero_based": plan.zero_based,
        "label_encoding": plan.encoding,
        "checksum": bool(checksum),
        "seconds": seconds,
        "text_bytes": scan.bytes_text,
        "rows_per_second": plan.m / seconds if seconds > 0 else float("inf"),
    }


def _scan_pass(src: Path, name: str, progress: bool) -> _Scan:
    """Pass 1: parse and check every line; count rows, nonzeros, columns; see the labels."""
    scan = _Scan(labels=LabelScan())
    with Progress(src.stat().st_size, "convert 1/2 scan", enabled=progress, unit="B") as bar:
        done = 0
        for block, line, pos in _text_blocks(src):
            scan.add(_parse_block(block, line, src, name))
            scan.bytes_text += len(block)
            bar.update(pos - done, postfix=f"{scan.rows} rows")
            done = pos
    if scan.rows == 0:
        raise DatasetError(f"{src}: no data lines")
    return scan


@dataclass(frozen=True)
class _Storage:
    """How ``X`` is stored: dtype name, compression, checksums, dense chunk width."""

    dtype: str
    compression: str | None
    checksum: bool
    chunk_cols: int | None


@dataclass(frozen=True)
class _Output:
    """What the second pass writes, decided from the first pass and the options."""

    task: str
    #: ``"{-1,+1} -> {0,1}"`` when binary labels are rewritten, else None.
    encoding: str | None
    zero_based: bool
    m: int
    n: int
    nnz: int
    #: ``dense`` or ``csr``.
    layout: str
    #: Nonzeros per column when the CSC copy is written, else None.
    csc_counts: np.ndarray | None
    storage: _Storage

    @property
    def shift(self) -> int:
        """Subtracted from a file's feature index to give the column."""
        return 0 if self.zero_based else 1

    @property
    def density(self) -> float:
        return self.nnz / (self.m * self.n)

    def labels(self, blk: _Block) -> np.ndarray:
        """A block's labels as stored (binary {-1, +1} as {0, 1})."""
        return (blk.labels > 0).astype(np.float64) if self.encoding else blk.labels


def _decide_output(
    scan: _Scan,
    src: Path,
    *,
    task: str | None,
    zero_based: bool | str,
    n_features: int | None,
    layout: str,
    csc: bool,
    storage: _Storage,
) -> _Output:
    """Check the options against what the first pass saw, and settle the output's shape."""
    task = task or scan.labels.task()
    encoding = scan.labels.encoding(task, str(src))
    if zero_based == "auto":
        zero_based = scan.zero_line is not None
    elif zero_based is False and scan.zero_line is not None:
        raise DatasetError(
            f"{src}: line {scan.zero_line}: feature index 0 in a file declared one-based"
        )
    shift = 0 if zero_based else 1
    needed = 0 if scan.max_idx is None else scan.max_idx + 1 - shift
    if n_features is None:
        n = needed
    else:
        n = int(n_features)
        if n < needed:
            raise DatasetError(
                f"n_features={n} is smaller than the file needs: line {scan.max_line} has "
                f"feature index {scan.max_idx} ({'zero' if zero_based else 'one'}-based), "
                f"so at least {needed} columns"
            )
    if n < 1:
        raise DatasetError(f"{src}: no features (every line has only a label)")
    m, nnz = scan.rows, scan.nnz
    if layout == "auto":
        layout = "dense" if nnz / (m * n) >= _DENSE_MIN_DENSITY else "csr"
    counts = None
    if csc and layout == "csr" and scan.col_counts is not None:
        counts = np.zeros(n, np.int64)
        raw = scan.col_counts[shift : shift + n]
        counts[: raw.size] = raw
    scan.col_counts = None  # the first pass's largest array: free it before the second
    return _Output(task, encoding, bool(zero_based), m, n, nnz, layout, counts, storage)


def _write_dense(f: h5py.File, src: Path, plan: _Output, bar: Progress) -> int:
    """Pass 2, dense ``X``: parse again and write whole chunk rows; returns the rows."""
    st, m, shift = plan.storage, plan.m, plan.shift
    ydset = create_y(f, m, st.compression, st.checksum)
    ds = create_dense(f, m, plan.n, st.dtype, st.chunk_cols, st.compression, st.checksum)
    buf = np.zeros((min(ds.chunks[0], m), plan.n), dtype=numpy_dtype(st.dtype))
    filled = 0  # rows of buf in use; buf holds global rows r - filled .. r
    r = 0
    for block, line, _ in _text_blocks(src):
        blk = _parse_block(block, line, src, st.dtype)
        _check_unchanged(src, r + blk.labels.size, m)
        ydset[r : r + blk.labels.size] = plan.labels(blk)
        offsets = np.concatenate(([0], np.cumsum(blk.counts)))
        i = 0
        while i < blk.labels.size:
            take = min(blk.labels.size - i, buf.shape[0] - filled)
            a, b = offsets[i], offsets[i + take]
            local = np.repeat(np.arange(filled, filled + take), blk.counts[i : i + take])
            buf[local, blk.idx[a:b] - shift] = blk.val[a:b]
            filled += take
            i += take
            r += take
            if filled == buf.shape[0] or r == m:
                ds[r - filled : r] = storage_view(buf[:filled])
                buf[:filled] = 0
                filled = 0
        bar.update(blk.labels.size)
    return r


def _write_csr(f: h5py.File, src: Path, plan: _Output, spill: Path, bar: Progress) -> int:
    """Pass 2, CSR ``X``: parse again and append each block's rows; spill the entries by
    column band for the CSC copy and build it at the end. Returns the rows."""
    st, m, nnz, shift = plan.storage, plan.m, plan.nnz, plan.shift
    ydset = create_y(f, m, st.compression, st.checksum)
    g = create_csr(f, m, plan.n, nnz, st.dtype, st.compression, st.checksum)
    builder = None
    if plan.csc_counts is not None:
        builder = CSCBuilder(plan.csc_counts, m, st.dtype, spill)
    r = k = 0
    g["indptr"][0] = 0
    for block, line, _ in _text_blocks(src):
        blk = _parse_block(block, line, src, st.dtype)
        size = blk.labels.size
        _check_unchanged(src, r + size, m)
        if k + blk.idx.size > nnz:
            raise DatasetError(
                f"{src}: the file changed during conversion (more than the {nnz} "
                "nonzeros of the first pass)"
            )
        ydset[r : r + size] = plan.labels(blk)
        g["indptr"][r + 1 : r + 1 + size] = k + np.cumsum(blk.counts)
        g["indices"][k : k + blk.idx.size] = blk.idx - shift
        g["data"][k : k + blk.idx.size] = storage_view(blk.val)
        if builder is not None:
            rows = np.repeat(np.arange(r, r + size, dtype=np.int64), blk.counts)
            builder.add(rows, blk.idx - shift, blk.val)
        k += blk.idx.size
        r += size
        bar.update(size)
    if builder is not None:
        _check_unchanged(src, r, m, final=True)
        c = create_csc(f, m, plan.n, nnz, st.dtype, st.compression, st.checksum)
        builder.finish(c, src)
    return r
