"""Fine-tune a pretrained encoder (or a random one) as a classifier (paper section 3.2, B.1.1).

    accelerate launch --multi_gpu pipelines/finetune.py --config configs/finetune/smoke.yaml
    python pipelines/finetune.py --config ... [key=value ...] [--resume]   # one process
    (--resume of a finished run leaves it as it is: one line, exit 0)

The pretraining head is dropped; a zero-initialized D x K linear layer is attached; the
position embeddings are 2D-interpolated when `model.image_size` differs from pretraining.
config -> checks -> Accelerator -> model -> optimizer -> resume (TrainLoop) -> data ->
loop -> final evaluation and save. Exit status: 0 done or preempted (checkpoint written), 1 failed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from argparse import Namespace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ssl_vit.atomic import write_text
from ssl_vit.cli import training_args
from ssl_vit.config import FinetuneConfig, load_config, to_dict
from ssl_vit.config.schema import FinetuneDataConfig
from ssl_vit.data import eval_loader, open_source, train_loader
from ssl_vit.data.device_augment import build_device_augment
from ssl_vit.data.labelled import check_recorded, choose_labelled, use_labelled
from ssl_vit.eval.confusion import add_confusion, confusion_summary
from ssl_vit.model import Classifier, PixelNorm, build_vit
from ssl_vit.train import preflight
from ssl_vit.train.classifier_file import CLASSIFIER_FILE, ClassifierSpec, save_classifier
from ssl_vit.train.distill import SelfTraining, check_teacher, record_teacher
from ssl_vit.train.ema import EMA
from ssl_vit.train.guard import one_line_errors, run_and_exit
from ssl_vit.train.metrics import format_metrics, ratio
from ssl_vit.train.probe_head import fit_probe_head
from ssl_vit.train.recipe import BatchMixer, build_finetune_optimizer, recipe_loss
from ssl_vit.train.rundir import release_new_run
from ssl_vit.train.runner import TrainLoop, finished_run
from ssl_vit.train.runtime import start_run
from ssl_vit.watchdog import watched

log = logging.getLogger("finetune")
SHOWN = ("step", "loss", "train_acc", "distill_loss", "top1", "top1_ema", "lr", "img_per_s")


def parse_args(argv: list[str] | None) -> Namespace:
    return training_args(__doc__, "configs/finetune/", argv)


class Checked(NamedTuple):
    """What `check` resolved before any compute."""

    cfg: FinetuneConfig  # frozen; from a checkpoint: its path, shape and pixel normalisation
    label_names: list[str]
    loaded: Any  # the loaded encoder (preflight.load_init_encoder), None for random init
    subset: Any  # the label budget's subset, None for every label
    note: str | None  # the line to log about the checkpoint
    teacher: Any  # the self-training teacher, None without distill.teacher


def check(cfg: FinetuneConfig, resume: bool) -> Checked:
    """Everything the job will touch, before any compute: sources with labels, the init
    checkpoint (loaded: the config's copy takes its shape and pixel normalisation, given ones
    must agree), the label budget's subset, the output directory."""
    label_names = preflight.check_labelled_source("data.train", cfg.data.train)
    # Drawn on every process (labels only; the same on all): a class too small fails here.
    subset = None
    if cfg.data.labels_per_class:
        subset = choose_labelled(cfg.data.train, cfg.data.labels_per_class, cfg.data.labels_seed)
    if resume:  # the run's own subset (or none), or one error line before anything is written
        check_recorded(subset, cfg.output_dir)
    if cfg.data.eval:
        eval_names = preflight.check_labelled_source("data.eval", cfg.data.eval)
        preflight.check_same_labels(("data.train", label_names), ("data.eval", eval_names))
    loaded = note = None
    if not cfg.init.scratch:  # a run directory -> its newest valid checkpoint
        cfg, loaded, note = preflight.init_from_checkpoint(
            "init.checkpoint", cfg, cfg.init.checkpoint
        )
    teacher = check_teacher(cfg, label_names, resume) if cfg.distill.enabled else None
    preflight.check_writable("output_dir", cfg.output_dir)
    return Checked(cfg, label_names, loaded, subset, note, teacher)


