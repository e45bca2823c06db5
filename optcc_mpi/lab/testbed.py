"""Per-rank link shaping on one machine: network namespaces, veth links, a bridge and tc.

Each MPI rank of a testbed lives in its own network namespace ``<name>-r<i>`` with one
interface ``eth0``. Its peer ``h<i>`` sits in a hub namespace ``<name>-hub`` and is a port of
the bridge ``br0``. A ``tbf`` qdisc on ``eth0`` limits what rank *i* sends; a second ``tbf``
on ``h<i>`` (the hub side, whose egress is the rank's ingress) limits what it receives, so a
degraded rank is slow in both directions. This kernel has no ``netem`` and no ingress
policing, hence two egress shapers rather than one policer.

With ``ranks_per_node`` k > 1 a namespace is a simulated *node* holding k consecutive
ranks (node i: ranks k i .. k i + k - 1) that share its one shaped ``eth0``, as the GPUs
of a server share its NIC; what they send each other stays inside the namespace. Then
every per-namespace name below (``r<i>``, ``h<i>``, the ``degrade`` keys, the rates)
counts nodes, not ranks; with one rank per node (the default) the two are the same.

Jobs start with the ``mpiexec`` of the MPI library in use (:mod:`optcc_mpi.lab.launch`),
MPICH's hydra or Open MPI's PRRTE, inside the hub namespace; a generated launcher script
stands in for ``ssh`` and enters the rank namespace named by the "host". The transport is
limited to TCP on ``eth0`` (MPICH: UCX ``tcp,self``; Open MPI: the ``ob1`` PML with the
``tcp,self`` BTLs): otherwise the ranks would use shared memory across the namespaces and
no byte would cross the shaped links.

Everything created is listed in a state file (``/run/optcc-testbed/<name>.json``; the folder
can be moved with ``OPTCC_TESTBED_STATE_DIR``) *before* it is created, and every namespace
carries a marker (the alias of its ``lo``), so :func:`down` can clean up after a crash while
leaving namespaces it did not make alone. Addresses are ``10.77.0.0/24`` and exist only
inside the testbed's namespaces.

Examples
--------
>>> from optcc_mpi.lab import testbed                            # doctest: +SKIP
>>> bed = testbed.up(4, "400mbit", {0: 0.5})                 # doctest: +SKIP
>>> bed.run([sys.executable, "prog.py"])                     # doctest: +SKIP
0
>>> bed.set_shaping(None)          # all links healthy, nothing torn down   # doctest: +SKIP
>>> testbed.down()                                           # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optcc_mpi import config, units
from optcc_mpi.errors import TestbedError
from optcc_mpi.lab import launch
from optcc_mpi.links import Links

__all__ = [
    "DEFAULT_NAME",
    "MAX_RANKS",
    "Testbed",
    "TestbedError",
    "TestbedExists",
    "current",
    "down",
    "format_bitrate",
    "namespaces_supported",
    "parse_degrade",
    "parse_latency",
    "parse_bitrate",
    "shaping_size",
    "require_root",
    "resolve_name",
    "run",
    "set_shaping",
    "status",
    "up",
]

#: Testbed name used when neither the caller nor ``OPTCC_TESTBED_NAME`` gives one. It is the
#: prefix of every namespace, so it is deliberately unlikely to clash with anyone else's.
DEFAULT_NAME = "optcctb"
#: Ranks are ``10.77.0.1`` .. ``10.77.0.250``; the hub is ``10.77.0.254``.
MAX_RANKS = 250
SUBNET = "10.77.0"
HUB_HOST = "hub"
HUB_ADDR = f"{SUBNET}.254"
BRIDGE = "br0"
RANK_DEV = "eth0"
MARKER = "optcc-testbed"
STATE_VERSION = 1
DEFAULT_LATENCY_US = 50_000
# Smallest tbf bucket: one 64 KiB TSO/GSO segment must fit, or tbf splits every segment and
# throughput collapses well below the configured rate.
MIN_BURST = 64 * 1024
# Jumbo frames, as on HPC Ethernet: with 1500-byte frames the TCP/IP headers and the ACKs
# that share each shaped link take about 7% of its rate (an earlier measurement: the
# fault-free ring reached 0.86-0.88 of the shaped rate at MTU 1500, 0.95-0.96 at 9000).
DEFAULT_MTU = 9000
# Loss-based TCP keeps a shaped link full (tbf's queue absorbs the sawtooth); BBR, the
# kernel default here, paces below the rate in its drain phases (OptCC at 32 MiB, p = 4,
# rank 0 at half rate: 1.49-1.53 s with reno, 1.56-1.59 s with bbr).
DEFAULT_CONGESTION = "reno"
# Slowest link we agree to build; below this tbf's arithmetic and TCP's timers misbehave.
MIN_RATE_BIT = 8_000
# Transport settings every testbed job needs (see the module docstring), by launcher
# flavour; callers may override them through ``env`` but not through the ambient
# environment. MPICH: UCX over TCP only, on the shaped device. Open MPI: the ob1 PML with
# the TCP and self BTLs on the shaped device (no shared memory, no UCX). Both: a
# torch.distributed gloo group started inside the job binds to the shaped device too
# (gloo otherwise takes the address its host name resolves to).
_GLOO_ENV = {"GLOO_SOCKET_IFNAME": RANK_DEV}
REQUIRED_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": RANK_DEV, **_GLOO_ENV}
REQUIRED_ENV_OPENMPI = {
    "OMPI_MCA_pml": "ob1",
    "OMPI_MCA_btl": "tcp,self",
    "OMPI_MCA_btl_tcp_if_include": RANK_DEV,
    **_GLOO_ENV,
}
# Ambient variables a job commonly needs. The launchers forward the launching environment
# to local ranks only; naming them in the argv makes ``launch_argv`` self-contained.
PASS_ENV_NAMES = ("PATH", "VIRTUAL_ENV", "PYTHONPATH", "LD_LIBRARY_PATH", "HOME", "TMPDIR")
PASS_ENV_PREFIXES = ("OPTCC_", "MPIR_CVAR_", "UCX_", "OMP_", "OMPI_MCA_", "PRTE_MCA_")

_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")


class TestbedExists(TestbedError):
    """``up`` found a testbed of that name already; pass ``force=True`` to recreate it."""

    __test__ = False


# --------------------------------------------------------------------------- parsing


def parse_bitrate(value: str | int | float) -> int:
    """Return a link rate in bits per second, as tc takes it.

    Unlike :func:`optcc_mpi.units.parse_rate`, which gives bytes per second for everything
    else in the package, this gives bits per second (the testbed's ``rate_bit``), and
    refuses a bare number in text: tc would read it as bits, a user maybe as bytes.

    Parameters
    ----------
    value : str or int or float
        A number of bits per second, or a rate in the units of :mod:`optcc_mpi.units`
        (``400mbit``, ``1gbit``, ``50MB/s``, ``2.5gbit``).

    Raises
    ------
    ValueError
        If the text is not a rate or the rate is below 8 kbit/s.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a rate: {value!r}")
    if isinstance(value, str) and value.strip().replace(".", "", 1).isdigit():
        raise ValueError(f"rate {value!r} has no unit; write e.g. 400mbit or 50MB/s")
    bits = float(value) if isinstance(value, (int, float)) else units.parse_rate(value) * 8
    if not bits >= MIN_RATE_BIT:
        raise ValueError(f"rate {value!r} is below the minimum of {MIN_RATE_BIT} bit/s")
    return int(round(bits))


def format_bitrate(bits: float) -> str:
    """Return ``bits`` per second as a short tc-style rate (``400mbit``, ``1.5gbit``); the
    inverse of :func:`parse_bitrate` (:func:`optcc_mpi.units.format_rate` takes bytes/s)."""
    return units.format_rate(bits / 8)


def shaping_size(value: str | int) -> int:
    """Return a size (``64KiB``, ``1MB``, ``32kbit``, bare bytes) in bytes, in the units of
    :mod:`optcc_mpi.units` (``KB``/``MB`` are decimal, ``K``/``KiB`` binary)."""
    size = units.parse_size(value)
    if size < 1:
        raise ValueError(f"size {value!r} must be at least one byte")
    return size


def parse_latency(value: str | float | int) -> int:
    """Return a tbf latency (the longest a packet may wait) in microseconds.

    Parameters
    ----------
    value : str or float or int
        ``50ms``, ``200us``, ``1s``, or a number of seconds.
    """
    micros = units.parse_duration(value) * 1e6
    if not micros >= 1:
        raise ValueError(f"latency {value!r} must be at least 1us")
    return int(round(micros))


def parse_degrade(
    value: str | Mapping[int, float] | None, ranks: int | None = None
) -> dict[int, float]:
    """Return a degrade map ``{rank: fraction}`` from ``"RANK:FRACTION[,RANK:FRACTION...]"``.

    Parameters
    ----------
    value : str or mapping or None
        ``"0:0.5"``, ``"0:0.5,3:0.25"``, ranges ``"4-7:0.75"`` (the syntax of
        :meth:`optcc_mpi.links.Links.parse`), a ``{rank: fraction}`` mapping, or None/""
        for "all links healthy". A fraction of 1 is accepted and dropped (healthy).
    ranks : int, optional
        Number of ranks; when given, every rank must be below it.

    Returns
    -------
    dict of int to float
        Degraded ranks, each with its fraction of the healthy rate in (0, 1).

    Raises
    ------
    ValueError
        On a malformed entry, a repeated rank, a rank out of range or a fraction outside
        (0, 1].
    """
    if value is None:
        return {}
    try:
        links = Links.parse(value) if isinstance(value, str) else Links(dict(value))
        if ranks is not None:
            links.check(ranks)
    except ValueError as exc:
        raise ValueError(f"degrade: {exc} (example: --degrade 0:0.5,4-7:0.75)") from None
    return dict(links.fractions)


def _check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ValueError(
            f"testbed name {name!r} must be 1-16 lowercase letters and digits, starting with "
            "a letter (it prefixes every namespace)"
        )
    return name


def resolve_name(name: str | None = None) -> str:
    """Return the testbed name to use: ``name``, else ``OPTCC_TESTBED_NAME``, else the default."""
    return _check_name(name or config.get("OPTCC_TESTBED_NAME") or DEFAULT_NAME)


def _state_dir() -> Path:
    return Path(config.get("OPTCC_TESTBED_STATE_DIR") or "/run/optcc-testbed")


# --------------------------------------------------------------------------- privileges


def require_root(action: str = "build a testbed") -> None:
    """Raise :class:`TestbedError` unless the process runs as root.

    Network namespaces, veth links and qdiscs need CAP_SYS_ADMIN and CAP_NET_ADMIN; asking
    for root up front gives one plain message instead of a cryptic ``ip`` failure midway.
    """
    if os.geteuid() != 0:
        raise TestbedError(
            f"needs root to {action}: network namespaces, veth links and tc qdiscs require "
            "CAP_SYS_ADMIN and CAP_NET_ADMIN. Run it as root (e.g. with sudo)."
        )


def ensure_tools() -> None:
    """Make sure ``ip``, ``tc`` and ``unshare`` exist, installing iproute2 when missing.

    Installation runs ``apt-get install -y iproute2`` and only as root, only if a tool is
    missing.
    """
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise TestbedError(f"{', '.join(missing)} not found; install iproute2")
        print("optcc testbed: installing iproute2 (ip, tc) with apt-get", file=sys.stderr)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "iproute2"]):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise TestbedError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        if any(shutil.which(tool) is None for tool in ("ip", "tc")):
            raise TestbedError("iproute2 installed but ip/tc are still not on PATH")
    if shutil.which("unshare") is None:
        raise TestbedError("unshare not found; install util-linux")


