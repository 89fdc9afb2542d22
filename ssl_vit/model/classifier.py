"""Fine-tuning model: the encoder plus one zero-initialized D x K linear head (paper 3.2)."""

from __future__ import annotations

import torch
from torch import nn

from ssl_vit.errors import ConfigError
from ssl_vit.model.pixels import PixelNorm
from ssl_vit.model.vit import ViT

__all__ = ["Classifier"]


class Classifier(nn.Module):
    """Encoder -> pooled representation ([class] token or mean of patches) -> linear head.

    The head's weights and bias start at zero (paper section 3.2), so the first logits are
    all zero and the first gradients reach the encoder only through the head's update.
    `pixels`: the input normalization (the fine-tuning job's data.mean / data.std), so that the
    model takes the loaders' uint8 images; None: images come normalized."""

    def __init__(
        self, encoder: ViT, num_classes: int, pool: str = "cls", pixels: PixelNorm | None = None
    ) -> None:
        super().__init__()
        self.pixels = pixels
        if pool not in ("cls", "gap"):
            raise ConfigError(f"unknown pooling '{pool}' (use 'cls' or 'gap')")
        self.encoder = encoder
        self.pool = pool
        self.head = nn.Linear(encoder.width, num_classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter layers for timm's `param_groups_layer_decay`: the embeddings are the stem
        (layer 0), block i is layer i + 1, the final norm and the head are one layer after the
        blocks (as MAE's `get_layer_id_for_vit`; timm's own ViT puts the norm with the last
        block: its ordinal (99999,) means "the previous group's layer")."""
        return {
            "stem": r"^encoder\.(?:cls_token|pos_embed|patch_embed)",
            "blocks": [
                (r"^encoder\.blocks\.(\d+)", None),
                (r"^(?:encoder\.norm|head)\.", (100000,)),
            ],
        }

    def forward(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] (uint8 / [0, 1] with `pixels`, else normalized) -> logits [B, K]."""
        x_BCHW = images_BCHW if self.pixels is None else self.pixels(images_BCHW)
        return self.head(self.encoder(x_BCHW, self.pool))
