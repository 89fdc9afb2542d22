"""A label budget for fine-tuning: K labelled images per class out of a larger labelled source.

The semi-supervised protocol (SimCLR, BYOL, MSN, Semi-ViT: fine-tune on 1% or 10% of the
labels, class-balanced, a fixed subset) is where self-supervised pretraining pays. The subset
is a function of the source and `data.labels_seed` only: per class, the samples' keys are
sorted and permuted by a generator seeded by `seeds.derive(labels_seed, LABELS, class index)`,
and the first K are taken.
So every init, training seed, process count and worker count trains on the same images, and a
smaller budget is inside a larger one (10 per class are the first 10 of the 50).

`choose_labelled` draws the subset (labels only, no image is decoded) and refuses a class with
fewer than K images in one line, before compute. `use_labelled` copies the chosen images once
into small shards of the run directory (`labelled/`) with the record `labelled.json`, so that
training reads K x classes images per epoch, not the whole source. Each image is decoded as it is
copied: one training could not decode is left out, named in the log and in `labelled.json`
(`unusable`), and `num_labelled` counts the images trained on. A stop signal during the copy
removes the partial copy and ends the job in one line.

Both files are the run's own, derived from the source: `check_recorded` (on --resume, before
anything is written) refuses another K or seed, and a source that no longer gives the same
subset, in one line naming what changed (which class, how many images); a moved source that
gives the same subset continues (the identity is the labels and keys, not the path).
`use_labelled` checks the copy (every file's size and sha256) and rebuilds it from the source
when it is missing or damaged, provided the chosen images' bytes are those it was made of.
"""

from __future__ import annotations

import hashlib
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from ssl_vit import seeds
from ssl_vit.atomic import clean_staging, file_sha256, write_json
from ssl_vit.config import ConfigError
from ssl_vit.data.decode import decode_image
from ssl_vit.data.image_source import ImageSource, Record
from ssl_vit.data.labelled_record import (
    LABELLED_DIR,
    LABELLED_RECORD,
    LabelledSubset,
    check_recorded,
    copy_problem,
    listed,
    read_record,
)
from ssl_vit.data.sources import open_source
from ssl_vit.data.write.writer import ShardWriter
from ssl_vit.errors import UserError
from ssl_vit.watchdog import Stopped, stops_raise

__all__ = [
    "LABELLED_DIR",
    "LABELLED_RECORD",
    "CopyInterruptedError",
    "LabelledSubset",
    "check_recorded",
    "choose_labelled",
    "use_labelled",
]

log = logging.getLogger(__name__)

_SHARDS = 8  # >= 8 shards: up to 8 ranks x workers each read their own (no shared shards)
_MAX_SHARD = 2000


class CopyInterruptedError(UserError, ValueError):
    """SIGTERM / SIGINT while the subset was being copied: the partial copy is gone; one line."""


def choose_labelled(spec: str, labels_per_class: int, seed: int = 0) -> LabelledSubset:
    """The K = `labels_per_class` images per class of source `spec` (data.train) drawn by `seed`.

    ConfigError (one line naming data.labels_per_class, the class and its count) if a class
    has fewer than K images, or naming data.train if the source names no classes (remote
    shards without an index: nothing is read)."""
    source = open_source(spec)
    names = list(source.label_names)
    if not names:
        raise ConfigError(
            f"data.labels_per_class={labels_per_class}: data.train={spec!r} names no classes "
            "(remote shards without an index.json, or unlabelled images); a label budget draws "
            "K images of each class of a labelled source"
        )
    labels, keys = source.labels(), source.sample_keys()
    available = {name: int((labels == c).sum()) for c, name in enumerate(names)}
    small = [(n, a) for n, a in available.items() if a < labels_per_class]
    if small:
        name, count = min(small, key=lambda x: x[1])
        raise ConfigError(
            f"data.labels_per_class={labels_per_class}: class {name!r} of {spec} has only "
            f"{count} images" + (f" ({len(small)} classes have fewer)" if len(small) > 1 else "")
        )
    chosen: dict[str, list[str]] = {}
    indices: list[int] = []
    for c, name in enumerate(names):
        members = np.flatnonzero(labels == c)
        members = members[np.argsort([keys[i] for i in members], kind="stable")]  # sorted keys
        rng = np.random.default_rng(seeds.derive(seed, seeds.LABELS, c))
        order = rng.permutation(len(members))[:labels_per_class]
        chosen[name] = [keys[i] for i in members[order]]
        indices += members[order].tolist()
    return LabelledSubset(spec, labels_per_class, seed, names, available, chosen, sorted(indices))


def use_labelled(subset: LabelledSubset, run_dir: str | Path, write: bool) -> str:
    """The shard spec of the subset's copy in `run_dir` (`labelled/`). The process with `write`
    (the main one) first checks what an earlier start of the run left (`check_recorded`, then
    every file of the copy by size and sha256) and keeps it when intact; else it builds the
    copy and labelled.json (a damaged copy only from a source whose chosen images have the
    bytes it was made of). `subset.unusable` then holds the images left out. A stop signal
    during the copy: `CopyInterruptedError`, the partial copy removed."""
    run_dir = Path(run_dir)
    out = run_dir / LABELLED_DIR
    if not write:
        return str(out)
    check_recorded(subset, run_dir)
    had, problem = read_record(run_dir)
    problem = problem or copy_problem(out, had, hashes=True)
    if had is not None and problem is None:
        subset.unusable = dict(had.get("unusable") or {})
        if had["source"] != subset.source:
            log.info(
                "labelled subset: data.train=%s gives the subset drawn from %s (the same labels "
                "and keys): continuing on its copy %s",
                *(subset.source, had["source"], out),
            )
        return str(out)
    if out.exists() or (run_dir / LABELLED_RECORD).exists():
        log.warning("labelled subset: %s; rebuilding the copy from %s", problem, subset.source)
    _build(subset, run_dir, had.get("content") if had else None)
    return str(out)


