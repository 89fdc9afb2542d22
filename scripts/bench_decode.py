"""Where a training sample's time goes at ImageNet size, and what decoding only the crop would
save (issue 30): per image, on one thread, over the JPEGs of a folder (`ssl-vit make-synthetic
--kind photos --folder`), with the training crop's own random boxes (224 px):

  decode          libjpeg-turbo through torchvision (what the loader runs), the whole image
  decode + crop   the loader's transform (`RandomResizedCropFlip.from_bytes`, no flip)
  cropped decode  with --turbojpeg LIB (a libturbojpeg >= 3.0): TurboJPEG 3 decodes only the
                  crop's rows and MCU columns (tj3SetCroppingRegion), then the same resize.
                  Not in the loader: no maintained Python package ships this call (docs/data.md)

    python scripts/bench_decode.py --folder data/photos [--turbojpeg /path/libturbojpeg.so.0]

Prints one JSON object (milliseconds per image, best of --repeats passes).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

import numpy as np
import torch
import torchvision.transforms.v2.functional as TF

from ssl_vit.data.decode import decode_image, jpeg_size
from ssl_vit.data.images import RandomResizedCropFlip


class _Region(ctypes.Structure):
    _fields_ = [(k, ctypes.c_int) for k in ("x", "y", "w", "h")]


def turbojpeg_crop(path: str):
    """decode(data, top, left, h, w) -> uint8 [3, h, w] through TurboJPEG 3's cropped decode."""
    lib = ctypes.CDLL(path)
    lib.tj3Init.restype = ctypes.c_void_p
    lib.tj3DecompressHeader.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.tj3Get.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.tj3SetCroppingRegion.argtypes = [ctypes.c_void_p, _Region]
    lib.tj3Decompress8.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.tj3Decompress8.argtypes += [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    handle = lib.tj3Init(1)  # TJINIT_DECOMPRESS
    mcu_width = [8, 16, 16, 8, 8, 32, 8]  # per TJSAMP_* subsampling

    def decode(data: bytes, top: int, left: int, h: int, w: int) -> torch.Tensor:
        if lib.tj3DecompressHeader(handle, data, len(data)):
            raise ValueError("TurboJPEG cannot read the header")
        x0 = left - left % mcu_width[lib.tj3Get(handle, 4)]  # TJPARAM_SUBSAMP
        out = np.empty((h, left + w - x0, 3), np.uint8)
        lib.tj3SetCroppingRegion(handle, _Region(x0, top, out.shape[1], h))
        if lib.tj3Decompress8(handle, data, len(data), out.ctypes.data, out.shape[1] * 3, 0):
            raise ValueError("TurboJPEG failed to decode")
        return torch.from_numpy(out).permute(2, 0, 1)[:, :, left - x0 :]

    return decode


def per_image_ms(fn, items, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for item in items:
            fn(*item)
        best = min(best, (time.perf_counter() - t0) / len(items))
    return round(best * 1e3, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--folder", required=True, help="a folder of JPEGs (searched recursively)")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--turbojpeg", help="a libturbojpeg >= 3.0, for the cropped decode")
    args = p.parse_args()
    torch.set_num_threads(1)  # a loader worker's thread

    files = sorted(Path(args.folder).rglob("*.jp*g"))
    data = [f.read_bytes() for f in files]
    crop = RandomResizedCropFlip(args.size, hflip=False)
    torch.manual_seed(0)
    boxes = [crop.crop_box(*jpeg_size(d)[::-1]) for d in data]
    items = list(zip(data, boxes, strict=True))

    def resize(x: torch.Tensor) -> torch.Tensor:
        return TF.resize_image(x, [args.size, args.size], antialias=True)

    result = {
        "images": len(data),
        "decode": per_image_ms(lambda d, b: decode_image(d), items, args.repeats),
        "decode + crop": per_image_ms(lambda d, b: crop.from_bytes(d), items, args.repeats),
    }
    if args.turbojpeg:
        decode = turbojpeg_crop(args.turbojpeg)
        result["cropped decode"] = per_image_ms(lambda d, b: decode(d, *b), items, args.repeats)
        result["cropped decode + resize"] = per_image_ms(
            lambda d, b: resize(decode(d, *b)), items, args.repeats
        )
        full = [(TF.crop_image(decode_image(d), *b), decode(d, *b)) for d, b in items[:50]]
        diff = [(c.int() - f.int()).abs() for f, c in full]
        result["cropped vs full decode's crop: max |diff|"] = max(int(x.max()) for x in diff)
        result["... fraction of values that differ"] = float(
            np.mean([(x > 0).float().mean().item() for x in diff])
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
