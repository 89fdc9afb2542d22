"""`ShardWriter`: samples -> `shard-NNNNNN.tar` files and their `index.json`, put in place whole.

The format is `ssl_vit.data.format`'s; `ssl_vit.data.write.convert.make_shards` fills a writer
from an image folder or HF dataset, the dataset generators (`ssl_vit.datasets`) from theirs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import webdataset as wds

from ssl_vit.atomic import staged_dir
from ssl_vit.data.format import INDEX_NAME, SHARD_FORMAT, SHARD_NAME, check_key, shard_name
from ssl_vit.errors import ConfigError, InputError
from ssl_vit.jsonfile import dump_json, read_json

__all__ = ["ShardWriter", "check_output", "check_replaceable"]

# Fixed integer member mtime: the same input gives byte-identical shards. (TarWriter's default
# is time.time(), a float, for which tarfile writes a pax header before every member.)
_MTIME = 0


def check_output(output: str | os.PathLike) -> None:
    """ValueError (one line) if the dataset directory `output` is a symbolic link: a dataset is
    built beside it and renamed over it, which would put the new folder in place of the link
    and leave the user's link renamed, not write into the folder it points to."""
    if os.path.islink(output):
        raise InputError(
            f"{output} is a symbolic link (to {os.readlink(output)}): name the folder itself"
        )


def _own(entry: os.DirEntry) -> bool:
    """`entry` is a file a `ShardWriter` writes: a regular file named `shard-NNNNNN.tar`, or
    an index.json of this format (a FIFO, a link or a folder of that name is not)."""
    if not entry.is_file(follow_symlinks=False):
        return False
    if SHARD_NAME.fullmatch(entry.name):
        return True
    if entry.name != INDEX_NAME:
        return False
    try:
        index = read_json(entry.path)  # bounded in size and depth: anyone's index.json
    except (OSError, ValueError):
        return False
    return isinstance(index, dict) and index.get("format") == SHARD_FORMAT


def check_replaceable(output: str | os.PathLike) -> None:
    """ValueError (one line) unless `output` is missing, empty or a shard dataset with nothing
    else in it: the new dataset is swapped in for the whole folder, so a file of anyone else
    there (notes, a source folder, a run's files, a FIFO) would be lost or copied. Nothing is
    opened but an index.json."""
    if not os.path.isdir(output):
        return
    with os.scandir(output) as entries:
        others = sorted(e.name for e in entries if not _own(e))
    if others:
        named = ", ".join(others[:4] + ["..."] * (len(others) > 4))
        raise InputError(
            f"{output}: holds {named}, not a shard dataset's own files "
            "(shard-NNNNNN.tar, index.json): write the shards to a new or empty folder"
        )


class ShardWriter:
    """Write samples into `shard-NNNNNN.tar` files of `shard_size` samples, then `index.json`.

    Everything is written into a hidden sibling of `output` that replaces it only when `close()`
    has written the index (`ssl_vit.atomic.staged_dir`): a failed or killed run leaves an
    existing dataset at `output` exactly as it was, never old and new shards mixed. `output` is
    checked on creation (`check_output`, `check_replaceable`), the latter again before the swap.
    Use as a context manager, ending with `close(...)`.
    """

    def __init__(self, output: str | os.PathLike, shard_size: int = 10000) -> None:
        if shard_size < 1:
            raise ConfigError(f"shard_size must be >= 1, got {shard_size}")
        check_output(output)
        check_replaceable(output)
        self.target = Path(output)
        self.shard_size = shard_size
        self._staged = staged_dir(self.target)
        self.output = self._staged.__enter__()  # where the shards are written until close()
        # The index's shard entries so far (a caller may add fields before `close`).
        self.shards: list[dict[str, Any]] = []
        self._keys: set[str] = set()
        self._tar: wds.TarWriter | None = None

    def _finish_shard(self) -> None:
        # No per-file rename: the shards are written inside the staged directory, which
        # becomes the dataset in one rename (`close`) and is never seen half written.
        if self._tar is not None:
            self._tar.close()
            self._tar = None

    def write(self, key: str, ext: str, data: bytes, label: int | None = None) -> None:
        """Add one sample: `{key}.{ext}` = `data` and, if `label` is not None, `{key}.cls`."""
        check_key(key, ext)
        if key in self._keys:
            raise InputError(f"duplicate sample key {key!r}")
        if self._tar is None or self.shards[-1]["num_samples"] == self.shard_size:
            self._finish_shard()
            self.shards.append({"name": shard_name(len(self.shards)), "num_samples": 0})
            path = self.output / self.shards[-1]["name"]
            self._tar = wds.TarWriter(str(path), encoder=False, mtime=_MTIME)
        sample: dict[str, Any] = {"__key__": key, ext: bytes(data)}
        if label is not None:
            sample["cls"] = str(int(label)).encode("ascii")
        self._tar.write(sample)
        self._keys.add(key)
        self.shards[-1]["num_samples"] += 1

    def close(
        self, *, label_names: list[str], source: str, num_skipped: int = 0, **extra: Any
    ) -> dict[str, Any]:
        """Finish the last shard, write the index, put the dataset in place; return the index."""
        self._finish_shard()
        index = {
            "format": SHARD_FORMAT,
            "num_samples": sum(s["num_samples"] for s in self.shards),
            "num_skipped": num_skipped,
            "label_names": list(label_names),
            "shards": self.shards,
            "source": source,
            **extra,
        }
        (self.output / INDEX_NAME).write_text(dump_json(index, INDEX_NAME, indent=1) + "\n")
        check_replaceable(self.target)  # nothing of anyone else's was put there meanwhile
        self._staged.__exit__(None, None, None)  # the new dataset replaces the old one
        self._staged = None
        return index

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._finish_shard()
        if self._staged is not None:  # failed (or never closed): the old dataset stays
            self._staged.__exit__(exc_type or RuntimeError, exc or RuntimeError(), tb)
            self._staged = None
