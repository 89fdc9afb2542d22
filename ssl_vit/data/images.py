"""Image decoding and the train / eval transforms, on uint8 tensors (no float until the
accelerator normalizes)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import numpy as np
import torch
from PIL import Image, ImageOps
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from ssl_vit.config.pixels import PIXEL_NORM
from ssl_vit.data.decode import (
    check_pixels,
    decode_image,
    exif_orientation,
    jpeg_size,
    open_jpeg_reduced,
    stored_box,
    upright,
)

__all__ = [
    "RandAugment",
    "RandomResizedCropFlip",
    "SquareLoad",
    "eval_transform",
    "fallback_box",
    "torchvision_train_transform",
    "train_transform",
]


class RandomResizedCropFlip:
    """uint8 [3,H,W] -> uint8 [3,S,S]: torchvision v2 `RandomResizedCrop` (+ `RandomHorizontalFlip`)
    with the same random draws and the same kernels, hence bit-identical images, without v2's
    per-call dispatch (~1.5x faster per sample on CIFAR-sized images). `after` (RandAugment, say)
    is applied to the flipped crop, its draws after the crop's and the flip's."""

    def __init__(
        self,
        size: int,
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3.0 / 4.0, 4.0 / 3.0),
        hflip: bool = True,
        after: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.size, self.scale, self.ratio, self.hflip = [size, size], tuple(scale), ratio, hflip
        self.after = after
        self._log_ratio = torch.log(torch.tensor(ratio))  # as v2 computes it: float32 bounds

    def crop_box(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(top, left, h, w), drawn from the global torch RNG exactly as v2 draws it.

        Not `transforms.RandomResizedCrop.get_params` (same draws, bit-identical boxes): it
        rebuilds the log-ratio tensor and dispatches `get_dimensions` on every call, +50 us a
        32 px sample (decode + augment ~220 us -> ~270 us, measured on one CPU thread)."""
        area = height * width
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(self.scale[0], self.scale[1]).item()
            log_r = torch.empty(1).uniform_(self._log_ratio[0], self._log_ratio[1])
            aspect = torch.exp(log_r).item()
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = torch.randint(0, height - h + 1, size=(1,)).item()
                left = torch.randint(0, width - w + 1, size=(1,)).item()
                return top, left, h, w
        h, w = fallback_box(height, width, self.ratio)
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        top, left, h, w = self.crop_box(*image.shape[-2:])
        out = TF.resized_crop_image(image, top, left, h, w, self.size, antialias=True)
        return self._flip(out)

    def _flip(self, out: torch.Tensor) -> torch.Tensor:
        if self.hflip and torch.rand(1) < 0.5:
            out = TF.horizontal_flip_image(out)
        return out if self.after is None else self.after(out)

    def from_bytes(self, data: bytes) -> torch.Tensor:
        """Encoded image -> uint8 [3,S,S]: `self(decode_image(data))` with the same random draws
        and the same crop box, decoding only what the crop needs. A JPEG crop at least 2S on its
        shorter side is decoded at 1/2, 1/4 or 1/8 scale (the largest that leaves the crop >= S
        a side, so the resize to S still only shrinks: nothing is lost), then cropped and
        resized in one antialiased op; any other image is decoded in full, once, as before.
        The box is drawn on the upright image, as `decode_image` gives it; a JPEG with an EXIF
        orientation is cut and resized as stored (`stored_box`), then turned upright."""
        size = jpeg_size(data)
        if size is None:
            return self(decode_image(data))
        check_pixels(size)  # before any draw, as decode_image would raise
        orientation = exif_orientation(data)
        width, height = size[::-1] if orientation >= 5 else size  # upright (5-8: a quarter turn)
        top, left, h, w = self.crop_box(height, width)
        scale = next((s for s in (8, 4, 2) if min(h, w) >= s * self.size[0]), 1)
        reduced = open_jpeg_reduced(data, scale) if scale > 1 else None
        if reduced is not None:
            box = stored_box((left, top, left + w, top + h), (width, height), orientation)
            box = tuple(v / scale for v in box)
            out_wh = (self.size[1], self.size[0])  # PIL's (width, height), upright
            out_wh = out_wh[::-1] if orientation >= 5 else out_wh
            out = reduced.resize(out_wh, Image.Resampling.BILINEAR, box, reducing_gap=None)
            pixels = np.array(out.convert("RGB") if out.mode != "RGB" else out)
            image = upright(torch.from_numpy(pixels).permute(2, 0, 1), orientation)
            return self._flip(image.contiguous())
        image = decode_image(data)
        if tuple(image.shape[-2:]) != (height, width):
            raise ValueError(f"JPEG header says {size[0]}x{size[1]}, decoded {image.shape}")
        out = TF.resized_crop_image(image, top, left, h, w, self.size, antialias=True)
        return self._flip(out)


