"""Build hook: the simulator's compiled event loop is built at install time.

``optcc_mpi/_simcore.c`` is a plain C library loaded with ctypes (no Python C API), built
here as an optional extension: where no C compiler is available the install still
succeeds and the simulator runs its pure-Python loop (same results, slower). Beside the
library goes the SHA-256 of the source it was built from, so that a checkout whose C
source changed after the install rebuilds instead of loading a stale library.
Everything else about the package is declared in ``pyproject.toml``.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """Optional extensions, each with a ``.sha256`` of its source beside it."""

    def build_extension(self, ext):
        super().build_extension(ext)
        target = Path(self.get_ext_fullpath(ext.name))
        if target.exists():
            digest = hashlib.sha256(Path(ext.sources[0]).read_bytes()).hexdigest()
            target.with_name(ext.name.rsplit(".", 1)[-1] + ".sha256").write_text(digest + "\n")


setup(
    ext_modules=[
        Extension(
            "optcc_mpi._simcore",
            sources=["optcc_mpi/_simcore.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
