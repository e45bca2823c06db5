"""One rank of ``scripts/gpu_check.py``'s torch.distributed checks: no MPI, one GPU per rank.

``gpu_check.py`` starts it in two ways:

* a world of one, as a plain process whose process group is made over a ``FileStore``
  (``--store FILE``): ``python scripts/gpu_check_rank.py --device cuda --out DIR --store F``;
* K ranks under ``torchrun --standalone --nproc-per-node K`` (its TCPStore on localhost),
  rank r on GPU r: ``... --device cuda --out DIR --ddp``.

With ``--device cuda`` the process group is NCCL and the tensors are CUDA tensors; with
``--device cpu`` (what ``gpu_check.py --cpu`` runs, to test the checks where there is no
GPU) it is gloo, and the transport is made to use NCCL's executor driver (``caps.completion =
"grouped"``: each level's messages posted as one group, nothing waited for on the host)
so that the code NCCL runs is the code checked.

Each rank writes ``DIR/rank-R.json``; :mod:`gpu_check` judges the ranks together (every
result against a float64 reference, the same bytes on every rank, on the device, no host
synchronisation where messages travel). What a rank records per call:

``error``/``bound``
    Largest difference from the float64 reference and what the dtype allows (0 for the
    exact reductions; ``inf`` if NaNs or the signs of zeros differ).
``on_device``/``same_memory``/``input_kept``
    Whether the result is on the input's device, in the input's memory (expected in place;
    out of place a new tensor is), and the input unchanged (out of place).
``syncs``/``host_copies``
    What :class:`HostSyncs` saw during the call (explicit synchronisations, and on CUDA
    every synchronising operation torch's sync debug mode reports; device-to-host copies
    by TorchArrayOps).
``messages``/``groups``
    Point-to-point messages the executor sent and received, and the groups (``batch``
    calls) it posted them in.
"""

from __future__ import annotations

import argparse
import functools
import dataclasses
import hashlib
import json
import os
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.modules["mpi4py"] = None  # type: ignore[assignment]  # MPI-free: import mpi4py fails

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import optcc_mpi  # noqa: E402
import optcc_mpi.torch as ot  # noqa: E402
from optcc_mpi import algorithms, collectives, transports  # noqa: E402
from optcc_mpi.transports import Completion  # noqa: E402
from optcc_mpi.arrays import TorchArrayOps  # noqa: E402
from optcc_mpi.reductions import reduce_with  # noqa: E402

#: (dtype, op) pairs every algorithm runs: the issue's four dtypes and more, every op kind.
CASES = (
    ("float32", "sum"),
    ("bfloat16", "sum"),
    ("float16", "sum"),
    ("int64", "sum"),
    ("float64", "sum"),
    ("float32", "max"),
    ("bfloat16", "min"),
    ("float64", "min"),
    ("float32", "prod"),
    ("int64", "bor"),
    ("int64", "max"),
)
#: Unit roundoff of the float types (a sum's error bound is a multiple of it).
UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
#: Words that the error of a bad-device call must contain, by process-group backend.
DEVICE_ERROR = {
    "nccl": "NCCL process group moves CUDA tensors",
    "gloo": "gloo process group moves CPU tensors",
}


