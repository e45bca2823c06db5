"""Every ``OPTCC_*`` environment variable the package reads: one table, read once.

Like mpi4py's ``rc``, the settings are one object, :data:`rc`, whose attributes are the
variables of the table (``OPTCC_LINKS`` is ``rc.links``, ``OPTCC_FASTCALL`` is
``rc.fastcall``). It reads the process environment at its first use and keeps what it
read: a call on the hot path costs an attribute lookup, not an environment lookup.
Assigning an attribute sets that variable for this process (``rc.links = "1:0.5"``);
assigning or reading a name that is not in the table raises ``AttributeError`` naming
the ones that are.

A process (a test, say) that changes ``os.environ`` after the first use calls
:func:`reload`, which reads the environment again and drops assignments.

:func:`get` and :func:`is_set` read a variable's text by its full name, from the same
settings. ``optcc-mpi info`` prints the values in force; ``docs/config.md`` is generated
from :func:`markdown`.

Variables that only the shell scripts under ``jobs/`` read (``OPTCC_HOME``,
``OPTCC_VENV``, ``OPTCC_TC_*``, ...) are documented in ``docs/slurm.md`` beside them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from optcc_mpi.errors import ArgumentTypeError

__all__ = ["Variable", "VARIABLES", "Settings", "rc", "get", "is_set", "reload", "markdown"]


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, default (None: unset), meaning and kind.

    ``kind`` is ``"text"`` (the value as given) or ``"flag"`` (``0``/``1``, read as a
    bool: anything but ``0`` is on)."""

    name: str
    default: str | None
    meaning: str
    topic: str
    kind: str = "text"

    @property
    def attr(self) -> str:
        """The attribute of :data:`rc` that holds this variable."""
        return self.name.removeprefix("OPTCC_").lower()


