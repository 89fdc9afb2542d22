"""The run plan: every value a job derives from its config and the launch (processes, device),
derived and checked here once, right after the config is loaded and checked; every module reads
it instead of re-deriving.

`train.batch_size` is GLOBAL. It splits over `processes` x `grad_accum`:

    global_batch = processes x grad_accum x process_micro
    micro_batch  = processes x process_micro      (the global micro-batch: one forward pass)
    process_batch = grad_accum x process_micro    (one process, one optimizer step)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ssl_vit.config import ConfigError
from ssl_vit.config.checks import auto_num_workers, check_batch_memory

__all__ = ["RunPlan", "build_plan"]


@dataclass(frozen=True)
class RunPlan:
    """The derived values of a training run (a frozen record: read it, never patch it)."""

    processes: int
    global_batch: int  # train.batch_size: images per optimizer step, all processes
    grad_accum: int  # micro-steps per optimizer step (gradients summed)
    micro_batch: int  # the global micro-batch: one forward pass of every process together
    process_micro: int  # one process's micro-batch (its loader's batch)
    process_batch: int  # one process's images per optimizer step
    eval_batch: int  # one process's evaluation batch (the global batch split over processes)
    num_workers: int  # loader workers per process (data.num_workers, -1 resolved)
    mixed_precision: str  # what the Accelerator runs: 'no', 'bf16' or 'fp16' ('auto' resolved)
    device: str  # e.g. 'cuda:0' or 'cpu'
    paired: bool = False  # mixup / cutmix pair images of a micro-batch (BatchMixer)


def build_plan(
    cfg: Any, processes: int, *, mixed_precision: str = "no", device: str = "cpu"
) -> RunPlan:
    """The plan of `cfg` (a checked job config) on `processes` processes; an impossible split
    is one ConfigError line naming the key."""
    tc = cfg.train
    per_step = processes * tc.grad_accum
    if tc.batch_size % per_step:
        raise ConfigError(
            f"train.batch_size: {tc.batch_size} is not divisible by processes x grad_accum "
            f"= {processes} x {tc.grad_accum}"
        )
    micro = tc.batch_size // tc.grad_accum
    parts = getattr(cfg, "parts", None)
    paired = parts is not None and parts.mixes
    if paired and micro % 2:
        # Mixing pairs images within a lane's share of the micro-batch (BatchMixer); the
        # training stream checks that share once it has resolved its lanes.
        raise ConfigError(
            f"parts.mixup/cutmix: need an even batch per step, got train.batch_size / "
            f"train.grad_accum = {micro}"
        )
    distill = getattr(cfg, "distill", None)
    if distill is not None and distill.enabled:  # ratio x as many unlabelled images beside
        size = cfg.model.image_size
        check_batch_memory("distill.ratio", distill.ratio, tc.batch_size // per_step, size)
    return RunPlan(
        processes=processes,
        global_batch=tc.batch_size,
        grad_accum=tc.grad_accum,
        micro_batch=micro,
        process_micro=tc.batch_size // per_step,
        process_batch=tc.batch_size // processes,
        eval_batch=tc.batch_size // processes,
        num_workers=auto_num_workers(cfg.data.num_workers),
        mixed_precision=mixed_precision,
        device=device,
        paired=paired,
    )