@torch.no_grad()
def evaluate(model, source: str, cfg: FinetuneConfig, run, num_classes: int) -> torch.Tensor:
    """The confusion matrix [K, K] (rows: true class) over the whole eval split, on the host:
    each rank counts a disjoint part on its device, the counts are summed."""
    model.eval()
    acc = run.acc
    conf = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=acc.device)
    loader = eval_loader(
        source,
        run.plan.eval_batch,
        cfg.model.image_size,
        num_workers=run.plan.num_workers,
        rank=acc.process_index,
        world_size=acc.num_processes,
        limit=cfg.data.max_eval,
        num_classes=num_classes,  # other labels: counted skips
    )
    for batch in watched(loader, "data.eval"):  # a stalled source ends the job
        with acc.autocast():
            pred = model(batch.images.to(acc.device)).argmax(dim=-1)
        add_confusion(conf, batch.labels.to(acc.device), pred)
    model.train()
    return acc.reduce(conf, reduction="sum").cpu()


def main(argv: list[str] | None = None) -> dict:
    t_start = time.time()
    args = parse_args(argv)
    with one_line_errors():
        cfg = load_config(FinetuneConfig, args.config, args.overrides)
        if (done := finished_run(cfg, args.resume and not args.overwrite)) is not None:
            return done  # a finished run: nothing checked, started or written
        # Before start_run: a bad init checkpoint or label budget makes no run directory.
        job = check(cfg, args.resume)
        cfg = job.cfg  # frozen and resolved: read from here on
        run = start_run(cfg, args.resume, args.overwrite)  # Accelerator, plan, run dir, seeds
        train_data = labelled_data(cfg, job.subset, run, args.resume)
        if job.teacher is not None and run.acc.is_main_process:
            record_teacher(run.run_dir, job.teacher)
    if job.note:
        log.info(job.note)
    acc, num_classes = run.acc, len(job.label_names)

    # --- Model, recipe, resume -------------------------------------------------------------
    model = build_classifier(cfg, job.loaded, num_classes, train_data, run)
    optimizer = build_finetune_optimizer(model, cfg.parts, cfg.train)
    ema = EMA(model, cfg.ema) if cfg.ema else None  # updated on the device, no sync
    augment = device_augment(cfg, acc)
    loop = TrainLoop(
        run, cfg, model, optimizer, args.resume, augment,
        parts={"ema": ema} if ema is not None else {},  # the training state beside the model's
        record={"label_names": job.label_names}, eval_every=cfg.eval_every,
    )  # fmt: skip
    # Self-training (distill.teacher): the frozen teacher and the unlabelled stream.
    selftrain = SelfTraining(cfg, loop, job.teacher, augment) if job.teacher is not None else None
    forward = classifier_forward(loop.model, cfg)
    if selftrain is not None:
        forward = selftrain.forward(loop.model, recipe_loss(cfg.parts))
    step = loop.train_step(forward)

    # --- Data ------------------------------------------------------------------------------
    loader = train_loader(
        train_data,
        loop.stream_args(),  # the plan's micro-batch, this rank's place, where a resume continues
        num_classes=num_classes,  # a label outside [0, K): a counted skip, not a crash
        randaugment=cfg.parts.randaugment,
        paired=run.plan.paired,
    )
    mixer = None  # mixup / cutmix pair images within a lane's share (any layout)
    if run.plan.paired:
        mixer = BatchMixer(cfg.parts, num_classes, cfg.seed, loader.lane_share)

    # --- Loop: one micro-batch, a log row, the periodic evaluation, the results ------------
    micro = micro_step(step, augment, mixer, selftrain, acc)
    evaluated = functools.partial(evaluate_all, loop.model, ema, cfg, run, job.label_names)
    finish = functools.partial(finish_run, job, loop, ema, evaluated, t_start)
    log.info(
        "fine-tuning %d classes at %d px, %s recipe, from %s",
        *(num_classes, cfg.model.image_size, cfg.recipe),
        "random init" if cfg.init.scratch else cfg.init.checkpoint,
    )
    after_step = (lambda applied: ema.update(loop.raw, applied)) if ema is not None else None
    side = {SelfTraining.SIDE: selftrain.loader} if selftrain is not None else None
    return loop.run(
        loader, micro, functools.partial(log_row, selftrain), finish, SHOWN,
        after_step=after_step, evaluate=lambda done: periodic(evaluated), side=side,
    )  # fmt: skip


