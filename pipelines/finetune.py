"""Fine-tune a pretrained encoder (or a random one) as a classifier (paper section 3.2, B.1.1).

    accelerate launch --multi_gpu pipelines/finetune.py --config configs/finetune/smoke.yaml
    python pipelines/finetune.py --config ... [key=value ...] [--resume]   # one process
    (--resume of a finished run leaves it as it is: one line, exit 0)

The pretraining head is dropped; a zero-initialized D x K linear layer is attached; the
position embeddings are 2D-interpolated when `model.image_size` differs from pretraining.
config -> checks -> Accelerator and plan -> model, optimizer -> resume -> data -> the loop
(written out below: micro-batches, the step, then what is due) -> final evaluation and save.
Exit status: 0 done or preempted (checkpoint written), 1 failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from argparse import Namespace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ssl_vit import jobs
from ssl_vit.atomic import write_text
from ssl_vit.cli import training_args
from ssl_vit.config import FinetuneConfig, load_config, to_dict
from ssl_vit.config.schema import FinetuneDataConfig
from ssl_vit.data import eval_loader, open_source, train_loader
from ssl_vit.data.device_augment import build_device_augment
from ssl_vit.data.labelled import (
    check_recorded,
    choose_labelled,
    choose_random,
    choose_typiclust,
    use_labelled,
)
from ssl_vit.errors import ConfigError
from ssl_vit.eval.confusion import add_confusion, confusion_summary
from ssl_vit.model import Classifier, PixelNorm, build_vit
from ssl_vit.train import preflight
from ssl_vit.train.classifier_file import CLASSIFIER_FILE, ClassifierSpec, save_classifier
from ssl_vit.train.distill import SelfTraining, check_teacher, record_teacher
from ssl_vit.train.ema import EMA
from ssl_vit.train.guard import StopRequest, one_line_errors, run_and_exit
from ssl_vit.train.label_picks import pick_typiclust
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
from ssl_vit.train.probe_head import fit_probe_head
from ssl_vit.train.recipe import BatchMixer, build_finetune_optimizer, recipe_loss
from ssl_vit.train.rundir import release_new_run
from ssl_vit.train.runtime import setup_logging, start_run
from ssl_vit.train.schedules import set_lr, warmup_cosine
from ssl_vit.train.step import TrainStep
from ssl_vit.watchdog import watched

log = logging.getLogger("finetune")
SHOWN = (
    "step",
    "loss",
    "train_acc",
    "distill_loss",
    "pseudo_used",
    "top1",
    "top1_ema",
    "lr",
    "img_per_s",
)


def parse_args(argv: list[str] | None) -> Namespace:
    return training_args(jobs.FINETUNE, __doc__, argv)


class Checked(NamedTuple):
    """What `check` resolved before any compute."""

    cfg: FinetuneConfig  # frozen; from a checkpoint: its path, shape and pixel normalisation
    label_names: list[str]
    loaded: Any  # the loaded encoder (preflight.load_init_encoder), None for random init
    subset: Any  # the label budget's subset, None for every label
    note: str | None  # the line to log about the checkpoint
    teacher: Any  # the offline teacher (distill.teacher), None without one
    eval_map: tuple[int, ...] | None  # data.eval's label -> the classifier's, where they differ
    eval_left_out: list[str]  # data.eval's classes data.train has no images of


def check(cfg: FinetuneConfig, resume: bool) -> Checked:
    """Everything the job will touch, before any compute: sources with labels, the init
    checkpoint (loaded: the config's copy takes its shape and pixel normalisation, given ones
    must agree), the label budget's subset, the output directory."""
    label_names = preflight.check_labelled_source("data.train", cfg.data.train)
    # Drawn on every process (labels only; the same on all): a class too small fails here.
    # random: keys only, the same on all. typiclust: a budget larger than the source fails
    # here; its picks need the encoder's features (`labelled_data`), or are the run's own.
    d, subset = cfg.data, None
    if d.labels_select == "balanced" and d.labels_per_class:
        subset = choose_labelled(d.train, d.labels_per_class, d.labels_seed)
    elif d.labels_select == "random":
        subset = choose_random(d.train, d.labels_budget, d.labels_seed)
    elif d.labels_select == "typiclust":
        where = cfg.output_dir if resume else None
        subset = choose_typiclust(d.train, d.labels_budget, d.labels_seed, where)
    if resume:  # the run's own subset (or none), or one error line before anything is written
        check_recorded(subset, cfg.output_dir)
    eval_map, missing = None, []
    if cfg.data.eval:
        eval_names = preflight.check_labelled_source("data.eval", cfg.data.eval)
        eval_map = preflight.eval_label_map(label_names, eval_names)  # by name, if they differ
        missing = [n for n, i in zip(eval_names, eval_map or (), strict=False) if i < 0]
        label_names = label_names or eval_names  # remote shards, read without their index.json
    if not label_names:  # the head's size: nothing else says how many classes there are
        raise ConfigError(
            f"data.train={cfg.data.train!r}: its class names are unknown (remote shards are "
            "read without their index.json) and data.eval names none: point data.eval at a "
            "labelled source with them (local shards, an image folder)"
        )
    if len(label_names) < 2:  # a folder with one class folder: nothing to tell apart
        raise ConfigError(
            f"data.train={cfg.data.train!r}: one class ({label_names[0]!r}); a classifier "
            "needs at least 2 (an image folder: one sub-folder per class)"
        )
    loaded = note = None
    if not cfg.init.scratch:  # a run directory -> its newest valid checkpoint
        path, recorded = cfg.init.checkpoint, None
        if resume and (own := preflight.resumed_encoder(cfg.output_dir, path)):
            (path, recorded), what = own, "the encoder's shape and normalisation are read from"
            log.warning("init.checkpoint=%r is gone: %s the run's own %s", recorded, what, path)
        cfg, loaded, note = preflight.init_from_checkpoint("init.checkpoint", cfg, path, recorded)
    teacher = check_teacher(cfg, label_names, resume) if cfg.distill.enabled else None
    preflight.check_writable("output_dir", cfg.output_dir)
    if cfg.data.eval:  # top-1 is read as a held-out figure: say when it is not one
        test = ("data.eval", cfg.data.eval)
        preflight.warn_shared(("data.train", d.train), test, "top-1 counts images it trains on")
        if cfg.distill.enabled:
            unlabelled = ("distill.unlabelled", cfg.distill.unlabelled)
            why = "its test images are trained on (without their labels), so top-1 is not held-out"
            preflight.warn_shared(unlabelled, test, why)
    if missing:  # the classifier cannot name these
        log.warning(
            "data.train has no images of %d class(es) of data.eval (%s): their test images are "
            "left out of top-1 and the confusion matrix; label some to learn them",
            len(missing), ", ".join(missing),
        )  # fmt: skip
    return Checked(cfg, label_names, loaded, subset, note, teacher, eval_map, missing)


