"""Masked patch prediction pretraining (Dosovitskiy et al. 2021, appendix B.1.2).

    accelerate launch --multi_gpu pipelines/pretrain.py --config configs/pretrain/smoke.yaml
    python pipelines/pretrain.py --config ... [key.sub=value ...]   # one process (CPU, 1 GPU)
    ... --resume                                 # continue from the newest valid checkpoint

config -> checks -> Accelerator -> model -> optimizer -> resume -> data -> loop -> final save
and few-shot evaluation. Exit status: 0 done or preempted (checkpoint written), 1 failed.
"""

from __future__ import annotations

import argparse
import logging
import math
import time

import torch

from ssl_vit.config import PretrainConfig, load_config, to_dict
from ssl_vit.data import pretrain_loader
from ssl_vit.data.device_augment import build_device_augment
from ssl_vit.eval.fewshot_job import fewshot_evaluate
from ssl_vit.model import build_vit
from ssl_vit.objectives import NUM_COLOR_CLASSES, MaskedPatchPrediction
from ssl_vit.objectives.corruption import CorruptionDraws
from ssl_vit.train import preflight
from ssl_vit.train.checkpoint import rng_state
from ssl_vit.train.compile import maybe_compile
from ssl_vit.train.guard import StopRequest, one_line_errors, run_job
from ssl_vit.train.loop import (
    BadSteps,
    Batches,
    Checkpointer,
    StepStats,
    end_preempted,
    lap_row,
    resume,
)
from ssl_vit.train.metrics import MetricsWriter, Stopwatch, format_metrics, progress_bar
from ssl_vit.train.optim import apply_step, build_adam
from ssl_vit.train.runtime import replica_checksum, start_run
from ssl_vit.train.schedules import set_lr, warmup_cosine