def namespaces_supported() -> tuple[bool, str]:
    """Return whether this process can create network namespaces, and why not.

    Creates and deletes one throw-away namespace; used by the tests to skip cleanly in
    containers that forbid namespaces.
    """
    if os.geteuid() != 0:
        return False, "not root: network namespaces need CAP_SYS_ADMIN"
    if shutil.which("ip") is None:
        return False, "iproute2 (ip) is not installed"
    probe = f"optcctbprobe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return False, f"`ip netns add` failed: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


# --------------------------------------------------------------------------- commands


def _cmd(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout}")
    return done


def _json_cmd(argv: Sequence[str]) -> Any:
    done = _cmd(argv, check=False)
    if done.returncode != 0 or not done.stdout.strip():
        return None
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        return None


def _list_netns() -> list[str]:
    # `ip netns list` needs no privileges (it reads /run/netns); its lines may carry
    # "(id: N)" after the name.
    done = _cmd(["ip", "netns", "list"], check=False)
    return sorted(line.split()[0] for line in done.stdout.splitlines() if line.strip())


def _ns_marker(ns: str) -> str | None:
    links = _json_cmd(["ip", "-n", ns, "-j", "link", "show", "dev", "lo"])
    if not links:
        return None
    return links[0].get("ifalias")


def _ns_pids(ns: str) -> list[int]:
    done = _cmd(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _qdisc(ns: str, dev: str) -> dict[str, Any] | None:
    qdiscs = _json_cmd(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev])
    for q in qdiscs or []:
        if q.get("root"):
            return q
    return None


