"""Masked patch prediction: corrupt patch embeddings, predict each corrupted patch's 3-bit
mean colour from its own output token (paper section 4.6, appendix B.1.2).

Shape legend: B batch, N patches, n corrupted patches per image, D width, K = 512 classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.config.schema import ObjectiveConfig
from ssl_vit.model.pixels import normalize_pixels
from ssl_vit.model.vit import ViT
from ssl_vit.objectives.corruption import corrupt_patches, num_corrupted
from ssl_vit.objectives.targets import NUM_COLOR_CLASSES, mean_color_classes

__all__ = ["MaskedPatchOutput", "MaskedPatchPrediction"]


@dataclass
class MaskedPatchOutput:
    """Loss and detached statistics of one step (tensors: no host sync until logged)."""

    loss: torch.Tensor  # scalar, mean cross-entropy over corrupted patches
    logits: torch.Tensor  # [B * n, K] (detached)
    targets: torch.Tensor  # [B * n] colour classes of the corrupted patches
    kind: torch.Tensor  # [B, N] corruption kinds (see objectives.corruption)
    correct: torch.Tensor  # number of corrupted patches whose colour was predicted right

    def kind_counts(self) -> torch.Tensor:
        """[4] patches per kind: untouched, masked, random, kept."""
        return torch.bincount(self.kind.flatten(), minlength=4)


class MaskedPatchPrediction(nn.Module):
    """Encoder + [mask] embedding + linear 512-way colour head. The head and the [mask]
    embedding belong to the objective: fine-tuning drops them and keeps `encoder`."""

    def __init__(
        self,
        encoder: ViT,
        cfg: ObjectiveConfig,
        mean: tuple[float, float, float] = (0.5, 0.5, 0.5),
        std: tuple[float, float, float] = (0.5, 0.5, 0.5),
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.cfg = cfg
        self.mask_embedding = nn.Parameter(torch.empty(encoder.width))
        self.head = nn.Linear(encoder.width, NUM_COLOR_CLASSES)
        self.register_buffer("pixel_mean", torch.tensor(mean), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(std), persistent=False)
        nn.init.trunc_normal_(self.mask_embedding, std=0.02)
        nn.init.zeros_(self.head.weight)  # uniform prediction at step 0: loss = ln 512
        nn.init.zeros_(self.head.bias)

    @property
    def num_corrupted(self) -> int:
        return num_corrupted(self.encoder.num_patches, self.cfg.mask_ratio)

    def forward(
        self, images: torch.Tensor, generator: torch.Generator | None = None
    ) -> MaskedPatchOutput:
        """images: [B, 3, H, W] uint8 (or float in [0, 1]), un-normalized, already augmented."""
        targets_BN = mean_color_classes(images, self.encoder.patch_size)
        x_BCHW = normalize_pixels(images, self.pixel_mean, self.pixel_std)

        emb_BND = self.encoder.embed_patches(x_BCHW)
        corrupted_BND, kind_BN = corrupt_patches(
            emb_BND, self.mask_embedding, self.cfg.mask_ratio, self.cfg.probs, generator
        )
        out_BND = self.encoder.encode(corrupted_BND)[:, 1:]

        # Exactly n patches per image are corrupted, so their positions are the first n of a
        # stable sort that puts corrupted before untouched: a gather of static shape, no sync.
        n = self.num_corrupted
        idx_Bn = (kind_BN == 0).to(torch.uint8).argsort(dim=1, stable=True)[:, :n]
        picked_BnD = out_BND.gather(1, idx_Bn.unsqueeze(-1).expand(-1, -1, out_BND.shape[-1]))
        logits_MK = self.head(picked_BnD).flatten(0, 1)  # logits of corrupted patches only
        targets_M = targets_BN.gather(1, idx_Bn).flatten()

        loss = F.cross_entropy(logits_MK.float(), targets_M)
        logits_MK = logits_MK.detach()
        correct = (logits_MK.argmax(dim=-1) == targets_M).sum()
        return MaskedPatchOutput(loss, logits_MK, targets_M, kind_BN, correct)
