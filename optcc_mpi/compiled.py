"""Plain C libraries of the package, loaded with ctypes.

Two parts of the package are small C libraries with no Python C API: the simulator's event
loop (``optcc_mpi/_simcore.c``) and the board, the shared-memory allgather of ranks on one
machine (``optcc_mpi/transports/_board.c``). Each is optional: without it a pure-Python
path runs with the same results, slower.

The library built at install time (``setup.py``, with the SHA-256 of its source in a
``.sha256`` file beside it) is used when it was built from the source beside it; otherwise
(a checkout whose C source changed after the install, or an install without a compiler)
it is compiled on first use into a per-user cache (``$OPTCC_CACHE``), where a C compiler
is available.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import os
import shutil
import subprocess
from pathlib import Path

from optcc_mpi import config

__all__ = ["library"]


def _installed(here: Path, name: str, digest: str | None) -> Path | None:
    """The library built at install time, if it matches the source (or there is none)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        lib = here / f"{name}{suffix}"
        if lib.exists():
            stamp = here / f"{name}.sha256"
            built = stamp.read_text().strip() if stamp.exists() else None
            if digest is None or built == digest:
                return lib
    return None


def library(here: Path, name: str) -> ctypes.CDLL | None:
    """The C library ``name`` (``here/name.c``, built as ``here/name{suffix}``), or None
    when there is none and none can be compiled. Each call loads it again: callers keep
    the result (``functools.lru_cache``)."""
    src = here / f"{name}.c"
    digest = hashlib.sha256(src.read_bytes()).hexdigest() if src.exists() else None
    path = _installed(here, name, digest)
    if path is None:
        if digest is None:
            return None
        cache = Path(config.get("OPTCC_CACHE") or Path.home() / ".cache" / "optcc_mpi")
        path = cache / f"{name.lstrip('_')}-{digest[:16]}.so"
    if not path.exists():
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not cc:
            return None
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                [cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(src)],
                check=True,
                capture_output=True,
                timeout=120,
            )
            os.replace(tmp, path)
        except (OSError, subprocess.SubprocessError):
            return None
    try:
        return ctypes.CDLL(str(path))
    except OSError:  # built for another platform, or truncated
        return None
