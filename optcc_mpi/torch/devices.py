"""The kind of device a call's tensors are on, agreed across the ranks before a transport
is chosen.

The ``optcc`` backend moves CPU tensors over gloo and CUDA tensors over NCCL, on
transports of their own (the NCCL one opened at the first CUDA call, collectively). A
rank whose tensors are on the CPU while another's are on a GPU would pick different
transports, run its argument check on a different control group, or wait in the opening
of a transport its peer never opens: the job stalls until the timeout and says nothing
useful. So the kind is agreed first, on a group every rank has whatever its tensors (the
CPU transport's gloo control group), and a difference is one clear error, the same words
on every rank:

1. :func:`device_kind` (this rank, no communication): ``"cpu"``, ``"cuda"``, or for a
   call whose own tensors are on several kinds of device their kinds joined by ``+``.
2. :func:`kind_code` of it is one more integer field of the fixed-shape agreement
   (:func:`optcc_mpi.check.agreement.agree_fields`, one MAX all-reduce of a few integers): the
   ranks agree where its minimum equals its maximum.
3. Only where they do not (the error path, so the usual call pays nothing more): every
   rank's kind is gathered and :func:`mixed_device_error` words the error, the same on
   every rank because it is made from the same gathered list.

:func:`agree_device_kind` does 2 and 3 on a transport; :func:`mixed_device_error` is the
pure part, for a backend that folds the field into an agreement of its own.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from optcc_mpi.check import agreement
from optcc_mpi.errors import ArgumentError, mark_everywhere

__all__ = ["device_kind", "kind_code", "mixed_device_error", "agree_device_kind"]


def _type_of(device: Any) -> str:
    """``"cuda"`` of ``torch.device("cuda", 1)`` or of ``"cuda:1"``."""
    kind = getattr(device, "type", None)
    return kind if isinstance(kind, str) else str(device).partition(":")[0]


def device_kind(tensors: Sequence[Any]) -> str:
    """The kind of device of a call's ``tensors`` (anything with a ``device``): one device
    type (``"cpu"``, ``"cuda"``), or the sorted types joined by ``+`` where this rank's
    own tensors are on several; ``"none"`` for no tensors. The index is left out: rank r
    on ``cuda:r`` is the usual NCCL job."""
    kinds = sorted({_type_of(t.device) for t in tensors})
    return "+".join(kinds) if kinds else "none"


def kind_code(kind: str) -> int:
    """A non-negative integer naming ``kind``, the same in every process (a field of
    :func:`optcc_mpi.check.agreement.agree_fields`)."""
    return zlib.crc32(kind.encode()) & 0x7FFFFFFF


def mixed_device_error(kinds: Sequence[str], what: str) -> ArgumentError | None:
    """The error of a call whose ranks' tensors are on different kinds of device.

    Parameters
    ----------
    kinds : sequence of str
        Every rank's :func:`device_kind`, in rank order (gathered: the same list on every
        rank, so the same words).
    what : str
        What was being done (``"all_reduce on the optcc backend"``).

    Returns
    -------
    ArgumentError or None
        None where every rank's tensors are on one kind of device; else the error to
        raise on every rank, marked as raised everywhere
        (:func:`optcc_mpi.errors.mark_everywhere`).
    """
    if len(set(kinds)) <= 1:
        return None
    ranks: dict[str, list[int]] = {}
    for rank, kind in enumerate(kinds):
        ranks.setdefault(kind, []).append(rank)
    parts = []
    for kind, where in sorted(ranks.items(), key=lambda kv: kv[1][0]):
        named = agreement.describe_ranks(where)
        parts.append(f"{kind} on {named}")
    words = (
        f"{what}: the ranks' tensors are on different kinds of device ({'; '.join(parts)}); "
        "every rank must pass tensors on the same kind of device (CUDA tensors go over NCCL, "
        "CPU tensors over gloo)"
    )
    error = ArgumentError(words)
    mark_everywhere(error, words)
    return error


def agree_device_kind(wire: Any, tensors: Sequence[Any], what: str) -> str:
    """Agree on the kind of device of a call's tensors over ``wire`` (a transport every
    rank has whatever its tensors: the CPU transport, whose control group is gloo); the
    kind, or the same :class:`~optcc_mpi.errors.ArgumentError` on every rank.

    One MAX all-reduce of two integers; a second collective (the kinds gathered) only
    where the ranks differ."""
    kind = device_kind(tensors)
    if wire.size > 1:
        lo, hi = agreement.agree_fields(wire, [kind_code(kind)])
        if lo[0] != hi[0]:
            error = mixed_device_error(wire.allgather(kind), what)
            if error is not None:
                raise error
    return kind
