"""The loaders' shared stages and the evaluation loader: encoded images -> decoded uint8 batches.

Everything per sample (reading, decoding, augmenting, batching) runs in the DataLoader workers;
the main process receives ready `Batch`es. Images stay uint8 end to end: normalization happens
later on the accelerator, and uint8 batches are 4x cheaper to pin and copy than float32.

A sample that fails to decode is skipped, counted in `Batch.skipped` and logged (the first 10,
then every 1000th); after `max_consecutive_failures` failures in a row the loader raises instead
of spinning. The endless, resumable training streams are in `ssl_vit.data.train_stream`.
"""

from __future__ import annotations

import itertools
import logging
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ssl_vit.data.images import decode_image, eval_transform
from ssl_vit.data.shards import IMAGE_EXTENSIONS, is_shard_spec, resolve_shards
from ssl_vit.data.sources import open_source

__all__ = ["Batch", "eval_loader", "make_loader"]

log = logging.getLogger(__name__)


class Batch(NamedTuple):
    """One batch (a NamedTuple, so DataLoader pins it field by field).

    images: uint8 [B,3,S,S] RGB, not normalized.
    labels: int64 [B], -1 where unlabelled.
    skipped: samples this worker failed to decode since its previous batch; summing over all
        batches (from all workers) gives the total.
    skipped_shards: tar-level errors (missing, unreadable or truncated shard), counted alike.
    keys: the samples' keys.
    worker: the stream role that made it (training streams; see `train_stream.StreamTracker`).
    position: that stream's position after the batch's last sample (training streams).
    B is 0 only in a batch that reports the skips of a worker whose whole share failed.
    """

    images: torch.Tensor
    labels: torch.Tensor
    skipped: int = 0
    skipped_shards: int = 0
    keys: list[str] | None = None
    worker: int = 0
    position: tuple[int, int] | None = None


def seed_of(*parts: int) -> int:
    return int(np.random.SeedSequence([p % 2**32 for p in parts]).generate_state(1)[0])


def _rate_limited(count: int) -> bool:
    return count <= 10 or count % 1000 == 0


@dataclass
class _Stats:
    """Per-worker counters shared by the stages of one stream."""

    skipped: int = 0  # since the last batch
    skipped_shards: int = 0  # since the last batch
    total_skipped: int = 0
    total_shard_errors: int = 0
    consecutive_failures: int = 0


class _Sample(NamedTuple):
    key: str
    url: str
    data: bytes | None  # None: no image member
    label: int | None  # None: a required label is missing


def _seeded(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, seed: int | None):
    """`fn(x)` with the global torch CPU RNG seeded by `seed` (None: as is), then restored.

    torchvision v2 draws from the global torch RNG; seeding it per sample makes an augmentation
    depend only on the sample's place in the stream (so a resumed stream repeats it exactly),
    and leaves the caller's RNG (model init, dropout) untouched when num_workers=0.
    """
    if seed is None:
        return fn(x)
    outer = torch.get_rng_state()
    torch.default_generator.manual_seed(seed)  # CPU only: never touches the CUDA generators
    try:
        return fn(x)
    finally:
        torch.set_rng_state(outer)


class _ShardErrorHandler:
    """WebDataset exception handler: count and log tar-level errors, then go on."""

    def __init__(self, stats: _Stats, count: bool) -> None:
        self.stats, self.count = stats, count  # count=False: another unit reports this shard

    def __call__(self, exn: Exception) -> bool:
        if self.count:
            self.stats.skipped_shards += 1
            self.stats.total_shard_errors += 1
            if _rate_limited(self.stats.total_shard_errors):
                log.warning("skipping (rest of) shard after %s: %s", type(exn).__name__, exn.args)
        return True


