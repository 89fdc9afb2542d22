"""A label budget for fine-tuning: K labelled images per class out of a larger labelled source.

The semi-supervised protocol (SimCLR, BYOL, MSN, Semi-ViT: fine-tune on 1% or 10% of the
labels, class-balanced, a fixed subset) is where self-supervised pretraining pays. The subset
is a function of the source and `data.labels_seed` only: per class, the samples' keys are
sorted and permuted by a generator seeded by `seeds.derive(labels_seed, LABELS, class index)`,
and the first K are taken.
So every init, training seed, process count and worker count trains on the same images, and a
smaller budget is inside a larger one (10 per class are the first 10 of the 50).

`choose_labelled` draws the subset (labels only, no image is decoded) and refuses a class with
fewer than K images in one line, before compute. `write_labelled` copies the chosen images once
into small shards of the run directory (`labelled/`) with the record `labelled.json`, so that
training reads K x classes images per epoch, not the whole source.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ssl_vit import seeds
from ssl_vit.atomic import write_text
from ssl_vit.config import ConfigError
from ssl_vit.data.shards import ShardWriter, read_index
from ssl_vit.data.sources import ImageSource, open_source

__all__ = [
    "LABELLED_DIR",
    "LABELLED_RECORD",
    "LabelledSubset",
    "check_recorded",
    "choose_labelled",
    "use_labelled",
]

log = logging.getLogger(__name__)

LABELLED_DIR, LABELLED_RECORD = "labelled", "labelled.json"  # inside the run directory
_SHARDS = 8  # >= 8 shards: up to 8 ranks x workers each read their own (no shared shards)
_MAX_SHARD = 2000


@dataclass
class LabelledSubset:
    """The chosen subset; `keys[name]`: the chosen keys of class `name`, in draw order."""

    source: str
    labels_per_class: int
    labels_seed: int
    label_names: list[str]
    available: dict[str, int]  # images per class in the source
    keys: dict[str, list[str]] = field(default_factory=dict)
    indices: list[int] = field(default_factory=list, repr=False)  # source indices, sorted

    @property
    def num_labelled(self) -> int:
        return len(self.indices)

    def record(self) -> dict:
        """What `labelled.json` holds (everything but the source indices)."""
        rec = {k: v for k, v in asdict(self).items() if k != "indices"}
        rec["counts"] = {name: len(keys) for name, keys in self.keys.items()}
        rec["num_labelled"] = self.num_labelled
        return rec


def choose_labelled(spec: str, labels_per_class: int, seed: int = 0) -> LabelledSubset:
    """The K = `labels_per_class` images per class of source `spec` drawn by `seed`.

    ConfigError (one line naming data.labels_per_class, the class and its count) if a class
    has fewer than K images."""
    source = open_source(spec)
    labels, keys = source.labels(), source.sample_keys()
    names = list(source.label_names)
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


def check_recorded(subset: LabelledSubset, run_dir: str | Path) -> None:
    """On resume, before the run directory is touched: the subset this run was started on (its
    `labelled.json`, if any) is `subset`; another one (K, seed or source) is one error line."""
    record = Path(run_dir) / LABELLED_RECORD
    if not record.is_file():
        return
    had = json.loads(record.read_text())
    if had != subset.record():
        raise ConfigError(
            f"data.labels_per_class / data.labels_seed / data.train: this run was started on "
            f"another labelled subset ({had['labels_per_class']} per class, seed "
            f"{had['labels_seed']}, from {had['source']}; {record}); resume with those values"
        )


def use_labelled(subset: LabelledSubset, run_dir: str | Path, write: bool) -> str:
    """The shard spec of the subset inside `run_dir`: written there (by the process with
    `write`, the main one) unless an earlier start of this run wrote it (`check_recorded`)."""
    run_dir = Path(run_dir)
    out, record = run_dir / LABELLED_DIR, run_dir / LABELLED_RECORD
    wanted = subset.record()
    if record.is_file() and json.loads(record.read_text()) == wanted:
        if read_index(str(out)) is not None:
            return str(out)
    if write:
        _write_shards(subset, out)
        write_text(record, json.dumps(wanted, indent=1) + "\n")
    return str(out)


def _write_shards(subset: LabelledSubset, out: Path) -> None:
    """The chosen images, byte for byte with their labels, into shards at `out` (staged, then
    renamed into place), in an order shuffled by the subset's seed so each shard mixes classes."""
    t0 = time.time()
    source: ImageSource = open_source(subset.source)
    records = list(source.iter_records(subset.indices))  # one pass, chosen samples only
    rng = np.random.default_rng(seeds.derive(subset.labels_seed, seeds.LABELS_ORDER, len(records)))
    order = rng.permutation(len(records))
    per_shard = min(_MAX_SHARD, max(1, math.ceil(len(records) / _SHARDS)))
    with ShardWriter(out, per_shard) as writer:
        for i in order.tolist():
            rec = records[i]
            writer.write(rec.key, rec.ext or "png", rec.data, rec.label)
        writer.close(
            label_names=subset.label_names,
            source=subset.source,
            labels_per_class=subset.labels_per_class,
            labels_seed=subset.labels_seed,
        )
    log.info(
        "labelled subset: %d images (%d per class) of %s written to %s in %.1f s",
        *(subset.num_labelled, subset.labels_per_class, subset.source, out, time.time() - t0),
    )
