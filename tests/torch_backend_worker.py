"""One rank of the ``optcc`` backend's tests (tests/test_torch_backend.py), started by
torchrun (or by mpiexec for ``from_mpi``).

``python -m torch.distributed.run --standalone --nproc-per-node N
tests/torch_backend_worker.py SCENARIO OUTDIR``. Each rank writes what it saw to
``OUTDIR/SCENARIO-RANK.json``; the test judges. No barrier before teardown anywhere: a
rank that finishes first destroys its groups while the others still work, as in users'
scripts.

Scenarios
---------
``ops``
    ``dist.all_reduce`` on an ``optcc`` default group: every ReduceOp (AVG and PREMUL_SUM
    included) on every dtype the package reduces, several sizes, against a float64 (or
    exact) reference; asynchronous calls waited for out of order; coalesced; a group with
    options of its own; ``$OPTCC_ALGORITHM``; what ``last_stats`` and the Work say ran.
``errors``
    Ranks that disagree, ops and dtypes the backend cannot reduce: the error on each rank
    and whether the tensor changed; then a good call.
``passthrough``
    Every other collective through the ``optcc`` group against its expected values
    (``PASSTHROUGH_BACKEND=gloo``: the same on a gloo group, for comparison).
``ddp``
    DDP with no hook on the ``optcc`` group against DDP on a gloo group, with DDP's
    options, and the asynchronous hook on gloo: the final parameters.
``hsdp``
    FSDP2 on a 2 x (P/2) mesh, the replicate dimension on ``optcc``, against the same
    mesh on gloo: the final parameters.
``teardown``
    Groups made, used (backend, hook, plain gloo) and destroyed several times over in one
    process, then re-initialised.
``kill``
    Rank 1 is killed (SIGKILL) in the middle of a large all_reduce; the others record
    when they started it (the test times the job's end).
``linklog``
    ``OPTCC_LINKS=watch`` with ``OPTCC_LINKS_LOG``: the backend's calls watched and logged.
``from_mpi``
    Under mpiexec: ``init_process_group_from_mpi("optcc")`` and an all_reduce.
``semantics``
    What a user sees of each behaviour that once differed from gloo's (the methods of a
    process group in each form, sparse tensors and DDP over them, a barrier after async
    work, the library's own allreduce on the group while calls are queued, coalesced
    non-contiguous tensors, records per work, the options' timeout, monitored barriers,
    abort), on ``SEMANTICS_BACKEND`` (gloo or optcc): the test compares the two.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
import zlib
from pathlib import Path

SCENARIO, OUT = sys.argv[1], Path(sys.argv[2])
if SCENARIO != "from_mpi":
    sys.modules["mpi4py"] = None  # type: ignore[assignment]  # torchrun jobs have no MPI

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import optcc_mpi.torch as ot  # noqa: E402
from optcc_mpi import collectives  # noqa: E402
from optcc_mpi.torch.process_group import OptccOptions  # noqa: E402
from optcc_mpi.torch.work import OptccWork  # noqa: E402
from optcc_mpi.transports.distributed import transport  # noqa: E402

RED = dist.ReduceOp


def env_rank() -> tuple[int, int]:
    for r, s in (
        ("RANK", "WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ):
        if r in os.environ:
            return int(os.environ[r]), int(os.environ[s])
    return 0, 1


RANK, P = env_rank()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def contributions(dtype: torch.dtype, n: int, seed: int) -> list[torch.Tensor]:
    """Every rank's input (each rank makes them all: the reference needs them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(P):
        if dtype.is_complex:
            out.append(torch.randn(n, generator=g, dtype=torch.complex128).to(dtype))
        elif dtype.is_floating_point:
            out.append(torch.randn(n, generator=g, dtype=torch.float64).to(dtype))
        elif dtype == torch.bool:
            out.append(torch.randint(0, 2, (n,), generator=g).bool())
        else:
            out.append(torch.randint(-3, 4, (n,), generator=g).to(dtype))
    return out


