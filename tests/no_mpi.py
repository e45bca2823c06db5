"""Run a module (as ``python -m`` would) or a script with mpi4py unimportable:
``python tests/no_mpi.py MODULE|SCRIPT.py ARGS...`` (under ``torchrun``, which starts
scripts, not modules). A PyTorch job may have no MPI library at all; code that needs none
must then not even import mpi4py (an import raises ImportError here)."""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    sys.modules["mpi4py"] = None  # type: ignore[assignment]  # import mpi4py -> ImportError
    target = sys.argv[1]
    sys.argv = [target, *sys.argv[2:]]
    if target.endswith(".py"):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
