"""Encoded image bytes -> uint8 RGB, the one decoding path of every source (shards, image
folders, HF datasets, few-shot subsets) and the one pixel limit `make-shards` also applies.

Whatever the file stores, the model sees 8-bit RGB: 16-bit samples are scaled to 8 bits
(v / 257, rounded: 65535 -> 255), never clipped; grey, palette, CMYK and alpha modes are
converted and alpha is dropped. An image with more than `MAX_PIXELS` pixels, or longer than
`MAX_ASPECT` times its width (or wider than that times its height), is refused before its pixels
are decoded (the caller skips and counts it).

Every image comes out upright, as people see it: an EXIF orientation (a phone photo stored on
its side) is applied as `PIL.ImageOps.exif_transpose` applies it (`exif_orientation`), so
training, evaluation, few-shot and predict see what the transformers export's `pipeline` sees.
"""

from __future__ import annotations

import io
import os
import re
import stat
import struct
import warnings
from collections.abc import Iterator

import numpy as np
import torch
from PIL import ExifTags, Image
from torchvision.io import ImageReadMode
from torchvision.io import decode_image as _tv_decode_image

from ssl_vit.errors import InputError

__all__ = [
    "MAX_ASPECT",
    "MAX_FILE_BYTES",
    "MAX_PIXELS",
    "check_pixels",
    "decode_image",
    "exif_orientation",
    "jpeg_size",
    "open_jpeg_reduced",
    "pil_orientation",
    "pil_to_rgb8",
    "read_image_file",
    "stored_box",
    "unreadable_reason",
    "upright",
    "upright_pil",
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
_NO_LENGTH = frozenset((0x01, *range(0xD0, 0xD8)))  # JPEG markers without a length
_APP1, _SOS = 0xE1, 0xDA  # the segment of EXIF and XMP metadata; start of scan (pixels follow)
_PNG = b"\x89PNG\r\n\x1a\n"
# PNG chunks PIL reads an orientation from: eXIf, and text chunks under these keywords.
_PNG_TEXT = (b"tEXt", b"zTXt", b"iTXt")
_PNG_EXIF_KEYS = (b"exif", b"Raw profile type exif", b"XML:com.adobe.xmp")

# EXIF orientation -> how the stored pixels become the upright image: (transpose, flip rows,
# flip columns), the transpose first. The table of `ImageOps.exif_transpose` (2 FLIP_LEFT_RIGHT,
# 3 ROTATE_180, 4 FLIP_TOP_BOTTOM, 5 TRANSPOSE, 6 ROTATE_270, 7 TRANSVERSE, 8 ROTATE_90) in
# array terms; 5-8 swap width and height. 1 (or none, or any other value): as stored.
_ORIENT = {
    2: (False, False, True),
    3: (False, True, True),
    4: (False, True, False),
    5: (True, False, False),
    6: (True, False, True),
    7: (True, True, True),
    8: (True, True, False),
}
_PIL_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def check_pixels(size: tuple[int, int]) -> None:
    """Raise ValueError if a (width, height) image is empty, exceeds `MAX_PIXELS` or has an
    aspect ratio beyond `MAX_ASPECT`:1 (either way)."""
    width, height = size
    if width < 1 or height < 1:
        raise InputError(f"{width}x{height} image: no pixels")
    if width * height > MAX_PIXELS:
        raise InputError(
            f"{width}x{height} image: more than {MAX_PIXELS} pixels (the decompression-bomb "
            "limit make-shards applies); resize it"
        )
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise InputError(
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


def _jpeg_segments(data: bytes) -> Iterator[tuple[int, int]]:
    """(marker, position) of each marker segment of JPEG bytes up to the start of scan (SOS,
    the last one yielded); stops early at bytes that are not a marker."""
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _NO_LENGTH:
            pos += 2
            continue
        yield marker, pos
        if marker == _SOS:
            return
        (length,) = struct.unpack(">H", data[pos + 2 : pos + 4])
        pos += 2 + length


def _header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a PNG or baseline/progressive JPEG from its header, else None.

    Reading 8 to a few hundred bytes costs ~1 us, where `PIL.Image.open` costs 30-60 us (as
    much as decoding a 32 px image), so the fast path checks the size without PIL."""
    if data[:8] == _PNG and data[12:16] == b"IHDR":
        return struct.unpack(">II", data[16:24])
    if data[:2] != b"\xff\xd8":
        return None
    for marker, pos in _jpeg_segments(data):
        if marker in _SOF and pos + 9 <= len(data):
            height, width = struct.unpack(">HH", data[pos + 5 : pos + 9])
            return width, height
    return None


def _may_be_oriented(data: bytes) -> bool:
    """False only where the bytes hold no orientation PIL would read: a JPEG without an APP1
    segment (EXIF, XMP) before its pixels, a PNG without an eXIf chunk nor EXIF / XMP text, a
    WebP whose header flags no EXIF nor XMP chunk (a simple lossy or lossless file has no room
    for them). A scan of the headers (~1-5 us, a chunk walk for a PNG), so that most images
    never pay for `Image.open` (~170 us for a 32 px WebP); anything else (another format,
    malformed bytes) is left to PIL."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP" and len(data) > 20:
        # Extended files (VP8X) carry flags: 0x08 an EXIF chunk, 0x04 an XMP one.
        return data[12:16] == b"VP8X" and bool(data[20] & 0x0C)
    if data[:2] == b"\xff\xd8":
        for marker, _ in _jpeg_segments(data):
            if marker == _APP1:
                return True
            if marker == _SOS:
                return False
        return True  # no scan found: PIL says what it reads
    if data[:8] != _PNG:
        return True
    pos = 8
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        if kind == b"eXIf":
            return True
        if kind in _PNG_TEXT:  # a keyword of at most 79 bytes, then a NUL
            if data[pos + 8 : pos + 8 + min(length, 80)].split(b"\0", 1)[0] in _PNG_EXIF_KEYS:
                return True
        if kind == b"IEND":
            return False
        pos += 12 + length
    return True  # truncated: PIL says what it reads


def pil_orientation(im: Image.Image) -> int:
    """The EXIF orientation `ImageOps.exif_transpose` applies to the opened image `im`: 2-8, or
    1 for none (no tag, another value, or metadata PIL cannot parse). A JPEG's is read from
    its header; any other image is decoded first, as exif_transpose does (a PNG's eXIf chunk
    may follow its pixels)."""
    try:
        if im.format not in ("JPEG", "MPO"):
            im.load()
        orientation = im.getexif().get(ExifTags.Base.Orientation, 1)
        return orientation if orientation in _ORIENT else 1
    except Exception:  # noqa: BLE001 - broken metadata: the pixels as stored
        return 1


def exif_orientation(data: bytes) -> int:
    """`pil_orientation` of encoded image bytes (1 for bytes PIL cannot open: the decode says
    why). Most images cost a header scan, not `Image.open` (`_may_be_oriented`)."""
    if not _may_be_oriented(data):
        return 1
    try:
        with Image.open(io.BytesIO(data)) as im:
            return pil_orientation(im)
    except Exception:  # noqa: BLE001 - unreadable: decoding it raises the reason
        return 1


def upright(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """uint8 [..., H, W] pixels as stored -> the image as people see it under an EXIF
    `orientation` ([..., W, H] for 5-8), as `ImageOps.exif_transpose` turns it."""
    if orientation not in _ORIENT:
        return image
    transpose, flip_rows, flip_cols = _ORIENT[orientation]
    if transpose:
        image = image.transpose(-2, -1)
    dims = [d for d, flip in ((-2, flip_rows), (-1, flip_cols)) if flip]
    return image.flip(dims) if dims else image.contiguous()


def upright_pil(im: Image.Image, orientation: int) -> Image.Image:
    """`upright` of a PIL image (a new image; `im` itself for orientation 1)."""
    return im.transpose(_PIL_TRANSPOSE[orientation]) if orientation in _ORIENT else im


def stored_box(
    box: tuple[float, float, float, float], size: tuple[int, int], orientation: int
) -> tuple[float, float, float, float]:
    """A box (left, top, right, bottom) of the upright image of (width, height) `size` -> the
    same pixels' box in the image as stored (its sides swapped for orientations 5-8), so a
    crop can be cut from pixels as stored and turned upright after (`upright`)."""
    if orientation not in _ORIENT:
        return box
    transpose, flip_rows, flip_cols = _ORIENT[orientation]
    (x0, y0, x1, y1), (width, height) = box, size
    if flip_cols:
        x0, x1 = width - x1, width - x0
    if flip_rows:
        y0, y1 = height - y1, height - y0
    return (y0, x0, y1, x1) if transpose else (x0, y0, x1, y1)


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
    """Encoded image bytes -> uint8 [3,H,W] RGB, upright (its EXIF orientation applied: H and
    W are those people see). Raises on empty, corrupt, non-image or too large (`MAX_PIXELS`)
    data."""
    if not data:
        raise InputError("empty image data")
    size = _header_size(data)
    if size is not None:  # PNG / JPEG: torchvision's decoders, ~2x faster than PIL's
        check_pixels(size)
        try:
            # torchvision 0.29 warns on every call that its codecs are deprecated (TorchCodec).
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                image = _rgb8(_tv_decode_image(buf, mode=ImageReadMode.RGB))
        except RuntimeError:
            pass  # e.g. a PNG variant libpng rejects: PIL decides (and rejects corrupt data)
        else:  # (torchvision's own EXIF option is off: one reading of the tag, PIL's)
            return upright(image, exif_orientation(data))
    # Other formats (BMP, TIFF, GIF, WebP, ...): PIL, which raises DecompressionBombError
    # above MAX_PIXELS when it opens the file.
    with Image.open(io.BytesIO(data)) as im:
        check_pixels(im.size)
        pixels = pil_to_rgb8(upright_pil(im, pil_orientation(im)))
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of JPEG bytes from the header (no decoding), None if not a JPEG: the
    pixels as stored (before the EXIF orientation, which swaps them for 5-8)."""
    return _header_size(data) if data[:2] == b"\xff\xd8" else None


def open_jpeg_reduced(data: bytes, scale: int) -> Image.Image | None:
    """JPEG bytes opened to decode at 1/`scale` (2, 4 or 8) of each side by libjpeg's scaled
    IDCT (PIL `draft`): pixel j of the result covers pixels [j*scale, (j+1)*scale) of the full
    image as stored (before its EXIF orientation: `stored_box`, then `upright`). Nothing is
    decoded yet (the caller's first pixel op does it). None if this JPEG cannot be read so
    (CMYK, whose colours torchvision converts otherwise; a size unlike its header's; a scale
    libjpeg would not give): the caller decodes it in full, still once."""
    im = Image.open(io.BytesIO(data))
    width, height = im.size
    if im.format != "JPEG" or im.mode not in ("RGB", "L") or im.size != jpeg_size(data):
        return None  # (a size unlike the header's, which drew the crop: the full path says so)
    check_pixels(im.size)
    im.draft(im.mode, (width // scale, height // scale))
    if im.size != (-(-width // scale), -(-height // scale)):
        return None
    return im


def unreadable_reason(e: Exception) -> str:
    """Why an image could not be read, the same on every run: PIL names the in-memory file it
    was handed (`cannot identify image file <_io.BytesIO object at 0x7f769dcb4c70>`)."""
    return re.sub(r" <_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", f"{type(e).__name__}: {e}")
