"""Taking encoders out of and into ssl-vit: export a checkpoint as timm / transformers weights
with a model card, import timm / transformers weights as an ssl-vit encoder."""

from ssl_vit.publish.export import export_checkpoint, import_weights
from ssl_vit.publish.model_card import model_card

__all__ = ["export_checkpoint", "import_weights", "model_card"]
