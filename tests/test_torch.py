"""optcc_mpi.torch: in-place AllReduce of tensors and the DDP communication hook.

Serial tests (plain pytest) cover conversion and argument errors on one rank; the MPI
tests (``make test`` runs them at 2, 3, 4, 5 and 8 ranks) check results against float64
references, bit-identity across ranks, and DDP with the hook against DDP's own all-reduce.

PyTorch is a test dependency (``make install`` brings the CPU build). Without it these
tests skip, except where ``$CI`` is set: there a missing torch fails the run.
"""

from __future__ import annotations

import datetime
import os
import sys
import zlib

import ml_dtypes
import numpy as np
import pytest

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover - only where torch is absent
    if os.environ.get("CI"):
        raise ImportError(
            f"CI is set but PyTorch is missing ({exc}): `make install` installs it from "
            "requirements.txt; the torch tests must run in CI"
        ) from exc
    pytest.skip(f"PyTorch is not installed ({exc})", allow_module_level=True)

import optcc_mpi
import optcc_mpi.torch as ot
from optcc_mpi.errors import ArgumentError, ArgumentTypeError

MPI = pytest.importorskip("mpi4py.MPI")

#: The dtypes DDP buckets and optimizer states come in, and the integers.
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64]
#: Unit roundoff of each float type.
UNIT = {
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float32: 2.0**-24,
    torch.float64: 2.0**-53,
}
ALGS = [
    "auto",
    "optcc",
]  # auto: native below 256 KiB, a schedule above; the rest in test_collectives


def world() -> tuple[object, int, int]:
    comm = MPI.COMM_WORLD
    return comm, comm.Get_rank(), comm.Get_size()


def contributions(dtype: torch.dtype, n: int, p: int, seed: int) -> list[torch.Tensor]:
    """Every rank's tensor, computable on every rank without communication."""
    out = []
    for r in range(p):
        g = np.random.default_rng([seed, r, n])
        if dtype in INTS:
            out.append(torch.from_numpy(g.integers(-1000, 1000, n)).to(dtype))
        else:
            out.append(torch.from_numpy(g.standard_normal(n)).to(dtype))
    return out


def digest(t: torch.Tensor) -> int:
    """CRC of the tensor's bytes (bfloat16 through its 16-bit words)."""
    raw = t.detach().contiguous().reshape(-1)
    if raw.dtype == torch.bfloat16:
        raw = raw.view(torch.int16)
    return zlib.crc32(raw.numpy().tobytes())


def same_everywhere(comm: object, t: torch.Tensor) -> None:
    digests = comm.allgather(digest(t))
    assert len(set(digests)) == 1, f"results differ across ranks: {digests}"


def data_address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> None:
    # Up to 8 ranks share 2 cores: PyTorch's intra-op threads would only fight.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def process_group() -> object:
    """torch.distributed's default group over COMM_WORLD (gloo), for DDP."""
    group = ot.init_process_group_from_mpi("gloo", timeout=datetime.timedelta(seconds=120))
    yield group
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- serial


def test_module_name_does_not_shadow_torch() -> None:
    """``optcc_mpi.torch`` imports the real PyTorch, and PyTorch is not our module."""
    assert ot.torch is sys.modules["torch"]
    assert ot.torch.__file__ != ot.__file__
    assert hasattr(ot.torch, "nn")


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_as_array_is_a_view(dtype: torch.dtype) -> None:
    """CPU tensors become NumPy arrays over the same memory, in every supported dtype."""
    t = torch.arange(12, dtype=dtype).reshape(3, 4)
    arr = ot.as_array(t)
    assert data_address(arr) == t.data_ptr()
    assert arr.shape == (12,)
    expect = ml_dtypes.bfloat16 if dtype == torch.bfloat16 else t.numpy().dtype
    assert arr.dtype == np.dtype(expect)
    arr[5] = 100
    assert t[1, 1].item() == 100  # a write through the view is a write to the tensor
    # A tensor that requires grad gives a view too (of its data).
    if dtype.is_floating_point:
        w = torch.zeros(4, dtype=dtype, requires_grad=True)
        assert data_address(ot.as_array(w)) == w.data_ptr()


