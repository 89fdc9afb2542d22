"""Prediction targets of masked patch prediction: the 3-bit mean colour of each patch.

Paper section 4.6: each patch's mean colour, each RGB channel quantized to 3 bits, is one of
512 classes. Computed on the un-normalized image in [0, 1], the same crop and flip the model
sees. Class = 64 * r + 8 * g + b with each channel `min(floor(mean * 8), 7)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["NUM_COLOR_CLASSES", "mean_color_classes", "color_class_to_rgb"]

BITS = 3
LEVELS = 2**BITS  # 8 levels per channel
NUM_COLOR_CLASSES = LEVELS**3  # 512


def _channel_levels(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[B, 3, H, W] -> [B, 3, H/P, W/P] quantized channel means in {0..7}."""
    H, W = images.shape[-2:]
    if H % patch_size or W % patch_size:
        raise ValueError(f"image size {(H, W)} is not a multiple of patch size {patch_size}")
    if images.dtype == torch.uint8:
        # Exact integer arithmetic for pixels k/255: floor(8 * sum / (255 * P^2)).
        # Integer sums are exact in float32 while below 2^24, i.e. 255 * P^2 for P <= 256.
        sums = F.avg_pool2d(images.float(), patch_size, divisor_override=1).to(torch.int64)
        return torch.clamp(LEVELS * sums // (255 * patch_size**2), max=LEVELS - 1)
    # Float images: float64 so that bin edges such as a mean of exactly 0.125 are exact.
    means = F.avg_pool2d(images.to(torch.float64), patch_size)
    return torch.floor(means * LEVELS).clamp_(0, LEVELS - 1).long()


def mean_color_classes(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """3-bit mean-colour class of every patch.

    Args:
        images: [B, 3, H, W], float in [0, 1] (or uint8 in [0, 255], computed exactly).
        patch_size: P; H and W must be multiples of it.

    Returns:
        LongTensor [B, N] with N = (H/P) * (W/P), patches in row-major order, values in [0, 512).
    """
    q_B3hw = _channel_levels(images, patch_size)
    classes_Bhw = q_B3hw[:, 0] * LEVELS**2 + q_B3hw[:, 1] * LEVELS + q_B3hw[:, 2]
    return classes_Bhw.flatten(1)


def color_class_to_rgb(classes: torch.Tensor) -> torch.Tensor:
    """Colour classes [...] -> bin-centre RGB in [0, 1], shape [..., 3] (for visualisation)."""
    r, g, b = classes // LEVELS**2, (classes // LEVELS) % LEVELS, classes % LEVELS
    return (torch.stack([r, g, b], dim=-1).float() + 0.5) / LEVELS