def fallback_box(height: int, width: int, ratio: Sequence[float]) -> tuple[int, int]:
    """(h, w) of get_params' fallback (no try fits): the whole image, cut to the nearest allowed
    ratio; the box is its centre."""
    h, w = height, width
    if width / height < min(ratio):
        h = int(round(w / min(ratio)))
    elif width / height > max(ratio):
        w = int(round(h * max(ratio)))
    return h, w


class RandAugment:
    """uint8 [3,H,W] -> uint8 [3,H,W]: timm's RandAugment (`rand_augment_transform`, on a PIL
    image) from a spec such as "rand-m9-mstd0.5-inc1" (MAE's (9, 0.5)).

    timm draws from Python's and NumPy's global RNGs; both are seeded here from one draw of
    the torch RNG, which the loader seeds per sample (stages._seeded), so a sample's ops depend
    only on its place in the stream, as its crop does; the global states are restored after."""

    def __init__(self, spec: str, image_size: int, mean: Sequence[float] = PIXEL_NORM):
        from timm.data.auto_augment import rand_augment_transform

        hparams = {
            "translate_const": int(image_size * 0.45),  # as timm's create_transform
            "img_mean": tuple(round(255 * m) for m in mean),  # fill of rotations / shears
        }
        self.op = rand_augment_transform(spec, hparams)
        for op in self.op.ops:
            if op.name.startswith("Posterize"):
                op.aug_fn = _posterize

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        seed = int(torch.randint(0, 2**31, (1,)))
        py_state, np_state = random.getstate(), np.random.get_state()
        random.seed(seed)
        np.random.seed(seed)
        try:
            out = self.op(Image.fromarray(image.permute(1, 2, 0).numpy()))
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
        return torch.from_numpy(np.asarray(out).copy()).permute(2, 0, 1).contiguous()


def _posterize(img: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    """timm's posterize, also at 0 bits: its PosterizeIncreasing reaches 0 at magnitude 10,
    which Pillow >= 12 refuses (older Pillow kept no bit: a black image; so does this)."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return ImageOps.posterize(img, bits_to_keep)


def train_transform(
    image_size: int,
    crop_scale: Sequence[float] = (0.08, 1.0),
    hflip: bool = True,
    randaugment: str = "",
    mean: Sequence[float] = PIXEL_NORM,
):
    """uint8 [3,H,W] -> uint8 [3,S,S]: random resized crop (+ horizontal flip) (+ RandAugment
    with a non-empty timm spec, after them as in timm / MAE)."""
    after = RandAugment(randaugment, image_size, mean) if randaugment else None
    return RandomResizedCropFlip(image_size, crop_scale, hflip=hflip, after=after)


def torchvision_train_transform(
    image_size: int, crop_scale: Sequence[float] = (0.08, 1.0), hflip: bool = True
) -> v2.Transform:
    """The same augmentation composed from stock torchvision v2 transforms (the reference)."""
    ops: list[v2.Transform] = [
        v2.RandomResizedCrop(image_size, scale=tuple(crop_scale), antialias=True)
    ]
    if hflip:
        ops.append(v2.RandomHorizontalFlip())
    return v2.Compose(ops)


def eval_transform(image_size: int) -> v2.Transform:
    """uint8 [3,H,W] -> uint8 [3,S,S]: resize the shorter side to S, then center crop."""
    return v2.Compose([v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)])


class SquareLoad:
    """uint8 [3,H,W] -> uint8 [3,L,L]: the shorter side resized to L (antialiased), then the
    central L x L; an image already L x L is returned as is (bit-identical).

    The workers' only transform under `data.augment=device`, which needs equal-sized images to
    batch. The aspect ratio is kept (no squashing); a non-square image loses the ends of its
    longer side, as a centre crop does at evaluation."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if tuple(image.shape[-2:]) != (self.size, self.size):
            image = TF.resize_image(image, [self.size], antialias=True)
            image = TF.center_crop_image(image, [self.size, self.size])
        return image
