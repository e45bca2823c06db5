"""The torch.distributed transport: schedules over a process group (gloo or NCCL).

For PyTorch jobs launched by ``torchrun`` (or ``srun`` with torch's variables): no MPI
library is involved. The first use of a process group makes its :class:`TorchTransport`,
which opens two private groups over the same processes (``new_group`` with local
synchronisation, so only the members take part):

* a *data* group of the user group's library, on which the schedule's messages travel
  (``isend``/``irecv`` with the group's own ranks), so none of them can meet a message or
  collective of the user's; on gloo two, one for the messages to a higher rank and one
  for those to a lower rank (below);
* a *control* group on gloo, for the argument check, the probe's and the watch's small
  collectives: CPU tensors, so that on NCCL a check never queues work on the GPU.

gloo
    CPU tensors (reduced by torch, :class:`~optcc_mpi.backend.TorchBackend`) and NumPy
    arrays (reduced by NumPy, their memory wrapped by ``torch.from_numpy``). A gloo
    request reports its completion only when waited for, so the executor waits for the
    outstanding operation of lowest level (completions
    :attr:`~optcc_mpi.transports.Completion.ORDERED`). gloo's messages are a rendezvous:
    a send starts only once the receiver's "ready to receive" notice has reached the
    sender, on the TCP connection between the two. Were the messages of both directions
    on one connection, that notice would queue behind the receiver's own data to the
    sender (a slow rank's whole backlog: on the testbed, rank 0 at half rate
    received only 87% of its rate while its receives were posted); so each direction has
    a group, and the connection carrying a direction's data carries only notices the
    other way.
NCCL
    CUDA tensors, which never leave the device: every level's messages are one NCCL group
    (``batch_isend_irecv``), waiting on it makes the current stream wait (not the host),
    and the reductions that follow are queued on the current stream (completions
    :attr:`~optcc_mpi.transports.Completion.GROUPED`). NCCL matches messages between two
    ranks by order, not tag: the executor posts each level's messages in an order both
    ends agree on.

The library's own AllReduce (``all_reduce``) is used where it reduces a type exactly as
this package does (:meth:`TorchTransport.native`); elsewhere every rank's data is
gathered and reduced in rank order.

``$OPTCC_LINKS`` names global ranks (``torch.distributed.get_rank()``); on a subgroup it
is translated to the group's ranks, and ranks outside it are dropped.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from optcc_mpi.backend import torch_backend
from optcc_mpi.errors import ArgumentError, ArgumentTypeError
from optcc_mpi.links import Links
from optcc_mpi.transports.base import Capabilities, Completion, Post, Transport

__all__ = ["TorchTransport", "transport", "group_of"]

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}
# Where the library's reduction is ours (dtype names; max/min on floats arrive here as
# their integer keys). 16-bit floats are not: we round to them after every step in
# float32. Complex, bool and the logical ops have no exact library reduction either.
_EXACT = {
    "gloo": {
        "sum": {"float32", "float64", "int32", "int64"},
        "prod": {"float32", "float64", "int32", "int64"},
        "max": {"int8", "uint8", "int32", "int64"},
        "min": {"int8", "uint8", "int32", "int64"},
        "band": {"int32", "int64"},
        "bor": {"int32", "int64"},
        "bxor": {"int32", "int64"},
    },
    "nccl": {
        "sum": {"float32", "float64", "int32", "int64"},
        "prod": {"float32", "float64", "int32", "int64"},
        "max": {"int8", "uint8", "int32", "int64"},
        "min": {"int8", "uint8", "int32", "int64"},
    },
}
_TRANSPORTS: dict[Any, TorchTransport] = {}
#: Gather into one tensor (the newer name where torch has it).
_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def group_of(group: Any) -> Any:
    """``group`` (None: the default group), checked: torch.distributed is initialised and
    this process is a member."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ArgumentError(
            "torch.distributed is not initialised: call torch.distributed."
            "init_process_group (torchrun sets its variables), or "
            "optcc_mpi.torch.init_process_group_from_mpi under mpiexec"
        )
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise ArgumentTypeError(
            f"group must be a torch.distributed ProcessGroup, not {type(group).__name__}"
        )
    if dist.get_rank(group) < 0:
        raise ArgumentError("this process is not a member of that process group")
    return group


