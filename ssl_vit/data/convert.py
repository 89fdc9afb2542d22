"""Copy an image folder or a Hugging Face dataset into shards (`ssl-vit make-shards`).

Kept apart from `shards` (the format) and `sources` (reading collections), which it joins:
both import only downward, so the data layer has no import cycle.
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any

import numpy as np
from PIL import Image

from ssl_vit.data.decode import check_pixels
from ssl_vit.data.shards import ShardWriter
from ssl_vit.data.sources import open_raw_source
from ssl_vit.progress import progress_iter

__all__ = ["image_error", "make_shards"]

log = logging.getLogger(__name__)


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
        return f"{type(e).__name__}: {e}"
    return None


def make_shards(
    source: str | os.PathLike,
    output: str | os.PathLike,
    shard_size: int = 10000,
    verify: bool = True,
    *,
    split: str = "train",
    source_format: str = "auto",
    shuffle_seed: int | None = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Copy an image folder or Hugging Face dataset into shards in `output`; return the index.

    `source_format`: "auto" (an HF `save_to_disk` directory if it has dataset_info.json,
    state.json or dataset_dict.json, else an image folder), "folder", "hf" (`load_from_disk`)
    or "hf-imagefolder" (`datasets.load_dataset("imagefolder")`). An image folder with class
    sub-folders is labelled (sorted names -> 0..K-1), else its top-level images are unlabelled.
    `split` picks the split of a DatasetDict. Images are copied byte for byte; with `verify`,
    files PIL cannot parse (including empty files) are skipped, logged and counted in
    `num_skipped`.

    Files are listed in sorted order, then written in the order of a permutation seeded by
    `shuffle_seed` (None: sorted order): a class-sorted stream would put one class in each
    shard, which shard resampling and a small shuffle buffer cannot mix back.
    """
    src = open_raw_source(str(source), split=split, source_format=source_format)
    if len(src) == 0:
        raise ValueError(f"no images found in {source}")
    order = range(len(src))
    if shuffle_seed is not None:
        order = np.random.default_rng(shuffle_seed).permutation(len(src)).tolist()
    labelled = bool(src.label_names)
    skipped = 0
    with ShardWriter(output, shard_size) as writer:
        for i in progress_iter(order, len(order), desc="make-shards", unit="img", enabled=progress):
            rec = src[i]
            error = image_error(rec.data) if verify or not rec.data else None
            if error is not None:
                skipped += 1
                log.warning("skipping %s: %s", src.describe(i), error)
                continue
            writer.write(rec.key, rec.ext or "png", rec.data, rec.label if labelled else None)
        if skipped == len(src):
            raise ValueError(f"all {skipped} images in {source} failed verification")
        return writer.close(
            label_names=src.label_names,
            source=os.path.abspath(source),
            num_skipped=skipped,
            shuffle_seed=shuffle_seed,
        )
