"""Taking models out of and into ssl-vit: export a checkpoint's encoder or a fine-tuned
classifier as timm / transformers weights with a model card, import timm / transformers weights
as an ssl-vit encoder."""

from ssl_vit.publish.export import export_checkpoint, import_weights
from ssl_vit.publish.export_classifier import export_classifier, export_model, export_source

__all__ = [
    "export_checkpoint",
    "export_classifier",
    "export_model",
    "export_source",
    "import_weights",
]
