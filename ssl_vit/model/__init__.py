"""Encoder modules: the ViT (built from a `ModelConfig`; its named variants are config data,
`ssl_vit.config.variants`), the fine-tuning classifier, position-embedding interpolation and pixel
normalization."""

from ssl_vit.model.classifier import Classifier
from ssl_vit.model.pixels import PixelNorm, normalize_pixels
from ssl_vit.model.pos_embed import interpolate_pos_embed
from ssl_vit.model.vit import ViT, build_vit

__all__ = [
    "Classifier",
    "ViT",
    "build_vit",
    "interpolate_pos_embed",
    "PixelNorm",
    "normalize_pixels",
]
