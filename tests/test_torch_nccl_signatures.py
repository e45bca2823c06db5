"""The NCCL transport's calls against torch's real signatures, on the CPU (issue 33).

CI has no GPU and its torch build has no ``ProcessGroupNCCL``, so the NCCL path of
:class:`~optcc_mpi.transports.distributed.TorchTransport` runs here over fake carriers whose
every method accepts exactly the calls torch's own class accepts: the signatures are read
at test time from the pybind docstrings of ``torch._C._distributed_c10d.Backend`` (what
``from_store`` opens) and ``ProcessGroup`` (a registered group), not written by hand. A
change of signature in torch, or a call of ours that does not fit one (the issue's
``Backend._start_coalescing(device)``), fails here rather than on every rank of a GPU job.

The fakes move the bytes: the ranks are threads of this process and share one
:class:`Wire` (mailboxes per sender, receiver and tag; collectives by a barrier). The
executor's grouped driver (:attr:`Completion.GROUPED`, NCCL's) runs every registered
algorithm through ``TorchTransport(library="nccl")`` on CPU tensors, checked against a
float64 reference.
"""

from __future__ import annotations

import collections
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402 - after the skip

from optcc_mpi import algorithms  # noqa: E402
from optcc_mpi.arrays import torch_array_ops  # noqa: E402
from optcc_mpi.executor import execute  # noqa: E402
from optcc_mpi.links import Links  # noqa: E402
from optcc_mpi.transports import Completion  # noqa: E402
from optcc_mpi.transports.base import Post  # noqa: E402
from optcc_mpi.transports.distributed import Carriers, TorchTransport  # noqa: E402
from optcc_mpi.watch import _HEAD, MessageLayout  # noqa: E402

C10D = torch._C._distributed_c10d
#: Stands for "has a default" in the signatures read from docstrings (pybind prints a
#: default's repr, which is not always Python: ``<... object at 0x...>``).
_DEFAULT = object()
#: How long a fake waits for a peer before failing the test (a bug, not a slow machine).
_PATIENCE = 60.0


# -- signatures read from torch ---------------------------------------------------------
def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside any bracket (types such as
    ``collections.abc.Sequence[torch.Tensor]``, defaults such as ``<RedOpType.SUM: 0>``)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([<":
            depth += 1
        elif ch in ")]>" and not (ch == ">" and text[i - 1] == "-"):
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:])
    return [p.strip() for p in parts]


def parse_pybind(name: str, doc: str) -> list[inspect.Signature]:
    """The signatures of method ``name`` in its pybind docstring (one per overload), the
    ``self`` parameter left out; each parameter's annotation is the docstring's text."""
    sigs = []
    for line in doc.splitlines():
        head = line.strip()
        if head[:1].isdigit():  # "2. allreduce(...)" of an overloaded function
            head = head.partition(". ")[2]
        if not head.startswith(f"{name}(") or "->" not in head:
            continue
        inner = head[len(name) + 1 : head.rindex(") ->")]
        params = []
        for part in _split_top(inner)[1:]:
            left, has_default, _ = part.partition(" = ")
            pname, _, annotation = left.partition(": ")
            params.append(
                inspect.Parameter(
                    pname.strip(),
                    inspect.Parameter.POSITIONAL_OR_KEYWORD,
                    default=_DEFAULT if has_default else inspect.Parameter.empty,
                    annotation=annotation.strip(),
                )
            )
        sigs.append(inspect.Signature(params))
    return sigs


def _fits(annotation: str, value: object) -> bool:
    """Whether ``value`` is of the type a pybind annotation names, where the test can tell
    (unknown types are let through: the count and names of arguments still bind)."""
    if annotation == "torch.Tensor":
        return isinstance(value, torch.Tensor)
    if annotation == "torch.device":
        return isinstance(value, torch.device)
    if annotation == "collections.abc.Sequence[torch.Tensor]":
        return isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value)
    if annotation == "typing.SupportsInt | typing.SupportsIndex":
        return isinstance(value, int) and not isinstance(value, bool)
    prefix = "torch._C._distributed_c10d."
    if annotation.startswith(prefix) and annotation.endswith("Options"):
        return isinstance(value, getattr(C10D, annotation[len(prefix) :]))
    return True