def reference(xs: list[torch.Tensor], kind: object, factor: float) -> torch.Tensor:
    dtype = xs[0].dtype
    if not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
        # Integers wrap around as the tensor's type does: reduced in int64, then cast.
        stack64 = torch.stack([x.long() for x in xs])
        red = {RED.SUM: stack64.sum(0), RED.PRODUCT: stack64.prod(0)}.get(kind)
        if red is None:
            red = stack64.max(0).values if kind == RED.MAX else stack64.min(0).values
        return red.to(dtype).double()
    wide = torch.complex128 if xs[0].is_complex() else torch.float64
    stack = torch.stack([x.to(wide) for x in xs])
    if xs[0].dtype == torch.bool:
        any_, all_ = (stack != 0).any(0), (stack != 0).all(0)
        return {RED.SUM: any_, RED.MAX: any_, RED.PRODUCT: all_, RED.MIN: all_}[kind].to(wide)
    if kind == RED.SUM:
        return stack.sum(0)
    if kind == RED.AVG:
        return stack.sum(0) / P
    if kind == RED.PREMUL_SUM:
        return stack.sum(0) * factor
    if kind == RED.PRODUCT:
        return stack.prod(0)
    if kind == RED.MAX:
        return stack.real.max(0).values.to(wide)
    if kind == RED.MIN:
        return stack.real.min(0).values.to(wide)
    raise ValueError(kind)


def allowed(xs: list[torch.Tensor], kind: object) -> float:
    """Largest error allowed against the wide reference: exact for integers, bools, max
    and min; for sums and products a few roundings per rank in the tensor's precision."""
    dtype = xs[0].dtype
    if not (dtype.is_floating_point or dtype.is_complex) or kind in (RED.MAX, RED.MIN):
        return 0.0
    unit = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
    unit[torch.complex64] = 2.0**-24
    u = unit.get(dtype, 2.0**-53)
    mags = torch.stack(
        [x.to(torch.complex128 if x.is_complex() else torch.float64).abs() for x in xs]
    )
    scale = (mags.prod(0) if kind == RED.PRODUCT else mags.sum(0)).max().item()
    return 4 * P * u * max(scale, 1.0)


OPS = {
    "sum": RED.SUM, "avg": RED.AVG, "premul_sum": RED.PREMUL_SUM, "product": RED.PRODUCT,
    "max": RED.MAX, "min": RED.MIN,
}  # fmt: skip
DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
    torch.bool,
)  # fmt: skip


def applies(name: str, dtype: torch.dtype) -> bool:
    """Whether torch's reduction ``name`` is defined on ``dtype`` (as NCCL defines them)."""
    if name in ("avg", "premul_sum"):
        return dtype.is_floating_point or dtype.is_complex
    if dtype.is_complex:
        return name == "sum"  # product of complex: checked apart, max/min undefined
    return True