def test_as_array_rejects() -> None:
    with pytest.raises(ArgumentTypeError, match="expected a torch.Tensor"):
        ot.as_array(np.zeros(3))
    with pytest.raises(ArgumentError, match="not contiguous"):
        ot.as_array(torch.zeros(3, 4).t())
    with pytest.raises(ArgumentError, match="dense"):
        ot.as_array(torch.zeros(3, 4).to_sparse())
    with pytest.raises(ArgumentError, match="conjugate"):
        ot.as_array(torch.zeros(3, dtype=torch.complex64).conj())
    with pytest.raises(ArgumentError, match="'meta'"):
        ot.as_array(torch.zeros(3, device="meta"))
    with pytest.raises(ArgumentTypeError, match="float8"):
        ot.as_array(torch.zeros(3).to(torch.float8_e4m3fn))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"op": "max", "average": True}, ArgumentError, "op='max'"),
        ({"average": 1}, ArgumentTypeError, "average must be True or False"),
        ({"op": "median"}, ArgumentError, "unsupported op 'median'"),
        ({"algorithm": "fastest"}, ArgumentError, "unknown algorithm 'fastest'"),
        ({"algorithm": 3}, ArgumentTypeError, "algorithm must be a string"),
        ({"links": "1:0.5"}, ArgumentError, "outside the communicator of size 1"),
        ({"links": "1=0.5"}, ArgumentError, "cannot parse"),
        ({"links": 0.5}, ArgumentTypeError, "links must be"),
    ],
)
def test_allreduce_argument_errors(kwargs: dict, error: type, match: str) -> None:
    """Bad arguments raise our errors, naming what was passed, and leave the tensor alone."""
    t = torch.arange(6, dtype=torch.float16)
    before = t.clone()
    with pytest.raises(error, match=match):
        ot.allreduce(t, comm=MPI.COMM_SELF, **kwargs)
    assert torch.equal(t, before)


def test_allreduce_rejects_integer_average_and_bad_comm() -> None:
    t = torch.arange(6)
    with pytest.raises(ArgumentError, match="floating-point tensor, not torch.int64"):
        ot.allreduce(t, average=True, comm=MPI.COMM_SELF)
    with pytest.raises(ArgumentTypeError, match="mpi4py communicator"):
        ot.allreduce(t, comm="world")
    with pytest.raises(ArgumentTypeError, match="mpi4py communicator"):
        ot.allreduce(t, comm=MPI.COMM_NULL)
    assert torch.equal(t, torch.arange(6))


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_allreduce_one_rank_in_place(dtype: torch.dtype) -> None:
    """On one rank the sum is the tensor itself, written through the same memory."""
    t = contributions(dtype, 101, 1, 7)[0]
    before, ptr = t.clone(), t.data_ptr()
    assert ot.allreduce(t, algorithm="ring", comm=MPI.COMM_SELF) is t
    assert t.data_ptr() == ptr and torch.equal(t, before)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"algorithm": "fastest"}, ArgumentError, "unknown algorithm 'fastest'"),
        ({"links": "1:0.5"}, ArgumentError, "outside the communicator of size 1"),
        ({"links": "0:2"}, ArgumentError, "fraction"),
        ({"links": [1]}, ArgumentTypeError, "links must be"),
        ({"comm": 42}, ArgumentTypeError, "mpi4py communicator"),
    ],
)
def test_comm_hook_argument_errors(kwargs: dict, error: type, match: str) -> None:
    """The hook's arguments are checked when it is made, not in the first backward pass."""
    kwargs.setdefault("comm", MPI.COMM_SELF)
    with pytest.raises(error, match=match):
        ot.comm_hook(**kwargs)


def test_init_process_group_argument_errors() -> None:
    with pytest.raises(ArgumentError, match="backend must be a string"):
        ot.init_process_group_from_mpi(backend=None, comm=MPI.COMM_SELF)
    with pytest.raises(ArgumentTypeError, match="mpi4py communicator"):
        ot.init_process_group_from_mpi(comm=object())
    assert not dist.is_initialized()


def test_init_process_group_bad_master_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_PORT", "29500x")
    with pytest.raises(ArgumentError, match="MASTER_PORT='29500x' is not a port number"):
        ot.init_process_group_from_mpi(comm=MPI.COMM_SELF)
    assert not dist.is_initialized()