def check_call(cls: type, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise TypeError unless ``cls.name(self, *args, **kwargs)`` fits one of the
    signatures torch documents for it (as pybind would refuse it)."""
    method = getattr(cls, name, None)
    if method is None:
        raise TypeError(f"torch {torch.__version__}'s {cls.__name__} has no method {name}")
    sigs = parse_pybind(name, method.__doc__ or "")
    assert sigs, f"no signature found in the docstring of {cls.__name__}.{name}"
    for sig in sigs:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            continue
        if all(_fits(sig.parameters[k].annotation, v) for k, v in bound.arguments.items()):
            return
    raise TypeError(
        f"{cls.__name__}.{name} of torch {torch.__version__} takes "
        f"{' or '.join(str(s) for s in sigs)}; called with args={args!r} kwargs={kwargs!r}"
    )


# -- the fake carriers ----------------------------------------------------------------------
class Wire:
    """What the ranks (threads) share: messages by (sender, receiver, tag), in posting
    order, and one slot per rank for the collectives."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.boxes: dict[tuple[int, int, int], collections.deque[torch.Tensor]] = (
            collections.defaultdict(collections.deque)
        )
        self.slots: list[torch.Tensor | None] = [None] * size
        self.meet = threading.Barrier(size, timeout=_PATIENCE)

    def put(self, src: int, dst: int, tag: int, data: torch.Tensor) -> None:
        with self.cond:
            self.boxes[src, dst, tag].append(data.clone())
            self.cond.notify_all()

    def take(self, src: int, dst: int, tag: int, into: torch.Tensor) -> None:
        with self.cond:
            box = self.boxes[src, dst, tag]
            if not self.cond.wait_for(lambda: bool(box), _PATIENCE):
                raise TimeoutError(f"rank {dst}: no message from {src} with tag {tag}")
            got = box.popleft()
        assert got.shape == into.shape and got.dtype == into.dtype, (got.shape, into.shape)
        into.copy_(got)

    def everyone(self, rank: int, mine: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``mine``, in rank order (a collective)."""
        self.slots[rank] = mine.clone()
        self.meet.wait()
        rows = [t for t in self.slots if t is not None]
        self.meet.wait()  # nobody overwrites a slot before everyone read it
        return rows


class Done(dist.Work):
    """A request: ``then()`` runs at the first wait (a receive waits for its message)."""

    def __init__(self, then: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._then = then

    def wait(self, timeout: object = None) -> bool:
        then, self._then = self._then, None
        if then is not None:
            then()
        return True


class _Calls:
    """The fake's methods: each call is first checked against :attr:`torch_class`'s
    signature, then carried out on the :class:`Wire`."""

    torch_class: type
    wire: Wire
    me: int
    log: list[tuple[str, int]]

    def _setup(self, wire: Wire, rank: int) -> None:
        self.wire, self.me = wire, rank
        self._group: list[tuple[bool, torch.Tensor, int, int]] | None = None
        #: (method, number of arguments) of every call, for the tests to read.
        self.log = []

    def _check(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        check_call(self.torch_class, name, args, kwargs)
        self.log.append((name, len(args) + len(kwargs)))

    def _start_coalescing(self, *args: Any, **kwargs: Any) -> None:
        self._check("_start_coalescing", args, kwargs)
        assert self._group is None, "a group started inside another"
        self._group = []

    def _end_coalescing(self, *args: Any, **kwargs: Any) -> dist.Work:
        self._check("_end_coalescing", args, kwargs)
        assert self._group is not None, "a group ended that was not started"
        group, self._group = self._group, None
        # As NCCL's group: every send of the group is posted before any receive waits.
        for send, data, peer, tag in group:
            if send:
                self.wire.put(self.me, peer, tag, data)
        recvs = [(data, peer, tag) for send, data, peer, tag in group if not send]
        return Done(lambda: [self.wire.take(peer, self.me, tag, d) for d, peer, tag in recvs])

    def send(self, *args: Any, **kwargs: Any) -> dist.Work:
        self._check("send", args, kwargs)
        (data,), peer, tag = args
        if self._group is not None:
            self._group.append((True, data, peer, tag))
            return Done()
        self.wire.put(self.me, peer, tag, data)
        return Done()

    def recv(self, *args: Any, **kwargs: Any) -> dist.Work:
        self._check("recv", args, kwargs)
        (data,), peer, tag = args
        if self._group is not None:
            self._group.append((False, data, peer, tag))
            return Done()
        return Done(lambda: self.wire.take(peer, self.me, tag, data))

    def _allgather_base(self, *args: Any, **kwargs: Any) -> dist.Work:
        self._check("_allgather_base", args, kwargs)
        out, mine = args[0], args[1]
        out.copy_(torch.cat([r.reshape(-1) for r in self.wire.everyone(self.me, mine)]))
        return Done()

    def allreduce(self, *args: Any, **kwargs: Any) -> dist.Work:
        self._check("allreduce", args, kwargs)
        (t,), opts = args[0], args[1]
        kind = opts.reduceOp.op  # the option holds a ReduceOp; its RedOpType says which
        reduce = {dist.ReduceOp.SUM: torch.sum, dist.ReduceOp.MAX: torch.amax}[kind]
        t.copy_(reduce(torch.stack(self.wire.everyone(self.me, t)), dim=0))
        return Done()

    def barrier(self, *args: Any, **kwargs: Any) -> dist.Work:
        self._check("barrier", args, kwargs)
        self.wire.everyone(self.me, torch.zeros(1))
        return Done()


class FakeBackend(_Calls):
    """A c10d ``Backend`` as :meth:`TorchTransport.from_store` opens it
    (``ProcessGroupNCCL`` on a store). pybind gives ``Backend`` no constructor to call from
    Python, so this is not an instance of it: it takes its calls' shapes only."""

    torch_class = C10D.Backend

    def __init__(self, wire: Wire, rank: int) -> None:
        self._setup(wire, rank)


class FakeProcessGroup(_Calls, dist.ProcessGroup):
    """A registered ``ProcessGroup`` (a group the user made) carrying the messages."""

    torch_class = C10D.ProcessGroup

    def __init__(self, wire: Wire, rank: int) -> None:
        dist.ProcessGroup.__init__(self, rank, wire.size)
        self._setup(wire, rank)


def _on_ranks(size: int, body: Callable[[int], object]) -> list[object]:
    """``body(rank)`` on ``size`` threads; their results in rank order (the first error
    raised again here)."""
    results: list[object] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * _PATIENCE)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    return results


