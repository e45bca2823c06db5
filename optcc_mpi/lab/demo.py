"""The demo (``optcc-mpi demo``, ``make demo``): the benchmark over one degraded link, and
its picture.

As root where network namespaces work it builds the testbed (real kernel shaping of every
rank's link), otherwise it uses software emulation at the same rates, and says which. It
prints every command it runs so that it can be pasted into a shell, runs the benchmark
(every registered algorithm and ``auto`` against the fault-free ring and the bound),
removes the testbed, and draws measured and modelled time against message size
(:func:`plot`).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optcc_mpi import algorithms
from optcc_mpi.lab import launch, testbed
from optcc_mpi.links import Links

__all__ = [
    "DemoConfig",
    "REFERENCE",
    "cli_argv",
    "figure",
    "links_label",
    "plot",
    "rate_label",
    "run",
    "shell_line",
    "size_label",
    "time_label",
]

#: The label ``lab.bench`` gives the fault-free ring, timed with every link healthy.
REFERENCE = "ring (fault-free)"


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs (``optcc-mpi demo --help``); sizes, rate and links as typed."""

    ranks: int = 8
    rate: str = "400mbit"
    links: str = "0:0.5"
    begin: str = "4M"
    end: str = "16M"
    iters: int = 3
    network: str = "auto"
    out: str = "demo-results"

    @property
    def rate_bytes(self) -> float:
        """The healthy link rate in bytes/s (``rate`` is a testbed rate, e.g. 400mbit)."""
        return testbed.parse_bitrate(self.rate) / 8


def cli_argv() -> list[str]:
    """How to start this installation's ``optcc-mpi`` from a shell: ``optcc-mpi`` when
    that is on ``PATH`` and is the one beside this Python, else the path of the one beside
    it, else ``python -m optcc_mpi`` with this interpreter's full path."""
    here = Path(sys.executable).parent / "optcc-mpi"
    found = shutil.which("optcc-mpi")
    if here.exists():
        if found and Path(found).resolve() == here.resolve():
            return ["optcc-mpi"]
        return [str(here)]
    return [sys.executable, "-m", "optcc_mpi"]


def shell_line(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """``argv`` as one line a POSIX shell runs as it is: quoted, and preceded by ``env``
    for the variables of ``env`` whose value differs from this process's environment."""
    changed = {k: v for k, v in (env or {}).items() if os.environ.get(k) != v}
    words = [*(["env", *(f"{k}={v}" for k, v in changed.items())] if changed else []), *argv]
    return shlex.join(words)


def _use_testbed(network: str) -> tuple[bool, str]:
    if network == "emulation":
        return False, "emulation requested"
    if os.geteuid() != 0:
        return False, "not root, so no kernel shaping"
    ok, why = testbed.namespaces_supported()
    if not ok:
        return False, f"network namespaces unavailable ({why})"
    return True, "root: real kernel shaping in network namespaces"


def run(cfg: DemoConfig) -> tuple[int, list[dict[str, Any]]]:
    """Run the benchmark on the testbed or under emulation, echoing every command, and
    plot it; returns the benchmark's exit status and its rows (rank 0's file).

    Raises
    ------
    TestbedError
        ``network="testbed"`` where the testbed cannot be built.
    """
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "bench.jsonl"
    rows_path.unlink(missing_ok=True)
    bench = [
        sys.executable,
        "-m",
        "optcc_mpi",
        "bench",
        *("-b", cfg.begin, "-e", cfg.end, "-f", "2", "-n", str(cfg.iters), "-w", "1"),
        *("--algorithms", ",".join([*algorithms.names(), "auto"])),
        *("--links", cfg.links, "--out", str(rows_path)),
    ]
    # Ranks beyond the cores poll each other's progress engines; throttling idle progress
    # makes oversubscribed MPICH runs an order of magnitude faster (launch.oversubscription_env).
    extra = launch.oversubscription_env(cfg.ranks)
    use_tb, why = _use_testbed(cfg.network)
    if cfg.network == "testbed" and not use_tb:
        raise testbed.TestbedError(f"--network testbed: {why}")
    me = cli_argv()
    t0 = time.perf_counter()
    if use_tb:
        print(f"network: testbed ({why}); {cfg.ranks} ranks at {cfg.rate}, degraded {cfg.links}")
        print(f"MPI: {launch.mpi_library()}")
        up = [*me, "testbed", "up", "--ranks", str(cfg.ranks), "--rate", cfg.rate]
        up += ["--links", cfg.links]
        job = [*me, "testbed", "run", *(f"--env={k}={v}" for k, v in extra.items()), "--"]
        print("$ " + shell_line([*me, "testbed", "down"]) + "   # a leftover of an earlier run")
        testbed.down()
        print("$ " + shell_line(up), flush=True)
        tb = testbed.up(cfg.ranks, cfg.rate, degrade=cfg.links)
        try:
            print("$ " + shell_line([*job, *bench]), flush=True)
            status = tb.run(bench, env=extra)
        finally:
            print("$ " + shell_line([*me, "testbed", "down"]), flush=True)
            testbed.down()
    else:
        rate = cfg.rate_bytes
        bench += ["--emulate", f"bw={rate / 1e6:g}MB/s"]
        print(
            f"network: software emulation ({why}); {cfg.ranks} ranks with "
            f"{rate / 1e6:g} MB/s virtual NICs ({cfg.rate}), degraded {cfg.links}"
        )
        chosen = launch.launcher()
        cmd = [*chosen.argv(cfg.ranks), *bench]
        env = {**extra, **chosen.env(cfg.ranks)}
        print(f"launcher: {chosen.describe()}")
        print("$ " + shell_line(cmd, env), flush=True)
        status = subprocess.call(cmd, env={**os.environ, **env})
    took = time.perf_counter() - t0
    rows: list[dict[str, Any]] = []
    if rows_path.exists():
        rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line]
    if rows:
        print(f"plot: {plot(rows, out / 'time-vs-size.png', rate=cfg.rate)}")
    print(f"benchmark took {took:.0f} s; rows in {rows_path}", flush=True)
    return status, rows