@pytest.mark.timeout(120)
def test_hook_registers_with_ddp_on_one_rank() -> None:
    """DDP accepts the hook (it checks the annotations) and trains with it on one rank
    exactly as without it: dividing by 1 and summing one rank change nothing."""
    group = ot.init_process_group_from_mpi(comm=MPI.COMM_SELF)
    try:
        assert dist.get_world_size() == 1 and group is dist.group.WORLD
        # A second call with matching ranks returns the same group.
        assert ot.init_process_group_from_mpi(comm=MPI.COMM_SELF) is group
        a = train(None, torch.float32, steps=3)
        b = train(ot.comm_hook(comm=MPI.COMM_SELF), torch.float32, steps=3)
        assert torch.equal(a, b)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- MPI


def check_mean_or_sum(
    t: torch.Tensor, xs: list[torch.Tensor], dtype: torch.dtype, mean: bool
) -> None:
    """Against float64: integers exactly; floats within the rounding bound."""
    ref = np.sum([x.double().numpy() for x in xs], axis=0)
    got = t.double().numpy()
    p = len(xs)
    if dtype in INTS:
        np.testing.assert_array_equal(got, ref)
        return
    scale = np.sum([np.abs(x.double().numpy()) for x in xs], axis=0)
    if mean:
        ref, scale = ref / p, scale / p
    # p-1 additions each rounding twice (float32, then the type) for 16-bit types, once
    # otherwise, plus the division by p (one rounding per term when done first).
    tol = (2 * (p - 1) + p + 1) * UNIT[dtype] * scale + 1e-300
    bad = np.abs(got - ref) > tol
    assert not bad.any(), (
        f"{bad.sum()} elements beyond the error bound, worst {np.abs(got - ref).max()}"
    )


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_allreduce_in_place(dtype: torch.dtype, algorithm: str) -> None:
    """Sum in the tensor's own memory against float64, the same bits on every rank, for
    a degraded profile; then the average."""
    comm, rank, p = world()
    for n in (1, p + 1, 1009, 70001):
        xs = contributions(dtype, n, p, 11)
        t = xs[rank].clone().reshape(-1, 1) if n % 2 else xs[rank].clone()
        ptr = t.data_ptr()
        assert ot.allreduce(t, algorithm=algorithm, links="1:0.5") is t
        assert t.data_ptr() == ptr
        check_mean_or_sum(t.reshape(-1), xs, dtype, mean=False)
        same_everywhere(comm, t)
        if dtype in FLOATS:
            t = xs[rank].clone()
            ot.allreduce(t, algorithm=algorithm, links="1:0.5", average=True)
            check_mean_or_sum(t, xs, dtype, mean=True)
            same_everywhere(comm, t)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["max", "min"])
