"""The training loop, written once: resume, the step's schedule (learning rate, log, checkpoint,
bad-step reads), the stop handler, checkpoints and the final save; what a job does each
micro-batch, at each log step, at its periodic evaluation and at the end is passed in.

    done = finished_run(cfg, args.resume)  # first: a finished run's results (then stop), or None
    loop = TrainLoop(run, cfg, model, optimizer, resume=args.resume, ...)  # loads the checkpoint
    step = loop.train_step(forward)                                      # the one TrainStep
    loader = ...(loop.stream_args())                                     # where the stream was
    results = loop.run(loader, micro, log_row, finish=..., ...)

One small class, no hierarchy and no callback registry (as torchtitan's and big_vision's loops).
One schedule for every job: log, evaluate and checkpoint, each at its own period.
The checkpoint's resume-state keys are defined here and nowhere else: per rank (`rng_rank*.pt`)
the RNG states, "stream" (`StreamTracker`) and "augment" (the resolved augmentation mode and the
device augmentation's generator, `run_state`); in the training state (main process) each of the
job's `parts` under its name (its `state_dict()`), and "scaler" (fp16's loss scale, `run_state`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from ssl_vit.config import to_dict
from ssl_vit.data.stream_state import StreamArgs
from ssl_vit.jsonfile import read_json
from ssl_vit.progress import progress_bar
from ssl_vit.train import checkpoint as ckpt
from ssl_vit.train import run_state
from ssl_vit.train.guard import StopRequest, note_checkpoints
from ssl_vit.train.loop import BadSteps, Batches, StepStats, lap_row, new_counters
from ssl_vit.train.metrics import MetricsWriter, Stopwatch, format_metrics
from ssl_vit.train.rng import rng_state, set_rng_state
from ssl_vit.train.rundir import check_resumed_config
from ssl_vit.train.runtime import RunContext, replica_checksum, setup_logging
from ssl_vit.train.schedules import set_lr, warmup_cosine
from ssl_vit.train.step import TrainStep

__all__ = ["Resumed", "Schedule", "TrainLoop", "finished_run", "load_resume_point"]

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> None: ...


@dataclass(frozen=True)
class Schedule:
    """When a step (1-based, counted after it ran) logs, evaluates, checkpoints, or reads the
    bad-step counts (at log and checkpoint steps: a run of skipped steps stops the job by the
    next of them at the latest). Each period is independent of the others."""

    steps: int
    log_every: int
    checkpoint_every: int  # 0: only the final checkpoint
    eval_every: int = 0  # 0: only the final evaluation (the job's `finish`)

    def logs(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.steps

    def evaluates(self, step: int) -> bool:
        """The periodic evaluation (the last step's is the job's final one, after the loop)."""
        every = self.eval_every
        return bool(every) and step % every == 0 and step != self.steps

    def checkpoints(self, step: int) -> bool:
        """The periodic checkpoint (the last step's is always written, after the loop)."""
        every = self.checkpoint_every
        return bool(every) and step % every == 0 and step != self.steps

    def reads_counts(self, step: int) -> bool:
        return self.logs(step) or self.checkpoints(step)


@dataclass
class Resumed:
    """Where a job starts: step 0 with fresh counters, or a checkpoint's step, counters, this
    rank's random state (with "stream" and "augment") and the training state."""

    step: int = 0
    counters: dict[str, int] = field(default_factory=new_counters)
    rng: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    path: str | None = None  # the checkpoint's


def load_resume_point(
    run: RunContext, enabled: bool, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Resumed:
    """With --resume, load the newest valid checkpoint into `model`, `optimizer` and the global
    random states, and say where the job continues."""
    note_checkpoints(run.ckpt_dir)
    path = ckpt.latest_valid_checkpoint(run.ckpt_dir) if enabled else None
    if path is None:
        if enabled:
            log.info("--resume: no valid checkpoint in %s, starting from scratch", run.ckpt_dir)
        return Resumed()
    # latest_valid_checkpoint has just checked every file's SHA-256: not a second time.
    state = ckpt.load_checkpoint(path, rank=run.acc.process_index, verified=True)
    model.load_state_dict(state.pop("model"))
    optimizer.load_state_dict(state.pop("optimizer"))
    rng = state.pop("rng")
    set_rng_state(rng)
    counters = {**new_counters(), **state.pop("counters", {})}  # (older checkpoints: none)
    log.info("resumed from %s at step %d", path, state["step"])
    return Resumed(state["step"], counters, rng, state, str(path))


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
    setup_logging(os.environ.get("RANK", "0") == "0")  # the launcher's rank: no process group
    line = "%s: finished at step %d/%d; nothing to resume (results.json kept)"
    log.info(line, cfg.output_dir, step, steps)
    return results


class TrainLoop:
    """A training job's loop: built after the model and optimizer (it resumes them, then hands
    them to Accelerate: `model`, `optimizer`, `raw` the unwrapped model), run once.

    augment: the device augmentation (None: crop + flip in the loader workers).
    parts: the job's stateful parts by checkpoint key (e.g. {"ema": ...}): saved in the
        training state and restored on resume.
    record: further entries of every checkpoint's training state (e.g. label names).
    eval_every: the period of the job's evaluation (`run(evaluate=...)`; 0: only the final)."""

    def __init__(
        self,
        run: RunContext,
        cfg: Any,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        resume: bool,
        augment: Stateful | None = None,
        *,
        parts: dict[str, Stateful] | None = None,
        record: dict[str, Any] | None = None,
        eval_every: int = 0,
    ) -> None:
        self.ctx, self.cfg, self.acc = run, cfg, run.acc
        tc = cfg.train
        self.schedule = Schedule(tc.steps, tc.log_every, tc.checkpoint_every, eval_every)
        self.augment, self.record = augment, record or {}
        self.parts = dict(parts or {})
        self.start = load_resume_point(run, resume, model, optimizer)
        self.counters = self.start.counters
        self._load_parts()
        main = self.acc.is_main_process
        self.metrics = MetricsWriter(
            run.run_dir, enabled=main, log_with=cfg.trackers, config=to_dict(cfg)
        )
        self.metrics.truncate_after(self.start.step)
        self.model, self.optimizer = self.acc.prepare(model, optimizer)
        self.raw = self.acc.unwrap_model(self.model)
        self.step: TrainStep | None = None
        self.batches: Batches | None = None
        self.side: dict[str, Batches] = {}

    def stream_args(self, side: str = "") -> StreamArgs:
        """The training loader's arguments the plan and the loop decide (global micro-batch,
        workers, this rank's place, where a resumed stream continues, the device augmentation's
        load size). `side`: a second stream read beside the main one, checkpointed apart."""
        plan, augment = self.ctx.plan, self.augment
        return StreamArgs(
            micro_batch=plan.micro_batch,
            num_workers=plan.num_workers,
            image_size=self.cfg.model.image_size,
            seed=self.cfg.seed,
            rank=self.acc.process_index,
            world_size=plan.processes,
            resume=self.start.rng.get(_stream_key(side)),  # where the consumed batches ended
            load_size=augment.load_size if augment is not None else None,  # decode + resize only
        )

    def _load_parts(self) -> None:
        if self.start.path is not None:  # resumed: the same augmentation, the fp16 scale
            run_state.check_augment_mode(
                self.start.rng.get("augment"), self.augment, self.start.path
            )
            run_state.load_scaler_state(self.acc, self.start.state.get("scaler"))
        if self.augment is not None:
            self.augment.load_state_dict(self.start.rng.get("augment"))
        if not self.start.state:
            return
        for key, part in self.parts.items():
            if self.start.state.get(key) is None:
                raise ckpt.CheckpointError(
                    f"{self.start.path}: no {key!r} state to resume (the run was started "
                    "without it)"
                )
            part.load_state_dict(self.start.state[key])

    def train_step(self, forward: Callable[..., Any]) -> TrainStep:
        """The job's `TrainStep` around `forward` (forward+loss; `compile.enabled` applies)."""
        c = self.cfg.compile
        how = dict(acc=self.acc, compile=c.enabled, compile_mode=c.mode)
        self.step = TrainStep(self.model, self.optimizer, forward, self.cfg.train.grad_clip, **how)
        return self.step

    def log(self, row: dict[str, Any]) -> dict[str, Any]:
        """Write a metrics row (main process) and show it on the progress bar."""
        row = self.metrics.log(row)
        self.bar.write(format_metrics(row, self.shown))
        return row

    def run(
        self,
        loader: Any,
        micro: Callable[[Any, int], dict[str, torch.Tensor | float]],
        log_row: Callable[[dict[str, Any], dict[str, Any], int], dict[str, Any]],
        finish: Callable[[dict[str, Any]], dict[str, Any]],
        shown: tuple[str, ...],
        *,
        after_step: Callable[[torch.Tensor | bool], None] | None = None,
        evaluate: Callable[[int], dict[str, Any] | None] | None = None,
        side: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Train from the resumed step to `train.steps`; returns the job's results.

        micro(batch, index): one micro-batch through the `TrainStep` (index: its place in the
            run, step x grad_accum + micro-step, which seeds its draws); returns the named
            statistics to sum (`StepStats`: tensors on the device or numbers; a skipped step
            counts in none).
        log_row(sums, lap, step): the metrics row at a log step, from the lap's sums over ranks
            and `lap` (lr, throughput, data wait, the run's counters).
        after_step(applied): after each optimizer step (applied: the device flag).
        shown: the keys of a row the progress bar prints.
        evaluate(step): the periodic evaluation at `eval_every` (never the last step): its
            scores join that step's row, or make a row of their own between log steps.
        finish(row): after the final checkpoint, the final evaluation and save -> results;
            `row` is the last step's, unlogged: `finish` logs it (with its final scores).
        side: {name: loader} streams `micro` reads with `side[name].next()`, each checkpointed
            under its own key and counted in `images_<name>`.
        Preempted (a stop signal): the checkpoint of the step reached, `{"preempted": True}`."""
        self._start(loader, shown, side or {})
        done = last_log = self.start.step
        row, last = {}, self.schedule.steps
        with (  # the stop handler first: a signal while the loader workers start is a preemption
            StopRequest(self.acc.num_processes, self.cfg.timeouts.stop_s) as stop,
            contextlib.ExitStack() as streams,
        ):
            for batches in (self.batches, *self.side.values()):
                streams.enter_context(batches)
            for done in range(self.start.step + 1, last + 1):
                lr = self._one_step(done, micro, after_step)
                due = self._due_row(done, lr, done - last_log, log_row, evaluate)
                if self.schedule.logs(done):
                    row, last_log = due, done
                if due is not None and done != last:  # the last row: `finish` logs it
                    row = self.log(due)
                if stop.agreed():  # preemption: every rank stops after the same step
                    break
                if self.schedule.checkpoints(done) and not self.bad.in_a_row:
                    with self.watch.paused():  # never during a run of skipped steps: the
                        self.save(done)  # last good one stays the resume point
            self.bar.close()
            self.bad.sync(done)  # (the last step may not have been a log step: a preemption)
            self.save(done)
            if done < last:
                return self._end_preempted(done)
            stop.finish_loop()  # a signal from here on ends the job at once (checkpoint complete)
            results = finish(row)
        self.metrics.write_results(results)
        self.acc.end_training()
        return results

    def _due_row(
        self, done: int, lr: float, lap_steps: int, log_row: Callable, evaluate: Callable | None
    ) -> dict[str, Any] | None:
        """The row step `done` makes: a log step's (`log_row` of the lap's `lap_steps` steps),
        the periodic evaluation's scores joined to it or in a row of their own; None."""
        due = None
        if self.schedule.logs(done):
            lap = lap_row(self.watch, lap_steps, self.ctx.plan.global_batch, self.counters)
            due = log_row(self.stats.reduce(self.acc), {"lr": lr, **lap}, done)
        if evaluate is not None and self.schedule.evaluates(done):
            with self.watch.paused():
                scores = evaluate(done) or {}
            due = {**(due or {"step": done}), **scores} if scores else due
        return due

    def _start(self, loader: Any, shown: tuple[str, ...], side: dict[str, Any]) -> None:
        """The loop's own objects: the batch stream, statistics, bad-step guard, progress bar."""
        acc, tc, plan = self.acc, self.cfg.train, self.ctx.plan
        log.info(
            "training %s for %d steps, global batch %d (%d per process x %d processes x %d "
            "accumulation) on %s",
            *(self.cfg.output_dir, tc.steps, plan.global_batch, plan.process_micro),
            *(plan.processes, plan.grad_accum, plan.device),
        )
        keys_file = None
        if self.cfg.data.record_keys:
            keys_file = self.ctx.run_dir / f"keys_rank{acc.process_index}.txt"
        self.watch = Stopwatch()  # the first lap starts here, with the loader built
        self.batches = Batches(loader, self.counters, acc.num_processes, self.watch, keys_file)
        self.side = {
            name: Batches(
                side_loader,
                self.counters,
                acc.num_processes,
                self.watch,
                what=f"the {name} data",
                count=f"images_{name}",
            )  # fmt: skip
            for name, side_loader in side.items()
        }
        self.bad = BadSteps(tc.max_bad_steps, self.ctx.ckpt_dir, self.counters, acc.device)
        self.stats: StepStats | None = None  # sized by the first micro-batch's figures
        self.bar = progress_bar(self.schedule.steps, self.start.step, acc.is_main_process)
        self.shown = shown
        self.model.train()

    def _one_step(self, done: int, micro: Callable, after_step: Callable | None) -> float:
        """Optimizer step `done` (1-based): its learning rate, `grad_accum` micro-batches, the
        statistics and bad-step counts (on the device). Returns the learning rate."""
        tc, accum = self.cfg.train, self.ctx.plan.grad_accum
        lr = warmup_cosine(done - 1, tc.steps, tc.warmup_steps, tc.lr, tc.min_lr)
        set_lr(self.optimizer, lr)
        self.step.applied = True
        for m in range(accum):
            values = micro(self.batches.next(), (done - 1) * accum + m)
            if self.stats is None:  # named slots, sized by what the job reports
                sizes = {k: v.numel() if torch.is_tensor(v) else 1 for k, v in values.items()}
                self.stats = StepStats(sizes, self.acc.device)
            self.stats.add(**values)
        applied = self.step.applied
        self.stats.end_step(applied)  # a skipped step counts in no logged mean
        self.bad.update(applied, self.step.scaler_skipped)  # fp16 overflows: not bad steps
        if after_step is not None:
            after_step(applied)
        if self.schedule.reads_counts(done):
            self.bad.check(done)
        self.bar.update(1)
        return lr

    def save(self, step: int) -> None:
        """Checkpoint `step`: every rank, at the same step (the training state's entries are
        gathered on every rank: replica checksums and the colour histogram are collectives)."""
        acc, t0 = self.acc, time.perf_counter()
        state = {
            "model": self.raw.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "counters": self.counters,
            "config": to_dict(self.cfg),
            **self.record,
            **{k: p.state_dict() for k, p in self.parts.items() if p is not None},
            "replica_checksums": replica_checksum(self.model, acc),  # raises if they diverged
            "scaler": run_state.scaler_state(acc),  # fp16's loss scale (None without fp16)
        }
        rng = {
            **rng_state(),
            "stream": self.batches.tracker.state_dict(),
            **{_stream_key(k): b.tracker.state_dict() for k, b in self.side.items()},
            "augment": run_state.augment_state(self.augment),  # the resolved mode (+ its generator)
        }
        path = ckpt.save_checkpoint(
            self.ctx.ckpt_dir,
            step,
            encoder=self.raw.encoder,
            model_config=to_dict(self.cfg.model),
            # What fine-tuning and few-shot evaluation of this encoder normalise pixels with.
            pixels=ckpt.PixelStats(tuple(self.cfg.data.mean), tuple(self.cfg.data.std)),
            state=state,
            rng=rng,
            rank=acc.process_index,
            is_main=acc.is_main_process,
            barrier=acc.wait_for_everyone,
            keep=self.cfg.train.keep_checkpoints,
        )
        log.info("checkpoint step %d written in %.1fs: %s", step, time.perf_counter() - t0, path)

    def _end_preempted(self, step: int) -> dict[str, Any]:
        """A stop signal ended the loop and the checkpoint of `step` is written: say so (in
        results.json too, so nothing takes the run for finished)."""
        log.info(
            "stopped by a signal after step %d; checkpoint written, resume with --resume", step
        )
        self.metrics.write_results({"step": step, "preempted": True})
        self.acc.end_training()
        return {"step": step, "preempted": True}


def _stream_key(side: str) -> str:
    """The per-rank checkpoint key of a stream's position: "stream", "stream_<side>"."""
    return f"stream_{side}" if side else "stream"
