"""The ViT encoder (paper section 3.1): patch projection, [class] token, learnable 1D position
embeddings, pre-LayerNorm blocks (multi-head self-attention + GELU MLP), final LayerNorm.

Shape legend: B batch, N patches, T = 1 + N tokens, D width, H heads, C channels.
The encoder is split at the point where masked patch prediction corrupts its input:
`embed_patches` (projection only) -> [objective corrupts here] -> `encode` (class token,
position embeddings, blocks). Fine-tuning and few-shot use `forward_features` + `pool`;
`forward_features(x, layers=...)` returns the chosen blocks' outputs from one pass (frozen
readouts below the last block).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.config.schema import ModelConfig
from ssl_vit.errors import ConfigError

__all__ = ["POOLS", "Attention", "Block", "ViT", "build_vit", "resolve_layers"]

# Image representations `ViT.pool` knows: [class] token, mean of patches, both concatenated.
POOLS = ("cls", "gap", "cls+gap")


def resolve_layers(layers: int | Sequence[int], depth: int) -> list[int]:
    """Block indices (negative counts from the end, as in Python) -> sorted unique indices in
    [0, depth). ValueError naming the index when one is out of range."""
    wanted = [layers] if isinstance(layers, int) else list(layers)
    if not wanted:
        raise ConfigError("layers: empty")
    for i in wanted:
        if not -depth <= i < depth:
            raise ConfigError(f"layer {i}: out of range for depth {depth} ({-depth}..{depth - 1})")
    return sorted({i % depth for i in wanted})


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ConfigError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        qkv = self.qkv(x_BTD).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        # Fused attention (flash / memory-efficient kernels on GPU).
        out_BHTd = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(out_BHTd.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    """Pre-LN Transformer block: x + MSA(LN(x)), then x + MLP(LN(x)) (paper eq. 2-3).

    `set_drop_path(p)`, p > 0: stochastic depth (Huang et al. 2016), in training each sample's
    residual branch is dropped with that probability (timm DropPath, kept ones scaled by
    1/(1-p)); at 0 (as built) the branch is added as is (identity, no random draw)."""

    def __init__(
        self,
        width: int,
        heads: int,
        mlp_ratio: float = 4.0,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        hidden = int(width * mlp_ratio)
        self.norm1 = nn.LayerNorm(width, eps=norm_eps)
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width, eps=norm_eps)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
        self.set_drop_path(0.0)

    def set_drop_path(self, rate: float) -> None:
        if rate > 0:
            from timm.layers import DropPath  # only when asked for: importing timm takes ~1 s

            self.drop_path = DropPath(rate)
        else:
            self.drop_path = nn.Identity()

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.drop_path(self.attn(self.norm1(x_BTD)))
        return x_BTD + self.drop_path(self.mlp(self.norm2(x_BTD)))


class ViT(nn.Module):
    """Vision Transformer encoder without a classification head."""

    def __init__(
        self,
        image_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        width: int = 768,
        depth: int = 12,
        heads: int = 12,
        mlp_ratio: float = 4.0,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
        if h % patch_size or w % patch_size:
            raise ConfigError(f"image size {(h, w)} is not a multiple of patch size {patch_size}")
        self.image_size = (h, w)
        self.patch_size = patch_size
        self.grid = (h // patch_size, w // patch_size)
        self.num_patches = self.grid[0] * self.grid[1]
        self.width = width
        # Flatten each PxP patch and project it linearly: a conv with kernel = stride = P is
        # exactly that matmul, laid out the way timm and big_vision store it.
        self.patch_embed = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + self.num_patches, width))
        self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio, norm_eps) for _ in range(depth))
        # 1e-6 as in big_vision / timm; weights imported from elsewhere keep their own value
        # (Hugging Face ViTs use 1e-12), so that their features are reproduced exactly.
        self.norm = nn.LayerNorm(width, eps=norm_eps)
        self.init_weights()

    def set_drop_path(self, rate: float) -> None:
        """Stochastic depth for fine-tuning: block i drops its residual branches with
        probability rate * i / (depth - 1) (linear from 0 to `rate`, as timm and MAE); 0: off."""
        depth = len(self.blocks)
        for i, block in enumerate(self.blocks):
            block.set_drop_path(rate * i / max(depth - 1, 1))

    def init_weights(self) -> None:
        """big_vision / timm-jax scheme: xavier-uniform linears with zero bias, LeCun-normal
        patch projection, N(0, 0.02) position embeddings, zero [class] token."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        fan_in = 3 * self.patch_size**2
        nn.init.trunc_normal_(self.patch_embed.weight, std=1.0 / math.sqrt(fan_in))
        nn.init.zeros_(self.patch_embed.bias)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.zeros_(self.cls_token)

    def embed_patches(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        """Linear projection of the patches, row-major order: [B, 3, H, W] -> [B, N, D]."""
        return self.patch_embed(images_BCHW).flatten(2).transpose(1, 2)

    def encode(self, emb_BND: torch.Tensor) -> torch.Tensor:
        """[class] token + position embeddings + blocks + final LN: [B, N, D] -> [B, 1 + N, D]."""
        return self.encode_layers(emb_BND, [len(self.blocks) - 1])[0]

    def encode_layers(self, emb_BND: torch.Tensor, layers: Sequence[int]) -> list[torch.Tensor]:
        """The outputs [B, 1 + N, D] of blocks `layers` (sorted indices in [0, depth)), one pass
        that stops after the deepest one asked for. The last block's output goes through the
        final LN (it is `encode`'s output); the others are the residual stream as it leaves
        the block (the final LN belongs to the last block's readout, as in timm's
        `forward_intermediates(norm=False)`)."""
        cls_B1D = self.cls_token.expand(emb_BND.shape[0], -1, -1)
        x_BTD = torch.cat([cls_B1D, emb_BND], dim=1) + self.pos_embed
        last, wanted, out = len(self.blocks) - 1, set(layers), []
        for i, block in enumerate(self.blocks[: max(layers) + 1]):
            x_BTD = block(x_BTD)
            if i in wanted:
                out.append(self.norm(x_BTD) if i == last else x_BTD)
        return out

    def forward_features(
        self, images_BCHW: torch.Tensor, layers: int | Sequence[int] | None = None
    ) -> torch.Tensor | list[torch.Tensor]:
        """[B, 3, H, W] normalized images -> all output tokens [B, 1 + N, D]; with `layers`
        (block indices, negative from the end) the list of those blocks' outputs, in
        increasing block order, from one forward pass (see `encode_layers`)."""
        emb_BND = self.embed_patches(images_BCHW)
        if layers is None:
            return self.encode(emb_BND)
        return self.encode_layers(emb_BND, resolve_layers(layers, len(self.blocks)))

    @staticmethod
    def pool(tokens_BTD: torch.Tensor, how: str = "cls") -> torch.Tensor:
        """Image representation: the [class] token output [B, D], the mean of patch outputs
        [B, D], or both concatenated (`cls+gap`, [B, 2D])."""
        if how == "cls":
            return tokens_BTD[:, 0]
        if how == "gap":
            return tokens_BTD[:, 1:].mean(dim=1)
        if how == "cls+gap":
            return torch.cat([tokens_BTD[:, 0], tokens_BTD[:, 1:].mean(dim=1)], dim=-1)
        raise ConfigError(f"unknown pooling '{how}' (use one of {', '.join(POOLS)})")

    def forward(self, images_BCHW: torch.Tensor, pool: str = "cls") -> torch.Tensor:
        return self.pool(self.forward_features(images_BCHW), pool)


def build_vit(cfg: ModelConfig) -> ViT:
    """The encoder described by a (validated) ModelConfig: the one constructor, for new models
    and saved ones alike (`ModelConfig.from_saved(metadata)`)."""
    missing = [k for k in ("patch_size", "width", "depth", "heads") if getattr(cfg, k) is None]
    if missing:
        raise ConfigError(f"model: set model.variant or model.{', model.'.join(missing)}")
    return ViT(
        cfg.image_size,
        cfg.patch_size,
        cfg.width,
        cfg.depth,
        cfg.heads,
        cfg.mlp_ratio,
        cfg.norm_eps,
    )
