"""Pretraining objectives: corruption of patch embeddings, colour targets, the loss."""

from ssl_vit.objectives.corruption import (
    KEPT,
    MASKED,
    RANDOM,
    UNTOUCHED,
    corrupt_patches,
    num_corrupted,
)
from ssl_vit.objectives.masked_patch import MaskedPatchOutput, MaskedPatchPrediction
from ssl_vit.objectives.targets import NUM_COLOR_CLASSES, color_class_to_rgb, mean_color_classes

__all__ = [
    "KEPT",
    "MASKED",
    "RANDOM",
    "UNTOUCHED",
    "NUM_COLOR_CLASSES",
    "MaskedPatchOutput",
    "MaskedPatchPrediction",
    "color_class_to_rgb",
    "corrupt_patches",
    "mean_color_classes",
    "num_corrupted",
]
