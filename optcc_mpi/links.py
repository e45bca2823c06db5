"""Link profiles: which ranks' NICs are degraded, and by how much.

A profile gives every rank a bandwidth *fraction* of the healthy rate B, in (0, 1]. It is
what an algorithm is told about the network; the absolute rate B and the per-message
latency only matter to the cost model and the simulator, which take them separately.

The string form is ``"RANK:FRACTION[,RANK:FRACTION...]"``, e.g. ``"0:0.5"`` for rank 0 at
half rate; unnamed ranks are healthy. A rank range ``"4-7:0.75"`` names several ranks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from optcc_mpi import config
from optcc_mpi.errors import ArgumentError, ArgumentTypeError
from optcc_mpi.units import parse_duration, parse_rate, parse_size

__all__ = ["Links", "parse_size", "parse_rate", "parse_duration", "ENV_LINKS"]

#: Environment variable read when ``links`` is not given.
ENV_LINKS = "OPTCC_LINKS"

_ITEM = re.compile(r"^\s*(\d+)(?:\s*-\s*(\d+))?\s*:\s*([^\s,]+)\s*$")


@dataclass(frozen=True)
class Links:
    """Per-rank NIC bandwidth as fractions of the healthy rate.

    Parameters
    ----------
    fractions : mapping of int to float
        Rank -> fraction of the healthy bandwidth, each in (0, 1]. Ranks not listed are
        healthy (fraction 1).

    Examples
    --------
    >>> Links.parse("0:0.5").vector(4)
    array([0.5, 1. , 1. , 1. ])
    >>> Links.parse("1:0.5,2:0.75").degraded
    (1, 2)
    """

    fractions: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        clean: dict[int, float] = {}
        for rank, frac in dict(self.fractions).items():
            rank_i = int(rank)
            frac_f = float(frac)
            if rank_i < 0:
                raise ArgumentError(f"link profile: rank {rank_i} is negative")
            if not (0.0 < frac_f <= 1.0) or not np.isfinite(frac_f):
                raise ArgumentError(
                    f"link profile: fraction {frac!r} for rank {rank_i} is outside (0, 1]"
                )
            if frac_f < 1.0:
                clean[rank_i] = frac_f
        object.__setattr__(self, "fractions", dict(sorted(clean.items())))

    # -- construction -------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> Links:
        """Parse ``"RANK:FRACTION[,RANK:FRACTION...]"`` (ranges ``"A-B:F"`` allowed).

        An empty string, ``"none"`` or ``"healthy"`` gives the all-healthy profile.
        """
        text = text.strip()
        if text.lower() in ("", "none", "healthy"):
            return cls({})
        fracs: dict[int, float] = {}
        for item in text.split(","):
            m = _ITEM.match(item)
            if not m:
                raise ArgumentError(
                    f"link profile: cannot parse {item.strip()!r} in {text!r}; "
                    "expected RANK:FRACTION, e.g. 0:0.5"
                )
            first = int(m.group(1))
            last = int(m.group(2)) if m.group(2) is not None else first
            if last < first:
                raise ArgumentError(f"link profile: empty rank range {item.strip()!r}")
            try:
                frac = float(m.group(3))
            except ValueError:
                raise ArgumentError(
                    f"link profile: fraction {m.group(3)!r} in {item.strip()!r} is not a number"
                ) from None
            for rank in range(first, last + 1):
                if rank in fracs:
                    raise ArgumentError(f"link profile: rank {rank} is named twice in {text!r}")
                fracs[rank] = frac
        return cls(fracs)

    @classmethod
    def from_vector(cls, fractions: Iterable[float]) -> Links:
        """Profile from one fraction per rank; the fastest rank need not be at 1.

        The vector is normalised by its maximum: only relative bandwidth matters to the
        algorithms.
        """
        vec = np.asarray(list(fractions), dtype=float)
        if vec.size == 0:
            return cls({})
        if not np.all(np.isfinite(vec)) or np.any(vec <= 0):
            raise ArgumentError(f"link profile: bandwidths must be positive and finite: {vec}")
        vec = vec / vec.max()
        return cls({i: float(f) for i, f in enumerate(vec)})

    @classmethod
    def coerce(cls, links: Links | str | Mapping[int, float] | None) -> Links:
        """Accept a Links, a string, a mapping, or None (read ``$OPTCC_LINKS``)."""
        if links is None:
            return cls.parse(config.get(ENV_LINKS) or "")
        if isinstance(links, Links):
            return links
        if isinstance(links, str):
            return cls.parse(links)
        if isinstance(links, Mapping):
            return cls(links)
        raise ArgumentTypeError(
            f"links must be a Links, a string or a mapping, not {type(links).__name__}"
        )

    # -- queries ------------------------------------------------------------------------
    @property
    def degraded(self) -> tuple[int, ...]:
        """Ranks running below the healthy rate, ascending."""
        return tuple(self.fractions)

    @property
    def healthy(self) -> bool:
        """True when no rank is degraded."""
        return not self.fractions

    def check(self, p: int) -> None:
        """Raise ValueError if a degraded rank is outside a communicator of size ``p``."""
        bad = [r for r in self.fractions if r >= p]
        if bad:
            raise ArgumentError(
                f"link profile names rank {bad[0]}, outside the communicator of size {p} "
                f"(ranks 0..{p - 1})"
            )

    def vector(self, p: int) -> np.ndarray:
        """Fractions for ranks ``0..p-1`` as a float array (checks the ranks)."""
        self.check(p)
        vec = np.ones(p)
        for rank, frac in self.fractions.items():
            vec[rank] = frac
        return vec

    def __str__(self) -> str:
        if not self.fractions:
            return "healthy"
        return ",".join(f"{r}:{f:g}" for r, f in self.fractions.items())

    def key(self) -> tuple[tuple[int, float], ...]:
        """Hashable identity, for caches."""
        return tuple(self.fractions.items())


# Unit parsing lives in optcc_mpi.units; these names stay importable from here.
