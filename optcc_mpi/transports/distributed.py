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

Where every rank is on one machine, a *board* (:mod:`optcc_mpi.transports.board`, one
shared mapping) carries instead the check's gathers, the barrier and, on gloo, the
library's AllReduce of host data: the same bytes in the same rank order, without TCP.
Where ``/dev/shm``'s budget leaves no room for one, the group has none, and its calls'
records say so (:attr:`~optcc_mpi.transports.Transport.board_state`).

gloo
    CPU tensors (reduced by torch, :class:`~optcc_mpi.arrays.TorchArrayOps`) and NumPy
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

The groups that carry the traffic (:class:`Carriers`) are called directly, with the
group's own ranks (``send([tensor], peer, tag)``, ``allgather``, ``allreduce``): they
may be registered process groups (:func:`transport`, for a group the user made) or c10d
backends opened on a store and never registered (:meth:`TorchTransport.from_store`, for
the ``optcc`` backend of :mod:`optcc_mpi.torch.process_group`, which cannot register groups
while torch is making it).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import dataclasses
import datetime
import pickle
import socket
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, BarrierOptions

from optcc_mpi.arrays import torch_array_ops
from optcc_mpi.errors import ArgumentError, ArgumentTypeError
from optcc_mpi.links import Links
from optcc_mpi.transports import base, board
from optcc_mpi.transports.base import (
    Capabilities,
    Completion,
    LevelClock,
    Post,
    Transport,
    cpu_placement,
    crowding_of,
)

__all__ = ["TorchTransport", "Carriers", "transport", "group_of", "fresh_store"]

