"""Optimizers with the usual no-weight-decay set (biases, norms, embeddings, tokens)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ssl_vit.config.schema import OptimConfig

__all__ = ["apply_step", "decay_exempt", "param_groups", "build_adam", "build_sgd"]


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
    cores 7x faster than the default for-loop update; same update up to float rounding)."""
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, fused=True
    )


def build_sgd(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """SGD with momentum (paper B.1.1 fine-tuning), no weight decay by default."""
    return torch.optim.SGD(param_groups(model, cfg.weight_decay), lr=cfg.lr, momentum=cfg.momentum)


def apply_step(acc, model: nn.Module, optimizer, grad_clip: float) -> bool:
    """Clip and apply the optimizer step unless the gradient norm is not finite; returns
    whether it was applied.

    The norm is taken after the gradient all-reduce, so every rank sees the same value and
    skips the same steps. Reading it is one host sync per step, as in AMP's GradScaler."""
    norm = acc.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    finite = math.isfinite(float(norm))
    if finite or acc.scaler is not None:  # fp16: the scaler skips the step and lowers the scale
        optimizer.step()
    return finite
