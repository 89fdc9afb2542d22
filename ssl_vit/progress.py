"""Progress of long jobs, with rate and ETA: a tqdm bar on a terminal; off a terminal (CI, log
files, the study's job logs) periodic log lines that carry the percent done and the ETA.

No torch here: every layer may use it (make-shards, feature extraction, the loops, the study).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["LOG_LINE", "LogProgress", "format_eta", "progress_bar", "progress_iter"]

log = logging.getLogger(__name__)
# A log record's line, the same for every command (the jobs': `runtime.setup_logging`).
LOG_LINE = {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s", "datefmt": "%H:%M:%S"}
T = TypeVar("T")


def format_eta(seconds: float) -> str:
    """Seconds -> '42s', '3m05s', '1h02m' ('?' when unknown)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class LogProgress:
    """Stand-in for a tqdm bar off a terminal (or on other ranks, `enabled=False`).

    `write(line)` prints the line followed by `| 45% | eta 1m20s` (the loops' metric lines);
    with `every_s`, `update` also logs a status line at most every `every_s` seconds and at the
    end of a job that took longer than that (jobs without metric lines). Rate and ETA count
    only the work done since creation.
    """

    def __init__(
        self,
        total: int,
        initial: int = 0,
        enabled: bool = True,
        desc: str = "",
        unit: str = "it",
        every_s: float | None = None,
    ) -> None:
        self.total, self.n, self.initial = total, initial, initial
        self.enabled, self.desc, self.unit, self.every_s = enabled, desc, unit, every_s
        self.start = self.last = time.monotonic()

    def _measure(self) -> tuple[float, float, str]:
        """(percent done, rate in units/s since creation, ETA as text)."""
        elapsed = time.monotonic() - self.start
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0
        left = self.total - self.n
        eta = format_eta(left / rate) if rate > 0 else ("0s" if left <= 0 else "?")
        return (100 * self.n / self.total if self.total else 100.0), rate, eta

    def status(self) -> str:
        """'45% (450/1000 img), 120 img/s, eta 5s'."""
        pct, rate, eta = self._measure()
        return (
            f"{pct:.0f}% ({self.n}/{self.total} {self.unit}), {rate:.3g} {self.unit}/s, eta {eta}"
        )

    def update(self, n: int = 1) -> None:
        self.n += n
        if not (self.enabled and self.every_s is not None):
            return
        now = time.monotonic()
        # And a last line at the end, unless the job was too short to need any.
        finished = self.n >= self.total and now - self.start >= self.every_s
        if now - self.last >= self.every_s or finished:
            self.last = now
            log.info("%s%s", f"{self.desc}: " if self.desc else "", self.status())

    def write(self, line: str) -> None:
        if self.enabled:
            pct, _, eta = self._measure()
            print(f"{line} | {pct:.0f}% | eta {eta}", flush=True)

    def close(self) -> None:
        pass


def progress_bar(
    total: int,
    initial: int = 0,
    enabled: bool = True,
    *,
    desc: str = "",
    unit: str = "step",
    every_s: float | None = None,
):
    """A tqdm bar (rate, ETA) on a terminal; a `LogProgress` otherwise. Both have `update(n)`,
    `write(line)` and `close()`."""
    if enabled and sys.stderr.isatty():
        from tqdm.auto import tqdm

        tqdm.monitor_interval = 0  # no monitor thread: the study forks its jobs (children.py)
        return tqdm(total=total, initial=initial, desc=desc or None, unit=unit, dynamic_ncols=True)
    return LogProgress(total, initial, enabled, desc, unit, every_s)


def progress_iter(
    items: Iterable[T],
    total: int,
    *,
    desc: str,
    unit: str = "it",
    enabled: bool = True,
    every_s: float = 30.0,
    count: Any = None,
) -> Iterator[T]:
    """Yield `items`, advancing a `progress_bar` by `count(item)` (default 1) per item."""
    bar = progress_bar(total, 0, enabled, desc=desc, unit=unit, every_s=every_s)
    try:
        for item in items:
            yield item
            bar.update(count(item) if count else 1)
    finally:
        bar.close()
