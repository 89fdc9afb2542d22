"""Polyak averaging (EMA) of a model's parameters, updated on the device without host syncs.

torch.optim.swa_utils.AveragedModel reads its update count on the host every update (`if
n_averaged == 0`: a sync per step); this one folds that test and the skip of a non-applied
optimizer step into the lerp weight, one `_foreach_lerp_` over all parameters. Its state dict
is AveragedModel's (`module.*`, `n_averaged`), so checkpoints load either way.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["EMA"]


class EMA(nn.Module):
    """`module`: a copy of the model whose parameters follow
    ema <- decay * ema + (1 - decay) * param after each applied step (the first applied step
    copies them, as AveragedModel does, unless `copy_first` is False: then the copy made here,
    the model's weights before training, is the average's start, as a mean teacher's is)."""

    def __init__(self, model: nn.Module, decay: float, copy_first: bool = True) -> None:
        super().__init__()
        self.module = copy.deepcopy(model).requires_grad_(False)
        self.decay = decay
        device = next(model.parameters()).device
        start = torch.tensor(0 if copy_first else 1, dtype=torch.long, device=device)
        self.register_buffer("n_averaged", start)

    @torch.no_grad()
    def update(self, model: nn.Module, applied: torch.Tensor | bool = True) -> None:
        """Average `model`'s parameters in; `applied` (bool tensor on the device): whether the
        optimizer step was applied, else nothing changes (weight 0)."""
        first = self.n_averaged == 0
        applied = torch.as_tensor(applied, device=self.n_averaged.device)
        # Weight 1 copies exactly (lerp's end - (end - start) * 0); weight 0 keeps exactly.
        weight = torch.where(first, 1.0, 1.0 - self.decay) * applied
        mine = list(self.module.parameters())
        theirs = [p.detach() for p in model.parameters()]
        torch._foreach_lerp_(mine, theirs, [weight] * len(mine))
        self.n_averaged += applied
