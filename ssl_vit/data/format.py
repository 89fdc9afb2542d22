"""The shard format both sides share: names, the index, a sample's members, a dataset in parts.

Shard format ("ssl-vit-shards/1"): `shard-000000.tar`, `shard-000001.tar`, ... in one directory,
each a plain tar holding per sample `{key}.{ext}` (the ORIGINAL encoded image bytes, re-encoded
only when `make-shards --max-size` shrinks the image) and, for labelled sources, `{key}.cls`
(the integer label as ASCII text). Keys are unique and contain no dots: WebDataset groups tar
members into samples by the part of the name before the first dot. `index.json`, written last,
holds `{"format", "num_samples", "num_skipped", "label_names", "shards": [{"name",
"num_samples"}], "source"}`; with `--max-size` also `"resize"` (the setting, how many images
were resized and copied) and per shard `"original_sizes"` ("WxH WxH ..." in sample order).

A dataset converted in N parts (`make-shards --part I/N`) is `ROOT/part-IIIII-of-NNNNN`, each
a dataset of its own whose index also holds `"part": [I, N]`, `"source_samples"` and
`"conversion"` (`{"format", "split", "verify"}`). Part I holds the samples `I, I + N, ...` of
the sorted source. Parts are one dataset only if they agree (`part_identity`): the same
source (path, reader, split, number of images, classes), the same N and the same conversion
settings; parts of one folder that disagree are refused when read, in one line naming the two
parts and what differs: a part of the test split must never be read as training data.

The writer (`ssl_vit.data.write`) and the readers (`ssl_vit.data.shards`, `.sources`) both
import this module; it imports neither, and no torch or PIL.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ssl_vit.errors import InputError
from ssl_vit.jsonfile import read_json

__all__ = [
    "IMAGE_EXTENSIONS",
    "INDEX_NAME",
    "PART_DIR",
    "SHARD_FORMAT",
    "SHARD_NAME",
    "check_key",
    "check_parts_agree",
    "complete_parts",
    "difference",
    "load_index",
    "part_dir",
    "part_identity",
    "parts_in",
    "sample_fields",
    "shard_name",
]

SHARD_FORMAT = "ssl-vit-shards/1"
INDEX_NAME = "index.json"
# Lower-case suffixes (no dot) treated as images, in the order a sample's members are tried.
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm")
# A writer's own shard names (`shard_name`): with index.json, the only files of a dataset
# directory a new conversion replaces (a `shard-notes.txt` is kept).
SHARD_NAME = re.compile(r"shard-[0-9]{6,}\.tar")
_EXT = re.compile(r"[a-z0-9]+")
# Zero-padded so that sorted names are the parts in order (SLURM arrays stay below 100,000).
PART_DIR = re.compile(r"part-([0-9]{5})-of-([0-9]{5})")


def shard_name(n: int) -> str:
    """The file name of shard `n` of a dataset."""
    return f"shard-{n:06d}.tar"


def check_key(key: str, ext: str) -> None:
    """ValueError unless `{key}.{ext}` is a valid sample member name (see the module doc)."""
    if not key or "." in key or "/" in key or key.startswith("__"):
        raise InputError(f"invalid sample key {key!r} (must be non-empty, no '.', '/', '__')")
    if not _EXT.fullmatch(ext):
        raise InputError(f"invalid image extension {ext!r}")


def load_index(path: str | os.PathLike) -> dict[str, Any]:
    """The index.json at `path`; ValueError (one line) unless it is a shard index of this
    format with well-formed shard entries and label names."""
    index = read_json(path)  # bounded: an index nested 200,000 deep is one line naming it
    if index.get("format") != SHARD_FORMAT:
        raise InputError(f"{path} is not a shard index (format {SHARD_FORMAT!r})")
    shards, names = index.get("shards"), index.get("label_names")
    entries_ok = isinstance(shards, list) and all(
        isinstance(s, dict) and isinstance(s.get("name"), str) and type(s.get("num_samples")) is int
        for s in shards
    )
    if not entries_ok or not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise InputError(
            f"{path}: a damaged shard index (need shards: [{{name, num_samples}}], "
            "label_names: [names])"
        )
    if len(set(names)) != len(names):  # a classifier trained on it would name two classes alike
        twice = sorted({n for n in names if names.count(n) > 1})
        raise InputError(f"{path}: label_names holds {twice} more than once: one name a class")
    return index


def sample_fields(sample: dict[str, Any]) -> tuple[str | None, int | None]:
    """(image extension, label) of one sample's members `{suffix: bytes}`, as WebDataset groups
    them: the first of IMAGE_EXTENSIONS present (None: no image member) and the integer in
    `.cls` (None: missing or not an integer). The one reading of a sample, for the streams and
    for `ShardSource` alike."""
    ext = next((e for e in IMAGE_EXTENSIONS if e in sample), None)
    try:
        label: int | None = int(sample["cls"])
    except (KeyError, ValueError):
        label = None
    return ext, label


# --------------------------------------------------------------------------------------------
# A dataset in parts


def part_dir(root: str | os.PathLike, i: int, n: int) -> Path:
    """Where part I of N of the dataset `root` is written."""
    return Path(root) / f"part-{i:05d}-of-{n:05d}"


def parts_in(root: str | os.PathLike) -> dict[str, tuple[int, int]]:
    """Part directories of `root` (name -> (I, N)); hidden staging directories are not parts."""
    if not os.path.isdir(root):
        return {}
    found = ((e, PART_DIR.fullmatch(e.name)) for e in os.scandir(root))
    return {e.name: (int(m.group(1)), int(m.group(2))) for e, m in found if m and e.is_dir()}


def part_identity(index: dict[str, Any]) -> dict[str, Any]:
    """What the parts of one dataset share, read from a part's index.json (or the fields a part
    is about to be written with): its source, the split into N and the conversion settings.
    The order of a part's samples (`shuffle_seed`) is not compared: it changes no sample."""
    # (A field of the wrong type reads as missing: the shape of an index is checked elsewhere.)
    resize = _field(index, "resize", dict) or {}  # absent: images stored as given
    stored = resize.get("max_size") is not None
    part = _field(index, "part", list) or []
    identity = {
        "source": index.get("source"),
        "source images": index.get("source_samples"),
        "classes": index.get("label_names"),
        "part count": part[1] if len(part) == 2 else None,
        "max_size": resize.get("max_size"),
        "quality": resize.get("quality") if stored else None,
        "lossless": resize.get("lossless") if stored else None,
    }
    # Written since the parts are compared (absent from older parts: not compared there).
    identity.update(_field(index, "conversion", dict) or {})
    return identity