class HostSyncs:
    """Counts what makes the host wait for the device while a call runs.

    Explicit waits are counted by wrapping ``torch.cuda.synchronize``, ``Stream.synchronize``,
    ``Event.synchronize`` and :meth:`TorchArrayOps.synchronize`; device-to-host copies by
    wrapping :meth:`TorchArrayOps.to_host`. On CUDA, torch's sync debug mode also reports
    every synchronising operation (a ``.item()``, a copy to the host, ...) as a warning,
    and each is counted. Use as a context manager; ``syncs`` and ``host_copies`` hold the
    counts of the last ``with`` block.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.syncs = 0
        self.host_copies = 0
        self._saved: list[tuple[Any, str, Any]] = []
        self._warnings: Any = None
        self._caught: list[Any] = []

    def _wrap(self, owner: Any, name: str, counter: str) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))

        def counted(*args: Any, **kwargs: Any) -> Any:
            setattr(self, counter, getattr(self, counter) + 1)
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    def __enter__(self) -> HostSyncs:
        self.syncs = self.host_copies = 0
        self._wrap(TorchArrayOps, "synchronize", "syncs")
        self._wrap(TorchArrayOps, "to_host", "host_copies")
        if self.cuda:
            self._wrap(torch.cuda, "synchronize", "syncs")
            self._wrap(torch.cuda.Stream, "synchronize", "syncs")
            self._wrap(torch.cuda.Event, "synchronize", "syncs")
            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)
            self.syncs += sum("synchroniz" in str(w.message) for w in self._caught)
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


class GroupCounter:
    """Counts the groups of messages a transport posts (its ``batch`` calls, which only the
    grouped driver makes), by wrapping the method on the instance."""

    def __init__(self, wire: Any) -> None:
        self.count = 0
        original = wire.batch

        def counted(posts: list[Any]) -> list[Any]:
            self.count += 1
            return original(posts)

        wire.batch = counted


def digest(t: torch.Tensor) -> str:
    """Hash of a tensor's bytes (copied to the host)."""
    raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


def inputs(dtype: torch.dtype, op: str, n: int, p: int, seed: int) -> list[torch.Tensor]:
    """Every rank's contribution, on the CPU (each rank makes them all: the reference needs
    them). Floats carry zeros of both signs; max/min inputs also a NaN on one rank."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(p):
        if dtype.is_floating_point:
            x = torch.randn(n, generator=g, dtype=torch.float64)
            if op == "prod":
                x = 1 + x.abs() / 8
            else:
                x[:: max(1, n // 7)] = -0.0 if r % 2 else 0.0
                if op in ("max", "min") and r == p - 1 and n > 2:
                    x[n // 2] = float("nan")
            out.append(x.to(dtype))
        else:
            out.append(torch.randint(-50, 50, (n,), generator=g).to(dtype))
    return out


def reference(xs: list[torch.Tensor], op: str) -> np.ndarray:
    """The reduction in float64 (int64 for integers), in rank order, with the package's
    rules for NaN and signed zeros (:func:`optcc_mpi.reductions.reduce_with`)."""
    wide = np.int64 if not xs[0].dtype.is_floating_point else np.float64
    acc = xs[0].to(torch.float64 if wide is np.float64 else torch.int64).numpy().copy()
    for x in xs[1:]:
        reduce_with(np, op, acc, x.to(torch.float64 if wide is np.float64 else torch.int64).numpy())
    return acc


def error_of(got: torch.Tensor, ref: np.ndarray, exact: bool) -> float:
    """Largest difference of ``got`` from ``ref``; inf where NaNs differ, or, for an exact
    reduction, where the signs of zeros differ."""
    g = got.detach().cpu().to(torch.float64 if ref.dtype.kind == "f" else torch.int64).numpy()
    if ref.dtype.kind != "f":
        return float(np.max(np.abs(g - ref))) if g.size else 0.0
    nan_g, nan_r = np.isnan(g), np.isnan(ref)
    if (nan_g != nan_r).any():
        return float("inf")
    keep = ~nan_r
    if exact and (np.signbit(g[keep]) != np.signbit(ref[keep])).any():
        return float("inf")
    return float(np.max(np.abs(g[keep] - ref[keep]), initial=0.0))


def bound(xs: list[torch.Tensor], op: str, name: str) -> float:
    """What the dtype allows against float64: 0 for integers, max and min; for a float sum
    or product, p - 1 roundings (two each for 16-bit types) of the largest magnitude."""
    if name not in UNIT or op not in ("sum", "prod"):
        return 0.0
    stack = torch.stack([x.double().abs() for x in xs])
    scale = (stack.sum(0) if op == "sum" else stack.prod(0)).max().item()
    return 2 * len(xs) * UNIT[name] * scale


class Rank:
    """This rank's process group, device and counters."""

    def __init__(self, device: str, store: str | None) -> None:
        self.cuda = device == "cuda"
        self.backend = "nccl" if self.cuda else "gloo"
        if store is None:  # torchrun: its variables, its TCPStore on localhost
            local = int(os.environ.get("LOCAL_RANK", "0"))
            self.device = torch.device("cuda", local) if self.cuda else torch.device("cpu")
            if self.cuda:
                torch.cuda.set_device(self.device)
            dist.init_process_group(self.backend)
        else:  # a world of one over a FileStore
            self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
            if self.cuda:
                torch.cuda.set_device(self.device)
            dist.init_process_group(
                self.backend, store=dist.FileStore(store, 1), rank=0, world_size=1
            )
        self.rank, self.p = dist.get_rank(), dist.get_world_size()
        self.group = dist.group.WORLD
        self.wire = transports.of(self.group)
        if not self.cuda:
            self.wire.caps = dataclasses.replace(
                self.wire.caps, completion=Completion("grouped")
            )  # NCCL's driver, run over gloo
        self.groups = GroupCounter(self.wire)
        self.syncs = HostSyncs(self.cuda)

    def links(self, algorithm: str) -> str | None:
        """A degraded last rank (not for the library's own AllReduce, nor a world of one)."""
        return f"{self.p - 1}:0.5" if self.p > 1 and algorithm != "native" else None

    def call(self, fn: Any) -> tuple[Any, dict[str, Any]]:
        """``fn()`` counted: its result and what it cost the host."""
        before = self.groups.count
        with self.syncs:
            result = fn()
        stats = collectives.last_stats()
        ex = stats.get("stats")
        return result, {
            "ran": stats.get("algorithm"),
            "transport": stats.get("transport"),
            "observe": self.wire.caps.completion.value,
            "syncs": self.syncs.syncs,
            "host_copies": self.syncs.host_copies,
            "messages": 0 if ex is None else ex.messages_sent + ex.messages_received,
            "groups": self.groups.count - before,
        }


