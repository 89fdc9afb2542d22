"""Learning-rate schedules as pure functions of the step (so resuming needs only the step)."""

from __future__ import annotations

import math

import torch

__all__ = ["warmup_cosine", "set_lr"]


def warmup_cosine(
    step: int, total_steps: int, warmup_steps: int, base_lr: float, min_lr: float = 0.0
) -> float:
    """Linear warmup from 0 to `base_lr` over `warmup_steps`, then cosine decay to `min_lr`
    at `total_steps`. `step` counts optimizer updates from 0; the lr of update `step`."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(progress, 1.0)
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
