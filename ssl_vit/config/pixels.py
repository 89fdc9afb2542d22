"""The pixel normalisation default, written once: every data config's `mean` / `std` and a
checkpoint that stores none take it."""

from __future__ import annotations

from typing import Any

__all__ = ["PIXEL_NORM", "complete_pixel_norm"]

# Per channel, of [0, 1] pixels: (x - 0.5) / 0.5 maps them to [-1, 1] (the paper's input).
PIXEL_NORM = (0.5, 0.5, 0.5)


def complete_pixel_norm(data: Any) -> None:
    """`data.mean` / `data.std` left null (a checkpoint's, when one is loaded and stores them)
    take the default: a new encoder, or a checkpoint that stores none."""
    for key in ("mean", "std"):
        if getattr(data, key) is None:
            setattr(data, key, PIXEL_NORM)
