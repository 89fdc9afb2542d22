"""Class-wise pseudo-label thresholds for the online stage, beyond the paper, in two forms:
FlexMatch's curriculum pseudo-labelling (`distill.class_thresholds`, Zhang et al. 2021, eq.
6-7: `ClassThresholds`) and class-balanced self-training's top share of each class
(`distill.class_share`, Zou et al. 2018, section 4.2: `ClassShares`, below).

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

FlexMatch lowers a class's threshold by how *few* confident pseudo-labels it gets, so at 10% of
the labels it let in nine classes at 0.05-0.38, half of those labels wrong (docs/results.md).
Class-balanced self-training (CBST) lowers it only as far as the teacher's own confidence on
that class requires: each class keeps at least the top `share` of the teacher's predictions of
it, its most confident ones,

    T_c = min(tau, q_c),   q_c = the confidence above which the top `share` of the
                                 teacher's predictions of class c lie

so a class the teacher is sure of keeps tau, and one it is never sure of (cats) still teaches
its best `share`. CBST sorts a whole round's predictions; a stream keeps instead a histogram of
each class's confidences (`BINS` bins on [0, 1]), averaged over steps like sigma above, and q_c
is read off it at a bin edge (so at least `share` is kept). With tau = 1 it is CBST's rule
itself: the same top share of every class. Its state (`hist`, `thresholds`) is checkpointed
with the teacher's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

BINS = 100  # of the teacher's confidence, on [0, 1]: q_c to within 0.01


def class_counts(labels_N: torch.Tensor, classes: int, keep_N: torch.Tensor | None = None):
    """[K] how many of `labels_N` (where `keep_N`) are each class; labels outside [0, K) count
    nowhere. A comparison, not torch.bincount, which reads its input's maximum on the host (a
    sync per step)."""
    onehot_NK = labels_N[:, None] == torch.arange(classes, device=labels_N.device)
    return (onehot_NK if keep_N is None else onehot_NK & keep_N[:, None]).sum(0)


def moved(average: torch.Tensor, step: torch.Tensor, applied, momentum: float) -> torch.Tensor:
    """`average` moved toward this step's statistic `step` (already summed over the
    processes) at `momentum`, where `applied` (a skipped step's are dropped): the one
    moving-average rule of FlexMatch's counts, the class shares' histograms and alignment's
    distributions. The flag stays on the device: no sync."""
    applied = torch.as_tensor(applied, device=average.device)
    return torch.where(applied, momentum * average + (1 - momentum) * step, average)


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
        self.sigma.copy_(moved(self.sigma, reduce(self.step_counts), applied, self.momentum))
        self.thresholds.copy_(flex_thresholds(self.sigma, self.tau))
        self.step_counts.zero_()


def bin_edges(bins: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B] the lower edges of `bins` equal bins on [0, 1]: a confidence's bin and the threshold
    read from the histogram are the same float, so a pseudo-label in the threshold's bin passes."""
    return torch.arange(bins, device=device) / bins


def share_thresholds(hist_KB: torch.Tensor, share: float, tau: float) -> torch.Tensor:
    """[K] min(tau, q_c): q_c the lower edge of the highest bin of class c's confidence
    histogram `hist_KB` at and above which lies at least `share` of its mass (tau for a class
    with none)."""
    tail_KB = hist_KB.flip(1).cumsum(1).flip(1)  # the mass at or above each bin's lower edge
    total_K = tail_KB[:, 0]
    reach_KB = tail_KB >= share * total_K[:, None]  # non-increasing in the bin: a prefix
    edge_K = bin_edges(hist_KB.shape[1], hist_KB.device)[reach_KB.sum(1) - 1]
    return torch.where(total_K > 0, edge_K.clamp_max(tau), torch.full_like(edge_K, tau))


class ClassShares(nn.Module):
    """CBST's per-class thresholds and the confidence histograms they come from; the loop's
    calls as `ClassThresholds`': `add` per micro-batch (every pseudo-label, not only the
    confident ones), `update` after each step."""

    def __init__(
        self,
        classes: int,
        tau: float,
        share: float,
        momentum: float,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.tau, self.share, self.momentum = tau, share, momentum
        self.register_buffer("hist", torch.zeros(classes, BINS, device=device))
        self.register_buffer("thresholds", torch.full((classes,), tau, device=device))
        # This step's histogram: zero at every step boundary, so not part of the state.
        step_KB = torch.zeros(classes, BINS, device=device)
        self.register_buffer("step_hist", step_KB, persistent=False)
        self.register_buffer("edges", bin_edges(BINS, device), persistent=False)

    def add(self, pseudo_U: torch.Tensor, confidence_U: torch.Tensor) -> None:
        """Count a micro-batch's pseudo-labels by class and confidence bin: the last edge at or
        below it (bucketize and index_add, not bincount: no host read)."""
        bin_U = torch.bucketize(confidence_U.detach(), self.edges, right=True) - 1
        bin_U = bin_U.clamp_(0, BINS - 1)  # a NaN (a step that will be skipped): anywhere
        ones_U = torch.ones_like(confidence_U, dtype=self.step_hist.dtype)
        self.step_hist.view(-1).index_add_(0, pseudo_U * BINS + bin_U, ones_U)

    @torch.no_grad()
    def update(self, applied: torch.Tensor | bool, reduce: Callable[[torch.Tensor], torch.Tensor]):
        """After a step: its histogram summed over the processes (`reduce`) joins the average
        where the step applied, and the thresholds follow (as `ClassThresholds.update`)."""
        self.hist.copy_(moved(self.hist, reduce(self.step_hist), applied, self.momentum))
        self.thresholds.copy_(share_thresholds(self.hist, self.share, self.tau))
        self.step_hist.zero_()
