"""Every bandwidth profile at its bound, by simulation (``optcc-mpi lab profiles``).

For each profile of a family (one degraded 8-rank server at p = 16..128 and 12.5 to 50%
loss, two degraded servers, several stragglers at different fractions, seeded random
per-rank vectors) this builds our OptCC and R2CCL schedules for 1 GiB per rank, simulates
them at 50 GB/s without latency (the fluid setting of the models), and records

* OptCC's simulated time over the lower bound, and its plan's fluid time over the bound
  (the plan meets the bound for every vector, derived (ours), docs/optcc.md; it may sit
  up to ``optcc.ATTACH_TOL`` above it where it attaches ranks with tiny shares, and up
  to ``optcc.GRID_TOL`` beyond ``optcc.DIRECT_OWNERS`` owners);
* R2CCL's simulated time over its own cost model (``r2ccl.r2ccl_time``);
* whether the verifier proves both schedules for the profile (built for a small buffer
  with enough segments that OptCC's scratch slots are reused, see :func:`verify_profile`:
  the verifier's cost grows with the operations, not the bytes).

Output: one JSON line per profile and a Markdown summary (``--out DIR``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from optcc_mpi import algorithms, model
from optcc_mpi import algorithms as registry
from optcc_mpi.algorithms import optcc as optcc_alg
from optcc_mpi.argtypes import alias, int_at_least, positive_size_arg, rate_arg
from optcc_mpi.errors import ArgumentError
from optcc_mpi.lab.tools import tool_main
from optcc_mpi.links import Links
from optcc_mpi.progress import Progress
from optcc_mpi.simulate import simulate
from optcc_mpi.verify import verify

__all__ = [
    "Profile",
    "families",
    "large_families",
    "drawn",
    "measure",
    "markdown",
    "add_arguments",
    "run_args",
    "main",
    "SUMMARY",
]

#: What ``optcc-mpi lab --help`` says of this tool.
SUMMARY = "every bandwidth profile family at its bound, by simulation (no MPI needed)"

#: One profile: family name, ranks, link profile text, and a short description.
Profile = tuple[str, int, str, str]

FAMILIES = ("server", "two-servers", "stragglers", "random")


def _random(p: int, lo: float, seed: int) -> str:
    """A per-rank vector uniform in ``[lo, 1)``, scaled so that the fastest rank is at 1."""
    f = np.random.default_rng(seed).uniform(lo, 1.0, p)
    return ",".join(f"{i}:{v / f.max():.4f}" for i, v in enumerate(f))


def families(max_p: int = 128) -> list[Profile]:
    """The profiles the issue names, up to ``max_p`` ranks."""
    out: list[Profile] = []
    for p in (16, 32, 64, 128):
        for x in (0.125, 0.25, 0.5):
            out.append(("server", p, f"0-7:{1 - x:g}", f"ranks 0-7 at {1 - x:g}"))
    for p, links in (
        (32, "0-7:0.5,8-15:0.75"),
        (32, "0-7:0.5,24-31:0.5"),
        (64, "0-7:0.5,32-39:0.875"),
        (128, "0-7:0.75,64-71:0.5"),
    ):
        out.append(("two-servers", p, links, links))
    for p, links in (
        (16, "0:0.5,5:0.7,9:0.85,15:0.6"),
        (24, "2:0.3,7:0.55,11:0.8"),
        (32, "3:0.25,17:0.5,30:0.875"),
        (64, "0:0.5,10:0.6,20:0.7,30:0.8,40:0.9"),
        (128, "5:0.2,50:0.5,100:0.9"),
    ):
        out.append(("stragglers", p, links, links))
    for p, lo, seed in ((16, 0.3, 1), (16, 0.05, 3), (32, 0.5, 2), (64, 0.1, 4), (128, 0.6, 5)):
        out.append(("random", p, _random(p, lo, seed), f"seed {seed}, f uniform in [{lo}, 1)"))
    return [x for x in out if x[1] <= max_p]


def large_families() -> list[Profile]:
    """Profiles beyond ``optcc.DIRECT_OWNERS`` owners, where OptCC's owners form a grid
    (p = 256, 512, 1024): one rank at 0.625 (it keeps a share of its own), a degraded
    server at 0.75 and at 0.5, and two seeded random vectors."""
    out: list[Profile] = []
    for p in (256, 512, 1024):
        out.append(("stragglers", p, "0:0.625", "rank 0 at 0.625"))
        for f in (0.75, 0.5):
            out.append(("server", p, f"0-7:{f:g}", f"ranks 0-7 at {f:g}"))
        for lo, seed in ((0.5, 7), (0.1, 4)):
            out.append(("random", p, _random(p, lo, seed), f"seed {seed}, f uniform in [{lo}, 1)"))
    return out


def drawn(n: int, seed: int = 0, max_p: int = 128) -> list[Profile]:
    """``n`` profiles drawn at random (``seed``) from the families other than random
    vectors, to check on profiles nobody tuned for: one server of 4 or 8 ranks at 10 to 60%
    loss, two servers of 8 ranks at 10 to 60% each, or 2 to 5 stragglers at 0.2 to 0.95 of
    the healthy rate, at p = 16, 24, 32, 48, 64, 96 or 128 (up to ``max_p``)."""
    rng = np.random.default_rng(seed)
    ps = [p for p in (16, 24, 32, 48, 64, 96, 128) if p <= max_p]
    if not ps:
        raise ArgumentError(f"--draw needs --max-ranks of at least 16, not {max_p}")
    out: list[Profile] = []
    for _ in range(n):
        p = int(rng.choice(ps))
        kind = int(rng.integers(3))
        if kind == 0:
            g = int(rng.choice([4, 8]))
            s0 = int(rng.integers(0, p // g)) * g
            f = 1 - rng.uniform(0.1, 0.6)
            text = f"{s0}-{s0 + g - 1}:{f:.3f}"
            out.append(("server", p, text, f"ranks {s0}-{s0 + g - 1} at {f:.3f}"))
        elif kind == 1:
            a, b = (int(v) * 8 for v in rng.choice(p // 8, 2, replace=False))
            fa, fb = 1 - rng.uniform(0.1, 0.6, 2)
            text = f"{a}-{a + 7}:{fa:.3f},{b}-{b + 7}:{fb:.3f}"
            out.append(("two-servers", p, text, text))
        else:
            ranks = sorted(int(r) for r in rng.choice(p, int(rng.integers(2, 6)), replace=False))
            text = ",".join(f"{r}:{rng.uniform(0.2, 0.95):.3f}" for r in ranks)
            out.append(("stragglers", p, text, text))
    return out


def verify_profile(name: str, p: int, links: Links) -> bool:
    """The verifier on ``name``'s schedule for this profile: a buffer of ``64 p + 5``
    elements, and for OptCC 12 segments (more than its scratch slots, so that slot reuse
    is proven) up to p = 64, 4 beyond (the verifier's cost grows as operations x p)."""

    params: dict[str, Any] = {}
    if name == "optcc":
        params["k"] = 12 if p <= 64 else 4
    sched = algorithms.get(name).build(p, 64 * p + 5, links, **params)
    return bool(verify(sched, raise_on_error=False).ok)


def r2ccl_helper_time(p: int, size: float, bw: float, links: Links) -> float:
    """A floor on R2CCL's composition that its cost model leaves out (derived, ours): each
    healthy rank (a rank at the top rate) carries, per direction, its main-ring traffic
    ``2(p-1)/p (1-Y) n``, its part of the healthy-only AllReduce ``2(h-1)/h Y n``, and, as
    a helper, the raw tails of the ``m`` degraded ranks spread over the ``h`` healthy
    ones, ``m Y n / h``, all at rate B. With few healthy ranks (a random vector has one)
    the last term dominates and no schedule of this composition can meet the model."""

    f = model.fractions(links, p)
    y = 1.0 - float(f.min())
    h = int(np.sum(f == f.max()))
    m = p - h
    if y <= 0.0 or h == 0:
        return 0.0
    load = 2.0 * (p - 1) / p * (1 - y) + (2.0 * (h - 1) / h * y) + m * y / h
    return load * size / (bw * float(f.max()))


def measure(
    profile: Profile,
    *,
    size: int = 1 << 30,
    bw: float = 50e9,
    check: bool = True,
    algorithms: Sequence[str] = ("optcc", "r2ccl"),
) -> dict[str, Any]:
    """One profile: the bound, OptCC's plan and simulated time, R2CCL's model and
    simulated time (of those in ``algorithms``), and (``check``) the verifier's verdict
    on both schedules."""

    family, p, text, what = profile
    links = Links.parse(text)
    ff = model.fault_free(p, size, bw)
    bound = model.lower_bound(p, size, bw, links)
    plan = optcc_alg.optcc_plan(p, links)
    row: dict[str, Any] = {
        "family": family,
        "p": p,
        "links": text,
        "profile": what,
        "size": size,
        "bw": bw,
        "bound_s": bound,
        "bound_over_ff": bound / ff,
        "plan_over_bound": plan.time * size / bw / bound,
        "attached": list(plan.attached),
        "ring_model_over_bound": registry.get("ring").time(p, size, bw, links) / bound,
    }
    row["r2ccl_helper_s"] = r2ccl_helper_time(p, size, bw, links)
    for name in algorithms:
        alg = registry.get(name)
        t0 = time.perf_counter()
        sched = alg.build(p, size // 4, links)
        t1 = time.perf_counter()
        sim = simulate(sched, links, bw=bw).time
        t2 = time.perf_counter()
        mod = alg.time(p, size, bw, links)
        row[f"{name}_sim_s"] = sim
        row[f"{name}_model_s"] = mod
        row[f"{name}_over_bound"] = sim / bound
        row[f"{name}_over_model"] = sim / mod
        row[f"{name}_ops"] = int(sched.n_ops)
        row[f"{name}_build_s"] = round(t1 - t0, 2)
        row[f"{name}_simulate_s"] = round(t2 - t1, 2)
        if name == "optcc":
            row["optcc_k"] = int(sched.params["k"])
            row["optcc_grid"] = list(sched.params["grid"])
        del sched
        if check:
            row[f"{name}_verified"] = verify_profile(name, p, links)
    return row


def _x(v: float) -> str:
    return f"{v:.4f}"


def markdown(rows: Sequence[dict[str, Any]], command: str = "") -> str:
    """The rows as Markdown: one table per family and a summary of the worst cases."""
    out = [
        "Simulated at 1 GiB per rank, 50 GB/s NICs, no latency. `OptCC / bound`: simulated "
        "time over the lower bound (the plan's fluid time is the bound, `plan / bound`); "
        "`R2CCL / model`: simulated time over R2CCL's own cost model; `helper floor / model`: the "
        "load of a healthy rank in R2CCL's composition, which the model omits, over the "
        "model (above 1, no schedule of the composition meets the model); `verified`: the "
        "verifier proves both schedules for the profile.",
        "",
    ]
    if command:
        out[-1:-1] = [f"Command: `{command}`"]
    for fam in FAMILIES:
        mine = [r for r in rows if r["family"] == fam]
        if not mine:
            continue
        out += [f"### {fam}", ""]
        out.append(
            "| p | profile | bound / fault-free | plan / bound | OptCC / bound | k | "
            "R2CCL / model | helper floor / model | R2CCL / bound | verified |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in mine:
            ok = [r.get("optcc_verified"), r.get("r2ccl_verified")]
            verdict = "-" if None in ok else ("yes" if all(ok) else "NO")
            if "r2ccl_over_model" in r:
                r2 = (
                    f"{_x(r['r2ccl_over_model'])} | "
                    f"{_x(r['r2ccl_helper_s'] / r['r2ccl_model_s'])} | {_x(r['r2ccl_over_bound'])}"
                )
            else:
                r2 = "- | - | -"
            out.append(
                f"| {r['p']} | {r['profile']} | {_x(r['bound_over_ff'])} | "
                f"{_x(r['plan_over_bound'])} | {_x(r['optcc_over_bound'])} | {r['optcc_k']} | "
                f"{r2} | {verdict} |"
            )
        out.append("")
    if rows:
        worst_o = max(rows, key=lambda r: r["optcc_over_bound"])
        out += [
            f"Worst OptCC / bound: {_x(worst_o['optcc_over_bound'])} "
            f"({worst_o['family']}, p = {worst_o['p']}, {worst_o['profile']}); "
            f"worst plan / bound: {_x(max(r['plan_over_bound'] for r in rows))}.",
            "",
        ]
        with_r2 = [r for r in rows if "r2ccl_over_model" in r]
        if with_r2:
            worst_r = max(with_r2, key=lambda r: abs(r["r2ccl_over_model"] - 1))
            out += [
                f"Worst R2CCL / model: {_x(worst_r['r2ccl_over_model'])} "
                f"({worst_r['family']}, p = {worst_r['p']}, {worst_r['profile']}).",
                "",
            ]
        checked = [r for r in rows if "optcc_verified" in r and "r2ccl_verified" in r]
        if checked:
            n_ok = sum(r["optcc_verified"] and r["r2ccl_verified"] for r in checked)
            out += [f"Verified: {n_ok} of {len(checked)} profiles checked.", ""]
    return "\n".join(out)


def run(
    profiles: Iterable[Profile],
    *,
    size: int,
    bw: float,
    check: bool,
    out: Path | None,
    progress: bool = True,
    algorithms: Sequence[str] = ("optcc", "r2ccl"),
) -> list[dict[str, Any]]:
    """Measure each profile, appending a JSON line per profile to ``out/profiles.jsonl``."""

    todo = list(profiles)
    bar = Progress(len(todo), "profiles", enabled=progress, unit="profile")
    rows = []
    lines = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        lines = (out / "profiles.jsonl").open("w")
    try:
        for prof in todo:
            row = measure(prof, size=size, bw=bw, check=check, algorithms=algorithms)
            rows.append(row)
            if lines is not None:
                lines.write(json.dumps(row) + "\n")
                lines.flush()
            bar.update(1, postfix=f"{prof[0]} p={prof[1]}")
    finally:
        bar.close()
        if lines is not None:
            lines.close()
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``optcc-mpi lab profiles`` (and ``python -m optcc_mpi.lab.profiles``)."""
    parser.description = __doc__.replace("``", "`")
    parser.epilog = (
        "examples:\n"
        "  optcc-mpi lab profiles --out docs/profiles     # all (minutes)\n"
        "  optcc-mpi lab profiles --family server --max-ranks 32 --no-verify\n"
        "  optcc-mpi lab profiles --large --out docs/profiles/large   # p = 256-1024\n"
        "  optcc-mpi lab profiles --draw 40 --seed 1 --no-verify   # unseen profiles\n"
    )
    parser.add_argument(
        "--family", action="append", choices=FAMILIES, help="repeatable; default all"
    )
    most = parser.add_argument(
        "--max-ranks",
        metavar="N",
        type=int_at_least(2, "the number of ranks"),
        default=128,
        help="largest number of ranks (default 128); --max-p is the old name",
    )
    alias(parser, most, "--max-p")
    parser.add_argument(
        "--size", type=positive_size_arg, default=1 << 30, help="bytes per rank (default 1G)"
    )
    parser.add_argument(
        "--bw",
        type=rate_arg,
        default=50e9,
        help="healthy rate, e.g. 50GB/s or 400gbit (default 50GB/s)",
    )
    parser.add_argument("--no-verify", action="store_true", help="skip the verifier")
    parser.add_argument(
        "--large",
        action="store_true",
        help="the profiles at p = 256 to 1024 instead (OptCC only, not verified: the "
        "verifier's cost grows as operations x p, and R2CCL's helper under a random "
        "vector carries every other rank's tail)",
    )
    parser.add_argument(
        "--draw",
        type=int_at_least(1, "the number of profiles"),
        metavar="N",
        help="N profiles drawn at random from the server, two-server and straggler "
        "families (p = 16 to --max-ranks) instead of the fixed list",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of --draw (default 0)")
    parser.add_argument("--out", type=Path, help="write profiles.jsonl and profiles.md here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_args(args: argparse.Namespace) -> int:
    """Measure the chosen profiles, print the summary and write it with ``--out``; exit
    status 1 if the verifier refuses any schedule."""
    if args.draw is not None and args.large:
        raise ArgumentError("--draw and --large do not go together")
    if args.large:
        pool = large_families()
    elif args.draw is not None:
        pool = drawn(args.draw, args.seed, args.max_ranks)
    else:
        pool = families(args.max_ranks)
    chosen = [x for x in pool if not args.family or x[0] in args.family]
    rows = run(
        chosen,
        size=args.size,
        bw=args.bw,
        check=not (args.no_verify or args.large),
        out=args.out,
        progress=not args.no_progress,
        algorithms=("optcc",) if args.large else ("optcc", "r2ccl"),
    )
    text = markdown(rows, args.command_line)
    print(text)
    if args.out is not None:
        (args.out / "profiles.md").write_text(text)
    bad = [r for r in rows if r.get("optcc_verified") is False or r.get("r2ccl_verified") is False]
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m optcc_mpi.lab.profiles``: the same as ``optcc-mpi lab profiles``."""
    return tool_main("optcc_mpi.lab.profiles", add_arguments, run_args, argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
