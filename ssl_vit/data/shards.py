"""Finding shards: a shard spec (directory, index, pattern, list, URL) -> the shards to read.

The format (index.json, names, a dataset in parts) is `ssl_vit.data.format`; the shards are
written by `ssl_vit.data.write` and read member by member by `ssl_vit.data.tar`.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import Any

import braceexpand

from ssl_vit.data.format import (
    IMAGE_EXTENSIONS,
    INDEX_NAME,
    PART_DIR,
    check_parts_agree,
    complete_parts,
    load_index,
    parts_in,
)

__all__ = ["is_shard_spec", "read_index", "resolve_shards"]

_REMOTE = re.compile(r"^(pipe:|[a-zA-Z][a-zA-Z0-9+.-]*://)")


def _split_spec(spec: str) -> list[str]:
    """Split a shard list on '::' and on commas outside braces (not inside `pipe:` commands)."""
    parts: list[str] = []
    for part in spec.split("::"):
        part = part.strip()
        if part.startswith("pipe:"):
            parts.append(part)
            continue
        depth, start = 0, 0
        for i, ch in enumerate(part):
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                parts.append(part[start:i].strip())
                start = i + 1
        parts.append(part[start:].strip())
    return [p for p in parts if p]


def _shards_from_index(index_path: str) -> list[str]:
    index = load_index(index_path)
    folder = os.path.dirname(index_path)
    paths = [os.path.join(folder, s["name"]) for s in index["shards"]]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} shard(s) listed in {index_path} are missing, e.g. {missing[0]}"
        )
    return paths


def _resolve_dir(path: str, part: str) -> list[str]:
    """The shards of a directory: its index.json, its parts (`ssl_vit.data.format`, all of
    them, each by its index), else its sorted *.tar."""
    if os.path.isfile(os.path.join(path, INDEX_NAME)):
        return _shards_from_index(os.path.join(path, INDEX_NAME))
    parts = complete_parts(path)
    if parts is not None:
        return [url for d in parts for url in _shards_from_index(str(d / INDEX_NAME))]
    paths = sorted(glob.glob(os.path.join(path, "*.tar")))
    if not paths:
        msg = f"no shards (*.tar) in directory {part}"
        if _holds_images(path):  # a new user's photos, or a saved Hugging Face dataset
            msg += (
                ": it holds images, which pretraining streams as shards: make them once with "
                f"`ssl-vit make-shards --source {part} --output <a new folder>`"
            )
        raise FileNotFoundError(msg)
    return paths


def _holds_images(path: str) -> bool:
    """Whether an image file or a saved dataset's table (*.arrow) lies anywhere under `path`."""
    kinds = (*IMAGE_EXTENSIONS, "arrow")
    return any(
        name.rpartition(".")[2].lower() in kinds for _, _, names in os.walk(path) for name in names
    )


def _resolve_one(part: str) -> list[str]:
    if _REMOTE.match(part):
        return list(braceexpand.braceexpand(part))
    path = os.path.expanduser(part)
    if "{" in path or any(c in path for c in "*?["):
        paths = [p for q in braceexpand.braceexpand(path) for p in sorted(glob.glob(q)) or [q]]
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} of {len(paths)} shards in {part} do not exist, e.g. {missing[0]}"
            )
        # A pattern of directories (the parts of a dataset): each read as a directory.
        return [u for p in paths for u in (_resolve_dir(p, p) if os.path.isdir(p) else [p])]
    if os.path.isdir(path):
        return _resolve_dir(path, part)
    if os.path.isfile(path):
        return _shards_from_index(path) if path.endswith(".json") else [path]
    raise FileNotFoundError(f"shards not found: {part} does not exist")


def resolve_shards(spec: str) -> list[str]:
    """Shard spec -> list of shard paths/URLs for WebDataset.

    `spec` is a shard directory (its index.json, else all its parts `part-IIIII-of-NNNNN` as one
    dataset, else its sorted *.tar), an index JSON, a brace pattern or glob
    (`dir/shard-{000000..000009}.tar`, or of directories: `dir/part-{00000..00003}-of-00016`),
    one tar path, or a `pipe:` command / URL (passed through, braces expanded); several can be
    joined with '::' or ','. Local paths must exist: FileNotFoundError with a one-line message
    otherwise; a dataset in parts with a part missing, or parts of one folder that disagree
    (`ssl_vit.data.format.check_parts_agree`): ValueError.
    """
    urls = [url for part in _split_spec(str(spec)) for url in _resolve_one(part)]
    if not urls:
        raise FileNotFoundError(f"no shards found for {spec!r}")
    _check_parts_agree(urls)
    return urls


def _check_parts_agree(urls: list[str]) -> None:
    """The part directories of one folder read together (a brace pattern or a list of them, as
    `ROOT` itself) are one dataset: ValueError (one line) unless they agree. Parts of other
    folders are other datasets, joined on purpose as any two datasets in a list."""
    by_root: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for folder in dict.fromkeys(os.path.dirname(u) for u in urls if not _REMOTE.match(u)):
        index = os.path.join(folder, INDEX_NAME)
        if PART_DIR.fullmatch(os.path.basename(folder)) and os.path.isfile(index):
            root = os.path.realpath(os.path.dirname(folder))
            by_root.setdefault(root, []).append((Path(folder), load_index(index)))
    for parts in by_root.values():
        check_parts_agree(parts)


def read_index(spec: str) -> dict[str, Any] | None:
    """The index.json that describes the shards of `spec` (its first part), or None.

    For a pattern or a single tar, the index of the directory holding it is returned (label
    names apply; its counts describe the whole directory).
    """
    parts = _split_spec(str(spec))
    if not parts or _REMOTE.match(parts[0]):
        return None
    path = os.path.expanduser(next(iter(braceexpand.braceexpand(parts[0]))))
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, INDEX_NAME)):
        first = complete_parts(path)  # a dataset in parts: the first part's index
        path = str(first[0]) if first else path
    if os.path.isdir(path):
        path = os.path.join(path, INDEX_NAME)
    elif not path.endswith(".json"):
        path = os.path.join(os.path.dirname(path), INDEX_NAME)
    return load_index(path) if os.path.isfile(path) else None


def is_shard_spec(spec: str) -> bool:
    """Whether `spec` names shards (rather than an image folder or an HF dataset directory)."""
    spec = str(spec)
    if _REMOTE.match(spec) or "::" in spec or len(_split_spec(spec)) > 1:
        return True
    path = os.path.expanduser(spec)
    if path.endswith((".tar", ".tar.gz", ".tgz", ".json")) or "{" in path:
        return True
    if os.path.isdir(path):
        return (
            os.path.isfile(os.path.join(path, INDEX_NAME))
            or bool(glob.glob(os.path.join(path, "*.tar")))
            or bool(parts_in(path))
        )
    return False