@torch.no_grad()
def evaluate(model, source: str, cfg: FinetuneConfig, run, num_classes: int, eval_map=None):
    """(the confusion matrix [K, K] (rows: true class) over the whole eval split, on the host;
    the images skipped): each rank counts a disjoint part on its device, the counts are summed.
    `eval_map`: the source's labels -> the classifier's (-1: not counted), where their class
    names differ."""
    model.eval()
    acc = run.acc
    conf = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=acc.device)
    lut = None if eval_map is None else torch.tensor([*eval_map, -1], device=acc.device)
    plan = run.plan
    loader = eval_loader(
        source,
        plan.local_eval,  # the per-process micro-batch: what the user sized to fit memory
        cfg.model.image_size,
        num_workers=plan.num_workers,
        rank=plan.rank,
        world_size=plan.world,
        limit=cfg.data.max_eval,
        num_classes=num_classes if lut is None else len(eval_map),  # others: counted skips
    )
    skipped = torch.zeros((), dtype=torch.int64, device=acc.device)
    for batch in watched(loader, "data.eval"):  # a stalled source ends the job
        with acc.autocast():
            pred = model(batch.images.to(acc.device)).argmax(dim=-1)
        labels = batch.labels.to(acc.device)
        add_confusion(conf, labels if lut is None else lut[labels], pred)  # (lut[-1] is -1)
        skipped += batch.skipped  # unreadable, or labelled outside the classes
    model.train()
    return acc.reduce(conf, reduction="sum").cpu(), int(acc.reduce(skipped, reduction="sum"))


