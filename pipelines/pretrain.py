"""Masked patch prediction pretraining (Dosovitskiy et al. 2021, appendix B.1.2).

    accelerate launch --multi_gpu pipelines/pretrain.py --config configs/pretrain/smoke.yaml
    python pipelines/pretrain.py --config ... [key.sub=value ...]   # one process (CPU, 1 GPU)
    ... --resume                                 # continue from the newest valid checkpoint
                                                 # (a finished run: left as it is, exit 0)

config -> checks -> Accelerator and plan -> model, optimizer -> resume -> data -> the loop
(written out below: micro-batches, the step, then what is due) -> final save and few-shot
evaluation.
Exit status: 0 done or preempted (checkpoint written), 1 failed.
"""

from __future__ import annotations

import logging
import time
from argparse import Namespace

import torch

from ssl_vit import jobs
from ssl_vit.cli import training_args
from ssl_vit.config import PretrainConfig, load_config
from ssl_vit.data import pretrain_loader
from ssl_vit.data.device_augment import build_device_augment
from ssl_vit.eval.fewshot_job import fewshot_evaluate, log_fewshot
from ssl_vit.model import build_vit
from ssl_vit.objectives import NUM_COLOR_CLASSES, MaskedPatchPrediction
from ssl_vit.objectives.corruption import CorruptionDraws
from ssl_vit.train import preflight
from ssl_vit.train.guard import StopRequest, one_line_errors, run_and_exit
from ssl_vit.train.loop import (
    Batches,
    Checkpoints,
    Meter,
    announce,
    due,
    end_preempted,
    finished_run,
    keys_file,
    read_resume_point,
    stream_args,
)
from ssl_vit.train.metrics import format_metrics, ratio
from ssl_vit.train.optim import build_adam
from ssl_vit.train.runtime import setup_logging, start_run
from ssl_vit.train.schedules import set_lr, warmup_cosine
from ssl_vit.train.step import TrainStep

log = logging.getLogger("pretrain")
SHOWN = ("step", "loss", "color_acc", "lr", "img_per_s", "data_wait")
RESULT_KEYS = (
    *("loss", "color_acc", "color_acc_majority", "frac_corrupted", "frac_mask", "frac_random"),
    *("frac_keep", "skipped_samples", "skipped_shards", "skipped_steps", "scaler_skips"),
)


def parse_args(argv: list[str] | None) -> Namespace:
    return training_args(jobs.PRETRAIN, __doc__, argv)


def check(cfg: PretrainConfig) -> list[str]:
    """Everything the job will touch, before any compute: shards, few-shot sources, output."""
    urls = preflight.check_shards("data.train_shards", cfg.data.train_shards)
    if cfg.fewshot.train:  # few-shot evaluation is on when fewshot.train is set
        train_names = preflight.check_labelled_source("fewshot.train", cfg.fewshot.train)
        eval_names = preflight.check_labelled_source("fewshot.eval", cfg.fewshot.eval)
        preflight.check_same_labels(("fewshot.train", train_names), ("fewshot.eval", eval_names))
    preflight.check_writable("output_dir", cfg.output_dir)
    return urls


