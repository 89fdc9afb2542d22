"""Fine-tune a pretrained encoder (or a random one) as a classifier (paper section 3.2, B.1.1).

    accelerate launch pipelines/finetune.py --config configs/finetune/smoke.yaml [key=value ...]
    python pipelines/finetune.py ...  [--resume]

The pretraining head is dropped; a zero-initialized D x K linear layer is attached; the
position embeddings are 2D-interpolated when `model.image_size` differs from pretraining.
config -> Accelerator -> data -> model -> optimizer -> resume -> loop -> final eval and save.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ssl_vit.config import ConfigError, FinetuneConfig, load_config, to_dict
from ssl_vit.data import StreamTracker, eval_loader, open_source, train_loader
from ssl_vit.model import Classifier, build_vit, normalize_pixels
from ssl_vit.train.checkpoint import (
    CheckpointError,
    encoder_from_checkpoint,
    latest_valid_checkpoint,
    load_checkpoint,
    resolve_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from ssl_vit.train.metrics import MetricsWriter, Stopwatch, format_metrics, progress_bar
from ssl_vit.train.optim import apply_step, build_sgd
from ssl_vit.train.runtime import StopRequest, start_run
from ssl_vit.train.schedules import set_lr, warmup_cosine

log = logging.getLogger("finetune")
SHOWN = ("step", "loss", "train_acc", "top1", "top1_ema", "lr", "img_per_s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", help="YAML config (see configs/finetune/)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return p.parse_intermixed_args(argv)


@torch.no_grad()
def evaluate(model, source: str, cfg: FinetuneConfig, acc) -> float:
    """Top-1 accuracy over the whole eval split (each rank a disjoint part, counts summed)."""
    model.eval()
    counts = torch.zeros(2, device=acc.device)
    for batch in eval_loader(
        source,
        cfg.train.batch_size // acc.num_processes,
        cfg.model.image_size,
        num_workers=cfg.data.num_workers,
        rank=acc.process_index,
        world_size=acc.num_processes,
        limit=cfg.data.max_eval,
    ):
        x = normalize_pixels(batch.images.to(acc.device), cfg.data.mean, cfg.data.std)
        with acc.autocast():
            pred = model(x).argmax(dim=-1)
        labels = batch.labels.to(acc.device)
        counts[0] += (pred == labels).sum()
        counts[1] += len(labels)
    correct, total = acc.reduce(counts, reduction="sum").tolist()
    model.train()
    return correct / max(total, 1)


def main(argv: list[str] | None = None) -> dict:
    t_start = time.time()
    args = parse_args(argv)
    try:
        cfg = load_config(FinetuneConfig, args.config, args.overrides)
        train_src = open_source(cfg.data.train)
        label_names = train_src.label_names
        if not label_names:
            raise ConfigError(f"data.train: {cfg.data.train} has no labels")
        if cfg.data.eval and open_source(cfg.data.eval).label_names != label_names:
            raise ConfigError("data.eval: its label names differ from data.train's")
        # --- Model: pretrained encoder (position embeddings resized) or random init ----------
        encoder = None
        if cfg.init.checkpoint:  # loaded before start_run: a bad checkpoint creates no run dir
            # A run directory -> its newest valid checkpoint, recorded as such in config.yaml.
            cfg.init.checkpoint = str(resolve_checkpoint(cfg.init.checkpoint))
            encoder, _ = encoder_from_checkpoint(
                cfg.init.checkpoint, cfg.model, cfg.init.pos_interp, cfg.init.format
            )
        run = start_run(cfg)  # Accelerator, run directory with config.yaml, seeds
    except (ConfigError, FileNotFoundError, CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
    tc, acc, run_dir, ckpt_dir = cfg.train, run.acc, run.run_dir, run.ckpt_dir
    if encoder is None:  # built after the seeds are set, so a from-scratch run is reproducible
        encoder = build_vit(cfg.model)

    model = Classifier(encoder, len(label_names), cfg.pool).to(acc.device)
    optimizer = build_sgd(model, tc)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema)) if cfg.ema else None

    start_step, stream_state = 0, None
    if args.resume and (path := latest_valid_checkpoint(ckpt_dir)) is not None:
        state = load_checkpoint(path, rank=acc.process_index)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if ema is not None:
            ema.load_state_dict(state["ema"])
        set_rng_state(state["rng"])
        start_step, stream_state = state["step"], state["rng"].get("stream")
        log.info("resumed from %s at step %d", path, start_step)
    metrics = MetricsWriter(
        run_dir, enabled=acc.is_main_process, log_with=tc.log_with, config=to_dict(cfg)
    )
    metrics.truncate_after(start_step)
    model, optimizer = acc.prepare(model, optimizer)
    raw = acc.unwrap_model(model)

    batches = iter(
        train_loader(
            cfg.data.train,
            run.local_batch,
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
    )
    tracker = StreamTracker(acc.num_processes, cfg.data.num_workers, stream_state)
    stop = StopRequest(acc.num_processes)

    def checkpoint(step: int) -> None:
        save_checkpoint(
            ckpt_dir,
            step,
            encoder=raw.encoder,
            model_config=to_dict(cfg.model),
            state={
                "model": raw.state_dict(),
                "optimizer": optimizer.state_dict(),
                "ema": ema.state_dict() if ema is not None else None,
                "config": to_dict(cfg),
                "label_names": label_names,
            },
            rng={**rng_state(), "stream": tracker.state_dict()},
            rank=acc.process_index,
            is_main=acc.is_main_process,
            barrier=acc.wait_for_everyone,
            keep=tc.keep_checkpoints,
        )

    def run_eval(row: dict) -> None:
        if cfg.data.eval:
            row["top1"] = evaluate(model, cfg.data.eval, cfg, acc)
            if ema is not None:
                row["top1_ema"] = evaluate(ema.module, cfg.data.eval, cfg, acc)

    log.info(
        "fine-tuning %d classes at %d px for %d steps, global batch %d, from %s",
        len(label_names),
        cfg.model.image_size,
        tc.steps,
        tc.batch_size,
        cfg.init.checkpoint or "random init",
    )
    model.train()
    watch, bar = Stopwatch(), progress_bar(tc.steps, start_step, acc.is_main_process)
    sums = torch.zeros(4, device=acc.device)  # loss, micro-steps, correct, seen
    last_log, row, bad_run, done, stopped = start_step, {}, 0, start_step, False
    for step in range(start_step, tc.steps):
        lr = warmup_cosine(step, tc.steps, tc.warmup_steps, tc.lr, tc.min_lr)
        set_lr(optimizer, lr)
        for _ in range(tc.grad_accum):
            t0 = time.perf_counter()
            batch = next(batches)
            tracker.update(batch)  # consumed batches only: the resume position
            watch.add("data", time.perf_counter() - t0)
            x = normalize_pixels(
                batch.images.to(acc.device, non_blocking=True), cfg.data.mean, cfg.data.std
            )
            y = batch.labels.to(acc.device, non_blocking=True)
            with acc.accumulate(model):
                logits = model(x)
                loss = F.cross_entropy(logits.float(), y)
                acc.backward(loss)
                if acc.sync_gradients:  # a non-finite gradient norm: the step is skipped
                    bad_run = 0 if apply_step(acc, model, optimizer, tc.grad_clip) else bad_run + 1
                optimizer.zero_grad(set_to_none=True)
            sums += torch.stack(
                [
                    loss.detach(),
                    torch.ones((), device=acc.device),
                    (logits.argmax(-1) == y).sum(),
                    torch.tensor(len(y)).to(y),
                ]
            )
        if bad_run >= tc.max_bad_steps:
            stop.close()
            sys.exit(
                f"error: {bad_run} steps in a row with a non-finite loss or gradient; stopping. "
                f"Last good checkpoint: {latest_valid_checkpoint(ckpt_dir)}"
            )
        if ema is not None and not bad_run:
            ema.update_parameters(raw)
        bar.update(1)
        done = step + 1
        if done % tc.log_every == 0 or done == tc.steps:
            elapsed, waits = watch.lap()
            loss_sum, n, correct, seen = acc.reduce(sums, reduction="sum").tolist()
            row = {
                "step": done,
                "loss": loss_sum / n,
                "train_acc": correct / seen,
                "lr": lr,
                "img_per_s": (done - last_log) * tc.batch_size / elapsed,
                "data_wait": waits.get("data", 0.0) / elapsed,
            }
            if cfg.eval_every and done % cfg.eval_every == 0 or done == tc.steps:
                with watch.paused():
                    run_eval(row)
            row = metrics.log(row)
            bar.write(format_metrics(row, SHOWN))
            sums.zero_()
            last_log = done
        if stop.agreed():  # preemption: every rank stops after the same step
            stopped = True
            break
        if tc.checkpoint_every and done % tc.checkpoint_every == 0 and done != tc.steps:
            if not bad_run:
                with watch.paused():
                    checkpoint(done)
    bar.close()
    stop.close()
    if stopped:
        checkpoint(done)
        log.info(
            "stopped by a signal after step %d; checkpoint written, resume with --resume", done
        )
        metrics.write_results({"step": done, "preempted": True})
        acc.end_training()
        return {"step": done, "preempted": True}

    # --- Final save: the fine-tuned classifier (safetensors) with its label names ---------
    checkpoint(tc.steps)
    results = {
        "step": tc.steps,
        "top1": row.get("top1"),
        "top1_ema": row.get("top1_ema"),
        "train_loss": row.get("loss"),
        "init": cfg.init.checkpoint or "random",
        "image_size": cfg.model.image_size,
        "wall_time_s": time.time() - t_start,
    }
    if acc.is_main_process:
        final = ema.module if ema is not None else raw
        tensors = {k: v.detach().contiguous().cpu() for k, v in final.state_dict().items()}
        save_file(
            tensors,
            str(run_dir / "model.safetensors"),
            metadata={
                "model_config": json.dumps(to_dict(cfg.model)),
                "pool": cfg.pool,
                "label_names": json.dumps(label_names),
            },
        )
        (run_dir / "labels.json").write_text(json.dumps(label_names, indent=1) + "\n")
    metrics.write_results(results)
    if acc.is_main_process:
        log.info("done: %s", format_metrics(results, ("top1", "top1_ema", "wall_time_s")))
    acc.end_training()
    return results


if __name__ == "__main__":
    main()
