"""Image decoding and the train / eval transforms, on uint8 tensors (no float until the
accelerator normalizes)."""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode
from torchvision.io import decode_image as _tv_decode_image
from torchvision.transforms import v2

__all__ = ["decode_image", "eval_transform", "train_transform"]


def decode_image(data: bytes) -> torch.Tensor:
    """Encoded image bytes -> uint8 [3,H,W] RGB. Raises on empty, corrupt or non-image data."""
    if not data:
        raise ValueError("empty image data")
    try:
        # torchvision 0.29 warns on every call that its codecs are deprecated (for TorchCodec).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            return _tv_decode_image(buf, mode=ImageReadMode.RGB)
    except RuntimeError:
        pass  # no BMP/TIFF/PPM decoder in torchvision: try PIL, which also rejects corrupt data
    with Image.open(io.BytesIO(data)) as im:
        pixels = np.asarray(im.convert("RGB"))
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).contiguous()


def train_transform(
    image_size: int, crop_scale: Sequence[float] = (0.08, 1.0), hflip: bool = True
) -> v2.Transform:
    """uint8 [3,H,W] -> uint8 [3,S,S]: random resized crop (+ horizontal flip)."""
    ops: list[v2.Transform] = [
        v2.RandomResizedCrop(image_size, scale=tuple(crop_scale), antialias=True)
    ]
    if hflip:
        ops.append(v2.RandomHorizontalFlip())
    return v2.Compose(ops)


def eval_transform(image_size: int) -> v2.Transform:
    """uint8 [3,H,W] -> uint8 [3,S,S]: resize the shorter side to S, then center crop."""
    return v2.Compose([v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)])