# ----------------------------------------------------------------------------- the plot


def size_label(nbytes: float) -> str:
    """``4194304`` -> ``"4 MiB"``: a size in binary units, for an axis."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.3g} B"


def time_label(ms: float) -> str:
    """``200`` -> ``"200 ms"``, ``1500`` -> ``"1.5 s"``, ``0.05`` -> ``"50 us"``."""
    if ms >= 1000:
        return f"{ms / 1000:.3g} s"
    if ms >= 1:
        return f"{ms:.3g} ms"
    return f"{ms * 1000:.3g} us"


def rate_label(rate: str) -> str:
    """A testbed rate as people write it: ``400mbit`` -> ``"400 Mbit/s"``."""
    bits = testbed.parse_bitrate(rate)
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.4g} {unit}"
    return f"{bits} bit/s"


def links_label(links: str) -> str:
    """``0:0.5,3:0.25`` -> ``"rank 0 at 50%, rank 3 at 25% of the rate"``."""
    fractions = Links.parse(links).fractions
    if not fractions:
        return "every link healthy"
    parts = [f"rank {r} at {100 * f:.3g}%" for r, f in sorted(fractions.items())]
    return ", ".join(parts) + " of the rate"


def plot(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, rate: str = "") -> Path:
    """Time per AllReduce against message size, as a PNG at ``path``: measured (solid,
    median; band: min-max) and modelled (dotted) for every algorithm on the degraded
    network, the fault-free ring on healthy links as the reference (grey, with its own
    model), and the lower bound of the degraded network (dashed). ``rate``: the healthy
    link rate, for the title."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig = figure(rows, rate=rate)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure(rows: Sequence[Mapping[str, Any]], *, rate: str = "") -> Any:
    """The matplotlib figure :func:`plot` saves (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(8, 5.2))
    labels = list(dict.fromkeys(r["algorithm"] for r in rows))
    degraded_labels = [a for a in labels if a != REFERENCE]
    sizes = sorted({r["size"] for r in rows})

    def line(label: str, color: str, name: str, **style: Any) -> None:
        mine = sorted((r for r in rows if r["algorithm"] == label), key=lambda r: r["size"])
        xs = [r["size"] for r in mine]
        ax.plot(xs, [r["time_us"] / 1e3 for r in mine], "o-", color=color, label=name, **style)
        ax.fill_between(
            xs,
            [r["time_min_us"] / 1e3 for r in mine],
            [r["time_max_us"] / 1e3 for r in mine],
            color=color,
            alpha=0.12,
        )
        model = [r.get("model_us") for r in mine]
        if model and all(m is not None and math.isfinite(m) for m in model):
            ax.plot(xs, [m / 1e3 for m in model], ":", color=color, lw=1.3)

    if REFERENCE in labels:
        line(REFERENCE, "0.45", "ring, every link healthy (reference)", lw=2, zorder=1)
    for i, label in enumerate(degraded_labels):
        chosen = {r.get("chosen") for r in rows if r["algorithm"] == label} - {None, label}
        name = f"{label} (ran {', '.join(sorted(chosen))})" if chosen else label
        line(label, f"C{i}", name)
    bounds = sorted(
        {
            (r["size"], r["bound_us"])
            for r in rows
            if r["algorithm"] != REFERENCE
            and r.get("bound_us") is not None
            and math.isfinite(r["bound_us"])
        }
    )
    if bounds:
        ax.plot(
            [b[0] for b in bounds],
            [b[1] / 1e3 for b in bounds],
            "k--",
            lw=1.2,
            label="lower bound, degraded network",
        )
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: size_label(v)))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: time_label(v)))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("message size per rank")
    ax.set_ylabel("time per AllReduce")
    first = rows[0] if rows else {}
    degraded = next((r["links"] for r in rows if r["algorithm"] != REFERENCE), "")
    network = {"testbed": "testbed (kernel shaping)", "emulation": "software emulation"}.get(
        first.get("network", ""), first.get("network", "")
    )
    ax.set_title(
        f"{first.get('p', '?')} ranks, {network}"
        + (f", {rate_label(rate)} links" if rate else "")
        + (f", {links_label(degraded)}" if degraded else "")
        + "\nsolid: measured median (band: min to max); dotted: model at the nominal rate",
        fontsize=10,
    )
    ax.grid(alpha=0.3, which="major")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