def build_classifier(cfg: FinetuneConfig, loaded, num_classes: int, train_data, run):
    """The classifier on the device: the loaded encoder (random init is built here, after
    the seeds are set, so a from-scratch run is reproducible), its head zero or the probe's."""
    encoder = build_vit(cfg.model) if loaded is None else loaded.encoder
    encoder.set_drop_path(cfg.parts.drop_path)  # the recipe's stochastic depth (0: none)
    pixels = PixelNorm(cfg.data.mean, cfg.data.std)  # the model takes the loaders' uint8
    model = Classifier(encoder, num_classes, cfg.pool, pixels).to(run.acc.device)
    if cfg.init.head == "probe":  # LP-FT (a resumed run's head is then the checkpoint's)
        fit_probe_head(
            model, train_data.train, cfg.model.image_size, batch_size=cfg.train.batch_size,
            num_workers=run.plan.num_workers, device=run.acc.device,
        )  # fmt: skip
    return model


def micro_step(step, augment, mixer, selftrain, acc):
    """The loop's `micro`: one micro-batch (`index`: its place in the run) -> its sums."""

    def micro(batch, index: int) -> dict:
        x = batch.images.to(acc.device, non_blocking=True)
        if augment is not None:
            x = augment(x, index)
        y = batch.labels.to(acc.device, non_blocking=True)
        target = y
        if mixer is not None:  # mixed [0, 1] images, soft targets [B, K]
            x, target = mixer(x.float() / 255.0, y, index)
        if selftrain is None:
            out, more = step(x, target), {}
        else:  # the unlabelled micro-batch beside it, with the teacher's soft targets
            unlabelled, teacher_view = selftrain.images(index)
            out = step(x, target, unlabelled, teacher_view)
            more = {"distill": out.distill, "agree": out.agree, "unlabelled": len(unlabelled)}
        correct = (out.logits.argmax(-1) == y).sum()
        return {"loss": out.loss, "micro": 1, "correct": correct, "seen": len(y), **more}

    return micro


def log_row(selftrain, sums: dict, lap: dict, done: int) -> dict:
    """A lap's row: loss and training accuracy (with self-training, its term and agreement)."""
    out = {"step": done, "loss": ratio(sums["loss"], sums["micro"])}
    out.update(train_acc=ratio(sums["correct"], sums["seen"]), **lap)
    if selftrain is not None:  # the distillation term, and how often student = teacher
        out.update(distill_loss=ratio(sums["distill"], sums["micro"]))
        out.update(teacher_agree=ratio(sums["agree"], sums["unlabelled"]))
    return out


def periodic(evaluated) -> dict:
    """top1 (top1_ema) for the step's row; the final evaluation's matrix is in the results."""
    scores = evaluated()
    scores.pop("confusion", None)
    return scores


def finish_run(job: Checked, loop, ema, evaluated, t_start: float, last_row: dict) -> dict:
    """The final evaluation completes the last row; results.json; the saved classifier."""
    cfg, label_names = job.cfg, job.label_names
    scores = evaluated()
    confusion = scores.pop("confusion", None)
    last_row = loop.log({**last_row, "step": cfg.train.steps, **scores})
    results = final_results(cfg, last_row, loop.counters, job.subset, label_names)
    if confusion is not None:  # per-class accuracy and the matrix of the saved model
        summary = confusion_summary(confusion, label_names)
        results.update(per_class_top1=summary["per_class_top1"])
        results.update(confusion_matrix=summary["confusion_matrix"])
    if job.teacher is not None:
        results["distill"] = distill_results(cfg, job.teacher, loop.counters)
    results["wall_time_s"] = time.time() - t_start
    if loop.acc.is_main_process:  # the averaged weights when there are any (what top1_ema scored)
        save_final(ema.module if ema is not None else loop.raw, cfg, label_names)
    log.info("done: %s", format_metrics(results, ("top1", "top1_ema", "wall_time_s")))
    return results


def device_augment(cfg: FinetuneConfig, acc):
    """data.augment=device: crop + flip on the device, from a generator of its own (None:
    workers). RandAugment (parts.randaugment) works on PIL images after the crop: it keeps
    the workers'."""
    return build_device_augment(
        cfg.data,
        cfg.model.image_size,
        acc.device,
        cfg.seed,
        acc.process_index,
        acc.num_processes,
        workers_only=bool(cfg.parts.randaugment),
    )


