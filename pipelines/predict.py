"""Label a source with a fine-tuned classifier: what users fine-tune for.

    ssl-vit predict --checkpoint runs/ft --source path/to/images --output runs/ft-pred
    accelerate launch --multi_gpu -m ssl_vit.pipelines.predict --checkpoint ... --source ...

The classifier file (`model.safetensors` of the fine-tuning run) gives the model, its label
names and the fine-tune's own evaluation transform, so on the fine-tune's `data.eval` predict's
top-1 is the fine-tune's. Rows come out in the source's order whatever the process and worker
count (`ssl_vit.data.predict_stream`); an unreadable image is a named, counted skip.
config -> checks -> Accelerator -> run directory -> classifier -> loader -> rounds -> results.
Exit status: 0 done, 1 failed. SIGTERM / SIGINT end it at once (nothing to resume): one error
line, exit 1, no partial predictions file; a rerun with --overwrite predicts them all again.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from pathlib import Path

import torch

from ssl_vit import jobs
from ssl_vit.atomic import clean_temporary
from ssl_vit.cli import job_parser
from ssl_vit.config import ConfigError, to_dict
from ssl_vit.config.checks import auto_num_workers
from ssl_vit.config.flags import given_flags, load_flagged
from ssl_vit.config.predict import PredictConfig
from ssl_vit.data.predict_stream import num_batches, open_predict_source, predict_loader
from ssl_vit.eval.confusion import add_confusion, confusion_summary
from ssl_vit.eval.predictions import PredictionWriter, gather_on_main, predict_batch
from ssl_vit.progress import progress_bar
from ssl_vit.runs.lock import on_main
from ssl_vit.runs.occupancy import check_not_source, occupant, saved_config, saved_job
from ssl_vit.train import preflight
from ssl_vit.train.classifier_file import (
    ClassifierError,
    find_classifier,
    load_classifier,
    read_classifier_spec,
)
from ssl_vit.train.guard import JobError, one_line_errors, run_and_exit
from ssl_vit.train.metrics import MetricsWriter
from ssl_vit.train.rundir import claim_run_dir, run_files
from ssl_vit.train.runtime import make_accelerator, setup_logging
from ssl_vit.watchdog import Stopped, stops_raise, watched

log = logging.getLogger("predict")
FLAGS = {  # command-line flag -> config key
    "checkpoint": "checkpoint",
    "source": "source",
    "output": "output_dir",
    "top_k": "top_k",
    "format": "format",
    "batch_size": "batch_size",
    "workers": "num_workers",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = job_parser(jobs.PREDICT, __doc__)
    p.add_argument("--checkpoint", help="fine-tuning run directory or its model.safetensors")
    p.add_argument("--source", help="image folder or file, shards, brace pattern or HF dataset")
    p.add_argument("--output", help="directory for predictions.jsonl and results.json")
    p.add_argument("--top-k", type=int, help="classes listed per image (default 5)")
    p.add_argument("--format", choices=["jsonl", "csv"], help="predictions.jsonl (default) or .csv")
    p.add_argument("--batch-size", type=int, help="images per forward pass per process (256)")
    p.add_argument("--workers", type=int, help="loader workers per process (-1: auto)")
    p.add_argument("--config", help="YAML config (the keys of PredictConfig)")
    p.add_argument("--overwrite", action="store_true", help="replace earlier predictions")
    p.add_argument(
        "--ignore-labels",
        action="store_true",
        help="treat the source as unlabelled (its folders are not the classifier's classes)",
    )
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p.parse_intermixed_args(argv)


def check(cfg: PredictConfig, overwrite: bool):
    """Everything before any image is read: the classifier (its header only), the source and
    its classes, the output directory. -> (classifier spec, number of images, the source's
    labels -> the classifier's or None, the source's classes the classifier lacks)"""
    try:
        spec = read_classifier_spec(cfg.checkpoint)
    except ClassifierError as e:
        raise ConfigError(f"--checkpoint {cfg.checkpoint}: {e}") from None
    preflight.check_not_a_run("--source", cfg.source)
    try:
        source = open_predict_source(cfg.source, cfg.ignore_labels)  # every image in it
        n = len(source)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--source {cfg.source}: {e}") from None
    names = [] if cfg.ignore_labels else list(source.label_names)
    unknown = [name for name in names if name not in spec.label_names]
    if unknown and len(unknown) == len(names):
        raise ConfigError(
            f"--source {cfg.source}: its classes {_listed(unknown)} are not among the "
            f"classifier's {_listed(spec.label_names)}; pass --ignore-labels to label its "
            "images anyway (no accuracy)"
        )
    check_output(Path(cfg.output_dir), cfg, overwrite)
    if names:  # its top-1 reads as held-out: say when the classifier was trained on it
        trained = (saved_config(find_classifier(cfg.checkpoint).parent) or {}).get("data")
        if isinstance(trained, dict) and isinstance(trained.get("train"), str):
            why = "top-1 counts images the classifier was trained on"
            preflight.warn_shared(
                ("the classifier's data.train", trained["train"]), ("--source", cfg.source), why
            )
    if unknown:  # as the fine-tune scored its data.eval (a few picked labels missed a class)
        log.warning(
            "--source %s: the classifier has no class %s: those images are predicted, with "
            "true_label null, and left out of top-1 and the confusion matrix",
            cfg.source, _listed(unknown),
        )  # fmt: skip
    # The source's label i is the classifier's class of the same name (folders sort by name).
    label_map = list(preflight.indices_by_name(names, list(spec.label_names))) or None
    return spec, n, label_map, unknown


def check_output(out: Path, cfg: PredictConfig, overwrite: bool) -> None:
    """The output holds nothing or earlier predictions (replaced only with --overwrite); never
    a run of another job, a checkpoint, a dataset, or anything predict reads."""
    job = saved_job(out)
    if job not in (None, jobs.PREDICT) or (job is None and occupant(out)):
        what = f"holds a {job.title} run" if job else occupant(out)
        raise ConfigError(f"--output {out}: {what}; write predictions to a folder of their own")
    if job is jobs.PREDICT and run_files(out) and not overwrite:
        raise ConfigError(f"--output {out}: holds predictions; pass --overwrite to replace them")
    if overwrite:
        check_not_source("--output", out, {"--checkpoint": cfg.checkpoint, "--source": cfg.source})


def main(argv: list[str] | None = None) -> dict:
    t_start = time.time()
    args = parse_args(argv)
    flags = given_flags(args, FLAGS)
    flags |= {"--ignore-labels": ("ignore_labels", True)} if args.ignore_labels else {}
    cfg = None
    try:
        with stops_raise():  # nothing to checkpoint: a stop ends the job where it is
            with one_line_errors():
                cfg = load_flagged(PredictConfig, args.config, flags, args.overrides)
            return predict(cfg, args.overwrite, t_start)
    except Stopped as e:  # what it was writing is removed on the way out (`run_rounds`)
        if cfg is not None:  # (and a file it was just opening)
            clean_temporary(cfg.output_dir, pid=os.getpid())
        raise JobError(
            f"{e} received: stopped before the predictions were complete (no partial file, no "
            "results.json); run it again with --overwrite"
        ) from None


def predict(cfg: PredictConfig, overwrite: bool, t_start: float) -> dict:
    """config -> checks -> ... -> results (`main`, under the stop handler)."""
    setup_logging()  # the checks' warnings as every other line (the launcher's rank: INFO)
    with one_line_errors():
        spec, n, label_map, left_out = check(cfg, overwrite)  # before any image is read
        acc = make_accelerator(cfg.mixed_precision, cfg.timeouts)
        setup_logging(acc.is_main_process)
        out = Path(cfg.output_dir)  # (check_output refused an --overwrite of what it reads)
        lock = on_main(acc, lambda: claim_run_dir(out, cfg, overwrite=overwrite))  # noqa: F841
        model, spec = load_classifier(cfg.checkpoint)
    workers = auto_num_workers(cfg.num_workers)
    loader = predict_loader(
        cfg.source, n, cfg.batch_size, spec.image_size,
        num_workers=workers, rank=acc.process_index, world_size=acc.num_processes,
        label_map=label_map,
    )  # fmt: skip
    log.info(
        "predicting %d images of %s with %s (%d classes, %d px) on %d process(es) x %d workers",
        n, cfg.source, cfg.checkpoint, spec.num_classes, spec.image_size, acc.num_processes,
        workers,
    )  # fmt: skip
    writer = None
    if acc.is_main_process:
        labelled = label_map is not None
        writer = PredictionWriter(Path(cfg.output_dir), cfg.format, spec.label_names, labelled)
    t_loop = time.time()
    conf, skipped = run_rounds(model.to(acc.device), loader, n, cfg, spec, acc, writer)
    results = {
        "job": "predict", "checkpoint": cfg.checkpoint, "source": cfg.source,
        "images": n - len(skipped), "skipped": len(skipped),
        "skipped_images": [{"key": key, "reason": why} for key, why in skipped],
        "label_names": list(spec.label_names), "image_size": spec.image_size,
        "processes": acc.num_processes, "workers": workers,
        "images_per_s": n / max(time.time() - t_loop, 1e-9), "wall_time_s": time.time() - t_start,
    }  # fmt: skip
    if label_map is not None:
        results.update(confusion_summary(conf, spec.label_names))
    if left_out:  # their images: true_label null, not in top-1 nor the confusion matrix
        results["classes_left_out"] = left_out
    if writer is not None:
        results["output"] = str(writer.close())
        write_results(Path(cfg.output_dir), cfg, results)
    return results


def run_rounds(model, loader, n: int, cfg: PredictConfig, spec, acc, writer):
    """Every process predicts its batch of round i (global batches iR .. iR + R - 1); the main
    process writes them in source order. -> (confusion matrix [K, K], skipped (name, why))"""
    K, R = spec.num_classes, acc.num_processes
    k, batches = min(cfg.top_k, K), num_batches(n, cfg.batch_size)
    conf, skipped = torch.zeros(K, K, dtype=torch.int64), []
    bar = progress_bar(n, enabled=acc.is_main_process, desc="predict", unit="img", every_s=30)
    it = iter(watched(loader, "--source"))  # a stalled source ends the job
    try:
        for i in range(math.ceil(batches / R)):
            mine = i * R + acc.process_index < batches  # the last round may leave some out
            part = predict_batch(model, next(it), k, acc.device, acc.autocast) if mine else None
            for p in gather_on_main(part, acc):
                writer.write(p)
                top1 = torch.tensor([t[0] for t in p.top_idx], dtype=torch.int64)
                add_confusion(conf, torch.tensor(p.labels, dtype=torch.int64), top1)
                skipped += p.skipped
                bar.update(len(p.names) + len(p.skipped))
    except BaseException:
        if writer is not None:
            writer.abort()  # no partial predictions file is left under the real name
        raise
    finally:
        bar.close()
        loader.close()  # its workers end on every way out (a stop signal, an error)
    return conf, skipped


def write_results(out: Path, cfg: PredictConfig, results: dict) -> None:
    metrics = MetricsWriter(out, config=to_dict(cfg))
    metrics.log({k: v for k, v in results.items() if isinstance(v, (int, float))})
    metrics.write_results(results)  # results.json last: it says the job finished
    top1, scored = results.get("top1"), results.get("num_labelled")
    of = f" of the {scored} of its classes" if results.get("classes_left_out") else ""
    log.info(
        "predicted %d images (%d skipped)%s: %s", results["images"], results["skipped"],
        f", top-1 {100 * top1:.2f}%{of}" if top1 is not None else "", results["output"],
    )  # fmt: skip


def _listed(names, most: int = 6) -> str:
    names = list(names)
    return "[" + ", ".join(names[:most]) + (", ..." if len(names) > most else "") + "]"


if __name__ == "__main__":
    run_and_exit(main)
