"""Endless training streams that resume exactly from a small position.

Each DataLoader worker of each rank plays one stream *role*; role r of rank R is reader unit
`R * num_workers + r` of `world_size * num_workers`. A unit's stream is a sequence of *visits*
(one shard, or one epoch of a random-access source), and its position is `(visit, n)`: the
first n samples of visit `visit` are consumed. Every random choice (which shard, the shuffle
of a block, each sample's augmentation) is seeded by (seed, unit, visit, place), never by a
running generator, so a stream restarted at a position yields exactly what the uninterrupted
stream would have yielded, at the cost of re-reading at most one shard.

Shards, non-resampled (default): epoch e visits the shards in a permutation seeded by (seed, e),
split over the units: with at least as many shards as units each unit reads its own shards
(`perm[unit::units]`); with fewer, each shard is shared by k units, each keeping every k-th
sample (k x the reading; a warning says so). Either way every sample is seen exactly once per
epoch across all ranks and workers. Resampled: each visit draws a shard with replacement.

Shuffling: within a visit, blocks of `shuffle_buffer` consecutive samples are permuted in
memory. Across shards, the epoch's shard permutation mixes; `make_shards` also writes samples in
a seeded random order, so a shard is already a random subset. The trade-off against a sliding
shuffle buffer: samples of one block share a shard, and resuming costs O(one shard), not O(all
samples seen).

The main process records, with `StreamTracker`, the position of each role's last *consumed*
batch (prefetched batches do not count) and which role comes next (DataLoader visits its workers
round-robin from worker 0); on resume, worker i plays role `(next + i) % num_workers`, so the
batch order continues as if never interrupted.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, get_worker_info

from ssl_vit.config.schema import FinetuneDataConfig, PretrainDataConfig, auto_num_workers
from ssl_vit.data.images import SquareLoad, train_transform
from ssl_vit.data.shards import is_shard_spec, read_index, resolve_shards
from ssl_vit.data.sources import open_source
from ssl_vit.data.stages import (
    Batch,
    Sample,
    Stats,
    StreamDataset,
    collate,
    decode_stage,
    make_loader,
    seed_of,
    shard_samples,
    to_sample,
)

__all__ = ["StreamTracker", "pretrain_loader", "train_loader"]

log = logging.getLogger(__name__)

# Stream ids mixed into seeds so shard choice, shuffling and augmentation draw independently.
_SHARDS, _SHUFFLE, _AUGMENT, _EPOCH, _RESEED = 1, 2, 3, 4, 5


def _chunks(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    """Consecutive lists of `size` items (the last may be shorter); itertools.batched in 3.12."""
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


@dataclass(eq=False)
class _ResumableStream(StreamDataset):
    """Base of the training streams: visits -> samples -> decode + augment -> full batches."""

    shuffle_buffer: int = 0
    start: dict[int, tuple[int, int]] = field(default_factory=dict)  # role -> position
    role_offset: int = 0  # worker i plays role (role_offset + i) % num_workers
    seeded: bool = True  # False: a deterministic transform, no per-sample RNG seeding

    def _visit(self, unit: int, units: int, v: int, stats: Stats) -> Iterator[Sample]:
        """The samples of visit `v` in stored order (shuffling happens in `_positions`)."""
        raise NotImplementedError

    def _positions(
        self, unit: int, units: int, first: int, skip: int, stats: Stats
    ) -> Iterator[tuple[Sample, int | None, tuple[int, int]]]:
        """(sample, augmentation seed, position after it), from position (first, skip) on.

        Raises after `max_consecutive_failures` visits in a row without a sample (all shards
        missing or empty), which would otherwise spin silently."""
        block, empty = max(self.shuffle_buffer, 1), 0
        for v in itertools.count(first):
            n = 0
            samples = self._visit(unit, units, v, stats)
            for b, chunk in enumerate(_chunks(samples, block)):
                n += len(chunk)
                if n <= skip:  # read past whole blocks consumed before the resume point
                    continue
                order = list(range(len(chunk)))
                random.Random(seed_of(self.seed, unit, v, b, _SHUFFLE)).shuffle(order)
                for j, i in enumerate(order):
                    place = b * block + j + 1
                    if place > skip:
                        aug = seed_of(self.seed, unit, v, place, _AUGMENT)
                        yield chunk[i], aug, (v, place)
            skip, empty = 0, 0 if n else empty + 1
            if empty >= self.max_consecutive_failures:
                raise RuntimeError(
                    f"no samples from the last {empty} shards (missing, unreadable or empty)"
                )

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        role = (self.role_offset + worker) % num_workers
        unit, units = self.rank * num_workers + role, self.world_size * num_workers
        stats = Stats()
        v, skip = self.start.get(role, (0, 0))
        samples = self._positions(unit, units, v, skip, stats)
        if not self.seeded:
            samples = ((s, None, position) for s, _, position in samples)
        items = decode_stage(
            samples, self.transform, stats, self.max_consecutive_failures, self.num_classes
        )
        # Each batch is sent as soon as it is full: its position then covers exactly the samples
        # it holds and the skips it reports, so nothing is counted twice after a resume.
        for chunk in _chunks(items, self.batch_size):
            batch = collate(chunk, self.image_size)
            yield batch._replace(
                skipped=stats.skipped,
                skipped_shards=stats.skipped_shards,
                role=role,
                position=chunk[-1][3],
            )
            stats.skipped = stats.skipped_shards = 0


@dataclass(eq=False)
class _ShardTrainStream(_ResumableStream):
    """Tar shards: epochs of seeded shard permutations split over units, or resampled."""

    urls: list[str] = field(default_factory=list)
    resampled: bool = False

    def _visit(self, unit: int, units: int, v: int, stats: Stats) -> Iterator[Sample]:
        n = len(self.urls)
        keep, of = 0, 1  # keep the samples i with i % of == keep
        if self.resampled:
            url = self.urls[random.Random(seed_of(self.seed, unit, v, _SHARDS)).randrange(n)]
        else:
            per_epoch = len(range(unit, n, units)) if n >= units else 1
            epoch, k = divmod(v, per_epoch)
            perm = np.random.default_rng(seed_of(self.seed, epoch, _EPOCH)).permutation(n)
            if n >= units:
                url = self.urls[perm[unit + k * units]]
            else:  # shard j is shared by units j, j + n, j + 2n, ...
                j = unit % n
                url, keep, of = self.urls[perm[j]], unit // n, len(range(j, units, n))
        # A shard shared by several units reports its errors once (from the unit keeping 0).
        for i, sample in enumerate(shard_samples(url, stats, count=keep == 0)):
            if i % of == keep:
                yield to_sample(sample, self.require_labels)


@dataclass(eq=False)
class _IndexedTrainStream(_ResumableStream):
    """A random-access source (image folder, HF dataset): visit v is epoch v, a permutation
    seeded by (seed, v) split over units."""

    spec: str = ""
    split: str | None = None

    def _visit(self, unit: int, units: int, v: int, stats: Stats) -> Iterator[Sample]:
        source = open_source(self.spec, self.split)  # opened per worker: pickles as a path
        order = np.random.default_rng(seed_of(self.seed, v, _EPOCH)).permutation(len(source))
        for i in order[unit::units].tolist():  # (iter_records would read them in sorted order)
            rec = source[i]
            label = None if self.require_labels and rec.label < 0 else rec.label
            yield Sample(rec.key, source.describe(i), rec.data or None, label)  # logs: the file


class StreamTracker:
    """Main-process record of a rank's training stream: per role, the position after the last
    consumed batch, and which role's batch comes next. `state_dict()` goes into the checkpoint;
    the loaders take it back as `resume=`."""

    def __init__(self, world_size: int, num_workers: int, resume: dict | None = None) -> None:
        self.layout = [world_size, max(num_workers, 1)]
        self.positions: dict[int, tuple[int, int]] = {}
        self.next_role = 0
        if resume is not None and resume.get("layout") == self.layout:
            # Roles rotate on resume (worker i plays role next + i): keep recording by role.
            self.positions = {int(r): tuple(p) for r, p in resume["positions"].items()}
            self.next_role = resume["next_role"]

    def update(self, batch: Batch) -> None:
        if batch.position is not None:
            self.positions[batch.role] = tuple(batch.position)
            self.next_role = (batch.role + 1) % self.layout[1]

    def state_dict(self) -> dict[str, Any]:
        return {
            "layout": list(self.layout),
            "positions": {r: list(p) for r, p in self.positions.items()},
            "next_role": self.next_role,
        }


def _resume_fields(resume: dict | None, world_size: int, num_workers: int) -> dict[str, Any]:
    """The dataset fields that restart a stream at a tracker's saved state."""
    if resume is None:
        return {}
    layout = [world_size, max(num_workers, 1)]
    if resume.get("layout") != layout:
        # Positions belong to reader units; with another layout they mean other samples.
        log.warning(
            "data stream saved with %s ranks x workers, resumed with %s: it restarts with a new "
            "seed (samples of the interrupted epoch may repeat or be missed)",
            resume.get("layout"),
            layout,
        )
        return {"reseed": True}
    start = {int(r): (int(p[0]), int(p[1])) for r, p in resume["positions"].items()}
    return {"start": start, "role_offset": int(resume["next_role"])}


