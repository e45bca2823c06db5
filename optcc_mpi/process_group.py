"""The torch.distributed backend ``optcc``: OptCC inside every PyTorch job.

``import optcc_mpi.torch`` registers it (:func:`register`) for CPU and CUDA tensors; then
whatever calls torch.distributed reaches OptCC with no change of its own code::

    dist.init_process_group("optcc")                   # DDP (no hook), dist.all_reduce ...
    dist.new_group(ranks, backend="optcc")
    init_device_mesh("cuda", (R, S), mesh_dim_names=("replicate", "shard"),
                     backend_override={"replicate": "optcc"})   # FSDP2's HSDP

What a group does
-----------------
``all_reduce`` (and ``all_reduce_coalesced``) runs the registered algorithms
(:func:`optcc_mpi.allreduce` over the group's own transport,
:class:`~optcc_mpi.transports.torch.TorchTransport` on groups the backend opens on the
store it is given): every ``ReduceOp`` (``AVG`` and ``PREMUL_SUM`` included) on every
dtype the package reduces. The call returns at once with an :class:`OptccWork`; the
group's reductions run in call order on one thread of its own (:class:`OrderedWorker`),
so DDP and FSDP2 overlap them with the backward pass, as they do with gloo and NCCL.

Every other collective (broadcast, all_gather and ``all_gather_into_tensor``,
reduce_scatter and ``reduce_scatter_tensor``, all_to_all, barrier, send/recv, gather,
scatter, reduce) goes unchanged to the library underneath: a gloo group for CPU tensors,
an NCCL group for CUDA tensors (made where CUDA and NCCL are available), both opened on
the same store and registered as the group's backends for their devices.

Settings
--------
Per group, :class:`OptccOptions` (``pg_options=`` of ``init_process_group`` and
``new_group``, or the second element of a ``backend_override`` pair); else the
algorithm from ``$OPTCC_ALGORITHM`` (default ``"auto"``) and the links from
``$OPTCC_LINKS`` (``probe``, ``watch`` or a profile, in the job's global ranks).
``optcc_mpi.collectives.last_stats()`` and :attr:`OptccWork.stats` say which algorithm a
call ran; with ``links="watch"``, ``$OPTCC_LINKS_LOG`` records what the watch adopts.

Errors
------
Arguments that differ across ranks (element count, dtype, op, algorithm, links) and an
op or dtype the backend cannot reduce raise the same :class:`~optcc_mpi.errors.ArgumentError`
on every rank from ``wait()`` (torch's ``all_reduce`` waits for you unless
``async_op=True``), with the tensor unchanged. ``destroy_process_group`` stops the
group's thread and shuts its groups down; a group can be made again afterwards.
"""

from __future__ import annotations

import atexit
import datetime
import queue
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from optcc_mpi import algorithms
from optcc_mpi.collectives import last_stats
from optcc_mpi.config import rc
from optcc_mpi.errors import ArgumentError, ArgumentTypeError
from optcc_mpi.links import Links
from optcc_mpi.tensors import HALF, reduce_tensor
from optcc_mpi.transports.torch import TorchTransport, fresh_store

__all__ = [
    "BACKEND",
    "OptccOptions",
    "OptccProcessGroup",
    "OptccWork",
    "OrderedWorker",
    "register",
    "submit",
    "worker_for",
]

#: The name torch.distributed knows the backend by.
BACKEND = "optcc"
_WHAT = "all_reduce on the optcc backend"
_RED = dist.ReduceOp.RedOpType
#: torch's reductions as the package names them.
_OPS = {
    _RED.SUM: "sum",
    _RED.PRODUCT: "prod",
    _RED.MIN: "min",
    _RED.MAX: "max",
    _RED.BAND: "band",
    _RED.BOR: "bor",
    _RED.BXOR: "bxor",
    _RED.AVG: "sum",
    _RED.PREMUL_SUM: "sum",
}
#: On bool tensors torch's arithmetic reductions are logical ones (NCCL reduces bools as
#: bytes that are 0 or 1: a sum or a max is true where any is, a product or min where all).
#: The bit operations are the logical ones there too; AVG and PREMUL_SUM have no meaning.
_BOOL = {
    _RED.SUM: "lor",
    _RED.MAX: "lor",
    _RED.BOR: "lor",
    _RED.PRODUCT: "land",
    _RED.MIN: "land",
    _RED.BAND: "land",
    _RED.BXOR: "lxor",
}


