"""What `make-shards` does to one image, in whichever worker process meets it: check it and,
with a maximum size, store it at training size.

Everything here is a pure function of the image bytes and the settings (fixed encoder options,
no clock, no RNG), so N worker processes produce exactly the bytes one process does.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import NamedTuple

from PIL import Image

from ssl_vit.data.decode import (
    check_pixels,
    exif_orientation,
    pil_to_rgb8,
    unreadable_reason,
    upright_pil,
)
from ssl_vit.errors import ConfigError

__all__ = ["Prepared", "StoreSettings", "image_error", "prepare_image", "shrink"]

# Formats stored losslessly when asked (`lossless`); every other one is re-encoded as JPEG.
_LOSSLESS_SOURCES = ("PNG", "BMP", "TIFF", "PPM", "GIF")


@dataclass(frozen=True)
class StoreSettings:
    """How `make-shards` stores images. `max_size`: the longest shorter side kept (None: every
    image as given, byte for byte); a larger image is resized (antialiased) to it and
    re-encoded as JPEG at `quality`, or as PNG if `lossless` and the source is lossless."""

    verify: bool = True
    max_size: int | None = None
    quality: int = 90
    lossless: bool = False

    def __post_init__(self) -> None:
        if self.max_size is not None and self.max_size < 1:
            raise ConfigError(f"--max-size must be >= 1, got {self.max_size}")
        if not 1 <= self.quality <= 100:
            raise ConfigError(f"--quality must be in [1, 100], got {self.quality}")

    def record(self) -> dict | None:
        """The setting as index.json records it (None: images stored as given)."""
        if self.max_size is None:
            return None
        return {"max_size": self.max_size, "quality": self.quality, "lossless": self.lossless}


class Prepared(NamedTuple):
    """One image ready to write: the bytes and extension to store, or why it is skipped, and
    its original (width, height) when images are resized (None otherwise)."""

    ext: str
    data: bytes
    error: str | None = None
    size: tuple[int, int] | None = None


def image_error(data: bytes) -> str | None:
    """Cheap validity check of encoded image bytes: None if PIL can parse them, else why not.

    `Image.verify()` checks headers and chunk checksums without decoding pixels (~15 us for a
    32x32 PNG), so it catches empty, non-image and most corrupt files at sharding time.
    """
    if not data:
        return "no image data (an empty or unreadable file, or a null image)"
    try:
        with Image.open(io.BytesIO(data)) as im:
            check_pixels(im.size)  # the limit every reader applies (data.decode)
            im.verify()
    except Exception as e:  # PIL raises many types for bad data
        return unreadable_reason(e)
    return None


def _target(size: tuple[int, int], max_size: int) -> tuple[int, int]:
    """(width, height) with the shorter side `max_size` and the aspect ratio kept."""
    w, h = size
    if w <= h:
        return max_size, max(1, round(h * max_size / w))
    return max(1, round(w * max_size / h)), max_size


def shrink(data: bytes, ext: str, settings: StoreSettings) -> Prepared:
    """The image stored at `settings.max_size`: the same bytes if its shorter side is already
    at most that, else resized (antialiased bicubic) and re-encoded upright, without EXIF (so
    no reader turns it twice). Sizes are upright ones. Raises on bad data."""
    with Image.open(io.BytesIO(data)) as im:
        check_pixels(im.size)
        orientation = exif_orientation(data)  # a header scan for most images
        size = im.size[::-1] if orientation >= 5 else im.size  # as people see it
        if min(size) <= settings.max_size:
            return Prepared(ext, data, None, size)
        target = _target(size, settings.max_size)
        fmt = im.format or ""
        if fmt == "JPEG":
            # libjpeg's scaled DCT decodes at 1/2, 1/4 or 1/8 while the result stays >= target:
            # a proper low-pass, and up to 8x less decoding.
            im.draft("RGB", target[::-1] if orientation >= 5 else target)
        pixels = Image.fromarray(pil_to_rgb8(upright_pil(im, orientation)))  # 8-bit RGB
    out = pixels.resize(target, Image.Resampling.BICUBIC, reducing_gap=None)
    buf = io.BytesIO()
    if settings.lossless and fmt in _LOSSLESS_SOURCES:
        out.save(buf, format="PNG", compress_level=6)
        return Prepared("png", buf.getvalue(), None, size)
    # Fixed options (no optimize pass, baseline, 4:2:0 chroma): same bytes on every run.
    out.save(buf, format="JPEG", quality=settings.quality, subsampling=2, optimize=False)
    return Prepared("jpg", buf.getvalue(), None, size)


def prepare_image(data: bytes, ext: str, settings: StoreSettings) -> Prepared:
    """Check one image and store it as `settings` ask; a bad image is a `Prepared` with the
    reason in `error` (the caller skips and counts it)."""
    error = image_error(data) if settings.verify or not data else None
    if error is not None:
        return Prepared(ext, b"", error)
    if settings.max_size is None:
        return Prepared(ext, data)
    try:
        return shrink(data, ext, settings)
    except Exception as e:  # an image that verifies but does not decode
        return Prepared(ext, b"", unreadable_reason(e))
