"""The training side of a fine-tuning recipe (ssl_vit.config.recipe): optimizer with layer-wise
lr decay, batch mixing (mixup / cutmix) and the loss that goes with the targets.

Shape legend: B batch, K classes, C channels, H, W image size.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit import seeds
from ssl_vit.config.optim import FinetuneOptimConfig
from ssl_vit.config.recipe import RecipeParts
from ssl_vit.train.optim import decay_exempt, fused_sgd, param_groups

__all__ = ["BatchMixer", "build_finetune_optimizer", "recipe_loss"]


def layer_decay_groups(model: nn.Module, weight_decay: float, layer_decay: float) -> list[dict]:
    """Parameter groups with `lr_scale` = layer_decay ** (depth + 1 - layer) (BEiT / MAE via
    timm's `param_groups_layer_decay` and the model's `group_matcher`): patch projection,
    [class] token and position embeddings are layer 0, block i is layer i + 1, the final norm
    and the head are layer depth + 1 (scale 1). Weight decay exempts what `param_groups` exempts.
    """
    from timm.optim import param_groups_layer_decay  # imported only with layer decay

    exempt = [n for n, p in model.named_parameters() if decay_exempt(n, p)]
    return param_groups_layer_decay(
        model, weight_decay, no_weight_decay_list=exempt, layer_decay=layer_decay
    )


def build_finetune_optimizer(
    model: nn.Module, parts: RecipeParts, cfg: FinetuneOptimConfig
) -> torch.optim.Optimizer:
    """SGD with momentum (the paper) or AdamW (decoupled decay), with layer-wise lr decay when
    `parts.layer_decay` < 1. The schedule's `set_lr` multiplies each group's `lr_scale`."""
    if parts.layer_decay < 1.0:
        groups = layer_decay_groups(model, cfg.weight_decay, parts.layer_decay)
    else:
        groups = param_groups(model, cfg.weight_decay)
    if parts.optimizer == "sgd":  # without layer decay: the paper's path (`optim.build_sgd`)
        return fused_sgd(groups, cfg)
    # The fused kernel where the build has one (CUDA, CPU); same update up to float rounding.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=True)


class BatchMixer:
    """Mixup / CutMix of a device batch (timm `Mixup`, batch mode: one lam per batch, label
    smoothing inside the soft targets), each image paired within its `group` of consecutive
    images: image i of a group with image group - 1 - i (timm pairs image i with B - 1 - i,
    which is the case of one group, `group` 0).

    The training stream gives each process whole lanes, so with `group` = a lane's share of the
    micro-batch (`TrainLoader.lane_share`, even: `resolve_lanes` checks it) every pair lies on
    one process and the mix of a micro-batch is the same on 1 or N processes. `lam`,
    mixup-or-cutmix and the box of micro-batch `index` are drawn on the host (no device sync) from
    `seeds.derive(seed, MIXUP, index)`: the same on every process, worker count and resume.
    timm draws from NumPy's global RNG, so it is seeded for the call and restored after (the
    caller's draws are untouched)."""

    def __init__(self, parts: RecipeParts, num_classes: int, seed: int = 0, group: int = 0):
        from timm.data import Mixup

        self.seed, self.group = seed, group
        self._orders: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self.mix = Mixup(
            mixup_alpha=parts.mixup,
            cutmix_alpha=parts.cutmix,
            prob=parts.mixup_prob,
            switch_prob=parts.switch_prob,
            mode="batch",
            label_smoothing=parts.label_smoothing,
            num_classes=num_classes,
        )

    def _order(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A permutation that puts each pair at places j and n - 1 - j, where timm pairs
        them, and its inverse (None: the identity, one group)."""
        group = self.group or n
        if group == n:  # timm's own pairing
            return None
        if n % group:
            raise ValueError(f"a batch of {n} images is not made of groups of {group}")
        if (n, device) not in self._orders:
            firsts = [g + i for g in range(0, n, group) for i in range(group // 2)]
            seconds = [g + group - 1 - i for g in range(0, n, group) for i in range(group // 2)]
            order = firsts + seconds[::-1]
            there = torch.tensor(order, device=device)
            back = torch.empty_like(there)
            back[there] = torch.arange(n, device=device)
            self._orders[n, device] = there, back
        return self._orders[n, device]

    def __call__(
        self, x_BCHW: torch.Tensor, y_B: torch.Tensor, index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixed images and soft targets [B, K] (each row sums to 1) of micro-batch `index`
        (step x grad_accum + micro-step); the images are mixed in place with one group."""
        order = self._order(len(x_BCHW), x_BCHW.device)
        if order is not None:
            x_BCHW, y_B = x_BCHW[order[0]], y_B[order[0]]
        outer = np.random.get_state()
        np.random.seed(seeds.derive(self.seed, seeds.MIXUP, index))
        try:
            x_BCHW, target_BK = self.mix(x_BCHW, y_B)
        finally:
            np.random.set_state(outer)
        if order is None:
            return x_BCHW, target_BK
        return x_BCHW[order[1]], target_BK[order[1]]


def recipe_loss(parts: RecipeParts) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """loss(logits [B, K] float, targets) for the recipe's targets: soft [B, K] with mixing
    (timm SoftTargetCrossEntropy), class indices [B] otherwise (cross-entropy, with label
    smoothing when set; the paper's plain cross-entropy at 0)."""
    if parts.mixes:
        from timm.loss import SoftTargetCrossEntropy

        return SoftTargetCrossEntropy()
    if parts.label_smoothing > 0:
        return partial(F.cross_entropy, label_smoothing=parts.label_smoothing)
    return F.cross_entropy
