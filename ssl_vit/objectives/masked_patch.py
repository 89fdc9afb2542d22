"""Masked patch prediction: corrupt patch embeddings, predict a target of each corrupted patch
from its own output token (paper section 4.6, appendix B.1.2).

Targets (`objective.target`, see objectives.targets): `mean_color` (one 512-way class per
patch, the paper's main choice), `color_4x4` (16 parallel 512-way classes, the 3-bit mean
colours of a 4x4 grid of cells) and `pixels_l2` (the patch's pixels, mean squared error).
Options beyond the paper (objectives.decoder): `decoder_depth` >= 1 puts a prediction decoder
between the encoder and the head; `encoder: visible` (MAE's arm) leaves the chosen patches out
of the encoder and gives the decoder [mask] tokens there. decoder_depth=0 with `encoder: all`
is the paper's objective, bit for bit.

Shape legend: B batch, N patches, n corrupted patches per image, M = B * n, D width (E: the
decoder's, when there is one),
K = 512 colour classes, C = 4 cells per side, X = P * P * 3 pixel values of a patch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.config.pixels import PIXEL_NORM
from ssl_vit.config.schema import ObjectiveConfig
from ssl_vit.errors import ConfigError
from ssl_vit.model.pixels import PixelNorm
from ssl_vit.model.vit import ViT
from ssl_vit.objectives import corruption
from ssl_vit.objectives.corruption import MASKED, UNTOUCHED
from ssl_vit.objectives.decoder import PredictionDecoder, encode_visible, split_visible
from ssl_vit.objectives.targets import (
    NUM_COLOR_CLASSES,
    cell_bounds,
    cell_color_classes,
    mean_color_classes,
    normalize_patches,
    patch_pixels,
    pixels_to_mean_color,
)

__all__ = ["CELLS", "MaskedPatchOutput", "MaskedPatchPrediction"]

CELLS = 4  # color_4x4: cells per patch side


@dataclass
class MaskedPatchOutput:
    """Loss and detached statistics of one step (tensors: no host sync until logged)."""

    loss: torch.Tensor  # scalar: mean cross-entropy (colour targets) or MSE (pixels_l2)
    # Head outputs of the corrupted patches (detached): [M, K] for mean_color, [M, C*C, K]
    # for color_4x4, predicted pixels [M, X] for pixels_l2.
    logits: torch.Tensor
    targets: torch.Tensor  # [M] / [M, C*C] colour classes, or [M, X] target pixels
    kind: torch.Tensor  # [B, N] corruption kinds (see objectives.corruption)
    # Colour predictions that were right: classes (or cells) for the classifiers; for
    # pixels_l2 the 3-bit mean colour of the predicted pixels against the patch's. None where
    # not measurable (pixels_l2 with per-patch normalization: the predicted mean is 0).
    correct: torch.Tensor | None
    color_targets: torch.Tensor  # [M] or [M, C*C] colour classes the accuracy is scored on

    def kind_counts(self) -> torch.Tensor:
        """[4] patches per kind: untouched, masked, random, kept."""
        # index_add_, not bincount: bincount reads its output size on the host (a sync on GPU).
        kind = self.kind.flatten()
        return torch.zeros(4, dtype=torch.long, device=kind.device).index_add_(
            0, kind, torch.ones_like(kind)
        )


def _head_size(target: str, patch_size: int) -> int:
    if target == "mean_color":
        return NUM_COLOR_CLASSES
    if target == "color_4x4":
        cell_bounds(patch_size, CELLS)  # raises for patches smaller than the cell grid
        return CELLS * CELLS * NUM_COLOR_CLASSES
    if target == "pixels_l2":
        return patch_size * patch_size * 3
    raise ConfigError(f"unknown objective target {target!r}")


class MaskedPatchPrediction(nn.Module):
    """Encoder + [mask] embedding + (optional decoder) + linear head for the chosen target. The
    head, the decoder and the [mask] embedding belong to the objective: fine-tuning, few-shot and
    export drop them and keep `encoder`."""

    def __init__(
        self,
        encoder: ViT,
        cfg: ObjectiveConfig,
        mean: tuple[float, float, float] = PIXEL_NORM,
        std: tuple[float, float, float] = PIXEL_NORM,
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.cfg = cfg
        # Created only when asked for, so that decoder_depth=0 draws the same initial weights.
        self.decoder = None
        if cfg.decoder_depth:
            width, heads = cfg.decoder_shape(encoder.width, encoder.blocks[0].attn.heads)
            self.decoder = PredictionDecoder(
                encoder.width, width, cfg.decoder_depth, heads, encoder.num_patches
            )
        head_in = encoder.width if self.decoder is None else self.decoder.embed.out_features
        # [mask] is an encoder input (the paper), or a decoder input in the visible arm (MAE).
        mask_width = head_in if cfg.encoder == "visible" else encoder.width
        self.mask_embedding = nn.Parameter(torch.empty(mask_width))
        self.head = nn.Linear(head_in, _head_size(cfg.target, encoder.patch_size))
        self.pixels = PixelNorm(mean, std)  # after the targets, taken from [0, 1] pixels
        nn.init.trunc_normal_(self.mask_embedding, std=0.02)
        # Zero head: uniform prediction at step 0 (loss = ln 512), or black pixels for L2.
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @property
    def num_corrupted(self) -> int:
        return corruption.num_corrupted(self.encoder.num_patches, self.cfg.mask_ratio)

    def targets(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(targets, colour classes), each [B, N, ...], of every patch (see MaskedPatchOutput)."""
        P = self.encoder.patch_size
        if self.cfg.target == "color_4x4":
            cells_BNc = cell_color_classes(images, P, CELLS)
            return cells_BNc, cells_BNc
        colors_BN = mean_color_classes(images, P)
        if self.cfg.target == "pixels_l2":
            return patch_pixels(images, P), colors_BN
        return colors_BN, colors_BN

    def draw_noise(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """[3, B, N] corruption draws for `forward`, on the model's device (see
        objectives.corruption.draw_corruption): made outside `forward`, so that `forward` is
        one graph under torch.compile."""
        device = self.mask_embedding.device
        return corruption.draw_corruption(batch_size, self.encoder.num_patches, generator, device)

    def forward(self, images: torch.Tensor, noise: torch.Tensor) -> MaskedPatchOutput:
        """images: [B, 3, H, W] uint8 (or float in [0, 1]), un-normalized, already augmented;
        noise: [3, B, N] corruption draws (`draw_noise`)."""
        targets_BN, colors_BN = self.targets(images)
        x_BCHW = self.pixels(images)

        emb_BND = self.encoder.embed_patches(x_BCHW)
        if self.cfg.encoder == "visible":
            out_BND, kind_BN, idx_Bn = self._visible_arm(emb_BND, noise)
        else:
            corrupted_BND, kind_BN = corruption.corrupt_patches(
                emb_BND, self.mask_embedding, noise, self.cfg.mask_ratio, self.cfg.probs
            )
            out_BTD = self.encoder.encode(corrupted_BND)
            out_BND = (out_BTD if self.decoder is None else self.decoder(out_BTD))[:, 1:]

            # Exactly n patches per image are corrupted, so their positions are the first n of
            # a stable sort that puts corrupted before untouched: a static-shape gather, no sync.
            n = self.num_corrupted
            idx_Bn = (kind_BN == 0).to(torch.uint8).argsort(dim=1, stable=True)[:, :n]
        picked_BnD = _gather(out_BND, idx_Bn)
        preds_MX = self.head(picked_BnD).flatten(0, 1)  # head on corrupted patches only
        targets_M = _gather(targets_BN, idx_Bn).flatten(0, 1)
        colors_M = _gather(colors_BN, idx_Bn).flatten(0, 1)
        loss, preds_MX, correct = self._loss(preds_MX, targets_M, colors_M)
        return MaskedPatchOutput(loss, preds_MX, targets_M, kind_BN, correct, colors_M)

    def _visible_arm(self, emb_BND, noise):
        """MAE's arm: the encoder sees the N - n kept patches only, the decoder their outputs
        and [mask] tokens at the n others. -> (decoder output [B, N, E], kind [B, N]: MASKED at
        the n left-out patches, UNTOUCHED elsewhere, their indices [B, n] ascending)."""
        masked_Bn, keep_Bk = split_visible(noise[0], self.num_corrupted)
        vis_BKD = encode_visible(self.encoder, emb_BND, keep_Bk)
        out_BTE = self.decoder.forward_visible(vis_BKD, keep_Bk, self.mask_embedding)
        kind_BN = torch.full(emb_BND.shape[:2], UNTOUCHED, device=emb_BND.device)
        kind_BN = kind_BN.scatter(1, masked_Bn, MASKED)
        return out_BTE[:, 1:], kind_BN, masked_Bn

    def _loss(self, preds_MX, targets_M, colors_M):
        """(loss, detached predictions in the output's shape, correct colour predictions)."""
        if self.cfg.target == "pixels_l2":
            # Regression on [0, 1] pixels (or per-patch normalized ones), in float32.
            target_MX = normalize_patches(targets_M) if self.cfg.normalize_pixels else targets_M
            loss = F.mse_loss(preds_MX.float(), target_MX)
            preds_MX = preds_MX.detach()
            correct = None
            if not self.cfg.normalize_pixels:
                correct = (pixels_to_mean_color(preds_MX) == colors_M).sum()
            return loss, preds_MX, correct
        logits = preds_MX.unflatten(-1, (-1, NUM_COLOR_CLASSES)).squeeze(-2)  # [M, K]/[M,CC,K]
        loss = F.cross_entropy(logits.flatten(0, -2).float(), targets_M.flatten())
        logits = logits.detach()
        return loss, logits, (logits.argmax(dim=-1) == targets_M).sum()


def _gather(x_BN: torch.Tensor, idx_Bn: torch.Tensor) -> torch.Tensor:
    """x [B, N, ...] at positions idx [B, n] of each image -> [B, n, ...]."""
    trailing = x_BN.shape[2:]
    idx = idx_Bn.view(*idx_Bn.shape, *([1] * len(trailing))).expand(-1, -1, *trailing)
    return x_BN.gather(1, idx)