# The fields of the data configs the loaders read (both job configs name them alike).
DataConfig = PretrainDataConfig | FinetuneDataConfig


def _resolved(data: DataConfig) -> DataConfig:
    """`data` with num_workers=-1 (auto) resolved (a loaded config is already; one built in
    code may not be)."""
    return dataclasses.replace(data, num_workers=auto_num_workers(data.num_workers))


def _train_fields(
    data: DataConfig,
    *,
    batch_size: int,
    image_size: int,
    seed: int,
    rank: int,
    world_size: int,
    resume: dict | None,
    require_labels: bool,
    max_consecutive_failures: int,
    load_size: int | None,
    num_classes: int = 0,
    randaugment: str = "",
) -> dict[str, Any]:
    """The `_ResumableStream` fields shared by the training streams; `load_size`: workers
    only decode and resize to it (the batch is augmented on the device), None: they augment."""
    fields = _resume_fields(resume, world_size, data.num_workers)
    if fields.pop("reseed", False):  # a stream unlike the one before (same seed: same order)
        seed = seed_of(seed, sum(p[0] for p in resume["positions"].values()), _RESEED)
    if load_size is None:
        transform = train_transform(image_size, data.crop_scale, data.hflip, randaugment, data.mean)
    else:
        image_size, transform = load_size, SquareLoad(load_size)
    return dict(
        batch_size=batch_size,
        image_size=image_size,
        transform=transform,
        seeded=load_size is None,
        seed=seed,
        rank=rank,
        world_size=world_size,
        require_labels=require_labels,
        max_consecutive_failures=max_consecutive_failures,
        num_classes=num_classes,
        **fields,
    )


