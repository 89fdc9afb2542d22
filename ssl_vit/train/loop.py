"""What a training loop is written with. The loop itself is in each pipeline, in plain sight
(`pipelines/pretrain.py`, `pipelines/finetune.py`, as nanoGPT's train.py and MAE's
engine_pretrain.py write theirs):

    start = read_resume_point(run, args.resume)     # step 0, or the newest valid checkpoint
    ...                                             # model, optimizer, augmentation, parts
    start.restore(run, model, optimizer, augment, parts)
    model, optimizer = acc.prepare(model, optimizer)
    ckpts = Checkpoints(run, cfg, model, optimizer, augment, parts, started=...)
    loader = ...(stream_args(run, cfg, start, augment))                  # where the stream was
    meter, batches = Meter(run, cfg, start, SHOWN), Batches(loader, start.counters, ...)
    with StopRequest(...) as stop, batches:
        for step in range(start.step + 1, steps + 1):
            set_lr(...)
            for index in plan.micro_steps(step): meter.add(**figures(train_step(...)))
            meter.end_step(step, train_step)
            if meter.logs(step): ... meter.log(row)   # then evaluation, stop, checkpoint
        meter.end_loop(step); ckpts.save(step, ...)    # then the final evaluation

No trainer class, no callbacks: these are the parts a loop calls. The checkpoint's resume-state
keys are defined here and nowhere else (with "counters" and "wall_time_s", the run's totals):
per rank (`rng_rank*.pt`) the RNG states, each stream's
position (`stream`, `stream_<name>`: `StreamTracker`) and "augment" (the resolved augmentation
mode and the device augmentation's generator); in the training state (main process) each of
the job's `parts` under its name (its `state_dict()`), and "scaler" (fp16's loss scale). Scaler
and mode differ between machines (the scaler exists only with fp16 on CUDA; `data.augment:
auto` resolves by device type), so a resume restores the scale and compares the mode: a run
that resumed onto another augmentation would silently become another run. Statistics stay on
the device between log steps: no host sync inside a step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from ssl_vit.config import to_dict
from ssl_vit.data import Batch
from ssl_vit.data.stages import end_workers
from ssl_vit.data.stream_state import StreamArgs
from ssl_vit.errors import ConfigError, JobError
from ssl_vit.jsonfile import read_json
from ssl_vit.progress import progress_bar
from ssl_vit.train import checkpoint as ckpt
from ssl_vit.train.guard import note_checkpoints
from ssl_vit.train.metrics import MetricsWriter, Stopwatch, format_metrics, ratio
from ssl_vit.train.rng import rng_state, set_rng_state
from ssl_vit.train.rundir import check_resumed_config
from ssl_vit.train.runtime import RunContext, replica_checksum, setup_logging
from ssl_vit.watchdog import waiting_for

__all__ = [
    "BadSteps",
    "Batches",
    "Checkpoints",
    "Meter",
    "Resumed",
    "StepStats",
    "TooManyBadStepsError",
    "announce",
    "due",
    "end_preempted",
    "finished_run",
    "keys_file",
    "new_counters",
    "read_resume_point",
    "stream_args",
]

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> None: ...


def due(step: int, every: int) -> bool:
    """Whether a period of `every` steps (0: never) ends at `step` (1-based, counted after it
    ran). The last step's log, checkpoint and evaluation are the loop's own, after it."""
    return every > 0 and step % every == 0


# Counted by each rank's loaders (`Batches`), summed over ranks by `Meter.totals`; the others
# are the same on every rank (bad steps: device counts after the all-reduce; images: the plan's).
_RANK_COUNTS = ("skipped_samples", "skipped_shards")


def new_counters() -> dict[str, int]:
    """Run totals kept in every checkpoint (images over all ranks)."""
    # scaler_skips: steps the fp16 loss scaler skipped (overflow, scale lowered), not bad steps
    names = ("skipped_samples", "skipped_shards", "skipped_steps", "scaler_skips", "images")
    return dict.fromkeys(names, 0)


# --- Start: a finished run, or where the run continues --------------------------------------


@dataclass
class Resumed:
    """Where a job starts: step 0 with fresh counters, or a checkpoint's step, counters, this
    rank's random state (with the streams and "augment") and the training state (model and
    optimizer until `restore` puts them in place)."""

    step: int = 0
    counters: dict[str, int] = field(default_factory=new_counters)
    rng: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    path: str | None = None  # the checkpoint's
    wall_time_s: float = 0.0  # the run's earlier processes' time, up to the checkpoint

    def started(self, t_start: float) -> float:
        """The `time.time()` the run started at, its earlier processes' time counted: this
        process's `t_start`, moved back by it (a resumed run's wall_time_s is the whole run's)."""
        return t_start - self.wall_time_s

    def restore(
        self,
        run: RunContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        augment: Stateful | None = None,
        parts: dict[str, Stateful] | None = None,
    ) -> None:
        """Put the checkpoint in place (before Accelerate's `prepare`): `model`, `optimizer`,
        the global random states, the device augmentation (`augment`, whose mode must be the
        checkpoint's), the fp16 loss scale and each of the job's `parts` by key. A new run:
        only the augmentation's generator starts."""
        if self.path is None:
            if augment is not None:
                augment.load_state_dict(None)
            return
        model.load_state_dict(self.state.pop("model"))
        optimizer.load_state_dict(self.state.pop("optimizer"))
        set_rng_state(self.rng)
        _check_augment_mode(self.rng.get("augment"), augment, self.path)
        # fp16: continue at the saved loss scale, not at 2^16; a checkpoint without one (a bf16
        # or fp32 run) leaves the scaler at its start.
        scaler = getattr(run.acc, "scaler", None)
        if scaler is not None and self.state.get("scaler"):
            scaler.load_state_dict(self.state["scaler"])
        if augment is not None:
            augment.load_state_dict(self.rng.get("augment"))
        for key, part in (parts or {}).items():
            if self.state.get(key) is None:
                raise ckpt.CheckpointError(
                    f"{self.path}: no {key!r} state to resume (the run was started without it)"
                )
            part.load_state_dict(self.state[key])


