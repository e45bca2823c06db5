"""The torch.distributed backend ``optcc``: OptCC inside every PyTorch job.

``import optcc_mpi.torch`` registers it (:func:`register`) for CPU and CUDA tensors; then
whatever calls torch.distributed reaches OptCC with no change of its own code::

    dist.init_process_group("optcc")                   # DDP (no hook), dist.all_reduce ...
    dist.new_group(ranks, backend="optcc")
    init_device_mesh("cuda", (R, S), mesh_dim_names=("replicate", "shard"),
                     backend_override={"replicate": "optcc"})   # FSDP2's HSDP

The path of one call
--------------------
::

    dist.all_reduce(t)                           torch.distributed, Python
      -> OptccProcessGroup.allreduce([t], opts)  this module: torch's forms, its op
         the short path (a CPU tensor, SUM or AVG, healthy links, auto):
         -> worker.OrderedWorker.run_here        nothing queued: run here, in order
            -> tensors.Lane.run                  the tensor classified, once
               -> collectives.Prepared.start     the argument check (a short message
                                                 travels in it: done), then
                  -> TorchTransport.allreduce    gloo's AllReduce
         each file entered once, going down; the work made, complete, on the way back.
         every other call:
         -> work.submit(...) -> OptccWork        queued in call order, returned at once
      -> work.OptccWork.wait()                   the caller waits: its job's turn has
         -> OrderedWorker.steal(job)             come, so it runs here (else the group's
                                                 thread runs it, and wait() waits)
            -> tensors.start_tensor              a NumPy view of a CPU tensor, the one
                                                 classification of the call's buffer
               -> collectives.start_call         one argument check, the plan, then
                  -> TorchTransport.allreduce    gloo's AllReduce (healthy links)
                  or the executor                OptCC's schedule (degraded links)

A synchronous call thus wakes no other thread: the check (one collective, which carries
short messages itself) and gloo's AllReduce for longer ones run in the caller's thread,
on the short path with nothing else between (:func:`~optcc_mpi.torch.tensors.lane`: the same
collectives and bits as the whole path, whichever path each rank takes). A call made
while others are queued, or not waited for at once (DDP's buckets, FSDP2's reductions),
runs on the group's own thread (:class:`~optcc_mpi.torch.worker.OrderedWorker`) in call
order, on the short path where it applies, so DDP and FSDP2 overlap them with the backward
pass as they do with gloo and NCCL.

What a group does
-----------------
``all_reduce`` and ``all_reduce_coalesced`` run the registered algorithms: every
``ReduceOp`` (``AVG`` and ``PREMUL_SUM`` included) on every dtype the package reduces;
on healthy links ``auto`` leaves the data to gloo's (NCCL's) ring, which it cannot beat,
and on degraded links it runs OptCC. Sparse tensors go to gloo's AllReduce, as on gloo.

Every other collective (broadcast, all_gather and ``all_gather_into_tensor``,
reduce_scatter and ``reduce_scatter_tensor``, all_to_all, barrier, send/recv, gather,
scatter, reduce) goes to the library underneath: a gloo group for CPU tensors, an NCCL
group for CUDA tensors (made where CUDA and NCCL are available), both opened on the same
store and registered as the group's backends for their devices. Each takes its turn
after the reductions queued before it; ``barrier`` completes after all of them, as
gloo's does. ``dist.monitored_barrier`` is refused by torch itself for any backend but
gloo; ``group.monitored_barrier(timeout, wait_all_ranks=True)`` runs gloo's.

Settings
--------
Per group, :class:`OptccOptions` (``pg_options=`` of ``init_process_group`` and
``new_group``, or the second element of a ``backend_override`` pair); else the
algorithm from ``$OPTCC_ALGORITHM`` (default ``"auto"``) and the links from
``$OPTCC_LINKS`` (``probe``, ``watch`` or a profile, in the job's global ranks).
:attr:`OptccWork.stats <optcc_mpi.torch.work.OptccWork.stats>` says what a call ran;
with ``links="watch"``, ``$OPTCC_LINKS_LOG`` records what the watch adopts.

Errors
------
Arguments that differ across ranks (element count, dtype, op, average, algorithm,
links) and an op or dtype the backend cannot reduce raise the same
:class:`~optcc_mpi.errors.ArgumentError` on every rank from ``wait()`` (torch's
``all_reduce`` waits for you unless ``async_op=True``), with the tensor unchanged.
``destroy_process_group`` stops the group's thread and shuts its groups down, and
returns at once: a call of this rank's still pending fails with an error that says the
group was destroyed, and a peer's call waiting for this rank on the board fails at once,
naming this rank. A group can be made again afterwards. ``abort()`` fails queued and
running work at once.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)

from optcc_mpi import algorithms
from optcc_mpi.communicators import CallRecord
from optcc_mpi.config import rc
from optcc_mpi.errors import ArgumentError, ArgumentTypeError
from optcc_mpi.links import Links
from optcc_mpi.torch.devices import agree_device_kind
from optcc_mpi.torch.tensors import HALF, Lane, LaneCall, TensorCall, lane, start_tensor
from optcc_mpi.torch.work import _WHAT, OptccWork, submit
from optcc_mpi.torch.worker import AbortedError, InFlight, OrderedWorker
from optcc_mpi.transports.base import ABORT_POLL
from optcc_mpi.transports.distributed import TorchTransport, fresh_store

__all__ = [
    "BACKEND",
    "AbortedError",
    "OptccOptions",
    "OptccProcessGroup",
    "register",
    "stage_through_host",
]

#: The name torch.distributed knows the backend by.
BACKEND = "optcc"
#: torch's reductions (``RedOpType`` members; the stubs name them on ``ReduceOp`` only).
_RED: Any = dist.ReduceOp.RedOpType
_T = TypeVar("_T")

#: torch's reductions as the package names them: ``(op, op on bool tensors)``. On bool
#: tensors torch's arithmetic reductions are logical ones (NCCL reduces bools as bytes
#: that are 0 or 1: a sum or a max is true where any is, a product or min where all); the
#: bit operations are the logical ones there too; AVG and PREMUL_SUM have no meaning.
_OPS: dict[Any, tuple[str, str | None]] = {
    _RED.SUM: ("sum", "lor"),
    _RED.PRODUCT: ("prod", "land"),
    _RED.MIN: ("min", "land"),
    _RED.MAX: ("max", "lor"),
    _RED.BAND: ("band", "land"),
    _RED.BOR: ("bor", "lor"),
    _RED.BXOR: ("bxor", "lxor"),
    _RED.AVG: ("sum", None),
    _RED.PREMUL_SUM: ("sum", None),
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
        Agree on every call's arguments across the ranks (the one collective that also
        carries short messages): a mismatch is an error on every rank rather than a
        wrong sum or a hang.
    timeout : datetime.timedelta, optional
        The group's timeout, in place of the one ``init_process_group``/``new_group``
        (or the device mesh) is given: for the groups underneath and for
        :meth:`OptccWork.wait`.
    carrier : {"nccl", "host"}, optional
        How CUDA tensors travel: ``"nccl"`` (NCCL underneath, the default) or ``"host"``:
        each call's tensors are copied to pinned host memory on the group's side stream,
        reduced there as CPU tensors are (gloo underneath), and copied back, so that
        ranks that share a GPU (which NCCL refuses) can run the CUDA path; the group's
        thread then waits for its own copies, the caller's thread never does. Default
        ``$OPTCC_CARRIER``, else ``"nccl"``. The same on every rank.
    """

    algorithm: str | None = None
    links: Links | str | None = None
    check: bool = True
    timeout: datetime.timedelta | None = None
    carrier: str | None = None

    @property
    def _timeout(self) -> datetime.timedelta | None:
        # torch's DeviceMesh reads a backend's options' timeout by this name.
        return self.timeout


