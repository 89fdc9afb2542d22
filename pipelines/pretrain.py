"""Masked patch prediction pretraining (Dosovitskiy et al. 2021, appendix B.1.2).

    accelerate launch pipelines/pretrain.py --config configs/pretrain/smoke.yaml [key.sub=value ...]
    python pipelines/pretrain.py ...            # the same, in one process
    ... --resume                                 # continue from the newest valid checkpoint

config -> Accelerator -> data -> model -> optimizer -> resume -> loop -> final save.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time

import torch

from ssl_vit.config import ConfigError, PretrainConfig, load_config, to_dict
from ssl_vit.data import Batch, StreamTracker, pretrain_loader, resolve_shards
from ssl_vit.eval.fewshot_job import fewshot_evaluate
from ssl_vit.model import build_vit
from ssl_vit.objectives import NUM_COLOR_CLASSES, MaskedPatchPrediction
from ssl_vit.train.checkpoint import (
    latest_valid_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from ssl_vit.train.metrics import MetricsWriter, Stopwatch, format_metrics, progress_bar
from ssl_vit.train.optim import apply_step, build_adam
from ssl_vit.train.runtime import StopRequest, replica_checksum, start_run
from ssl_vit.train.schedules import set_lr, warmup_cosine

log = logging.getLogger("pretrain")
SHOWN = ("step", "loss", "color_acc", "lr", "img_per_s", "data_wait")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", help="YAML config (see configs/pretrain/)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> dict:
    t_start = time.time()
    args = parse_args(argv)
    try:
        cfg = load_config(PretrainConfig, args.config, args.overrides)
        urls = resolve_shards(cfg.data.train_shards)
        run = start_run(cfg)  # Accelerator, run directory with config.yaml, seeds
    except (ConfigError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    tc, acc, run_dir, ckpt_dir = cfg.train, run.acc, run.run_dir, run.ckpt_dir
    local_batch = run.local_batch

    # --- Model, optimizer ----------------------------------------------------------------
    model = MaskedPatchPrediction(build_vit(cfg.model), cfg.objective, cfg.data.mean, cfg.data.std)
    model.to(acc.device)
    optimizer = build_adam(model, tc)
    # The corruption draws come from their own generator, on the device, saved with the RNGs.
    gen = torch.Generator(acc.device).manual_seed(cfg.seed * 7919 + acc.process_index)

    # --- Resume --------------------------------------------------------------------------
    start_step, stream_state = 0, None
    counters = {"skipped_samples": 0, "skipped_shards": 0, "skipped_steps": 0, "images": 0}
    target_hist = torch.zeros(NUM_COLOR_CLASSES, dtype=torch.long, device=acc.device)
    if args.resume and (path := latest_valid_checkpoint(ckpt_dir)) is not None:
        state = load_checkpoint(path, rank=acc.process_index)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"], gen)
        start_step, counters = state["step"], {**counters, **state["counters"]}
        stream_state = state["rng"].get("stream")
        if acc.is_main_process:  # the saved histogram is already summed over ranks
            target_hist = state["target_hist"].to(acc.device)
        log.info("resumed from %s at step %d", path, start_step)
    elif args.resume:
        log.info("--resume: no valid checkpoint in %s, starting from scratch", ckpt_dir)
    metrics = MetricsWriter(
        run_dir, enabled=acc.is_main_process, log_with=tc.log_with, config=to_dict(cfg)
    )
    metrics.truncate_after(start_step)
    model, optimizer = acc.prepare(model, optimizer)
    if tc.compile:
        model = torch.compile(model)
    encoder = acc.unwrap_model(model).encoder

    # --- Data: every rank streams its own shards (never dispatched from rank 0) -----------
    loader = pretrain_loader(
        urls,
        local_batch,
        cfg.model.image_size,
        crop_scale=cfg.data.crop_scale,
        hflip=cfg.data.hflip,
        num_workers=cfg.data.num_workers,
        shuffle_buffer=cfg.data.shuffle_buffer,
        seed=cfg.seed,
        rank=acc.process_index,
        world_size=acc.num_processes,
        resampled=cfg.data.resampled,
        resume=stream_state,  # exactly where the consumed batches ended
    )
    batches = iter(loader)
    tracker = StreamTracker(acc.num_processes, cfg.data.num_workers, stream_state)
    keys_file = run_dir / f"keys_rank{acc.process_index}.txt" if cfg.data.record_keys else None
    stop = StopRequest(acc.num_processes)

    def checkpoint(step: int) -> None:
        hist = acc.reduce(target_hist.clone(), reduction="sum")  # every rank calls this
        checksums = replica_checksum(model, acc)  # raises if the replicas have diverged
        save_checkpoint(
            ckpt_dir,
            step,
            encoder=encoder,
            model_config=to_dict(cfg.model),
            state={
                "model": acc.unwrap_model(model).state_dict(),
                "optimizer": optimizer.state_dict(),
                "counters": counters,
                "target_hist": hist.cpu(),
                "config": to_dict(cfg),
                "replica_checksums": checksums,
            },
            rng={**rng_state(gen), "stream": tracker.state_dict()},
            rank=acc.process_index,
            is_main=acc.is_main_process,
            barrier=acc.wait_for_everyone,
            keep=tc.keep_checkpoints,
        )

    # --- Loop ----------------------------------------------------------------------------
    log.info(
        "pretraining %s for %d steps, global batch %d (%d per process x %d processes x %d "
        "accumulation) on %s",
        cfg.output_dir,
        tc.steps,
        tc.batch_size,
        local_batch,
        acc.num_processes,
        tc.grad_accum,
        acc.device,
    )
    model.train()
    watch, bar = Stopwatch(), progress_bar(tc.steps, start_step, acc.is_main_process)
    # Per-lap sums, reduced over ranks at log steps only: loss, micro-steps, correct,
    # predicted, and patches per corruption kind (untouched, masked, random, kept).
    sums = torch.zeros(8, device=acc.device)
    last_row: dict = {}
    last_log = start_step
    step_sums, step_hist = torch.zeros_like(sums), torch.zeros_like(target_hist)
    bad_run, done, stopped = 0, start_step, False
    for step in range(start_step, tc.steps):
        lr = warmup_cosine(step, tc.steps, tc.warmup_steps, tc.lr, tc.min_lr)
        set_lr(optimizer, lr)
        step_sums.zero_()
        step_hist.zero_()
        bad = False
        for _ in range(tc.grad_accum):
            t0 = time.perf_counter()
            batch = next_batch(batches, counters, tracker, keys_file)
            watch.add("data", time.perf_counter() - t0)
            counters["images"] += len(batch.images) * acc.num_processes
            images = batch.images.to(acc.device, non_blocking=True)
            with acc.accumulate(model):
                out = model(images, gen)  # autocast (mixed precision) is applied by prepare()
                acc.backward(out.loss)
                if acc.sync_gradients:
                    bad = not apply_step(acc, model, optimizer, tc.grad_clip)
                optimizer.zero_grad(set_to_none=True)
            step_sums[0] += out.loss.detach()
            step_sums[1] += 1
            if out.correct is not None:  # None: colour accuracy is not defined for the target
                step_sums[2] += out.correct
                step_sums[3] += out.color_targets.numel()
            step_sums[4:] += out.kind_counts()
            step_hist += torch.bincount(out.color_targets.flatten(), minlength=NUM_COLOR_CLASSES)
        done = step + 1
        if bad:  # not applied; not counted in the logged means
            bad_run, counters["skipped_steps"] = bad_run + 1, counters["skipped_steps"] + 1
            log.warning(
                "step %d: non-finite gradient norm, step skipped (%d in a row)", done, bad_run
            )
            if bad_run >= tc.max_bad_steps:
                stop.close()
                sys.exit(
                    f"error: {bad_run} steps in a row with a non-finite loss or gradient (last: "
                    f"step {done}); stopping. Last good checkpoint: "
                    f"{latest_valid_checkpoint(ckpt_dir)}"
                )
        else:
            bad_run = 0
            sums += step_sums
            target_hist += step_hist
        bar.update(1)

        done = step + 1
        if done % tc.log_every == 0 or done == tc.steps:
            elapsed, waits = watch.lap()
            loss_sum, n_micro, correct, predicted, *kinds = acc.reduce(sums, "sum").tolist()
            hist = acc.reduce(target_hist.clone(), reduction="sum")
            corrupted = sum(kinds[1:])
            last_row = metrics.log(
                {
                    "step": done,
                    "loss": _div(loss_sum, n_micro),
                    "color_acc": _div(correct, predicted),
                    # Accuracy of always predicting the most frequent colour class seen so far.
                    "color_acc_majority": (hist.max() / hist.sum().clamp(min=1)).item(),
                    "lr": lr,
                    "img_per_s": (done - last_log) * tc.batch_size / elapsed,
                    "data_wait": waits.get("data", 0.0) / elapsed,
                    "frac_corrupted": _div(corrupted, sum(kinds)),
                    "frac_mask": _div(kinds[1], corrupted),
                    "frac_random": _div(kinds[2], corrupted),
                    "frac_keep": _div(kinds[3], corrupted),
                    "skipped_samples": counters["skipped_samples"],
                    "skipped_shards": counters["skipped_shards"],
                    "skipped_steps": counters["skipped_steps"],
                    "images_seen": counters["images"],
                    "peak_mem_mb": (
                        torch.cuda.max_memory_allocated() / 2**20
                        if acc.device.type == "cuda"
                        else None
                    ),
                }
            )
            sums.zero_()
            last_log = done
            if acc.is_main_process:
                bar.write(format_metrics(last_row, SHOWN))
            if not math.isfinite(last_row["loss"]):
                log.warning("non-finite loss at step %d", done)
        if (
            cfg.fewshot.train
            and cfg.fewshot.every
            and done % cfg.fewshot.every == 0
            and done != tc.steps
        ):
            with watch.paused():
                _fewshot(cfg, encoder, acc, metrics, done, model)
        if stop.agreed():  # preemption: every rank stops after the same step
            stopped = True
            break
        if tc.checkpoint_every and done % tc.checkpoint_every == 0 and done != tc.steps:
            if not bad_run:  # keep the last good checkpoint during a run of skipped steps
                with watch.paused():
                    checkpoint(done)
    bar.close()
    stop.close()

    # --- Final save and results ----------------------------------------------------------
    checkpoint(done)
    if stopped:
        log.info(
            "stopped by a signal after step %d; checkpoint written, resume with --resume", done
        )
        metrics.write_results({"step": done, "preempted": True})
        acc.end_training()
        return {"step": done, "preempted": True}
    results = {
        k: last_row.get(k)
        for k in (
            "loss",
            "color_acc",
            "color_acc_majority",
            "frac_corrupted",
            "frac_mask",
            "frac_random",
            "frac_keep",
            "skipped_samples",
            "skipped_shards",
            "skipped_steps",
        )
    }
    results.update(
        step=tc.steps,
        checkpoint=str(ckpt_dir / f"step_{tc.steps:08d}"),
        wall_time_s=time.time() - t_start,
        num_processes=acc.num_processes,
    )
    if cfg.fewshot.train:
        results["fewshot"] = _fewshot(cfg, encoder, acc, metrics, tc.steps, model)
    metrics.write_results(results)
    if acc.is_main_process:
        log.info("done: %s", format_metrics(results, ("loss", "color_acc", "wall_time_s")))
    acc.end_training()
    return results


def _div(a: float, b: float) -> float:
    """a / b, NaN when a lap held only skipped steps."""
    return a / b if b else math.nan


def next_batch(batches, counters: dict, tracker: StreamTracker, keys_file=None) -> Batch:
    """The next non-empty batch, adding its decode/shard failures to `counters` and its stream
    position to `tracker` (only consumed batches count; prefetched ones do not)."""
    while True:
        batch = next(batches)
        counters["skipped_samples"] += batch.skipped
        counters["skipped_shards"] += batch.skipped_shards
        tracker.update(batch)
        if keys_file is not None:
            with open(keys_file, "a") as f:
                f.write("".join(k + "\n" for k in batch.keys))
        if len(batch.images):  # an empty batch only reports a worker's skipped samples
            return batch


def _fewshot(cfg, encoder, acc, metrics, step, model) -> dict | None:
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
        )
        metrics.log({"step": step, **{f"fewshot/{k}": v for k, v in res["summary"].items()}})
        log.info("few-shot at step %d: %s", step, res["summary"])
    acc.wait_for_everyone()
    model.train()
    return res


if __name__ == "__main__":
    main()