def main(argv: list[str] | None = None) -> dict:
    t_start = time.time()
    args = parse_args(argv)
    setup_logging()  # the checks' warnings as every other line (the launcher's rank: INFO)
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
    acc, plan, tc = run.acc, run.plan, cfg.train
    label_names, num_classes = job.label_names, len(job.label_names)

    # --- Model, recipe, augmentation; resume them; then Accelerate's prepare ----------------
    start = read_resume_point(run, args.resume)  # step 0, or the newest valid checkpoint
    model = build_classifier(cfg, job.loaded, num_classes, train_data, run, start)
    optimizer = build_finetune_optimizer(model, cfg.parts, tc)
    ema = EMA(model, cfg.ema) if cfg.ema else None  # updated on the device, no sync
    # crop + flip on the device where the plan puts them (None: the workers')
    augment = build_device_augment(cfg.data, cfg.model.image_size, acc.device, cfg.seed, plan)
    parts = {"ema": ema} if ema is not None else {}  # the training state beside the model's
    # Training on the unlabelled images too (distill.unlabelled): the teacher (offline: the
    # frozen classifier; online: the student's EMA, in `parts`) and the unlabelled stream.
    selftrain = None
    if cfg.distill.enabled:
        selftrain = SelfTraining(cfg, run, job.teacher, augment, start, model)
        parts.update(selftrain.parts)
    start.restore(run, model, optimizer, augment, parts)
    model, optimizer = acc.prepare(model, optimizer)
    raw = acc.unwrap_model(model)
    forward = classifier_forward(model, cfg)
    if selftrain is not None:
        selftrain.start(raw, start.step)
        forward = selftrain.forward(model, recipe_loss(cfg.parts))
    c = cfg.compile
    train_step = TrainStep(
        model, optimizer, forward, tc.grad_clip, acc, compile=c.enabled, compile_mode=c.mode
    )
    started = start.started(t_start)  # a resumed run's: its first process's start
    record = {"label_names": label_names}
    ckpts = Checkpoints(run, cfg, model, optimizer, augment, parts, record, started=started)

    # --- Data: the labelled stream (and the unlabelled one beside it) ------------------------
    loader = train_loader(
        train_data,
        stream_args(run, cfg, start, augment),  # where a resumed stream continues
        num_classes=num_classes,  # a label outside [0, K): a counted skip, not a crash
        randaugment=cfg.parts.randaugment,
        paired=plan.paired,
    )
    mixer = None  # mixup / cutmix pair images within a lane's share (any layout)
    if plan.paired:
        mixer = BatchMixer(cfg.parts, num_classes, cfg.seed, loader.lane_share)
    meter = Meter(run, cfg, start, SHOWN)  # step statistics, bad steps, metrics.jsonl, the bar
    labelled = Batches(loader, start.counters, plan.global_micro, meter.watch, keys_file(run, cfg))
    unlabelled = None  # self-training's: named in the checkpoint, counted in images_unlabelled
    if selftrain is not None:
        u = selftrain.loader, start.counters, plan.global_unlabelled_micro, meter.watch
        unlabelled = Batches(*u, name=selftrain.NAME)
    streams = [b for b in (labelled, unlabelled) if b is not None]  # what a checkpoint records

    # --- The loop ---------------------------------------------------------------------------
    announce(run, cfg)
    log.info(
        "fine-tuning %d classes at %d px, %s recipe, from %s",
        *(num_classes, cfg.model.image_size, cfg.recipe),
        "random init" if cfg.init.scratch else cfg.init.checkpoint,
    )
    model.train()
    step, row = start.step, {}
    # The stop handler first: a signal while the loader workers start is a preemption.
    with (
        StopRequest(plan.world, cfg.timeouts.stop_s) as stop,
        labelled,
        unlabelled if unlabelled is not None else contextlib.nullcontext(),
    ):
        for step in range(start.step + 1, tc.steps + 1):
            lr = warmup_cosine(step - 1, tc.steps, tc.warmup_steps, tc.lr, tc.min_lr)
            set_lr(optimizer, lr)
            for index in plan.micro_steps(step):  # numbered over the run: they seed the draws
                batch = labelled.next()
                x = batch.images.to(acc.device, non_blocking=True)
                if augment is not None:
                    x = augment(x, index)
                y = target = batch.labels.to(acc.device, non_blocking=True)
                if mixer is not None:  # mixed [0, 1] images, soft targets [B, K]
                    x, target = mixer(x.float() / 255.0, y, index)
                if selftrain is None:
                    out, more = train_step(x, target), {}
                else:  # the unlabelled micro-batch beside it: the student's and teacher's views
                    u = unlabelled.next()
                    out = train_step(x, target, *selftrain.views(u.images, index))
                    more = selftrain.counts(out, u.labels, y)  # u.labels: only scored, if any
                correct = (out.logits.argmax(-1) == y).sum()
                meter.add(loss=out.loss, micro=1, correct=correct, seen=len(y), **more)
            meter.end_step(step, train_step)  # on the device; read at log and checkpoint steps
            if ema is not None:
                ema.update(raw, train_step.applied)
            if selftrain is not None:  # online: the teacher follows the student
                selftrain.follow(raw, train_step.applied)
            due_row = None
            if meter.logs(step):
                row = due_row = log_row(selftrain, *meter.lap(step, lr), step)
            if due(step, cfg.eval_every) and step != tc.steps:  # joins the step's row
                with meter.paused():
                    scores = evaluate_all(model, ema, cfg, run, label_names, job.eval_map)
                scores.pop("confusion", None)  # the final evaluation's matrix is in the results
                scores.pop("eval_skipped", None)  # and its skips
                if scores:
                    due_row = {**(due_row or {"step": step}), **scores}
            if due_row is not None and step != tc.steps:  # the last row: logged at the end
                meter.log(due_row)
            if stop.agreed():  # preemption: every rank stops after the same step
                break
            if due(step, tc.checkpoint_every) and step != tc.steps and not meter.bad.in_a_row:
                with meter.paused():  # never during a run of skipped steps: the last good
                    ckpts.save(step, meter.totals(), *streams)  # one stays the resume point
        meter.end_loop(step)
        ckpts.save(step, meter.totals(), *streams)
        if step < tc.steps:
            return end_preempted(meter, step)
        stop.finish_loop()  # a signal from here on ends the job at once (checkpoint complete)

        # --- Final: evaluation (completes the last row), results.json, the classifier -------
        scores = evaluate_all(model, ema, cfg, run, label_names, job.eval_map)
        confusion, eval_skipped = scores.pop("confusion", None), scores.pop("eval_skipped", 0)
        row = meter.log({**row, "step": tc.steps, **scores})
        results = final_results(cfg, row, start.counters, job.subset, label_names)
        if eval_skipped or (cfg.data.eval and row["top1"] is None):
            results["eval_skipped"] = eval_skipped
            warn_eval_skipped(cfg.data.eval, eval_skipped, confusion)
        if job.eval_left_out:  # their test images: not in top-1 nor the confusion matrix
            results["eval_classes_left_out"] = job.eval_left_out
        if confusion is not None:  # per-class accuracy and the matrix of the saved model
            summary = confusion_summary(confusion, label_names)
            results.update(per_class_top1=summary["per_class_top1"])
            results.update(confusion_matrix=summary["confusion_matrix"])
        if selftrain is not None:
            results["distill"] = distill_results(cfg, job.teacher, start.counters, row, acc)
            if selftrain.classes is not None:  # FlexMatch's or CBST's, as the last step left them
                t = selftrain.classes.thresholds.tolist()
                results["distill"]["class_thresholds"] = dict(zip(label_names, t, strict=True))
            if selftrain.align is not None:  # ReMixMatch's p_L / p_U, as the last step left it
                t = selftrain.align.scale.tolist()
                results["distill"]["align_scale"] = dict(zip(label_names, t, strict=True))
        results["wall_time_s"] = time.time() - started
        if acc.is_main_process:  # the averaged weights when there are any (what top1_ema scored)
            save_final(ema.module if ema is not None else raw, cfg, label_names)
        shown = ("top1", "top1_ema", "wall_time_s") if ema is not None else ("top1", "wall_time_s")
        log.info("done: %s", format_metrics(results, shown))
    return meter.finish(results)