def collectives_scenario(me: Rank) -> list[dict[str, Any]]:
    """Every registered algorithm and ``auto``: each case and size in place, and one call
    out of place."""
    rows = []
    sizes = (1, me.p + 1, 4097, 1 << 18)
    names = ["auto", *algorithms.names()]
    # The first calls make the process group's communicators (NCCL's lazily, at the first
    # message and the first all_reduce): not what is measured.
    for alg in ("ring", "native"):
        ot.allreduce(torch.ones(4096, device=me.device), algorithm=alg)
    for alg in names:
        links = me.links(alg)
        for name, op in CASES:
            dtype = getattr(torch, name)
            for n in sizes:
                xs = inputs(dtype, op, n, me.p, seed=zlib.crc32(f"{name}{op}{n}".encode()))
                t = xs[me.rank].to(me.device, copy=True)  # xs stay the reference's
                got, rec = me.call(
                    functools.partial(ot.allreduce, t, op, algorithm=alg, links=links)
                )
                exact = bound(xs, op, name) == 0.0
                rows.append(
                    {
                        "algorithm": alg,
                        "kind": "in place",
                        "dtype": name,
                        "op": op,
                        "n": n,
                        "error": error_of(got, reference(xs, op), exact),
                        "bound": bound(xs, op, name),
                        "digest": digest(got),
                        "on_device": got.device == me.device,
                        "same_memory": got.data_ptr() == t.data_ptr(),
                        "input_kept": True,
                        **rec,
                    }
                )
        xs = inputs(torch.float32, "sum", 4099, me.p, seed=5)
        t = xs[me.rank].to(me.device, copy=True)  # xs stay the reference's
        kept = t.clone()
        got, rec = me.call(
            functools.partial(optcc_mpi.allreduce, t, comm=me.group, algorithm=alg, links=links)
        )
        rows.append(
            {
                "algorithm": alg,
                "kind": "out of place",
                "dtype": "float32",
                "op": "sum",
                "n": 4099,
                "error": error_of(got, reference(xs, "sum"), False),
                "bound": bound(xs, "sum", "float32"),
                "digest": digest(got),
                "on_device": got.device == me.device,
                "same_memory": got.data_ptr() == t.data_ptr(),
                "input_kept": bool(torch.equal(t, kept)),
                **rec,
            }
        )
    return rows