class LossLogits(NamedTuple):
    loss: torch.Tensor  # the mean loss (what `TrainStep` backpropagates)
    logits: torch.Tensor  # [B, K]


def classifier_forward(model, cfg: FinetuneConfig):
    """forward+loss of the prepared classifier: the region compiled with `compile.enabled`."""
    loss_fn = recipe_loss(cfg.parts)

    def forward_loss(images: torch.Tensor, targets: torch.Tensor) -> LossLogits:
        """uint8 (or mixed [0, 1]) images, labels [B] (or soft targets [B, K] when mixing)."""
        logits = model(images)
        return LossLogits(loss_fn(logits.float(), targets), logits)

    return forward_loss


def final_results(cfg: FinetuneConfig, row: dict, counters: dict, subset, label_names):
    return {
        "step": cfg.train.steps,
        "top1": row.get("top1"),
        "top1_ema": row.get("top1_ema"),
        "train_loss": row.get("loss"),
        "skipped_steps": counters["skipped_steps"],
        "scaler_skips": counters["scaler_skips"],  # fp16 overflows the loss scaler handled
        "init": "random" if cfg.init.scratch else cfg.init.checkpoint,
        "image_size": cfg.model.image_size,
        "recipe": cfg.recipe,
        "seed": cfg.seed,
        "labels_per_class": cfg.data.labels_per_class,  # 0: every label of data.train
        "num_labelled": subset.num_labelled if subset else _source_size(cfg.data.train),
        "num_classes": len(label_names),
        "label_names": list(label_names),
    }


def distill_results(cfg: FinetuneConfig, teacher, counters: dict) -> dict:
    """What results.json says of self-training: the teacher (path, checksum, its top-1), the
    unlabelled source and how many of its images the run saw (all processes)."""
    d = cfg.distill
    return {
        **teacher.record(),
        "unlabelled": d.unlabelled,
        "unlabelled_images_seen": counters.get("images_unlabelled", 0),
        "temperature": d.temperature,
        "weight": d.weight,
        "ratio": d.ratio,
    }


def evaluate_all(model, ema, cfg: FinetuneConfig, run, label_names) -> dict[str, Any]:
    """top1 (and top1_ema with Polyak averaging) on data.eval, with `confusion` the summary of
    the model that is saved (the averaged one when there is one); {} without an eval split."""
    if not cfg.data.eval:
        return {}
    K = len(label_names)
    conf = evaluate(model, cfg.data.eval, cfg, run, K)
    row = {"top1": confusion_summary(conf, label_names)["top1"] or 0.0}
    if ema is not None:
        conf = evaluate(ema.module, cfg.data.eval, cfg, run, K)
        row["top1_ema"] = confusion_summary(conf, label_names)["top1"] or 0.0
    row["confusion"] = conf
    return row


def save_final(model, cfg: FinetuneConfig, label_names: list[str]) -> None:
    """model.safetensors (the classifier with its shape, pooling, labels and evaluation
    transform: what predict, distillation and export read) and labels.json, both atomic."""
    out = Path(cfg.output_dir)
    spec = ClassifierSpec(
        to_dict(cfg.model), cfg.pool, tuple(label_names), tuple(cfg.data.mean), tuple(cfg.data.std)
    )
    save_classifier(model, out / CLASSIFIER_FILE, spec)
    write_text(out / "labels.json", json.dumps(label_names, indent=1) + "\n")


def labelled_data(cfg: FinetuneConfig, subset, run, resume: bool) -> FinetuneDataConfig:
    """The data section the training stream reads: with a label budget, its images copied once
    into the run directory by the main process, which every process then reads (config.yaml
    keeps the source's name). A new run whose copy fails or is stopped (SIGTERM) keeps no run
    files, so the same command starts it again."""
    if subset is None:
        return cfg.data
    try:
        spec = use_labelled(subset, run.run_dir, write=run.acc.is_main_process)
    except BaseException:
        if run.acc.is_main_process and not resume:
            release_new_run(run.run_dir)
        raise
    run.acc.wait_for_everyone()
    return dataclasses.replace(cfg.data, train=spec)


def _source_size(spec: str) -> int | None:
    """The number of samples of `spec` (from its index for shards), None if unknown."""
    try:
        return len(open_source(spec))
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    run_and_exit(main)
