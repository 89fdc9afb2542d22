"""Pixel normalization, done on the accelerator: loaders deliver uint8 (4x less to copy)."""

from __future__ import annotations

import torch

__all__ = ["normalize_pixels", "pixel_stats"]


def pixel_stats(
    mean: tuple[float, ...], std: tuple[float, ...], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) as float32 [3] tensors on `device`, for `normalize_pixels`. Build them once
    per job, not per batch: each build is a host-to-device copy of Python numbers."""
    return torch.tensor(mean, device=device), torch.tensor(std, device=device)


def normalize_pixels(
    images: torch.Tensor, mean: torch.Tensor | tuple, std: torch.Tensor | tuple
) -> torch.Tensor:
    """uint8 [B, 3, H, W] (or float in [0, 1]) -> float32 (x / 255 - mean) / std.
    `mean`, `std`: [3] tensors on the images' device (`pixel_stats`), or tuples (a copy per
    call)."""
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    mean = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    std = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std
