"""Pixel normalization, done on the accelerator: loaders deliver uint8 (4x less to copy).

`PixelNorm` is the one place it happens: the first stage of the pretraining objective, of the
fine-tuning classifier and of frozen feature extraction (`eval.readouts.frozen_forward`).
`pixel_norm_problem` is the one check of statistics read from a file: a std of 0 or a NaN mean
would make every input NaN, and every prediction the same.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ssl_vit.config.pixels import PIXEL_NORM

__all__ = ["PixelNorm", "normalize_pixels", "pixel_norm_problem"]


def pixel_norm_problem(mean: Any, std: Any) -> str | None:
    """What makes (`mean`, `std`), read from an untrusted file, unusable as a pixel
    normalisation (3 finite numbers each, every std > 0), or None."""
    for key, value in (("mean", mean), ("std", std)):
        if not isinstance(value, list | tuple) or len(value) != 3 or not all(map(_number, value)):
            return f"{key} must be 3 numbers, got {value!r}"
        if not all(map(math.isfinite, value)):
            return f"{key} must be finite, got {list(value)}"
    if min(std) <= 0:
        return f"std must be > 0 (it divides), got {list(std)}"
    return None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def normalize_pixels(
    images: torch.Tensor, mean: torch.Tensor | tuple, std: torch.Tensor | tuple
) -> torch.Tensor:
    """uint8 [B, 3, H, W] (or float in [0, 1]) -> float32 (x / 255 - mean) / std.
    `mean`, `std`: [3] tensors on the images' device, or tuples (a copy per call)."""
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    mean = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    std = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


class PixelNorm(nn.Module):
    """uint8 [B, 3, H, W] (or float in [0, 1]) -> float32 (x / 255 - mean) / std. The
    statistics are buffers (moved with the module, built once: no host-to-device copy per
    batch) and not saved: checkpoints hold no pixel statistics (the config does)."""

    def __init__(
        self,
        mean: tuple[float, float, float] = PIXEL_NORM,
        std: tuple[float, float, float] = PIXEL_NORM,
    ) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return normalize_pixels(images, self.mean, self.std)
