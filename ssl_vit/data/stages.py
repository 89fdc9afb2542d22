"""The stages every loader shares: sample records, decoding, batching, the DataLoader itself.

Everything per sample (reading, decoding, augmenting, batching) runs in the DataLoader workers;
the main process receives ready `Batch`es. Images stay uint8 end to end: normalization happens
later on the accelerator, and uint8 batches are 4x cheaper to pin and copy than float32.

The workers ignore SIGTERM / SIGINT (the main process handles a stop), so multiprocessing's exit
handler, which terminates them with SIGTERM and then waits, would wait forever on a loader still
alive when a script ends: every loader made here (`WorkerLoader`) ends its workers on `close()`,
at the end of a `with` block, when it and its iterators are deleted, and at interpreter exit,
before that handler.

A sample that fails to decode is skipped, counted in `Batch.skipped` and logged (the first 10,
then every 1000th); after `max_consecutive_failures` failures in a row the loader raises instead
of spinning. The one-pass evaluation loader is in `ssl_vit.data.eval_stream`, the endless,
resumable training streams in `ssl_vit.data.train_stream`.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util  # noqa: F401 - its exit handler is registered before ours (below)
import signal
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.signal_handling import _remove_worker_pids

from ssl_vit import seeds
from ssl_vit.data.decode import decode_image, unreadable_reason
from ssl_vit.data.format import sample_fields
from ssl_vit.data.tar import tar_groups
from ssl_vit.errors import InputError
from ssl_vit.watchdog import track_loader

__all__ = [
    "Batch",
    "Sample",
    "Stats",
    "StreamDataset",
    "WorkerLoader",
    "collate",
    "decode_stage",
    "end_workers",
    "make_loader",
    "rate_limited",
    "record_sample",
    "shard_samples",
    "share",
    "to_sample",
]

log = logging.getLogger(__name__)


class Batch(NamedTuple):
    """One batch (a NamedTuple, so DataLoader pins it field by field).

    images: uint8 [B,3,S,S] RGB, not normalized.
    labels: int64 [B], -1 where unlabelled.
    skipped: samples this worker failed to decode since its previous batch; summing over all
        batches (from all workers) gives the total.
    skipped_shards: tar-level errors (missing, unreadable or truncated shard), counted alike.
    keys: the samples' keys.
    position: training streams: {lane: its position after the batch} (`train_stream`).
    B is 0 only in an evaluation batch that reports the skips of a worker whose whole share
    failed.
    """

    images: torch.Tensor
    labels: torch.Tensor
    skipped: int = 0
    skipped_shards: int = 0
    keys: list[str] | None = None
    position: dict[int, tuple[int, int]] | None = None


def share(n: int, unit: int, units: int) -> tuple[slice, int, int]:
    """The share of unit `unit` of `units` (a rank, a worker, a lane) of `n` items (shards, or
    samples): (the slice of the items it reads, keep, of): of each item it reads, it keeps the
    samples i with i % of == keep. The one way the loaders split a source.

    With at least as many items as units, unit u reads items u, u + units, ... whole. With fewer,
    unit u reads item u % n and shares it with the other units reading that item, sample by
    sample: no unit is left without data, no item is read by all, each sample goes to one unit.
    (An item of one sample, an index, is then kept only by the unit with keep 0.)
    """
    if n >= units or n == 0:
        return slice(unit, None, units), 0, 1
    j = unit % n
    return slice(j, j + 1), unit // n, len(range(j, units, n))


def rate_limited(count: int) -> bool:
    return count <= 10 or count % 1000 == 0


@dataclass
class Stats:
    """Per-worker counters shared by the stages of one stream."""

    skipped: int = 0  # since the last batch
    skipped_shards: int = 0  # since the last batch
    total_skipped: int = 0
    total_shard_errors: int = 0
    consecutive_failures: int = 0


class Sample(NamedTuple):
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


def shard_samples(url: str, stats: Stats, count: bool) -> Iterator[dict[str, Any]]:
    """The raw samples of one tar shard (`ssl_vit.data.tar.tar_groups`, with `__url__`). Of its
    tar-level errors the first is counted and logged: one shard may report several (each
    duplicate member, then the read error that ends it) and must count once (count=False:
    another unit reports this shard)."""
    failed = False

    def on_error(exn: Exception) -> None:
        nonlocal failed
        if count and not failed:
            failed = True
            stats.skipped_shards += 1
            stats.total_shard_errors += 1
            if rate_limited(stats.total_shard_errors):
                log.warning("skipping (rest of) shard after %s: %s", type(exn).__name__, exn.args)

    for _, sample in tar_groups(url, on_error=on_error):
        sample["__url__"] = url
        yield sample


def to_sample(sample: dict[str, Any], require_label: bool) -> Sample:
    """A WebDataset sample dict -> `Sample` (without a label: -1, or None if one is required)."""
    ext, label = sample_fields(sample)
    if label is None and not require_label:
        label = -1
    data = sample[ext] if ext is not None else None
    return Sample(sample["__key__"], sample.get("__url__", ""), data, label)


def record_sample(source: Any, rec: Any, require_label: bool) -> Sample:
    """A random-access source's `Record` -> `Sample` (the log names the file); a missing label
    (-1) is None when one is required, as `to_sample`."""
    label = None if require_label and rec.label < 0 else rec.label
    return Sample(rec.key, source.describe(rec.index), rec.data or None, label)


def decode_stage(
    samples: Iterator[tuple[Sample, int | None, Any]],
    transform: Callable,
    stats: Stats,
    limit: int,
    num_classes: int = 0,
) -> Iterator[tuple[torch.Tensor, int, str, Any]]:
    """(sample, augmentation seed, tag) -> (image, label, key, tag), skipping bad samples
    (and, with `num_classes` K > 0, samples whose label is outside [0, K))."""
    # A transform with `from_bytes` (the training crop) decodes the bytes itself, only as much
    # of them as its crop needs; any other is given `decode_image`'s image.
    from_bytes = getattr(transform, "from_bytes", None)
    for s, aug_seed, tag in samples:
        try:
            if s.data is None:
                raise ValueError("no image member")
            if s.label is None:
                raise ValueError("no valid .cls label")
            if num_classes and not 0 <= s.label < num_classes:
                raise ValueError(f"label {s.label} out of range [0, {num_classes})")
            if from_bytes is not None:
                image = _seeded(from_bytes, s.data, aug_seed)
            else:
                image = _seeded(transform, decode_image(s.data), aug_seed)
        except Exception as e:  # any bad sample is skipped, whatever the decoder raised
            stats.skipped += 1
            stats.total_skipped += 1
            stats.consecutive_failures += 1
            if rate_limited(stats.total_skipped):
                log.warning(
                    "skipping sample %s in %s: %s (%d skipped by this worker)",
                    *(s.key, s.url, unreadable_reason(e), stats.total_skipped),
                )
            if stats.consecutive_failures >= limit:  # a source of no images: said, not spun
                raise InputError(
                    f"{limit} samples in a row failed to decode (last: {s.key} in {s.url}: "
                    f"{unreadable_reason(e)}); is the data corrupt or not images?"
                ) from e
            continue
        stats.consecutive_failures = 0
        yield image, s.label, s.key, tag


def collate(items: list[tuple[torch.Tensor, int, str, Any]], image_size: int) -> Batch:
    if not items:
        empty = torch.empty((0, 3, image_size, image_size), dtype=torch.uint8)
        return Batch(empty, torch.empty(0, dtype=torch.int64), keys=[])
    images, labels, keys, _ = zip(*items, strict=True)
    return Batch(torch.stack(images), torch.tensor(labels, dtype=torch.int64), keys=list(keys))


@dataclass(eq=False)
class StreamDataset(IterableDataset):
    """Base of the loaders' datasets. Each names its batch by scope (`batch_field`): the
    training streams `global_micro` (all processes' micro-batch), the evaluation pass
    `local_batch` (this process's)."""

    batch_field: ClassVar[str]
    image_size: int
    transform: Callable
    seed: int
    rank: int
    world_size: int
    require_labels: bool
    max_consecutive_failures: int
    num_classes: int = 0  # > 0: a sample whose label is outside [0, K) is skipped and counted

    def __post_init__(self) -> None:
        if getattr(self, self.batch_field) < 1:
            batch = getattr(self, self.batch_field)
            raise ValueError(f"{self.batch_field} must be >= 1, got {batch}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got {self.rank}, {self.world_size}")


def _init_worker(_: int) -> None:
    # SIGINT (Ctrl-C reaches the whole process group) and SIGTERM (preemption) are the main
    # process's to handle: it finishes the step and checkpoints while the workers keep serving.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.excepthook = _quiet_when_the_main_process_is_gone


def _quiet_when_the_main_process_is_gone(kind: type, value: BaseException, tb: Any) -> None:
    """A worker's file-descriptor sharing thread (multiprocessing.resource_sharer, which hands
    a batch's tensors to the main process) reports a connection the main process dropped as it
    ended, e.g. after another worker died: a traceback under the job's one error line, which
    already says why it ended. Anything else is printed as Python prints it."""
    if not issubclass(kind, (ConnectionResetError, BrokenPipeError, EOFError)):
        sys.__excepthook__(kind, value, tb)


# The iterators whose worker processes may still run (weak: a deleted one ends its own).
_LIVE: weakref.WeakSet = weakref.WeakSet()
REAP_S = 2.0  # how long a killed worker may take to be reaped (one in an uninterruptible read)


def end_workers(iterator: Any) -> None:
    """End a DataLoader iterator's worker processes, in bounded time: DataLoader's own orderly
    shutdown (the call its finalizer makes: for each worker that does not stop, blocked in a
    read, it waits 5 s, sends a SIGTERM they ignore and waits 5 s more), then a SIGKILL to any
    worker left. No-op without workers.

    Nothing runs beside that shutdown to cut its waits short: a timer thread started here to
    kill a blocked worker sooner printed CPython's own traceback (a KeyError in the thread's
    bootstrap) under a dying job's one error line (CI, 2026-11-29). Nor are the workers killed
    first: DataLoader stops its pin-memory thread before its workers stop, so that none dies
    mid-write to the queue that thread reads, and a worker that stopped in order is not named
    in a failing job's error line as one a signal killed (`watchdog.dead_workers`).

    The one way a loader iterator's workers are ended (`WorkerLoader.close`, interpreter exit,
    the training loop's `Batches.close`, an iterator over one: `assembled`'s); a job that is
    dying kills every child at once instead (`watchdog.kill_children`)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    workers = list(getattr(iterator, "_workers", ()))
    if shutdown is None or not workers:  # (None, a plain iterator: not weakly referable)
        return
    _LIVE.discard(iterator)
    if getattr(iterator, "_worker_pids_set", False):  # (a DataLoader iterator, not a wrapper)
        # DataLoader's SIGCHLD handler would raise for a worker killed here (it forgets them
        # only after its own joins).
        _remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False
    try:
        shutdown()
    finally:
        for w in workers:  # any left (DataLoader's own bound ends with a SIGTERM they ignore)
            w.kill()
        for w in workers:
            w.join(REAP_S)


@atexit.register  # after multiprocessing's and torch's registrations, so it runs before them
def _end_all() -> None:
    for it in list(_LIVE):
        end_workers(it)


class WorkerLoader(DataLoader):
    """A DataLoader whose worker processes end with it (when, and why: the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._made: weakref.WeakSet = weakref.WeakSet()

    def _get_iterator(self) -> Any:
        it = super()._get_iterator()
        if self.num_workers > 0:
            _LIVE.add(it)
            self._made.add(it)
            track_loader(it)  # a worker a signal ended is named in the job's error line
        return it

    def close(self) -> None:
        """End the workers of every iterator made so far (a new iteration starts new ones)."""
        for it in list(self._made):
            end_workers(it)
        self._iterator = None  # the persistent iterator, if any

    def __enter__(self) -> WorkerLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_loader(
    dataset: StreamDataset, num_workers: int, persistent: bool, prefetch: int, pin: bool = True
) -> WorkerLoader:
    """A DataLoader that only moves the workers' ready `Batch`es (batch_size=None), pinned with
    CUDA when `pin` (False: the caller copies them into pinned memory itself)."""
    # Its own generator: DataLoader draws a base seed per iterator, which would consume the
    # global RNG.
    return WorkerLoader(
        dataset,
        batch_size=None,
        generator=torch.Generator().manual_seed(seeds.derive(dataset.seed, seeds.LOADER)),
        num_workers=num_workers,
        pin_memory=pin and torch.cuda.is_available(),
        persistent_workers=persistent and num_workers > 0,
        prefetch_factor=prefetch if num_workers > 0 else None,
        worker_init_fn=_init_worker if num_workers > 0 else None,
    )
