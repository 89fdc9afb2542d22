"""ssl-vit: masked patch prediction pretraining for Vision Transformers.

The public API used by jobs and outside code; everything else lives in the sub-packages
(`model`, `objectives`, `train`, `data`, `eval`).
"""

from ssl_vit.eval.fewshot import ridge_accuracies
from ssl_vit.model.pos_embed import interpolate_pos_embed
from ssl_vit.model.vit import ViT, build_vit
from ssl_vit.objectives.corruption import corrupt_patches
from ssl_vit.objectives.masked_patch import MaskedPatchPrediction
from ssl_vit.objectives.targets import cell_color_classes, mean_color_classes, patch_pixels

__all__ = [
    "MaskedPatchPrediction",
    "ViT",
    "build_vit",
    "cell_color_classes",
    "corrupt_patches",
    "ridge_accuracies",
    "interpolate_pos_embed",
    "mean_color_classes",
    "patch_pixels",
]
__version__ = "0.1.0"
