"""Copy an image folder or a Hugging Face dataset into shards (`ssl-vit make-shards`).

Kept apart from `shards` (the format) and `sources` (reading collections), which it joins:
both import only downward, so the data layer has no import cycle.

With `workers` > 1, worker processes read, check and (with `max_size`) resize and re-encode
images in chunks of consecutive positions of the write order, while this process writes their
results strictly in that order: the shards, their bytes and index.json are exactly those one
worker writes. A worker whose parent dies (SIGKILL) exits within a second; a worker that dies
ends the job with an error (`BrokenProcessPool`), never a hang.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from ssl_vit.data.parts import check_new_part, holds_parts, parse_part, part_indices
from ssl_vit.data.prepare import Prepared, StoreSettings, image_error, prepare_image
from ssl_vit.data.shards import ShardWriter
from ssl_vit.data.sources import ImageSource, open_raw_source
from ssl_vit.progress import progress_iter

__all__ = ["available_cpus", "image_error", "make_shards"]

log = logging.getLogger(__name__)

# One written sample or skip: (key, label, the source's description of it, the prepared image).
_Item = tuple[str, int, str, Prepared]


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a SLURM allocation)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


# --------------------------------------------------------------------------------------------
# Per image, in a worker (or in this process when workers=1: the same function)

_worker_state: dict[str, Any] = {}


def _exit_with_parent(parent: int) -> None:
    """A worker's daemon thread: leave as soon as the parent is gone (SIGKILLed: nothing else
    would tell a worker blocked on a read or on its task queue)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _init_worker(src: ImageSource, settings: StoreSettings, parent: int) -> None:
    _worker_state.update(src=src, settings=settings)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


def _prepare_chunk(indices: list[int]) -> list[_Item]:
    src, settings = _worker_state["src"], _worker_state["settings"]
    items = []
    for i in indices:
        rec = src[i]
        prepared = prepare_image(rec.data, rec.ext or "png", settings)
        items.append((rec.key, rec.label, src.describe(i), prepared))
    return items


# --------------------------------------------------------------------------------------------
# In order, from one or many workers


