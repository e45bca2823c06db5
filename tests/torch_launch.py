"""Starting a test's worker script on several ranks under torchrun (shared by the tests
that do: tests/test_torch_backend.py, tests/test_ride.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def this_checkout(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this checkout first on ``PYTHONPATH``: a worker started as a script has
    its own folder on the path, not the current directory, and would import the package
    installed in the environment (another checkout's, where it is an editable install)."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}


def torchrun(
    worker: Path, n: int, *args: str, timeout: float = 600, **env_extra: str
) -> subprocess.CompletedProcess[str]:
    """``worker`` with ``args`` on ``n`` ranks under torchrun, in this environment less any
    MPI launcher's variables and ``OPTCC_*`` settings, plus ``env_extra``; the finished
    process (its output captured). A worker that hangs prints every thread's stack 30 s
    before ``timeout`` (``WORKER_DUMP_AFTER``, where the worker reads it)."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "MPI", "OPTCC_"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WORKER_DUMP_AFTER=str(timeout - 30))
    env.update(env_extra)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={n}", str(worker), *args,
    ]  # fmt: skip
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=this_checkout(env)
    )