@dataclass(frozen=True)
class OptccOptions:
    """Settings of one ``optcc`` group (``pg_options=``).

    Parameters
    ----------
    algorithm : str, optional
        ``"auto"`` or a registered algorithm (``optcc_mpi.ALGORITHMS``); default
        ``$OPTCC_ALGORITHM``, else ``"auto"``.
    links : Links or str, optional
        ``"probe"``, ``"watch"`` or a profile (``"1:0.5"``) in the group's ranks; default
        ``$OPTCC_LINKS`` (in the job's global ranks).
    check : bool
        Agree on every call's arguments across the ranks first (one small collective on
        the control group): a mismatch is an error on every rank rather than a wrong sum.
    timeout : datetime.timedelta, optional
        The group's timeout (default: the one ``new_group`` or the device mesh is given).
    """

    algorithm: str | None = None
    links: Links | str | None = None
    check: bool = True
    timeout: datetime.timedelta | None = None

    @property
    def _timeout(self) -> datetime.timedelta | None:
        # torch's DeviceMesh reads a backend's options' timeout by this name.
        return self.timeout


class OptccWork(dist.Work):
    """The handle of one ``all_reduce`` on the ``optcc`` backend: complete once the
    group's thread has reduced the tensors (before that, they must not be touched).

    Parameters
    ----------
    future : torch.futures.Future
        Completed with the list of tensors, or with the reduction's error.
    timeout : datetime.timedelta
        How long :meth:`wait` waits at most (the group's timeout).
    """

    def __init__(
        self, future: torch.futures.Future[list[torch.Tensor]], timeout: datetime.timedelta
    ):
        super().__init__()
        self._future = future
        self._timeout = timeout
        self._done = threading.Event()
        #: What the call did (:func:`optcc_mpi.collectives.last_stats`), once complete.
        self.stats: Mapping[str, object] = {}
        future.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the reduction is complete; raise its error if it failed.

        Raises
        ------
        ArgumentError, ArgumentTypeError
            The arguments were refused (the same error on every rank).
        RuntimeError
            The reduction did not complete within ``timeout`` (default: the group's), or
            a peer failed.
        """
        limit = timeout if timeout and timeout.total_seconds() > 0 else self._timeout
        if not self._done.wait(limit.total_seconds()):
            raise RuntimeError(
                f"{_WHAT}: not complete after {limit} (a rank that never made the call, "
                "or a stalled peer)"
            )
        self._future.wait()  # raises the reduction's error
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """The future that completes with the reduced tensors (DDP chains on it)."""
        return self._future

    def is_completed(self) -> bool:
        """Whether the reduction has finished (successfully or not)."""
        return self._future.done()

    def is_success(self) -> bool:
        """Whether the reduction has finished without an error."""
        return self._future.done() and self.exception() is None

    def exception(self) -> BaseException | None:
        """The reduction's error, once finished (None while running or on success)."""
        if not self._future.done():
            return None
        try:
            self._future.value()
        except BaseException as exc:  # noqa: BLE001 - reported, not handled
            return exc
        return None

    def result(self) -> list[torch.Tensor]:
        """The reduced tensors (waits first)."""
        self.wait()
        return self._future.value()


class OrderedWorker:
    """One thread that runs submitted jobs in submission order.

    A group's reductions are collectives: every rank must run them in the same order, and
    each completes only when every rank runs it. One thread per group keeps the order of
    the calls and lets the caller go on (the backward pass, the next bucket).

    Parameters
    ----------
    name : str
        The thread's name (seen in debuggers and ``py-spy``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], torch.futures.Future[Any]] | None]
        self._jobs = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        _WORKERS.add(self)

    def submit(self, job: Callable[[], Any], future: torch.futures.Future[Any]) -> None:
        """Run ``job()`` after every job submitted before it; complete ``future`` with its
        result or its error."""
        with self._lock:
            if self._closed:
                raise ArgumentError(f"{self.name}: the process group was destroyed")
            if self._thread is None:
                # A daemon, so that a rank whose peer hangs can still exit; close() (and
                # the interpreter's exit) stops it properly first.
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._jobs.put((job, future))

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, future = item
            try:
                result = job()
            except BaseException as exc:  # noqa: BLE001 - the caller's wait() raises it
                future.set_exception(exc)
            else:
                future.set_result(result)

    def close(self, timeout: float = 10.0) -> bool:
        """Let the submitted jobs finish and stop the thread; whether it stopped within
        ``timeout`` seconds (a job waiting for a dead peer may not)."""
        with self._lock:
            if self._closed:
                return True
            self._closed = True
            thread = self._thread
        _WORKERS.discard(self)
        if thread is None:
            return True
        self._jobs.put(None)
        if thread is threading.current_thread():
            return False
        thread.join(timeout)
        return not thread.is_alive()


#: Live workers, stopped at exit: a thread left inside a gloo wait while the interpreter
#: finalises is ended mid-C++ call, and the process aborts ("terminate called without an
#: active exception").
_WORKERS: weakref.WeakSet[OrderedWorker] = weakref.WeakSet()


@atexit.register
def _stop_workers() -> None:
    for worker in list(_WORKERS):
        worker.close(timeout=5.0)


_HOOK_WORKERS: dict[TorchTransport, OrderedWorker] = {}


def worker_for(transport: TorchTransport) -> OrderedWorker:
    """The ordered worker of ``transport`` (the DDP hook's, per process group), made on
    first use and stopped when the transport closes."""
    worker = _HOOK_WORKERS.get(transport)
    if worker is None:
        worker = _HOOK_WORKERS[transport] = OrderedWorker(f"optcc {transport.describe()}")

        def drop() -> None:
            _HOOK_WORKERS.pop(transport, None)
            worker.close()

        transport.on_close(drop)
    return worker


def submit(
    worker: OrderedWorker,
    tensors: list[torch.Tensor],
    job: Callable[[], Any],
    timeout: datetime.timedelta,
) -> OptccWork:
    """Queue ``job()``, which reduces ``tensors`` in place, on ``worker``; its
    :class:`OptccWork`. On CUDA the job starts after the work queued so far on the
    caller's current stream and runs on that device's current stream in the worker; the
    future carries its completion to whoever waits."""
    devices = sorted({t.device for t in tensors if t.is_cuda}, key=str)
    future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future(devices=devices or None)
    work = OptccWork(future, timeout)
    ready = None
    if devices:
        # The backward pass that wrote a gradient was queued on the caller's stream.
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(devices[0]))

    def run() -> list[torch.Tensor]:
        if ready is None:
            job()
        else:
            with torch.cuda.device(devices[0]):
                torch.cuda.current_stream().wait_event(ready)
                job()
        work.stats = last_stats()
        return tensors

    worker.submit(run, future)
    return work


def _op(reduce_op: Any, dtype: torch.dtype) -> tuple[str, bool, Any]:
    """``(package op, average, premul factor)`` of torch's ``reduce_op`` on ``dtype``."""
    kind = reduce_op.op if isinstance(reduce_op, dist.ReduceOp) else reduce_op
    name = _OPS.get(kind)
    if name is None:
        raise ArgumentError(f"{_WHAT}: ReduceOp {kind} is not supported")
    if dtype == torch.bool:
        name = _BOOL.get(kind)
        if name is None:
            raise ArgumentError(f"{_WHAT}: ReduceOp {kind.name} of bool tensors has no meaning")
    premul = None
    if kind == _RED.PREMUL_SUM:
        premul = reduce_op.factor
        if premul is None:
            raise ArgumentError(f"{_WHAT}: PREMUL_SUM without its factor")
    average = kind == _RED.AVG
    if (average or premul is not None) and not (dtype.is_floating_point or dtype.is_complex):
        raise ArgumentError(
            f"{_WHAT}: ReduceOp.{kind.name} needs a floating-point tensor, not {dtype}; "
            "reduce with SUM and scale"
        )
    return name, average, premul


class OptccProcessGroup(dist.ProcessGroup):
    """A process group of the ``optcc`` backend (module docstring); made by
    torch.distributed through :func:`register`'s creator, not by hand.

    Parameters
    ----------
    store : torch.distributed.Store
        The group's store (torch gives it a prefix of its own).
    rank, size : int
        This process's rank in the group and the group's size.
    timeout : datetime.timedelta
        For the groups underneath and for :meth:`OptccWork.wait`.
    global_ranks : sequence of int, optional
        The job's rank of each member (default ``range(size)``).
    options : OptccOptions, optional
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        global_ranks: list[int] | None = None,
        options: OptccOptions | None = None,
    ) -> None:
        super().__init__(rank, size)
        if options is None:
            options = OptccOptions()
        if not isinstance(options, OptccOptions):
            raise ArgumentTypeError(
                "pg_options of an optcc group must be an OptccOptions, not "
                f"{type(options).__name__}"
            )
        algorithm = options.algorithm or rc.algorithm or "auto"
        if algorithm != "auto":
            algorithms.get(algorithm)  # the error names the choices
        self.algorithm = algorithm
        self.links = options.links
        self.check = options.check
        self.timeout = timeout
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(size))
        store = fresh_store(store, size)  # not the keys of a group made before this one
        self._store = store
        # The library underneath, for everything that is not an AllReduce.
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._nccl = None
        if torch.cuda.is_available() and dist.is_nccl_available():
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, opts)
            self._register_backend(
                torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, self._nccl
            )
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        # OptCC's own traffic, on groups of its own (collective: every member opens them).
        self._cpu = TorchTransport.from_store(store, rank, size, self.global_ranks, "gloo", timeout)
        self._cuda: TorchTransport | None = None
        self._worker = OrderedWorker(f"optcc group of {size} (rank {rank})")
        self._down = False

    # -- torch.distributed's view ------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def optcc_transport(self) -> TorchTransport:
        """The transport of CPU tensors and NumPy arrays (``optcc_mpi.allreduce(...,
        comm=group)`` runs over it; so does ``optcc_mpi.torch.allreduce(group=group)``)."""
        return self._cpu

    def _transport(self, tensor: torch.Tensor) -> TorchTransport:
        """The transport of ``tensor``'s device (in the group's thread: the NCCL one is
        opened at the first CUDA tensor, by every rank in the same call)."""
        if not tensor.is_cuda:
            return self._cpu
        if self._cuda is None:
            if self._nccl is None:
                raise ArgumentError(f"{_WHAT}: CUDA tensors need CUDA and NCCL on every rank")
            self._cuda = TorchTransport.from_store(
                dist.PrefixStore("cuda", self._store),
                self.rank(),
                self.size(),
                self.global_ranks,
                "nccl",
                self.timeout,
            )
        return self._cuda

    # -- AllReduce -----------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> OptccWork:
        """Start reducing ``tensors`` (one tensor) in place; its :class:`OptccWork`."""
        reduce_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._submit(list(tensors), reduce_op)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> OptccWork:
        """Start reducing several tensors in place, as one message where they share a dtype
        and a device; its :class:`OptccWork`."""
        reduce_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._submit(list(tensors), reduce_op, coalesced=True)

    def _submit(
        self, tensors: list[torch.Tensor], reduce_op: Any, coalesced: bool = False
    ) -> OptccWork:
        refuse: Exception | None = None
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            refuse = ArgumentTypeError(f"{_WHAT}: expected a list of tensors")
            tensors = []
        elif not coalesced and len(tensors) != 1:
            refuse = ArgumentError(f"{_WHAT}: one tensor per call (got {len(tensors)})")
        return submit(
            self._worker,
            tensors,
            lambda: self._reduce_all(tensors, reduce_op, refuse),
            self.timeout,
        )

    def run(self, tensors: list[torch.Tensor], job: Callable[[TorchTransport], Any]) -> OptccWork:
        """Run ``job(transport)`` on the group's thread, after every call made before it,
        with the transport of ``tensors``' device (the DDP hook's path over an ``optcc``
        group: its buckets keep their place among the group's other reductions)."""
        return submit(self._worker, tensors, lambda: job(self._transport(tensors[0])), self.timeout)

    def _reduce_all(
        self, tensors: list[torch.Tensor], reduce_op: Any, refuse: Exception | None
    ) -> None:
        """In the group's thread: reduce each run of tensors that share dtype and device as
        one flat message (a single tensor: itself). Every check agrees across the ranks
        first (:func:`~optcc_mpi.tensors.reduce_tensor`), so a refusal is raised on every
        rank and nothing changes."""
        if refuse is not None:
            reduce_tensor(
                None, "sum", self.algorithm, self.links, self._cpu, None, False, True, False,
                _WHAT, refuse=refuse,
            )  # fmt: skip
            return
        runs: list[list[torch.Tensor]] = []
        for t in tensors:
            if runs and _same_kind(runs[-1][0], t):
                runs[-1].append(t)
            else:
                runs.append([t])
        for run in runs:
            flat = run[0] if len(run) == 1 else torch.cat([t.detach().reshape(-1) for t in run])
            error: Exception | None = None
            op, average, premul = "sum", False, None
            try:
                op, average, premul = _op(reduce_op, flat.dtype)
                wire = self._transport(flat)
            except ArgumentError as exc:
                error, wire = exc, self._cpu
            reduce_tensor(
                flat, op, self.algorithm, self.links, wire, None, average, self.check,
                flat.dtype in HALF, _WHAT, refuse=error, premul=premul,
            )  # fmt: skip
            if len(run) > 1:
                offset = 0
                for t in run:
                    n = t.numel()
                    t.detach().view(-1).copy_(flat[offset : offset + n])
                    offset += n

    # -- everything else: the library underneath ------------------------------------------------
    # torch's trampoline for a Python process group calls the base class's version of
    # these with the GIL held when the subclass does not define them; a gloo thread that
    # then needs the GIL (to free a tensor it holds) while the base class waits for that
    # thread's queue deadlocks (1 call in 8 or so here). Defined here, each is a plain
    # call of the library's own binding, which lets the GIL go.
    def _library(self, tensors: list[torch.Tensor]) -> Any:
        """The library that moves ``tensors``: NCCL for CUDA tensors, else gloo."""
        if tensors and tensors[0].is_cuda:
            if self._nccl is None:
                raise ArgumentError("CUDA tensors need CUDA and NCCL on every rank")
            return self._nccl
        return self._gloo

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._library(tensors).broadcast(tensors, opts)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> Any:
        return self._library(inputs).allgather(outputs, inputs, opts)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> Any:
        return self._library(outputs).reduce_scatter(outputs, inputs, opts)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 - c10d's name
        output_splits: list[int],
        input_splits: list[int],
        opts: Any,
    ) -> Any:
        return self._library([input]).alltoall_base(
            output, input, output_splits, input_splits, opts
        )

    def barrier(self, opts: Any) -> Any:
        return self._gloo.barrier(opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        return self._library(tensors).send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self._library(tensors).recv(tensors, src, tag)

    # -- teardown ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Finish the submitted reductions, stop the group's thread and shut its groups
        down (``destroy_process_group`` calls it)."""
        if self._down:
            return
        self._down = True
        self._worker.close(timeout=self.timeout.total_seconds())
        for t in (self._cpu, self._cuda):
            if t is not None:
                t.close()
        for backend in (self._gloo, self._nccl):
            if backend is not None:
                try:
                    backend.shutdown()
                except RuntimeError:  # a peer already gone
                    pass

    def abort(self) -> None:
        """Stop without waiting for submitted reductions (torch's error path)."""
        self._worker.close(timeout=0.0)
        self.shutdown()


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device


def _create(backend_opts: Any, pg_options: Any) -> OptccProcessGroup:
    """torch.distributed's creator of an ``optcc`` group (extended API: the global ranks
    and ``pg_options`` come with it)."""
    ranks = list(getattr(backend_opts, "global_ranks_in_group", []) or [])
    return OptccProcessGroup(
        backend_opts.store,
        backend_opts.group_rank,
        backend_opts.group_size,
        backend_opts.timeout,
        ranks or None,
        pg_options,
    )


def register() -> None:
    """Make ``"optcc"`` a torch.distributed backend for CPU and CUDA (once; importing
    :mod:`optcc_mpi.torch` calls it)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