_ALL = (
    # Collectives
    Variable(
        "OPTCC_LINKS",
        None,
        "Link profile used when `allreduce` gets no `links`: `RANK:FRACTION,...` in the "
        "job's ranks (MPI's COMM_WORLD, torch's global ranks), `probe`, `watch`, or "
        "`healthy`. Unset: ranks that span machines learn their links (`watch`) on calls of "
        "64 KiB and more; ranks on one machine take them as healthy.",
        "collectives",
    ),
    Variable(
        "OPTCC_ALGORITHM",
        None,
        "Algorithm of the `optcc` torch.distributed backend's all_reduce when its group's "
        "options name none (`auto` when unset; `optcc_mpi.ALGORITHMS` lists the names).",
        "collectives",
    ),
    Variable(
        "OPTCC_CARRIER",
        None,
        "How the `optcc` torch.distributed backend moves CUDA tensors when its group's "
        "options name no carrier: `nccl` (the default where NCCL is available) or `host` "
        "(staged through host memory and moved by gloo: ranks that share a GPU).",
        "collectives",
    ),
    Variable(
        "OPTCC_EMULATE",
        None,
        "Software link emulation used when `allreduce` gets no `emulate`, e.g. "
        "`bw=200MB/s,latency=20us`.",
        "collectives",
    ),
    Variable(
        "OPTCC_EMULATE_FRACTION",
        None,
        "This process's own bandwidth fraction under emulation (set per rank by "
        "`jobs/degrade-wrapper.sh`).",
        "collectives",
    ),
    Variable(
        "OPTCC_LINKS_LOG",
        None,
        'JSON-lines file to which `links="watch"` and `optcc-mpi doctor` append the '
        "profiles they adopt or find (`optcc_mpi.linklog`; rank 0 writes).",
        "collectives",
    ),
    Variable(
        "OPTCC_FASTCALL",
        "1",
        "`0` turns off the compiled call path of short `allreduce` calls "
        "(`optcc_mpi.check.fastcall`; the Python path gives the same results).",
        "collectives",
        "flag",
    ),
    Variable(
        "OPTCC_BOARD",
        "1",
        "`0` sends the exchanges of a torch.distributed group's ranks (the argument check, "
        "the short messages that travel with it, the AllReduce of CPU tensors) through gloo "
        "even where every rank is on one machine, instead of the shared-memory board "
        "(`optcc_mpi.transports.board`; the same results on every rank).",
        "collectives",
        "flag",
    ),
    Variable(
        "OPTCC_GATHER_LIMIT",
        None,
        "Largest short `auto` message gathered and reduced in rank order (a size, e.g. "
        "`16K`; `0`: the least, 256 bytes); larger ones go to the library's AllReduce. "
        "Default: measured per communicator (`optcc_mpi.check.crossover`). The same on every rank.",
        "collectives",
    ),
    Variable(
        "OPTCC_LINK_RATE",
        None,
        "One healthy link's rate (e.g. `200mbit`, `25GB/s`) for the network model that sizes "
        "OptCC's segments and the ring's messages (each message's fixed cost weighed by the "
        "ranks per core where ranks share CPUs). Default: learnt where ranks span machines "
        "(one short probe round per communicator, at the first call whose schedule it "
        "sizes; used up to 200 Mbit/s), else a 10 Gbit/s NIC's. Agreed by each call's check "
        "where a schedule is built from it (a rate that differs across ranks is the same "
        "error on every rank).",
        "collectives",
    ),
    Variable(
        "OPTCC_CUDA_AWARE",
        None,
        "`1`/`0`: force whether the MPI library is taken as CUDA-aware (default: detected).",
        "collectives",
        "flag",
    ),
    # Simulator
    Variable(
        "OPTCC_SIM",
        None,
        "`python`: use the pure-Python simulator even where the compiled event loop exists.",
        "simulator",
    ),
    Variable(
        "OPTCC_CACHE",
        None,
        "Folder for files built at run time (default `~/.cache/optcc_mpi`).",
        "simulator",
    ),
    # Data and training
    Variable(
        "OPTCC_DATA_HOME",
        None,
        "Folder searched for dataset names before the shipped `data/` folder.",
        "data",
    ),
    Variable(
        "OPTCC_GLM_EXIT_AFTER",
        None,
        "Testing aid: exit with status 75 after this many CA-SGD rounds (kill-and-resume tests).",
        "training",
    ),
    # Lab: testbed, launching and sweeps
    Variable(
        "OPTCC_TESTBED_NAME",
        None,
        "Name of the namespace testbed a process runs in (set by `optcc-mpi testbed run`).",
        "lab",
    ),
    Variable(
        "OPTCC_TESTBED_STATE_DIR",
        None,
        "Folder holding testbed state files (default under /run or the cache folder).",
        "lab",
    ),
    Variable(
        "OPTCC_MPIEXEC",
        None,
        "The `mpiexec` to launch ranks with (default: the one beside the Python "
        "interpreter, then PATH).",
        "lab",
    ),
    Variable(
        "OPTCC_LAUNCHER",
        None,
        "Launching ranks (demo, sweeps): the launcher's words, `{ranks}` replaced (default: "
        "srun inside a Slurm allocation, else the MPI library's own mpiexec; docs/mpi.md).",
        "lab",
    ),
    Variable(
        "OPTCC_SRUN_MPI",
        None,
        "The `srun --mpi=` plugin (default `pmi2` for MPICH, `pmix` for Open MPI).",
        "lab",
    ),
    Variable("OPTCC_PROGRAM", None, "Sweeps: the program each task runs.", "lab"),
    Variable("OPTCC_HOME", None, "Sweeps and job scripts: the project checkout.", "lab"),
    Variable(
        "OPTCC_STRAGGLER_PROCIDS",
        None,
        "Job scripts: Slurm process ids to degrade.",
        "lab",
    ),
    Variable("OPTCC_STRAGGLER_NODEIDS", None, "Job scripts: Slurm node ids to degrade.", "lab"),
    Variable(
        "OPTCC_STRAGGLER_FRACTION",
        None,
        "Job scripts: bandwidth fraction of the degraded ranks.",
        "lab",
    ),
    Variable(
        "OPTCC_DEGRADE_METHOD",
        None,
        "Job scripts: `emulate` or `tc` (how `degrade-wrapper.sh` degrades a rank).",
        "lab",
    ),
)

#: Every variable by name.
VARIABLES: dict[str, Variable] = {v.name: v for v in _ALL}
_BY_ATTR: dict[str, Variable] = {v.attr: v for v in _ALL}


def _text(var: Variable, raw: str | None) -> str | None:
    """The variable's text: ``raw`` unless unset or blank, else its default."""
    return raw if raw is not None and raw.strip() else var.default


