"""Run outputs: `metrics.jsonl` (one JSON object per logged step, the source of truth) and
`results.json`, and optionally the same rows in experiment trackers through Accelerate's
tracking API (`trackers`: tensorboard, wandb, mlflow, ...).

Only the main process writes. Values are converted with `.item()` here, at log steps only,
so the training step itself never waits on the device. Both files are strict JSON: a value that
is not finite (the loss of a diverged or skipped step, a ratio of an empty lap) is written as
null (`jsonfile.dump_json`); the trackers and the console still see it as NaN.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ssl_vit.atomic import read_jsonl, write_text, writing
from ssl_vit.config.loader import flat_keys
from ssl_vit.jsonfile import dump_json

__all__ = [
    "MetricsWriter",
    "Stopwatch",
    "format_metrics",
    "ratio",
]

log = logging.getLogger(__name__)


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
    """`keys` of `row` as "key value | ...", leaving out what the row lacks or holds as None
    (a fine-tune without data.eval has no top1)."""
    shown = [(k, row[k]) for k in keys if row.get(k) is not None]
    return " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown)


def ratio(a: float, b: float) -> float:
    """a / b of a lap's sums, NaN when the lap held only skipped steps (b = 0)."""
    return a / b if b else math.nan


PROJECT = "ssl-vit"  # wandb project / mlflow experiment (WANDB_PROJECT etc. still win)


def _tracker_args(name: str, run_dir: Path, purge_step: int | None) -> tuple[list, dict]:
    """Positional and keyword arguments of Accelerate's tracker `name` for this run, offline
    unless the user configured a server: wandb -> WANDB_MODE=offline (files under run_dir),
    mlflow -> a file store in run_dir/mlruns unless MLFLOW_TRACKING_URI is set."""
    if name == "tensorboard":  # events directly in the run directory, as `metrics.jsonl`
        return [run_dir.name, str(run_dir.parent)], {"purge_step": purge_step}
    if name == "wandb":
        os.environ.setdefault("WANDB_MODE", "offline")
        return [PROJECT], {"name": run_dir.name, "dir": str(run_dir)}
    if name == "mlflow":
        if "MLFLOW_TRACKING_URI" not in os.environ:
            import mlflow

            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        return [PROJECT], {"run_name": run_dir.name}
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    cls = LOGGER_TYPE_TO_CLASS[name]
    return ([PROJECT, str(run_dir)] if cls.requires_logging_directory else [PROJECT]), {}


class MetricsWriter:
    """Appends JSON lines to `run_dir/metrics.jsonl` and sends every numeric value of a row to
    the trackers of `log_with` (Accelerate's tracking API) at the row's `step`; a no-op on
    non-main processes. `config` is stored in the trackers as the run's hyperparameters."""

    def __init__(
        self,
        run_dir: str | Path,
        enabled: bool = True,
        log_with: Sequence[str] = (),
        config: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.run_dir = Path(run_dir)
        self.log_with = list(log_with) if enabled else []
        self.config = config
        self.trackers: list | None = None  # opened at the first row, after `truncate_after`
        self._purge_step: int | None = None

    def log(self, row: dict[str, Any]) -> dict[str, Any]:
        row = to_python(row)
        if self.enabled:
            with writing(self.path), open(self.path, "a") as f:
                f.write(dump_json(row, str(self.path), nan_as_null=True) + "\n")
        if self.log_with:
            self._log_trackers(row)
        return row

    def _start_trackers(self) -> list:
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        trackers = []
        for name in self.log_with:  # as Accelerator.init_trackers builds them
            args, kwargs = _tracker_args(name, self.run_dir, self._purge_step)
            tracker = LOGGER_TYPE_TO_CLASS[name](*args, **kwargs)
            tracker.start()
            # The config as the run's parameters; not for TensorBoard, whose hparams go to two
            # timestamped folders per start: config.yaml is already next to its events.
            if self.config is not None and name != "tensorboard":  # lists and None as strings
                flat = flat_keys(self.config).items()
                scalar = (bool, int, float, str)
                hparams = {k: v if isinstance(v, scalar) else str(v) for k, v in flat}
                tracker.store_init_configuration(hparams)
            trackers.append(tracker)
        log.info("metrics also go to %s", ", ".join(self.log_with))
        return trackers

    def _log_trackers(self, row: dict[str, Any]) -> None:
        if self.trackers is None:
            self.trackers = self._start_trackers()
        step = int(row.get("step", 0))
        values = {
            k: v
            for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        for tracker in self.trackers:
            tracker.log(values, step=step)

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows logged after the checkpoint, so each step appears once (in
        TensorBoard, events after `step` are purged when the writer opens; wandb and mlflow
        keep what they were sent). A torn last line (a kill or a full disk mid-write) is dropped
        with a warning; the file is rewritten atomically."""
        self._purge_step = step + 1
        if not (self.enabled and self.path.is_file()):
            return
        rows = read_jsonl(self.path)
        kept = [r for r in rows if not isinstance(r, dict) or r.get("step", -1) <= step]
        lines = (dump_json(r, str(self.path), nan_as_null=True) + "\n" for r in kept)
        write_text(self.path, "".join(lines))

    def close(self) -> None:
        for tracker in self.trackers or []:
            tracker.finish()
        self.trackers = None

    def write_results(self, results: dict[str, Any]) -> None:
        if self.enabled:
            path = self.run_dir / "results.json"
            write_text(path, dump_json(to_python(results), str(path), 2, nan_as_null=True) + "\n")
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