class TorchTransport(Transport["dist.Work"]):
    """A torch.distributed process group and its private groups (module docstring)."""

    def __init__(self, group: Any) -> None:
        library = str(dist.get_backend(group)).lower()
        if library not in ("gloo", "nccl"):
            raise ArgumentError(
                f"the {library!r} process-group backend is not supported; use gloo (CPU) "
                "or nccl (CUDA)"
            )
        self.name = library
        completion = Completion.GROUPED if library == "nccl" else Completion.ORDERED
        self.caps = Capabilities(completion=completion, sync_device=False, tensors=True)
        ranks = dist.get_process_group_ranks(group)
        self.group = group
        self.global_ranks = list(ranks)
        self.ctrl = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self.data = (
            self.ctrl
            if library == "gloo" and len(ranks) == 1
            else dist.new_group(ranks, backend=library, use_local_synchronization=True)
        )
        # gloo: messages to a lower rank travel on a group of their own (module docstring).
        self.down = (
            dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
            if library == "gloo" and len(ranks) > 1
            else self.data
        )
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        hosts: list[Any] = [None] * size
        dist.all_gather_object(hosts, socket.gethostname(), group=self.ctrl)
        super().__init__(rank, size, "shared-memory" if len(set(hosts)) == 1 else "network")
        self.hosts = hosts

    # -- point-to-point ------------------------------------------------------------------
    def check_backend(self, backend: Any) -> None:
        if self.name == "nccl":
            if backend.name != "torch" or not backend.device:
                raise ArgumentError(
                    "an NCCL process group moves CUDA tensors only; pass CUDA tensors, or "
                    "use a gloo group for CPU tensors and NumPy arrays"
                )
        elif backend.name == "torch" and backend.device:
            where = backend.where.type
            hint = "use an NCCL group for CUDA tensors" if where == "cuda" else "not " + where
            raise ArgumentError(
                f"a gloo process group moves CPU tensors and NumPy arrays ({hint}); move the "
                "tensor to the CPU"
            )
        elif backend.name not in ("torch", "numpy"):
            raise ArgumentTypeError(
                f"the torch.distributed transport cannot move {backend.name} arrays; pass "
                "tensors (or NumPy arrays over gloo)"
            )

    def scratch(self, nbytes: int) -> tuple[Any, Any]:
        if self.name != "nccl":
            return super().scratch(nbytes)
        device = torch.device("cuda", torch.cuda.current_device())
        return torch.zeros(nbytes, dtype=torch.uint8, device=device), torch_backend(device)

    def message(self, backend: Any, arr: Any) -> Any:
        if isinstance(arr, np.ndarray):
            return torch.from_numpy(arr.view(np.uint8))
        return arr.view(torch.uint8)

    def _carrier(self, src: int, dst: int) -> Any:
        """The group that carries messages from rank ``src`` to rank ``dst``."""
        return self.data if src < dst else self.down

    def isend(self, data: Any, peer: int, tag: int) -> Any:
        return dist.isend(data, group=self._carrier(self.rank, peer), group_dst=peer, tag=tag)

    def irecv(self, data: Any, peer: int, tag: int) -> Any:
        return dist.irecv(data, group=self._carrier(peer, self.rank), group_src=peer, tag=tag)

    def wait(self, req: Any) -> None:
        req.wait()

    def batch(self, posts: Sequence[Post]) -> list[Any]:
        # One batch per carrying group (torch wants one group per batch); NCCL has one.
        by: dict[Any, list[Any]] = {}
        for post in posts:
            peer = post.peer
            group = self._carrier(self.rank, peer) if post.send else self._carrier(peer, self.rank)
            op = dist.isend if post.send else dist.irecv
            by.setdefault(group, []).append(
                dist.P2POp(op, post.data, group=group, group_peer=peer, tag=post.tag)
            )
        return [req for ops in by.values() for req in dist.batch_isend_irecv(ops)]

    # -- the library's own AllReduce -------------------------------------------------------
    def native(self, backend: Any, dtype_name: str, op: str) -> bool:
        if backend.name == "numpy" and dtype_name == "bfloat16":
            return False
        return dtype_name in _EXACT[self.name].get(op, ())

    def allreduce(self, backend: Any, arr: Any, dtype_name: str, op: str) -> Any:
        tensor = torch.from_numpy(arr) if isinstance(arr, np.ndarray) else arr
        return dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self.data, async_op=True)

    # -- control traffic -------------------------------------------------------------------
    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def allgather_block(self, block: np.ndarray, out: np.ndarray) -> None:
        _GATHER(torch.from_numpy(out.reshape(-1)), torch.from_numpy(block), group=self.ctrl)

    def gather_rows(self, backend: Any, arr: Any) -> Any:
        if backend.name != "torch":
            return None
        rows = torch.empty((self.size, arr.shape[0]), dtype=arr.dtype, device=arr.device)
        # As bytes: the library moves them whatever the type (bool, bfloat16, complex).
        _GATHER(rows.view(-1).view(torch.uint8), arr.view(torch.uint8), group=self.data)
        return rows

    def allreduce_max(self, vec: np.ndarray) -> None:
        dist.all_reduce(torch.from_numpy(vec), op=dist.ReduceOp.MAX, group=self.ctrl)

    def barrier(self) -> None:
        dist.barrier(group=self.ctrl)

    def job_links(self, links: Links) -> Links:
        if links.healthy:
            return links
        world = dist.get_world_size()
        bad = [r for r in links.fractions if r >= world]
        if bad:
            raise ArgumentError(
                f"names rank {bad[0]}, outside the job of {world} ranks (OPTCC_LINKS uses "
                "global ranks)"
            )
        member = {g: i for i, g in enumerate(self.global_ranks)}
        return Links({member[g]: f for g, f in links.fractions.items() if g in member})

    def describe(self) -> str:
        return f"{self.name} process group of {self.size}"


def transport(group: Any) -> TorchTransport:
    """The cached :class:`TorchTransport` of ``group`` (None: the default group), made on
    first use (collective over the group's members: it opens the private groups)."""
    group = group_of(group)
    t = _TRANSPORTS.get(group)
    if t is None:
        t = _TRANSPORTS[group] = TorchTransport(group)
    return t