def build_classifier(cfg: FinetuneConfig, loaded, num_classes: int, train_data, run, start):
    """The classifier on the device: the loaded encoder (random init is built here, after
    the seeds are set, so a from-scratch run is reproducible), its head zero or, for LP-FT on
    a new run, the probe's (a resumed run's head is the checkpoint's)."""
    encoder = build_vit(cfg.model) if loaded is None else loaded.encoder
    encoder.set_drop_path(cfg.parts.drop_path)  # the recipe's stochastic depth (0: none)
    pixels = PixelNorm(cfg.data.mean, cfg.data.std)  # the model takes the loaders' uint8
    model = Classifier(encoder, num_classes, cfg.pool, pixels).to(run.acc.device)
    if cfg.init.head == "probe" and start.step == 0:
        fit_probe_head(model, train_data.train, cfg.model.image_size, run)
    return model


def log_row(selftrain, sums: dict, lap: dict, step: int) -> dict:
    """A lap's row: loss and training accuracy (and the unlabelled images' columns)."""
    out = {"step": step, "loss": ratio(sums["loss"], sums["micro"])}
    out.update(train_acc=ratio(sums["correct"], sums["seen"]), **lap)
    if selftrain is not None:
        out.update(selftrain.row(sums))
    return out


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
        "skipped_samples": counters["skipped_samples"],  # unreadable images, bad labels
        "skipped_shards": counters["skipped_shards"],
        "skipped_steps": counters["skipped_steps"],
        "scaler_skips": counters["scaler_skips"],  # fp16 overflows the loss scaler handled
        "init": "random" if cfg.init.scratch else cfg.init.checkpoint,
        "image_size": cfg.model.image_size,
        "recipe": cfg.recipe,
        "seed": cfg.seed,
        "labels_per_class": cfg.data.labels_per_class,  # 0: every label of data.train
        "labels_select": cfg.data.labels_select,  # balanced, or N images picked unlabelled
        "labels_budget": cfg.data.labels_budget,  # that N (0: balanced)
        "num_labelled": subset.num_labelled if subset else _source_size(cfg.data.train),
        "num_classes": len(label_names),
        "label_names": list(label_names),
    }