class _Done:
    """A call finished already: its record (what :meth:`TensorCall.wait` returns)."""

    __slots__ = ("record",)
    request = None

    def __init__(self, record: CallRecord | None = None) -> None:
        self.record = record

    def wait(self) -> CallRecord | None:
        return self.record


#: What a job hands back: a started call, whose ``wait()`` completes it (its record).
_Step = TensorCall | LaneCall | _Done


#: How an optcc group's CUDA tensors can travel (OptccOptions.carrier).
_CARRIERS = ("nccl", "host")


def _any_cuda(tensors: Sequence[Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)


def stage_through_host(
    tensors: Sequence[torch.Tensor],
    reduce: Callable[[list[torch.Tensor]], _T],
    synchronize: Callable[[], None],
) -> _T:
    """``reduce(hosts)`` of host copies of ``tensors``, whose results are copied back: the
    host-staged carrier of CUDA tensors. The copies are queued on the current streams
    (pinned host memory where CUDA is there, so that they are asynchronous and the
    allocator keeps each buffer until its copy is done); ``synchronize()`` waits for the
    copies to the host before ``reduce`` reads them; the copies back are queued, not
    waited for (the call's completion event follows them)."""
    pinned = torch.cuda.is_available()
    hosts = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned) for t in tensors]
    for host, t in zip(hosts, tensors):
        host.copy_(t.detach(), non_blocking=pinned)
    synchronize()
    result = reduce(hosts)
    for host, t in zip(hosts, tensors):
        t.detach().copy_(host, non_blocking=pinned)
    return result


