"""Endless training streams that resume exactly, on any number of processes and workers.

The stream is `L` *lanes* (`data.lanes`, fixed for a run; auto: the largest divisor of the global
micro-batch up to 64 and up to the number of shards). Each global micro-batch takes
`global_micro / L` consecutive samples from every lane, in lane order; process R takes its
contiguous share of the lanes (its slice of the global micro-batch) and its loader workers split
that share again (`stream_state.lane_range`).
The main process puts its workers' shares side by side in worker order. So which sample sits
where in a global micro-batch is a function of the seed and the lanes only, never of the number of
processes or workers: a job continues exactly when resumed on another cluster shape.

A lane's stream is a sequence of *visits* (one shard, or one epoch of a random-access source),
and its position is `(visit, n)`: the first n samples of visit `visit` are consumed. Every random
choice is seeded from the job's seed and the place in the stream (`ssl_vit.seeds`), never by a
running generator: which shard (epoch e: a permutation seeded by (seed, e), lane l reading
`perm[l::L]`; fewer shards than lanes: each shard is shared by k lanes, each keeping every k-th
sample, k x the reading; resampled: a draw per (lane, visit)), the shuffle of a block, and each
sample's augmentation, seeded by the sample's identity (epoch, shard, index in the shard). A
restarted lane yields exactly what the uninterrupted one would have, at the cost of re-reading at
most one shard per lane. A sample that fails to decode is skipped within its lane (the lane's
next sample takes its place), so skips change nothing on another cluster shape either.

Shuffling: within a lane's visit, blocks of `shuffle_buffer / L` consecutive samples are
permuted in memory (the buffer is the stream's, shared by its lanes); a micro-batch mixes L
lanes (L shards); `make_shards` writes samples in a seeded random order, so a shard is already
a random subset. Auto lanes are at most one per shard (no shard read twice); with a shard count
that is a multiple of L, every lane's epoch holds as many shards, and epochs end together.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ssl_vit import seeds
from ssl_vit.config.schema import FinetuneDataConfig, PretrainDataConfig
from ssl_vit.data import stages
from ssl_vit.data.assembled import TrainLoader
from ssl_vit.data.images import SquareLoad, train_transform
from ssl_vit.data.shards import is_shard_spec, resolve_shards
from ssl_vit.data.sources import open_source
from ssl_vit.data.stages import Batch, Sample, Stats, StreamDataset
from ssl_vit.data.stream_state import StreamArgs, lane_range, source_id, start_stream
from ssl_vit.errors import ConfigError, InputError

__all__ = ["pretrain_loader", "train_loader"]

log = logging.getLogger(__name__)

SampleId = tuple[int, ...]  # a sample's place in the global stream (seeds its augmentation)


def _chunks(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    """Consecutive lists of `size` items (the last may be shorter); itertools.batched in 3.12."""
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


@dataclass(eq=False)
class _LaneStream(StreamDataset):
    """Base of the training streams: lanes of visits -> samples -> decode + augment -> chunks.
    `global_micro`: the global micro-batch (all processes); a worker yields its lanes' share
    of each."""

    batch_field = "global_micro"
    global_micro: int = 0
    lanes: int = 1
    shuffle_buffer: int = 0
    start: dict[int, tuple[int, int]] = field(default_factory=dict)  # lane -> position
    seeded: bool = True  # False: a deterministic transform, no per-sample RNG seeding

    def _visit(self, lane: int, v: int, stats: Stats) -> Iterator[tuple[Sample, SampleId]]:
        """The samples of lane `lane`'s visit `v` in stored order, with their identities."""
        raise NotImplementedError

    def _positions(
        self, lane: int, first: int, skip: int, stats: Stats
    ) -> Iterator[tuple[Sample, int | None, tuple[int, int]]]:
        """(sample, augmentation seed, position after it), from position (first, skip) on.

        Raises after `max_consecutive_failures` visits in a row without a sample (all shards
        missing or empty), which would otherwise spin silently."""
        # The buffer is the stream's: each lane holds its share in memory.
        block, empty = max(self.shuffle_buffer // self.lanes, 1), 0
        for v in itertools.count(first):
            n = 0
            samples = self._visit(lane, v, stats)
            for b, chunk in enumerate(_chunks(samples, block)):
                n += len(chunk)
                if n <= skip:  # read past whole blocks consumed before the resume point
                    continue
                order = list(range(len(chunk)))
                random.Random(seeds.derive(self.seed, seeds.SHUFFLE, lane, v, b)).shuffle(order)
                for j, i in enumerate(order):
                    place = b * block + j + 1
                    if place > skip:
                        sample, sid = chunk[i]
                        aug = seeds.derive(self.seed, seeds.AUGMENT, *sid) if self.seeded else None
                        yield sample, aug, (v, place)
            skip, empty = 0, 0 if n else empty + 1
            if empty >= self.max_consecutive_failures:
                raise InputError(
                    f"no samples from the last {empty} shards (missing, unreadable or empty)"
                )

    def _lane(self, lane: int, stats: Stats) -> Iterator[tuple[torch.Tensor, int, str, Any]]:
        v, skip = self.start.get(lane, (0, 0))
        samples = self._positions(lane, v, skip, stats)
        return stages.decode_stage(
            samples, self.transform, stats, self.max_consecutive_failures, self.num_classes
        )

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = lane_range(self.lanes, self.rank, self.world_size, worker, workers)
        stats = {lane: Stats() for lane in mine}
        streams = {lane: self._lane(lane, stats[lane]) for lane in mine}
        per_lane = self.global_micro // self.lanes
        # One message per `workers` micro-batches: this worker's share of each (per_lane samples
        # of each of its lanes, in lane order), micro-batch after micro-batch, and `position` the
        # list of its lanes' positions after each. A message costs the DataLoader about a
        # millisecond whatever its size, so a worker sends as many as if it made whole batches.
        while True:
            items, positions = [], []
            for _ in range(workers):
                position = {}
                for lane in mine:
                    got = list(itertools.islice(streams[lane], per_lane))
                    items += got
                    position[lane] = got[-1][3]
                positions.append(position)
            yield stages.collate(items, self.image_size)._replace(
                skipped=sum(s.skipped for s in stats.values()),
                skipped_shards=sum(s.skipped_shards for s in stats.values()),
                position=positions,
            )
            for s in stats.values():
                s.skipped = s.skipped_shards = 0


@dataclass(eq=False)
class _ShardTrainStream(_LaneStream):
    """Tar shards: epochs of seeded shard permutations split over lanes, or resampled."""

    urls: list[str] = field(default_factory=list)
    resampled: bool = False

    def _visit(self, lane: int, v: int, stats: Stats) -> Iterator[tuple[Sample, SampleId]]:
        n, lanes = len(self.urls), self.lanes
        keep, of = 0, 1  # keep the samples i with i % of == keep
        if self.resampled:
            j = random.Random(seeds.derive(self.seed, seeds.SHARDS, lane, v)).randrange(n)
            url, sid = self.urls[j], (lane, v)
        else:  # an epoch: this lane's share of a permutation of the shards
            mine, keep, of = stages.share(n, lane, lanes)
            epoch, k = divmod(v, len(range(n)[mine]))
            perm = np.random.default_rng(seeds.derive(self.seed, seeds.EPOCH, epoch)).permutation(n)
            j = range(n)[mine][k]
            url, sid = self.urls[perm[j]], (epoch, int(perm[j]))
        # A shard shared by several lanes reports its errors once (from the lane keeping 0).
        for i, sample in enumerate(stages.shard_samples(url, stats, count=keep == 0)):
            if i % of == keep:
                yield stages.to_sample(sample, self.require_labels), (*sid, i)


@dataclass(eq=False)
class _IndexedTrainStream(_LaneStream):
    """A random-access source (image folder, HF dataset): visit v is epoch v, a permutation
    seeded by (seed, v) split over lanes."""

    spec: str = ""
    labels: str = "required"  # an image folder's class folders (`FolderSource`)
    _source: Any = field(default=None, init=False, repr=False)

    def _visit(self, lane: int, v: int, stats: Stats) -> Iterator[tuple[Sample, SampleId]]:
        if self._source is None:  # opened once in each worker, not at every lane's visit
            self._source = open_source(self.spec, labels=self.labels)  # pickles as a path
        source = self._source
        perm = np.random.default_rng(seeds.derive(self.seed, seeds.EPOCH, v)).permutation
        for i in perm(len(source))[lane :: self.lanes].tolist():  # (not iter_records: sorted)
            yield stages.record_sample(source, source[i], self.require_labels), (v, i)


# The fields of the data configs the loaders read (both job configs name them alike).
DataConfig = PretrainDataConfig | FinetuneDataConfig


def _build(
    make: Any,
    data: DataConfig,
    stream: StreamArgs,
    identity: dict[str, Any],
    key: str,
    *,
    randaugment: str = "",
    paired: bool = False,
    records: int = 0,
    **fields: Any,
) -> TrainLoader:
    """The `TrainLoader` of dataset class `make`; `identity`: what the saved stream must match
    to be continued, `key`: the config key naming the data; `records` > 0: the samples of an
    indexed source (at least one per lane)."""
    s = stream
    # Auto lanes: at most one per shard, or per sample of an indexed source (a label budget's
    # few images), so that every lane has something to read.
    cap = len(fields.get("urls", ())) or records
    lanes, start, tracker = start_stream(s, data.lanes, identity, key, cap, paired)
    if records and records < lanes:
        raise ConfigError(
            f"{fields['spec']}: {records} samples < {lanes} lanes (data.lanes); set data.lanes "
            f"to at most {records}, a divisor of the global micro-batch {s.global_micro}"
        )
    workers, per_rank = s.num_workers, lanes // s.world_size
    if workers > per_rank:
        log.info("data: %d lanes per process, so %d loader workers", per_rank, per_rank)
        workers = per_rank
    image_size = s.image_size
    if s.load_size is None:
        transform = train_transform(image_size, data.crop_scale, data.hflip, randaugment, data.mean)
    else:
        image_size, transform = s.load_size, SquareLoad(s.load_size)
    dataset = make(
        global_micro=s.global_micro,
        image_size=image_size,
        transform=transform,
        seeded=s.load_size is None,
        seed=s.seed,
        rank=s.rank,
        world_size=s.world_size,
        max_consecutive_failures=s.max_consecutive_failures,
        lanes=lanes,
        shuffle_buffer=data.shuffle_buffer,
        start=start,
        **fields,
    )
    # With several workers `assembled._Assembled` copies their shares into pinned memory itself.
    loader = stages.make_loader(dataset, workers, persistent=True, prefetch=2, pin=workers <= 1)
    return TrainLoader(loader, tracker)


def _shard_loader(
    urls: list[str], data: DataConfig, stream: StreamArgs, key: str, **fields: Any
) -> TrainLoader:
    if 0 < data.lanes and len(urls) < data.lanes and not data.resampled:
        log.warning(
            "%d shards < data.lanes=%d: each shard is read by up to %d lanes, each keeping its "
            "share of the samples (more reading); more, smaller shards avoid this",
            *(len(urls), data.lanes, -(-data.lanes // len(urls))),
        )
    identity = {
        "source": source_id(urls),
        "resampled": data.resampled,
        "shuffle_buffer": data.shuffle_buffer,
    }
    fields.update(urls=urls, resampled=data.resampled)
    return _build(_ShardTrainStream, data, stream, identity, key, **fields)


def pretrain_loader(
    data: PretrainDataConfig, stream: StreamArgs, urls: Sequence[str] | None = None
) -> TrainLoader:
    """Endless augmented batches (this process's share of each global micro-batch) from the
    shards of `data.train_shards` (or `urls`, shards already resolved), with `data`'s lanes,
    shuffle buffer, crop scale, flip and resampling.

    Non-resampled: epochs, each sample once per epoch (per lane: lanes of equal shares end
    their epochs together); resampled: shards drawn with replacement. Labels come from `.cls`
    when present (-1 otherwise).
    """
    urls = resolve_shards(data.train_shards) if urls is None else list(urls)
    return _shard_loader(urls, data, stream, "data.train_shards", require_labels=False)


def train_loader(
    data: FinetuneDataConfig,
    stream: StreamArgs,
    *,
    num_classes: int = 0,
    randaugment: str = "",
    paired: bool = False,
    source: str | None = None,
) -> TrainLoader:
    """Endless augmented labelled batches of `data.train` for fine-tuning, resumable like
    `pretrain_loader`. `num_classes` K > 0: samples labelled outside [0, K) are skipped and
    counted (a label the classifier head has no output for); `randaugment`: a timm RandAugment
    spec applied after crop and flip (worker-side augmentation only); `paired`: mixup / cutmix
    pair images within a lane's share of the micro-batch (`lane_share`), which must be even.
    `source`: the unlabelled images of self-training (`distill.unlabelled`) instead, with the
    same augmentation; their labels, if any, are not read.

    Shards: as `pretrain_loader`, a sample without a label skipped. An image folder or HF
    dataset: per epoch a permutation seeded by (seed, epoch), split over the lanes. That the
    labelled source has labels at all is checked before the job starts
    (`preflight.check_labelled_source`).
    """
    labelled = source is None
    source, key = (data.train, "data.train") if labelled else (source, "distill.unlabelled")
    fields: dict[str, Any] = dict(
        require_labels=labelled,
        num_classes=num_classes if labelled else 0,
        randaugment=randaugment,
        paired=paired,
    )
    if is_shard_spec(source):
        return _shard_loader(resolve_shards(source), data, stream, key, **fields)
    # Unlabelled images: every image of a folder, those beside its class folders too.
    folder_labels = "required" if labelled else "ignored"
    source_obj = open_source(source, labels=folder_labels)
    identity = {
        "source": f"{len(source_obj)} records/{source_id([source])}",
        "shuffle_buffer": data.shuffle_buffer,
    }
    fields.update(spec=source, records=len(source_obj), labels=folder_labels)
    return _build(_IndexedTrainStream, data, stream, identity, key, **fields)