def _build(subset: LabelledSubset, run_dir: Path, content: dict[str, str] | None) -> None:
    """Copy the subset into `run_dir/labelled`, then write labelled.json. On a stop signal or a
    failure nothing of the new copy stays (one put in place without its record is removed)."""
    out, record = run_dir / LABELLED_DIR, run_dir / LABELLED_RECORD
    published = done = False
    try:
        with stops_raise():
            written = _write_shards(subset, out, content)
            published = True
            write_json(record, {**subset.record(), **written})
            done = True
    except Stopped as e:
        # A signal between the writer's staging mkdir and its cleanup's start leaves the
        # staging folder: this process's own, removed here whichever instruction it hit.
        clean_staging(out)
        raise CopyInterruptedError(
            f"{e} while copying the labelled subset into {out}: stopped before training, "
            "nothing of the copy kept; run the same command again"
        ) from None
    finally:
        if published and not done:
            shutil.rmtree(out, ignore_errors=True)


def _write_shards(
    subset: LabelledSubset, out: Path, content: dict[str, str] | None
) -> dict[str, Any]:
    """The chosen images training can decode, byte for byte with their labels, into shards at
    `out` (staged, then renamed into place), in an order shuffled by the subset's seed so each
    shard mixes classes; sets `subset.unusable`. `content` (a rebuild): the per-class digests
    the chosen images must have, checked before anything is written.
    -> labelled.json's `content` (those digests) and `files` (each file's bytes and sha256)."""
    t0 = time.time()
    source: ImageSource = open_source(subset.source)
    records = list(source.iter_records(subset.indices))  # one pass, chosen samples only
    digests = _digests(records, subset.label_names)
    changed = [
        f"class {n!r}" for n in subset.label_names if content and content.get(n) != digests[n]
    ]
    if changed:
        raise ConfigError(
            f"--resume: data.train={subset.source!r}: the chosen images of {listed(changed)} "
            "have other bytes than those the run's labelled copy was made of (labelled.json "
            "`content`), so the damaged copy cannot be rebuilt: restore that source, or start a "
            "new run in another output_dir"
        )
    rng = np.random.default_rng(seeds.derive(subset.labels_seed, seeds.LABELS_ORDER, len(records)))
    order = rng.permutation(len(records))
    per_shard = min(_MAX_SHARD, max(1, math.ceil(len(records) / _SHARDS)))
    unusable: dict[str, str] = {}
    with ShardWriter(out, per_shard) as writer:
        for i in order.tolist():
            rec = records[i]
            why = _undecodable(rec)
            if why is not None:  # training would skip it: not copied, not counted
                unusable[rec.key] = why
                continue
            writer.write(rec.key, rec.ext or "png", rec.data, rec.label)
        if records and len(unusable) == len(records):
            raise ConfigError(
                f"data.train={subset.source!r}: none of the {len(records)} images drawn for "
                f"data.labels_per_class={subset.labels_per_class} can be decoded (e.g. "
                f"{next(iter(unusable.items()))})"
            )
        writer.close(
            label_names=subset.label_names,
            source=subset.source,
            labels_per_class=subset.labels_per_class,
            labels_seed=subset.labels_seed,
        )
    subset.unusable = unusable
    if unusable:
        left = [f"{k} ({why})" for k, why in sorted(unusable.items())]
        log.warning(
            "labelled subset: %d of the %d images drawn cannot be decoded and are left out of "
            "the copy (%s); num_labelled counts the %d trained on",
            *(len(unusable), len(records), listed(left), subset.num_labelled),
        )
    log.info(
        "labelled subset: %d images (%d per class) of %s written to %s in %.1f s",
        *(subset.num_labelled, subset.labels_per_class, subset.source, out, time.time() - t0),
    )
    files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in _files(out)}
    return {"content": digests, "files": files}


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))


def _undecodable(rec: Record) -> str | None:
    """Why training could not decode `rec`'s image (it would skip it), or None."""
    try:
        decode_image(rec.data)
    except Exception as e:  # noqa: BLE001 - whatever the decoder raises, training skips it
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'undecodable'}"[:200]
    return None


def _digests(records: list[Record], names: list[str]) -> dict[str, str]:
    """Per class, the sha256 of its chosen images (key, size, bytes) in key order: the same
    however the source is stored or wherever it lies."""
    hashes = {name: hashlib.sha256() for name in names}
    for rec in sorted(records, key=lambda r: r.key):
        h = hashes[names[rec.label]]
        h.update(f"{rec.key}\0{len(rec.data)}\0".encode())
        h.update(rec.data)
    return {name: h.hexdigest() for name, h in hashes.items()}