def test_allreduce_max_min(op: str) -> None:
    comm, rank, p = world()
    xs = contributions(torch.float32, 1009, p, 12)
    t = xs[rank].clone()
    ot.allreduce(t, op, algorithm="optcc", links="1:0.5")
    ref = getattr(torch.stack(xs), op)(dim=0).values
    assert torch.equal(t, ref)
    same_everywhere(comm, t)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_allreduce_requires_grad_leaf() -> None:
    """A parameter (a leaf that requires grad) is reduced in place, like its .data."""
    comm, rank, p = world()
    w = torch.nn.Parameter(torch.full((10,), float(rank)))
    ot.allreduce(w, average=True)
    assert w.requires_grad
    assert torch.equal(w.detach(), torch.full((10,), (p - 1) / 2))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_allreduce_errors_on_every_rank() -> None:
    """One rank's bad tensor, or ranks that disagree, raise on every rank before any
    tensor changes; nothing hangs."""
    comm, rank, p = world()

    def attempt(t: torch.Tensor, **kw: object) -> str:
        before = t.clone()
        with pytest.raises(ArgumentError) as info:
            ot.allreduce(t, **kw)
        assert torch.equal(t, before), "the tensor changed before the error"
        return str(info.value)

    # Rank 1 passes a transposed (non-contiguous) view.
    t = torch.ones(4, 3).t() if rank == 1 else torch.ones(3, 4)
    msg = attempt(t)
    assert "not contiguous" in msg
    if rank != 1:
        assert "arguments rejected" in msg and "(rank 1)" in msg
    # Element counts differ.
    assert "element count differs" in attempt(torch.ones(5 + (rank == p - 1)))
    # A bfloat16 average divides before the sum: a disagreement found after the division
    # would leave the tensor modified, so it must be found before.
    dtype = torch.bfloat16 if rank else torch.float16
    assert "dtype differs" in attempt(torch.ones(8, dtype=dtype), average=True)
    assert "average differs" in attempt(torch.ones(8, dtype=torch.bfloat16), average=rank == 0)
    links = "1:0.5" if rank else "1:0.25"
    assert "link profile differs" in attempt(torch.ones(8), links=links)
    # After all that, a good call still works.
    t = torch.ones(8)
    ot.allreduce(t)
    assert torch.equal(t, torch.full((8,), float(p)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_init_process_group_one_bad_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad $MASTER_PORT on one rank is an error on every rank, not a hang."""
    comm, rank, p = world()
    if rank == p - 1:
        monkeypatch.setenv("MASTER_PORT", "70000")
    with pytest.raises(ArgumentError, match=rf"MASTER_PORT='70000' .*\(rank {p - 1}\)"):
        ot.init_process_group_from_mpi()


class Bucket:
    """What the hook uses of ``torch.distributed.GradBucket``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self._tensor


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_hook_averages_a_bucket(dtype: torch.dtype) -> None:
    """The hook returns a completed future holding the bucket, averaged in place: within
    the rounding bound of the float64 mean, the same bits on every rank."""
    comm, rank, p = world()
    hook = ot.comm_hook(algorithm="optcc", links="1:0.5")
    xs = contributions(dtype, 5003, p, 13)
    bucket = xs[rank].clone()
    fut = hook(None, Bucket(bucket))
    assert isinstance(fut, torch.futures.Future) and fut.done()
    assert fut.value() is bucket
    check_mean_or_sum(bucket, xs, dtype, mean=True)
    same_everywhere(comm, bucket)
    # The division comes first, in the bucket's dtype, as in DDP's default hook: the
    # result is the sum of the rounded quotients within the bound for the additions.
    quotients = torch.stack([x / p for x in xs]).double()
    tol = 2 * (p - 1) * UNIT[dtype] * quotients.abs().sum(0) + 1e-300
    assert ((bucket.double() - quotients.sum(0)).abs() <= tol).all()


def train(
    hook: object, dtype: torch.dtype, steps: int = 10, bucket_mb: float = 0.001
) -> torch.Tensor:
    """DDP training of a small MLP, the same seed for the weights everywhere and per-rank
    data; returns the final parameters as one float64 vector."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4), torch.nn.Tanh(),
        torch.nn.Linear(4, 1),
    ).to(dtype)  # fmt: skip
    # Small buckets: several per step, so the hook sees more than one.
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=bucket_mb)
    if hook is not None:
        model.register_comm_hook(state=None, hook=hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g).to(dtype)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([q.detach().reshape(-1).double() for q in model.parameters()])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ["auto", "optcc"])
def test_ddp_hook_matches_ddp(process_group: object, algorithm: str) -> None:
    """DDP with the hook and one half-speed link ends, after 10 steps, within 1e-5 of
    DDP's own all-reduce, with the same bits on every rank."""
    comm, rank, p = world()
    ours = train(ot.comm_hook(algorithm=algorithm, links="1:0.5"), torch.float32)
    stats = optcc_mpi.collectives.last_stats()
    assert str(stats["links"]) == "1:0.5"  # the hook ran, with the profile asked for
    if algorithm != "auto":
        assert stats["algorithm"] == algorithm
    theirs = train(None, torch.float32)
    assert torch.isfinite(ours).all()
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-5, f"parameters differ from DDP's by {diff}"
    digests = comm.allgather(ours.numpy().tobytes())
    assert all(d == digests[0] for d in digests), "parameters differ across ranks"
    # Not vacuous: the training moved the parameters.
    assert (ours - train(None, torch.float32, steps=0)).abs().max().item() > 1e-3


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_ddp_hook_half_precision(process_group: object, dtype: torch.dtype) -> None:
    """16-bit models: buckets in the model's dtype; the result tracks DDP's own within a
    few units in the last place of the type, the same bits on every rank."""
    comm, rank, p = world()
    ours = train(ot.comm_hook(algorithm="optcc", links="1:0.5"), dtype, bucket_mb=25)
    theirs = train(None, dtype, bucket_mb=25)
    assert torch.isfinite(ours).all()
    tol = 16 * UNIT[dtype] * theirs.abs().max().item()
    diff = (ours - theirs).abs().max().item()
    assert diff <= tol, f"parameters differ from DDP's by {diff} (bound {tol})"
    digests = comm.allgather(ours.numpy().tobytes())
    assert all(d == digests[0] for d in digests), "parameters differ across ranks"
