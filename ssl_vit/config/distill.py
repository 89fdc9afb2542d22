"""The `distill` section of fine-tuning: training on the unlabelled images too (beyond the
paper), `offline` (self-training: a fixed fine-tuned teacher, SimCLRv2) or `online`
(semi-supervised: the student's own EMA as the teacher, FixMatch). How each works: the module
docstring of `train/distill.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ssl_vit.config.checks import check_fraction, check_min, check_positive
from ssl_vit.config.frozen import Frozen
from ssl_vit.errors import ConfigError

__all__ = ["DistillConfig"]


@dataclass
class DistillConfig(Frozen):
    """Off unless `unlabelled` is set."""

    # `offline`: a fixed fine-tuned teacher (`teacher`); `online`: the student's own EMA.
    mode: Literal["offline", "online"] = "offline"
    # offline: a fine-tuned classifier: a fine-tuning run directory or its model.safetensors.
    teacher: str = ""
    # The unlabelled images: any source (labels, if it has any, only score the pseudo-labels).
    unlabelled: str = ""
    # offline: softmax temperature of teacher and student on the unlabelled images (SimCLRv2: 1).
    temperature: float = 1.0
    # Weight of the unlabelled loss; the labelled cross-entropy has weight 1 (FixMatch: 1).
    weight: float = 1.0
    # Unlabelled images per labelled image in each micro-batch (FixMatch's mu: 7).
    ratio: int = 1
    # online: the teacher's weights follow the student's, t <- m t + (1 - m) s after each
    # applied step. Semi-ViT uses 0.9999 over 100k+ steps; the window 1 / (1 - m) steps must be
    # well inside the run (0.99 is a 100-step window for a run of a few hundred steps).
    momentum: float = 0.999
    # online: a pseudo-label counts where the teacher's softmax maximum is at least this
    # (FixMatch: 0.95; Semi-ViT: 0.7-0.9); below it the image adds nothing to the loss.
    threshold: float = 0.95
    # online: RandAugment-style ops per strong view and their largest magnitude (of 10).
    strong_ops: int = 2
    strong_magnitude: int = 10
    # What the teacher sees: `same`, the student's augmented image (SimCLRv2); `weak_strong`,
    # the image only resized while the student sees it randomly cropped and flipped (on the
    # device, at data.crop_scale): the teacher's targets are its best guesses and the student
    # must reach them from harder views (FixMatch's weak / strong views, Sohn et al. 2020).
    views: Literal["same", "weak_strong"] = "same"
    # online: Semi-ViT's probabilistic pseudo-mixup (Cai et al. 2022, section 3.3): each
    # strong view is blended with another's in proportion to the two pseudo-labels'
    # confidences, and trained toward the same blend of the two pseudo-labels.
    mixup: bool = False
    # online: FlexMatch's class-wise thresholds (Zhang et al. 2021; ssl_vit.train.class_thresholds):
    # each class's is distill.threshold scaled down by how seldom the teacher is confident in
    # it, so the classes it confuses are taught too (a fixed threshold keeps mostly the ones
    # it knows).
    class_thresholds: bool = False
    # online: class-balanced self-training (Zou et al. 2018; ssl_vit.train.class_thresholds):
    # each class keeps at least this top share of the teacher's predictions of it, its threshold
    # lowered from distill.threshold as far as that needs (distill.threshold=1: exactly the
    # share of every class). 0: off.
    class_share: float = 0.0
    # online: ReMixMatch's distribution alignment (Berthelot et al. 2020; ssl_vit.train.align):
    # the teacher's probabilities are scaled by the labelled images' class frequencies over its
    # mean prediction before the pseudo-labels are taken, so a class it predicts too seldom
    # passes the threshold more often (the threshold and its pseudo-labels are not lowered).
    align: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.unlabelled.strip())

    @property
    def online(self) -> bool:
        return self.enabled and self.mode == "online"

    def validate(self) -> None:
        check_positive("distill.", self, ("temperature", "ratio", "strong_ops"))
        check_min("distill.", self, ("weight",), 0)
        check_fraction("distill.momentum", self.momentum, low_open=False)
        check_fraction("distill.threshold", self.threshold)
        if not 0 <= self.strong_magnitude <= 10:
            raise ConfigError(
                f"distill.strong_magnitude={self.strong_magnitude}: give 0 to 10 (RandAugment's)"
            )
        teacher = bool(self.teacher.strip())
        if self.mode == "offline" and teacher != self.enabled:
            raise ConfigError(
                "distill.teacher and distill.unlabelled: give both (self-training) or neither"
            )
        if not 0 <= self.class_share <= 1:
            raise ConfigError(f"distill.class_share={self.class_share}: give 0 (off) to 1")
        if self.class_share and self.class_thresholds:
            raise ConfigError(
                "distill.class_share and distill.class_thresholds: both set the thresholds per "
                "class; give one"
            )
        for key in ("mixup", "class_thresholds", "class_share", "align"):
            if getattr(self, key) and self.mode != "online":
                raise ConfigError(
                    f"distill.{key}: acts on pseudo-labels, which only distill.mode=online "
                    "makes; drop it or set distill.mode=online"
                )
        if self.mode == "online" and teacher:
            raise ConfigError(
                "distill.teacher: distill.mode=online has no fixed teacher (its teacher is the "
                "student's moving average); drop distill.teacher or use distill.mode=offline"
            )
