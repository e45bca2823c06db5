"""The allreduce corpus: a fixed grid of calls and a digest of every result, to show that
a change left behaviour identical (issue 34's renames; any refactoring).

    mpiexec -n 4 python scripts/allreduce_corpus.py --out after.json
    torchrun --standalone --nproc-per-node 2 scripts/allreduce_corpus.py --torch --out t.json
    python scripts/allreduce_corpus.py --compare before.json after.json

Every algorithm (and ``auto``) on six dtypes, five ops, three sizes, healthy links and one
rank at half rate, with inputs seeded per rank and case (NaN and signed zeros included in
the floating ones); each case records the SHA-256 of rank 0's result bytes, whether every
rank got the same bytes, or the error the call raised. ``--torch``: the same over the
``optcc`` torch.distributed backend (``dist.all_reduce`` of CPU tensors, in place, waited
for and asynchronous; torch's ops, AVG included). ``--compare`` prints the cases that
differ and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import zlib

import numpy as np

DTYPES = ("float32", "float64", "float16", "int32", "int64", "uint8")
OPS = ("sum", "prod", "max", "min", "band")
SIZES = (1, 1009, 70001)
LINKS = (None, "0:0.5")


def contribution(dtype: str, n: int, rank: int, case: str) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(f"{case}/{rank}".encode()))
    if dtype.startswith("float"):
        x = rng.standard_normal(n).astype(dtype)
        if n > 8:
            x[:4] = [np.nan, -0.0, 0.0, np.inf if rank == 1 else -np.inf][:4]
        return x
    return rng.integers(0, 4, n).astype(dtype)


def run(out: str) -> int:
    from mpi4py import MPI

    import optcc_mpi

    comm = MPI.COMM_WORLD
    rows: dict[str, dict[str, object]] = {}
    for algorithm in optcc_mpi.ALGORITHMS:
        for links in LINKS:
            for dtype in DTYPES:
                for op in OPS:
                    for n in SIZES:
                        case = f"{algorithm}/{links}/{dtype}/{op}/{n}"
                        x = contribution(dtype, n, comm.rank, case)
                        row: dict[str, object] = {}
                        try:
                            y = optcc_mpi.allreduce(x, op=op, algorithm=algorithm, links=links)
                        except (ValueError, TypeError) as exc:
                            row["error"] = f"{type(exc).__name__}: {exc}"
                        else:
                            digest = hashlib.sha256(np.ascontiguousarray(y).tobytes()).hexdigest()
                            every = comm.allgather(digest)
                            row["digest"] = digest[:16]
                            row["same_on_every_rank"] = len(set(every)) == 1
                        rows[case] = row
    if comm.rank == 0:
        with open(out, "w") as f:
            json.dump({"ranks": comm.size, "cases": rows}, f, indent=0, sort_keys=True)
        print(f"{len(rows)} cases, {sum('error' in r for r in rows.values())} refused -> {out}")
    return 0


def run_torch(out: str) -> int:
    import torch
    import torch.distributed as dist

    import optcc_mpi.torch  # noqa: F401  (registers "optcc")

    dist.init_process_group("optcc")
    rank = dist.get_rank()
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
           "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}  # fmt: skip
    rows: dict[str, dict[str, object]] = {}
    for dtype in ("float32", "float64", "float16", "bfloat16", "int32", "int64"):
        for name, op in ops.items():
            for n in SIZES:
                for async_op in (False, True):
                    case = f"torch/{dtype}/{name}/{n}/{'async' if async_op else 'sync'}"
                    base = contribution("float64" if dtype == "bfloat16" else dtype, n, rank, case)
                    t = torch.from_numpy(base.copy()).to(getattr(torch, dtype))
                    row: dict[str, object] = {}
                    try:
                        work = dist.all_reduce(t, op=op, async_op=async_op)
                        if async_op:
                            work.wait()
                    except (ValueError, TypeError, RuntimeError) as exc:
                        row["error"] = f"{type(exc).__name__}: {exc}"
                    else:
                        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
                        digest = hashlib.sha256(raw).hexdigest()
                        every: list[object] = [None] * dist.get_world_size()
                        dist.all_gather_object(every, digest)
                        row["digest"] = digest[:16]
                        row["same_on_every_rank"] = len(set(every)) == 1
                    rows[case] = row
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"ranks": dist.get_world_size(), "cases": rows}, f, indent=0, sort_keys=True)
        print(f"{len(rows)} cases, {sum('error' in r for r in rows.values())} refused -> {out}")
    dist.destroy_process_group()
    return 0


def compare(before: str, after: str) -> int:
    a = json.load(open(before))["cases"]
    b = json.load(open(after))["cases"]
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    for k in differ[:20]:
        print(f"{k}: {a.get(k)} -> {b.get(k)}")
    print(f"{len(set(a) | set(b))} cases, {len(differ)} differences")
    return 1 if differ else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="run the corpus (under mpiexec) and write its digests here")
    ap.add_argument("--torch", action="store_true", help="over the optcc torch backend")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("give --out or --compare")
    return run_torch(args.out) if args.torch else run(args.out)


if __name__ == "__main__":
    sys.exit(main())
