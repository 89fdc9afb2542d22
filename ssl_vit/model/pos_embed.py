"""Resizing learned position embeddings to a new patch grid (paper section 3.2).

Shape legend: B batch (1 for a model's `pos_embed`), P prefix tokens ([class]), H x W the
patch grid in row-major order, D width.

Fine-tuning at a higher resolution keeps the patch size, so the sequence gets longer and the
pre-trained position embeddings no longer line up. The paper resizes them by 2D interpolation
according to their location in the original image; the prefix tokens have no location and are
kept as they are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["interpolate_pos_embed"]

_MODES = ("bilinear", "bicubic")


def _as_grid(grid: int | tuple[int, int], name: str) -> tuple[int, int]:
    """An int means a square grid; both sides must be positive."""
    h, w = (grid, grid) if isinstance(grid, int) else tuple(grid)
    if h <= 0 or w <= 0:
        raise ValueError(f"{name} must have positive sides, got {(h, w)}")
    return int(h), int(w)


def _old_grid(num_patches: int, old_grid: int | tuple[int, int] | None) -> tuple[int, int]:
    """The grid the embeddings were trained on: given, or the square root of their count."""
    if old_grid is None:
        side = math.isqrt(num_patches)
        if side * side != num_patches:
            raise ValueError(
                f"{num_patches} patch positions are not a perfect square; "
                "pass old_grid=(H, W) for a non-square grid"
            )
        return side, side
    h, w = _as_grid(old_grid, "old_grid")
    if h * w != num_patches:
        raise ValueError(
            f"old_grid={(h, w)} has {h * w} positions but pos_embed has {num_patches} "
            "after the prefix tokens"
        )
    return h, w


def interpolate_pos_embed(
    pos_embed: torch.Tensor,
    new_grid: int | tuple[int, int],
    num_prefix_tokens: int = 1,
    old_grid: int | tuple[int, int] | None = None,
    mode: str = "bicubic",
) -> torch.Tensor:
    """Resize the patch part of a position-embedding table to a new grid.

    Args:
        pos_embed: [B, P + H*W, D] (B is 1 for a model's table): P prefix tokens, then the
            patch positions in row-major order.
        new_grid: (H', W'), or an int for a square grid.
        num_prefix_tokens: P, the tokens without a location ([class]); kept unchanged.
        old_grid: (H, W) of `pos_embed`; None means square, H = W = sqrt(number of patches).
        mode: "bilinear" or "bicubic" (`F.interpolate`, align_corners=False, no antialias).

    Returns:
        [B, P + H'*W', D] in the input's dtype. When the grid is unchanged the input tensor
        itself is returned, so the values are bitwise identical.

    Raises:
        ValueError: unknown mode, wrong rank, or sizes that do not match the grids.
    """
    if mode not in _MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {_MODES}")
    if pos_embed.ndim != 3:
        raise ValueError(f"pos_embed must be [B, P + H*W, D], got shape {tuple(pos_embed.shape)}")
    if not 0 <= num_prefix_tokens <= pos_embed.shape[1]:
        raise ValueError(
            f"num_prefix_tokens={num_prefix_tokens} out of range for a sequence of "
            f"{pos_embed.shape[1]}"
        )
    B, T, D = pos_embed.shape
    H, W = _old_grid(T - num_prefix_tokens, old_grid)
    new_H, new_W = _as_grid(new_grid, "new_grid")
    if (new_H, new_W) == (H, W):
        return pos_embed

    prefix_BPD = pos_embed[:, :num_prefix_tokens]
    # Image layout [B, D, H, W] so that the interpolation follows location in the image.
    grid_BDHW = pos_embed[:, num_prefix_tokens:].reshape(B, H, W, D).permute(0, 3, 1, 2)
    # float32 because bicubic is not implemented for half types on every device, and so that
    # a low-precision table is rounded only once, at the end.
    grid_BDHW = F.interpolate(
        grid_BDHW.float(), size=(new_H, new_W), mode=mode, align_corners=False, antialias=False
    )
    grid_BND = grid_BDHW.permute(0, 2, 3, 1).reshape(B, new_H * new_W, D).to(pos_embed.dtype)
    return torch.cat([prefix_BPD, grid_BND], dim=1)
