"""Argument types for command lines: one parser per kind of value, shared by every tool.

Both faces that parse command lines use these: the ``optcc-mpi`` commands
(:mod:`optcc_mpi.cli`) and the lab's tools (:mod:`optcc_mpi.lab`, run as
``optcc-mpi lab TOOL``). It sits below both, next to :mod:`optcc_mpi.units`, so that
``64K``, ``400mbit``, ``0:0.5`` or ``k=64`` mean the same on every command line and the
lab never reaches up into the CLI for them.

Every type rejects a bad value with a message that quotes what the user typed (argparse
prefixes the option's name), so that ``--ranks 0`` or ``--losses 1.5`` fail before any
work starts, instead of surfacing later as a confusing error about something derived
from them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

from optcc_mpi import algorithms
from optcc_mpi.emulation import Emulation
from optcc_mpi.errors import ArgumentError
from optcc_mpi.links import Links
from optcc_mpi.units import parse_duration, parse_rate, parse_size

__all__ = [
    "size_arg",
    "positive_size_arg",
    "sizes_arg",
    "rate_arg",
    "rate_with_unit_arg",
    "duration_arg",
    "links_arg",
    "links_or_probe_arg",
    "links_learnt_arg",
    "emulation_arg",
    "int_at_least",
    "float_above",
    "ranks_arg",
    "ranks_list_arg",
    "losses_arg",
    "algorithms_arg",
    "parse_key_value",
    "key_value_arg",
    "key_values",
    "StoreTyped",
    "typed_flag",
    "alias",
]


def _wrap(fn: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """``fn`` as an argparse type: its ValueError becomes argparse's error (the message
    kept), and argparse names the type ``what`` in its own messages."""

    def conv(text: str) -> Any:
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    conv.__name__ = what
    return conv


#: Bytes from ``4096``, ``64K``, ``256MiB``, ``1GB`` (:func:`optcc_mpi.units.parse_size`).
size_arg = _wrap(parse_size, "size")
#: Bytes per second from ``25GB/s``, ``400mbit`` (:func:`optcc_mpi.units.parse_rate`).
rate_arg = _wrap(parse_rate, "bandwidth")


def rate_with_unit_arg(text: str) -> float:
    """A rate that names its unit (argparse type): ``10gbit``, ``1.25GB/s``, ``400mbit``.
    A bare number is refused: read as bytes per second, ``100`` would be 0.0008 Mbit/s
    where 100 Gbit/s was surely meant."""
    try:
        float(text)
    except ValueError:
        return rate_arg(text)
    raise argparse.ArgumentTypeError(
        f"{text!r} has no unit; a rate needs one, e.g. {text}gbit, {text}mbit or {text}GB/s"
    )


#: Seconds from ``20us``, ``1.5ms`` (:func:`optcc_mpi.units.parse_duration`).
duration_arg = _wrap(parse_duration, "duration")
#: A link profile ``RANK:FRACTION[,...]`` (:meth:`optcc_mpi.links.Links.parse`).
links_arg = _wrap(Links.parse, "link profile")
#: An emulation ``bw=RATE,latency=TIME[,degrade=...]`` (:meth:`Emulation.parse`).
emulation_arg = _wrap(Emulation.parse, "emulation")


def positive_size_arg(text: str) -> int:
    """A size in bytes of at least 1 (argparse type)."""
    value = size_arg(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least 1 byte")
    return value


def sizes_arg(text: str) -> list[int]:
    """argparse type: comma-separated sizes, each at least 1 byte (``4,1K,64K``)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: expected sizes, e.g. 4,1K,64K")
    return [positive_size_arg(item) for item in items]