#: The options' ``reduceOp`` of each op (the stubs call the members ``RedOpType`` and the
#: field ``ReduceOp``; torch converts one to the other).
_REDUCE_OPS: dict[str, Any] = {
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
#: An empty block (a barrier on the board is an allgather of nothing).
_NOTHING = np.zeros(0, dtype=np.uint8)
#: The request of an AllReduce done when it was started (on the board).
_DONE = object()


class _Polled:
    """The request of the library's AllReduce over gloo: a collective, whose wait
    :meth:`TorchTransport.wait` polls (a message's it must not)."""

    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work


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


class Carriers(NamedTuple):
    """The groups a :class:`TorchTransport`'s traffic travels on: registered process
    groups or unregistered c10d backends (both take the same calls, in group ranks)."""

    #: Messages to a higher rank (every message on NCCL), the library's AllReduce and the
    #: gathers of rows, in the user group's library.
    data: Any
    #: Messages to a lower rank (gloo; ``data`` itself on NCCL).
    down: Any
    #: The argument check's, the probe's and the watch's small collectives (gloo, CPU).
    ctrl: Any
    #: What to shut down with the transport (groups it opened itself and owns).
    owned: tuple[Any, ...] = ()


def _coalescing_args(carrier: Any, device: torch.device) -> tuple[torch.device, ...]:
    """The arguments of ``carrier._start_coalescing``/``_end_coalescing`` for a group of
    messages on ``device``.

    torch 2.13 has two signatures. A registered ``ProcessGroup`` (a group the user made)
    takes the device, to pick its backend for that device; a c10d ``Backend`` (what
    :meth:`TorchTransport.from_store` opens: ``ProcessGroupNCCL`` on a store) is already
    one library's and takes nothing, and a device passed to it is a ``TypeError`` on every
    rank at the first group. ``tests/test_torch_nccl_signatures.py`` runs this against
    fakes whose calls must fit the signatures read from torch's own classes.
    """
    return (device,) if isinstance(carrier, dist.ProcessGroup) else ()


def fresh_store(store: Any, size: int) -> Any:
    """``store`` under a prefix no earlier making of groups on it used.

    torch gives a group made again after ``destroy_process_group`` the store prefix of
    the one before, where the keys of its rendezvous remain; a gloo rendezvous that reads
    them waits for peers that are gone. Each of the ``size`` members adds one to a
    counter before anyone can connect (and so before any member can destroy the groups
    and make them again), so the members of one making count the same generation.
    """
    generation = (int(store.add("optcc/makings", 1)) - 1) // size
    return dist.PrefixStore(f"optcc/{generation}", store)


class CudaClock:
    """A :class:`~optcc_mpi.transports.base.LevelClock` of CUDA events: a mark is a timing
    event recorded on the current stream (the side stream the executor's levels run on),
    read with ``query`` (never waits) and ``elapsed_time``."""

    def mark(self) -> object:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def reached(self, marks: Sequence[object]) -> bool:
        return all(m.query() for m in marks)  # type: ignore[attr-defined]

    def seconds(self, a: object, b: object) -> float:
        return float(a.elapsed_time(b)) / 1e3  # type: ignore[attr-defined]


class TorchTransport(Transport["dist.Work"]):
    """A torch.distributed process group's traffic (module docstring).

    Parameters
    ----------
    library : str
        ``"gloo"`` or ``"nccl"``: the library that moves the data.
    rank, size : int
        This process's rank in the group and the group's size.
    global_ranks : sequence of int
        The job's rank of each member (for ``$OPTCC_LINKS``).
    carriers : Carriers
        The groups the traffic travels on.
    timeout : datetime.timedelta, optional
        The groups' timeout, which the board's waits honour too.
    backend : str, optional
        The torch.distributed backend of the group the user sees, which the errors name
        (:meth:`describe`): the ``optcc`` backend's transports carry its calls over gloo
        or NCCL groups of their own, and a user of an ``optcc`` group knows no gloo
        group. Default: ``library``.
    """

    def __init__(
        self,
        library: str,
        rank: int,
        size: int,
        global_ranks: Sequence[int],
        carriers: Carriers,
        timeout: datetime.timedelta = datetime.timedelta(minutes=30),
        backend: str | None = None,
    ) -> None:
        if library not in ("gloo", "nccl"):
            raise ArgumentError(
                f"the {library!r} process-group backend is not supported; use gloo (CPU) "
                "or nccl (CUDA)"
            )
        self.name = library
        #: The backend of the group the user sees (what :meth:`describe` names).
        self.backend = backend or library
        completion = Completion.GROUPED if library == "nccl" else Completion.ORDERED
        self.caps = Capabilities(
            completion=completion,
            sync_device=False,
            tensors=True,
            library_optimal=True,
            library_identical=True,
        )
        self.global_ranks = list(global_ranks)
        self.data, self.down, self.ctrl = carriers.data, carriers.down, carriers.ctrl
        self._owned = carriers.owned
        # The last works handed to gloo and their tensors (_held).
        self._recent: collections.deque[Any] = collections.deque(maxlen=48)
        # Only the groups this transport opened itself can be aborted through it.
        self._abortable = bool(carriers.owned)
        self._aborted = False
        self._ended = "aborted"  # (or destroyed, with a call pending: abort())
        _LIVE.add(self)
        Transport.__init__(self, rank, size, "network")
        self.timeout = timeout
        places = self.allgather((socket.gethostname(), cpu_placement(), board.place()))
        hosts = [host for host, _, _ in places]
        self.kind = "shared-memory" if len(set(hosts)) == 1 else "network"
        self.hosts = hosts
        self.crowding = crowding_of([cpus for _, cpus, _ in places])
        # The check's exchanges and the AllReduce of host data through shared memory where
        # every rank can share it and /dev/shm's budget allows (board.py); None: on the
        # control and data groups, and every call's record says why (board_state).
        self.board, self.board_state = board.Board.opened(
            rank, size, [shm for _, _, shm in places], self.allgather, self.crowding
        )
        if self.board is not None:
            self.board.timeout = timeout.total_seconds()
            self.board.aborted = self._was_aborted
            self.board.what = self.describe()
            # Short messages travel in the check up to the board's own measure.
            self.gather_total = board.GATHER_TOTAL
        elif library == "gloo":
            # Across machines (or with the board off) a short sum's check rides in its data's
            # AllReduce once the ranks expect the call (check.ride): gloo's ring gives every
            # rank the same bits. The board's calls are cheaper than a round already.
            self.caps = dataclasses.replace(self.caps, ride=True)

    @classmethod
    def of_group(cls, group: Any) -> TorchTransport:
        """The transport of a registered process group: groups of its own over the same
        members, opened on the group's store (:meth:`from_store`) in a fresh namespace
        (:func:`fresh_store`), so that a group made again after
        ``destroy_process_group`` never meets the keys of the one before."""
        library = str(dist.get_backend(group)).lower()
        if library not in ("gloo", "nccl"):
            raise ArgumentError(
                f"the {library!r} process-group backend is not supported; use gloo (CPU) "
                "or nccl (CUDA)"
            )
        store = group.get_group_store()
        if store is None:
            raise ArgumentError(f"the {library} process group has no store to open groups on")
        size = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group)
        return cls.from_store(fresh_store(store, size), dist.get_rank(group), size, ranks, library)

    @classmethod
    def from_store(
        cls,
        store: Any,
        rank: int,
        size: int,
        global_ranks: Sequence[int],
        library: str = "gloo",
        timeout: datetime.timedelta = datetime.timedelta(minutes=30),
        backend: str | None = None,
    ) -> TorchTransport:
        """A transport on groups of its own, opened on ``store`` (keys under
        ``optcc/``; pass a :func:`fresh_store`) and never registered with
        torch.distributed; collective over the ``size`` processes that call it with the
        same store. :meth:`Transport.close` shuts them down. ``backend``: the backend of
        the group the user sees, for the errors (default ``library``)."""

        def gloo(name: str) -> Any:
            return dist.ProcessGroupGloo(
                dist.PrefixStore(f"optcc/{name}", store), rank, size, timeout
            )

        ctrl = gloo("ctrl")
        if library == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            data = down = dist.ProcessGroupNCCL(
                dist.PrefixStore("optcc/nccl", store), rank, size, opts
            )
            owned: tuple[Any, ...] = (data, ctrl)
        else:
            data = ctrl if size == 1 else gloo("up")
            down = data if size == 1 else gloo("down")
            owned = tuple({id(g): g for g in (data, down, ctrl)}.values())
        carriers = Carriers(data, down, ctrl, owned)
        return cls(library, rank, size, global_ranks, carriers, timeout, backend)

    def close(self) -> None:
        """The group went away: drop what was kept for it, and shut down the groups this
        transport opened on a store."""
        if self.closed:
            return
        super().close()
        if self.board is not None:
            # Every peer's wait that needs a block of this rank ends at once, naming this
            # rank as the one that destroyed the group (Board.close), rather than at the
            # group's timeout. Unmapped when the last thread inside a wait on it let go.
            self.board.close()
        self.board = None
        owned, self._owned = self._owned, ()
        for group in owned:
            try:
                group.shutdown()
            except RuntimeError:  # already shut down, or torch's shutdown of a dead peer
                pass
        if owned and not self._aborted:
            # The groups it opened are let go here, not at the process's end: a gloo
            # group's sockets and threads go only with the object (its shutdown keeps
            # them), and a work kept in _recent keeps its group's connections. Every call
            # on them completed (a closed transport's owner has no call pending:
            # OptccProcessGroup.shutdown aborts where one is), so their destructors,
            # which join gloo's threads, wait for nothing; _recent, which holds the
            # tensors those threads saw, goes after them, so that no gloo thread is the
            # last to let go of a tensor Python saw (_held).
            del owned
            self.data = self.down = self.ctrl = _GONE
            self._recent.clear()
            return
        # gloo's threads may still hold this transport's last tensors a moment after
        # the groups went away: kept past the object (and, at exit, past the interpreter).
        _CLOSED_RECENT.append(self._recent)

    def abort(self, destroyed: bool = False) -> None:
        """The group was aborted: as :meth:`close`, but abort the groups this transport
        opened rather than shutting them down; a wait in progress raises within
        :data:`~optcc_mpi.transports.base.ABORT_POLL` seconds (:meth:`wait`). The groups
        are kept to the process's end: a gloo group destroyed while its own thread still
        waits for a peer ends the process. ``destroyed``: the group is being destroyed
        with a call still pending (its errors, here and on the peers, say destroyed,
        not aborted, and the board's last completed exchanges still complete)."""
        self._aborted = True
        self._ended = "destroyed on this rank" if destroyed else "aborted"
        if self.board is not None and not destroyed:
            self.board.broken()
        owned, self._owned = self._owned, ()
        _ABORTED.extend(owned)
        for group in owned:
            try:
                group.abort()
            except RuntimeError:  # already aborted or shut down
                pass
        self.close()

    # -- point-to-point ------------------------------------------------------------------
    def check_arrays(self, arrays: Any) -> None:
        if self.name == "nccl":
            if arrays.name != "torch" or not arrays.device:
                raise ArgumentError(
                    "an NCCL process group moves CUDA tensors only; pass CUDA tensors, or "
                    "use a gloo group for CPU tensors and NumPy arrays"
                )
        elif arrays.name == "torch" and arrays.device:
            where = arrays.where.type
            hint = "use an NCCL group for CUDA tensors" if where == "cuda" else "not " + where
            raise ArgumentError(
                f"a gloo process group moves CPU tensors and NumPy arrays ({hint}); move the "
                "tensor to the CPU"
            )
        elif arrays.name not in ("torch", "numpy"):
            raise ArgumentTypeError(
                f"the torch.distributed transport cannot move {arrays.name} arrays; pass "
                "tensors (or NumPy arrays over gloo)"
            )

    def scratch(self, nbytes: int) -> tuple[Any, Any]:
        if self.name != "nccl":
            return super().scratch(nbytes)
        device = torch.device("cuda", torch.cuda.current_device())
        return torch.zeros(nbytes, dtype=torch.uint8, device=device), torch_array_ops(device)

    def level_clock(self, arrays: Any) -> LevelClock | None:
        if self.name != "nccl" or not arrays.device:
            return None
        return CudaClock()

    def message(self, arrays: Any, arr: Any) -> Any:
        if isinstance(arr, np.ndarray):
            return torch.from_numpy(arr.view(np.uint8))
        return arr.view(torch.uint8)

    def _carrier(self, src: int, dst: int) -> Any:
        """The group that carries messages from rank ``src`` to rank ``dst``."""
        return self.data if src < dst else self.down

    def isend(self, data: Any, peer: int, tag: int) -> Any:
        return self._held(self._carrier(self.rank, peer).send([data], peer, tag), data)

    def irecv(self, data: Any, peer: int, tag: int) -> Any:
        return self._held(self._carrier(peer, self.rank).recv([data], peer, tag), data)

    def wait(self, req: Any) -> None:
        """Wait for ``req``: a message (the library's ``Work`` of a send or a receive),
        the library's AllReduce (:meth:`allreduce`) or the board's.

        A message is waited for without a limit of ours (the group's timeout holds): a
        gloo send or receive waited for with a timeout that passes is *finished* with
        that error ("Timed out waiting 500ms for recv operation"), though its buffer stays
        posted; a message over a slow link can take seconds. A collective is polled
        (:meth:`_poll`)."""
        if type(req) is _Polled:
            self._poll(req.work)
        elif req is not _DONE:  # (_DONE: the board's AllReduce, complete when it returned)
            req.wait()

    def _poll(self, work: Any) -> None:
        """Wait for a collective's ``work``, waking every
        :data:`~optcc_mpi.transports.base.ABORT_POLL` seconds (a gloo wait is not woken by
        an abort of its group) to see whether the transport was aborted: then raise
        instead of waiting on for a peer that will not come, and leave no thread inside
        the library's wait when the interpreter ends. (A gloo collective's timed wait that
        passes leaves the collective running.)"""
        if self.closed or not self._abortable:
            work.wait()
            return
        poll = datetime.timedelta(seconds=base.ABORT_POLL)
        while True:
            try:
                work.wait(poll)
                return
            except RuntimeError:
                if work.is_completed():
                    # Its own outcome: the timed wait may have lost a race with the
                    # collective's completion (torch's "Operation timed out!" for a work
                    # that completed a moment later: re-raising that failed a riding
                    # DDP bucket on one rank of four, which left the others waiting),
                    # so the untimed wait says whether it failed.
                    work.wait()
                    return
                if self._aborted:
                    raise ArgumentError(
                        f"{self.describe()}: the process group was {self._ended}"
                    ) from None

    def batch(self, posts: Sequence[Post]) -> list[Any]:
        if self.name != "nccl":
            return super().batch(posts)
        # One NCCL group for the level (what batch_isend_irecv does on NCCL).
        where = _coalescing_args(self.data, posts[0].data.device)  # type: ignore[attr-defined]
        self.data._start_coalescing(*where)
        for post in posts:
            (self.data.send if post.send else self.data.recv)([post.data], post.peer, post.tag)
        return [self.data._end_coalescing(*where)]

    # -- the library's own AllReduce -------------------------------------------------------
    def native(self, arrays: Any, dtype_name: str, op: str) -> bool:
        if arrays.name == "numpy" and dtype_name == "bfloat16":
            return False
        return dtype_name in _EXACT[self.name].get(op, ())

    def allreduce(self, arrays: Any, arr: Any, dtype_name: str, op: str) -> Any:
        on = self.board
        if on is not None and self.name == "gloo":
            # Every rank on this machine: through the shared mapping, reduced in rank order
            # (board.Board.allreduce; 0.3-0.5x gloo's time here, docs/results.md), done
            # when this returns. The same choice on every rank: the board is the group's.
            host = arr if isinstance(arr, np.ndarray) else arr.detach().numpy()
            if host.flags.c_contiguous:
                on.allreduce(host.reshape(-1), op)
            else:  # (a strided view: reduced in a copy, written back)
                flat = np.ascontiguousarray(host).reshape(-1)
                on.allreduce(flat, op)
                host[...] = flat.reshape(host.shape)
            return _DONE
        tensor = torch.from_numpy(arr) if isinstance(arr, np.ndarray) else arr
        opts = AllreduceOptions()
        opts.reduceOp = _REDUCE_OPS[op]
        work = self._held(self.data.allreduce([tensor], opts), tensor)
        # (NCCL's is waited for as its messages are: the stream waits, not the host)
        return _Polled(work) if self.name == "gloo" else work

    def _held(self, work: Any, *tensors: torch.Tensor) -> Any:
        """``work``, kept by this transport for a while with its tensors.

        gloo's worker thread lets go of a queued collective's work just after it reports
        the collective complete. Where Python let go of the work first, the worker
        thread's release destroys it, and its tensors (which Python saw) then hand their
        Python objects back, which needs the GIL, whether or not Python still holds the
        tensors: at interpreter exit (the last call of a job, then
        ``destroy_process_group``) the thread finds Python finalising and is ended inside
        C++, and the process aborts ("terminate called without an active exception"; the
        core shows a gloo worker in ``~AsyncAllgatherWork`` -> ``decref_pyobject`` ->
        ``take_gil`` -> ``pthread_exit``). The last works and their tensors stay
        referenced here, so that the worker thread's release never is the last, and at
        exit they are kept past the interpreter's end (:func:`_close_all`).
        """
        self._recent.append(work)
        self._recent.extend(tensors)
        return work

    # -- control traffic -------------------------------------------------------------------
    def allgather(self, obj: Any) -> list[Any]:
        # Pickled, as all_gather_object does, but on the control group directly: the
        # sizes first, then the padded bytes.
        raw = pickle.dumps(obj)
        sizes = self._gather_block(torch.tensor([len(raw)], dtype=torch.int64))
        width = int(sizes.max())
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        rows = self._gather_block(mine)
        return [
            pickle.loads(rows[r, : int(sizes[r, 0])].numpy().tobytes()) for r in range(self.size)
        ]

    def _gather_block(self, block: torch.Tensor) -> torch.Tensor:
        out = torch.empty((self.size, block.numel()), dtype=block.dtype)
        flat = out.view(-1)
        self._poll(
            self._held(self.ctrl._allgather_base(flat, block, AllgatherOptions()), flat, block)
        )
        return out

    def allgather_block(self, block: np.ndarray, out: np.ndarray) -> None:
        on = self.board
        if on is not None and on.fits(block.nbytes):
            on.allgather_block(block, out)
            return
        into, mine = torch.from_numpy(out.reshape(-1)), torch.from_numpy(block)
        self._poll(
            self._held(self.ctrl._allgather_base(into, mine, AllgatherOptions()), into, mine)
        )

    def gather_rows(self, arrays: Any, arr: Any) -> Any:
        if arrays.name != "torch":
            return None
        rows = torch.empty((self.size, arr.shape[0]), dtype=arr.dtype, device=arr.device)
        # As bytes: the library moves them whatever the type (bool, bfloat16, complex).
        into, mine = rows.view(-1).view(torch.uint8), arr.view(torch.uint8)
        self._poll(
            self._held(self.data._allgather_base(into, mine, AllgatherOptions()), into, mine)
        )
        return rows

    def allreduce_max(self, vec: np.ndarray) -> None:
        opts = AllreduceOptions()
        opts.reduceOp = _REDUCE_OPS["max"]
        t = torch.from_numpy(vec)
        self._poll(self._held(self.ctrl.allreduce([t], opts), t))

    def barrier(self) -> None:
        if self.board is not None:
            self.allgather_block(_NOTHING, _NOTHING.reshape(1, 0).repeat(self.size, 0))
            return
        self._poll(self.ctrl.barrier(BarrierOptions()))

    def _was_aborted(self) -> bool:
        return self._aborted

    def job_links(self, links: Links) -> Links:
        if links.healthy:
            return links
        world = dist.get_world_size() if dist.is_initialized() else len(self.global_ranks)
        bad = [r for r in links.fractions if r >= world]
        if bad:
            raise ArgumentError(
                f"names rank {bad[0]}, outside the job of {world} ranks (OPTCC_LINKS uses "
                "global ranks)"
            )
        member = {g: i for i, g in enumerate(self.global_ranks)}
        return Links({member[g]: f for g, f in links.fractions.items() if g in member})

    def describe(self) -> str:
        # The group the user made (an optcc group's, not the gloo groups underneath).
        return f"{self.backend} process group of {self.size}"