def _split_for_eval(
    urls: list[str], rank: int, world_size: int, worker: int, num_workers: int
) -> tuple[list[str], list[tuple[int, int]], bool]:
    """One pass, each sample once: split shards by rank, then by worker. A level with fewer
    shards than units splits the sample stream by index modulo instead (every unit of that
    level reads all its shards), so no unit is left without data.

    Returns (shards to read, [(offset, step)] sample filters, whether to report shard errors).
    """
    shards, filters, owner = list(urls), [], True
    for index, count in ((rank, world_size), (worker, num_workers)):
        if count == 1:
            continue
        if len(shards) >= count:
            shards = shards[index::count]
        else:
            filters.append((index, count))
            owner = owner and index == 0
    return shards, filters, owner


def _to_sample(sample: dict[str, Any], require_label: bool) -> _Sample:
    ext = next((e for e in IMAGE_EXTENSIONS if e in sample), None)
    try:
        label: int | None = int(sample["cls"])
    except (KeyError, ValueError):
        label = None if require_label else -1
    return _Sample(sample["__key__"], sample.get("__url__", ""), sample.get(ext), label)


def _decode_stage(
    samples: Iterator[tuple[_Sample, int | None, Any]],
    transform: Callable,
    stats: _Stats,
    limit: int,
) -> Iterator[tuple[torch.Tensor, int, str, Any]]:
    """(sample, augmentation seed, tag) -> (image, label, key, tag), skipping bad samples."""
    for s, aug_seed, tag in samples:
        try:
            if s.data is None:
                raise ValueError("no image member")
            if s.label is None:
                raise ValueError("no valid .cls label")
            image = _seeded(transform, decode_image(s.data), aug_seed)
        except Exception as e:  # any bad sample is skipped, whatever the decoder raised
            stats.skipped += 1
            stats.total_skipped += 1
            stats.consecutive_failures += 1
            if _rate_limited(stats.total_skipped):
                log.warning(
                    "skipping sample %s in %s: %s: %s (%d skipped by this worker)",
                    s.key,
                    s.url,
                    type(e).__name__,
                    e,
                    stats.total_skipped,
                )
            if stats.consecutive_failures >= limit:
                raise RuntimeError(
                    f"{limit} samples in a row failed to decode (last: {s.key} in {s.url}: {e}); "
                    "is the data corrupt or not images?"
                ) from e
            continue
        stats.consecutive_failures = 0
        yield image, s.label, s.key, tag


def _collate(items: list[tuple[torch.Tensor, int, str, Any]], image_size: int) -> Batch:
    if not items:
        empty = torch.empty((0, 3, image_size, image_size), dtype=torch.uint8)
        return Batch(empty, torch.empty(0, dtype=torch.int64), keys=[])
    images, labels, keys, _ = zip(*items, strict=True)
    return Batch(torch.stack(images), torch.tensor(labels, dtype=torch.int64), keys=list(keys))