def int_at_least(low: int, what: str) -> Callable[[str], int]:
    """argparse type: an integer >= ``low``; ``what`` says what it counts."""

    def conv(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be at least {low}")
        return value

    conv.__name__ = what
    return conv


def float_above(low: float, what: str) -> Callable[[str], float]:
    """argparse type: a finite number > ``low``."""

    def conv(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (value > low and value < float("inf")):
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be above {low:g}")
        return value

    conv.__name__ = what
    return conv


#: Ranks of a modelled AllReduce: one rank has nothing to reduce.
ranks_arg = int_at_least(2, "the number of ranks")


def ranks_list_arg(text: str) -> list[int]:
    """argparse type: comma-separated numbers of ranks, each at least 2."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers of ranks, e.g. 8,16,32")
    return [ranks_arg(item) for item in items]


def losses_arg(text: str) -> list[float]:
    """argparse type: comma-separated bandwidth losses, each in [0, 1) (a loss of 1 would
    leave no bandwidth at all)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: expected losses, e.g. 0.125,0.25,0.5")
    out = []
    for item in items:
        try:
            loss = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"loss {item!r} is not a number") from None
        if not 0.0 <= loss < 1.0:
            raise argparse.ArgumentTypeError(
                f"loss {item!r} is outside [0, 1): a loss is the fraction of bandwidth lost"
            )
        out.append(loss)
    return out


def links_or_probe_arg(text: str) -> str:
    """argparse type: a link profile or ``probe`` (kept as typed, checked here)."""
    if text.strip().lower() != "probe":
        links_arg(text)
    return text


def links_learnt_arg(text: str) -> str:
    """argparse type: a link profile, ``probe`` or ``watch`` (kept as typed, checked
    here): where the links may be learnt while the job runs."""
    if text.strip().lower() != "watch":
        links_or_probe_arg(text)
    return text


def algorithms_arg(text: str) -> list[str]:
    """A comma-separated list of registered algorithm names (argparse type)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected at least one algorithm name")
    for name in names:
        try:
            algorithms.get(name)
        except ArgumentError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def _typed_value(text: str) -> Any:
    # true/false, then int, then float, else the text itself: what a schedule parameter or
    # a table cell means when typed on a command line.
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            continue
    return text


def parse_key_value(text: str, *, typed: bool = True, what: str = "KEY=VALUE") -> tuple[str, Any]:
    """``"k=64"`` -> ``("k", 64)``: the one KEY=VALUE parser of the command line.

    Parameters
    ----------
    text : str
        ``KEY=VALUE``; the key is stripped and must not be empty; the value is everything
        after the first ``=`` (it may contain ``=`` itself).
    typed : bool
        Convert the value: ``true``/``false`` (any case) to bool, then int, then float,
        else keep the text (stripped). ``False`` keeps it verbatim (environment values).
    what : str
        How the error names the expected form (``COLUMN=V1,V2``).

    Returns
    -------
    tuple of (str, object)
        The key and the (converted) value.

    Raises
    ------
    ArgumentError
        No ``=``, or an empty key.
    """
    key, sep, value = str(text).partition("=")
    if not sep or not key.strip():
        raise ArgumentError(f"expected {what}, got {text!r}")
    return key.strip(), (_typed_value(value.strip()) if typed else value)


def key_value_arg(text: str) -> tuple[str, Any]:
    """:func:`parse_key_value` as an argparse type (typed values)."""
    try:
        return parse_key_value(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


key_value_arg.__name__ = "KEY=VALUE"


def key_values(items: Iterable[str], *, typed: bool = True, what: str = "KEY=VALUE") -> dict:
    """Several ``KEY=VALUE`` items as a dict (a later key wins); see :func:`parse_key_value`."""
    return dict(parse_key_value(item, typed=typed, what=what) for item in items)


class StoreTyped(argparse.Action):
    """``store``, remembering which of the option's names was typed.

    An option with an old name kept as an alias (``--ranks`` and ``--p``) uses this action,
    so that an error found later, from several arguments together, can quote the flag the
    user actually typed (:func:`typed_flag`).
    """

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        typed = dict(getattr(namespace, "typed_flags", None) or {})
        typed[self.dest] = option_string
        namespace.typed_flags = typed


def typed_flag(args: argparse.Namespace, dest: str, default: str) -> str:
    """The flag the user typed for ``dest`` (:class:`StoreTyped`), else ``default``."""
    return (getattr(args, "typed_flags", None) or {}).get(dest) or default


def alias(parser: Any, action: argparse.Action, *names: str) -> None:
    """Accept ``names`` as old names of ``action``'s option, hidden from ``--help``.

    The alias stores into the same destination with the same type, and remembers that it
    was typed (:func:`typed_flag`), so errors quote it; argparse's own errors for a bad
    value name the alias as typed. Say in ``action``'s help text that the old name works.

    Parameters
    ----------
    parser : argparse.ArgumentParser or argument group
        Where ``action`` was added (a mutually exclusive group keeps its exclusivity).
    action : argparse.Action
        What ``parser.add_argument`` returned for the current name.
    *names : str
        The old option strings.
    """
    parser.add_argument(
        *names,
        dest=action.dest,
        type=action.type,
        choices=action.choices,
        metavar=action.metavar,
        action=StoreTyped,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
