"""Masked patch prediction pretraining (Dosovitskiy et al. 2021, appendix B.1.2).

    accelerate launch --multi_gpu pipelines/pretrain.py --config configs/pretrain/smoke.yaml
    python pipelines/pretrain.py --config ... [key.sub=value ...]   # one process (CPU, 1 GPU)
    ... --resume                                 # continue from the newest valid checkpoint
                                                 # (a finished run: left as it is, exit 0)

config -> checks -> Accelerator -> model -> optimizer -> resume (TrainLoop) -> data ->
loop -> final save and few-shot evaluation.
Exit status: 0 done or preempted (checkpoint written), 1 failed.
"""

from __future__ import annotations

import logging
import time
from argparse import Namespace

import torch

from ssl_vit.cli import training_args
from ssl_vit.config import PretrainConfig, load_config
from ssl_vit.data import pretrain_loader
from ssl_vit.data.device_augment import build_device_augment
from ssl_vit.eval.fewshot_job import fewshot_evaluate, log_fewshot
from ssl_vit.model import build_vit
from ssl_vit.objectives import NUM_COLOR_CLASSES, MaskedPatchPrediction
from ssl_vit.objectives.corruption import CorruptionDraws
from ssl_vit.train import preflight
from ssl_vit.train.guard import one_line_errors, run_and_exit
from ssl_vit.train.metrics import format_metrics, ratio
from ssl_vit.train.optim import build_adam
from ssl_vit.train.runner import TrainLoop, finished_run
from ssl_vit.train.runtime import start_run

log = logging.getLogger("pretrain")
SHOWN = ("step", "loss", "color_acc", "lr", "img_per_s", "data_wait")
RESULT_KEYS = (
    *("loss", "color_acc", "color_acc_majority", "frac_corrupted", "frac_mask", "frac_random"),
    *("frac_keep", "skipped_samples", "skipped_shards", "skipped_steps", "scaler_skips"),
)


def parse_args(argv: list[str] | None) -> Namespace:
    return training_args(__doc__, "configs/pretrain/", argv)


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
    with one_line_errors():
        cfg = load_config(PretrainConfig, args.config, args.overrides)
        if (done := finished_run(cfg, args.resume and not args.overwrite)) is not None:
            return done  # a finished run: nothing checked, started or written
        urls = check(cfg)
        run = start_run(cfg, args.resume, args.overwrite)  # Accelerator, locked run dir, seeds
    acc = run.acc
    loop, augment, hist = build_loop(cfg, run, args.resume)  # model, optimizer, resume
    # forward+loss, one graph (the corruption draws come in as a tensor)
    step, encoder = loop.train_step(loop.model), loop.raw.encoder
    # Micro-batch u's corruption: this rank's slice of the global batch's draws from (seed, u).
    draws = CorruptionDraws(
        cfg.seed, encoder.num_patches, acc.process_index, acc.num_processes, acc.device
    )

    # --- Data: every rank streams its own shards (never dispatched from rank 0) -----------
    # The plan's micro-batch and workers, this rank's place, where a resumed stream continues.
    loader = pretrain_loader(cfg.data, loop.stream_args(), urls=urls)

    # --- Loop: one micro-batch, a log row, the few-shot evaluation, the results -----------
    def micro(batch, index: int) -> dict:  # index: the micro-batch's place in the run
        images = batch.images.to(acc.device, non_blocking=True)
        if augment is not None:  # uint8 in and out: the colour targets stay exact
            images = augment(images, index)
        noise = draws(index, len(images))
        out = step(images, noise)  # autocast (mixed precision) comes from prepare()
        hist.add(out.color_targets)
        return step_figures(out)

    def row(sums: dict, lap: dict, done: int) -> dict:
        cuda = acc.device.type == "cuda"
        peak_mb = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        return {**log_row(sums, hist.total(), done), **lap, "peak_mem_mb": peak_mb}

    def fewshot_at(done: int) -> dict | None:
        return fewshot(cfg, encoder, acc, loop.metrics, done, loop.model)

    def finish(last_row: dict) -> dict:
        last_row = loop.log(last_row)
        results = final_results(cfg, run, last_row, time.time() - t_start)
        if cfg.fewshot.train:
            results["fewshot"] = fewshot_at(cfg.train.steps)
        log.info("done: %s", format_metrics(results, ("loss", "color_acc", "wall_time_s")))
        return results

    def periodic(done: int) -> None:  # logs its own rows: nothing joins the step's row
        fewshot_at(done)

    return loop.run(loader, micro, row, finish, SHOWN, after_step=hist.end_step, evaluate=periodic)


def build_loop(cfg: PretrainConfig, run, resume: bool):
    """The model, its optimizer and augmentation, the colour histogram, and the `TrainLoop`
    that resumes them -> (loop, device augmentation or None, histogram)."""
    acc = run.acc
    model = MaskedPatchPrediction(build_vit(cfg.model), cfg.objective, cfg.data.mean, cfg.data.std)
    model.to(acc.device)
    optimizer = build_adam(model, cfg.train)
    # data.augment=device: crop + flip on the device, from a generator of its own (None: workers)
    augment = build_device_augment(
        cfg.data, cfg.model.image_size, acc.device, cfg.seed, acc.process_index, acc.num_processes
    )
    hist = ColorHistogram(acc)
    every = cfg.fewshot.every if cfg.fewshot.train else 0  # the periodic few-shot evaluation
    parts = {"target_hist": hist}  # the training state beside model and optimizer
    loop = TrainLoop(run, cfg, model, optimizer, resume, augment, parts=parts, eval_every=every)
    return loop, augment, hist


def step_figures(out) -> dict:
    """What a micro-batch adds to the step's statistics (`TrainLoop.run`'s `micro`)."""
    # correct None: colour accuracy undefined for the target (0 of 0: NaN in the log)
    counted = out.correct is not None
    return {
        "loss": out.loss,
        "micro": 1,
        "correct": out.correct if counted else 0,
        "predicted": out.color_targets.numel() if counted else 0,
        "kinds": out.kind_counts(),
    }


def final_results(cfg: PretrainConfig, run, last_row: dict, wall_time_s: float) -> dict:
    steps = cfg.train.steps
    results = {k: last_row.get(k) for k in RESULT_KEYS}
    results.update(
        step=steps,
        checkpoint=str(run.ckpt_dir / f"step_{steps:08d}"),
        wall_time_s=wall_time_s,
        num_processes=run.plan.processes,
    )
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
        log_fewshot(metrics, step, res)
        log.info("few-shot at step %d: %s", step, res["summary"])
    acc.wait_for_everyone()
    model.train()
    return res


if __name__ == "__main__":
    run_and_exit(main)