#: Signatures whose short path (or its absence) a group keeps.
_LANES = 64
#: No short path made yet for a signature (OptccProcessGroup._lane).
_NO_LANE: Any = object()


def _reduce_op(reduce_op: Any, dtype: torch.dtype) -> tuple[str, bool, Any]:
    """``(package op, average, premul factor)`` of torch's ``reduce_op`` (a ``ReduceOp``
    or its ``RedOpType``) on ``dtype``."""
    kind = getattr(reduce_op, "op", reduce_op)
    names = _OPS.get(kind)
    if names is None:
        raise ArgumentError(f"{_WHAT}: ReduceOp {kind} is not supported")
    name = names[1] if dtype == torch.bool else names[0]
    if name is None:
        raise ArgumentError(f"{_WHAT}: ReduceOp {kind.name} of bool tensors has no meaning")
    premul = None
    if kind == _RED.PREMUL_SUM:
        premul = getattr(reduce_op, "factor", None)
        if premul is None:
            raise ArgumentError(f"{_WHAT}: PREMUL_SUM without its factor")
    average = kind == _RED.AVG
    if (average or premul is not None) and not (dtype.is_floating_point or dtype.is_complex):
        raise ArgumentError(
            f"{_WHAT}: ReduceOp.{kind.name} needs a floating-point tensor, not {dtype}; "
            "reduce with SUM and scale"
        )
    return name, average, premul


def _lane_key(tensor: torch.Tensor, reduce_op: Any) -> tuple[torch.dtype, int, Any]:
    """The signature a group keeps a short path for: dtype, size, torch's reduction."""
    return tensor.dtype, tensor.numel(), getattr(reduce_op, "op", reduce_op)


