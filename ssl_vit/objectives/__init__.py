"""Pretraining objectives: corruption of patch embeddings, colour targets, the optional
prediction decoder, the loss."""

from ssl_vit.objectives.corruption import (
    KEPT,
    MASKED,
    RANDOM,
    UNTOUCHED,
    corrupt_patches,
    draw_corruption,
    num_corrupted,
)
from ssl_vit.objectives.decoder import PredictionDecoder
from ssl_vit.objectives.masked_patch import CELLS, MaskedPatchOutput, MaskedPatchPrediction
from ssl_vit.objectives.targets import (
    NUM_COLOR_CLASSES,
    cell_color_classes,
    color_class_to_rgb,
    mean_color_classes,
    patch_pixels,
)

__all__ = [
    "KEPT",
    "MASKED",
    "RANDOM",
    "UNTOUCHED",
    "CELLS",
    "NUM_COLOR_CLASSES",
    "MaskedPatchOutput",
    "MaskedPatchPrediction",
    "PredictionDecoder",
    "cell_color_classes",
    "color_class_to_rgb",
    "corrupt_patches",
    "draw_corruption",
    "mean_color_classes",
    "num_corrupted",
    "patch_pixels",
]