def main(argv: list[str] | None = None) -> dict:
    t_start = time.time()
    args = parse_args(argv)
    setup_logging()  # the checks' warnings as every other line (the launcher's rank: INFO)
    with one_line_errors():
        cfg = load_config(PretrainConfig, args.config, args.overrides)
        if (done := finished_run(cfg, args.resume and not args.overwrite)) is not None:
            return done  # a finished run: nothing checked, started or written
        urls = check(cfg)
        run = start_run(cfg, args.resume, args.overwrite)  # Accelerator, plan, locked run dir
    acc, plan, tc = run.acc, run.plan, cfg.train

    # --- Model, optimizer, augmentation; resume them; then Accelerate's prepare -------------
    start = read_resume_point(run, args.resume)  # step 0, or the newest valid checkpoint
    model = MaskedPatchPrediction(build_vit(cfg.model), cfg.objective, cfg.data.mean, cfg.data.std)
    optimizer = build_adam(model.to(acc.device), tc)
    # data.augment=device: crop + flip on the device, from a generator of its own (None: workers)
    augment = build_device_augment(cfg.data, cfg.model.image_size, acc.device, cfg.seed, plan)
    hist = ColorHistogram(acc)  # the run's colour targets (color_acc_majority), checkpointed
    parts = {"target_hist": hist}
    start.restore(run, model, optimizer, augment, parts)
    model, optimizer = acc.prepare(model, optimizer)
    encoder = acc.unwrap_model(model).encoder
    # forward+loss in one graph (the corruption draws come in as a tensor); autocast from prepare
    c = cfg.compile
    train_step = TrainStep(
        model, optimizer, model, tc.grad_clip, acc, compile=c.enabled, compile_mode=c.mode
    )
    # Micro-batch u's corruption: this rank's slice of the global micro-batch's draws (seed, u).
    draws = CorruptionDraws(cfg.seed, encoder.num_patches, plan.rank, plan.global_micro, acc.device)
    started = start.started(t_start)  # a resumed run's: its first process's start
    ckpts = Checkpoints(run, cfg, model, optimizer, augment, parts, started=started)
    fewshot_every = cfg.fewshot.every if cfg.fewshot.train else 0

    # --- Data: every rank streams its own shards (never dispatched from rank 0) -------------
    loader = pretrain_loader(cfg.data, stream_args(run, cfg, start, augment), urls=urls)
    meter = Meter(run, cfg, start, SHOWN)  # step statistics, bad steps, metrics.jsonl, the bar
    batches = Batches(loader, start.counters, plan.global_micro, meter.watch, keys_file(run, cfg))

    # --- The loop ---------------------------------------------------------------------------
    announce(run, cfg)
    model.train()
    step, row = start.step, {}
    # The stop handler first: a signal while the loader workers start is a preemption.
    with StopRequest(plan.world, cfg.timeouts.stop_s) as stop, batches:
        for step in range(start.step + 1, tc.steps + 1):
            lr = warmup_cosine(step - 1, tc.steps, tc.warmup_steps, tc.lr, tc.min_lr)
            set_lr(optimizer, lr)
            for index in plan.micro_steps(step):  # numbered over the run: they seed the draws
                images = batches.next().images.to(acc.device, non_blocking=True)
                if augment is not None:  # uint8 in and out: the colour targets stay exact
                    images = augment(images, index)
                out = train_step(images, draws(index, len(images)))
                hist.add(out.color_targets)
                meter.add(**step_figures(out))
            meter.end_step(step, train_step)  # on the device; read at log and checkpoint steps
            hist.end_step(train_step.applied)
            if meter.logs(step):
                sums, lap = meter.lap(step, lr)
                row = {**log_row(sums, hist.total(), step), **lap, "peak_mem_mb": peak_mb(acc)}
                if step != tc.steps:  # the last row is logged with the final results
                    meter.log(row)
            if due(step, fewshot_every) and step != tc.steps:
                with meter.paused():  # logs its own row
                    fewshot(cfg, encoder, acc, meter.metrics, step, model)
            if stop.agreed():  # preemption: every rank stops after the same step
                break
            if due(step, tc.checkpoint_every) and step != tc.steps and not meter.bad.in_a_row:
                with meter.paused():  # never during a run of skipped steps: the last good
                    ckpts.save(step, meter.totals(), batches)  # one stays the resume point
        meter.end_loop(step)
        ckpts.save(step, meter.totals(), batches)
        if step < tc.steps:
            return end_preempted(meter, step)
        stop.finish_loop()  # a signal from here on ends the job at once (checkpoint complete)

        # --- Final: the last row, the few-shot evaluation, results.json ---------------------
        meter.log(row)
        results = final_results(cfg, run, row)
        if cfg.fewshot.train:
            results["fewshot"] = fewshot(cfg, encoder, acc, meter.metrics, tc.steps, model)
        results["wall_time_s"] = time.time() - started  # the final evaluation's included
        log.info("done: %s", format_metrics(results, ("loss", "color_acc", "wall_time_s")))
    return meter.finish(results)


