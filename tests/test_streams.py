"""The stream protocol of :mod:`optcc_mpi.torch.streams` on the CPU, with recording fakes
(issue 33, deliver 2): the order of record, wait, launch and completion; every device of a
call; one side stream per group and device; a wait that leaves the host free."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("torch")

from optcc_mpi.testing.fake_streams import FakeStreams, FakeTensor  # noqa: E402
from optcc_mpi.torch.streams import SideStreams, StreamCall  # noqa: E402


def _in_thread(body: Callable[[], object]) -> object:
    """``body()`` on a new thread (as the group's thread runs a job: its current streams
    are the devices' default streams); its result, or its error raised here."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(body())
        except BaseException as exc:  # noqa: BLE001 - raised again below
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _job(fake: FakeStreams, *what: str) -> Callable[[], str]:
    def job() -> str:
        for w in what:
            fake.launch(w)
        return "result"

    return job


def test_order_of_record_wait_launch_complete() -> None:
    """The call records on the caller's stream; the side stream waits on it; the job's
    work goes to the side stream from the group's thread; the completion is recorded
    there; the caller's wait queues a wait on it and returns with the device not done."""
    fake = FakeStreams()
    fake.set_device("cuda:0")
    grad = FakeTensor("grad", "cuda:0")
    call = SideStreams(fake).start([grad])
    assert fake.log == [("record", "e1", "default:cuda:0")]
    assert _in_thread(lambda: call.run(_job(fake, "messages", "reduce"))) == "result"
    assert call.wait() is True
    assert fake.log == [
        ("record", "e1", "default:cuda:0"),
        ("wait", "side1:cuda:0", "e1"),
        ("keep", "grad", "side1:cuda:0"),
        ("launch", "messages", "side1:cuda:0"),
        ("launch", "reduce", "side1:cuda:0"),
        ("record", "e2", "side1:cuda:0"),
        ("wait", "default:cuda:0", "e2"),
    ]
    # wait() returned while the device has not run the job: the host was not held.
    assert not call.is_completed()
    fake.finish()
    assert call.is_completed()
    assert fake.entries("host-sync") == []


def test_caller_on_its_own_stream() -> None:
    """The caller's *current* stream, not the default one, is recorded at the call and
    made to wait at ``wait()``; the thread that waits may be on another stream."""
    fake = FakeStreams()
    mine = fake.user_stream("mine", "cuda:0")
    streams = SideStreams(fake)
    with fake.using([mine]):
        call = streams.start([FakeTensor("x", "cuda:0")])
    _in_thread(lambda: call.run(_job(fake, "reduce")))
    other = fake.user_stream("other", "cuda:0")
    with fake.using([other]):
        call.wait()
    assert fake.entries("record")[0] == ("record", "e1", "mine")
    assert fake.entries("wait") == [("wait", "side1:cuda:0", "e1"), ("wait", "other", "e2")]


def test_every_device_of_a_call() -> None:
    """Tensors on two devices: an event on the caller's stream of each, each device's side
    stream waits on its own, the job runs with both side streams current, a completion
    event on each, and the wait makes both current streams wait."""
    fake = FakeStreams()
    tensors = [FakeTensor("a", "cuda:1"), FakeTensor("b", "cuda:0"), FakeTensor("c", "cuda:1")]
    call = SideStreams(fake).start(tensors)
    assert call.devices == ["cuda:0", "cuda:1"]

    def job() -> None:
        fake.launch("on first")  # the first device is current
        fake.set_device("cuda:1")
        fake.launch("on second")

    _in_thread(lambda: call.run(job))
    call.wait()
    assert fake.log == [
        ("record", "e1", "default:cuda:0"),
        ("record", "e2", "default:cuda:1"),
        ("wait", "side1:cuda:0", "e1"),
        ("wait", "side2:cuda:1", "e2"),
        ("keep", "a", "side2:cuda:1"),
        ("keep", "b", "side1:cuda:0"),
        ("keep", "c", "side2:cuda:1"),
        ("launch", "on first", "side1:cuda:0"),
        ("launch", "on second", "side2:cuda:1"),
        ("record", "e3", "side1:cuda:0"),
        ("record", "e4", "side2:cuda:1"),
        ("wait", "default:cuda:0", "e3"),
        ("wait", "default:cuda:1", "e4"),
    ]
    fake.finish()
    assert call.is_completed()


def test_one_side_stream_per_group_and_device() -> None:
    """Two groups on one device have two side streams; one group's calls share its own."""
    fake = FakeStreams()
    one, two = SideStreams(fake), SideStreams(fake)
    t = FakeTensor("t", "cuda:0")
    calls = [one.start([t]), two.start([t]), one.start([t])]
    for call in calls:
        _in_thread(lambda call=call: call.run(_job(fake, "work")))
    launches = [e[2] for e in fake.entries("launch")]
    assert launches[0] == launches[2] != launches[1]
    assert one.stream("cuda:0") is not two.stream("cuda:0")
    assert one.stream("cuda:1") is not one.stream("cuda:0")


def test_wait_holds_the_host_only_until_the_job_is_queued() -> None:
    """Before the group's thread has queued the job, the host waits (at most the group's
    timeout): there is no completion event yet to make the stream wait on."""
    fake = FakeStreams()
    streams = SideStreams(fake, timeout=datetime.timedelta(milliseconds=20))
    call = streams.start([FakeTensor("t", "cuda:0")])
    with pytest.raises(RuntimeError, match="not queued"):
        call.wait()
    assert not call.is_completed()
    call.run(_job(fake, "late"))
    assert call.wait() is True


def test_wait_with_a_timeout_waits_for_the_device() -> None:
    """As NCCL's ``wait(timeout)``: the stream waits, then the host polls the completion
    event until it passes or the time is up (polling is a query, not a host wait)."""
    fake = FakeStreams()
    call = SideStreams(fake).start([FakeTensor("t", "cuda:0")])
    call.run(_job(fake, "work"))
    with pytest.raises(RuntimeError, match="did not complete"):
        call.wait(datetime.timedelta(milliseconds=20))
    assert fake.queries > 0
    fake.finish()
    assert call.wait(datetime.timedelta(seconds=30)) is True
    assert fake.entries("host-sync") == []


class _Future:
    """Stands for a CUDA-aware ``torch.futures.Future``: notes the current stream when it
    is completed (where the real one records its events)."""

    def __init__(self, fake: FakeStreams) -> None:
        self.fake = fake
        self.completed_on: str | None = None
        self.value: Any = None
        self.error: BaseException | None = None

    def set_result(self, value: Any) -> None:
        self.value, self.completed_on = value, self.fake.current_stream("cuda:0").name

    def set_exception(self, exc: BaseException) -> None:
        self.error, self.completed_on = exc, self.fake.current_stream("cuda:0").name


def test_future_completed_on_the_side_stream() -> None:
    fake = FakeStreams()
    call = SideStreams(fake).start([FakeTensor("t", "cuda:0")])
    future = _Future(fake)
    _in_thread(lambda: call.run(_job(fake, "work"), future))  # type: ignore[arg-type]
    assert future.value == "result" and future.completed_on == "side1:cuda:0"
    # The future is completed after the completion event is recorded.
    assert fake.log[-1] == ("record", "e2", "side1:cuda:0")


def test_a_failed_job() -> None:
    """The job's error goes to the future (``run`` does not raise then) and to ``wait``;
    the call counts as completed and no stream is made to wait on a completion that was
    never recorded."""
    fake = FakeStreams()
    call: StreamCall = SideStreams(fake).start([FakeTensor("t", "cuda:0")])
    future = _Future(fake)

    def job() -> None:
        raise ValueError("refused on every rank")

    assert call.run(job, future) is None  # type: ignore[arg-type]
    assert isinstance(future.error, ValueError) and future.completed_on == "side1:cuda:0"
    with pytest.raises(ValueError, match="refused"):
        call.wait()
    assert call.is_completed() and isinstance(call.exception(), ValueError)
    assert [e for e in fake.entries("wait") if e[1].startswith("default")] == []
    with pytest.raises(ValueError):
        SideStreams(fake).start([]).run(job)  # no future: raised


def test_cpu_tensors_have_no_streams() -> None:
    fake = FakeStreams()
    call = SideStreams(fake).start([FakeTensor("t", "cpu")])
    assert call.devices == []
    assert call.run(lambda: 7) == 7
    assert call.wait() and call.is_completed()
    assert fake.log == []


def test_calls_in_call_order_on_the_groups_thread() -> None:
    """As the backend would use it: calls started by the caller, run by the group's
    ordered thread (:class:`~optcc_mpi.torch.worker.OrderedWorker`); each call's work
    follows the previous call's on the one side stream, and the second call's wait on the
    caller's stream is queued only after the first call's completion was recorded."""
    torch = pytest.importorskip("torch")
    from optcc_mpi.torch.worker import OrderedWorker

    fake = FakeStreams()
    streams = SideStreams(fake)
    worker = OrderedWorker("test group")
    futures = []
    try:
        for name in ("bucket0", "bucket1"):
            call = streams.start([FakeTensor(name, "cuda:0")])
            future: Any = torch.futures.Future()
            # The worker's own future gets None: the call's future is completed by run(),
            # with the side streams current.
            worker.submit(
                lambda c=call, n=name, f=future: c.run(_job(fake, n), f),
                future=torch.futures.Future(),
            )
            futures.append((call, future))
        for call, future in futures:
            assert future.wait() == "result"
            call.wait()
    finally:
        worker.close()
    # Event names depend on which thread made an event first: read them from the log.
    log, side = fake.log, "side1:cuda:0"
    ready = [e[1] for e in fake.entries("record") if e[2] == "default:cuda:0"]
    done = [e[1] for e in fake.entries("record") if e[2] == side]
    assert len(ready) == len(done) == 2
    assert [e for e in fake.entries("wait") if e[1] == side] == [
        ("wait", side, ready[0]),
        ("wait", side, ready[1]),
    ]
    assert [e[1:] for e in fake.entries("launch")] == [("bucket0", side), ("bucket1", side)]
    # The second call's work waits on the caller only after the first call was queued.
    assert log.index(("record", done[0], side)) < log.index(("wait", side, ready[1]))


def test_the_backends_cuda_path_follows_the_protocol() -> None:
    """``work.submit`` for tensors on a device, as the backend and the hook call it, driven
    with the recording fake: the caller's ready event, the job on the side stream, the
    future completed there, and ``wait()`` making the caller's stream wait on the
    completion without a host synchronisation."""
    torch = pytest.importorskip("torch")
    import datetime

    from optcc_mpi.torch.work import submit
    from optcc_mpi.torch.worker import OrderedWorker

    fake = FakeStreams()
    worker = OrderedWorker("test group")
    worker.stream_api = fake
    tensor = FakeTensor("grad", "cuda:0")
    try:
        work = submit(worker, [tensor], _job(fake, "bucket"), datetime.timedelta(seconds=30))
        assert work.wait() is True
        assert work.is_completed() is False  # the device has not got there
        fake.finish()
        assert work.is_completed() and work.exception() is None
        assert work.get_future().wait() == [tensor]
    finally:
        worker.close()
    side = "side1:cuda:0"
    assert [e[1:] for e in fake.entries("launch")] == [("bucket", side)]
    assert fake.entries("host-sync") == []
    ready = [e[1] for e in fake.entries("record") if e[2] == "default:cuda:0"]
    done = [e[1] for e in fake.entries("record") if e[2] == side]
    assert ("wait", side, ready[0]) in fake.log
    assert ("wait", "default:cuda:0", done[0]) in fake.log  # the caller's stream waits
    del torch
