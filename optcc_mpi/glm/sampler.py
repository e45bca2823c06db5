"""The sample sequence: identical on every rank, one permutation per epoch.

Epoch ``e`` visits the rows in the order ``default_rng([seed, e]).permutation(m)``; because
each permutation depends only on ``(seed, e)``, every rank draws the same sequence without
communicating, and a resumed run needs to know only the epoch and the block it stopped at.

Blocking (our choice; ``docs/casgd.md``): an epoch has ``K = m // b`` mini-batches of ``b``
consecutive entries of its permutation; the last ``m % b`` rows of the permutation sit out
that epoch (different rows each epoch). The ``K`` steps are grouped into
``ceil(K / s)`` outer iterations of ``s`` steps each; the last one of an epoch is shorter
(``K % s`` steps) when ``s`` does not divide ``K``. Outer iterations never straddle an
epoch, so the full-training loss at the end of each epoch is the loss of the same iterate
for SGD and for every ``s``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ArgumentError

__all__ = ["Sampler"]


@dataclass(frozen=True)
class Sampler:
    """Mini-batch sequence for ``m`` rows, batch size ``b``, ``s`` steps per outer iteration.

    Parameters
    ----------
    m : int
        Number of training rows.
    b : int
        Mini-batch size.
    s : int
        Steps per outer iteration (1 for plain SGD's bookkeeping).
    seed : int
        Shared seed; the same on every rank.
    """

    m: int
    b: int
    s: int
    seed: int

    def __post_init__(self) -> None:
        if self.b < 1 or self.s < 1:
            raise ArgumentError(f"b and s must be at least 1, got b={self.b}, s={self.s}")
        if self.s * self.b > self.m:
            raise ArgumentError(
                f"s*b = {self.s}*{self.b} = {self.s * self.b} exceeds the {self.m} training rows; "
                "lower s or b"
            )

    @property
    def steps_per_epoch(self) -> int:
        """``K = m // b`` mini-batch steps per epoch."""
        return self.m // self.b

    @property
    def blocks_per_epoch(self) -> int:
        """Outer iterations per epoch, ``ceil(K / s)``."""
        return -(-self.steps_per_epoch // self.s)

    def permutation(self, epoch: int) -> np.ndarray:
        """Row order of ``epoch`` (int64, length ``m``)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.m)

    def block(self, perm: np.ndarray, index: int) -> tuple[np.ndarray, int]:
        """Rows of outer iteration ``index`` of an epoch and its number of steps.

        Returns
        -------
        rows : ndarray
            ``steps * b`` row indices, mini-batch after mini-batch.
        steps : int
            ``s``, or fewer for the last outer iteration of the epoch.
        """
        steps = min(self.s, self.steps_per_epoch - index * self.s)
        if steps < 1:
            raise IndexError(f"outer iteration {index} is past the end of the epoch")
        start = index * self.s * self.b
        return perm[start : start + steps * self.b], steps
