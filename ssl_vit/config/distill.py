"""The `distill` section of fine-tuning: self-training on the unlabelled images (beyond the
paper). A fine-tuned classifier (the teacher) labels the unlabelled images softly, on the same
augmented images the student sees, and the student fits those targets besides the labelled
micro-batch's true labels (SimCLRv2's distillation loss, Chen et al. 2020, section 2.3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ssl_vit.config.checks import check_min, check_positive
from ssl_vit.config.frozen import Frozen
from ssl_vit.errors import ConfigError

__all__ = ["DistillConfig"]


@dataclass
class DistillConfig(Frozen):
    """Off unless `teacher` is set."""

    # A fine-tuned classifier: a fine-tuning run directory or its model.safetensors.
    teacher: str = ""
    # The unlabelled images: any source (labels, if it has any, are ignored).
    unlabelled: str = ""
    # Softmax temperature of teacher and student on the unlabelled images (SimCLRv2: 1).
    temperature: float = 1.0
    # Weight of the distillation loss; the labelled cross-entropy has weight 1.
    weight: float = 1.0
    # Unlabelled images per labelled image in each micro-batch.
    ratio: int = 1
    # What the teacher sees: `same`, the student's augmented image (SimCLRv2); `weak_strong`,
    # the image only resized while the student sees it randomly cropped and flipped (on the
    # device, at data.crop_scale): the teacher's targets are its best guesses and the student
    # must reach them from harder views (FixMatch's weak / strong views, Sohn et al. 2020).
    views: Literal["same", "weak_strong"] = "same"

    @property
    def enabled(self) -> bool:
        return bool(self.teacher.strip())

    def validate(self) -> None:
        check_positive("distill.", self, ("temperature", "ratio"))
        check_min("distill.", self, ("weight",), 0)
        if self.enabled != bool(self.unlabelled.strip()):
            raise ConfigError(
                "distill.teacher and distill.unlabelled: give both (self-training) or neither"
            )
