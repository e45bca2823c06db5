"""Build hook: three optional C extensions are built at install time.

``optcc_mpi/_simcore.c`` is the simulator's event loop and ``optcc_mpi/transports/_board.c``
the shared-memory exchange of ranks on one machine, plain C libraries loaded with ctypes
(no Python C API, ``optcc_mpi.compiled``); ``optcc_mpi/check/_fastcall.c`` is the compiled call
path of a short AllReduce (``optcc_mpi.check.fastcall``, Python C API, no MPI headers: it
calls the MPI library through the address mpi4py resolved). All three are optional: where no C compiler is available
the install still succeeds and the pure-Python paths run (same results, slower). Beside
each library goes the SHA-256 of the source it was built from, so that a checkout whose C
source changed after the install is noticed instead of loading a stale library.
Everything else about the package is declared in ``pyproject.toml``.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class BuildExt(build_ext):
    """Optional extensions, each with a ``.sha256`` of its source beside it."""

    def build_extension(self, ext):
        super().build_extension(ext)
        target = Path(self.get_ext_fullpath(ext.name))
        if target.exists():
            digest = _digest(ext.sources[0])
            target.with_name(ext.name.rsplit(".", 1)[-1] + ".sha256").write_text(digest + "\n")


setup(
    ext_modules=[
        Extension(
            "optcc_mpi._simcore",
            sources=["optcc_mpi/_simcore.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "optcc_mpi.transports._board",
            sources=["optcc_mpi/transports/_board.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "optcc_mpi.check._fastcall",
            sources=["optcc_mpi/check/_fastcall.c"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            # The module carries its source's digest (optcc_mpi.check.fastcall compares it
            # with the source beside it: an editable install keeps no stamp file).
            define_macros=[("FASTCALL_SOURCE", f'"{_digest("optcc_mpi/check/_fastcall.c")}"')],
            optional=True,
        ),
    ],
    cmdclass={"build_ext": BuildExt},
)
