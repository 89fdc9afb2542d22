"""A label-budget run's own record of its subset (`labelled.json`) and copy (`labelled/`), read
back on --resume: both are derived from the source, so they are untrusted and checked.

`LabelledSubset` is the subset and what `labelled.json` holds of it. `check_recorded` compares
what the run was started on (labelled.json; lost or damaged: the copy's index.json and keys) with
the subset the source gives now, and names what changed; `read_record` and `copy_problem` tell
whether the copy can be kept as it is (every file's size and sha256) or must be rebuilt
(`ssl_vit.data.labelled.use_labelled`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ssl_vit.atomic import file_sha256
from ssl_vit.config import ConfigError
from ssl_vit.data.format import INDEX_NAME, sample_fields
from ssl_vit.data.shards import resolve_shards
from ssl_vit.data.tar import tar_groups
from ssl_vit.jsonfile import read_json

__all__ = [
    "LABELLED_DIR",
    "LABELLED_RECORD",
    "LabelledSubset",
    "check_recorded",
    "copy_problem",
    "listed",
    "read_record",
    "recorded",
]

LABELLED_DIR, LABELLED_RECORD = "labelled", "labelled.json"  # inside the run directory
# How a subset was chosen, with the value a record without the key (balanced) stands for.
_HOW = {"labels_select": "balanced", "labels_budget": 0, "labels_per_class": 0, "labels_seed": 0}
_SHOWN = 3  # classes (or keys) named in one line before "and N more"


@dataclass
class LabelledSubset:
    """The chosen subset; `keys[name]`: the chosen keys of class `name`, in draw order.
    Picked without the labels (`labels_select` random or typiclust: `labels_budget` images in
    all, `labels_per_class` 0), `available` is empty (the source's labels are not counted) and
    `keys` holds the picks by the class they turn out to have, none for some classes maybe;
    a typiclust subset is picked once the run has its processes (`keys`, `indices` empty
    until then: `picked`)."""

    source: str
    labels_per_class: int
    labels_seed: int
    label_names: list[str]
    available: dict[str, int]  # images per class in the source
    keys: dict[str, list[str]] = field(default_factory=dict)
    indices: list[int] = field(default_factory=list, repr=False)  # source indices, sorted
    # Chosen keys training cannot use (key -> why: not decodable), left out of the copy; known
    # once the copy is made or read back (`use_labelled`).
    unusable: dict[str, str] = field(default_factory=dict, repr=False)
    labels_select: str = "balanced"  # data.labels_select
    labels_budget: int = 0  # data.labels_budget (0: balanced)

    @property
    def picked(self) -> bool:
        """The images are known (a typiclust subset: once its features are computed)."""
        return bool(self.indices)

    @property
    def num_labelled(self) -> int:
        """The images trained on: the chosen ones less the unusable."""
        return len(self.indices) - len(self.unusable)

    def record(self) -> dict:
        """What `labelled.json` holds (everything but the source indices)."""
        rec = {k: v for k, v in asdict(self).items() if k not in ("indices", "unusable")}
        if self.labels_select == "balanced":  # labelled.json as before the other methods
            del rec["labels_select"], rec["labels_budget"]
        rec["counts"] = {
            name: sum(k not in self.unusable for k in keys) for name, keys in self.keys.items()
        }
        rec["num_labelled"] = self.num_labelled
        rec["unusable"] = dict(self.unusable)
        return rec


def check_recorded(subset: LabelledSubset | None, run_dir: str | Path) -> None:
    """On --resume, before anything is written: the run in `run_dir` continues on `subset`
    (None: no label budget). ConfigError (one line) when its `labelled` or `labelled.json` is a
    symbolic link, when it was started with another K or seed (or none), or when the source no
    longer gives its subset, naming what changed (which class, how many images). Reads
    labelled.json, else (lost or damaged) the copy's index.json and keys; a run with neither
    passes (its config.yaml is compared when the run directory is claimed). A missing or
    damaged copy is no error here: `use_labelled` rebuilds it."""
    if not str(run_dir).strip():  # no output_dir (refused when the run directory is claimed)
        return
    run_dir = Path(run_dir)
    for path in (run_dir / LABELLED_DIR, run_dir / LABELLED_RECORD):
        if path.is_symlink():
            raise ConfigError(
                f"--resume: {path} is a symbolic link (to {os.readlink(path)}), not the run's own "
                "file: remove the link (--resume rebuilds the labelled copy from data.train)"
            )
    had, where = recorded(run_dir)
    if had is None:
        return
    was = {key: had.get(key, default) for key, default in _HOW.items()}
    now = {key: getattr(subset, key) for key in _HOW} if subset else {**_HOW}
    now["labels_seed"] = subset.labels_seed if subset else was["labels_seed"]
    diffs = [f"data.{key} {was[key]} -> {value}" for key, value in now.items() if was[key] != value]
    if diffs:
        how = f"{was['labels_per_class']} per class"
        if was["labels_select"] != "balanced":
            how = f"{was['labels_budget']} images by {was['labels_select']}"
        raise ConfigError(
            f"--resume: the run in {run_dir} was started on another labelled subset and cannot "
            f"continue with {', '.join(diffs)} ({where}: {how}, seed {was['labels_seed']}); "
            "resume with those values, or start a new run in another output_dir"
        )
    if subset is None or not subset.picked:  # (a record of K = 0: nothing was drawn)
        return
    changes = _changes(had, subset)
    if changes:
        damage = copy_problem(run_dir / LABELLED_DIR, had, hashes=False)
        raise ConfigError(
            f"--resume: data.train={subset.source!r} no longer gives the labelled subset the run "
            f"in {run_dir} was started on ({listed(changes)}; {where}, from {had['source']})"
            + (f"; its damaged copy cannot be rebuilt ({damage})" if damage else "")
            + ": restore that source, or start a new run in another output_dir"
        )


def read_record(run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(labelled.json's record, None), or (None, why there is none: missing or damaged)."""
    path = run_dir / LABELLED_RECORD
    if not path.is_file():
        return None, f"{path} is missing"
    try:
        rec = read_json(path)
    except ValueError as e:  # JsonFileError: names the file
        return None, str(e)
    except OSError as e:
        return None, f"{path}: unreadable ({e.strerror or e})"
    why = _record_problem(rec)
    return (None, f"{path}: not a labelled record ({why})") if why else (rec, None)


def recorded(run_dir: Path) -> tuple[dict[str, Any] | None, Path | None]:
    """What the run was started on and the file that says so: labelled.json, else the copy's
    index.json (K, seed, label names, source) with the copy's keys per class (`copy_keys`);
    (None, None) when neither is readable."""
    rec, _ = read_record(run_dir)
    if rec is not None:
        return rec, run_dir / LABELLED_RECORD
    out = run_dir / LABELLED_DIR
    try:
        index = read_json(out / INDEX_NAME)
    except (OSError, ValueError):
        return None, None
    fields = ("labels_per_class", "labels_seed", "label_names", "source")
    had = {k: index.get(k) for k in fields}
    had.update({k: index[k] for k in ("labels_select", "labels_budget") if k in index})
    if _record_problem(had, full=False):
        return None, None
    had["copy_keys"] = _copy_keys(out, had["label_names"])
    return had, out / INDEX_NAME


def _copy_keys(out: Path, names: list[str]) -> dict[str, list[str]]:
    """The keys of the copy at `out` per class, from its tar headers: a damaged shard (empty,
    cut short) gives the keys read before the damage, an unreadable copy none."""
    try:
        urls = resolve_shards(str(out))
    except Exception:  # noqa: BLE001 - no readable index: nothing to compare
        return {}
    found: dict[str, list[str]] = {}
    for url in urls:
        for _, sample in tar_groups(url, suffixes=("cls",), on_error=lambda e: None):
            _, label = sample_fields(sample)
            name = names[label] if label is not None and 0 <= label < len(names) else "?"
            found.setdefault(name, []).append(sample["__key__"])
    return found


def _changes(had: dict[str, Any], subset: LabelledSubset) -> list[str]:
    """What differs between the subset `had` recorded and `subset` (the source's path aside: a
    moved source that gives the same subset continues): one phrase per class."""
    if had["label_names"] != subset.label_names:
        return [f"label names {had['label_names']} -> {subset.label_names}"]
    changes = []
    for name in subset.label_names if "available" in had else []:  # labelled.json
        before, now = had["available"].get(name), subset.available.get(name)  # picked: none
        if before != now:
            changes.append(f"class {name!r}: {before} -> {now} images")
        elif had["keys"].get(name) != subset.keys[name]:
            gone = len(set(had["keys"].get(name) or ()) - set(subset.keys[name]))
            changes.append(f"class {name!r}: other images ({gone} of its keys no longer drawn)")
    for name, keys in (had.get("copy_keys") or {}).items():  # the copy's own keys
        extra = sorted(set(keys) - set(subset.keys.get(name, ())))
        if extra:
            changes.append(f"class {name!r}: {len(extra)} copied images no longer drawn")
    return changes


def copy_problem(out: Path, rec: dict[str, Any] | None, hashes: bool) -> str | None:
    """What is wrong with the copy at `out` against its record (every file's size, and sha256
    with `hashes`), or None. A record of an earlier version (no `files`): the index lists the
    shards, each present and not empty."""
    if out.is_symlink() or not out.is_dir():
        return f"{out} is missing"
    files = (rec or {}).get("files")
    if not files:
        try:
            index = read_json(out / INDEX_NAME)
            files = {str(s["name"]): None for s in index["shards"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"{out / INDEX_NAME} is unreadable ({str(e).splitlines()[0] if str(e) else e})"
    for name, want in files.items():
        path = out / name
        if Path(name).name != name or not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if want is None and not size:
            return f"{path} is empty"
        if want is not None and size != want["bytes"]:
            return f"{path} has {size} bytes, {want['bytes']} when written"
        if want is not None and hashes and file_sha256(path) != want["sha256"]:
            return f"{path} has other bytes than when written (sha256)"
    return None


def _record_problem(rec: dict[str, Any], full: bool = True) -> str | None:
    """Why `rec` is not a labelled record, or None. `full` False: the fields the copy's
    index.json holds too (K, seed, label names, source)."""
    if not all(_is_int(rec.get(k)) for k in ("labels_per_class", "labels_seed")):
        return "labels_per_class / labels_seed are not integers"
    if not isinstance(rec.get("labels_select", ""), str) or not _is_int(
        rec.get("labels_budget", 0)
    ):
        return "labels_select / labels_budget are not a name and an integer"
    names = rec.get("label_names")
    if not isinstance(rec.get("source"), str) or not _list_of(names, str):
        return "source / label_names are not a path and a list of names"
    if not full:
        return None
    shapes = {"available": int, "keys": list, "content": str, "unusable": str, "files": dict}
    for key, kind in shapes.items():
        value = rec.get(key)
        if value is None and key in ("content", "unusable", "files"):  # earlier versions
            continue
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, kind) for k, v in value.items()
        ):
            return f"{key} is not a mapping of names to {kind.__name__}"
    if not all(_list_of(keys, str) for keys in rec["keys"].values()):
        return "keys is not a list of keys per class"
    for name, f in (rec.get("files") or {}).items():
        if (
            name.startswith(".")
            or Path(name).name != name
            or not _is_int(f.get("bytes"))
            or not isinstance(f.get("sha256"), str)
        ):
            return f"files: {name!r} is not a file of the copy with its bytes and sha256"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _list_of(value: Any, kind: type) -> bool:
    return isinstance(value, list) and all(isinstance(v, kind) for v in value)


def listed(items: list[str]) -> str:
    more = len(items) - _SHOWN
    return "; ".join(items[:_SHOWN]) + (f"; and {more} more" if more > 0 else "")