def _nccl_transports(size: int, kind: type[_Calls]) -> list[TorchTransport]:
    """One ``TorchTransport(library="nccl")`` per rank, its messages on a fake of ``kind``
    and its control traffic on a fake ``Backend`` (gloo's, as ``from_store`` opens it)."""
    data_wire, ctrl_wire = Wire(size), Wire(size)

    def make(rank: int) -> TorchTransport:
        data = kind(data_wire, rank)
        ctrl = FakeBackend(ctrl_wire, rank)
        return TorchTransport("nccl", rank, size, range(size), Carriers(data, data, ctrl))

    return _on_ranks(size, make)  # type: ignore[return-value]


# -- the tests ----------------------------------------------------------------------------
def test_parse_pybind_reads_names_defaults_and_overloads() -> None:
    doc = (
        "f(*args, **kwargs)\nOverloaded function.\n\n"
        "1. f(self: m.C, tensors: collections.abc.Sequence[torch.Tensor], opts: m.O = "
        "<m.O object at 0x7f>) -> c10d::Work\n\n"
        "2. f(self: m.C, tensor: torch.Tensor, op: m.R = <RedOpType.SUM: 0>, timeout: "
        "datetime.timedelta | None = None) -> c10d::Work\n"
    )
    one, two = parse_pybind("f", doc)
    assert list(one.parameters) == ["tensors", "opts"]
    assert one.parameters["tensors"].annotation == "collections.abc.Sequence[torch.Tensor]"
    assert one.parameters["opts"].default is _DEFAULT
    assert list(two.parameters) == ["tensor", "op", "timeout"]
    assert two.parameters["tensor"].default is inspect.Parameter.empty
    assert parse_pybind("g", "g(self: m.C) -> None\n")[0].parameters == {}