def _typed(var: Variable, text: str | None) -> str | bool | None:
    if var.kind == "flag":
        return None if text is None else text.strip() != "0"
    return text


class Settings:
    """The ``OPTCC_*`` variables as attributes, read from the environment at first use
    (module docstring). The one instance is :data:`rc`.

    After the first read the values are plain instance attributes, so reading one costs
    what reading any attribute costs (the hot path reads two per call)."""

    if TYPE_CHECKING:
        # Each variable's attribute and its type, for the type checker: a ``"flag"`` is
        # ``bool | None``, text ``str | None`` (tests/test_config.py holds this to the
        # table above). Declared only: at run time the values live in the instance.
        links: str | None
        algorithm: str | None
        carrier: str | None
        emulate: str | None
        emulate_fraction: str | None
        links_log: str | None
        fastcall: bool | None
        board: bool | None
        gather_limit: str | None
        link_rate: str | None
        cuda_aware: bool | None
        sim: str | None
        cache: str | None
        data_home: str | None
        glm_exit_after: str | None
        testbed_name: str | None
        testbed_state_dir: str | None
        mpiexec: str | None
        launcher: str | None
        srun_mpi: str | None
        program: str | None
        home: str | None
        straggler_procids: str | None
        straggler_nodeids: str | None
        straggler_fraction: str | None
        degrade_method: str | None

    def __getattr__(self, attr: str) -> str | bool | None:
        # Only reached for a name that is not set yet: load everything, then look again.
        var = _BY_ATTR.get(attr)
        if var is None:
            raise AttributeError(_unknown(attr))
        self._load()
        return self.__dict__[attr]

    def _load(self) -> None:
        text = {v.name: _text(v, os.environ.get(v.name)) for v in _ALL}
        self.__dict__["_text"] = text
        for v in _ALL:
            self.__dict__[v.attr] = _typed(v, text[v.name])

    def __setattr__(self, attr: str, value: str | bool | None) -> None:
        var = _BY_ATTR.get(attr)
        if var is None:
            raise AttributeError(_unknown(attr))
        if value is None or value is False or value is True:
            text = None if value is None else ("1" if value else "0")
        elif isinstance(value, str):
            text = value
        else:
            raise ArgumentTypeError(
                f"rc.{attr} takes a string (or None), not {type(value).__name__}"
            )
        if "_text" not in self.__dict__:
            self._load()
        self.__dict__["_text"][var.name] = _text(var, text)
        self.__dict__[attr] = _typed(var, self.__dict__["_text"][var.name])

    def text(self, name: str) -> str | None:
        """The text of variable ``name`` (its full name, ``OPTCC_...``); KeyError for a
        name that is not in the table (a programming error)."""
        if name not in VARIABLES:
            raise KeyError(f"{name} is not an OPTCC_* variable of optcc_mpi.config")
        if "_text" not in self.__dict__:
            self._load()
        return self.__dict__["_text"][name]

    def reload(self) -> None:
        """Read the environment again at the next use (assignments are dropped)."""
        self.__dict__.clear()

    def __dir__(self) -> list[str]:
        return sorted(_BY_ATTR)

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{v.attr}={getattr(self, v.attr)!r}" for v in _ALL if self.text(v.name) is not None
        )
        return f"optcc_mpi.config.rc({shown})"


def _unknown(attr: str) -> str:
    return f"optcc_mpi.config.rc has no setting {attr!r}; settings: {', '.join(sorted(_BY_ATTR))}"


#: The settings in force (module docstring).
rc = Settings()


def get(name: str) -> str | None:
    """The text of variable ``name`` (its default when unset or empty), as read at the
    settings' first use (:func:`reload` reads again)."""
    return rc.text(name)


def is_set(name: str) -> bool:
    """Whether variable ``name`` is set to something non-empty."""
    return get(name) is not None


def reload() -> None:
    """Read the environment again at the next use: for a process that changed
    ``os.environ`` after the first use (tests, mostly). Assignments to :data:`rc` are
    dropped."""
    rc.reload()


def markdown() -> str:
    """The table of variables, as Markdown (``docs/config.md``)."""
    lines = ["| variable | `rc.` | topic | meaning |", "|---|---|---|---|"]
    for v in _ALL:
        lines.append(f"| `{v.name}` | `{v.attr}` | {v.topic} | {v.meaning} |")
    return "\n".join(lines) + "\n"
