"""Taking models out of and into ssl-vit: export a checkpoint's encoder or a fine-tuned
classifier as timm / transformers weights with a model card, import timm / transformers weights
as an ssl-vit encoder."""

from ssl_vit.publish.export import export_checkpoint, import_weights
from ssl_vit.publish.export_classifier import export_classifier, is_classifier

__all__ = [
    "export_checkpoint",
    "export_classifier",
    "import_weights",
    "is_classifier",
]
