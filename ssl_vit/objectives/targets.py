"""Prediction targets of masked patch prediction (paper section 4.6, appendix B.1.2).

Three targets, all taken from the un-normalized image in [0, 1] (the same crop and flip the
model sees):

- `mean_color_classes`: each patch's mean colour, each RGB channel quantized to 3 bits, one of
  512 classes. Class = 64 * r + 8 * g + b with each channel `min(floor(mean * 8), 7)`.
- `cell_color_classes`: the patch cut into C x C cells (C = 4: the paper's "4x4 downsized
  patch"), each cell's 3-bit mean colour class. Cell i of a side of P pixels covers pixels
  [floor(i * P / C), floor((i + 1) * P / C)): every pixel belongs to exactly one cell, and when
  P is not a multiple of C the cells differ in size by one pixel (P = 6: widths 1, 2, 1, 2).
  Needs P >= C so that no cell is empty.
- `patch_pixels`: the patch's raw pixels in [0, 1] (regression target), optionally normalized
  per patch to zero mean and unit variance (MAE's `norm_pix_loss`).

Shape legend: B batch, N patches, P patch side, C cells per side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssl_vit.errors import ConfigError

__all__ = [
    "NUM_COLOR_CLASSES",
    "mean_color_classes",
    "cell_color_classes",
    "cell_bounds",
    "patch_pixels",
    "normalize_patches",
    "quantize_colors",
    "pixels_to_mean_color",
    "color_class_to_rgb",
]

BITS = 3
LEVELS = 2**BITS  # 8 levels per channel
NUM_COLOR_CLASSES = LEVELS**3  # 512


def _check_size(images: torch.Tensor, patch_size: int) -> None:
    H, W = images.shape[-2:]
    if H % patch_size or W % patch_size:
        raise ValueError(f"image size {(H, W)} is not a multiple of patch size {patch_size}")


def _levels(sums: torch.Tensor, counts: torch.Tensor | int, uint8: bool) -> torch.Tensor:
    """Channel sums over `counts` pixels -> quantized channel means in {0..7}.

    uint8 pixels k/255 are computed exactly: floor(8 * sum / (255 * count)) in integers (sums
    of up to 2^24 / 255 pixels are exact in float32). Float images use float64 so that bin
    edges such as a mean of exactly 0.125 are exact.
    """
    if uint8:
        return torch.clamp(LEVELS * sums.round().long() // (255 * counts), max=LEVELS - 1)
    return torch.floor(sums / counts * LEVELS).clamp_(0, LEVELS - 1).long()


def quantize_colors(levels_3: torch.Tensor) -> torch.Tensor:
    """Quantized channel levels [..., 3] in {0..7} -> colour classes [...] in [0, 512)."""
    return levels_3[..., 0] * LEVELS**2 + levels_3[..., 1] * LEVELS + levels_3[..., 2]


def mean_color_classes(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """3-bit mean-colour class of every patch.

    Args:
        images: [B, 3, H, W], float in [0, 1] (or uint8 in [0, 255], computed exactly).
        patch_size: P; H and W must be multiples of it.

    Returns:
        LongTensor [B, N] with N = (H/P) * (W/P), patches in row-major order, values in [0, 512).
    """
    _check_size(images, patch_size)
    uint8 = images.dtype == torch.uint8
    x = images.float() if uint8 else images.to(torch.float64)
    sums_B3hw = F.avg_pool2d(x, patch_size, divisor_override=1)
    q_Bhw3 = _levels(sums_B3hw, patch_size**2, uint8).permute(0, 2, 3, 1)
    return quantize_colors(q_Bhw3).flatten(1)


def cell_bounds(patch_size: int, cells: int = 4) -> list[tuple[int, int]]:
    """[start, end) pixel ranges of the `cells` cells along one side of a patch."""
    if patch_size < cells:
        raise ConfigError(f"patch size {patch_size} is smaller than {cells} cells per side")
    return [(i * patch_size // cells, (i + 1) * patch_size // cells) for i in range(cells)]


def _cell_matrix(patch_size: int, cells: int, device: torch.device) -> torch.Tensor:
    """[C, P] 0/1 matrix: row i selects the pixels of cell i along one side."""
    m_CP = torch.zeros(cells, patch_size, dtype=torch.float64, device=device)
    for i, (start, end) in enumerate(cell_bounds(patch_size, cells)):
        m_CP[i, start:end] = 1.0
    return m_CP


def cell_color_classes(images: torch.Tensor, patch_size: int, cells: int = 4) -> torch.Tensor:
    """3-bit mean-colour class of each of the C x C cells of every patch.

    Args:
        images: [B, 3, H, W], float in [0, 1] (or uint8, computed exactly).
        patch_size: P >= cells; H and W must be multiples of it.
        cells: C, cells per side (the paper's 4x4).

    Returns:
        LongTensor [B, N, C * C]: patches row-major, cells row-major within a patch.
    """
    _check_size(images, patch_size)
    uint8 = images.dtype == torch.uint8
    B, _, H, W = images.shape
    h, w = H // patch_size, W // patch_size
    x = images.to(torch.float64).view(B, 3, h, patch_size, w, patch_size)
    m_CP = _cell_matrix(patch_size, cells, images.device)
    # Sums over the pixels of each cell: rows (m @ .) then columns (. @ m^T), in float64.
    sums_B3hCwC = torch.einsum("ip,bchpwq,jq->bchiwj", m_CP, x, m_CP)
    counts_CC = m_CP.sum(1)[:, None] * m_CP.sum(1)[None, :]
    sums_BhwCC3 = sums_B3hCwC.permute(0, 2, 4, 3, 5, 1)
    counts = counts_CC[:, :, None].long() if uint8 else counts_CC[:, :, None]
    q_BhwCC3 = _levels(sums_BhwCC3, counts, uint8)
    return quantize_colors(q_BhwCC3).reshape(B, h * w, cells * cells)


def patch_pixels(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Pixels of every patch in [0, 1] (uint8 is divided by 255).

    Returns:
        float32 [B, N, P * P * 3], patches row-major; within a patch, pixel rows, then pixel
        columns, then RGB (MAE's `patchify` order).
    """
    _check_size(images, patch_size)
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    B, _, H, W = x.shape
    h, w, P = H // patch_size, W // patch_size, patch_size
    x_B3hPwP = x.reshape(B, 3, h, P, w, P)
    return x_B3hPwP.permute(0, 2, 4, 3, 5, 1).reshape(B, h * w, P * P * 3)


def normalize_patches(pixels: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """[..., P*P*3] -> zero mean, unit variance over the last axis (MAE's norm_pix_loss)."""
    mean = pixels.mean(dim=-1, keepdim=True)
    var = pixels.var(dim=-1, keepdim=True, unbiased=False)
    return (pixels - mean) / (var + eps).sqrt()


def pixels_to_mean_color(pixels: torch.Tensor) -> torch.Tensor:
    """Patch pixels [..., P*P*3] in [0, 1] (`patch_pixels` order) -> mean-colour classes [...].

    Used to score regressed pixels on the same 3-bit colour accuracy as the classifiers.
    """
    means_3 = pixels.to(torch.float64).unflatten(-1, (-1, 3)).mean(dim=-2)
    return quantize_colors(_levels(means_3, 1, uint8=False))


def color_class_to_rgb(classes: torch.Tensor) -> torch.Tensor:
    """Colour classes [...] -> bin-centre RGB in [0, 1], shape [..., 3] (for visualisation)."""
    r, g, b = classes // LEVELS**2, (classes // LEVELS) % LEVELS, classes % LEVELS
    return (torch.stack([r, g, b], dim=-1).float() + 0.5) / LEVELS
