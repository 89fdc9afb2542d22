"""Distribution alignment of the online stage's pseudo-labels (`distill.align`): ReMixMatch's
(Berthelot et al. 2020, section 3.2), beyond the paper.

A teacher that knows some classes better than others is confident mostly on those: CIFAR-10 at
10% of the labels, threshold 0.7, 0.3% of the used pseudo-labels are cats and 17% airplanes
(docs/results.md), so the student is taught the classes it already knows. FlexMatch's class
thresholds (`class_thresholds`) answer by letting less confident pseudo-labels in, about half
of them wrong there. Distribution alignment changes the teacher's probabilities instead: each
image's are scaled by how much rarer the teacher makes each class than the labelled images are,

    q_u = normalise(p_u x p_L / p_U)

where p_L is the labelled images' class frequencies and p_U the teacher's mean prediction on
the unlabelled images; the pseudo-label is q_u's argmax, its confidence q_u's maximum. So an
image the teacher half-believes to be a cat, a class it predicts too seldom, can pass the
threshold, and one of a class it over-predicts needs more. ReMixMatch averages p_U over the
last 128 batches; here both means are exponential averages over steps with that window
(`WINDOW`), of the labelled stream's labels and the teacher's softmax summed over the
processes, starting from equal shares (no scaling until the data say otherwise). On the device,
no host sync; its state (`labelled`, `unlabelled`, `scale`) is checkpointed with the teacher's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ssl_vit.train.class_thresholds import class_counts, moved

WINDOW = 128  # steps: ReMixMatch's running average of the teacher's predictions


def aligned(probs_UK: torch.Tensor, scale_K: torch.Tensor) -> torch.Tensor:
    """[U, K] each row of `probs_UK` scaled by `scale_K` (p_L / p_U) and renormalised."""
    q_UK = probs_UK * scale_K
    return q_UK / q_UK.sum(-1, keepdim=True)


class Alignment(nn.Module):
    """The two class distributions and the scale they give. The loop's calls: `add` per
    micro-batch (its labels and the teacher's summed softmax), `update` after each step."""

    def __init__(self, classes: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.momentum = 1 - 1 / WINDOW
        equal = torch.full((classes,), 1 / classes, device=device)
        self.register_buffer("labelled", equal.clone())  # p_L
        self.register_buffer("unlabelled", equal.clone())  # p_U
        self.register_buffer("scale", torch.ones(classes, device=device))  # p_L / p_U
        # This step's sums, [2, K + 1]: labelled then unlabelled, each K class sums and a count.
        # Zero at every step boundary, so not part of the state.
        sums = torch.zeros(2, classes + 1, device=device)
        self.register_buffer("step_sums", sums, persistent=False)

    def add(self, labels_B: torch.Tensor, teacher_sum_K: torch.Tensor, images_U: int) -> None:
        """A micro-batch's labelled classes (labels outside [0, K) are not counted) and the
        teacher's softmax summed over its `images_U` unlabelled images."""
        counts_K = class_counts(labels_B, len(self.scale)).to(self.step_sums.dtype)
        self.step_sums[0, :-1] += counts_K
        self.step_sums[0, -1] += counts_K.sum()
        self.step_sums[1, :-1] += teacher_sum_K.to(self.step_sums.dtype)
        self.step_sums[1, -1] += images_U

    @torch.no_grad()
    def update(self, applied: torch.Tensor | bool, reduce: Callable[[torch.Tensor], torch.Tensor]):
        """After a step: its sums over the processes (`reduce`, one all-reduce) join the two
        averages where the step applied (a skipped step's are dropped), and the scale follows."""
        applied = torch.as_tensor(applied, device=self.scale.device)  # on the device: no sync
        sums = reduce(self.step_sums)
        for mean_K, row in ((self.labelled, sums[0]), (self.unlabelled, sums[1])):
            seen = applied & (row[-1] > 0)  # a step with no image of this kind moves nothing
            mean_K.copy_(moved(mean_K, row[:-1] / row[-1].clamp_min(1), seen, self.momentum))
        self.scale.copy_(self.labelled / self.unlabelled.clamp_min(1e-6))
        self.step_sums.zero_()