def _link_stats(ns: str, dev: str) -> dict[str, Any] | None:
    links = _json_cmd(["ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev])
    return links[0] if links else None


def _default_burst(rate_bit: int) -> int:
    # Two milliseconds' worth of bytes, at least one GSO segment (see MIN_BURST).
    return max(MIN_BURST, rate_bit // 8 // 500)


# --------------------------------------------------------------------------- the testbed


@dataclass
class Testbed:
    """A testbed as recorded in its state file.

    Obtain one from :func:`up` or :func:`current`; do not build it by hand.

    Attributes
    ----------
    name : str
        Prefix of every namespace (``<name>-hub``, ``<name>-r<i>``).
    ranks : int
        Number of MPI ranks the testbed holds.
    rate_bit : int
        Healthy link rate in bits per second, each direction.
    degrade : dict of int to float
        Degraded nodes (ranks, with one rank per node) and their fractions of
        ``rate_bit`` now in force.
    burst : int or None
        tbf bucket in bytes; None picks two milliseconds' worth per link (at least 64 KiB).
    latency_us : int
        tbf latency (queue length expressed as waiting time) in microseconds.
    mtu : int
        MTU of every veth and the bridge, in bytes.
    congestion : str
        TCP congestion control inside the rank namespaces.
    complete : bool
        False while ``up`` is still building (or crashed while building).
    ranks_per_node : int
        Ranks sharing one namespace and its shaped link (module docstring).
    """

    name: str
    ranks: int
    rate_bit: int
    degrade: dict[int, float] = field(default_factory=dict)
    burst: int | None = None
    latency_us: int = DEFAULT_LATENCY_US
    mtu: int = DEFAULT_MTU
    congestion: str = DEFAULT_CONGESTION
    complete: bool = False
    created: float = field(default_factory=time.time)
    created_etc_netns: bool = False
    ranks_per_node: int = 1

    # ---- names and paths

    @property
    def nodes(self) -> int:
        """Number of node namespaces (``ranks / ranks_per_node``)."""
        return self.ranks // self.ranks_per_node

    def ranks_of(self, node: int) -> list[int]:
        """The ranks that node ``node`` holds."""
        k = self.ranks_per_node
        return list(range(node * k, node * k + k))

    @property
    def hub_ns(self) -> str:
        """Name of the hub namespace that holds the bridge and runs ``mpiexec``."""
        return f"{self.name}-hub"

    def rank_ns(self, rank: int) -> str:
        """Name of the namespace of ``rank``."""
        return f"{self.name}-r{rank}"

    @staticmethod
    def rank_host(rank: int) -> str:
        """Host name of ``rank`` inside the testbed (what hydra's ``-hosts`` lists)."""
        return f"r{rank}"

    @staticmethod
    def rank_addr(rank: int) -> str:
        """IPv4 address of ``rank``'s ``eth0``."""
        return f"{SUBNET}.{rank + 1}"

    @staticmethod
    def hub_dev(rank: int) -> str:
        """Name of ``rank``'s veth peer in the hub (its ingress shaper sits there)."""
        return f"h{rank}"

    @property
    def namespaces(self) -> list[str]:
        """All namespaces of this testbed, hub first."""
        return [self.hub_ns, *(self.rank_ns(i) for i in range(self.nodes))]

    @property
    def marker(self) -> str:
        """Alias written on ``lo`` of every namespace, proving the namespace is ours."""
        return f"{MARKER}:{self.name}"

    @property
    def state_path(self) -> Path:
        """Path of the JSON state file."""
        return _state_dir() / f"{self.name}.json"

    @property
    def run_dir(self) -> Path:
        """Folder with generated files (the launcher script)."""
        return _state_dir() / self.name

    @property
    def nswrap(self) -> Path:
        """Launcher script that hydra runs in place of ``ssh``."""
        return self.run_dir / "nswrap"

    @property
    def etc_netns(self) -> list[Path]:
        """``/etc/netns/<ns>`` folders; ``ip netns exec`` mounts their ``hosts`` file."""
        return [Path("/etc/netns") / ns for ns in self.namespaces]

    # ---- rates

    def rate_of(self, rank: int, degrade: Mapping[int, float] | None = None) -> int:
        """Return ``rank``'s link rate in bit/s under ``degrade`` (default: the current one)."""
        degrade = self.degrade if degrade is None else degrade
        return int(round(self.rate_bit * degrade.get(rank, 1.0)))

    def rates(self) -> dict[int, int]:
        """Return every node's (rank's) current link rate in bit/s (both directions)."""
        return {i: self.rate_of(i) for i in range(self.nodes)}

    def _tbf_args(self, rate_bit: int) -> list[str]:
        burst = self.burst if self.burst is not None else _default_burst(rate_bit)
        return [
            "tbf",
            "rate",
            f"{rate_bit}bit",
            "burst",
            f"{burst}b",
            "latency",
            f"{self.latency_us}us",
        ]

    def _apply_rank_shaping(self, rank: int, rate_bit: int) -> None:
        # `replace` changes an existing tbf in place (the kernel calls its change hook), so a
        # running job keeps its connections and queued packets.
        tbf = self._tbf_args(rate_bit)
        _cmd(["tc", "-n", self.rank_ns(rank), "qdisc", "replace", "dev", RANK_DEV, "root", *tbf])
        _cmd(["tc", "-n", self.hub_ns, "qdisc", "replace", "dev", self.hub_dev(rank), "root", *tbf])

    def set_shaping(
        self,
        degrade: Mapping[int, float] | str | None,
        *,
        rate: str | int | None = None,
    ) -> None:
        """Change the link rates in place, without tearing anything down.

        Works from the host and from inside a job running in the testbed (as root: ``tc -n``
        enters the target namespace from any namespace), so a benchmark can time the healthy
        and the degraded case in one run.

        Parameters
        ----------
        degrade : mapping or str or None
            ``{rank: fraction}`` or ``"RANK:FRACTION,..."``; None or ``{}`` makes every link
            healthy.
        rate : str or int, optional
            New healthy rate (tc-style or bit/s); default keeps the current one.
        """
        require_root("change link rates")
        new_degrade = parse_degrade(degrade, self.nodes)
        new_rate = self.rate_bit if rate is None else parse_bitrate(rate)
        for r, fraction in new_degrade.items():
            if new_rate * fraction < MIN_RATE_BIT:
                raise ValueError(
                    f"rank {r} at {fraction} of {format_bitrate(new_rate)} is too slow"
                )
        with _locked(self.name):
            old_rate, old_degrade = self.rate_bit, self.degrade
            self.rate_bit, self.degrade = new_rate, new_degrade
            try:
                for rank in range(self.nodes):
                    self._apply_rank_shaping(rank, self.rate_of(rank))
            except BaseException:
                self.rate_bit, self.degrade = old_rate, old_degrade
                raise
            self._write_state()

    # ---- jobs

    def launch_argv(
        self,
        cmd: Sequence[str],
        n: int | None = None,
        env: Mapping[str, str] | None = None,
        *,
        mpiexec: tuple[str, str] | None = None,
    ) -> list[str]:
        """Return the full argv that runs ``cmd`` as an MPI job, one rank per namespace.

        Parameters
        ----------
        cmd : sequence of str
            The program and its arguments (``[sys.executable, "prog.py"]``).
        n : int, optional
            Number of ranks; default all of the testbed's. Rank *i* runs in
            ``<name>-r<j>``, ``j = i // ranks_per_node``.
        env : mapping, optional
            Extra variables for every rank; they override everything else, including the
            required transport settings (:data:`REQUIRED_ENV`, :data:`REQUIRED_ENV_OPENMPI`).
        mpiexec : (path, flavour), optional
            The launcher, ``flavour`` ``"hydra"`` or ``"openmpi"``; default
            :func:`optcc_mpi.lab.launch.mpiexec_for` (the one of this Python's MPI).

        Returns
        -------
        list of str
            Run it as root. MPICH: ``ip netns exec <hub> mpiexec -launcher ssh
            -launcher-exec <nswrap> -hosts r0,.. -localhost hub -n N -genv K V ... cmd``.
            Open MPI: ``ip netns exec <hub> unshare --uts sh -c 'hostname hub && exec "$@"'
            sh mpiexec --prtemca prte_ssh_agent <nswrap> --host r0,.. -n N
            --allow-run-as-root -x K=V ... cmd`` (PRRTE ignores ``plm_rsh_agent`` and would
            try the real ssh; the hub gets a hostname of its own so that PRRTE does not
            take a rank host for itself).
        """
        n = self.ranks if n is None else int(n)
        if not 1 <= n <= self.ranks:
            raise ValueError(f"n={n} ranks requested but the testbed has {self.ranks}")
        if not cmd:
            raise ValueError("no command to launch")
        job_env: dict[str, str] = {
            k: v
            for k, v in os.environ.items()
            if k in PASS_ENV_NAMES or k.startswith(PASS_ENV_PREFIXES)
        }
        path, flavour = mpiexec if mpiexec is not None else launch.mpiexec_for()
        if flavour not in ("hydra", "openmpi"):
            raise TestbedError(
                f"{path} is neither MPICH's hydra nor Open MPI's mpiexec; the testbed knows "
                "how to start ranks in namespaces with those two only (set OPTCC_MPIEXEC)"
            )
        job_env.update(REQUIRED_ENV if flavour == "hydra" else REQUIRED_ENV_OPENMPI)
        # A job inside the testbed finds its own testbed (current(), set_shaping()) by name.
        job_env["OPTCC_TESTBED_NAME"] = self.name
        job_env["OPTCC_TESTBED_STATE_DIR"] = str(_state_dir())
        job_env.update(env or {})
        k = self.ranks_per_node
        used = -(-n // k)
        if k == 1:
            hosts = ",".join(self.rank_host(i) for i in range(n))
        else:  # k slots per node host, filled in order
            hosts = ",".join(f"{self.rank_host(i)}:{k}" for i in range(used))
        argv = [shutil.which("ip") or "ip", "netns", "exec", self.hub_ns]
        if flavour == "hydra":
            argv += [path, "-launcher", "ssh", "-launcher-exec", str(self.nswrap)]
            argv += ["-hosts", hosts, "-localhost", HUB_HOST, "-n", str(n)]
            for key, value in job_env.items():
                argv += ["-genv", key, value]
            return argv + list(cmd)
        unshare = shutil.which("unshare") or "unshare"
        argv += [unshare, "--uts", "/bin/sh", "-c", f'hostname {HUB_HOST} && exec "$@"', "sh"]
        # One slot per host (--host rI), so rank i lands on rI: the order is the mapping.
        argv += [path, "--prtemca", "prte_ssh_agent", str(self.nswrap), "--host", hosts]
        argv += ["-n", str(n), "--allow-run-as-root"]
        for key, value in job_env.items():
            argv += ["-x", f"{key}={value}"]
        return argv + list(cmd)

    def run(
        self,
        cmd: Sequence[str],
        n: int | None = None,
        env: Mapping[str, str] | None = None,
        *,
        timeout: float | None = None,
    ) -> int:
        """Run ``cmd`` as an MPI job in the testbed and return its exit status.

        Parameters are those of :meth:`launch_argv`; ``timeout`` (seconds) kills the job's
        process group when exceeded and returns 124, like ``timeout(1)``. A job killed by a
        signal returns 128 + the signal number, as a shell would report it.
        """
        require_root("run a job in the testbed")
        argv = self.launch_argv(cmd, n, env)
        # Own process group, so a timeout or Ctrl-C reaches mpiexec and every proxy.
        proc = subprocess.Popen(argv, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            launch.stop_group(proc, grace=3.0)
            return 124
        except KeyboardInterrupt:
            launch.stop_group(proc, grace=3.0)
            raise
        return 128 - rc if rc < 0 else rc

    def counters(self) -> dict[int, dict[str, int]]:
        """Return the byte counters of every rank's ``eth0``: ``{rank: {"tx": .., "rx": ..}}``.

        The difference across a job is what the job put on (and took off) the shaped links.
        """
        require_root("read link counters")
        result = {}
        for rank in range(self.nodes):
            stats = _link_stats(self.rank_ns(rank), RANK_DEV)
            if stats is None:
                raise TestbedError(f"{self.rank_ns(rank)} has no {RANK_DEV}; run `status`")
            result[rank] = {
                "tx": int(stats["stats64"]["tx"]["bytes"]),
                "rx": int(stats["stats64"]["rx"]["bytes"]),
            }
        return result

    def status(self) -> dict[str, Any]:
        """Return what exists of this testbed and whether it is consistent (:func:`status`)."""
        return status(self.name)

    # ---- state

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-ready state record."""
        return {
            "version": STATE_VERSION,
            "marker": MARKER,
            "name": self.name,
            "ranks": self.ranks,
            "rate_bit": self.rate_bit,
            "degrade": {str(k): v for k, v in self.degrade.items()},
            "burst": self.burst,
            "latency_us": self.latency_us,
            "mtu": self.mtu,
            "congestion": self.congestion,
            "complete": self.complete,
            "created": self.created,
            "created_etc_netns": self.created_etc_netns,
            "ranks_per_node": self.ranks_per_node,
            "subnet": f"{SUBNET}.0/24",
            "namespaces": self.namespaces,
            "etc_netns": [str(p) for p in self.etc_netns],
            "nswrap": str(self.nswrap),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Testbed:
        """Rebuild a testbed from its state record."""
        if data.get("marker") != MARKER or data.get("version") != STATE_VERSION:
            raise TestbedError("state file was not written by this version of optcc testbed")
        return cls(
            name=_check_name(data["name"]),
            ranks=int(data["ranks"]),
            rate_bit=int(data["rate_bit"]),
            degrade={int(k): float(v) for k, v in data.get("degrade", {}).items()},
            burst=data.get("burst"),
            latency_us=int(data.get("latency_us", DEFAULT_LATENCY_US)),
            mtu=int(data.get("mtu", 1500)),
            congestion=str(data.get("congestion", "")),
            complete=bool(data.get("complete", False)),
            created=float(data.get("created", 0.0)),
            created_etc_netns=bool(data.get("created_etc_netns", False)),
            ranks_per_node=int(data.get("ranks_per_node", 1)),
        )

    def _write_state(self) -> None:
        # Write-then-rename: a reader (or a crash) never sees half a file.
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        os.replace(tmp, self.state_path)

    def describe(self) -> str:
        """Return a one-line summary (``4 ranks at 400mbit; rank 0 at 0.5 (200mbit)``)."""
        k = self.ranks_per_node
        text = f"{self.ranks} ranks at {format_bitrate(self.rate_bit)}"
        if k > 1:
            text = (
                f"{self.ranks} ranks, {k} per node on {self.nodes} nodes, at "
                f"{format_bitrate(self.rate_bit)}"
            )
        what = "node" if k > 1 else "rank"
        if self.degrade:
            parts = [
                f"{what} {r} at {f:g} ({format_bitrate(self.rate_of(r))})"
                for r, f in self.degrade.items()
            ]
            text += "; " + ", ".join(parts)
        else:
            text += ", all links healthy"
        return text


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    # One lock per testbed serialises up, down and set_shaping across processes (a job's
    # rank 0 may reshape while someone runs `status` or `down`). Re-entrant within a process
    # is not needed: callers take it once.
    directory = _state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.lock"
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_state(name: str) -> dict[str, Any] | None:
    path = _state_dir() / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise TestbedError(f"state file {path} is corrupt ({exc}); run `testbed down`") from None


# --------------------------------------------------------------------------- up


_NSWRAP = """#!/bin/bash
# Generated by optcc_mpi.lab.testbed for testbed {name!s}; removed by `optcc-mpi testbed down`.
# The launcher (MPICH hydra, Open MPI's PRRTE) runs this in place of ssh: `nswrap [ssh
# options] HOST COMMAND...`. HOST is a rank host rN; COMMAND (hydra's proxy, PRRTE's
# daemon) runs inside namespace {name!s}-rN with hostname rN,
# so every rank looks like its own node and its traffic leaves through the shaped eth0.
while [[ $# -gt 0 && "$1" == -* ]]; do
  case "$1" in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;
    *) shift ;;
  esac
done
host="$1"; shift
if [[ ! "$host" =~ ^r[0-9]+$ ]]; then
  echo "nswrap: unknown testbed host '$host' (expected r0, r1, ...)" >&2
  exit 255
fi
exec {ip!s} netns exec "{name!s}-$host" {unshare!s} --uts /bin/sh -c "hostname $host && $*"
"""


def up(
    ranks: int,
    rate: str | int,
    degrade: Mapping[int, float] | str | None = None,
    *,
    burst: str | int | None = None,
    latency: str | float | None = None,
    name: str | None = None,
    force: bool = False,
    mtu: int = DEFAULT_MTU,
    congestion: str = DEFAULT_CONGESTION,
    ranks_per_node: int = 1,
) -> Testbed:
    """Build a testbed: one namespace per rank, veths into a bridge, tbf in both directions.

    Parameters
    ----------
    ranks : int
        Number of ranks (1..250 namespaces).
    rate : str or int
        Healthy rate of every link, each direction: ``"400mbit"``, ``"1gbit"``, ``"50MB/s"``
        or bit/s.
    degrade : mapping or str, optional
        ``{rank: fraction}`` or ``"RANK:FRACTION,..."``: these ranks (nodes, with
        ``ranks_per_node`` > 1) send and receive at ``fraction * rate``. Change later with
        :meth:`Testbed.set_shaping`.
    burst : str or int, optional
        tbf bucket (``"64KiB"`` or bytes); default two milliseconds of each link's rate, at
        least 64 KiB.
    latency : str or float, optional
        tbf latency (``"50ms"`` or seconds); default 50 ms.
    name : str, optional
        Testbed name and namespace prefix; default ``OPTCC_TESTBED_NAME`` or ``optcctb``.
    force : bool
        Tear down an existing testbed of this name first instead of refusing.
    mtu : int
        MTU of the veths and the bridge (576..65535); default 9000 (jumbo frames, as on
        HPC Ethernet; at 1500 headers and ACKs take about 7% of each shaped link).
    congestion : str
        TCP congestion control in the rank namespaces, ``"reno"`` (default: keeps a
        shaped link full) or ``"bbr"``; ``""`` keeps the kernel's default.
    ranks_per_node : int
        Ranks per namespace, sharing its shaped link (a divisor of ``ranks``; default 1).

    Returns
    -------
    Testbed
        The new testbed.

    Raises
    ------
    TestbedExists
        If a testbed of this name exists (or left namespaces behind) and ``force`` is False.
    TestbedError
        If not root, or a command fails (everything created so far is removed again).
    ValueError
        On bad arguments.
    """
    name = resolve_name(name)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, not {ranks!r}")
    k = ranks_per_node
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or ranks % k:
        raise ValueError(
            f"ranks_per_node must be a positive divisor of ranks={ranks}, not {ranks_per_node!r}"
        )
    if not ranks // k <= MAX_RANKS:
        raise ValueError(f"ranks must be an integer in 1..{MAX_RANKS * k}, not {ranks!r}")
    rate_bit = parse_bitrate(rate)
    degrade_map = parse_degrade(degrade, ranks // k)
    for r, fraction in degrade_map.items():
        if rate_bit * fraction < MIN_RATE_BIT:
            raise ValueError(f"rank {r} at {fraction} of {format_bitrate(rate_bit)} is too slow")
    if isinstance(mtu, bool) or not isinstance(mtu, int) or not 576 <= mtu <= 65535:
        raise ValueError(f"mtu must be an integer in 576..65535, not {mtu!r}")
    if congestion not in ("", "reno", "bbr", "cubic"):
        raise ValueError(f"congestion must be reno, bbr, cubic or '' (default), not {congestion!r}")
    bed = Testbed(
        name=name,
        ranks=ranks,
        rate_bit=rate_bit,
        degrade=degrade_map,
        burst=None if burst is None else shaping_size(burst),
        latency_us=DEFAULT_LATENCY_US if latency is None else parse_latency(latency),
        mtu=mtu,
        congestion=congestion,
        ranks_per_node=k,
    )
    require_root()
    ensure_tools()
    with _locked(name):
        existing = _read_state(name)
        leftovers = _our_leftovers(name, None)
        if existing is not None or leftovers:
            if not force:
                what = (
                    Testbed.from_dict(existing).describe()
                    if existing is not None
                    else f"leftover namespaces {', '.join(leftovers)}"
                )
                raise TestbedExists(
                    f"testbed {name!r} already exists ({what}); use it, run "
                    "`optcc-mpi testbed down` first, or pass --force (force=True) to recreate it"
                )
            _teardown(name, kill=True)
        taken = sorted(set(bed.namespaces) & set(_list_netns()))
        if taken:
            raise TestbedError(
                f"namespace(s) {', '.join(taken)} exist but were not made by this testbed; "
                "refusing to touch them (choose another --name)"
            )
        bed.created_etc_netns = not Path("/etc/netns").exists()
        # Record the plan before acting: a crash midway leaves a state file that `down` uses.
        bed._write_state()
        try:
            _build(bed)
        except BaseException:
            _teardown(name, kill=True)
            raise
        bed.complete = True
        bed._write_state()
    return bed


def _build(bed: Testbed) -> None:
    hub = bed.hub_ns
    ip = ["ip"]
    for ns in bed.namespaces:
        _cmd([*ip, "netns", "add", ns])
        # Mark first, so a namespace of ours is recognisable even if we crash right after.
        _cmd([*ip, "-n", ns, "link", "set", "dev", "lo", "alias", bed.marker])
        _cmd([*ip, "-n", ns, "link", "set", "dev", "lo", "up"])
        if bed.congestion:
            _cmd(
                [*ip, "netns", "exec", ns, "sysctl", "-qw"]
                + [f"net.ipv4.tcp_congestion_control={bed.congestion}"]
            )
    _cmd([*ip, "-n", hub, "link", "add", BRIDGE, "type", "bridge"])
    _cmd([*ip, "-n", hub, "addr", "add", f"{HUB_ADDR}/24", "dev", BRIDGE])
    _cmd([*ip, "-n", hub, "link", "set", "dev", BRIDGE, "up"])
    for rank in range(bed.nodes):
        ns, peer = bed.rank_ns(rank), bed.hub_dev(rank)
        _cmd(
            [*ip, "link", "add", peer, "netns", hub, "type", "veth"]
            + ["peer", "name", RANK_DEV, "netns", ns]
        )
        _cmd([*ip, "-n", hub, "link", "set", "dev", peer, "mtu", str(bed.mtu)])
        _cmd([*ip, "-n", ns, "link", "set", "dev", RANK_DEV, "mtu", str(bed.mtu)])
        _cmd([*ip, "-n", hub, "link", "set", "dev", peer, "master", BRIDGE])
        _cmd([*ip, "-n", hub, "link", "set", "dev", peer, "up"])
        _cmd([*ip, "-n", ns, "addr", "add", f"{bed.rank_addr(rank)}/24", "dev", RANK_DEV])
        _cmd([*ip, "-n", ns, "link", "set", "dev", RANK_DEV, "up"])
        bed._apply_rank_shaping(rank, bed.rate_of(rank))
    _cmd([*ip, "-n", hub, "link", "set", "dev", BRIDGE, "mtu", str(bed.mtu)])
    # Name resolution: `ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts.
    hosts = [
        f"# {bed.marker} (generated; removed by `optcc-mpi testbed down`)",
        "127.0.0.1 localhost",
    ]
    hosts += [f"{bed.rank_addr(i)} {bed.rank_host(i)}" for i in range(bed.nodes)]
    hosts.append(f"{HUB_ADDR} {HUB_HOST}")
    for folder in bed.etc_netns:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text("\n".join(hosts) + "\n")
    bed.run_dir.mkdir(parents=True, exist_ok=True)
    bed.nswrap.write_text(
        _NSWRAP.format(
            name=bed.name,
            ip=shutil.which("ip") or "ip",
            unshare=shutil.which("unshare") or "unshare",
        )
    )
    bed.nswrap.chmod(0o755)


# --------------------------------------------------------------------------- down


def _our_leftovers(name: str, state: Mapping[str, Any] | None) -> list[str]:
    """Namespaces that ``down`` may delete: listed in the state, or prefixed and marked."""
    listed = set(state.get("namespaces", [])) if state else set()
    complete = bool(state.get("complete")) if state else False
    marker = f"{MARKER}:{name}"
    ours = []
    for ns in _list_netns():
        if not ns.startswith(f"{name}-"):
            continue
        if _ns_marker(ns) == marker:
            ours.append(ns)
        elif ns in listed and not complete:
            # Listed by an `up` that never finished: it may have died between `netns add`
            # and writing the marker. A finished testbed's namespaces are all marked, so an
            # unmarked one there belongs to someone else.
            ours.append(ns)
    return ours


def _foreign(name: str, ours: Sequence[str]) -> list[str]:
    return [ns for ns in _list_netns() if ns.startswith(f"{name}-") and ns not in ours]


def _teardown(name: str, *, kill: bool) -> dict[str, Any]:
    state = _read_state_lenient(name)
    removed: list[str] = []
    busy: dict[str, list[int]] = {}
    ours = _our_leftovers(name, state)
    # Hub last: deleting a rank namespace also deletes its veth peer in the hub.
    for ns in sorted(ours, key=lambda s: s.endswith("-hub")):
        pids = _ns_pids(ns)
        if pids and kill:
            _end_pids(pids)
            pids = _ns_pids(ns)
        if pids:
            # The name goes now; the namespace itself lives until these processes exit.
            busy[ns] = pids
        _cmd(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    marker = f"{MARKER}:{name}"
    listed_etc = set(state.get("etc_netns", [])) if state else set()
    etc_root = Path("/etc/netns")
    removed_etc: list[str] = []
    if etc_root.is_dir():
        for folder in sorted(etc_root.glob(f"{name}-*")):
            hosts = folder / "hosts"
            try:
                ours_hosts = hosts.read_text().startswith(f"# {marker}")
            except OSError:
                ours_hosts = False
            if ours_hosts or (str(folder) in listed_etc and not hosts.exists()):
                hosts.unlink(missing_ok=True)
                with contextlib.suppress(OSError):  # keep anything someone else put there
                    folder.rmdir()
                    removed_etc.append(str(folder))
        if state and state.get("created_etc_netns"):
            with contextlib.suppress(OSError):
                etc_root.rmdir()
    run_dir = _state_dir() / name
    shutil.rmtree(run_dir, ignore_errors=True)
    state_file = _state_dir() / f"{name}.json"
    had_state = state_file.exists()
    state_file.unlink(missing_ok=True)
    for tmp in _state_dir().glob(f"{name}.tmp*"):
        tmp.unlink(missing_ok=True)
    return {
        "name": name,
        "removed_namespaces": removed,
        "removed_etc_netns": removed_etc,
        "removed_state": had_state,
        "busy": busy,
        "foreign": _foreign(name, []),
    }


def _read_state_lenient(name: str) -> dict[str, Any] | None:
    try:
        return _read_state(name)
    except TestbedError:
        return None  # a corrupt state file must not stop the cleanup


def _end_pids(pids: Sequence[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            if not any(Path(f"/proc/{pid}").exists() for pid in pids):
                return
            time.sleep(0.1)


def down(name: str | None = None, *, kill: bool = False) -> dict[str, Any]:
    """Remove a testbed: its namespaces (and with them links and qdiscs), files and state.

    Safe to call twice and after a crash: it removes what the state file lists plus any
    namespace carrying the testbed's prefix *and* marker. Namespaces with the prefix but
    without the marker are someone else's and are left alone (reported as ``foreign``).

    Parameters
    ----------
    name : str, optional
        Testbed name; default ``OPTCC_TESTBED_NAME`` or ``optcctb``.
    kill : bool
        End (SIGTERM, then SIGKILL) processes still running inside the namespaces. Without
        it such processes keep their namespace alive, unnamed, until they exit.

    Returns
    -------
    dict
        ``removed_namespaces``, ``removed_etc_netns``, ``removed_state`` (bool), ``busy``
        (namespace -> pids still inside), ``foreign`` (prefixed namespaces left alone).
    """
    name = resolve_name(name)
    require_root("remove a testbed")
    with _locked(name):
        summary = _teardown(name, kill=kill)
    (_state_dir() / f"{name}.lock").unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        _state_dir().rmdir()  # only when no other testbed uses it
    return summary


# --------------------------------------------------------------------------- queries


def current(name: str | None = None) -> Testbed | None:
    """Return the testbed recorded in the state file, or None when there is none.

    Inside a job started by :meth:`Testbed.launch_argv`, ``OPTCC_TESTBED_NAME`` names the
    testbed, so ``current()`` finds it without arguments.
    """
    data = _read_state(resolve_name(name))
    return None if data is None else Testbed.from_dict(data)


def status(name: str | None = None) -> dict[str, Any]:
    """Return what exists of a testbed and whether it is consistent with its state file.

    Parameters
    ----------
    name : str, optional
        Testbed name; default ``OPTCC_TESTBED_NAME`` or ``optcctb``.

    Returns
    -------
    dict
        ``name``, ``state_file``, ``exists`` (anything of it present), ``testbed`` (the state
        record or None), ``namespaces`` (name -> {exists, marked}), ``ranks`` (one entry per
        rank: namespace, address, expected rate, egress/ingress qdisc with its rate, byte
        counters), ``leftovers`` (marked namespaces missing from the state), ``foreign``
        (prefixed namespaces without our marker), ``problems`` (list of str), ``consistent``
        (bool, or None without root) and ``root`` (bool). Without root only the state file
        and the namespace names can be read.
    """
    name = resolve_name(name)
    root = os.geteuid() == 0
    state_path = _state_dir() / f"{name}.json"
    problems: list[str] = []
    try:
        data = _read_state(name)
    except TestbedError as exc:
        data, problems = None, [str(exc)]
    bed = Testbed.from_dict(data) if data else None
    present = [ns for ns in _list_netns() if ns.startswith(f"{name}-")]
    info: dict[str, Any] = {
        "name": name,
        "state_file": str(state_path),
        "testbed": data,
        "root": root,
        "namespaces": {},
        "ranks": [],
        "leftovers": [],
        "foreign": [],
        "problems": problems,
    }
    if not root:
        info["namespaces"] = {ns: {"exists": True, "marked": None} for ns in present}
        info["exists"] = bool(data) or bool(present)
        info["consistent"] = None
        problems.append("not root: links and qdiscs cannot be inspected")
        return info
    marker = f"{MARKER}:{name}"
    marks = {ns: _ns_marker(ns) == marker for ns in present}
    expected = bed.namespaces if bed else []
    for ns in expected:
        info["namespaces"][ns] = {"exists": ns in marks, "marked": marks.get(ns, False)}
        if ns not in marks:
            problems.append(f"namespace {ns} is missing")
        elif not marks[ns]:
            problems.append(f"namespace {ns} exists without our marker")
    info["leftovers"] = [ns for ns in present if marks[ns] and ns not in expected]
    info["foreign"] = [ns for ns in present if not marks[ns]]
    for ns in info["leftovers"]:
        problems.append(f"leftover namespace {ns} is not in the state file (run `down`)")
    if bed is not None:
        if not bed.complete:
            problems.append("`up` did not finish (crashed or still running); run `down`")
        if not os.access(bed.nswrap, os.X_OK):
            problems.append(f"launcher {bed.nswrap} is missing")
        for folder in bed.etc_netns:
            if not (folder / "hosts").exists():
                problems.append(f"{folder}/hosts is missing")
        hub_ok = marks.get(bed.hub_ns, False)
        for rank in range(bed.nodes):
            ns = bed.rank_ns(rank)
            want = bed.rate_of(rank)
            entry: dict[str, Any] = {
                "rank": rank,
                "ranks": bed.ranks_of(rank),
                "namespace": ns,
                "addr": bed.rank_addr(rank),
                "rate_bit": want,
                "egress": None,
                "ingress": None,
                "tx_bytes": None,
                "rx_bytes": None,
            }
            if marks.get(ns, False):
                stats = _link_stats(ns, RANK_DEV)
                if stats is None:
                    problems.append(f"{ns} has no {RANK_DEV}")
                else:
                    entry["tx_bytes"] = int(stats["stats64"]["tx"]["bytes"])
                    entry["rx_bytes"] = int(stats["stats64"]["rx"]["bytes"])
                entry["egress"] = _qdisc_info(ns, RANK_DEV, want, problems)
            if hub_ok:
                entry["ingress"] = _qdisc_info(bed.hub_ns, bed.hub_dev(rank), want, problems)
            info["ranks"].append(entry)
    info["exists"] = bool(data) or bool(present)
    info["consistent"] = not problems
    return info


def _qdisc_info(ns: str, dev: str, want_bit: int, problems: list[str]) -> dict[str, Any] | None:
    q = _qdisc(ns, dev)
    if q is None:
        problems.append(f"{ns}/{dev}: no root qdisc (link missing?)")
        return None
    # tc reports tbf's rate in bytes per second.
    rate_bit = int(q.get("options", {}).get("rate", 0)) * 8 if q.get("kind") == "tbf" else None
    ok = rate_bit is not None and abs(rate_bit - want_bit) <= max(8, want_bit // 100)
    if not ok:
        got = "no tbf" if rate_bit is None else format_bitrate(rate_bit)
        problems.append(
            f"{ns}/{dev}: {q.get('kind')} at {got}, expected {format_bitrate(want_bit)}"
        )
    return {"ns": ns, "dev": dev, "kind": q.get("kind"), "rate_bit": rate_bit, "ok": ok}


# --------------------------------------------------------------------------- module-level


def _require_current(name: str | None) -> Testbed:
    bed = current(name)
    if bed is None:
        raise TestbedError(
            f"no testbed {resolve_name(name)!r}; create one with `optcc-mpi testbed up`"
        )
    if not bed.complete:
        raise TestbedError(f"testbed {bed.name!r} is incomplete; run `optcc-mpi testbed down`")
    return bed


def set_shaping(
    degrade: Mapping[int, float] | str | None,
    *,
    rate: str | int | None = None,
    name: str | None = None,
) -> Testbed:
    """Change the current testbed's rates in place; see :meth:`Testbed.set_shaping`.

    Returns the updated testbed.
    """
    bed = _require_current(name)
    bed.set_shaping(degrade, rate=rate)
    return bed


def run(
    cmd: Sequence[str],
    n: int | None = None,
    env: Mapping[str, str] | None = None,
    *,
    name: str | None = None,
    timeout: float | None = None,
) -> int:
    """Run ``cmd`` as an MPI job in the current testbed; see :meth:`Testbed.run`."""
    return _require_current(name).run(cmd, n, env, timeout=timeout)