def _batch_stage(
    items: Iterator[tuple[torch.Tensor, int, str, Any]],
    batch_size: int,
    image_size: int,
    stats: _Stats,
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
            pending, buf = _collate(buf, image_size), []
    if pending is not None or buf or stats.skipped or stats.skipped_shards:
        yield report(pending if pending is not None else _collate(buf, image_size))


@dataclass(eq=False)
class _Stream(IterableDataset):
    """Base of the loaders' datasets."""

    batch_size: int
    image_size: int
    transform: Callable
    seed: int
    rank: int
    world_size: int
    require_labels: bool
    max_consecutive_failures: int

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got {self.rank}, {self.world_size}")


@dataclass(eq=False)
class _PassStream(_Stream):
    """One pass for evaluation: subclasses yield this worker's share of the samples."""

    def _samples(self, worker: int, num_workers: int, stats: _Stats) -> Iterator[_Sample]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        stats = _Stats()
        samples = ((s, None, None) for s in self._samples(worker, num_workers, stats))
        images = _decode_stage(samples, self.transform, stats, self.max_consecutive_failures)
        return _batch_stage(images, self.batch_size, self.image_size, stats)


@dataclass(eq=False)
class _ShardStream(_PassStream):
    """One pass over tar shards, split by rank then worker."""

    urls: list[str] = field(default_factory=list)

    def _samples(self, worker: int, num_workers: int, stats: _Stats) -> Iterator[_Sample]:
        urls, filters, owner = _split_for_eval(
            self.urls, self.rank, self.world_size, worker, num_workers
        )
        shards = iter([{"url": url} for url in urls])
        raw = wds.tarfile_samples(shards, handler=_ShardErrorHandler(stats, owner))
        for offset, step in filters:
            raw = itertools.islice(raw, offset, None, step)
        return (_to_sample(s, self.require_labels) for s in raw)


@dataclass(eq=False)
class _IndexedStream(_PassStream):
    """One pass over `indices` (all if None) of a random-access source (image folder, HF
    dataset, or shards by index)."""

    spec: str = ""
    split: str | None = None
    indices: np.ndarray | None = None

    def _samples(self, worker: int, num_workers: int, stats: _Stats) -> Iterator[_Sample]:
        source = open_source(self.spec, self.split)  # opened per worker: pickles as a path
        order = np.arange(len(source)) if self.indices is None else np.unique(self.indices)
        for rec in source.iter_records(order[self.rank :: self.world_size][worker::num_workers]):
            label = None if self.require_labels and rec.label < 0 else rec.label
            yield _Sample(rec.key, f"{self.spec}", rec.data or None, label)


def _ignore_stop_signals(_: int) -> None:
    # SIGINT (Ctrl-C reaches the whole process group) and SIGTERM (preemption) are the main
    # process's to handle: it finishes the step and checkpoints while the workers keep serving.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def make_loader(dataset: _Stream, num_workers: int, persistent: bool, prefetch: int) -> DataLoader:
    """A DataLoader that only moves the workers' ready `Batch`es (batch_size=None)."""
    # Its own generator: DataLoader draws a base seed per iterator, which would consume the
    # global RNG.
    return DataLoader(
        dataset,
        batch_size=None,
        generator=torch.Generator().manual_seed(seed_of(dataset.seed, dataset.rank)),
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=persistent and num_workers > 0,
        prefetch_factor=prefetch if num_workers > 0 else None,
        worker_init_fn=_ignore_stop_signals if num_workers > 0 else None,
    )


def eval_loader(
    source: str,
    batch_size: int,
    image_size: int,
    *,
    num_workers: int = 2,
    rank: int = 0,
    world_size: int = 1,
    split: str | None = None,
    indices: Sequence[int] | np.ndarray | None = None,
    limit: int = 0,
    max_consecutive_failures: int = 1000,
) -> DataLoader:
    """One pass over a labelled source (shards, image folder, HF dataset), resize + center crop.

    Each sample is delivered once across ranks x workers; the final partial batch is kept (one
    per worker). Shards are split by rank, then by worker; with fewer shards than units the
    samples are split by index modulo instead. Ranks may get different numbers of batches:
    gather with that in mind. `indices` restricts the pass to those samples (source order) and
    `limit` > 0 to the first N of them; both read shards by index instead of streaming them.
    """
    common = dict(
        batch_size=batch_size,
        image_size=image_size,
        transform=eval_transform(image_size),
        seed=0,
        rank=rank,
        world_size=world_size,
        require_labels=False,
        max_consecutive_failures=max_consecutive_failures,
    )
    if indices is None and limit <= 0 and is_shard_spec(source):
        dataset: _Stream = _ShardStream(urls=resolve_shards(source), **common)
    else:
        n = len(open_source(source, split))  # also fails early, in the main process
        idx = np.arange(n) if indices is None else np.asarray(indices, dtype=np.int64)
        if limit > 0:
            idx = np.unique(idx)[:limit]
        dataset = _IndexedStream(spec=source, split=split, indices=idx, **common)
    return make_loader(dataset, num_workers, persistent=False, prefetch=2)
