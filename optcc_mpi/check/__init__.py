"""The argument check, Python and C, in one place: every collective call first agrees on
its arguments in one collective of fixed shape, so that ranks that disagree get the same
clear error before any buffer changes, and short messages travel in that same collective.

Where each part lives (below it, the transports; above it, the collectives and the torch
side, which call it)::

    protocol    the wire protocol: each rank's arguments as a 96-byte header, a room for
                short data beside it, one gather, the same decision on every rank
                (agree_header, Mismatch, reduce_gathered)
    state       what the check keeps per communicator: its buffers, the room agreed for
                the next call, the gather limit, the compiled path's context (CheckState)
    crossover   the gather limit: the largest message whose data travels in the check,
                measured once per communicator (decide)
    fastcall    the compiled call path of a short AllReduce over MPI (_fastcall.c: the
    _fastcall.c same header, check and reduction in C, byte for byte)
    agreement   agreeing on anything else across ranks: one value, fields, a function
                run on every rank with its errors shared (agree, agree_fields, Members)
    ride        a repeated short sum agreed inside its own AllReduce, by a flag per rank,
                where the transport allows it (gloo without the board): Ride

Its callers: :mod:`optcc_mpi.collectives` (every call: ``agree_header``, then the fold or
the plan) and its parts (:mod:`optcc_mpi.arguments`: the header; :mod:`optcc_mpi.planning`:
the watch's rows; :mod:`optcc_mpi.compiled_path`: the compiled call),
:class:`optcc_mpi.communicators.CommState` (owns each communicator's
``CheckState``), :mod:`optcc_mpi.torch.tensors` (a tensor call's check, the short path's
lane). docs/architecture.md has the words (check, header, room, fold, gather limit).

The names below resolve on first use: importing this package imports none of its
modules, so each keeps its place in the layers (tests/test_architecture.py).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "agree_header": "optcc_mpi.check.protocol",
    "Mismatch": "optcc_mpi.check.protocol",
    "reduce_gathered": "optcc_mpi.check.protocol",
    "CheckState": "optcc_mpi.check.state",
    "decide": "optcc_mpi.check.crossover",
    "agree": "optcc_mpi.check.agreement",
    "agree_fields": "optcc_mpi.check.agreement",
    "Members": "optcc_mpi.check.agreement",
}

__all__ = list(_EXPORTS)


# Left open: the names are functions, classes and a protocol of different modules; naming
# their types here would import them (see the module docstring).
def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'optcc_mpi.check' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
