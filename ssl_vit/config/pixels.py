"""The pixel normalisation default, written once: every data config's `mean` / `std` and a
checkpoint that stores none take it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

__all__ = ["PIXEL_NORM", "completed_pixel_norm"]

# Per channel, of [0, 1] pixels: (x - 0.5) / 0.5 maps them to [-1, 1] (the paper's input).
PIXEL_NORM = (0.5, 0.5, 0.5)


def completed_pixel_norm(data: Any) -> Any:
    """A copy of `data` whose `mean` / `std` left null (a checkpoint's, when one is loaded and
    stores them) take the default: a new encoder, or a checkpoint that stores none."""
    return replace(data, mean=data.mean or PIXEL_NORM, std=data.std or PIXEL_NORM)
