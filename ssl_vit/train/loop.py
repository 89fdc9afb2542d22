"""What the pretraining and fine-tuning loops share, written once: the batch stream with its
counters, named step statistics, the bad-step guard, checkpoints and resume.

Each pipeline keeps its own step and evaluation and calls these; there is no trainer class.
Statistics stay on the device between log steps: no host sync inside a step for them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from ssl_vit.config.schema import OptimConfig
from ssl_vit.data import Batch
from ssl_vit.train.checkpoint import (
    latest_valid_checkpoint,
    load_checkpoint,
    save_checkpoint,
    set_rng_state,
)
from ssl_vit.train.guard import note_checkpoints
from ssl_vit.train.metrics import MetricsWriter, Stopwatch
from ssl_vit.train.runtime import Run
from ssl_vit.watchdog import track_loader, waiting_for

__all__ = [
    "BadSteps",
    "Batches",
    "Checkpointer",
    "StepStats",
    "end_preempted",
    "lap_row",
    "Resumed",
    "new_counters",
    "resume",
]

log = logging.getLogger(__name__)


def new_counters() -> dict[str, int]:
    """Run totals kept in every checkpoint (images over all ranks)."""
    return {"skipped_samples": 0, "skipped_shards": 0, "skipped_steps": 0, "images": 0}


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
        start: Resumed,
        world_size: int,
        watch: Stopwatch,
        keys_file: Path | None = None,
        what: str = "the training data",
    ) -> None:
        self.what, self.loader = what, loader
        self.it: Iterator[Batch] | None = None
        self.tracker = loader.tracker  # the stream's lane positions -> the checkpoint
        self.counters, self.world_size = start.counters, world_size
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
        self.counters["images"] += len(batch.images) * self.world_size
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


class BadSteps:
    """Steps with a non-finite gradient norm are not applied (`apply_step`); they are counted
    in `counters["skipped_steps"]`, and `max_bad_steps` of them in a row stop the job with an
    error naming the last good checkpoint (none is written during such a run).

    The counts stay on the device (`update` takes the step's applied flag as a tensor: no
    sync) and are read at log and checkpoint steps (`train.log_every`, `checkpoint_every`,
    the last step): a run of bad steps stops the job at the next of those at the latest, and
    `in_a_row` is current whenever a checkpoint is due."""

    def __init__(
        self, tc: OptimConfig, ckpt_dir: Path, counters: dict[str, int], device: torch.device
    ) -> None:
        self.tc, self.ckpt_dir, self.counters = tc, ckpt_dir, counters
        self.in_a_row = 0  # as of the last read
        # [skipped since the last read, bad steps in a row now, longest run since the last read]
        self.dev = torch.zeros(3, dtype=torch.long, device=device)

    def update(self, applied: bool | torch.Tensor, step: int) -> None:
        skipped, in_a_row, longest = self.dev.unbind(0)
        bad = ~torch.as_tensor(applied, device=self.dev.device)
        skipped += bad
        in_a_row.mul_(bad).add_(bad)  # +1, or back to 0 on an applied step
        torch.maximum(longest, in_a_row, out=longest)
        tc = self.tc
        every = tc.checkpoint_every
        if step % tc.log_every == 0 or step == tc.steps or (every and step % every == 0):
            self.check(step)

    def sync(self, step: int) -> int:
        """Read the device counts as of `step` (one host sync) into `counters` and `in_a_row`;
        returns the longest run of bad steps since the last read."""
        skipped, self.in_a_row, longest = self.dev.tolist()
        self.dev[0] = 0
        self.dev[2] = self.in_a_row
        self.counters["skipped_steps"] += skipped
        if skipped:
            log.warning(
                "%d step(s) skipped since the last log: non-finite gradient norm (%d in a row "
                "at step %d)",
                *(skipped, self.in_a_row, step),
            )
        return longest

    def check(self, step: int) -> None:
        """`sync`, then stop the job if a run of bad steps reached `max_bad_steps`."""
        longest = self.sync(step)
        if longest >= self.tc.max_bad_steps:
            raise SystemExit(
                f"error: at least {self.tc.max_bad_steps} steps in a row with a non-finite loss "
                f"or gradient ({longest} by step {step}); stopping. Last good checkpoint: "
                f"{latest_valid_checkpoint(self.ckpt_dir)}"
            )


class Checkpointer:
    """Writes the run's checkpoints: every rank calls `save(step)` at the same step.

    `state()` returns the pipeline's training state (main process), `rng()` this rank's random
    state (every rank); the encoder goes alongside as encoder.safetensors for downstream use."""

    def __init__(
        self,
        run: Run,
        tc: OptimConfig,
        encoder: torch.nn.Module,
        model_config: dict[str, Any],
        state: Callable[[], dict[str, Any]],
        rng: Callable[[], dict[str, Any]],
    ) -> None:
        self.run, self.tc, self.encoder, self.model_config = run, tc, encoder, model_config
        self.state, self.rng = state, rng
        note_checkpoints(run.ckpt_dir)

    def save_if_due(self, step: int, bad: BadSteps, watch: Stopwatch) -> None:
        """The periodic checkpoint (`train.checkpoint_every`; the last step's is always written
        after the loop), never during a run of skipped steps: the last good one stays."""
        every = self.tc.checkpoint_every
        if every and step % every == 0 and step != self.tc.steps and not bad.in_a_row:
            with watch.paused():
                self.save(step)

    def save(self, step: int, bad: BadSteps | None = None) -> Path:
        """Every rank, at the same step; `bad`: bring its skipped-step count up to date first
        (the loop's last step may not have been a log step: a preemption)."""
        if bad is not None:
            bad.sync(step)
        acc, t0 = self.run.acc, time.perf_counter()
        path = save_checkpoint(
            self.run.ckpt_dir,
            step,
            encoder=self.encoder,
            model_config=self.model_config,
            state=self.state(),
            rng=self.rng(),
            rank=acc.process_index,
            is_main=acc.is_main_process,
            barrier=acc.wait_for_everyone,
            keep=self.tc.keep_checkpoints,
        )
        log.info("checkpoint step %d written in %.1fs: %s", step, time.perf_counter() - t0, path)
        return path


@dataclass
class Resumed:
    """Where a job starts: step 0 with fresh counters, or a checkpoint's step, data stream
    position (`StreamTracker` state), counters and the rest of its training state."""

    step: int = 0
    stream: dict[str, Any] | None = None
    counters: dict[str, int] = field(default_factory=new_counters)
    state: dict[str, Any] = field(default_factory=dict)
    augment: dict[str, Any] | None = None  # the device augmentation's generator state


def resume(
    run: Run,
    enabled: bool,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator | None = None,
) -> Resumed:
    """With --resume, load the newest valid checkpoint into `model`, `optimizer` and the random
    states (global ones and `generator`), and say where the job continues."""
    note_checkpoints(run.ckpt_dir)
    path = latest_valid_checkpoint(run.ckpt_dir) if enabled else None
    if path is None:
        if enabled:
            log.info("--resume: no valid checkpoint in %s, starting from scratch", run.ckpt_dir)
        return Resumed()
    state = load_checkpoint(path, rank=run.acc.process_index)
    model.load_state_dict(state.pop("model"))
    optimizer.load_state_dict(state.pop("optimizer"))
    rng = state.pop("rng")
    set_rng_state(rng, generator)
    counters = {**new_counters(), **state.pop("counters", {})}  # (older checkpoints: none)
    log.info("resumed from %s at step %d", path, state["step"])
    return Resumed(state["step"], rng.get("stream"), counters, state, rng.get("augment"))


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


def end_preempted(metrics: MetricsWriter, acc: Any, step: int) -> dict[str, Any]:
    """A stop signal ended the loop and the checkpoint of `step` is written: say so (in
    results.json too, so nothing takes the run for finished) and return the job's result."""
    log.info("stopped by a signal after step %d; checkpoint written, resume with --resume", step)
    metrics.write_results({"step": step, "preempted": True})
    acc.end_training()
    return {"step": step, "preempted": True}
