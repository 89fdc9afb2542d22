"""Encoded image bytes -> uint8 RGB, the one decoding path of every source (shards, image
folders, HF datasets, few-shot subsets) and the one pixel limit `make-shards` also applies.

Whatever the file stores, the model sees 8-bit RGB: 16-bit samples are scaled to 8 bits
(v / 257, rounded: 65535 -> 255), never clipped; grey, palette, CMYK and alpha modes are
converted and alpha is dropped. An image with more than `MAX_PIXELS` pixels, or longer than
`MAX_ASPECT` times its width (or wider than that times its height), is refused before its pixels
are decoded (the caller skips and counts it).
"""

from __future__ import annotations

import io
import os
import stat
import struct
import warnings

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode
from torchvision.io import decode_image as _tv_decode_image

__all__ = [
    "MAX_ASPECT",
    "MAX_FILE_BYTES",
    "MAX_PIXELS",
    "check_pixels",
    "decode_image",
    "jpeg_size",
    "open_jpeg_reduced",
    "pil_to_rgb8",
    "read_image_file",
]

# PIL's decompression-bomb threshold (Image.open raises above twice MAX_IMAGE_PIXELS, 179 M
# pixels by default): what `make-shards --verify` refuses, so every reader refuses the same.
MAX_PIXELS = 2 * (Image.MAX_IMAGE_PIXELS or 89_478_485)
# Longer side / shorter side. Every loader resizes the shorter side to the model's input S
# (evaluation, `data.augment=device`) or crops a near-square box first (workers): a resized
# image is then at most MAX_ASPECT * S^2 pixels (5 M at S=224), however few pixels the file
# holds. A 1 x 2,000,000 PNG (6 KB) resized to S=224 would be 448 M pixels (18 GB of memory).
MAX_ASPECT = 100
# The largest image file read (1 GiB): more than any encoding of a MAX_PIXELS image needs but
# raw 16-bit ones, and a bound on what one sample can take from a reader's memory.
MAX_FILE_BYTES = 1 << 30

_SOF = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # JPEG start-of-frame markers (not DHT etc.)


def check_pixels(size: tuple[int, int]) -> None:
    """Raise ValueError if a (width, height) image is empty, exceeds `MAX_PIXELS` or has an
    aspect ratio beyond `MAX_ASPECT`:1 (either way)."""
    width, height = size
    if width < 1 or height < 1:
        raise ValueError(f"{width}x{height} image: no pixels")
    if width * height > MAX_PIXELS:
        raise ValueError(
            f"{width}x{height} image: more than {MAX_PIXELS} pixels (the decompression-bomb "
            "limit make-shards applies); resize it"
        )
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise ValueError(
            f"{width}x{height} image: aspect ratio beyond {MAX_ASPECT}:1 (resizing its shorter "
            "side to the input size would take memory without bound); crop it"
        )


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def read_image_file(path: str | os.PathLike) -> bytes:
    """The bytes of the image file `path` (symlinks followed). OSError saying why, without
    blocking or reading, if it is not a regular file (a FIFO would wait for a writer forever,
    /dev/zero never ends) or holds more than `MAX_FILE_BYTES`."""
    # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a file")
            raise OSError(f"not a regular file ({kind})")
        if st.st_size > MAX_FILE_BYTES:
            raise OSError(f"{st.st_size} bytes: more than {MAX_FILE_BYTES} (the image file limit)")
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:  # grew while read
        raise OSError(f"larger than {MAX_FILE_BYTES} bytes (the image file limit)")
    return data


def _header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a PNG or baseline/progressive JPEG from its header, else None.

    Reading 8 to a few hundred bytes costs ~1 us, where `PIL.Image.open` costs 30-60 us (as
    much as decoding a 32 px image), so the fast path checks the size without PIL."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR":
        return struct.unpack(">II", data[16:24])
    if data[:2] != b"\xff\xd8":
        return None
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            pos += 2
            continue
        (length,) = struct.unpack(">H", data[pos + 2 : pos + 4])
        if marker in _SOF and pos + 9 <= len(data):
            height, width = struct.unpack(">HH", data[pos + 5 : pos + 9])
            return width, height
        pos += 2 + length
    return None


def pil_to_rgb8(im: Image.Image) -> np.ndarray:
    """A PIL image of any mode -> uint8 [H, W, 3] RGB. Integer modes deeper than 8 bits
    (I;16*, I) are taken as 16-bit and scaled by 255/65535 (PIL's own `convert` clips them at
    255); float (F) as [0, 1]; every other mode through `convert("RGB")` (alpha dropped)."""
    if im.mode.startswith("I"):
        grey = np.clip(np.asarray(im).astype(np.int64), 0, 65535)
        grey = ((grey + 128) // 257).astype(np.uint8)
    elif im.mode == "F":
        grey = np.rint(np.clip(np.asarray(im, dtype=np.float64), 0, 1) * 255).astype(np.uint8)
    else:
        with warnings.catch_warnings():  # P with transparency bytes: alpha is dropped anyway
            warnings.simplefilter("ignore", UserWarning)
            return np.asarray(im.convert("RGB")).copy()
    return np.repeat(grey[:, :, None], 3, axis=2)


def _rgb8(image: torch.Tensor) -> torch.Tensor:
    """torchvision's decode of a 16-bit PNG is uint16: scale it to uint8 (rounded v / 257)."""
    if image.dtype == torch.uint8:
        return image
    return image.to(torch.int32).add_(128).div_(257, rounding_mode="floor").to(torch.uint8)


def decode_image(data: bytes) -> torch.Tensor:
    """Encoded image bytes -> uint8 [3,H,W] RGB. Raises on empty, corrupt, non-image or
    too large (`MAX_PIXELS`) data."""
    if not data:
        raise ValueError("empty image data")
    size = _header_size(data)
    if size is not None:  # PNG / JPEG: torchvision's decoders, ~2x faster than PIL's
        check_pixels(size)
        try:
            # torchvision 0.29 warns on every call that its codecs are deprecated (TorchCodec).
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                return _rgb8(_tv_decode_image(buf, mode=ImageReadMode.RGB))
        except RuntimeError:
            pass  # e.g. a PNG variant libpng rejects: PIL decides (and rejects corrupt data)
    # Other formats (BMP, TIFF, GIF, WebP, ...): PIL, which raises DecompressionBombError
    # above MAX_PIXELS when it opens the file.
    with Image.open(io.BytesIO(data)) as im:
        check_pixels(im.size)
        pixels = pil_to_rgb8(im)
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of JPEG bytes from the header (no decoding), None if not a JPEG."""
    return _header_size(data) if data[:2] == b"\xff\xd8" else None


def open_jpeg_reduced(data: bytes, scale: int) -> Image.Image | None:
    """JPEG bytes opened to decode at 1/`scale` (2, 4 or 8) of each side by libjpeg's scaled
    IDCT (PIL `draft`): pixel j of the result covers pixels [j*scale, (j+1)*scale) of the full
    image. Nothing is decoded yet (the caller's first pixel op does it). None if this JPEG
    cannot be read so (CMYK, whose colours torchvision converts otherwise; a size unlike its
    header's; a scale libjpeg would not give): the caller decodes it in full, still once."""
    im = Image.open(io.BytesIO(data))
    width, height = im.size
    if im.format != "JPEG" or im.mode not in ("RGB", "L") or im.size != jpeg_size(data):
        return None  # (a size unlike the header's, which drew the crop: the full path says so)
    check_pixels(im.size)
    im.draft(im.mode, (width // scale, height // scale))
    if im.size != (-(-width // scale), -(-height // scale)):
        return None
    return im