@pytest.mark.parametrize("kind", [FakeBackend, FakeProcessGroup])
def test_fakes_take_torchs_signatures(kind: type[_Calls]) -> None:
    """Every method of the fakes has a signature read from torch's class, and a call that
    fits none is refused as pybind refuses it."""
    fake = kind(Wire(1), 0)
    for name in ("_start_coalescing", "_end_coalescing", "send", "recv", "_allgather_base"):
        assert parse_pybind(name, getattr(kind.torch_class, name).__doc__), name
    t = torch.zeros(1)
    with pytest.raises(TypeError, match="send of torch"):
        fake.send(t, 0, 0)  # a tensor where torch takes a list of them
    with pytest.raises(TypeError, match="_start_coalescing of torch"):
        fake._start_coalescing(torch.device("cpu"), torch.device("cpu"))


def test_backend_coalescing_takes_no_device() -> None:
    """The call issue 33 found (torch 2.13: ``Backend._start_coalescing(self)``): the
    fake ``Backend`` refuses a device, as ``ProcessGroupNCCL`` on a store does, and the
    registered group takes one."""
    cpu = torch.device("cpu")
    with pytest.raises(TypeError):
        FakeBackend(Wire(1), 0)._start_coalescing(cpu)
    pg = FakeProcessGroup(Wire(1), 0)
    pg._start_coalescing(cpu)
    pg._end_coalescing(cpu).wait()


@pytest.mark.parametrize("kind", [FakeBackend, FakeProcessGroup])
def test_batch_posts_one_group_per_call(kind: type[_Calls]) -> None:
    """``batch`` on the NCCL transport: one group, the sends and receives inside it, the
    one request it returns completing the receives."""
    wires = _nccl_transports(2, kind)

    def level(rank: int) -> torch.Tensor:
        t = wires[rank]
        out = torch.full((3,), -1, dtype=torch.uint8)
        mine = torch.full((3,), rank + 1, dtype=torch.uint8)
        reqs = t.batch([Post(True, mine, 1 - rank, 7), Post(False, out, 1 - rank, 7)])
        assert len(reqs) == 1
        t.wait(reqs[0])
        return out

    got = _on_ranks(2, level)
    assert [g.tolist() for g in got] == [[2, 2, 2], [1, 1, 1]]  # type: ignore[attr-defined]
    for t in wires:
        names = [name for name, _ in t.data.log]
        assert names == ["_start_coalescing", "send", "recv", "_end_coalescing"]


@pytest.mark.parametrize("kind", [FakeBackend, FakeProcessGroup])
@pytest.mark.parametrize("size", [2, 3])
def test_grouped_driver_over_nccl_transport(kind: type[_Calls], size: int) -> None:
    """Every registered algorithm (a slow link included) through the executor's grouped
    driver on ``TorchTransport(library="nccl")``: each rank's float32 sum within
    ``size - 1`` roundings of the float64 one, the same bits on every rank, and every
    level posted as one group."""
    wires = _nccl_transports(size, kind)
    assert all(t.caps.completion is Completion.GROUPED for t in wires)
    count = 1000 + size
    rng = np.random.default_rng(33)
    inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(size)]
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    bound = (size - 1) * np.finfo(np.float32).eps * np.sum(np.abs(inputs), axis=0)
    cpu = torch_array_ops("cpu")
    for name in algorithms.names():
        small = {"chunk_bytes": 1024} if "chunk_bytes" in algorithms.get(name).params else {}
        sched = algorithms.build(name, size, count, Links({size - 1: 0.5}), itemsize=4, **small)

        def run(rank: int, sched: Any = sched) -> torch.Tensor:
            buf = torch.from_numpy(inputs[rank].copy())
            execute(sched, buf, comm=wires[rank], op="sum", arrays=cpu)
            return buf

        before = [len(t.data.log) for t in wires]
        out = _on_ranks(size, run)
        for rank, got in enumerate(out):
            err = np.abs(got.numpy().astype(np.float64) - exact)  # type: ignore[attr-defined]
            assert np.all(err <= bound), (name, rank, float(err.max()))
            assert torch.equal(got, out[0]), (name, rank)  # type: ignore[arg-type]
        for t, start in zip(wires, before):
            calls = [n for n, _ in t.data.log[start:]]
            groups = calls.count("_start_coalescing")
            assert groups == calls.count("_end_coalescing")
            sends = sum(k == "send" for k in calls)
            assert (groups > 0) == (sends + calls.count("recv") > 0), (name, calls[:8])


