"""Run a module as ``python -m`` would, with mpi4py unimportable: ``python tests/no_mpi.py
MODULE ARGS...`` (under ``torchrun``, which starts scripts, not modules). A PyTorch job may
have no MPI library at all; a command that needs none must then not even import mpi4py
(an import raises ImportError here, which the command would report)."""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    sys.modules["mpi4py"] = None  # type: ignore[assignment]  # import mpi4py -> ImportError
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
