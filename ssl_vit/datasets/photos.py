"""An ImageNet-like set from real photographs: benchmarks and tests of the loaders at the sizes
users train on, where there is no ImageNet (`ssl-vit make-synthetic --kind photos`).

The photographs are the colour photos scikit-image ships in its wheel (`skimage.data`: an
astronaut, a cat, a coffee cup, a rocket, ... ; the `photos` extra installs it). Image i takes
photo `i % K` (its label: K classes) and makes a new view of it, all drawn from
`np.random.default_rng([seed, i])`: a random crop (10-100% of the area, aspect 3:4 to 4:3), a
horizontal flip half the time, brightness, contrast and saturation changes of up to 25%, and a
size from ImageNet's distribution (most images 500 px on the longer side, 4:3 landscape or 3:4
portrait; the rest 200-1000 px), saved as JPEG quality 90: ~500x375 and ~100 KB typical, as
ImageNet's training images.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageEnhance

from ssl_vit.atomic import staged_dir
from ssl_vit.data.write.writer import ShardWriter, check_output
from ssl_vit.errors import ConfigError, InputError
from ssl_vit.progress import progress_iter

__all__ = ["PHOTO_NAMES", "load_photos", "make_photo_shards", "photo_views", "write_photo_folder"]

# skimage.data's colour photographs (not its drawings, microscopy stacks or grey images).
PHOTO_NAMES = [
    "astronaut",
    "chelsea",
    "coffee",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "motorcycle_left",
    "motorcycle_right",
]
# Aspect ratios (width / height) of ImageNet training images, roughly in their proportions.
_ASPECTS = ([4 / 3, 3 / 4, 3 / 2, 1.0, 2 / 3, 16 / 9], [0.55, 0.15, 0.12, 0.1, 0.04, 0.04])


def load_photos() -> list[np.ndarray]:
    """The photographs as uint8 [H,W,3] arrays, in `PHOTO_NAMES` order. ImportError naming the
    extra to install if scikit-image is missing."""
    try:
        from skimage import data
    except ImportError as e:
        raise ImportError(
            f"{e}: make-synthetic --kind photos needs scikit-image: pip install 'ssl-vit[photos]'"
        ) from None
    left, right, _ = data.stereo_motorcycle()
    extra = {"motorcycle_left": left, "motorcycle_right": right}
    photos = [extra[n] if n in extra else getattr(data, n)() for n in PHOTO_NAMES]
    return [np.ascontiguousarray(p[..., :3]) for p in photos]


def _size(rng: np.random.Generator) -> tuple[int, int]:
    """A (width, height) from ImageNet's distribution: 75% 500 px on the longer side."""
    aspect = rng.choice(_ASPECTS[0], p=_ASPECTS[1])
    longer = 500 if rng.random() < 0.75 else int(rng.integers(200, 1001))
    if aspect >= 1:
        return longer, max(1, round(longer / aspect))
    return max(1, round(longer * aspect)), longer


def render_view(photo: np.ndarray, rng: np.random.Generator) -> Image.Image:
    """A random view of `photo` (crop, flip, colour, ImageNet-like size), from `rng` alone."""
    height, width = photo.shape[:2]
    area = height * width * rng.uniform(0.1, 1.0)
    aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    w = int(min(width, round(np.sqrt(area * aspect))))
    h = int(min(height, round(np.sqrt(area / aspect))))
    top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
    im = Image.fromarray(photo[top : top + h, left : left + w])
    if rng.random() < 0.5:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        im = enhance(im).enhance(rng.uniform(0.75, 1.25))
    return im.resize(_size(rng), Image.Resampling.BICUBIC)


def photo_views(
    n: int, seed: int = 0, quality: int = 90, photos: list[np.ndarray] | None = None
) -> Iterator[tuple[str, bytes, int]]:
    """Yield n (key, JPEG bytes, label) samples; sample i depends only on (seed, i)."""
    if seed < 0:
        raise ConfigError(f"seed must be >= 0, got {seed}")
    photos = load_photos() if photos is None else photos
    for i in range(n):
        label = i % len(photos)
        buf = io.BytesIO()
        im = render_view(photos[label], np.random.default_rng([seed, i]))
        im.save(buf, format="JPEG", quality=quality)
        yield f"{i:08d}_{PHOTO_NAMES[label]}", buf.getvalue(), label


def make_photo_shards(
    output: str | os.PathLike, n: int = 10000, seed: int = 0, shard_size: int = 1000
) -> dict[str, Any]:
    """Write `photo_views(n, seed)` as shards + index.json; return the index."""
    if n < 1:
        raise ConfigError(f"n must be >= 1, got {n}")
    views = photo_views(n, seed)
    with ShardWriter(output, shard_size) as writer:
        for key, data, label in progress_iter(views, n, desc="make-synthetic", unit="img"):
            writer.write(key, "jpg", data, label)
        return writer.close(label_names=PHOTO_NAMES, source=f"synthetic-photos(n={n}, seed={seed})")


def write_photo_folder(
    output: str | os.PathLike, n: int = 10000, seed: int = 0, overwrite: bool = False
) -> None:
    """Write `photo_views(n, seed)` as an image folder `output/<photo>/<key>.jpg` (the input of
    `make-shards` and of torchvision's ImageFolder).

    `output` must be missing or empty (ValueError, one line, before anything is written): an
    image folder's classes are its sub-folders, so images already there would be mixed into
    them. With `overwrite` a non-empty `output` is replaced, everything in it. The folder is
    written beside `output` and renamed into place (`ssl_vit.atomic.staged_dir`)."""
    if n < 1:
        raise ConfigError(f"n must be >= 1, got {n}")
    root = Path(output)
    check_output(root)
    if root.is_dir() and any(root.iterdir()) and not overwrite:
        raise InputError(
            f"--output {root} is not empty: its images would be mixed into the photos' classes "
            "(write to a new folder, or --overwrite to replace it)"
        )
    with staged_dir(root) as staging:
        views = progress_iter(photo_views(n, seed), n, desc="photos", unit="img")
        for key, data, label in views:
            folder = staging / PHOTO_NAMES[label]
            folder.mkdir(exist_ok=True)
            (folder / f"{key}.jpg").write_bytes(data)
