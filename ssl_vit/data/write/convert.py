"""Copy an image folder or a Hugging Face dataset into shards (`ssl-vit make-shards`).

The write side (`ssl_vit.data.write`): it reads a collection through `ssl_vit.data.sources` and
writes it with `ShardWriter`; the read side never imports it, so the data layer has no cycle.

With `workers` > 1, worker processes read, check and (with `max_size`) resize and re-encode
images in chunks of consecutive positions of the write order, while this process writes their
results strictly in that order: the shards, their bytes and index.json are exactly those one
worker writes. A worker whose parent dies (SIGKILL) exits within a second; a worker that dies
ends the job with one error line naming how it died (`ChildProcessError`), never a hang, and
the old dataset at the output stays as it was.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

from ssl_vit.config.checks import available_cpus
from ssl_vit.data.format import parts_in
from ssl_vit.data.image_source import ImageSource
from ssl_vit.data.sources import FolderSource, open_raw_source
from ssl_vit.data.write import parts
from ssl_vit.data.write.prepare import Prepared, StoreSettings, prepare_image
from ssl_vit.data.write.writer import ShardWriter, check_output, check_replaceable
from ssl_vit.errors import ConfigError, InputError
from ssl_vit.progress import progress_iter

__all__ = ["cap_workers", "make_shards"]

log = logging.getLogger(__name__)

# One written sample or skip: (key, label, the source's description of it, the prepared image).
_Item = tuple[str, int, str, Prepared]


def cap_workers(workers: int) -> int:
    """`workers`, at most `available_cpus()` (one logged line when capped): more processes than
    CPUs only compete for them, each with its own copy of the source's listing. ValueError
    (one line) below 1."""
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    cpus = available_cpus()
    if workers > cpus:
        log.warning("--workers %d: capped at the %d CPUs available", workers, cpus)
    return min(workers, cpus)


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
        if rec.label < 0 and src.label_names and isinstance(src, FolderSource):
            prepared = Prepared(rec.ext, b"", "outside the class folders, so it has no label")
        else:
            prepared = prepare_image(rec.data, rec.ext or "png", settings)
        items.append((rec.key, rec.label, src.describe(i), prepared))
    return items


# --------------------------------------------------------------------------------------------
# In order, from one or many workers


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
    # Chunks small enough that every worker gets several (and a stalled image holds back few
    # others), large enough that the per-task cost of the pool (~0.1 ms) stays small.
    size = max(1, min(64, len(order) // (8 * workers)))
    chunks = (order[k : k + size] for k in range(0, len(order), size))
    init = (src, settings, os.getpid())
    pool = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=init)
    pending: deque[Future] = deque()
    procs: dict[int, Any] = {}  # every worker started, kept to tell how a dead one ended
    done = False
    try:
        for chunk in chunks:
            pending.append(pool.submit(_prepare_chunk, chunk))
            procs.update(getattr(pool, "_processes", None) or {})
            if len(pending) >= 4 * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
        done = True
    except BrokenProcessPool:
        raise ChildProcessError(
            f"a make-shards worker died ({_how_ended(procs.values())})"
        ) from None
    finally:
        if not done:  # an error, an interrupt or an abandoned generator: no waiting on a
            _kill_workers(pool)  # worker that may be stuck on a read
        pool.shutdown(wait=done, cancel_futures=True)


def _how_ended(procs: Iterable[Any]) -> str:
    """How the worker whose death broke the pool ended ("pid P, killed by SIGKILL"), as far as
    its exit status tells: the pool terminates the other workers with SIGTERM afterwards."""
    procs, deadline = list(procs), time.monotonic() + 1.0
    while True:
        # The pool's own thread reaps the workers too: a read that loses that race sees no
        # status once, the next one sees what the pool's thread stored.
        ended = [(p.pid, _exitcode(p)) for p in procs]
        ended = [(pid, code) for pid, code in ended if code is not None]
        first = next((e for e in ended if e[1] != -signal.SIGTERM), None)
        if first is not None or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    first = first or (ended[0] if ended else None)
    if first is None:
        return "its exit status is unknown"
    pid, code = first
    if code >= 0:
        return f"pid {pid}, exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    oom = ", as the out-of-memory killer does" if -code == signal.SIGKILL else ""
    return f"pid {pid}, killed by {name}{oom}"


def _exitcode(proc: Any) -> int | None:
    try:
        return proc.exitcode
    except ValueError:  # a closed Process object
        return None


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
    indices = parts.part_indices(len(src), *part) if part else list(range(len(src)))
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
    overwrite: bool = False,
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
    (`ssl_vit.data.write.parts`). `max_size`, `quality`, `lossless`: store images at training
    size (`ssl_vit.data.write.prepare.StoreSettings`); the setting and every image's original
    size go into index.json.

    `output` is written only if it is missing, empty or holds nothing but an earlier output of
    make-shards, replaced, whole, with `overwrite` only; anything else (`_target`) is refused in
    one line before any image is read, as are more parts than the source has images and a part
    that disagrees with the parts `output` already holds (`_part_fields`). `workers` is capped
    at the CPUs available.
    """
    settings = StoreSettings(verify, max_size, quality, lossless)
    workers = cap_workers(workers)
    part, target = _target(output, part, overwrite)
    src = open_raw_source(str(source), split=split, source_format=source_format)
    if len(src) == 0:
        raise InputError(f"no images found in {source}")
    if src.plain_label_column:  # written unlabelled: say why, and the fix
        log.warning("%s: %s; its images are written without labels", source, src.unlabelled_why)
    if not part and not overwrite and os.path.isdir(target) and os.listdir(target):
        raise InputError(f"--output {target}: holds a dataset; pass --overwrite to replace it")
    fields: dict[str, Any] = {}  # a part's identity, checked before anything is written
    if part:
        fields = _part_fields(src, source, output, target, split, source_format, settings, part)
    order = _write_order(src, shuffle_seed, part)
    prepared = _prepared_in_order(src, order, settings, min(workers, max(1, len(order))))
    items = progress_iter(prepared, len(order), desc="make-shards", unit="img", enabled=progress)
    labelled = bool(src.label_names)
    skipped, sizes = 0, []  # sizes: the original (width, height) of every written image
    try:
        with ShardWriter(target, shard_size) as writer:
            for key, label, where, image in items:
                if image.error is not None:
                    skipped += 1
                    log.warning("skipping %s: %s", where, image.error)
                    continue
                writer.write(key, image.ext, image.data, label if labelled else None)
                sizes.append(image.size)
            if skipped == len(order):
                raise InputError(f"all {skipped} images in {source} failed verification")
            extra: dict[str, Any] = {}
            if part:
                # The same part, or one that disagrees, written meanwhile by another job.
                parts.check_new_part(output, *part, overwrite=overwrite)
                parts.check_agrees_with_written(output, target, fields)
                extra = {k: fields[k] for k in ("part", "source_samples", "conversion")}
            if settings.max_size is not None:
                extra["resize"] = _record_sizes(writer.shards, sizes, settings)
            return writer.close(
                label_names=src.label_names,
                source=os.path.abspath(source),
                num_skipped=skipped,
                shuffle_seed=shuffle_seed,
                **extra,
            )
    except ChildProcessError as e:  # a dead worker: the staged shards were removed
        raise ChildProcessError(f"{e}; {target} is left as it was") from None
    finally:
        prepared.close()  # on any failure: the workers are killed now, not at exit


