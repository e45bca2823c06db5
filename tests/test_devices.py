"""The device kind of a call, agreed before a transport is chosen (issue 33): a rank with
CPU tensors and another with CUDA tensors give the same clear error on every rank, not a
timeout. Ranks are threads (:class:`~optcc_mpi.testing.local.LocalWorld`); a CUDA tensor
is a stand-in with a CUDA ``device`` (this machine has none)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from optcc_mpi.errors import ArgumentError, everywhere
from optcc_mpi.testing.local import LocalWorld
from optcc_mpi.torch.devices import agree_device_kind, device_kind, kind_code, mixed_device_error

torch = pytest.importorskip("torch")

WHAT = "all_reduce on the optcc backend"


def _cuda(index: int) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device("cuda", index))


def test_device_kind() -> None:
    assert device_kind([torch.zeros(2)]) == "cpu"
    assert device_kind([_cuda(0), _cuda(3)]) == "cuda"  # the index is not the kind
    assert device_kind([_cuda(1), torch.zeros(1)]) == "cpu+cuda"
    assert device_kind([SimpleNamespace(device="cuda:2")]) == "cuda"
    assert device_kind([]) == "none"
    assert kind_code("cuda") == kind_code("cuda") != kind_code("cpu")
    assert kind_code("cpu+cuda") >= 0


def test_mixed_device_error_is_pure_and_names_the_ranks() -> None:
    assert mixed_device_error(["cuda"] * 4, WHAT) is None
    assert mixed_device_error([], WHAT) is None
    error = mixed_device_error(["cpu", "cuda", "cuda", "cpu", "cpu"], WHAT)
    assert isinstance(error, ArgumentError)
    assert str(error) == (
        f"{WHAT}: the ranks' tensors are on different kinds of device (cpu on ranks 0,3-4; "
        "cuda on ranks 1-2); every rank must pass tensors on the same kind of device (CUDA "
        "tensors go over NCCL, CPU tensors over gloo)"
    )
    assert everywhere(error) == str(error)
    # The same list gives the same words: what makes the error the same on every rank.
    assert str(mixed_device_error(["cpu", "cuda", "cuda", "cpu", "cpu"], WHAT)) == str(error)


def test_agreed_over_the_ranks() -> None:
    """One CPU rank among CUDA ranks: every rank raises the same error, none waits; when
    the ranks agree, each gets the kind."""
    world = LocalWorld(3, timeout=30.0)

    def call(t: object) -> str:
        rank = t.rank  # type: ignore[attr-defined]
        tensors = [torch.zeros(4)] if rank == 1 else [_cuda(rank)]
        try:
            agree_device_kind(t, tensors, WHAT)
        except ArgumentError as exc:
            return str(exc)
        return "no error"

    said = world.run(call)
    assert said[0] == said[1] == said[2]
    assert "cuda on ranks 0,2" in said[0] and "cpu on rank 1" in said[0]
    assert world.run(lambda t: agree_device_kind(t, [_cuda(t.rank)], WHAT)) == ["cuda"] * 3
    assert LocalWorld(1).run(lambda t: agree_device_kind(t, [torch.zeros(1)], WHAT)) == ["cpu"]