def _check_augment_mode(saved: dict[str, Any] | None, augment: Any, path: Any) -> None:
    """One error line when this run's augmentation (`augment`: the device augmentation or
    None) is not the checkpoint's: another augmentation is another run."""
    # The mode the checkpoint records (older ones: None under workers, the generator state
    # under device).
    was = "workers" if saved is None else saved.get("mode", "device")
    now = "workers" if augment is None else "device"
    if was != now:
        raise ConfigError(
            f"data.augment: the run in {path} was trained with {was!r} augmentation, this "
            f"job resolves it to {now!r} (data.augment=auto: device on CUDA, workers "
            f"elsewhere); set data.augment={was} to continue it"
        )


def read_resume_point(run: RunContext, enabled: bool) -> Resumed:
    """With --resume, the newest valid checkpoint, read (`Resumed.restore` puts it in place):
    where the job continues. Without one, or without --resume: step 0."""
    note_checkpoints(run.ckpt_dir)
    path = ckpt.latest_valid_checkpoint(run.ckpt_dir) if enabled else None
    if path is None:
        if enabled:
            log.info("--resume: no valid checkpoint in %s, starting from scratch", run.ckpt_dir)
        return Resumed()
    # latest_valid_checkpoint has just checked every file's SHA-256: not a second time.
    state = ckpt.load_checkpoint(path, rank=run.acc.process_index, verified=True)
    rng = state.pop("rng")
    counters = {**new_counters(), **state.pop("counters", {})}  # (older checkpoints: none)
    wall_time_s = state.pop("wall_time_s", 0.0)  # (older checkpoints: none)
    log.info("resumed from %s at step %d", path, state["step"])
    return Resumed(state["step"], counters, rng, state, str(path), wall_time_s)