def _field(index: dict[str, Any], key: str, kind: type) -> Any:
    value = index.get(key)
    return value if isinstance(value, kind) else None


def difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """'KEY A vs B' for the first field in which two parts' identities differ (None: they
    agree); a field only one of them records is not compared."""
    ia, ib = part_identity(a), part_identity(b)
    for key, value in ia.items():
        if key not in ib or value == ib[key]:
            continue
        other = ib[key]
        if isinstance(value, list) and isinstance(other, list):  # class names: name the first
            if len(value) != len(other):
                return f"{key} {len(value)} vs {len(other)}"
            k = next(k for k, (x, y) in enumerate(zip(value, other, strict=True)) if x != y)
            return f"class {k} {value[k]!r} vs {other[k]!r}"
        return f"{key} {value} vs {other}"
    return None


def check_parts_agree(parts: list[tuple[Path, dict[str, Any]]]) -> None:
    """ValueError (one line) naming two of `parts` [(directory, its index)] and what differs,
    unless they are parts of one dataset (`part_identity`)."""
    for path, index in parts[1:]:
        diff = difference(parts[0][1], index)
        if diff is not None:
            raise InputError(
                f"{parts[0][0]} and {path} are not parts of one dataset ({diff}): write every "
                "part from one source with the same settings"
            )


def complete_parts(root: str | os.PathLike) -> list[Path] | None:
    """The part directories of `root`, in order, if it is a dataset written in parts (None if
    it holds no part directory). ValueError (one line) if parts of several splits are mixed,
    one is missing, a part's index does not say it is that part, or two parts disagree
    (`check_parts_agree`)."""
    root = Path(root)
    parts = parts_in(root)
    if not parts:
        return None
    splits = sorted({n for _, n in parts.values()})
    if len(splits) > 1:
        raise InputError(f"{root} mixes parts of splits into {splits}: keep one split")
    n = splits[0]
    dirs = [part_dir(root, i, n) for i in range(n)]
    missing = [d.name for d in dirs if d.name not in parts]
    if missing:
        raise InputError(
            f"{root}: {len(missing)} of {n} parts not written yet (e.g. {missing[0]}); "
            "name the written ones (a list or a brace pattern) to read them alone"
        )
    indexes = []
    for i, d in enumerate(dirs):
        index = d / INDEX_NAME
        if not index.is_file():
            raise InputError(f"{d}: no index.json (a part still being written?)")
        loaded = read_json(index)
        recorded = loaded.get("part")
        if recorded != [i, n]:
            raise InputError(f"{index} records part {recorded}, not [{i}, {n}]")
        indexes.append((d, loaded))
    check_parts_agree(indexes)
    return dirs