def errors_scenario(me: Rank) -> dict[str, Any]:
    """The last rank passes a tensor on a device its process group cannot move: every rank
    raises, nothing changes, and the next call works."""
    wrong = torch.device("cpu") if me.cuda else torch.device("meta")
    t = torch.ones(8, device=wrong if me.rank == me.p - 1 else me.device)
    before = t.clone() if t.device.type != "meta" else None
    out: dict[str, Any] = {"expect": DEVICE_ERROR[me.backend]}
    try:
        ot.allreduce(t)
    except (ValueError, TypeError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    else:
        out["error"] = None
    out["unchanged"] = True if before is None else bool(torch.equal(t, before))
    t = torch.ones(8, device=me.device)
    ot.allreduce(t)
    out["after"] = t.cpu().tolist()
    return out


def train(me: Rank, hook: Any, steps: int = 20) -> torch.Tensor:
    """DDP training of a small model (about 1 M parameters), the same weights everywhere,
    per-rank data; the final parameters as one float64 vector on the host."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 960),
        torch.nn.Tanh(), torch.nn.Linear(960, 1),
    ).to(me.device)  # fmt: skip
    ids = [me.device.index] if me.cuda else None
    model = torch.nn.parallel.DistributedDataParallel(net, device_ids=ids, bucket_cap_mb=1)
    if hook is not None:
        model.register_comm_hook(state=None, hook=hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + me.rank)
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g).to(me.device)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([q.detach().reshape(-1).double().cpu() for q in model.parameters()])


def ddp_scenario(me: Rank) -> dict[str, Any]:
    """DDP with the hook (OptCC, the last rank at half rate) against DDP's own all-reduce."""
    ours = train(me, ot.comm_hook(algorithm="optcc", links=me.links("optcc")))
    ran = collectives.last_stats()
    theirs = train(me, None)
    start = train(me, None, steps=0)
    return {
        "ours": hashlib.sha256(ours.numpy().tobytes()).hexdigest()[:16],
        "diff": (ours - theirs).abs().max().item(),
        "scale": theirs.abs().max().item(),
        "moved": (ours - start).abs().max().item(),
        "ran": ran.get("algorithm"),
        "links": str(ran.get("links")),
        "transport": ran.get("transport"),
        "parameters": ours.numel(),
    }


def describe(me: Rank) -> dict[str, Any]:
    """What this rank ran on."""
    info: dict[str, Any] = {
        "rank": me.rank,
        "world": me.p,
        "device": str(me.device),
        "backend": me.backend,
        "torch": torch.__version__,
        "observe": me.wire.caps.completion.value,
    }
    if me.cuda:
        info["gpu"] = torch.cuda.get_device_name(me.device)
        version = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--out", type=Path, required=True, help="folder for rank-R.json")
    ap.add_argument("--store", help="a world of one over this FileStore (else torchrun's)")
    ap.add_argument("--ddp", action="store_true", help="also DDP with the hook against DDP")
    args = ap.parse_args(argv)
    me = Rank(args.device, args.store)
    record: dict[str, Any] = {**describe(me), "rows": collectives_scenario(me)}
    record["errors"] = errors_scenario(me)
    if args.ddp:
        record["ddp"] = ddp_scenario(me)
    record["mpi_loaded"] = "mpi4py.MPI" in sys.modules
    (args.out / f"rank-{me.rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
