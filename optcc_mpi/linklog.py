"""The link record of a run: what ``links="watch"`` adopted and what ``doctor`` found.

A JSON-lines file, one object per line, appended to (several runs may share a file; the
``run`` field tells them apart), written by rank 0 only (every rank holds the same
profile at the same call). Which file: the one given with :func:`recording` (or
:class:`LinkLog`), else ``$OPTCC_LINKS_LOG``; none, nothing is written.

Records (every one has ``time``, Unix seconds, ``run`` and ``event``):

``start``
    First line of a run: ``source`` (``watch`` or ``doctor``), ``p``, ``host``, ``pid``
    and ``job`` (``$SLURM_JOB_ID``, if set).
``adopt``
    ``links="watch"`` adopted a new profile at call ``call``: ``links`` (the profile's
    string form), ``fractions`` (one per rank), ``measured`` (the fractions the
    call's observations gave, or None), ``why`` (which calls measured what, and what the
    probe found, if one decided; None: not said) and ``probe`` (the probe's fractions per
    rank, or None).
``probe``
    The watch's calls suspected a change and every rank ran the probe at call ``call``
    (:func:`optcc_mpi.probe.probe_ranks`): ``suspected`` (the traffic's profile),
    ``links`` (what the probe named), ``found`` (its fraction per rank), ``unresolved``,
    ``reference`` (what fractions are of), ``seconds``, ``adopted`` (whether the profile
    changed: else the suspicion was wrong and the profile stays) and ``why``.
``call``
    What call ``call`` ran: ``algorithm``, the ``links`` in force, ``measured`` and
    ``explore`` (the watch ran it on the healthy profile to measure every rank alike);
    written when the algorithm or the profile changes, otherwise at most every ``every``
    seconds (a heartbeat, so that the timeline shows how long a state lasted without a
    line per call), and for the last call when the process exits.
``doctor``
    A verdict of :func:`optcc_mpi.doctor.doctor`: ``status``, ``links``, ``fractions``
    (per rank), ``summary`` and ``call`` (the doctor runs of this process so far).

:func:`read` reads a file back; ``optcc-mpi report --links FILE`` draws the timeline.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from optcc_mpi import config
from optcc_mpi.errors import ArgumentError
from optcc_mpi.links import Links

__all__ = ["ENV_LINKS_LOG", "LinkLog", "from_env", "recording", "read", "Record"]

#: One record: a JSON object (read back from a file, its values are of any JSON type).
Record = dict[str, Any]
#: What a ``call`` record changes with: the algorithm, the profile's key, exploring.
_State = tuple[str, tuple[tuple[int, float], ...], bool]
#: The arguments of a ``call`` record (:func:`_call_record`).
_CallArgs = tuple[int, int, str, Links, "Links | None", bool]

#: Environment variable naming the file when no other is given.
ENV_LINKS_LOG = "OPTCC_LINKS_LOG"
#: The file :func:`recording` set for this process (None: use the environment).
_DEFAULT: list[str | None] = [None]
#: Logs this process has made (part of each run's name).
_MADE = [0]


class LinkLog:
    """Appends link records of one run to a JSON-lines file.

    Parameters
    ----------
    path : str or Path
        The file (created with its folder if missing; appended to).
    every : float
        Seconds between two ``call`` records that say nothing new (heartbeats).
    """

    def __init__(self, path: str | os.PathLike[str], *, every: float = 10.0) -> None:
        self.path = Path(path)
        if not str(path).strip():
            raise ArgumentError("link log: the file name is empty")
        if self.path.is_dir():
            raise ArgumentError(f"link log: {self.path} is a folder, not a file")
        self.every = float(every)
        # Unique per log: host, process, start time, and the logs this process made.
        _MADE[0] += 1
        self.run = f"{socket.gethostname()}-{os.getpid()}-{time.time():.0f}-{_MADE[0]}"
        self._started = False
        self._last_state: _State | None = None
        self._last_time = -1e300
        self._doctor_runs = 0
        #: The last ``call`` record not written (with its time), written at exit.
        self._pending: tuple[float, _CallArgs] | None = None
        atexit.register(self.flush)

    def write(self, record: Record, when: float | None = None) -> None:
        """Append one record (``time``, default now, and ``run`` added), preceded by the
        run's ``start`` record the first time."""
        when = time.time() if when is None else when
        if not self._started:
            self._started = True
            start = {
                "event": "start",
                "source": record.get("source"),
                "p": record.get("p"),
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "job": os.environ.get("SLURM_JOB_ID"),
            }
            self._append(start, when)
        self._append(record, when)

    def flush(self) -> None:
        """Write the last ``call`` record if it was held back (at exit, so that the
        timeline shows where the run ended)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.write(_call_record(*pending[1]), pending[0])

    def _append(self, record: Record, when: float) -> None:
        line = json.dumps({"time": round(when, 6), "run": self.run, **record})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One write of one line in append mode: lines of several writers never interleave.
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")

    def adopted(
        self,
        call: int,
        p: int,
        profile: Links,
        measured: Links | None = None,
        *,
        why: str | None = None,
        probe: Any = None,
    ) -> None:
        """``links="watch"`` adopted ``profile`` at call ``call`` (``why``: the reason;
        ``probe``: the probe's fractions per rank, if one decided)."""
        self.write(
            {
                "event": "adopt",
                "source": "watch",
                "call": int(call),
                "p": int(p),
                "links": str(profile),
                "fractions": _vector(profile, p),
                "measured": None if measured is None else _vector(measured, p),
                "why": why,
                "probe": None if probe is None else _floats(probe),
            }
        )

    def probed(
        self, call: int, p: int, suspected: Links, found: Any, why: str, *, adopted: bool
    ) -> None:
        """The watch ran its probe at call ``call`` on suspecting ``suspected``
        (``found``: a :class:`optcc_mpi.probe.RankProbe`)."""
        self.write(
            {
                "event": "probe",
                "source": "watch",
                "call": int(call),
                "p": int(p),
                "suspected": str(suspected),
                "links": str(found.links),
                "found": _floats(found.fractions),
                "unresolved": [int(r) for r in found.unresolved],
                "reference": found.source,
                "seconds": round(float(found.seconds), 6),
                "adopted": bool(adopted),
                "why": why,
            }
        )

    def ran(
        self,
        call: int,
        p: int,
        algorithm: str,
        profile: Links,
        measured: Links | None = None,
        *,
        explore: bool = False,
    ) -> bool:
        """Call ``call`` ran ``algorithm`` under ``profile`` (``explore``: on the healthy
        profile, to measure every rank alike); written when any of them changed since the
        last ``call`` record, or ``every`` seconds after it. Returns whether a record was
        written."""
        state: _State = (algorithm, profile.key(), explore)
        now = time.monotonic()
        # Every watched call comes here: a call that says nothing new only keeps its
        # arguments (the record is built if it is ever written).
        args: _CallArgs = (call, p, algorithm, profile, measured, explore)
        if state == self._last_state and now - self._last_time < self.every:
            self._pending = (time.time(), args)
            return False
        self._last_state, self._last_time, self._pending = state, now, None
        self.write(_call_record(*args))
        return True

    def doctor(self, verdict: Record, p: int) -> None:
        """A doctor's verdict (:meth:`optcc_mpi.doctor.Diagnosis.to_dict`)."""
        self._doctor_runs += 1
        fractions = [1.0] * p
        for row in verdict.get("ranks", []):
            f = row.get("fraction")
            if f is not None:
                fractions[int(row["rank"])] = float(f)
        self.write(
            {
                "event": "doctor",
                "source": "doctor",
                "call": self._doctor_runs,
                "p": int(p),
                "status": verdict.get("status"),
                "links": verdict.get("links"),
                "fractions": fractions,
                "summary": verdict.get("summary"),
            }
        )


def _call_record(
    call: int, p: int, algorithm: str, profile: Links, measured: Links | None, explore: bool
) -> Record:
    return {
        "event": "call",
        "source": "watch",
        "call": int(call),
        "p": int(p),
        "algorithm": algorithm,
        "links": str(profile),
        "fractions": _vector(profile, p),
        "measured": None if measured is None else _vector(measured, p),
        "explore": bool(explore),
    }


def _floats(values: Any) -> list[float | None]:
    """Numbers for JSON: NaN (not measured) as None, the rest to 4 places."""
    return [None if v != v else round(float(v), 4) for v in values]


def _vector(links: Links, p: int) -> list[float]:
    return [float(f) for f in links.vector(p)]


def from_env() -> LinkLog | None:
    """A log for the file :func:`recording` set, else ``$OPTCC_LINKS_LOG``; None if
    neither names one."""
    path = _DEFAULT[0] or config.get(ENV_LINKS_LOG)
    return LinkLog(path) if path else None


@contextlib.contextmanager
def recording(path: str | os.PathLike[str] | None) -> Iterator[None]:
    """Within the block, link watches made in this process (the first watched call on a
    communicator makes one) and doctors log to ``path``; None changes nothing.

    Examples
    --------
    >>> with recording("links.jsonl"):                           # doctest: +SKIP
    ...     train(...)                      # allreduce(..., links="watch") inside
    """
    if path is None:
        yield
        return
    LinkLog(path)  # a bad name fails here, before anything runs
    before = _DEFAULT[0]
    _DEFAULT[0] = str(path)
    try:
        yield
    finally:
        _DEFAULT[0] = before


def read(path: str | os.PathLike[str]) -> list[Record]:
    """Every record of a link log, in file order.

    Raises
    ------
    FileNotFoundError
        No such file.
    ValueError
        A line is not a JSON object (its number is named).
    """
    out = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ArgumentError(f"{path}:{number}: not JSON ({exc.msg})") from None
            if not isinstance(rec, dict) or "event" not in rec:
                raise ArgumentError(f"{path}:{number}: not a link record (no 'event')")
            out.append(rec)
    return out
