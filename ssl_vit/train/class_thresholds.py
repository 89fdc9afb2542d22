"""Class-wise pseudo-label thresholds for the online stage (`distill.class_thresholds`):
FlexMatch's curriculum pseudo-labelling (Zhang et al. 2021, eq. 6-7), beyond the paper.

A fixed threshold keeps the pseudo-labels of the classes the teacher already knows and almost
never those it confuses (CIFAR-10 at 10% of the labels, threshold 0.7: 0.3% of the used
pseudo-labels are cats, 17% airplanes; docs/results.md), so the student learns more of what it
knows. FlexMatch scales each class's threshold by how well that class is learnt:

    sigma_c  = the number of unlabelled images the teacher labels c with confidence >= tau
    beta_c   = sigma_c / max_c sigma_c
    T_c      = beta_c / (2 - beta_c) x tau          (its convex mapping M(x) = x / (2 - x))

and a pseudo-label u counts where its confidence reaches T_{pseudo_u}. FlexMatch counts each
image's latest prediction over the whole unlabelled set; a stream has no per-image memory, so
sigma here is an exponential average of each step's counts (summed over the processes) with
the teacher's momentum, `distill.momentum`: its window, 1 / (1 - m) steps, is the teacher's.
beta is a ratio, so the average needs no bias correction. Before any confident pseudo-label
every class has tau (the fixed threshold). All on the device: no host sync; its state
(`sigma`, `thresholds`) is checkpointed with the teacher's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def class_counts(labels_N: torch.Tensor, classes: int, keep_N: torch.Tensor | None = None):
    """[K] how many of `labels_N` (where `keep_N`) are each class; labels outside [0, K) count
    nowhere. A comparison, not torch.bincount, which reads its input's maximum on the host (a
    sync per step)."""
    onehot_NK = labels_N[:, None] == torch.arange(classes, device=labels_N.device)
    return (onehot_NK if keep_N is None else onehot_NK & keep_N[:, None]).sum(0)


def flex_thresholds(sigma_K: torch.Tensor, tau: float) -> torch.Tensor:
    """[K] FlexMatch's class thresholds M(beta_c) x tau from the counts `sigma_K` (all tau
    while every count is 0)."""
    top = sigma_K.max()
    beta_K = torch.where(top > 0, sigma_K / top.clamp_min(1e-12), torch.ones_like(sigma_K))
    return beta_K / (2 - beta_K) * tau


class ClassThresholds(nn.Module):
    """The per-class thresholds and the counts they come from. The loop's calls: `add` per
    micro-batch (the teacher's confident pseudo-labels), `update` after each step."""

    def __init__(
        self, classes: int, tau: float, momentum: float, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.tau, self.momentum = tau, momentum
        self.register_buffer("sigma", torch.zeros(classes, device=device))
        self.register_buffer("thresholds", torch.full((classes,), tau, device=device))
        # This step's counts: zero at every step boundary, so not part of the state.
        self.register_buffer("step_counts", torch.zeros(classes, device=device), persistent=False)

    def add(self, pseudo_U: torch.Tensor, confidence_U: torch.Tensor) -> None:
        """Count a micro-batch's pseudo-labels whose confidence reaches tau, by class."""
        confident_K = class_counts(pseudo_U, len(self.sigma), confidence_U >= self.tau)
        self.step_counts += confident_K.to(self.step_counts.dtype)

    @torch.no_grad()
    def update(self, applied: torch.Tensor | bool, reduce: Callable[[torch.Tensor], torch.Tensor]):
        """After a step: its counts summed over the processes (`reduce`) join the average where
        the step applied (a skipped step's are dropped), and the thresholds follow."""
        applied = torch.as_tensor(applied, device=self.sigma.device)  # on the device: no sync
        m = self.momentum
        moved_K = m * self.sigma + (1 - m) * reduce(self.step_counts)
        self.sigma.copy_(torch.where(applied, moved_K, self.sigma))
        self.thresholds.copy_(flex_thresholds(self.sigma, self.tau))
        self.step_counts.zero_()