def peak_mb(acc) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if acc.device.type == "cuda" else None


def step_figures(out) -> dict:
    """What a micro-batch adds to the step's statistics (`Meter.add`)."""
    # correct None: colour accuracy undefined for the target (0 of 0: NaN in the log)
    counted = out.correct is not None
    return {
        "loss": out.loss,
        "micro": 1,
        "correct": out.correct if counted else 0,
        "predicted": out.color_targets.numel() if counted else 0,
        "kinds": out.kind_counts(),
    }


def final_results(cfg: PretrainConfig, run, last_row: dict) -> dict:
    steps = cfg.train.steps
    results = {k: last_row.get(k) for k in RESULT_KEYS}
    checkpoint = str(run.ckpt_dir / f"step_{steps:08d}")
    results.update(step=steps, checkpoint=checkpoint, num_processes=run.plan.world)
    return results


class ColorHistogram:
    """The run's colour-target counts over applied steps (for `color_acc_majority`): on the
    device, no host sync; summed over ranks when read, and so in the checkpoint's
    "target_hist" (restored on the main process only: the others start from zero)."""

    def __init__(self, acc) -> None:
        self.acc = acc
        self.counts = torch.zeros(NUM_COLOR_CLASSES, dtype=torch.long, device=acc.device)
        self.step = torch.zeros_like(self.counts)  # this step's, until it is applied or not

    def add(self, targets: torch.Tensor) -> None:
        targets = targets.flatten()
        self.step.index_add_(0, targets, torch.ones_like(targets))  # no host sync

    def end_step(self, applied: torch.Tensor | bool) -> None:
        self.counts += self.step * applied  # applied: a bool on the device, no sync
        self.step.zero_()

    def total(self) -> torch.Tensor:
        """Summed over ranks (a collective: every rank calls it at the same step)."""
        return self.acc.reduce(self.counts.clone(), "sum")

    def state_dict(self) -> torch.Tensor:
        return self.total().cpu()

    def load_state_dict(self, saved: torch.Tensor) -> None:
        if self.acc.is_main_process:  # the saved histogram is already summed over ranks
            self.counts = saved.to(self.acc.device)


def log_row(sums: dict, hist: torch.Tensor, step: int) -> dict:
    """The objective's figures of one lap (`StepStats` sums over ranks) and the run's
    colour histogram so far."""
    untouched, masked, random, kept = sums["kinds"]
    corrupted = masked + random + kept
    return {
        "step": step,
        "loss": ratio(sums["loss"], sums["micro"]),
        "color_acc": ratio(sums["correct"], sums["predicted"]),
        # Accuracy of always predicting the most frequent colour class seen so far.
        "color_acc_majority": (hist.max() / hist.sum().clamp(min=1)).item(),
        "frac_corrupted": ratio(corrupted, corrupted + untouched),
        "frac_mask": ratio(masked, corrupted),
        "frac_random": ratio(random, corrupted),
        "frac_keep": ratio(kept, corrupted),
    }


def fewshot(cfg, encoder, acc, metrics, step, model) -> dict | None:
    """Few-shot linear evaluation of the frozen encoder, logged as a metrics row."""
    model.eval()
    res = None
    if acc.is_main_process:  # cheap (a few hundred train images + the test split): main only
        norm = dict(image_size=cfg.model.image_size, mean=cfg.data.mean, std=cfg.data.std)
        how = dict(device=acc.device, compile=cfg.compile, precision=acc.mixed_precision)
        res = fewshot_evaluate(encoder, cfg.fewshot, **norm, **how)
        log_fewshot(metrics, step, res)  # (fewshot_evaluate has logged its figures)
    acc.wait_for_everyone()
    model.train()
    return res


if __name__ == "__main__":
    run_and_exit(main)