def _tensor_list(tensors: Any) -> list[Any]:
    """torch's ``tensors`` argument in either form (a tensor, or a sequence of them)."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if isinstance(tensors, (list, tuple)):
        return list(tensors)
    return [tensors]  # refused by the check, on every rank


def _op_of(opts: Any) -> Any:
    """The ``ReduceOp`` of torch's options argument in any of its forms: options, a
    ``ReduceOp``, its ``RedOpType``, or None (SUM)."""
    if opts is None:
        return dist.ReduceOp.SUM
    return getattr(opts, "reduceOp", opts)


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
        For the groups underneath and for :meth:`OptccWork.wait` (``options.timeout``,
        where set, takes its place).
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
        global_ranks: Sequence[int] | None = None,
        options: OptccOptions | None = None,
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (a Python process group's form)
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
        carrier = options.carrier or rc.carrier or "nccl"
        if carrier not in _CARRIERS:
            raise ArgumentError(
                f"carrier must be one of {', '.join(map(repr, _CARRIERS))}, not {carrier!r}"
            )
        #: How CUDA tensors travel (:class:`OptccOptions`).
        self.carrier = carrier
        if options.timeout is not None:
            timeout = options.timeout
        self.timeout = timeout
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(size))
        store = fresh_store(store, size)  # not the keys of a group made before this one
        self._store = store
        # The library underneath, for everything that is not an AllReduce (Any: the stubs
        # of ProcessGroupGloo list none of its collectives).
        self._gloo: Any = dist.ProcessGroupGloo(
            dist.PrefixStore("gloo", store), rank, size, timeout
        )
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._nccl = None
        if carrier == "host":
            # CUDA tensors are staged through host memory: gloo underneath for them too
            # (its own broadcast and all_reduce take CUDA tensors; the rest, as on gloo).
            self._register_backend(
                torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, self._gloo
            )
        elif torch.cuda.is_available() and dist.is_nccl_available():
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, opts)
            self._register_backend(
                torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, self._nccl
            )
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        # OptCC's own traffic, on groups of its own (collective: every member opens them).
        # Named as the optcc group in its errors (a timeout on the board, an abort).
        self._cpu = TorchTransport.from_store(
            store, rank, size, self.global_ranks, "gloo", timeout, backend=BACKEND
        )
        self._cuda: TorchTransport | None = None
        self._worker = OrderedWorker(f"optcc group of {size} (rank {rank})")
        self._down = False
        # The short path of each signature seen (dtype, size, op), or None where a call of
        # it takes the whole path (tensors.lane); bounded (_LANES).
        self._lanes: dict[tuple[torch.dtype, int, Any], Lane | None] = {}

    # -- torch.distributed's view ------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def optcc_transport(self) -> TorchTransport:
        """The transport of CPU tensors and NumPy arrays (``optcc_mpi.allreduce(...,
        comm=group)`` runs over it, in the group's order: :meth:`optcc_ordered`)."""
        return self._cpu

    def optcc_ordered(self, call: Callable[[TorchTransport], _T]) -> _T:
        """``call(transport)`` in the group's order, from any thread, waited for: how
        :func:`optcc_mpi.allreduce` runs a call given this group as ``comm`` (its
        messages share the group's transport with the calls queued on it)."""
        future: torch.futures.Future[_T] = torch.futures.Future()
        job = self._worker.submit(lambda: call(self._cpu), future, park=True)
        OptccWork(future, self.timeout, lambda: self._worker.steal(job)).wait()  # type: ignore[arg-type]
        return future.value()

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
                backend=BACKEND,
            )
        return self._cuda

    # -- ordering ------------------------------------------------------------------------------
    def _call(self, tensors: list[Any], job: Callable[[], _Step], park: bool) -> OptccWork:
        """Run ``job`` in the group's order (on the group's thread, or in the caller's
        when it waits: :meth:`OrderedWorker.steal`); its :class:`OptccWork`. ``park``:
        the caller waits at once."""

        cpu = all(isinstance(t, torch.Tensor) and not t.is_cuda for t in tensors)

        def run() -> CallRecord | InFlight | None:
            step = job()
            if cpu and step.request is not None:
                return InFlight(step.wait)  # (the group's thread goes on meanwhile)
            return step.wait()

        return submit(self._worker, tensors, run, self.timeout, park, overlap=cpu)

    # -- AllReduce -----------------------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None, timeout: Any = None) -> OptccWork:
        """Start reducing ``tensors`` (one tensor, or a list of one) in place; its
        :class:`OptccWork`. ``opts``: ``AllreduceOptions``, a ``ReduceOp`` or None (SUM),
        as any torch.distributed process group takes them."""
        del timeout  # (the group's timeout applies)
        tensors = _tensor_list(tensors)
        reduce_op = _op_of(opts)
        if len(tensors) == 1 and isinstance(tensors[0], torch.Tensor) and tensors[0].is_sparse:
            # Sparse tensors: gloo's own AllReduce, as on a gloo group.
            args = () if opts is None else (opts,)
            return self._library_call(tensors, lambda: self._gloo.allreduce(tensors, *args))
        # torch's dist.all_reduce says whether it waits at once (opts.asyncOp False): the
        # call is then run here if nothing is queued, else parked for it to run
        # (OrderedWorker.submit), and the group's thread is not woken for nothing.
        park = getattr(opts, "asyncOp", True) is False
        if self.carrier == "host" and _any_cuda(tensors):
            return self._staged(tensors, reduce_op, coalesced=False)
        if len(tensors) == 1:
            tensor = tensors[0]
            short = self._lane(tensor, reduce_op)
            if short is not None:
                if park:
                    # Down once: the worker runs the lane's call here, which classifies
                    # the tensor and goes on to the check and the wire (None: not the
                    # lane's tensor, or its settings changed: the whole path).
                    try:
                        ran, record = self._worker.run_here(short.run, tensor)
                    except Exception as exc:  # noqa: BLE001 - raised by the work's wait()
                        return self._completed(tensor, None, exc)
                    if ran and record is not None:
                        return self._completed(tensor, record, None)
                if short.takes(tensor):
                    return self._call(tensors, lambda: short.start(tensor), park)
                if not short.prepared.current():
                    # (made again at the next call: the settings changed, config.reload())
                    self._lanes.pop(_lane_key(tensor, reduce_op), None)
        return self._call(tensors, lambda: self._reduce(tensors, reduce_op), park)

    def _lane(self, tensor: Any, reduce_op: Any) -> Lane | None:
        """The short path of ``tensor``'s signature with ``reduce_op``
        (:func:`~optcc_mpi.torch.tensors.lane`), made at the first call of the signature;
        None: the whole path. Whether it takes this very tensor is the lane's to say
        (:meth:`~optcc_mpi.torch.tensors.Lane.run`, :meth:`~optcc_mpi.torch.tensors.Lane.takes`).
        Where NCCL is there, every call takes the whole path (it agrees on the kind of
        device first)."""
        if self._nccl is not None or not isinstance(tensor, torch.Tensor):
            return None
        key = _lane_key(tensor, reduce_op)
        found = self._lanes.get(key, _NO_LANE)
        if found is _NO_LANE:
            kind = key[2]
            if kind == _RED.PREMUL_SUM:
                return None
            found = None
            names = _OPS.get(kind)
            if names is not None and names[tensor.dtype == torch.bool] == "sum":  # SUM, AVG
                found = lane(
                    tensor, "sum", kind == _RED.AVG, self._cpu, self.algorithm, self.links,
                    self.check,
                )  # fmt: skip
            if len(self._lanes) >= _LANES:
                self._lanes.clear()
            self._lanes[key] = found
        return found

    def _completed(
        self, tensor: torch.Tensor, record: CallRecord | None, error: Exception | None
    ) -> OptccWork:
        """The work of a call run in the caller's thread: complete, with ``record``, or
        failed with ``error`` (raised by its ``wait()``, as a queued call's is)."""
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        if error is not None:
            future.set_exception(cast(Any, error))  # (torch's stub types it as the value)
        else:
            future.set_result([tensor])
        work = OptccWork(future, self.timeout)
        if record is not None:
            work.stats = record
        return work

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> OptccWork:
        """Start reducing several tensors in place, as one message per run of tensors
        that share a dtype and a device; its :class:`OptccWork`. Every tensor is checked
        before any is written."""
        tensors = _tensor_list(tensors)
        reduce_op = _op_of(opts)
        if self.carrier == "host" and _any_cuda(tensors):
            return self._staged(tensors, reduce_op, coalesced=True)
        return self._call(
            tensors, lambda: self._reduce(tensors, reduce_op, coalesced=True), park=False
        )

    def _staged(self, tensors: list[Any], reduce_op: Any, coalesced: bool) -> OptccWork:
        """Reduce CUDA ``tensors`` through host memory (``carrier="host"``): on the
        group's thread with its side streams current, after the caller's work on them."""

        def job() -> CallRecord | None:
            devices = {t.device for t in tensors if t.is_cuda}

            def synchronize() -> None:
                for device in devices:
                    torch.cuda.current_stream(device).synchronize()

            return stage_through_host(
                tensors,
                lambda hosts: self._reduce(hosts, reduce_op, coalesced).wait(),
                synchronize,
            )

        return submit(self._worker, tensors, job, self.timeout)

    def run(self, tensors: list[torch.Tensor], job: Callable[[TorchTransport], Any]) -> OptccWork:
        """Run ``job(transport)`` on the group's thread, after every call made before it,
        with the transport of ``tensors``' device (the DDP hook's path over an ``optcc``
        group: its buckets keep their place among the group's other reductions)."""
        return submit(self._worker, tensors, lambda: job(self._transport(tensors[0])), self.timeout)

    def _reduce(self, tensors: list[Any], reduce_op: Any, coalesced: bool = False) -> _Step:
        """Start reducing ``tensors``: one tensor as itself, several (or, coalesced, a
        lone strided one) as one flat message per run of dtype and device, copied back.
        Every check agrees across the ranks in the first run's argument check (the shape
        of every run rides in it), so a refusal is raised on every rank before anything
        changes."""
        refuse: Exception | None = None
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            refuse = ArgumentTypeError(f"{_WHAT}: expected a list of tensors")
        elif not coalesced and len(tensors) != 1:
            refuse = ArgumentError(f"{_WHAT}: one tensor per call (got {len(tensors)})")
        elif any(t.is_sparse for t in tensors):
            refuse = ArgumentError(f"{_WHAT}: sparse tensors are reduced one per call")
        if refuse is not None:
            start_tensor(
                None, "sum", self.algorithm, self.links, self._cpu, None, False, True, False,
                refuse=refuse,
            ).wait()  # fmt: skip
            return _Done()
        if not coalesced:
            return self._start(tensors[0], reduce_op, None)
        runs: list[list[torch.Tensor]] = []
        for t in tensors:
            if runs and runs[-1][0].dtype == t.dtype and runs[-1][0].device == t.device:
                runs[-1].append(t)
            else:
                runs.append([t])
        shapes = "; ".join(f"{t.numel()} {t.dtype} on {t.device.type}" for t in tensors)
        record = None
        for i, run in enumerate(runs):
            # Several tensors travel as one flat copy; so does a lone strided one, which
            # cannot be reduced in place (as gloo's coalesced call, which reduces either).
            copied = len(run) > 1 or not run[0].is_contiguous()
            flat = torch.cat([t.detach().reshape(-1) for t in run]) if copied else run[0]
            record = self._start(flat, reduce_op, shapes if i == 0 else None).wait()
            if copied:
                offset = 0
                for t in run:
                    n = t.numel()
                    t.detach().copy_(flat[offset : offset + n].view(t.shape))
                    offset += n
        return _Done(record)

    def _start(self, tensor: torch.Tensor, reduce_op: Any, shapes: str | None) -> TensorCall:
        """Start the reduction of one tensor (``shapes``: the coalesced call's tensors,
        which must agree too)."""
        error: Exception | None = None
        op, average, premul = "sum", False, None
        wire = self._cpu
        if self._nccl is not None and self.check and self.size() > 1:
            # Where CUDA tensors could go over NCCL, a rank with CPU tensors and one with
            # CUDA tensors would agree on different control groups and wait out the
            # timeout: the kind of device is agreed first, on the CPU transport.
            agree_device_kind(self._cpu, [tensor], _WHAT)
        try:
            op, average, premul = _reduce_op(reduce_op, tensor.dtype)
            wire = self._transport(tensor)
        except ArgumentError as exc:
            error = exc
        # (a coalesced call's first check agrees on every tensor of the call)
        label = None if shapes is None else ("coalesced tensors", f"{shapes}, average={average}")
        call = start_tensor(
            tensor, op, self.algorithm, self.links, wire, None, average, self.check,
            tensor.dtype in HALF, refuse=error, premul=premul, label=label,
        )  # fmt: skip
        return call

    # -- everything else: the library underneath ------------------------------------------------
    def _library(self, tensors: Sequence[Any]) -> Any:
        """The library that moves ``tensors``: NCCL for CUDA tensors, else gloo."""
        first = tensors[0] if tensors else None
        while isinstance(first, (list, tuple)) and first:
            first = first[0]
        if isinstance(first, torch.Tensor) and first.is_cuda and self.carrier != "host":
            if self._nccl is None:
                raise ArgumentError("CUDA tensors need CUDA and NCCL on every rank")
            return self._nccl
        return self._gloo

    def _library_call(self, tensors: Sequence[Any], call: Callable[[], Any]) -> Any:
        """``call()`` (a call of the library underneath) in the group's order: at once
        when nothing is queued (the library's own work), else on the group's thread
        after the calls before it.

        torch's trampoline for a Python process group calls the base class's version of
        a collective with the GIL held when the subclass does not define it; a gloo thread
        that then needs the GIL (to free a tensor it holds) while the base class waits for
        that thread's queue deadlocks. Defined here, each is a plain call of the
        library's own binding, which lets the GIL go."""
        flat = [t for t in _flatten(tensors) if isinstance(t, torch.Tensor)]
        ran, work = self._worker.now(call)
        if ran:
            # The library's threads let go of a call's tensors after reporting it done:
            # the transport keeps the last few, so that none of those threads frees a
            # tensor Python saw while the interpreter finalises (TorchTransport._held).
            return self._cpu._held(work, *flat)
        return submit(self._worker, flat, lambda: call().wait(), self.timeout)

    def _pass(self, method: str, tensors: Sequence[Any], *args: Any) -> Any:
        """The library's ``method(*args)`` for ``tensors``, in the group's order."""
        library = self._library(tensors)
        return self._library_call(args, lambda: getattr(library, method)(*args))

    def broadcast(self, tensors: Any, opts: Any = None, timeout: Any = None) -> Any:
        tensors = _tensor_list(tensors)
        if opts is None:
            opts = BroadcastOptions()
        elif not isinstance(opts, BroadcastOptions):
            root, opts = opts, BroadcastOptions()  # broadcast(tensor, root)
            opts.rootRank = root
        return self._pass("broadcast", tensors, tensors, opts)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        if isinstance(inputs, torch.Tensor):  # allgather(outputs, tensor)
            outputs, inputs = [list(outputs)], [inputs]
        if opts is None:
            opts = AllgatherOptions()
        return self._pass("allgather", inputs, outputs, inputs, opts)

    def reduce_scatter(  # type: ignore[override]  # (each of torch's forms, told apart here)
        self, outputs: Any, inputs: Any, opts: Any = None
    ) -> Any:
        if isinstance(outputs, torch.Tensor):  # reduce_scatter(output, inputs, op)
            op = _op_of(opts)
            outputs, inputs, opts = [outputs], [list(inputs)], ReduceScatterOptions()
            opts.reduceOp = op
        elif opts is None:
            opts = ReduceScatterOptions()
        return self._pass("reduce_scatter", outputs, outputs, inputs, opts)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 - c10d's name
        output_splits: list[int],
        input_splits: list[int],
        opts: Any = None,
    ) -> Any:
        args = (output, input, output_splits, input_splits) + (() if opts is None else (opts,))
        return self._pass("alltoall_base", [input], *args)

    alltoall_base = all_to_all_single  # type: ignore[assignment]  # (c10d's name for it)

    def barrier(self, opts: Any = None) -> Any:
        """A barrier that completes after every call made on the group before it (the
        reductions queued and those in flight), as gloo's does."""
        if not isinstance(opts, BarrierOptions):
            timeout, opts = opts, BarrierOptions()
            if isinstance(timeout, datetime.timedelta):
                opts.timeout = timeout

        def job() -> None:
            self._gloo.barrier(opts).wait()

        return submit(self._worker, [], job, self.timeout)

    def monitored_barrier(
        self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """gloo's monitored barrier (names the ranks that did not arrive), after every
        call made on the group before it. torch's ``dist.monitored_barrier`` refuses
        every backend but gloo by name: call this method of the group instead."""
        args = () if timeout is None else (timeout,)

        def job() -> None:
            self._gloo.monitored_barrier(*args, wait_all_ranks=wait_all_ranks)

        # (in the group's order, run here: its turn comes after this rank's calls before
        # it, with no collective of its own in front, so that a rank that never arrives
        # is named by gloo's barrier rather than waited for)
        submit(self._worker, [], job, self.timeout, park=True).wait()

    def send(self, tensors: Any, dst: int, tag: int = 0) -> Any:
        tensors = _tensor_list(tensors)
        return self._pass("send", tensors, tensors, dst, tag)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> Any:
        tensors = _tensor_list(tensors)
        return self._pass("recv", tensors, tensors, src, tag)

    # -- teardown ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the group's thread and shut its groups down (``destroy_process_group``
        calls it), without waiting for anyone: a call of this rank's still pending
        (queued, or waiting for its peers) fails with an :class:`AbortedError` that says
        the group was destroyed, and the peers' waits on the board for this rank end at
        once with an error naming this rank (:meth:`Board.close
        <optcc_mpi.transports.board.Board.close>`). Nothing pending, the group's thread
        stops at once and the groups underneath are shut down in order."""
        if self._down:
            return
        self._down = True
        if self._worker.idle():
            self._worker.close()
            self._close_groups(abort=False)
            return
        # A call still pending would wait for peers that may be destroying the group too,
        # up to the group's timeout: it fails now instead, as on an abort, and the
        # libraries underneath are aborted, not shut down in order (their own threads may
        # be inside a wait for a peer).
        self._worker.abort(
            AbortedError(
                f"{_WHAT}: the process group was destroyed on this rank (rank {self.rank()}) "
                "while this call was pending"
            )
        )
        self._close_groups(abort=True, destroyed=True)
        self._worker.join(timeout=4 * ABORT_POLL)  # (its wait looks every ABORT_POLL)

    def abort(self) -> None:
        """Stop at once: queued and running work fails with :class:`AbortedError`, the
        libraries underneath are aborted (not shut down in order), and nothing waits for
        a peer (torch's error path; ``destroy_process_group`` after it returns)."""
        if self._down:
            return
        self._down = True
        self._worker.abort(AbortedError(f"{_WHAT}: the process group was aborted"))
        self._close_groups(abort=True)
        self._worker.join(timeout=4 * ABORT_POLL)  # (its wait looks every ABORT_POLL)

    def _close_groups(self, abort: bool, destroyed: bool = False) -> None:
        for t in (self._cpu, self._cuda):
            if t is not None:
                t.abort(destroyed) if abort else t.close()
        for backend in (self._gloo, self._nccl):
            if backend is not None:
                try:
                    backend.abort() if abort else backend.shutdown()
                except RuntimeError:  # a peer already gone
                    pass


def _flatten(items: Any) -> list[Any]:
    if isinstance(items, (list, tuple)):
        return [x for item in items for x in _flatten(item)]
    return [items]


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