def ops_scenario() -> dict:
    dist.init_process_group("optcc")
    rows = []
    for dtype in DTYPES:
        for name, kind in OPS.items():
            if not applies(name, dtype):
                continue
            for n in (1, 1009, 70001):
                xs = contributions(dtype, n, seed=zlib.crc32(f"{dtype}{name}{n}".encode()))
                t = xs[RANK].clone()
                op = dist._make_nccl_premul_sum(0.5) if kind == RED.PREMUL_SUM else kind
                dist.all_reduce(t, op=op)
                ref = reference(xs, kind, 0.5)
                err = (t.to(ref.dtype) - ref).abs().max().item()
                stats = collectives.last_stats()
                rows.append({
                    "dtype": str(dtype), "op": name, "n": n, "error": err,
                    "bound": allowed(xs, kind), "digest": digest(t),
                    "algorithm": stats.get("algorithm"),
                })  # fmt: skip
    out: dict = {"rows": rows, "env_algorithm": os.environ.get("OPTCC_ALGORITHM")}
    # Whether the checks travelled on the board (every rank on this machine) or on gloo.
    out["board"] = transport(None).board is not None
    # Asynchronous: several calls in flight, waited for in reverse; each Work completes
    # with its own tensors, in call order on every rank.
    ts = [torch.full((50_000,), float(RANK + i)) for i in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    out["work_type"] = type(works[0]).__name__
    for w in reversed(works):
        assert w.wait()
    out["async"] = [t[0].item() for t in ts]
    fut = dist.all_reduce(torch.ones(8), async_op=True).get_future()
    out["future"] = fut.wait()[0].tolist()
    out["work_stats"] = works[-1].stats.get("algorithm")
    # Coalesced: one call, several tensors.
    cs = [torch.full((3,), 1.0 + RANK), torch.full((5,), 2.0), torch.full((1,), 3.0)]
    dist.all_reduce_coalesced(cs)
    out["coalesced"] = [c.tolist() for c in cs]
    # A group with options of its own, and a subgroup of the first two ranks.
    ring = dist.new_group(backend="optcc", pg_options=OptccOptions(algorithm="ring"))
    t = torch.ones(100_000)
    dist.all_reduce(t, group=ring)
    out["ring"] = [collectives.last_stats().get("algorithm"), t[0].item()]
    pair = dist.new_group([0, 1], backend="optcc")
    if RANK < 2:
        t = torch.ones(10)
        dist.all_reduce(t, group=pair)
        out["pair"] = t[0].item()
    # optcc_mpi's own entry points over the same group.
    t = torch.ones(10)
    ot.allreduce(t, average=True)
    out["ot_allreduce"] = t[0].item()
    out["backend"] = dist.get_backend()
    dist.destroy_process_group()
    # Made again after destroy.
    dist.init_process_group("optcc")
    t = torch.ones(10)
    dist.all_reduce(t)
    out["again"] = t[0].item()
    dist.destroy_process_group()
    return out


def errors_scenario() -> dict:
    dist.init_process_group("optcc")
    out: dict = {}
    last = RANK == P - 1

    def attempt(key: str, t: torch.Tensor, op: object = RED.SUM) -> None:
        before = t.clone()
        try:
            dist.all_reduce(t, op=op)
        except (ValueError, TypeError, RuntimeError) as exc:
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
        else:
            out[key] = {"error": None}
        out[key]["unchanged"] = bool(torch.equal(t, before))

    attempt("count", torch.ones(5 + last))
    attempt("dtype", torch.ones(8, dtype=torch.float64 if last else torch.float32))
    attempt("op", torch.ones(8), RED.MAX if last else RED.SUM)
    attempt("avg_vs_sum", torch.ones(8), RED.AVG if last else RED.SUM)
    attempt("uint16", torch.ones(8, dtype=torch.uint16))
    attempt("avg_int", torch.ones(8, dtype=torch.int32), RED.AVG)
    attempt("one_rank_bad_dtype", torch.ones(8, dtype=torch.uint32 if last else torch.int32))
    attempt("complex_max", torch.ones(8, dtype=torch.complex64), RED.MAX)
    # A failed call under DDP (a group whose algorithm differs on one rank): DDP's reducer
    # reads the work's future in C++, where the error must be an error (it once read the
    # exception object as its bucket and crashed with SIGSEGV).
    odd = dist.new_group(
        backend="optcc", pg_options=OptccOptions(algorithm="ring" if last else "auto")
    )
    model = torch.nn.parallel.DistributedDataParallel(build(), process_group=odd)
    try:
        model(torch.ones(4, 32)).sum().backward()
    except RuntimeError as exc:
        out["ddp"] = {"error": f"{type(exc).__name__}: {exc}"}
    else:
        out["ddp"] = {"error": None}
    dist.destroy_process_group(odd)
    t = torch.ones(8)
    dist.all_reduce(t)
    out["after"] = t.tolist()
    # The last rank takes the whole path, the others the short one (tensors.lane): the
    # same collectives, so the same bits and the same errors.
    world = dist.distributed_c10d._get_default_group()
    if last:
        world._lane = lambda tensor, op: None  # type: ignore[method-assign]
    mixed, errors = [], []
    for n in (3, 5_000, 70_001):  # in the check, gathered after it, gloo's AllReduce
        xs = [torch.arange(n, dtype=torch.float32) * (r + 1) / 7 for r in range(P)]
        for op in (RED.SUM, RED.AVG):
            ref = sum(x.double() for x in xs) / (P if op == RED.AVG else 1)
            for async_op in (False, True):
                t = xs[RANK].clone()
                work = dist.all_reduce(t, op=op, async_op=async_op)
                if async_op:
                    work.wait()
                errors.append(((t.double() - ref).abs().max() / ref.abs().max()).item())
                mixed.append(digest(t))
    out["mixed"], out["mixed_error"] = mixed, max(errors)
    attempt("mixed_count", torch.ones(5 + last))
    attempt("mixed_avg", torch.ones(8), RED.AVG if last else RED.SUM)
    if last:
        del world._lane
    dist.destroy_process_group()
    return out


def passthrough_scenario() -> dict:
    dist.init_process_group(os.environ.get("PASSTHROUGH_BACKEND", "optcc"))
    r, p = RANK, P
    got: dict = {}
    t = torch.full((3,), float(r))
    dist.broadcast(t, src=p - 1)
    got["broadcast"] = t.tolist() == [float(p - 1)] * 3
    outs = [torch.empty(2) for _ in range(p)]
    dist.all_gather(outs, torch.full((2,), float(r)))
    got["all_gather"] = [o[0].item() for o in outs] == list(map(float, range(p)))
    big = torch.empty(2 * p)
    dist.all_gather_into_tensor(big, torch.full((2,), float(r)))
    got["all_gather_into_tensor"] = big.tolist() == [float(i // 2) for i in range(2 * p)]
    o = torch.empty(2)
    dist.reduce_scatter(o, [torch.full((2,), float(i + r)) for i in range(p)])
    got["reduce_scatter"] = o.tolist() == [float(r * p + sum(range(p)))] * 2
    o = torch.empty(2)
    dist.reduce_scatter_tensor(o, torch.arange(2 * p, dtype=torch.float32))
    got["reduce_scatter_tensor"] = o.tolist() == [float(p * (2 * r)), float(p * (2 * r + 1))]
    outs = [torch.empty(1) for _ in range(p)]
    dist.all_to_all(outs, [torch.full((1,), float(10 * r + i)) for i in range(p)])
    got["all_to_all"] = [x.item() for x in outs] == [float(10 * i + r) for i in range(p)]
    o = torch.empty(p)
    dist.all_to_all_single(o, torch.arange(p, dtype=torch.float32) + 10 * r)
    got["all_to_all_single"] = o.tolist() == [float(10 * i + r) for i in range(p)]
    dist.barrier()
    got["barrier"] = True
    if r == 0:
        dist.send(torch.full((4,), 7.0), dst=1)
        got["send_recv"] = True
    elif r == 1:
        x = torch.empty(4)
        dist.recv(x, src=0)
        got["send_recv"] = x.tolist() == [7.0] * 4
    else:
        got["send_recv"] = True
    gl = [torch.empty(1) for _ in range(p)] if r == 0 else None
    dist.gather(torch.full((1,), float(r)), gl, dst=0)
    got["gather"] = r != 0 or [x.item() for x in gl] == list(map(float, range(p)))
    x = torch.empty(1)
    dist.scatter(x, [torch.full((1,), float(i)) for i in range(p)] if r == 0 else None, src=0)
    got["scatter"] = x.item() == float(r)
    x = torch.full((2,), float(r))
    dist.reduce(x, dst=0)
    got["reduce"] = r != 0 or x.tolist() == [float(sum(range(p)))] * 2
    objs: list = [None] * p
    dist.all_gather_object(objs, {"rank": r})
    got["all_gather_object"] = objs == [{"rank": i} for i in range(p)]
    dist.destroy_process_group()
    return got


def semantics_scenario() -> dict:
    """The same script on ``SEMANTICS_BACKEND`` (gloo or optcc): what a user sees of each
    behaviour the issue found different from gloo's. Values, not timings."""
    import datetime
    import threading

    import optcc_mpi

    name = os.environ.get("SEMANTICS_BACKEND", "optcc")
    dist.init_process_group(name)
    r, p = RANK, P
    pg = dist.group.WORLD
    got: dict = {}

    # 9. ProcessGroup methods called from Python in each form torch accepts
    t = torch.full((4,), float(r + 1))
    pg.allreduce([t]).wait()
    got["pg.allreduce([t])"] = t.tolist()
    t = torch.full((4,), float(r + 1))
    pg.allreduce([t], RED.MAX).wait()
    got["pg.allreduce([t], MAX)"] = t.tolist()
    t = torch.full((4,), float(r + 1))
    pg.allreduce(t).wait()
    got["pg.allreduce(t)"] = t.tolist()
    t = torch.full((2,), float(r))
    pg.broadcast([t]).wait()
    got["pg.broadcast([t])"] = t.tolist()
    t = torch.full((2,), float(r))
    pg.broadcast(t, p - 1).wait()
    got["pg.broadcast(t, root)"] = t.tolist()
    outs = [[torch.empty(2) for _ in range(p)]]
    pg.allgather(outs, [torch.full((2,), float(r))]).wait()
    got["pg.allgather(out, in)"] = [o.tolist() for o in outs[0]]
    pg.barrier().wait()
    got["pg.barrier()"] = True
    bucket = torch.full((8,), float(r))
    fut = pg.allreduce([bucket]).get_future()  # a custom DDP hook's form
    got["hook form"] = fut.wait()[0].tolist()

    # 1. sparse tensors, alone and in DDP
    i = torch.tensor([[0, 2 + r]]).reshape(1, 2)
    sp = torch.sparse_coo_tensor(i, torch.tensor([1.0 + r, 2.0]), (6,))
    dist.all_reduce(sp)
    got["sparse all_reduce"] = sp.to_dense().tolist()
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    ddp = torch.nn.parallel.DistributedDataParallel(emb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        ddp(torch.tensor([r, step + 3])).sum().backward()
        opt.step()
    got["ddp sparse embedding"] = emb.weight.detach().double().sum().item()

    # 2. a barrier completes after everything queued before it
    big = torch.ones(1 << 22)
    w = dist.all_reduce(big, async_op=True)
    dist.barrier()
    got["barrier after async: completed"] = w.is_completed()
    got["barrier after async: reduced"] = bool(torch.all(big == p))
    w.wait()

    # 3. the library's own allreduce on the group while async calls are queued
    xs = [torch.full((1 << 18,), float(k + r)) for k in range(4)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    arr = optcc_mpi.allreduce(np.full(1000, float(r)), comm=pg)
    for w in works:
        w.wait()
    got["optcc_mpi.allreduce(comm=group) while queued"] = [float(arr[0])] + [
        float(x[0]) for x in xs
    ]

    # 4. coalesced with a non-contiguous tensor
    a = torch.full((3,), float(r))
    b = torch.arange(6, dtype=torch.float32).reshape(2, 3) + r
    bt = b.t()
    dist.all_reduce_coalesced([a, bt])
    got["coalesced non-contiguous"] = [a.tolist(), bt.tolist()]
    # ... and alone in the call (a transpose; every other element of a vector, whose
    # other elements must stay as they were): reduced as in a pair, as gloo does
    v = torch.arange(10.0) + r
    lones = {"coalesced lone transpose": (b + 1).t(), "coalesced lone stride 2": v[::2]}
    for key, lone in lones.items():
        try:
            dist.all_reduce_coalesced([lone])
            got[key] = lone.tolist()
        except Exception as exc:  # noqa: BLE001 - recorded: the test compares with gloo
            got[key] = f"{type(exc).__name__}: {exc}"
    got["coalesced lone stride 2: the vector"] = v.tolist()

    # 6. each work's own record, groups used from two threads
    if name == "optcc":
        g1 = dist.new_group(backend="optcc", pg_options=OptccOptions(algorithm="ring"))
        g2 = dist.new_group(backend="optcc", pg_options=OptccOptions(algorithm="optcc"))
        seen: dict = {"ring": [], "optcc": []}

        def use(group: object, alg: str) -> None:
            for _ in range(6):
                w = dist.all_reduce(torch.ones(1 << 16), group=group, async_op=True)
                w.wait()
                seen[alg].append(w.stats.get("algorithm"))

        threads = [threading.Thread(target=use, args=a) for a in ((g1, "ring"), (g2, "optcc"))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        got["stats per work"] = {k: sorted(set(v)) for k, v in seen.items()}
        # 5. the group's timeout from OptccOptions
        g3 = dist.new_group(
            backend="optcc", pg_options=OptccOptions(timeout=datetime.timedelta(seconds=7))
        )
        got["options timeout"] = g3.timeout.total_seconds()
        for g in (g1, g2, g3):
            dist.destroy_process_group(g)

    # 7. monitored_barrier: torch's refusal by name, the group's own method
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        got["dist.monitored_barrier"] = "ok"
    except ValueError as exc:
        got["dist.monitored_barrier"] = "refused: " + str(exc)[:40]
    pg.monitored_barrier(datetime.timedelta(seconds=30), wait_all_ranks=True)
    got["group.monitored_barrier"] = "ok"

    # 8. abort: queued work fails at once, the process exits
    if name == "optcc":
        lone = dist.new_group(backend="optcc")
        dist.barrier()
        if r == 0:  # the others never call: rank 0's calls can only fail
            pending = [
                dist.all_reduce(torch.ones(1 << 16), group=lone, async_op=True) for _ in range(5)
            ]
            t0 = time.monotonic()
            lone.abort()
            errors = []
            for w in pending:
                try:
                    w.wait(datetime.timedelta(seconds=60))
                    errors.append("completed")
                except Exception as exc:  # noqa: BLE001 - recorded
                    errors.append(type(exc).__name__)
            got["abort: queued work"] = sorted(set(errors))
            got["abort: seconds"] = time.monotonic() - t0  # (recorded, not judged)
        # The others abort once rank 0 has seen its own abort's errors: a peer's abort
        # fails rank 0's waiting call too, with an error of its own (a lost peer).
        dist.barrier()
        if r != 0:
            lone.abort()
    dist.destroy_process_group()
    return got


def build(seed: int = 0, unused: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [
        torch.nn.Linear(32, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 1),
    ]
    net = torch.nn.Sequential(*layers)
    if unused:
        net.add_module("spare", torch.nn.Linear(4, 4))  # never in the forward pass
    return net


class Spare(torch.nn.Module):
    """``net`` run without its ``spare`` layer (if any): parameters DDP never sees used."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, mod in self.net.named_children():
            if name != "spare":
                x = mod(x)
        return x


def train_ddp(group: object, variant: str, steps: int = 8, hook: object = None) -> torch.Tensor:
    """DDP on ``group`` with one of DDP's options; the final parameters (float64)."""
    unused = variant == "find_unused_parameters"
    net = Spare(build(unused=unused))
    kw = {"bucket_cap_mb": 0.05, "process_group": group}
    if variant in ("static_graph", "gradient_as_bucket_view", "find_unused_parameters"):
        kw[variant] = True
    model = torch.nn.parallel.DistributedDataParallel(net, **kw)
    if hook is not None:
        model.register_comm_hook(state=group, hook=hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + RANK)
    for step in range(steps):
        x = torch.randn(16, 32, generator=g)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        if variant == "no_sync" and step % 2 == 0:
            with model.no_sync():  # accumulate locally, reduce on the next step
                torch.nn.functional.mse_loss(model(x), y).backward()
            continue
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([q.detach().reshape(-1).double() for q in model.parameters()])


def ddp_scenario() -> dict:
    dist.init_process_group("optcc")
    gloo = dist.new_group(backend="gloo")
    out: dict = {"variants": {}}
    for variant in (
        "plain",
        "static_graph",
        "gradient_as_bucket_view",
        "find_unused_parameters",
        "no_sync",
    ):
        ours = train_ddp(dist.group.WORLD, variant)
        ran = collectives.last_stats().get("transport")
        theirs = train_ddp(gloo, variant)
        start = torch.cat(
            [
                q.detach().reshape(-1).double()
                for q in Spare(build(unused=variant == "find_unused_parameters")).parameters()
            ]
        )
        out["variants"][variant] = {
            "diff": (ours - theirs).abs().max().item(),
            "scale": theirs.abs().max().item(),
            "moved": (ours - start).abs().max().item(),
            "digest": digest(ours),
            "transport": ran,
        }
    # The hook on a gloo group, asynchronous now: against DDP's own all-reduce.
    hooked = train_ddp(gloo, "plain", hook=ot.comm_hook(algorithm="optcc"))
    plain = train_ddp(gloo, "plain")
    out["hook"] = {
        "diff": (hooked - plain).abs().max().item(),
        "scale": plain.abs().max().item(),
        "digest": digest(hooked),
    }
    dist.destroy_process_group()
    return out


def hsdp_scenario() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    out: dict = {}
    shape = (P // 2, 2)
    # The replicate dimension with options of its own: the ring, so that what ran is known.
    optcc = ("optcc", OptccOptions(algorithm="ring"))
    for name, override in (("optcc", {"replicate": optcc}), ("gloo", {})):
        mesh = init_device_mesh(
            "cpu", shape, mesh_dim_names=("replicate", "shard"), backend_override=override
        )
        net = build(seed=3)
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(2000 + RANK)
        for _ in range(6):
            x = torch.randn(16, 32, generator=g)
            loss = torch.nn.functional.mse_loss(net(x), torch.cos(x.sum(1, keepdim=True)))
            loss.backward()
            opt.step()
            opt.zero_grad()
        full = torch.cat([q.full_tensor().detach().reshape(-1).double() for q in net.parameters()])
        out[name] = full
        out[name + "_backend"] = dist.get_backend(mesh.get_group("replicate"))
        if name == "optcc":
            out["ran"] = collectives.last_stats().get("algorithm")
    res = {
        "diff": (out["optcc"] - out["gloo"]).abs().max().item(),
        "scale": out["gloo"].abs().max().item(),
        "digest": digest(out["optcc"]),
        "replicate_backend": out["optcc_backend"],
        "ran": out["ran"],
    }
    dist.destroy_process_group()
    return res


def teardown_scenario() -> dict:
    """Make, use and destroy groups over and over: the optcc backend (with and without the
    hook on it, re-initialised from the environment as users do) and gloo with the hook.
    A gloo default group made again under torchrun needs a store prefix of its own:
    torch gives it the keys of the last one (docs/torch.md)."""
    rounds = int(os.environ.get("TEARDOWN_ROUNDS", "6"))
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), P, False)
    seen = []
    for i in range(rounds):
        kind = ("optcc", "gloo+hook", "optcc+hook")[i % 3]
        if kind == "gloo+hook":
            store = dist.PrefixStore(f"teardown-{i}", base)
            dist.init_process_group("gloo", store=store, rank=RANK, world_size=P)
        else:
            dist.init_process_group("optcc")
        net = torch.nn.parallel.DistributedDataParallel(build(seed=i), bucket_cap_mb=0.05)
        if kind.endswith("hook"):
            net.register_comm_hook(state=None, hook=ot.comm_hook())
        for _ in range(2):
            net(torch.randn(8, 32)).sum().backward()
        t = torch.ones(100_000)
        dist.all_reduce(t, async_op=True)  # left in flight: destroy lets it finish
        seen.append(kind)
        dist.destroy_process_group()
    return {"rounds": seen}


def kill_scenario() -> dict:
    dist.init_process_group("optcc")
    t = torch.ones(1 << 20)
    dist.all_reduce(t)  # everyone connected
    started = time.time()
    (OUT / f"kill-started-{RANK}.json").write_text(json.dumps({"at": started}))
    if RANK == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-job: the others are in the next call
    for _ in range(1000):
        dist.all_reduce(torch.ones(16 << 20))
    return {"survived": True}


def linklog_scenario() -> dict:
    """``OPTCC_LINKS=watch`` and ``OPTCC_LINKS_LOG`` in the environment (set by the test):
    the backend's calls are watched and rank 0 logs what they ran."""
    dist.init_process_group("optcc")
    for _ in range(6):
        t = torch.ones(1 << 18)
        dist.all_reduce(t)
    stats = collectives.last_stats()
    out = {"links": str(stats.get("links")), "algorithm": stats.get("algorithm")}
    dist.destroy_process_group()
    return out


def from_mpi_scenario() -> dict:
    ot.init_process_group_from_mpi("optcc")
    t = torch.full((1000,), float(RANK))
    dist.all_reduce(t)
    out = {"value": t[0].item(), "backend": dist.get_backend(), "size": dist.get_world_size()}
    dist.destroy_process_group()
    return out


def main() -> None:
    if os.environ.get("WORKER_DUMP_AFTER"):  # debugging a hang: every thread's stack
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["WORKER_DUMP_AFTER"]), exit=True)
    result = {
        "ops": ops_scenario,
        "errors": errors_scenario,
        "passthrough": passthrough_scenario,
        "ddp": ddp_scenario,
        "hsdp": hsdp_scenario,
        "teardown": teardown_scenario,
        "kill": kill_scenario,
        "linklog": linklog_scenario,
        "from_mpi": from_mpi_scenario,
        "semantics": semantics_scenario,
    }[SCENARIO]()
    result["work_class_ok"] = issubclass(OptccWork, dist.Work)
    (OUT / f"{SCENARIO}-{RANK}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