def finished_run(cfg: Any, resume: bool) -> dict[str, Any] | None:
    """With --resume, the results of a run that already finished: its results.json records a
    final step of `train.steps` or more, not a preemption, and that step's checkpoint passes
    its manifest. Such a job has nothing to do: it writes nothing (no lock, no config.yaml, no
    checkpoint, no evaluation) and says so in one line. None otherwise (no results.json, an
    unreadable one, a preemption, a longer run; a damaged final checkpoint, which the resume
    then rebuilds from the newest valid one).

    Called before the Accelerator: each process reads the files itself (as each verifies the
    checkpoint it resumes from), so every rank of a launch returns alike, with no collective
    to wait on."""
    if not resume:
        return None
    run_dir = Path(cfg.output_dir)
    try:
        results = read_json(run_dir / "results.json")
    except (OSError, ValueError):
        return None
    step, steps = results.get("step"), cfg.train.steps
    if results.get("preempted") or not isinstance(step, int) or step < steps:
        return None
    try:
        ckpt.verify_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}")
    except (ckpt.CheckpointError, OSError):
        return None
    # Another kind of run, shape or stream is refused as for any --resume (one line).
    check_resumed_config(run_dir, cfg, finished=True)
    setup_logging()  # the launcher's rank: no process group
    line = "%s: finished at step %d/%d; nothing to resume (results.json kept)"
    log.info(line, cfg.output_dir, step, steps)
    return results


def stream_args(
    run: RunContext, cfg: Any, start: Resumed, augment: Any, name: str = ""
) -> StreamArgs:
    """A training stream's arguments the plan and the checkpoint decide: the plan's global
    micro-batch and workers, this rank's place, where a resumed stream continues (`name`: a
    second stream read beside the main one, checkpointed apart), the device augmentation's
    load size (the loader then only decodes and resizes)."""
    plan = run.plan
    return StreamArgs(
        global_micro=plan.global_micro,
        num_workers=plan.num_workers,
        image_size=cfg.model.image_size,
        seed=cfg.seed,
        rank=plan.rank,
        world_size=plan.world,
        resume=start.rng.get(_stream_key(name)),  # where the consumed batches ended
        load_size=augment.load_size if augment is not None else None,
    )


def keys_file(run: RunContext, cfg: Any) -> Path | None:
    """Where this rank writes the keys of the samples it trains on (`data.record_keys`)."""
    if not cfg.data.record_keys:
        return None
    return run.run_dir / f"keys_rank{run.acc.process_index}.txt"


def _stream_key(name: str) -> str:
    """The per-rank checkpoint key of a stream's position: "stream", "stream_<name>"."""
    return f"stream_{name}" if name else "stream"


# --- Data: the batch stream as a loop reads it ------------------------------------------------


class Batches:
    """The training stream as a loop sees it: `next()` gives the next non-empty batch, adds
    its loader's skips and `images` (the global images a batch stands for, from the plan) to
    `counters[count]`, records its stream position (consumed batches only; prefetched ones do
    not count) and the time spent waiting for it.

    The loader workers start when the `with` block is entered (enter it after the stop handler
    is installed: a stop signal during their start-up is then a preemption, not the default
    action that would orphan them); `close()` (or leaving the block) shuts them down on every
    exit path. `name`: the stream's name in the checkpoint ("": the main one)."""

    def __init__(
        self,
        loader: DataLoader,
        counters: dict[str, int],
        images: int,
        watch: Stopwatch,
        keys_file: Path | None = None,
        name: str = "",
    ) -> None:
        self.loader, self.name, self.images = loader, name, images
        self.what = f"the {name} data" if name else "the training data"
        self.count = f"images_{name}" if name else "images"
        self.it: Iterator[Batch] | None = None
        self.tracker = loader.tracker  # the stream's lane positions -> the checkpoint
        self.counters = counters
        counters.setdefault(self.count, 0)
        self.watch, self.keys_file = watch, keys_file

    def __enter__(self) -> Batches:
        with waiting_for(self.what):  # worker start-up
            self.it = iter(self.loader)
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
        self.counters[self.count] += self.images
        self.watch.add("data", time.perf_counter() - t0)
        return batch

    def close(self) -> None:
        # Here, not left to DataLoader's finalizer: an exception's traceback keeps the iterator
        # (and its workers) alive past the loop.
        end_workers(self.it)


# --- Each step: statistics, bad steps, the log ------------------------------------------------

# The step's gradient norm in `StepStats` beside the micro-batches' figures: its sum, whether
# the clip scaled it, and the steps counted (so a skipped step counts in neither mean).
_NORM_SLOTS = ("grad_norm", "clipped", "steps")


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
    sync); the loop reads them (`check`) at log and checkpoint steps (`Meter.end_step`): a
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
                f"{ckpt.latest_valid_checkpoint(self.ckpt_dir)}"
            )