def _target(
    output: str | os.PathLike, part: str | tuple[int, int] | None, overwrite: bool
) -> tuple[tuple[int, int] | None, str | os.PathLike]:
    """(part (I, N) or None, where the dataset or the part is written): refused in one line if
    it is a symbolic link, holds anything make-shards did not write, is a part already written
    (without `overwrite`), or a whole dataset's `output` that holds parts."""
    part = parts.parse_part(part) if isinstance(part, str) else part
    if part:
        target = parts.check_new_part(output, *part, overwrite=overwrite)
    elif parts_in(output):
        raise InputError(f"--output {output} holds parts (part-*-of-*): give --part I/N")
    else:
        target = output
    check_output(target)
    check_replaceable(target)
    return part, target


def _part_fields(
    src: ImageSource,
    source: str | os.PathLike,
    output: str | os.PathLike,
    target: str | os.PathLike,
    split: str,
    source_format: str,
    settings: StoreSettings,
    part: tuple[int, int],
) -> dict[str, Any]:
    """The index fields that make a part one of a dataset (`ssl_vit.data.format.part_identity`):
    its place, the source's size and what reads and converts it. Checked before anything is
    written: a split whose every part can be written and read, and one dataset with the parts
    `output` already holds."""
    i, n = part
    if n > len(src):
        raise InputError(
            f"--part {i}/{n}: {source} has {len(src)} images, fewer than the {n} parts (some "
            f"would be empty and the split could never be completed): use at most {len(src)}"
        )
    reader = "folder" if isinstance(src, FolderSource) else source_format
    reader = "hf" if reader == "auto" else reader
    fields = {
        "source": os.path.abspath(source),
        "label_names": src.label_names,
        "resize": settings.record(),
        "part": list(part),
        "source_samples": len(src),
        # The split names the data only for an HF dataset (a folder has none).
        "conversion": {
            "format": reader,
            "split": None if reader == "folder" else split,
            "verify": settings.verify,
        },
    }
    parts.check_agrees_with_written(output, target, fields)
    return fields


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