def _shard_loader(
    urls: list[str], data: DataConfig, prefetch_factor: int, **stream: Any
) -> DataLoader:
    """The resumable stream over `urls`; `stream`: the `_train_fields` arguments."""
    units = stream["world_size"] * max(data.num_workers, 1)
    if not data.resampled and len(urls) < units:
        log.warning(
            "%d shards < %d ranks x workers: each shard is read by up to %d of them, each "
            "keeping its share of the samples (more reading); more, smaller shards avoid this",
            len(urls),
            units,
            -(-units // len(urls)),
        )
    dataset = _ShardTrainStream(
        urls=urls,
        resampled=data.resampled,
        shuffle_buffer=data.shuffle_buffer,
        **_train_fields(data, **stream),
    )
    return make_loader(dataset, data.num_workers, persistent=True, prefetch=prefetch_factor)


def pretrain_loader(
    data: PretrainDataConfig,
    *,
    batch_size: int,
    image_size: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    resume: dict | None = None,
    urls: Sequence[str] | None = None,
    labelled: bool = False,
    prefetch_factor: int = 2,
    max_consecutive_failures: int = 1000,
    load_size: int | None = None,
) -> DataLoader:
    """Endless augmented batches of `batch_size` (per process) from the shards of
    `data.train_shards` (or `urls`, shards already resolved), with `data`'s workers, shuffle
    buffer, crop scale, flip and resampling.

    Non-resampled: epochs, each sample once per epoch across all ranks and workers; resampled:
    shards drawn with replacement. Labels come from `.cls` when present (-1 otherwise); with
    `labelled=True` a sample without one is skipped. `resume`: a `StreamTracker.state_dict()`.
    `load_size`: batches of un-augmented uint8 [B,3,L,L] images for `DeviceAugment`.
    """
    urls = resolve_shards(data.train_shards) if urls is None else list(urls)
    data = _resolved(data)
    return _shard_loader(
        urls,
        data,
        prefetch_factor,
        batch_size=batch_size,
        image_size=image_size,
        seed=seed,
        rank=rank,
        world_size=world_size,
        resume=resume,
        require_labels=labelled,
        max_consecutive_failures=max_consecutive_failures,
        load_size=load_size,
    )


def train_loader(
    data: FinetuneDataConfig,
    *,
    batch_size: int,
    image_size: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    resume: dict | None = None,
    split: str | None = None,
    prefetch_factor: int = 2,
    max_consecutive_failures: int = 1000,
    load_size: int | None = None,
    num_classes: int = 0,
    randaugment: str = "",
) -> DataLoader:
    """Endless augmented labelled batches of `data.train` for fine-tuning, resumable like
    `pretrain_loader`. `num_classes` K > 0: samples labelled outside [0, K) are skipped and
    counted (a label the classifier head has no output for); `randaugment`: a timm RandAugment
    spec applied after crop and flip (worker-side augmentation only).

    Shards: as `pretrain_loader(..., labelled=True)`. An image folder or HF dataset: per epoch a
    permutation seeded by (seed, epoch), split by rank and worker (`shuffle_buffer` unused).
    `load_size`: as `pretrain_loader`.
    """
    source, data = data.train, _resolved(data)
    stream: dict[str, Any] = dict(
        batch_size=batch_size,
        image_size=image_size,
        seed=seed,
        rank=rank,
        world_size=world_size,
        resume=resume,
        require_labels=True,
        max_consecutive_failures=max_consecutive_failures,
        load_size=load_size,
        num_classes=num_classes,
        randaugment=randaugment,
    )
    if is_shard_spec(source):
        index = read_index(source)
        if index is not None and not index["label_names"]:
            raise ValueError(f"{source}: shards have no labels (index.json label_names is empty)")
        return _shard_loader(resolve_shards(source), data, prefetch_factor, **stream)
    source_obj = open_source(source, split)
    if not source_obj.label_names:
        raise ValueError(f"{source}: source has no labels")
    units = world_size * max(data.num_workers, 1)
    if len(source_obj) < units:
        raise ValueError(f"{source}: {len(source_obj)} samples < {units} ranks x workers")
    dataset = _IndexedTrainStream(spec=source, split=split, **_train_fields(data, **stream))
    return make_loader(dataset, data.num_workers, persistent=True, prefetch=prefetch_factor)
