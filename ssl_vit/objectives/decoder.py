"""A prediction decoder between the encoder and the masked-prediction head (MAE, He et al.
2021, sec. 3 and Table 1), and the encoder pass over the visible patches only (MAE's arm).

Without a decoder the encoder's last blocks learn to predict colours and its top features lose
their semantics (issue 22; MAE Table 1a: linear probe 59.6 with mask tokens in the encoder and
no decoder, 73.5 with an 8-block decoder). The decoder belongs to the objective like the head
and the [mask] embedding: fine-tuning, few-shot and export keep the encoder only.

Shape legend: B batch, N patches per image, n predicted (masked) patches per image, k = N - n
visible patches, T = 1 + N tokens, K = 1 + k tokens of the visible arm's encoder, D encoder
width, E decoder width.
"""

from __future__ import annotations

import torch
from torch import nn

from ssl_vit.model.vit import Block, ViT

__all__ = ["PredictionDecoder", "encode_visible", "split_visible"]


class PredictionDecoder(nn.Module):
    """Linear D -> E, its own learned position embeddings (T x E), `depth` pre-LN blocks and its
    own final LayerNorm: [B, T, D] encoder tokens -> [B, T, E]. With `mask_embedding` set (the
    visible arm) it first puts the visible tokens back at their positions and [mask] tokens of
    width E at the others (`forward_visible`)."""

    def __init__(
        self,
        in_width: int,
        width: int,
        depth: int,
        heads: int,
        num_patches: int,
    ) -> None:
        super().__init__()
        self.num_patches = num_patches
        self.embed = nn.Linear(in_width, width)
        # Learned like the encoder's (MAE fixes 2D sin-cos ones here; both are position codes
        # the encoder's do not share, so the decoder can re-place tokens it receives).
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + num_patches, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))  # MLP 4x, eps 1e-6
        self.norm = nn.LayerNorm(width, eps=1e-6)
        # The encoder's scheme: xavier-uniform linears, zero biases, N(0, 0.02) positions.
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, tokens_BTD: torch.Tensor) -> torch.Tensor:
        """Encoder output tokens [B, T, D] ([class] first, patches in order) -> [B, T, E]."""
        return self._blocks(self.embed(tokens_BTD))

    def forward_visible(
        self, tokens_BKD: torch.Tensor, keep_Bk: torch.Tensor, mask_embedding_E: torch.Tensor
    ) -> torch.Tensor:
        """Encoder output of the visible patches [B, 1 + k, D] (the [class] token first, then
        patches `keep_Bk` [B, k] in that order) -> [B, T, E]: every patch position filled, the
        visible ones with their projected token, the others with `mask_embedding_E` [E]."""
        x_BKE = self.embed(tokens_BKD)
        cls_B1E, vis_BkE = x_BKE[:, :1], x_BKE[:, 1:]
        B, k, E = vis_BkE.shape
        full_BNE = mask_embedding_E.to(vis_BkE.dtype).expand(B, self.num_patches, E)
        # A scatter of static shape (exactly k per image): no host sync, one graph.
        full_BNE = full_BNE.scatter(1, keep_Bk.unsqueeze(-1).expand(-1, -1, E), vis_BkE)
        return self._blocks(torch.cat([cls_B1E, full_BNE], dim=1))

    def _blocks(self, x_BTE: torch.Tensor) -> torch.Tensor:
        x_BTE = x_BTE + self.pos_embed
        for block in self.blocks:
            x_BTE = block(x_BTE)
        return self.norm(x_BTE)


def split_visible(noise_BN: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The visible arm's choice, from the corruption's first draw [B, N] (the one whose argsort
    chooses the corrupted patches in `corrupt_patches`): (masked [B, n], kept [B, N - n]) patch
    indices, each sorted ascending. Exactly n per image, static shapes."""
    order_BN = noise_BN.argsort(dim=1)
    masked_Bn, _ = order_BN[:, :n].sort(dim=1)
    keep_Bk, _ = order_BN[:, n:].sort(dim=1)
    return masked_Bn, keep_Bk


def encode_visible(encoder: ViT, emb_BND: torch.Tensor, keep_Bk: torch.Tensor) -> torch.Tensor:
    """The encoder over the [class] token and the kept patches only: patch embeddings [B, N, D]
    -> [B, 1 + k, D], each patch with its own position embedding (as `ViT.encode_layers` adds
    them), then the blocks and the final LayerNorm."""
    pos_1TD = encoder.pos_embed
    x_BND = emb_BND + pos_1TD[:, 1:]
    x_BkD = x_BND.gather(1, keep_Bk.unsqueeze(-1).expand(-1, -1, x_BND.shape[-1]))
    cls_B1D = (encoder.cls_token + pos_1TD[:, :1]).expand(x_BkD.shape[0], -1, -1)
    x_BKD = torch.cat([cls_B1D, x_BkD], dim=1)
    for block in encoder.blocks:
        x_BKD = block(x_BKD)
    return encoder.norm(x_BKD)
