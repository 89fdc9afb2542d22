"""Self-training on the unlabelled images (beyond the paper): a fine-tuned classifier, the
teacher, labels them softly and the student fits those targets besides the labelled images'
true labels. SimCLRv2's distillation loss (Chen et al. 2020, eq. 2): the cross-entropy of the
student's temperature-scaled softmax against the teacher's, on the same augmented images.

Shape legend: B labelled images, U unlabelled images, K classes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DistillLoss", "distill_forward", "distillation_loss", "frozen_teacher"]


def distillation_loss(
    student_UK: torch.Tensor, teacher_UK: torch.Tensor, temperature: float
) -> torch.Tensor:
    """mean over images of -sum_k softmax(teacher / T)_k log softmax(student / T)_k."""
    target_UK = F.softmax(teacher_UK.float() / temperature, dim=-1)
    return -(target_UK * F.log_softmax(student_UK.float() / temperature, dim=-1)).sum(-1).mean()


def frozen_teacher(teacher: nn.Module, device: torch.device) -> nn.Module:
    """The teacher on `device`, in eval mode (no dropout, drop path off) with no parameter
    that asks for a gradient: the step's backward and optimizer never reach it."""
    teacher = teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


class DistillLoss(NamedTuple):
    loss: torch.Tensor  # labelled cross-entropy + weight x distillation (what is minimised)
    logits: torch.Tensor  # [B, K] the student's on the labelled images
    labelled: torch.Tensor  # the labelled part of the loss
    distill: torch.Tensor  # the distillation part
    agree: torch.Tensor  # unlabelled images whose student top-1 is the teacher's (a count)


def distill_forward(
    model: nn.Module,
    teacher: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    temperature: float,
    weight: float,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], DistillLoss]:
    """forward+loss of one micro-batch: labelled images (uint8, or mixed [0, 1]) with their
    targets, and unlabelled images (uint8). The student sees both in one forward pass; the
    teacher only the unlabelled ones, under no_grad, in the same (compiled) region."""

    def forward_loss(images_B, targets, unlabelled_U) -> DistillLoss:
        if images_B.dtype != unlabelled_U.dtype:  # mixed labelled images are [0, 1] floats
            unlabelled_U = unlabelled_U.float() / 255.0
        logits = model(torch.cat([images_B, unlabelled_U]))
        logits_B, student_UK = logits[: len(images_B)], logits[len(images_B) :]
        with torch.no_grad():
            teacher_UK = teacher(unlabelled_U)
        labelled = loss_fn(logits_B.float(), targets)
        distill = distillation_loss(student_UK, teacher_UK, temperature)
        agree = (student_UK.argmax(-1) == teacher_UK.argmax(-1)).sum()
        return DistillLoss(labelled + weight * distill, logits_B, labelled, distill, agree)

    return forward_loss
