"""The prediction stream: one pass over any source (image folder, shards, HF dataset), every
image once across processes and workers, in batches that know their place in the source.

The source is cut into global batches of `batch_size` consecutive images; batch g goes to
process g mod R and, within it, to loader worker (g // R) mod W. A DataLoader serves its
workers' batches round-robin, so each process receives its batches in increasing g, and the
main process can write the rows of batches g = iR .. iR + R - 1 after round i: the source's
order whatever the process and worker count, with memory that does not grow with the source.
An unreadable image is dropped from its batch and named in `PredictBatch.skipped`; every g
yields one batch, empty if all its images failed, so the rounds stay aligned.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ssl_vit.data.decode import decode_image, unreadable_reason
from ssl_vit.data.image_source import ImageSource
from ssl_vit.data.images import eval_transform
from ssl_vit.data.sources import FolderSource, open_source
from ssl_vit.data.stages import collate, make_loader, rate_limited

__all__ = ["PredictBatch", "num_batches", "open_predict_source", "predict_loader"]

log = logging.getLogger(__name__)
_CHUNK = 256  # batches whose indices a worker asks its source for at once (memory stays flat)


class PredictBatch(NamedTuple):
    """Global batch `index` of the source: its readable images (uint8 [n, 3, S, S]), their
    names (a folder's relative paths, else the sample keys) and labels (-1: none), and the
    (name, reason) of each image that could not be read."""

    index: int
    images: torch.Tensor
    names: list[str]
    labels: torch.Tensor
    skipped: list[tuple[str, str]]


def num_batches(num_images: int, batch_size: int) -> int:
    return math.ceil(num_images / batch_size)


@dataclass(eq=False)
class _PredictDataset(IterableDataset):
    spec: str
    num_images: int
    batch_size: int
    image_size: int
    rank: int
    world_size: int
    label_map: list[int] | None = None  # the source's label i -> label_map[i]; None: unlabelled
    seed: int = 0  # make_loader's; nothing here is random
    skipped: int = 0  # this worker's, for rate-limited logging

    def __iter__(self) -> Iterator[PredictBatch]:
        source = open_predict_source(self.spec, self.label_map is None)  # per worker: a path
        if isinstance(source, FolderSource) and len(source) != self.num_images:
            raise RuntimeError(
                f"{self.spec}: {len(source)} images, {self.num_images} when the job started "
                "(files added or removed meanwhile)"
            )
        transform = eval_transform(self.image_size)
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        R, n = self.world_size, num_batches(self.num_images, self.batch_size)
        mine = range(self.rank + worker * R, n, workers * R)  # this worker's global batches
        for start in range(0, len(mine), _CHUNK):
            yield from self._batches(source, transform, mine[start : start + _CHUNK])

    def _batches(self, source: ImageSource, transform, batches: range) -> Iterator[PredictBatch]:
        B = self.batch_size
        idx = np.concatenate([np.arange(g * B, min((g + 1) * B, self.num_images)) for g in batches])
        records = source.iter_records(idx)  # ascending index order, so batch by batch
        for g in batches:
            items, skipped = [], []
            for _ in range(min((g + 1) * B, self.num_images) - g * B):
                rec = next(records)
                name = source.name(rec)
                try:
                    if not rec.data:
                        raise ValueError("no image data")
                    label = self.label_map[rec.label] if self.label_map and rec.label >= 0 else -1
                    items.append((transform(decode_image(rec.data)), label, name, None))
                except Exception as e:  # any unreadable image: named, counted, never a crash
                    skipped.append((name, unreadable_reason(e)))
                    self.skipped += 1
                    if rate_limited(self.skipped):
                        log.warning("skipping %s: %s", name, skipped[-1][1])
            batch = collate(items, self.image_size)
            yield PredictBatch(g, batch.images, batch.keys, batch.labels, skipped)


def open_predict_source(spec: str, ignore_labels: bool) -> ImageSource:
    """The source predict reads: every image in it. A folder's images outside its class
    folders are predicted without a true label (label -1); with `ignore_labels`, every image
    under the folder, none labelled (`FolderSource`'s "optional" and "ignored")."""
    return open_source(spec, labels="ignored" if ignore_labels else "optional")


def predict_loader(
    spec: str,
    num_images: int,
    batch_size: int,
    image_size: int,
    *,
    num_workers: int,
    rank: int = 0,
    world_size: int = 1,
    label_map: list[int] | None = None,
) -> DataLoader:
    """This process's batches of `spec` (global batches g = rank, rank + R, ...), in order,
    each image resized and centre-cropped by the evaluation transform (`eval_transform`).
    `label_map`: the source's label i is class label_map[i] (None: the source is read as
    unlabelled, `open_predict_source(spec, ignore_labels=True)`, every label -1).
    `num_images`: `len(open_predict_source(...))` of the same reading."""
    dataset = _PredictDataset(spec, num_images, batch_size, image_size, rank, world_size, label_map)
    return make_loader(dataset, num_workers, persistent=False, prefetch=2)
