"""The baseline of scripts/bench.py: a timm `VisionTransformer` of the same shape driven by the
masked-prediction step a timm user would write (timm is a benchmark-only dependency).

The loss definition is ours exactly (same targets, same corruption of the patch embeddings, a
512-way head on the corrupted tokens only), so the benchmark compares the models and the steps,
not two objectives. `copy_weights` makes the two models numerically the same function.

Shape legend: B batch, N patches, n corrupted patches per image, D width, K = 512 classes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.model.pixels import PixelNorm
from ssl_vit.objectives import NUM_COLOR_CLASSES, MaskedPatchPrediction
from ssl_vit.objectives.corruption import corrupt_patches, draw_corruption, num_corrupted
from ssl_vit.objectives.targets import mean_color_classes

__all__ = ["TimmMaskedPatch", "copy_weights"]


class TimmMaskedPatch(nn.Module):
    """timm ViT (its defaults: fused attention, exact GELU) + [mask] embedding + colour head."""

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        width: int,
        depth: int,
        heads: int,
        mlp_ratio: float = 4.0,
        mask_ratio: float = 0.5,
        probs: tuple[float, float, float] = (0.8, 0.1, 0.1),
    ) -> None:
        super().__init__()
        from timm.models.vision_transformer import VisionTransformer

        self.vit = VisionTransformer(
            img_size=image_size,
            patch_size=patch_size,
            embed_dim=width,
            depth=depth,
            num_heads=heads,
            mlp_ratio=mlp_ratio,
            num_classes=0,
        )
        self.patch_size, self.mask_ratio, self.probs = patch_size, mask_ratio, probs
        self.mask_embedding = nn.Parameter(torch.zeros(width))
        self.head = nn.Linear(width, NUM_COLOR_CLASSES)
        self.pixels = PixelNorm()  # as the pipeline's data.mean / data.std defaults

    def draw_noise(self, batch_size: int, generator: torch.Generator | None = None):
        """[3, B, N] corruption draws, as MaskedPatchPrediction.draw_noise."""
        num_patches = self.vit.patch_embed.num_patches
        return draw_corruption(batch_size, num_patches, generator, self.mask_embedding.device)

    def forward(self, images: torch.Tensor, noise: torch.Tensor):
        """images: uint8 [B, 3, H, W], noise [3, B, N] -> scalar mean cross-entropy over
        corrupted patches."""
        targets_BN = mean_color_classes(images, self.patch_size)
        x = self.pixels(images)
        emb_BND = self.vit.patch_embed(x)  # mask applied to the patch embeddings
        corrupted_BND, kind_BN = corrupt_patches(
            emb_BND, self.mask_embedding, noise, self.mask_ratio, self.probs
        )
        x = self.vit.norm_pre(self.vit._pos_embed(corrupted_BND))
        out_BND = self.vit.norm(self.vit.blocks(x))[:, 1:]
        n = num_corrupted(kind_BN.shape[1], self.mask_ratio)
        idx_Bn = (kind_BN == 0).to(torch.uint8).argsort(dim=1, stable=True)[:, :n]
        picked_BnD = out_BND.gather(1, idx_Bn.unsqueeze(-1).expand(-1, -1, out_BND.shape[-1]))
        logits_MK = self.head(picked_BnD).flatten(0, 1)
        return F.cross_entropy(logits_MK.float(), targets_BN.gather(1, idx_Bn).flatten())


@torch.no_grad()
def copy_weights(ours: MaskedPatchPrediction, theirs: TimmMaskedPatch) -> None:
    """Load our parameters into the timm baseline (same layout, renamed)."""
    enc, vit = ours.encoder, theirs.vit
    pairs = [
        (vit.patch_embed.proj, enc.patch_embed),
        (vit.norm, enc.norm),
        (theirs.head, ours.head),
    ]
    for tb, ob in zip(vit.blocks, enc.blocks, strict=True):
        pairs += [
            (tb.norm1, ob.norm1),
            (tb.attn.qkv, ob.attn.qkv),
            (tb.attn.proj, ob.attn.proj),
            (tb.norm2, ob.norm2),
            (tb.mlp.fc1, ob.mlp[0]),
            (tb.mlp.fc2, ob.mlp[2]),
        ]
    for t, o in pairs:
        t.weight.copy_(o.weight)
        t.bias.copy_(o.bias)
    vit.cls_token.copy_(enc.cls_token)
    vit.pos_embed.copy_(enc.pos_embed)
    theirs.mask_embedding.copy_(ours.mask_embedding)
