"""The parts of the training loop (`runner.TrainLoop`): the batch stream with its counters,
named step statistics, the bad-step guard, a lap's throughput figures.

Statistics stay on the device between log steps: no host sync inside a step for them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from ssl_vit.data import Batch
from ssl_vit.train.checkpoint import latest_valid_checkpoint
from ssl_vit.train.guard import JobError
from ssl_vit.train.metrics import Stopwatch
from ssl_vit.watchdog import track_loader, waiting_for

__all__ = ["BadSteps", "Batches", "StepStats", "TooManyBadStepsError", "lap_row", "new_counters"]

log = logging.getLogger(__name__)


def new_counters() -> dict[str, int]:
    """Run totals kept in every checkpoint (images over all ranks)."""
    # scaler_skips: steps the fp16 loss scaler skipped (overflow, scale lowered), not bad steps
    names = ("skipped_samples", "skipped_shards", "skipped_steps", "scaler_skips", "images")
    return dict.fromkeys(names, 0)


class Batches:
    """The training stream as a loop sees it: `next()` gives the next non-empty batch, adds
    its loader's skips and the global image count to `counters`, records its stream position
    (consumed batches only; prefetched ones do not count) and the time spent waiting for it.

    The loader workers start when the `with` block is entered (enter it after the stop handler
    is installed: a stop signal during their start-up is then a preemption, not the default
    action that would orphan them); `close()` (or leaving the block) shuts them down on every
    exit path."""

    def __init__(
        self,
        loader: DataLoader,
        counters: dict[str, int],
        world_size: int,
        watch: Stopwatch,
        keys_file: Path | None = None,
        what: str = "the training data",
        count: str = "images",
    ) -> None:
        self.what, self.loader = what, loader
        self.it: Iterator[Batch] | None = None
        self.tracker = loader.tracker  # the stream's lane positions -> the checkpoint
        self.counters, self.world_size, self.count = counters, world_size, count
        counters.setdefault(count, 0)
        self.watch, self.keys_file = watch, keys_file

    def __enter__(self) -> Batches:
        with waiting_for(self.what):  # worker start-up
            self.it = iter(self.loader)
        track_loader(self.it)  # a dead worker is named in the job's error line
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next(self) -> Batch:
        t0 = time.perf_counter()
        while True:
            with waiting_for(self.what):  # a stalled source ends the job (watchdog.py)
                batch = next(self.it)
            self.counters["skipped_samples"] += batch.skipped
            self.counters["skipped_shards"] += batch.skipped_shards
            self.tracker.update(batch)
            if self.keys_file is not None:
                with open(self.keys_file, "a") as f:
                    f.write("".join(k + "\n" for k in batch.keys))
            if len(batch.images):  # an empty batch only reports a worker's skipped samples
                break
        self.counters[self.count] += len(batch.images) * self.world_size
        self.watch.add("data", time.perf_counter() - t0)
        return batch

    def close(self) -> None:
        # The same call DataLoader's own finalizer makes; done here because an exception's
        # traceback keeps the iterator (and its workers) alive past the loop.
        shutdown = getattr(self.it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


class StepStats:
    """Sums of named per-step values, on the device until a log step.

    `add(name=value)` adds to the current step (device tensors or Python numbers; entries may be
    vectors, e.g. 4 counts); `end_step(applied)` keeps the step's values only if the optimizer
    applied it (a bool, or a bool tensor on the device: no sync), so skipped steps never enter
    the logged means; `reduce(acc)` sums the lap over ranks (one all-reduce, one host sync) and
    starts a new lap. Python numbers are added on the device as kernel arguments (no copy);
    sums are float32, exact for counts below 2**24 per lap."""

    def __init__(self, sizes: dict[str, int], device: torch.device) -> None:
        self.slices: dict[str, slice] = {}
        n = 0
        for name, size in sizes.items():
            self.slices[name] = slice(n, n + size)
            n += size
        self.step_dev, self.lap_dev = torch.zeros(n, device=device), torch.zeros(n, device=device)

    def add(self, **values: torch.Tensor | float) -> None:
        for name, value in values.items():
            where = self.slices[name]
            self.step_dev[where] += value.detach() if isinstance(value, torch.Tensor) else value

    def end_step(self, applied: bool | torch.Tensor) -> None:
        if isinstance(applied, torch.Tensor):  # where, not a product: a skipped loss is NaN
            self.lap_dev += torch.where(applied, self.step_dev, 0.0)
        elif applied:
            self.lap_dev += self.step_dev
        self.step_dev.zero_()

    def reduce(self, acc: Any) -> dict[str, Any]:
        """{name: float, or a list for vector entries}, summed over ranks; resets the lap."""
        totals = acc.reduce(self.lap_dev.clone(), reduction="sum").tolist()
        self.lap_dev.zero_()
        return {
            name: totals[s.start] if s.stop - s.start == 1 else totals[s]
            for name, s in self.slices.items()
        }


class TooManyBadStepsError(JobError):
    """`max_bad_steps` steps in a row had a non-finite gradient norm: the job stops (exit 1)."""


class BadSteps:
    """Steps with a non-finite gradient norm are not applied (`apply_step`); they are counted
    in `counters["skipped_steps"]`, and `max_bad_steps` of them in a row stop the job with an
    error naming the last good checkpoint (none is written during such a run).

    The counts stay on the device (`update` takes the step's applied flag as a tensor: no
    sync); the loop reads them (`check`) at log and checkpoint steps (`runner.Schedule`): a
    run of bad steps stops the job at the next of those at the latest, and `in_a_row` is
    current whenever a checkpoint is due."""

    def __init__(
        self, max_bad_steps: int, ckpt_dir: Path, counters: dict[str, int], device: torch.device
    ) -> None:
        self.max_bad_steps, self.ckpt_dir, self.counters = max_bad_steps, ckpt_dir, counters
        self.in_a_row = 0  # as of the last read
        # [skipped since the last read, bad steps in a row now, longest run since the last read,
        #  fp16 scaler skips since the last read]
        self.dev = torch.zeros(4, dtype=torch.long, device=device)

    def update(self, applied: bool | torch.Tensor, scaler_skipped: bool | torch.Tensor = False):
        """One optimizer step's flags: applied, or skipped by the fp16 loss scaler (an
        overflow it handles: counted apart, neither extends nor ends a run of bad steps)."""
        skipped, in_a_row, longest, scaler = self.dev.unbind(0)
        bad = ~torch.as_tensor(applied, device=self.dev.device)
        if isinstance(scaler_skipped, torch.Tensor):  # a device flag (fp16): no sync
            bad = bad & ~scaler_skipped
            scaler += scaler_skipped
            in_a_row.copy_(torch.where(scaler_skipped, in_a_row, (in_a_row + 1) * bad))
        else:
            in_a_row.mul_(bad).add_(bad)  # +1, or back to 0 on an applied step
        skipped += bad
        torch.maximum(longest, in_a_row, out=longest)

    def sync(self, step: int) -> int:
        """Read the device counts as of `step` (one host sync) into `counters` and `in_a_row`;
        returns the longest run of bad steps since the last read."""
        skipped, self.in_a_row, longest, by_scaler = self.dev.tolist()
        self.dev[0] = 0
        self.dev[2] = self.in_a_row
        self.dev[3] = 0
        self.counters["skipped_steps"] += skipped
        self.counters["scaler_skips"] = self.counters.get("scaler_skips", 0) + by_scaler
        if by_scaler:
            log.info(
                "%d step(s) skipped by the fp16 loss scaler (overflow; scale lowered)", by_scaler
            )
        if skipped:
            log.warning(
                "%d step(s) skipped since the last log: non-finite gradient norm (%d in a row "
                "at step %d)",
                *(skipped, self.in_a_row, step),
            )
        return longest

    def check(self, step: int) -> None:
        """`sync`, then stop the job (`TooManyBadStepsError`) if a run of bad steps reached
        `max_bad_steps`."""
        longest = self.sync(step)
        if longest >= self.max_bad_steps:
            raise TooManyBadStepsError(
                f"at least {self.max_bad_steps} steps in a row with a non-finite loss "
                f"or gradient ({longest} by step {step}); stopping. Last good checkpoint: "
                f"{latest_valid_checkpoint(self.ckpt_dir)}"
            )


def lap_row(watch: Stopwatch, steps: int, batch_size: int, counters: dict[str, int]) -> dict:
    """What both jobs log at a log step besides their own figures: throughput and the share of
    time spent waiting for data since the last log step, and the run's counters."""
    elapsed, waits = watch.lap()
    return {
        "img_per_s": steps * batch_size / elapsed,
        "data_wait": waits.get("data", 0.0) / elapsed,
        **{k: v for k, v in counters.items() if k != "images"},
        "images_seen": counters["images"],
    }
