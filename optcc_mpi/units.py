"""Sizes, rates and durations from text: one meaning of every unit, everywhere.

Every command-line option, environment variable and API argument that takes a size, a
bandwidth or a time goes through these three functions, so ``1MB`` means the same to
``model``, ``bench``, ``testbed`` and ``Emulation``.

=====================  ==========================================================
Sizes (bytes)          ``4096``, ``B``; bare ``K``/``M``/``G``/``T`` are binary as in
                       nccl-tests (``64K`` = 65,536); ``KiB``/``MiB``/``GiB``/``TiB``
                       binary; ``KB``/``MB``/``GB``/``TB`` decimal (SI: ``1MB`` =
                       1,000,000); ``kbit``/``mbit``/``gbit`` decimal bits.
Rates (bytes/s)        a number of bytes/s; ``KB/s``/``MB/s``/``GB/s`` decimal bytes,
                       ``KiB/s``/``MiB/s``/``GiB/s`` binary bytes; ``kbit``, ``mbit``,
                       ``gbit``, ``tbit`` (with or without ``/s``) decimal bits, as in
                       tc and NIC specifications (``400mbit`` = 50,000,000 bytes/s).
                       ``mbps``-style units are refused: tc reads them as bytes,
                       people as bits.
Durations (seconds)    a number of seconds; ``ns``, ``us`` (or ``µs``), ``ms``, ``s``.
=====================  ==========================================================

Units are case-insensitive except that ``b`` alone is a byte and ``bit`` a bit.
"""

from __future__ import annotations

import re
from numbers import Real

from optcc_mpi.errors import ArgumentError

__all__ = ["parse_size", "parse_rate", "parse_duration", "format_size", "format_rate"]

_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"
_RE = re.compile(rf"^\s*{_NUMBER}\s*([a-zµ/]*)\s*$")

_SIZE = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kbit": 10**3 / 8,
    "mbit": 10**6 / 8,
    "gbit": 10**9 / 8,
}
_RATE = {
    "": 1.0,
    "b/s": 1.0,
    "kb/s": 1e3,
    "mb/s": 1e6,
    "gb/s": 1e9,
    "tb/s": 1e12,
    "kib/s": 2.0**10,
    "mib/s": 2.0**20,
    "gib/s": 2.0**30,
    "tib/s": 2.0**40,
    "bit": 1 / 8,
    "kbit": 1e3 / 8,
    "mbit": 1e6 / 8,
    "gbit": 1e9 / 8,
    "tbit": 1e12 / 8,
}
_RATE.update({f"{k}/s": v for k, v in list(_RATE.items()) if k.endswith("bit")})
_TIME = {"": 1.0, "s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "µs": 1e-6}
_TIME.update({"usec": 1e-6, "ns": 1e-9})


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    return float(value) if isinstance(value, Real) else None


def _split(text: object, what: str, example: str) -> tuple[float, str]:
    match = _RE.match(str(text).lower())
    if not match:
        raise ArgumentError(f"cannot parse {what} {text!r}; use e.g. {example}")
    return float(match.group(1)), match.group(2)


def parse_size(text: str | int) -> int:
    """Bytes from ``4096``, ``"64K"``, ``"256MiB"``, ``"1GB"`` (module docstring)."""
    number = _number(text)
    if number is None:
        value, unit = _split(text, "size", "4096, 64K, 256MiB, 1GB")
        if unit not in _SIZE:
            raise ArgumentError(
                f"cannot parse size {text!r}: unknown unit {unit!r}; use B, K/M/G (binary), "
                "KiB/MiB/GiB or KB/MB/GB (decimal)"
            )
        number = value * _SIZE[unit]
    if number < 0:
        raise ArgumentError(f"size {text!r} is negative")
    return int(round(number))


def parse_rate(text: str | float) -> float:
    """Bytes per second from ``"25GB/s"``, ``"200MiB/s"``, ``"400mbit"`` or a number."""
    number = _number(text)
    if number is None:
        value, unit = _split(text, "bandwidth", "25GB/s, 200MB/s, 400mbit")
        if unit.endswith("bps"):
            raise ArgumentError(
                f"bandwidth {text!r} is ambiguous ({unit!r} is bytes to tc, bits to most "
                f"people); write {value:g}MB/s for bytes or {value:g}mbit for bits"
            )
        if unit not in _RATE:
            raise ArgumentError(
                f"cannot parse bandwidth {text!r}: unknown unit {unit!r}; use e.g. 25GB/s, "
                "200MiB/s, 400mbit"
            )
        number = value * _RATE[unit]
    if not number > 0:
        raise ArgumentError(f"bandwidth {text!r} must be positive")
    return number


def parse_duration(text: str | float) -> float:
    """Seconds from ``"20us"``, ``"1.5ms"``, ``"0.1s"`` or a number of seconds."""
    number = _number(text)
    if number is None:
        value, unit = _split(text, "duration", "20us, 1.5ms, 0.1s")
        if unit not in _TIME:
            raise ArgumentError(
                f"cannot parse duration {text!r}: unknown unit {unit!r}; use ns, us, ms or s"
            )
        number = value * _TIME[unit]
    if number < 0:
        raise ArgumentError(f"duration {text!r} is negative")
    return number


def format_size(nbytes: float) -> str:
    """``nbytes`` in binary units, as the benchmarks print sizes (``64KiB``, ``1GiB``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % (scale // 1024 or 1) == 0:
            return f"{nbytes / scale:g}{unit}"
    return f"{int(nbytes)}B"


def format_rate(bytes_per_s: float) -> str:
    """A rate as tc writes it, in decimal bits (``400mbit``, ``1.5gbit``)."""
    bits = bytes_per_s * 8
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3f}".rstrip("0").rstrip(".") + unit
    return f"{int(bits)}bit"