class _Gone:
    """What a closed transport's groups are: any use says the group was destroyed."""

    def __getattr__(self, name: str) -> Any:
        raise ArgumentError("the process group was destroyed")


_GONE: Any = _Gone()
#: The groups of aborted transports, kept to the process's end (:meth:`TorchTransport.abort`).
_ABORTED: list[Any] = []
#: The tensors closed transports handed gloo last (the latest transports' only).
_CLOSED_RECENT: collections.deque[collections.deque[Any]] = collections.deque(maxlen=64)
#: Every transport alive, for what :func:`_close_all` keeps past the interpreter's end.
_LIVE: weakref.WeakSet[TorchTransport] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for t in list(_TRANSPORTS.values()):
        t.close()
    _TRANSPORTS.clear()
    # A gloo worker thread can lag behind the collective it reported complete and drop
    # its tensors only while Python is finalising, when it may no longer take the GIL
    # (the process aborts: :meth:`TorchTransport._held`). The tensors the transports
    # handed to gloo last are kept alive past the interpreter's end (a deliberate leak of
    # a few small tensors at exit), so that no gloo thread can hold their last reference.
    kept = [t._recent for t in list(_LIVE)] + [_ABORTED, _CLOSED_RECENT]
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))


def transport(group: Any) -> TorchTransport:
    """The transport of ``group`` (None: the default group): the ``optcc`` backend's own
    (:mod:`optcc_mpi.torch.process_group`, any object with an ``optcc_transport()`` method),
    else a cached :class:`TorchTransport` made on first use (collective over the group's
    members: it opens the private groups)."""
    group = group_of(group)
    own = getattr(group, "optcc_transport", None)
    if callable(own):
        return own()
    t = _TRANSPORTS.get(group)
    if t is None or t.closed:
        t = _TRANSPORTS[group] = TorchTransport.of_group(group)
    return t
