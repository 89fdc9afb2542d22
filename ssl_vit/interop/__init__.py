"""Weights in other libraries' layouts: timm `VisionTransformer` and Hugging Face `ViTModel`.

Pure key and shape mapping (torch only, neither library is imported here), used in both
directions: `to_timm` / `to_hf` for export (an encoder, or a fine-tuned classifier with its
head), `read_foreign` for import (encoders only). Exporting and importing
whole checkpoints (files, model cards) is `ssl_vit.publish`.
"""

from ssl_vit.interop.foreign import detect_format, foreign_pixel_norm, read_foreign
from ssl_vit.interop.hf_format import (
    from_hf,
    hf_classifier_config,
    hf_config,
    hf_preprocessor,
    to_hf,
)
from ssl_vit.interop.keymap import InteropError
from ssl_vit.interop.timm_format import from_timm, timm_config, to_timm

__all__ = [
    "InteropError",
    "detect_format",
    "foreign_pixel_norm",
    "from_hf",
    "from_timm",
    "hf_classifier_config",
    "hf_config",
    "hf_preprocessor",
    "read_foreign",
    "timm_config",
    "to_hf",
    "to_timm",
]