def distill_results(cfg: FinetuneConfig, teacher, counters: dict, row: dict, acc) -> dict:
    """What results.json says of the unlabelled images' use: the mode, the unlabelled source
    and how many of its images the run saw (all processes); offline, the teacher (path,
    checksum, its top-1); online, its knobs and the last lap's pseudo-labels
    (none used: a warning from the main process)."""
    d = cfg.distill
    out = {"mode": d.mode, "unlabelled": d.unlabelled}
    out.update(unlabelled_images_seen=counters.get("images_unlabelled", 0))
    out.update(weight=d.weight, ratio=d.ratio)
    if not d.online:
        return {**teacher.record(), **out, "temperature": d.temperature}
    out.update(momentum=d.momentum, threshold=d.threshold, strong_ops=d.strong_ops)
    out.update(strong_magnitude=d.strong_magnitude, mixup=d.mixup)
    # distill.class_thresholds is not repeated here: its key holds the thresholds by class
    # that main() writes when FlexMatch's (or CBST's, class_share > 0) are on, none when off
    out.update(class_share=d.class_share, align=d.align)
    if row.get("pseudo_used") == 0 and acc.is_main_process:
        log.warning(
            "distill: no unlabelled image passed distill.threshold=%s in the last %d steps: "
            "they taught nothing; lower distill.threshold or distill.momentum",
            d.threshold, cfg.train.steps % cfg.train.log_every or cfg.train.log_every,
        )  # fmt: skip
    return {**out, "pseudo_used": row.get("pseudo_used"), "pseudo_acc": row.get("pseudo_acc")}


def evaluate_all(model, ema, cfg: FinetuneConfig, run, label_names, eval_map) -> dict[str, Any]:
    """top1 (and top1_ema with Polyak averaging) on data.eval (None when no image of it was
    scored), with `confusion` the summary of the model that is saved (the averaged one when
    there is one) and `eval_skipped` the images skipped; {} without an eval split."""
    if not cfg.data.eval:
        return {}
    K = len(label_names)
    conf, skipped = evaluate(model, cfg.data.eval, cfg, run, K, eval_map)
    row = {"top1": confusion_summary(conf, label_names)["top1"]}  # None: no image scored
    if ema is not None:
        conf, _ = evaluate(ema.module, cfg.data.eval, cfg, run, K, eval_map)  # the same images
        row["top1_ema"] = confusion_summary(conf, label_names)["top1"]
    row["confusion"], row["eval_skipped"] = conf, skipped
    return row


def warn_eval_skipped(source: str, skipped: int, confusion) -> None:
    """Images of data.eval that top-1 does not count: said, and when none was scored, top-1
    is not measured (None), never a 0% it did not see."""
    scored = int(confusion.sum())
    if scored == 0:
        log.warning(
            "data.eval=%s: none of its images was scored (%d skipped: unreadable, or labelled "
            "outside data.train's classes): top-1 not measured", source, skipped,
        )  # fmt: skip
    else:
        log.warning(
            "data.eval=%s: %d image(s) skipped (unreadable, or labelled outside data.train's "
            "classes): top-1 is over the %d scored", source, skipped, scored,
        )  # fmt: skip


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
        if not subset.picked:  # typiclust: its keys and indices set, the same on each process
            pick_typiclust(subset, cfg, run)
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
