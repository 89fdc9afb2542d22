"""Run outputs: `metrics.jsonl` (one JSON object per logged step) and `results.json`, and
optionally TensorBoard event files in the run directory (the numeric values of each row).

Only the main process writes. Values are converted with `.item()` here, at log steps only,
so the training step itself never waits on the device.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = ["MetricsWriter", "Stopwatch", "format_metrics", "progress_bar", "to_python"]


def to_python(value: Any) -> Any:
    """Tensors and NumPy scalars -> plain Python numbers, recursively."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    if hasattr(value, "item"):
        return value.item()
    return value


def format_metrics(row: dict[str, Any], keys: tuple[str, ...]) -> str:
    parts = []
    for k in keys:
        if k in row:
            v = row[k]
            parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    return " | ".join(parts)


_NO_TENSORBOARD = (
    "tensorboard: true needs the tensorboard package: pip install 'ssl-vit[tensorboard]'"
)


def _summary_writer(run_dir: Path, purge_step: int | None):
    """A TensorBoard SummaryWriter for `run_dir` (imported here: tensorboard is an extra)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(_NO_TENSORBOARD) from None
    return SummaryWriter(log_dir=str(run_dir), purge_step=purge_step)


class MetricsWriter:
    """Appends JSON lines to `run_dir/metrics.jsonl` and, with `tensorboard`, writes every
    numeric value of a row as a TensorBoard scalar at the row's `step`; a no-op on non-main
    processes."""

    def __init__(
        self, run_dir: str | Path, enabled: bool = True, tensorboard: bool = False
    ) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.run_dir = Path(run_dir)
        self.tensorboard = tensorboard and enabled
        self._tb = None
        self._purge_step: int | None = None
        # Fail at start-up rather than at the first log step; the writer itself is opened at
        # the first row, after `truncate_after` has said which steps a resume replaces.
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ImportError(_NO_TENSORBOARD)

    def log(self, row: dict[str, Any]) -> dict[str, Any]:
        row = to_python(row)
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row, allow_nan=True) + "\n")
        if self.tensorboard:
            self._log_scalars(row)
        return row

    def _log_scalars(self, row: dict[str, Any]) -> None:
        if self._tb is None:
            self._tb = _summary_writer(self.run_dir, self._purge_step)
        step = int(row.get("step", 0))
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(key, value, global_step=step)
        self._tb.flush()  # log steps are rare: keep the event file current for a live view

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows logged after the checkpoint, so each step appears once (in
        TensorBoard, events after `step` are purged when the writer opens)."""
        self._purge_step = step + 1
        if not (self.enabled and self.path.is_file()):
            return
        rows = [line for line in self.path.read_text().splitlines() if line.strip()]
        kept = [r for r in rows if json.loads(r).get("step", -1) <= step]
        self.path.write_text("".join(r + "\n" for r in kept))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def write_results(self, results: dict[str, Any]) -> None:
        if self.enabled:
            results = to_python(results)
            clean = {
                k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in results.items()
            }
            (self.run_dir / "results.json").write_text(json.dumps(clean, indent=2) + "\n")
        self.close()  # results are written once, at the end of a job


class Stopwatch:
    """Accumulates named durations between log steps (e.g. time spent waiting on data)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.start = time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (evaluation, checkpointing) is left out of the next lap."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add("paused", time.perf_counter() - t0)

    def lap(self) -> tuple[float, dict[str, float]]:
        """(training seconds since the last lap, pauses excluded; accumulated totals);
        resets both."""
        now = time.perf_counter()
        totals = self.totals
        elapsed = now - self.start - totals.pop("paused", 0.0)
        self.start, self.totals = now, {}
        return elapsed, totals


class _LogOnly:
    """Stand-in for a progress bar off a terminal (or on other ranks): prints log lines."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def update(self, n: int = 1) -> None:
        pass

    def write(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        pass


def progress_bar(total: int, initial: int, enabled: bool):
    """A tqdm bar on a terminal, plain printed log lines otherwise (CI, log files)."""
    import sys

    from tqdm.auto import tqdm

    if enabled and sys.stderr.isatty():
        return tqdm(total=total, initial=initial, dynamic_ncols=True, unit="step")
    return _LogOnly(enabled)
