"""A dataset converted in N parts (`make-shards --part I/N`), on one machine or many.

Part I of N holds the samples `I, I + N, I + 2N, ...` of the sorted source, so every part has a
share of every class, and is written to its own directory `ROOT/part-IIIII-of-NNNNN` with its
own shards and index.json (`"part": [I, N]`). Keys come from the whole source's listing, so
they are unique across parts. The loaders read `ROOT` (all N parts, refused while one is
missing), a brace pattern of part directories or a list of them as one dataset.

Parts are one dataset only if they agree (`part_identity`): the same source (path, reader,
split, number of images, classes), the same N and the same conversion settings. A part that
disagrees with the parts already in `ROOT` is refused before it is written, and parts of one
folder that disagree are refused when read, in one line naming the two parts and what differs:
a part of the test split must never be read as training data.

No torch, no PIL: the shard resolver (`ssl_vit.data.shards`) imports it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ssl_vit.jsonfile import read_json

__all__ = [
    "PART_DIR",
    "check_agrees_with_written",
    "check_new_part",
    "check_parts_agree",
    "complete_parts",
    "holds_parts",
    "parse_part",
    "part_dir",
    "part_indices",
    "part_identity",
]

# Zero-padded so that sorted names are the parts in order (SLURM arrays stay below 100,000).
PART_DIR = re.compile(r"part-([0-9]{5})-of-([0-9]{5})")


def parse_part(spec: str) -> tuple[int, int]:
    """'I/N' -> (I, N), 0 <= I < N (I counts from 0, as a SLURM array task id does)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*/\s*([0-9]+)\s*", str(spec))
    if m is None:
        raise ValueError(f"--part {spec!r}: expected I/N, e.g. 0/16 (I counts from 0)")
    i, n = int(m.group(1)), int(m.group(2))
    if not 0 <= i < n or n > 99999:
        raise ValueError(f"--part {spec}: need 0 <= I < N <= 99999 (I counts from 0)")
    return i, n


def part_dir(root: str | os.PathLike, i: int, n: int) -> Path:
    """Where part I of N of the dataset `root` is written."""
    return Path(root) / f"part-{i:05d}-of-{n:05d}"


def part_indices(num_samples: int, i: int, n: int) -> list[int]:
    """The indices of the sorted source that part I of N holds (the parts partition them)."""
    return list(range(i, num_samples, n))


def _parts_in(root: Path) -> dict[str, tuple[int, int]]:
    """Part directories of `root` (name -> (I, N)); hidden staging directories are not parts."""
    if not root.is_dir():
        return {}
    found = {}
    for entry in os.scandir(root):
        m = PART_DIR.fullmatch(entry.name)
        if m and entry.is_dir():
            found[entry.name] = (int(m.group(1)), int(m.group(2)))
    return found


def holds_parts(root: str | os.PathLike) -> bool:
    """Whether `root` holds part directories (a dataset written with `--part`)."""
    return bool(_parts_in(Path(root)))


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


def _difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
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
        diff = _difference(parts[0][1], index)
        if diff is not None:
            raise ValueError(
                f"{parts[0][0]} and {path} are not parts of one dataset ({diff}): write every "
                "part from one source with the same settings"
            )


def check_agrees_with_written(root: str | os.PathLike, new: Path, fields: dict[str, Any]) -> None:
    """ValueError (one line) if the part about to be written to `new` with the index `fields`
    disagrees with a part already written in `root`: refused before it is written, so that the
    written parts are never mixed with one of another source or conversion."""
    for name in sorted(_parts_in(Path(root))):
        index = Path(root) / name / "index.json"
        if not index.is_file():
            continue
        written = read_json(index)
        diff = _difference(fields, written)
        if diff is not None:
            raise ValueError(
                f"{new} would not be one dataset with {index.parent} ({diff}): write it to "
                "another --output, or remove the parts written before"
            )


def check_new_part(root: str | os.PathLike, i: int, n: int) -> Path:
    """The directory part I of N goes to; ValueError (one line) if it is already written, or
    if `root` holds parts of another split (another N: the parts would overlap or miss
    samples)."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ValueError(f"--output {root}: exists and is not a directory")
    parts = _parts_in(root)
    other = sorted({m for _, m in parts.values() if m != n})
    if other:
        raise ValueError(
            f"{root} holds parts of a split into {other[0]}, not {n}: write the {n} parts to "
            "another directory (or remove the old parts)"
        )
    target = part_dir(root, i, n)
    if target.name in parts:
        raise ValueError(f"part {i}/{n} is already written ({target}); remove it to write it again")
    if root.is_dir() and (root / "index.json").is_file():
        raise ValueError(f"{root} holds a whole dataset (index.json), not parts")
    return target


def complete_parts(root: str | os.PathLike) -> list[Path] | None:
    """The part directories of `root`, in order, if it is a dataset written in parts (None if
    it holds no part directory). ValueError (one line) if parts of several splits are mixed,
    one is missing, a part's index does not say it is that part, or two parts disagree
    (`check_parts_agree`)."""
    root = Path(root)
    parts = _parts_in(root)
    if not parts:
        return None
    splits = sorted({n for _, n in parts.values()})
    if len(splits) > 1:
        raise ValueError(f"{root} mixes parts of splits into {splits}: keep one split")
    n = splits[0]
    dirs = [part_dir(root, i, n) for i in range(n)]
    missing = [d.name for d in dirs if d.name not in parts]
    if missing:
        raise ValueError(
            f"{root}: {len(missing)} of {n} parts not written yet (e.g. {missing[0]}); "
            "name the written ones (a list or a brace pattern) to read them alone"
        )
    indexes = []
    for i, d in enumerate(dirs):
        index = d / "index.json"
        if not index.is_file():
            raise ValueError(f"{d}: no index.json (a part still being written?)")
        loaded = read_json(index)
        recorded = loaded.get("part")
        if recorded != [i, n]:
            raise ValueError(f"{index} records part {recorded}, not [{i}, {n}]")
        indexes.append((d, loaded))
    check_parts_agree(indexes)
    return dirs