log = logging.getLogger("pretrain")
SHOWN = ("step", "loss", "color_acc", "lr", "img_per_s", "data_wait")
RESULT_KEYS = (
    *("loss", "color_acc", "color_acc_majority", "frac_corrupted", "frac_mask", "frac_random"),
    *("frac_keep", "skipped_samples", "skipped_shards", "skipped_steps"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", help="YAML config (see configs/pretrain/)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a run in output_dir")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return p.parse_intermixed_args(argv)


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
        urls = check(cfg)
        run = start_run(cfg, args.resume, args.overwrite)  # Accelerator, locked run dir, seeds
    tc, acc = cfg.train, run.acc

    # --- Model, optimizer ----------------------------------------------------------------
    model = MaskedPatchPrediction(build_vit(cfg.model), cfg.objective, cfg.data.mean, cfg.data.std)
    model.to(acc.device)
    optimizer = build_adam(model, tc)
    # data.augment=device: crop + flip on the device, from a generator of its own (None: workers)
    augment = build_device_augment(
        cfg.data, cfg.model.image_size, acc.device, cfg.seed, acc.process_index, acc.num_processes
    )

    # --- Resume --------------------------------------------------------------------------
    start = resume(run, args.resume, model, optimizer)
    start_step, counters = start.step, start.counters
    if augment is not None:
        augment.load_state_dict(start.augment)
    target_hist = torch.zeros(NUM_COLOR_CLASSES, dtype=torch.long, device=acc.device)
    if start.state and acc.is_main_process:  # the saved histogram is already summed over ranks
        target_hist = start.state["target_hist"].to(acc.device)
    metrics = MetricsWriter(
        run.run_dir, enabled=acc.is_main_process, log_with=tc.log_with, config=to_dict(cfg)
    )
    metrics.truncate_after(start_step)
    model, optimizer = acc.prepare(model, optimizer)
    # forward+loss, one graph (the corruption draws come in as a tensor); the optimizer step
    # stays outside: fused kernels already.
    forward = maybe_compile(model, tc.compile, tc.compile_mode, acc.device)
    encoder = acc.unwrap_model(model).encoder
    # Micro-batch u's corruption: this rank's slice of the global batch's draws from (seed, u).
    draws = CorruptionDraws(
        cfg.seed, encoder.num_patches, acc.process_index, acc.num_processes, acc.device
    )

    # --- Data: every rank streams its own shards (never dispatched from rank 0) -----------
    loader = pretrain_loader(
        cfg.data,
        batch_size=run.local_batch,
        image_size=cfg.model.image_size,
        seed=cfg.seed,
        rank=acc.process_index,
        world_size=acc.num_processes,
        resume=start.stream,  # exactly where the consumed batches ended
        urls=urls,
        load_size=augment.load_size if augment else None,  # device: only decode + resize
    )
    keys_file = run.run_dir / f"keys_rank{acc.process_index}.txt" if cfg.data.record_keys else None
    watch = Stopwatch()
    batches = Batches(loader, start, acc.num_processes, watch, keys_file)

    def training_state() -> dict:
        return {
            "model": acc.unwrap_model(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "counters": counters,
            "target_hist": acc.reduce(target_hist.clone(), reduction="sum").cpu(),
            "config": to_dict(cfg),
            "replica_checksums": replica_checksum(model, acc),  # raises if replicas diverged
        }

    ckpt = Checkpointer(
        run,
        tc,
        encoder,
        to_dict(cfg.model),
        state=training_state,
        rng=lambda: {
            **rng_state(),
            "stream": batches.tracker.state_dict(),
            "augment": augment.state_dict() if augment else None,
        },
    )

    # --- Loop ----------------------------------------------------------------------------
    log.info(
        "pretraining %s for %d steps, global batch %d (%d per process x %d processes x %d "
        "accumulation) on %s",
        *(cfg.output_dir, tc.steps, tc.batch_size, run.local_batch, acc.num_processes),
        *(tc.grad_accum, acc.device),
    )
    stats = StepStats({"loss": 1, "micro": 1, "correct": 1, "predicted": 1, "kinds": 4}, acc.device)
    step_hist = torch.zeros_like(target_hist)
    bad = BadSteps(tc, run.ckpt_dir, counters, acc.device)
    bar = progress_bar(tc.steps, start_step, acc.is_main_process)
    fewshot_every = cfg.fewshot.every if cfg.fewshot.train else 0
    model.train()
    done, last_log, last_row = start_step, start_step, {}
    with (  # the stop handler first: a signal while the loader workers start is a preemption
        StopRequest(acc.num_processes, tc.stop_timeout_s) as stop,
        batches,
    ):
        for step in range(start_step, tc.steps):
            lr = warmup_cosine(step, tc.steps, tc.warmup_steps, tc.lr, tc.min_lr)
            set_lr(optimizer, lr)
            applied = True
            for micro in range(tc.grad_accum):
                images = batches.next().images.to(acc.device, non_blocking=True)
                index = step * tc.grad_accum + micro  # the micro-batch's place in the run
                if augment is not None:  # uint8 in and out: the colour targets stay exact
                    images = augment(images, index)
                noise = draws(index, len(images))
                with acc.accumulate(model):
                    out = forward(images, noise)  # autocast (mixed precision) comes from prepare()
                    acc.backward(out.loss)
                    if acc.sync_gradients:
                        applied = apply_step(acc, model, optimizer, tc.grad_clip)
                    optimizer.zero_grad(set_to_none=True)
                stats.add(loss=out.loss, micro=1, kinds=out.kind_counts())
                if out.correct is not None:  # None: colour accuracy undefined for the target
                    stats.add(correct=out.correct, predicted=out.color_targets.numel())
                targets = out.color_targets.flatten()
                step_hist.index_add_(0, targets, torch.ones_like(targets))  # no host sync
            done = step + 1
            stats.end_step(applied)  # a skipped step counts in no logged mean
            bad.update(applied, done)
            target_hist += step_hist * applied  # applied: a bool on the device, no sync
            step_hist.zero_()
            bar.update(1)
            if done % tc.log_every == 0 or done == tc.steps:
                hist = acc.reduce(target_hist.clone(), "sum")
                row = {**log_row(stats.reduce(acc), hist, done), "lr": lr}
                row.update(lap_row(watch, done - last_log, tc.batch_size, counters))
                last_row = metrics.log({**row, "peak_mem_mb": peak_memory_mb(acc.device)})
                last_log = done
                bar.write(format_metrics(last_row, SHOWN))
            if fewshot_every and done % fewshot_every == 0 and done != tc.steps:
                with watch.paused():
                    fewshot(cfg, encoder, acc, metrics, done, model)
            if stop.agreed():  # preemption: every rank stops after the same step
                break
            ckpt.save_if_due(done, bad, watch)
        bar.close()

        # --- Final save and results ------------------------------------------------------
        ckpt.save(done, bad)
        if done < tc.steps:
            return end_preempted(metrics, acc, done)
        stop.finish_loop()  # a signal from here on ends the job at once (checkpoint complete)
        results = {k: last_row.get(k) for k in RESULT_KEYS}
        results.update(
            step=tc.steps,
            checkpoint=str(run.ckpt_dir / f"step_{tc.steps:08d}"),
            wall_time_s=time.time() - t_start,
            num_processes=acc.num_processes,
        )
        if cfg.fewshot.train:
            results["fewshot"] = fewshot(cfg, encoder, acc, metrics, tc.steps, model)
    metrics.write_results(results)
    log.info("done: %s", format_metrics(results, ("loss", "color_acc", "wall_time_s")))
    acc.end_training()
    return results


def log_row(sums: dict, hist: torch.Tensor, step: int) -> dict:
    """The objective's figures of one lap (`StepStats` sums over ranks) and the run's
    colour histogram so far."""
    untouched, masked, random, kept = sums["kinds"]
    corrupted = masked + random + kept
    return {
        "step": step,
        "loss": _div(sums["loss"], sums["micro"]),
        "color_acc": _div(sums["correct"], sums["predicted"]),
        # Accuracy of always predicting the most frequent colour class seen so far.
        "color_acc_majority": (hist.max() / hist.sum().clamp(min=1)).item(),
        "frac_corrupted": _div(corrupted, corrupted + untouched),
        "frac_mask": _div(masked, corrupted),
        "frac_random": _div(random, corrupted),
        "frac_keep": _div(kept, corrupted),
    }


def peak_memory_mb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None


def _div(a: float, b: float) -> float:
    """a / b, NaN when a lap held only skipped steps."""
    return a / b if b else math.nan


def fewshot(cfg, encoder, acc, metrics, step, model) -> dict | None:
    """Few-shot linear evaluation of the frozen encoder, logged as a metrics row."""
    model.eval()
    res = None
    if acc.is_main_process:  # cheap (a few hundred train images + the test split): main only
        f = cfg.fewshot
        res = fewshot_evaluate(
            encoder,
            f.train,
            f.eval,
            image_size=cfg.model.image_size,
            mean=cfg.data.mean,
            std=cfg.data.std,
            shots=f.shots,
            seeds=f.seeds,
            l2_regs=f.l2_reg,
            batch_size=f.batch_size,
            num_workers=f.num_workers,
            max_eval=f.max_eval,
            device=acc.device,
            knn_k=f.knn_k,
            knn_train=f.knn_train,
            knn_temperature=f.knn_temperature,
            standardize=f.standardize,
            compile=cfg.train.compile,
            compile_mode=cfg.train.compile_mode,
        )
        metrics.log({"step": step, **{f"fewshot/{k}": v for k, v in res["summary"].items()}})
        if "knn" in res:  # the k-NN monitor (fewshot.knn_k > 0), on the same test features
            metrics.log({"step": step, "knn/top1": res["knn"]["top1"]})
        log.info("few-shot at step %d: %s", step, res["summary"])
    acc.wait_for_everyone()
    model.train()
    return res


if __name__ == "__main__":
    run_job(main)
