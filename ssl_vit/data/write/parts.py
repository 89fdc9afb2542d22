"""Writing a dataset in N parts (`make-shards --part I/N`), on one machine or many.

Part I of N holds the samples `I, I + N, I + 2N, ...` of the sorted source, so every part has a
share of every class, and is written to its own directory `ROOT/part-IIIII-of-NNNNN` with its
own shards and index.json (`"part": [I, N]`). Keys come from the whole source's listing, so
they are unique across parts. A part that disagrees with the parts already in `ROOT`
(`ssl_vit.data.format.part_identity`) is refused before it is written. The layout, and the
checks the readers make, are in `ssl_vit.data.format`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ssl_vit.data.format import INDEX_NAME, PART_DIR, difference, part_dir, parts_in
from ssl_vit.errors import ConfigError, InputError
from ssl_vit.jsonfile import read_json

__all__ = ["check_agrees_with_written", "check_new_part", "parse_part", "part_indices"]

# What the jobs of a split leave in ROOT besides their parts: a part being written, or left
# by a killed job, is a hidden sibling of its part directory (`ssl_vit.atomic.staged_dir`).
_PART_STAGING = re.compile(r"\.part-[0-9]{5}-of-[0-9]{5}\.(staging|old)-[0-9]+")


def parse_part(spec: str) -> tuple[int, int]:
    """'I/N' -> (I, N), 0 <= I < N (I counts from 0, as a SLURM array task id does)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*/\s*([0-9]+)\s*", str(spec))
    if m is None:
        raise ConfigError(f"--part {spec!r}: expected I/N, e.g. 0/16 (I counts from 0)")
    i, n = int(m.group(1)), int(m.group(2))
    if not 0 <= i < n or n > 99999:
        raise ConfigError(f"--part {spec}: need 0 <= I < N <= 99999 (I counts from 0)")
    return i, n


def part_indices(num_samples: int, i: int, n: int) -> list[int]:
    """The indices of the sorted source that part I of N holds (the parts partition them)."""
    return list(range(i, num_samples, n))


def check_agrees_with_written(root: str | os.PathLike, new: Path, fields: dict[str, Any]) -> None:
    """ValueError (one line) if the part about to be written to `new` with the index `fields`
    disagrees with a part already written in `root`: refused before it is written, so that the
    written parts are never mixed with one of another source or conversion."""
    for name in sorted(parts_in(root)):
        index = Path(root) / name / INDEX_NAME
        if not index.is_file():
            continue
        written = read_json(index)
        diff = difference(fields, written)
        if diff is not None:
            raise InputError(
                f"{new} would not be one dataset with {index.parent} ({diff}): write it to "
                "another --output, or remove the parts written before"
            )


def check_new_part(root: str | os.PathLike, i: int, n: int, overwrite: bool = False) -> Path:
    """The directory part I of N goes to; ValueError (one line) if it is already written (and
    not `overwrite`), if `root` holds parts of another split (another N: the parts would
    overlap or miss samples), or anything but parts (`_check_only_parts`)."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise InputError(f"--output {root}: exists and is not a directory")
    _check_only_parts(root)
    parts = parts_in(root)
    other = sorted({m for _, m in parts.values() if m != n})
    if other:
        raise InputError(
            f"{root} holds parts of a split into {other[0]}, not {n}: write the {n} parts to "
            "another directory (or remove the old parts)"
        )
    target = part_dir(root, i, n)
    if target.name in parts and not overwrite:
        raise InputError(
            f"part {i}/{n} is already written ({target}); pass --overwrite to write it again"
        )
    return target


def _check_only_parts(root: Path) -> None:
    """ValueError (one line) unless `root` holds nothing but parts and their staging: the jobs
    of a split write only there, so a file of the user's is never mixed with a dataset."""
    if not root.is_dir():
        return
    if (root / INDEX_NAME).is_file():
        raise InputError(f"{root} holds a whole dataset (index.json), not parts")
    with os.scandir(root) as entries:
        others = sorted(
            e.name
            for e in entries
            if not (e.is_dir() and PART_DIR.fullmatch(e.name))
            and not _PART_STAGING.fullmatch(e.name)
        )
    if others:
        listed = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
        raise InputError(
            f"--output {root}: holds {listed}, not parts (part-IIIII-of-NNNNN): write the parts "
            "to a new or empty folder"
        )
