"""The rate a link is judged against where the median link cannot be: what the system
reports of this host's interface (:func:`interface_speed`), an earlier healthy record
(:func:`baseline_rate`), and the choice among them (:func:`reference`).

With fewer than three nodes the doctor judges against an expected rate
(:mod:`optcc_mpi.doctor.diagnosis`, "Fewer than three nodes"); the first it has of
``expect``, the emulated rate, the interfaces' reported speed and a baseline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from optcc_mpi.errors import ArgumentError

__all__ = ["IFACE_VARIABLES", "interface_speed", "baseline_rate", "reference"]

#: Variables that name the interface a transport's traffic leaves by (gloo's and NCCL's
#: sockets, UCX's devices, Open MPI's TCP transport), in the order they are read.
IFACE_VARIABLES = (
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "UCX_NET_DEVICES",
    "OMPI_MCA_btl_tcp_if_include",
)


def _default_iface(root: Path) -> str | None:
    """The interface of the default route (``/proc/net/route``), if any."""
    try:
        lines = (root / "proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        cols = line.split()
        if len(cols) > 1 and cols[1] == "00000000":
            return cols[0]
    return None


def interface_speed(
    iface: str | None = None,
    *,
    env: dict[str, str] | None = None,
    root: str | Path = "/",
) -> tuple[str | None, float]:
    """The interface this host's traffic leaves by and the speed the system reports for
    it, in bytes/s (NaN where it reports none).

    The interface is ``iface``, else the first one named by :data:`IFACE_VARIABLES` (an
    exclusion list, ``^...``, or a device port such as ``mlx5_0:1`` names no interface),
    else the default route's. Its speed is ``/sys/class/net/IF/speed`` (Mbit/s) where
    that is a physical device (``IF/device`` exists) reporting a positive number:
    virtual devices (veth, bridges, tunnels, loopback) report a nominal figure or none,
    and the links of a network-namespace testbed are shaped below what their veths say.
    ``root`` replaces ``/`` (tests).
    """
    import os

    base = Path(root)
    env = dict(os.environ) if env is None else env
    name = iface
    if name is None:
        for var in IFACE_VARIABLES:
            first = env.get(var, "").split(",")[0].strip()
            if first and not first.startswith("^") and ":" not in first:
                name = first
                break
    if name is None:
        name = _default_iface(base)
    if name is None:
        return None, math.nan
    dev = base / "sys/class/net" / name
    try:
        mbit = float((dev / "speed").read_text().strip())
    except (OSError, ValueError):
        return name, math.nan
    if not (dev / "device").exists() or not mbit > 0 or not math.isfinite(mbit):
        return name, math.nan
    return name, mbit * 1e6 / 8


def baseline_rate(path: str | Path) -> float:
    """The healthy link rate (bytes/s) of an earlier doctor's ``--json``: the slower of
    its median egress and ingress, from a run whose verdict was healthy.

    Raises
    ------
    ArgumentError
        The file is missing, not a doctor's JSON, or its verdict was not healthy (a
        degraded or inconclusive run's median says nothing of a healthy link).
    """
    import json

    p = Path(path)
    try:
        data = json.loads(p.read_text())
        status = data["status"]
        rate = min(float(data["median_egress"]), float(data["median_ingress"]))
    except FileNotFoundError:
        raise ArgumentError(f"--baseline {p}: no such file") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArgumentError(f"--baseline {p} is not a doctor's --json ({exc})") from None
    if status != "healthy":
        raise ArgumentError(
            f"--baseline {p}: that run was {status}, not healthy; its median is no healthy "
            "link's rate"
        )
    if not (rate > 0 and math.isfinite(rate)):
        raise ArgumentError(f"--baseline {p}: no median rate in it")
    return rate


def reference(
    n_nodes: int,
    *,
    expect: float | None = None,
    emulated: float | None = None,
    speeds: Sequence[float] = (),
    ifaces: Sequence[str | None] = (),
    baseline: float | None = None,
) -> tuple[float | None, str]:
    """The rate a link is judged against and where it came from: ``(None, "median")`` to
    judge against the median link (3 nodes or more, no ``expect``), else the first of
    ``expect``, the emulated rate, the interfaces' reported ``speeds`` (one per node; all
    must report one: the highest), the ``baseline`` (:mod:`optcc_mpi.doctor.diagnosis`), or ``(None,
    "none")`` when fewer than 3 nodes have none of them."""
    if expect is not None:
        return float(expect), "--expect"
    if n_nodes >= 3:
        return None, "median"
    if emulated:
        return float(emulated), "the emulated rate"
    sp = np.asarray(speeds, dtype=float)
    if sp.size and np.isfinite(sp).all():
        names = sorted({str(i) for i in ifaces if i}) or ["?"]
        return float(sp.max()), f"the speed {'/'.join(names)} reports"
    if baseline is not None:
        return float(baseline), "an earlier healthy record"
    return None, "none"
