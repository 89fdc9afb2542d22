"""The evaluation loader: one pass over a labelled source, each sample once across ranks and
workers, resized and center-cropped (the shared stages are in `ssl_vit.data.stages`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

from ssl_vit.data import stages
from ssl_vit.data.images import eval_transform
from ssl_vit.data.shards import is_shard_spec, resolve_shards
from ssl_vit.data.sources import open_source
from ssl_vit.data.stages import Batch, Sample, Stats, StreamDataset

__all__ = ["eval_loader"]


def _batch_stage(
    items: Iterator[tuple[torch.Tensor, int, str, Any]],
    batch_size: int,
    image_size: int,
    stats: Stats,
) -> Iterator[Batch]:
    """Batches of `batch_size` (the last may be smaller), each carrying the skip counts since
    the previous one. A full batch is held until the next sample arrives, so skips at the very
    end of a stream are reported with its last batch rather than in an empty one."""

    def report(batch: Batch) -> Batch:
        batch = batch._replace(skipped=stats.skipped, skipped_shards=stats.skipped_shards)
        stats.skipped = stats.skipped_shards = 0
        return batch

    pending, buf = None, []
    for item in items:
        if pending is not None:
            yield report(pending)
            pending = None
        buf.append(item)
        if len(buf) == batch_size:
            pending, buf = stages.collate(buf, image_size), []
    if pending is not None or buf or stats.skipped or stats.skipped_shards:
        yield report(pending if pending is not None else stages.collate(buf, image_size))


@dataclass(eq=False)
class _PassStream(StreamDataset):
    """One pass for evaluation: subclasses yield this worker's share of the samples, in
    batches of `local_batch` (this process's)."""

    batch_field = "local_batch"
    local_batch: int = 0

    def _samples(self, worker: int, num_workers: int, stats: Stats) -> Iterator[Sample]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        stats = Stats()
        samples = ((s, None, None) for s in self._samples(worker, num_workers, stats))
        images = stages.decode_stage(
            samples, self.transform, stats, self.max_consecutive_failures, self.num_classes
        )
        return _batch_stage(images, self.local_batch, self.image_size, stats)


@dataclass(eq=False)
class _ShardStream(_PassStream):
    """One pass over tar shards, split by rank then worker."""

    urls: list[str] = field(default_factory=list)

    def _samples(self, worker: int, num_workers: int, stats: Stats) -> Iterator[Sample]:
        # Split the shards by rank, then by worker (`share`); [(offset, step)] filters the
        # samples of shared shards, whose errors only the unit keeping their sample 0 reports.
        urls, filters, owner = list(self.urls), [], True
        for index, count in ((self.rank, self.world_size), (worker, num_workers)):
            mine, keep, of = stages.share(len(urls), index, count)
            urls = urls[mine]
            if of > 1:
                filters.append((keep, of))
                owner = owner and keep == 0
        raw = itertools.chain.from_iterable(stages.shard_samples(url, stats, owner) for url in urls)
        for offset, step in filters:
            raw = itertools.islice(raw, offset, None, step)
        return (stages.to_sample(s, self.require_labels) for s in raw)


@dataclass(eq=False)
class _IndexedStream(_PassStream):
    """One pass over `indices` (all if None) of a random-access source (image folder, HF
    dataset, or shards by index)."""

    spec: str = ""
    indices: np.ndarray | None = None

    def _samples(self, worker: int, num_workers: int, stats: Stats) -> Iterator[Sample]:
        source = open_source(self.spec)  # opened per worker: pickles as a path
        order = np.arange(len(source)) if self.indices is None else np.unique(self.indices)
        for index, count in ((self.rank, self.world_size), (worker, num_workers)):
            mine, keep, _ = stages.share(len(order), index, count)
            order = order[mine] if keep == 0 else order[:0]
        for rec in source.iter_records(order):
            yield stages.record_sample(source, rec, self.require_labels)


def eval_loader(
    source: str,
    local_batch: int,
    image_size: int,
    *,
    num_workers: int = 2,
    rank: int = 0,
    world_size: int = 1,
    indices: Sequence[int] | np.ndarray | None = None,
    limit: int = 0,
    num_classes: int = 0,
) -> DataLoader:
    """One pass over a labelled source (shards, image folder, HF dataset), resize + center crop,
    in batches of `local_batch` on this process (a fine-tuning job's: `RunPlan.local_eval`).

    Each sample is delivered once across ranks x workers; the final partial batch is kept (one
    per worker). Shards are split by rank, then by worker; units outnumbering the shards share
    a shard sample by sample (`ssl_vit.data.stages.share`). Ranks may get different numbers of
    batches: gather with that in mind. `indices` restricts the pass to those samples (source
    order) and `limit` > 0 to the first N of them; both read shards by index instead of
    streaming them (few-shot decodes its support set so, in the workers).
    `num_classes` K > 0: samples labelled outside [0, K) are skipped and counted.
    """
    common = dict(
        local_batch=local_batch,
        image_size=image_size,
        transform=eval_transform(image_size),
        seed=0,
        rank=rank,
        world_size=world_size,
        require_labels=False,
        max_consecutive_failures=1000,
        num_classes=num_classes,
    )
    if indices is None and limit <= 0 and is_shard_spec(source):
        dataset: StreamDataset = _ShardStream(urls=resolve_shards(source), **common)
    else:
        n = len(open_source(source))  # also fails early, in the main process
        idx = np.arange(n) if indices is None else np.asarray(indices, dtype=np.int64)
        if limit > 0:
            idx = np.unique(idx)[:limit]
        dataset = _IndexedStream(spec=source, indices=idx, **common)
    return stages.make_loader(dataset, num_workers, persistent=False, prefetch=2)