class Meter:
    """A run's bookkeeping between steps: the step statistics (`StepStats`), the bad-step
    guard (`BadSteps`), the lap's stopwatch, metrics.jsonl (rows after the resumed step
    dropped) and the progress bar. `logs(step)` is the log period (and the last step)."""

    def __init__(self, run: RunContext, cfg: Any, start: Resumed, shown: tuple[str, ...]):
        tc, acc = cfg.train, run.acc
        self.acc, self.shown, self.counters = acc, shown, start.counters
        self.steps, self.log_every, self.ckpt_every = tc.steps, tc.log_every, tc.checkpoint_every
        self.grad_clip = tc.grad_clip
        self.global_batch = run.plan.global_batch
        self.metrics = MetricsWriter(
            run.run_dir, enabled=acc.is_main_process, log_with=cfg.trackers, config=to_dict(cfg)
        )
        self.metrics.truncate_after(start.step)
        self.bad = BadSteps(tc.max_bad_steps, run.ckpt_dir, self.counters, acc.device)
        self.summed = {k: self.counters[k] for k in _RANK_COUNTS}  # as of the last `totals`
        self.stats: StepStats | None = None  # sized by the first micro-batch's figures
        self.bar = progress_bar(tc.steps, start.step, acc.is_main_process)
        self.watch = Stopwatch()  # the first lap starts here, with the loader built
        self.last_log = start.step

    def logs(self, step: int) -> bool:
        return due(step, self.log_every) or step == self.steps

    def add(self, **values: torch.Tensor | float) -> None:
        """One micro-batch's figures (named slots, sized by the first micro-batch's; and the
        step's gradient norm, `end_step`'s)."""
        if self.stats is None:
            sizes = {k: v.numel() if torch.is_tensor(v) else 1 for k, v in values.items()}
            sizes.update(dict.fromkeys(_NORM_SLOTS, 1))
            self.stats = StepStats(sizes, self.acc.device)
        self.stats.add(**values)

    def end_step(self, step: int, train_step: Any) -> None:
        """After the optimizer step: keep its figures if it was applied, count a bad one (on
        the device); read the counts at log and checkpoint steps (a run of bad steps stops
        the job there)."""
        applied = train_step.applied
        if train_step.grad_norm is not None:  # the same on every rank (after the all-reduce)
            norm = train_step.grad_norm.float()
            clipped = norm > self.grad_clip if self.grad_clip > 0 else torch.zeros_like(norm)
            self.stats.add(grad_norm=norm, clipped=clipped.float(), steps=1)
        self.stats.end_step(applied)  # a skipped step counts in no logged mean
        self.bad.update(applied, train_step.scaler_skipped)  # fp16 overflows: not bad steps
        if self.logs(step) or due(step, self.ckpt_every):
            self.bad.check(step)
        self.bar.update(1)

    def totals(self) -> dict[str, int]:
        """The run's counters, with the samples and shards every rank's loaders skipped since
        the last call added (one all-reduce: each `Batches` counts its own rank's): what a
        log row and a checkpoint record. On every rank at the same step."""
        new = [self.counters[k] - self.summed[k] for k in _RANK_COUNTS]
        new = self.acc.reduce(torch.tensor(new, device=self.acc.device), reduction="sum")
        for k, n in zip(_RANK_COUNTS, new.tolist(), strict=True):
            self.counters[k] = self.summed[k] = self.summed[k] + int(n)
        return self.counters

    def lap(self, step: int, lr: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """At a log step: (the lap's sums over ranks, what every row has: lr, the gradients'
        mean global norm before clipping and the share of steps clipped, throughput and the
        share of time spent waiting for data since the last log step, the counters)."""
        elapsed, waits = self.watch.lap()
        steps, self.last_log = step - self.last_log, step
        sums = self.stats.reduce(self.acc)
        applied = sums.pop("steps")  # each rank's count: the ratios below are the same on all
        figures = {
            "lr": lr,
            "grad_norm": ratio(sums.pop("grad_norm"), applied),
            "clipped": ratio(sums.pop("clipped"), applied),
            "img_per_s": steps * self.global_batch / elapsed,
            "data_wait": waits.get("data", 0.0) / elapsed,
            **{k: v for k, v in self.totals().items() if k != "images"},
            "images_seen": self.counters["images"],
        }
        return sums, figures

    def log(self, row: dict[str, Any]) -> dict[str, Any]:
        """Write a metrics row (main process) and show it on the progress bar."""
        row = self.metrics.log(row)
        self.bar.write(format_metrics(row, self.shown))
        return row

    def paused(self):
        """Time spent inside (evaluation, checkpointing) is left out of the lap."""
        return self.watch.paused()

    def end_loop(self, step: int) -> None:
        self.bar.close()
        self.bad.sync(step)  # (the last step may not have been a log step: a preemption)

    def finish(self, results: dict[str, Any]) -> dict[str, Any]:
        """results.json (and the trackers closed); the Accelerator's end."""
        self.metrics.write_results(results)
        self.acc.end_training()
        return results


def end_preempted(meter: Meter, step: int) -> dict[str, Any]:
    """A stop signal ended the loop and the checkpoint of `step` is written: say so (in
    results.json too, so nothing takes the run for finished)."""
    log.info("stopped by a signal after step %d; checkpoint written, resume with --resume", step)
    return meter.finish({"step": step, "preempted": True})


def announce(run: RunContext, cfg: Any) -> None:
    """The run's first line: how the global batch splits (the plan's figures)."""
    plan = run.plan
    log.info(
        "training %s for %d steps, global batch %d (%d per process x %d processes x %d "
        "accumulation) on %s",
        *(cfg.output_dir, cfg.train.steps, plan.global_batch, plan.local_micro),
        *(plan.world, plan.grad_accum, plan.device),
    )


# --- Checkpoints --------------------------------------------------------------------------------


class Checkpoints:
    """`save(step, *streams)`: the checkpoint of `step`, on every rank at the same step (the
    training state's entries are gathered on every rank: replica checksums and the colour
    histogram are collectives). Built after Accelerate's `prepare` (`model`: the prepared
    model). parts: the job's stateful parts by key (as given to `resume`); record: further
    entries of every training state (e.g. label names)."""

    def __init__(
        self,
        run: RunContext,
        cfg: Any,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        augment: Stateful | None = None,
        parts: dict[str, Stateful] | None = None,
        record: dict[str, Any] | None = None,
        *,
        started: float,
    ) -> None:
        self.run, self.cfg, self.model, self.optimizer = run, cfg, model, optimizer
        self.started = started  # `Resumed.started`: the run's wall time so far is recorded
        self.raw = run.acc.unwrap_model(model)
        self.augment, self.parts, self.record = augment, parts or {}, record or {}

    def save(self, step: int, counters: dict[str, int], *streams: Batches) -> None:
        acc, cfg, t0 = self.run.acc, self.cfg, time.perf_counter()
        scaler = getattr(acc, "scaler", None)
        state = {
            "model": self.raw.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "counters": counters,
            "wall_time_s": time.time() - self.started,
            "config": to_dict(cfg),
            **self.record,
            **{k: p.state_dict() for k, p in self.parts.items()},
            "replica_checksums": replica_checksum(self.model, acc),  # raises if they diverged
            # fp16's loss scale (None without fp16)
            "scaler": None if scaler is None else scaler.state_dict(),
        }
        rng = {**rng_state(), **{_stream_key(b.name): b.tracker.state_dict() for b in streams}}
        rng["augment"] = {"mode": "workers"}  # the resolved mode (+ the device generator)
        if self.augment is not None:
            rng["augment"] = {"mode": "device", **self.augment.state_dict()}
        path = ckpt.save_checkpoint(
            self.run.ckpt_dir,
            step,
            encoder=self.raw.encoder,
            model_config=to_dict(cfg.model),
            # What fine-tuning and few-shot evaluation of this encoder normalise pixels with.
            pixels=ckpt.PixelStats(tuple(cfg.data.mean), tuple(cfg.data.std)),
            state=state,
            rng=rng,
            rank=acc.process_index,
            is_main=acc.is_main_process,
            barrier=acc.wait_for_everyone,
            keep=cfg.train.keep_checkpoints,
        )
        log.info("checkpoint step %d written in %.1fs: %s", step, time.perf_counter() - t0, path)