def _chunk_size(n: int, workers: int) -> int:
    # Small enough that every worker gets several chunks (and a stalled image holds back few
    # others), large enough that the per-task cost of the pool (~0.1 ms) stays small.
    return max(1, min(64, n // (8 * workers)))


def _prepared_in_order(
    src: ImageSource, order: list[int], settings: StoreSettings, workers: int
) -> Iterator[_Item]:
    """`_prepare_chunk` over `order`, in order; at most 4 chunks per worker in flight, so the
    results waiting to be written stay bounded whatever the speed of the disk."""
    if workers <= 1:
        _worker_state.update(src=src, settings=settings)
        try:
            for i in order:
                yield from _prepare_chunk([i])
        finally:
            _worker_state.clear()
        return
    size = _chunk_size(len(order), workers)
    chunks = (order[k : k + size] for k in range(0, len(order), size))
    init = (src, settings, os.getpid())
    pool = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=init)
    pending: deque[Future] = deque()
    done = False
    try:
        for chunk in chunks:
            pending.append(pool.submit(_prepare_chunk, chunk))
            if len(pending) >= 4 * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
        done = True
    finally:
        if not done:  # an error, an interrupt or an abandoned generator: no waiting on a
            _kill_workers(pool)  # worker that may be stuck on a read
        pool.shutdown(wait=done, cancel_futures=True)


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    kill = getattr(pool, "kill_workers", None)  # Python >= 3.14
    if kill is not None:
        kill()
        return
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        proc.kill()


def _write_order(src: ImageSource, shuffle_seed: int | None, part: tuple[int, int] | None):
    """Indices of `src` in the order they are written: this part's share of the sorted source
    (all of it without a part), permuted by `shuffle_seed` (None: sorted)."""
    indices = part_indices(len(src), *part) if part else list(range(len(src)))
    if shuffle_seed is None:
        return indices
    perm = np.random.default_rng(shuffle_seed).permutation(len(indices))
    return [indices[k] for k in perm.tolist()]


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
    workers: int = 1,
    part: str | tuple[int, int] | None = None,
    max_size: int | None = None,
    quality: int = 90,
    lossless: bool = False,
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

    `workers`: processes that read, check and re-encode (default 1; `ssl-vit make-shards`
    defaults to the CPUs available); the output is the same for any number. `part` "I/N"
    (or (I, N)): write only part I of N of the sorted source to `output/part-IIIII-of-NNNNN`
    (`ssl_vit.data.parts`). `max_size`, `quality`, `lossless`:
    store images at training size (`ssl_vit.data.prepare.StoreSettings`); the setting and every
    image's original size go into index.json.
    """
    settings = StoreSettings(verify, max_size, quality, lossless)
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    part = parse_part(part) if isinstance(part, str) else part
    if part:
        target = check_new_part(output, *part)
    elif holds_parts(output):
        raise ValueError(f"--output {output} holds parts (part-*-of-*): give --part I/N")
    else:
        target = output
    src = open_raw_source(str(source), split=split, source_format=source_format)
    if len(src) == 0:
        raise ValueError(f"no images found in {source}")
    order = _write_order(src, shuffle_seed, part)
    prepared = _prepared_in_order(src, order, settings, min(workers, max(1, len(order))))
    job = _Job(source, output, target, src, settings, shuffle_seed, part)
    try:
        return _write_dataset(job, prepared, shard_size, len(order), progress)
    finally:
        prepared.close()  # on any failure: the workers are killed now, not at exit


class _Job(NamedTuple):
    """What `_write_dataset` needs to know of the make_shards call."""

    source: str | os.PathLike
    output: str | os.PathLike
    target: str | os.PathLike
    src: ImageSource
    settings: StoreSettings
    shuffle_seed: int | None
    part: tuple[int, int] | None


def _write_dataset(
    job: _Job, prepared: Iterator[_Item], shard_size: int, total: int, progress: bool
) -> dict[str, Any]:
    """Write the prepared images in order into `job.target`; return the index."""
    items = progress_iter(prepared, total, desc="make-shards", unit="img", enabled=progress)
    with ShardWriter(job.target, shard_size) as writer:
        skipped, sizes = _write_all(writer, items, bool(job.src.label_names))
        if skipped == total:
            raise ValueError(f"all {skipped} images in {job.source} failed verification")
        extra: dict[str, Any] = {}
        if job.part:
            check_new_part(job.output, *job.part)  # the same part written meanwhile elsewhere
            extra = {"part": list(job.part), "source_samples": len(job.src)}
        if job.settings.max_size is not None:
            extra["resize"] = _record_sizes(writer.shards, sizes, job.settings)
        return writer.close(
            label_names=job.src.label_names,
            source=os.path.abspath(job.source),
            num_skipped=skipped,
            shuffle_seed=job.shuffle_seed,
            **extra,
        )


def _write_all(
    writer: ShardWriter, items: Iterator[_Item], labelled: bool
) -> tuple[int, list[tuple[int, int] | None]]:
    """Write every prepared image in order, log and count the bad ones; (skips, the original
    (width, height) of every written image)."""
    skipped, sizes = 0, []
    for key, label, where, prepared in items:
        if prepared.error is not None:
            skipped += 1
            log.warning("skipping %s: %s", where, prepared.error)
            continue
        writer.write(key, prepared.ext, prepared.data, label if labelled else None)
        sizes.append(prepared.size)
    return skipped, sizes


def _record_sizes(
    shards: list[dict[str, Any]], sizes: list[tuple[int, int]], settings: StoreSettings
) -> dict[str, Any]:
    """Put each shard's original image sizes into its index entry, as one string "WxH WxH ..."
    in sample order (a few bytes an image: ImageNet's index stays ~10 MB, a list of pairs would
    be ~30 MB); return the index's record of the setting."""
    at = 0
    for shard in shards:
        n = shard["num_samples"]
        shard["original_sizes"] = " ".join(f"{w}x{h}" for w, h in sizes[at : at + n])
        at += n
    resized = sum(min(w, h) > settings.max_size for w, h in sizes)
    return {**settings.record(), "resized": resized, "copied": len(sizes) - resized}
