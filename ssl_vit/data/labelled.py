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

Beyond the paper (issue 49: which N images should a user label?), `data.labels_select`
random or typiclust picks `data.labels_budget` images of the source without reading a label:
`choose_random` from the sorted keys by `seeds.derive(labels_seed, LABELS_RANDOM)`, on every
process (keys only: exact, the same everywhere); `choose_typiclust` only checks the budget
and, on --resume, takes the run's recorded picks (a second feature pass could differ in the
last bit on another device), else leaves the picks to `ssl_vit.train.label_picks` once the
run has its processes. `picked_subset` then reads the picks' labels (what labelling them
gives), and the copy and its record are those of a balanced subset.

Both files are the run's own, derived from the source: checked on --resume (`check_recorded`),
rebuilt when missing or damaged (`use_labelled`); a moved source that gives the same subset
continues (the identity is the labels and keys, not the path).
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
    recorded,
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
    "choose_random",
    "choose_typiclust",
    "picked_subset",
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


def choose_random(spec: str, budget: int, seed: int = 0) -> LabelledSubset:
    """`budget` images of source `spec` drawn uniformly from its sorted keys by `seed`, without
    reading a label (data.labels_select=random)."""
    source = _sized(spec, budget, "random")
    keys = sorted(source.sample_keys())  # the draw is of keys, not of the source's order
    rng = np.random.default_rng(seeds.derive(seed, seeds.LABELS_RANDOM))
    picks = [keys[i] for i in rng.permutation(len(keys))[:budget].tolist()]
    return picked_subset(spec, "random", budget, seed, picks)


def choose_typiclust(spec: str, budget: int, seed: int, resume_dir: str | None) -> LabelledSubset:
    """The typiclust subset before its features: its budget checked against the source; on
    --resume (`resume_dir`) of a run that recorded picks of this budget and seed, those picks
    (ConfigError naming a key the source no longer has), else none yet (`picked` False)."""
    source = _sized(spec, budget, "typiclust")
    had, where = recorded(Path(resume_dir)) if resume_dir else (None, None)
    how = [(had or {}).get(k) for k in ("labels_select", "labels_budget", "labels_seed")]
    if how != ["typiclust", budget, seed]:  # another record: check_recorded names the change
        names = list(source.label_names)
        return LabelledSubset(
            spec, 0, seed, names, {}, labels_select="typiclust", labels_budget=budget
        )
    picks = [k for keys in (had.get("keys") or had.get("copy_keys") or {}).values() for k in keys]
    gone = sorted(set(picks) - set(source.sample_keys()))
    if gone:
        raise ConfigError(
            f"--resume: data.train={spec!r} no longer has {len(gone)} of the images the run in "
            f"{resume_dir} picked by typiclust (e.g. {gone[0]!r}; {where}): restore that "
            "source, or start a new run in another output_dir"
        )
    return picked_subset(spec, "typiclust", budget, seed, picks)


def picked_subset(
    spec: str, method: str, budget: int, seed: int, picks: list[str]
) -> LabelledSubset:
    """The subset of the images of source `spec` with keys `picks` (in pick order) that
    `method` picked: the picks' labels read (labelling them), each class's picks in pick order
    (a class may have none). ConfigError naming data.train if a pick is not a labelled image."""
    source = open_source(spec)
    names, labels = list(source.label_names), source.labels()
    where = {k: i for i, k in enumerate(source.sample_keys())}
    chosen: dict[str, list[str]] = {name: [] for name in names}
    for key in picks:
        i = where.get(key, -1)
        if i < 0 or not 0 <= labels[i] < len(names):
            raise ConfigError(
                f"data.labels_select={method}: data.train={spec!r} has no labelled image "
                f"{key!r}, which it picked; label every image of the source"
            )
        chosen[names[labels[i]]].append(key)
    indices = sorted(where[k] for k in picks)
    how = {"labels_select": method, "labels_budget": budget}
    return LabelledSubset(spec, 0, seed, names, {}, chosen, indices, **how)


def _sized(spec: str, budget: int, method: str) -> ImageSource:
    """Source `spec`, which must hold at least `budget` images (one line before compute)."""
    source = open_source(spec)
    if budget > len(source):
        raise ConfigError(
            f"data.labels_budget={budget}: more than the {len(source)} images of "
            f"data.train={spec!r} (data.labels_select={method})"
        )
    return source


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
                f"{_budget(subset)} can be decoded (e.g. "
                f"{next(iter(unusable.items()))})"
            )
        writer.close(
            label_names=subset.label_names,
            source=subset.source,
            labels_per_class=subset.labels_per_class,
            labels_seed=subset.labels_seed,
            **({} if subset.labels_select == "balanced" else {
                "labels_select": subset.labels_select, "labels_budget": subset.labels_budget}),
        )  # fmt: skip
    subset.unusable = unusable
    if unusable:
        left = [f"{k} ({why})" for k, why in sorted(unusable.items())]
        log.warning(
            "labelled subset: %d of the %d images drawn cannot be decoded and are left out of "
            "the copy (%s); num_labelled counts the %d trained on",
            *(len(unusable), len(records), listed(left), subset.num_labelled),
        )
    log.info(
        "labelled subset: %d images (%s) of %s written to %s in %.1f s",
        *(subset.num_labelled, _budget(subset), subset.source, out, time.time() - t0),
    )
    files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in _files(out)}
    return {"content": digests, "files": files}


def _budget(subset: LabelledSubset) -> str:
    """How the subset was chosen, as its config keys say."""
    if subset.labels_select == "balanced":
        return f"data.labels_per_class={subset.labels_per_class}"
    return f"data.labels_select={subset.labels_select}, data.labels_budget={subset.labels_budget}"


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
