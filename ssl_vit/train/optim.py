"""Optimizers with the usual no-weight-decay set (biases, norms, embeddings, tokens), and the
optimizer step that skips a non-finite gradient on the device (no host sync)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from ssl_vit.config.optim import FinetuneOptimConfig, OptimConfig

__all__ = ["apply_step", "decay_exempt", "param_groups", "build_adam", "build_sgd", "fused_sgd"]


def decay_exempt(name: str, p: torch.Tensor) -> bool:
    """1-D parameters (biases, LayerNorm) and the position embedding / [class] / [mask]
    embeddings get no weight decay, as in big_vision and timm."""
    return p.ndim <= 1 or name.endswith(("pos_embed", "cls_token", "mask_embedding"))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay only weight matrices; what `decay_exempt` names is exempt."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if decay_exempt(name, p) else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_adam(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Adam (paper B.1.2); with weight_decay > 0 it is decoupled (AdamW). The fused kernel on
    GPU and CPU alike: one pass over each parameter instead of ~10 elementwise ops (on 2 CPU
    cores 7x faster than the default for-loop update; same update up to float rounding), and
    it skips a step on the device when told to (`found_inf`, see `apply_step`)."""
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, fused=True
    )


def build_sgd(model: nn.Module, cfg: FinetuneOptimConfig) -> torch.optim.Optimizer:
    """SGD with momentum (paper B.1.1 fine-tuning), no weight decay by default."""
    return fused_sgd(param_groups(model, cfg.weight_decay), cfg)


def fused_sgd(groups: list[dict], cfg: FinetuneOptimConfig) -> torch.optim.Optimizer:
    """SGD over `groups`, fused (one kernel per parameter group, GPU and CPU) so that a step is
    skipped on the device (`apply_step`).
    The momentum buffers start at zero instead of being created by the first step: a first
    step that is skipped would otherwise leave them uninitialized (the fused kernel returns
    before writing them). Without dampening the first update is the same: 0 * m + g = g."""
    opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=True)
    if cfg.momentum > 0:
        for group in opt.param_groups:
            for p in group["params"]:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return opt


class Applied(NamedTuple):
    """An optimizer step's outcome, on the device."""

    applied: torch.Tensor  # bool scalar: False when the gradient norm was not finite
    norm: torch.Tensor  # the gradients' global norm before clipping (what the log shows)


def apply_step(acc, model: nn.Module, optimizer, grad_clip: float) -> Applied:
    """Clip the gradients and apply the optimizer step unless their norm is not finite.
    Returns whether the step was applied and the norm, both on the device. `acc`: the job's
    Accelerator (its clip and fp16 scaler), or None for one process without a scaler.

    No host sync: the norm stays on the device and the fused optimizer kernel reads the skip
    flag there (`found_inf`, the attribute AMP's GradScaler sets for optimizers with
    `_step_supports_amp_scaling`), leaving parameters, moments, momentum buffers and step
    counters untouched. The norm is taken after the gradient all-reduce, so every rank sees
    the same value and skips the same steps. With fp16 the scaler sets `found_inf` itself
    (inf/NaN gradients, the same steps) and lowers its scale."""
    clip = nn.utils.clip_grad_norm_ if acc is None else acc.clip_grad_norm_
    norm = clip(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    finite = torch.isfinite(norm)
    if acc is None or acc.scaler is None:
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds it
        if not getattr(inner, "_step_supports_amp_scaling", False):
            raise TypeError(f"{type(inner).__name__} cannot skip a step on the device: fused=True")
        inner.found_inf = (~finite).float()
        try:
            optimizer.step()
        finally:
            del inner.found_inf
    else:
        optimizer.step()
    return Applied(finite, norm.detach())
