"""A small progress bar for long work, printed by one process only.

Bars go to standard error and redraw in place on a terminal; elsewhere (batch logs) they
print a line at most every ``min_interval`` seconds, so Slurm output files stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Progress over ``total`` units of work.

    Parameters
    ----------
    total : int or None
        Units of work; None when unknown (only the count and rate are shown).
    desc : str
        Label printed before the bar.
    enabled : bool
        False turns every call into a no-op (e.g. on ranks other than 0).
    unit : str
        Name of one unit, shown with the rate.
    stream : file, optional
        Where to write; standard error by default.
    min_interval : float
        Seconds between two redraws.
    """

    def __init__(
        self,
        total: int | None,
        desc: str = "",
        *,
        enabled: bool = True,
        unit: str = "it",
        stream: TextIO | None = None,
        min_interval: float | None = None,
    ) -> None:
        self.total = total
        self.desc = desc
        self.enabled = enabled
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.min_interval = (
            min_interval if min_interval is not None else (0.1 if self.tty else 10.0)
        )
        self.n = 0
        self.postfix = ""
        self._start = time.perf_counter()
        self._last = -1e300
        self._drawn = -1  # self.n at the last draw

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        """Advance by ``n`` units; optionally replace the text shown after the bar."""
        self.n += n
        if postfix is not None:
            self.postfix = postfix
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last >= self.min_interval or (
            self.total is not None and self.n >= self.total
        ):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        self._drawn = self.n
        elapsed = now - self._start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        if self.total:
            frac = min(1.0, self.n / self.total)
            width = 24
            fill = int(frac * width)
            bar = "#" * fill + "-" * (width - fill)
            eta = (self.total - self.n) / rate if rate > 0 else float("nan")
            text = (
                f"{self.desc} [{bar}] {self.n}/{self.total} {100 * frac:5.1f}% "
                f"{elapsed:6.1f}s eta {eta:6.1f}s {rate:.3g} {self.unit}/s"
            )
        else:
            text = f"{self.desc} {self.n} {self.unit} {elapsed:6.1f}s {rate:.3g} {self.unit}/s"
        if self.postfix:
            text += f" {self.postfix}"
        if self.tty:
            self.stream.write("\r" + text + "\033[K")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Draw the final state and end the line."""
        if not self.enabled:
            return
        if self._drawn != self.n or self.tty:
            self._draw(time.perf_counter())
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()
        self.enabled = False