class _FakeClock:
    """A :class:`~optcc_mpi.transports.base.LevelClock` whose marks are host times, and
    which the test says the device has passed (``reached``) or not yet."""

    def __init__(self) -> None:
        self.marks: list[float] = []
        self.passed = False

    def mark(self) -> object:
        self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def reached(self, marks: Any) -> bool:
        return self.passed

    def seconds(self, a: object, b: object) -> float:
        return self.marks[int(b)] - self.marks[int(a)]  # type: ignore[call-overload]


def test_nccl_levels_are_timed_on_the_device_and_read_without_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 33: on NCCL the host never sees a message arrive, so the grouped driver marks
    each level on the device (the transport's clock: CUDA events there, a fake here) and
    the watch reads the marks at the next call's check. A call whose marks the device has
    not passed by then contributes values of messages not recorded, of the agreed length
    (the check never waits); once it has, every message is timed from its level's marks
    and the rows pair into a rate for every rank."""
    from optcc_mpi.watch import LinkWatch

    size = 3
    count = 1 << 17  # 512 KiB of float32: messages above the watch's 64 KiB
    sched = algorithms.build("ring", size, count, Links(), itemsize=4)
    cpu = torch_array_ops("cpu")

    def call(passed: bool) -> tuple[list[Any], list[np.ndarray], list[_FakeClock]]:
        clocks = [_FakeClock() for _ in range(size)]
        wires = _nccl_transports(size, FakeBackend)
        for t, clock in zip(wires, clocks):
            monkeypatch.setattr(t, "level_clock", lambda arrays, c=clock: c)
        watches = [LinkWatch(size) for _ in range(size)]

        def run(rank: int) -> Any:
            buf = torch.ones(count)
            epoch = time.perf_counter()
            stats = execute(sched, buf, comm=wires[rank], op="sum", arrays=cpu)
            assert torch.equal(buf, torch.full((count,), float(size)))
            watches[rank].record_messages(rank, sched, 4, stats, epoch)
            return stats

        stats = _on_ranks(size, run)
        for clock in clocks:
            clock.passed = passed  # the device, by the next call's check
        return stats, [w.contribution() for w in watches], clocks

    stats, early, clocks = call(passed=False)
    for rank, st in enumerate(stats):
        # One mark at the start, two per level with messages; the times wait on the device.
        levels = st.device.levels
        assert levels and len(clocks[rank].marks) == 1 + 2 * len(levels)
    assert len({c.size for c in early}) == 1
    assert all(np.all(c[size + _HEAD : size + _HEAD + c[size]] == -1) for c in early)

    stats, late, _ = call(passed=True)
    assert [c.size for c in late] == [c.size for c in early]
    for st in stats:
        assert st.device is None and st.recvs and st.sends
        assert all(0 <= m.posted <= m.completed for m in st.recvs)
        assert all(m.posted == 0.0 for m in st.sends)
    lay = MessageLayout(sched, 4, LinkWatch(size).length - size - 2)
    rates = lay.rates(np.array(late)[:, size + _HEAD :])
    assert np.all(rates > 0), rates
