"""WebDataset shards: the format, writing it, finding shards and reading them member by member.

(`ssl_vit.data.convert.make_shards` fills a `ShardWriter` from an image folder or HF dataset.)

Shard format ("ssl-vit-shards/1"): `shard-000000.tar`, `shard-000001.tar`, ... in one directory,
each a plain tar holding per sample `{key}.{ext}` (the ORIGINAL encoded image bytes, re-encoded
only when `make-shards --max-size` shrinks the image) and, for labelled sources, `{key}.cls`
(the integer label as ASCII text). Keys are unique and contain no dots: WebDataset groups tar
members into samples by the part of the name before the first dot. `index.json`, written last,
holds `{"format", "num_samples", "num_skipped", "label_names", "shards": [{"name",
"num_samples"}], "source"}`; with `--max-size` also `"resize"` (the setting, how many images
were resized and copied) and per shard `"original_sizes"` ("WxH WxH ..." in sample order); a
part of a dataset written in parts (`ssl_vit.data.parts`) also `"part": [I, N]`,
`"source_samples"` and `"conversion"` (`{"format", "split", "verify"}`: with the source and the
resize setting, what parts of one dataset must share)."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import tarfile
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import IO, Any

import braceexpand
import webdataset as wds
from webdataset.gopen import Pipe

from ssl_vit.atomic import staged_dir
from ssl_vit.data.parts import PART_DIR, check_parts_agree, complete_parts, holds_parts
from ssl_vit.jsonfile import read_json
from ssl_vit.watchdog import track_pipe

__all__ = [
    "IMAGE_EXTENSIONS",
    "INDEX_NAME",
    "SHARD_FORMAT",
    "ShardWriter",
    "check_output",
    "is_shard_spec",
    "read_index",
    "resolve_shards",
    "open_url",
    "sample_fields",
    "tar_members",
]

log = logging.getLogger(__name__)

SHARD_FORMAT = "ssl-vit-shards/1"
INDEX_NAME = "index.json"
# Lower-case suffixes (no dot) treated as images, in the order a sample's members are tried.
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm")
_REMOTE = re.compile(r"^(pipe:|[a-zA-Z][a-zA-Z0-9+.-]*://)")
_EXT = re.compile(r"[a-z0-9]+")
# A writer's own shard names (`shard-{n:06d}.tar`): with index.json, the only files of `output`
# it replaces (a `shard-notes.txt` is kept).
_SHARD_NAME = re.compile(r"shard-[0-9]{6,}\.tar")
# Fixed integer member mtime: the same input gives byte-identical shards. (TarWriter's default
# is time.time(), a float, for which tarfile writes a pax header before every member.)
_MTIME = 0


def check_output(output: str | os.PathLike) -> None:
    """ValueError (one line) if the dataset directory `output` is a symbolic link: a dataset is
    built beside it and renamed over it, which would put the new folder in place of the link
    and leave the user's link renamed, not write into the folder it points to."""
    if os.path.islink(output):
        raise ValueError(
            f"{output} is a symbolic link (to {os.readlink(output)}): name the folder itself"
        )


class ShardWriter:
    """Write samples into `shard-NNNNNN.tar` files of `shard_size` samples, then `index.json`.

    Everything is written into a hidden sibling of `output` that replaces it only when `close()`
    has written the index (`ssl_vit.atomic.staged_dir`): a failed or killed run leaves an
    existing dataset at `output` exactly as it was, never old and new shards mixed. Files of
    `output` that are not shards (a README) are carried over. Use as a context manager;
    `close(...)` finishes the last shard, writes the index and puts the dataset in place. An
    `output` that is a symbolic link is refused (`check_output`).
    """

    def __init__(self, output: str | os.PathLike, shard_size: int = 10000) -> None:
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        check_output(output)
        self.target = Path(output)
        self.shard_size = shard_size
        self._staged = staged_dir(self.target)
        self.output = self._staged.__enter__()  # where the shards are written until close()
        self._shards: list[dict[str, Any]] = []
        self._keys: set[str] = set()
        self._tar: wds.TarWriter | None = None
        self._count = 0

    def _tmp_path(self) -> Path:
        return self.output / (self._shards[-1]["name"] + ".tmp")

    def _finish_shard(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        self._tar = None
        self._shards[-1]["num_samples"] = self._count
        os.replace(self._tmp_path(), self.output / self._shards[-1]["name"])

    def write(self, key: str, ext: str, data: bytes, label: int | None = None) -> None:
        """Add one sample: `{key}.{ext}` = `data` and, if `label` is not None, `{key}.cls`."""
        if not key or "." in key or "/" in key or key.startswith("__"):
            raise ValueError(f"invalid sample key {key!r} (must be non-empty, no '.', '/', '__')")
        if key in self._keys:
            raise ValueError(f"duplicate sample key {key!r}")
        if not _EXT.fullmatch(ext):
            raise ValueError(f"invalid image extension {ext!r}")
        if self._tar is None or self._count == self.shard_size:
            self._finish_shard()
            self._shards.append({"name": f"shard-{len(self._shards):06d}.tar", "num_samples": 0})
            self._tar = wds.TarWriter(str(self._tmp_path()), encoder=False, mtime=_MTIME)
            self._count = 0
        sample: dict[str, Any] = {"__key__": key, ext: bytes(data)}
        if label is not None:
            sample["cls"] = str(int(label)).encode("ascii")
        self._tar.write(sample)
        self._keys.add(key)
        self._count += 1
        self._shards[-1]["num_samples"] = self._count

    @property
    def shards(self) -> list[dict[str, Any]]:
        """The index's shard entries so far (live: a caller may add fields before `close`)."""
        return self._shards

    def close(
        self, *, label_names: list[str], source: str, num_skipped: int = 0, **extra: Any
    ) -> dict[str, Any]:
        """Finish the last shard, write the index, put the dataset in place; return the index."""
        self._finish_shard()
        index = {
            "format": SHARD_FORMAT,
            "num_samples": sum(s["num_samples"] for s in self._shards),
            "num_skipped": num_skipped,
            "label_names": list(label_names),
            "shards": self._shards,
            "source": source,
            **extra,
        }
        (self.output / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n")
        self._carry_over_other_files()
        self._staged.__exit__(None, None, None)  # the new dataset replaces the old one
        self._staged = None
        return index

    def _carry_over_other_files(self) -> None:
        if not self.target.is_dir():
            return
        for p in self.target.iterdir():
            shard_file = p.name == INDEX_NAME or _SHARD_NAME.fullmatch(p.name)
            if shard_file or (self.output / p.name).exists():
                continue
            if p.is_dir():
                shutil.copytree(p, self.output / p.name, symlinks=True)
            else:
                shutil.copy2(p, self.output / p.name, follow_symlinks=False)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None
        if self._staged is not None:  # failed (or never closed): the old dataset stays
            self._staged.__exit__(exc_type or RuntimeError, exc or RuntimeError(), tb)
            self._staged = None


# --------------------------------------------------------------------------------------------
# Finding shards


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
    index = _load_index(index_path)
    folder = os.path.dirname(index_path)
    paths = [os.path.join(folder, s["name"]) for s in index["shards"]]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} shard(s) listed in {index_path} are missing, e.g. {missing[0]}"
        )
    return paths


def _resolve_dir(path: str, part: str) -> list[str]:
    """The shards of a directory: its index.json, its parts (`ssl_vit.data.parts`, all of
    them, each by its index), else its sorted *.tar."""
    if os.path.isfile(os.path.join(path, INDEX_NAME)):
        return _shards_from_index(os.path.join(path, INDEX_NAME))
    parts = complete_parts(path)
    if parts is not None:
        return [url for d in parts for url in _shards_from_index(str(d / INDEX_NAME))]
    paths = sorted(glob.glob(os.path.join(path, "*.tar")))
    if not paths:
        raise FileNotFoundError(f"no shards (*.tar) in directory {part}")
    return paths


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
    (`ssl_vit.data.parts.check_parts_agree`): ValueError.
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
            by_root.setdefault(root, []).append((Path(folder), _load_index(index)))
    for parts in by_root.values():
        check_parts_agree(parts)


def _load_index(path: str) -> dict[str, Any]:
    index = read_json(path)  # bounded: an index nested 200,000 deep is one line naming it
    if index.get("format") != SHARD_FORMAT:
        raise ValueError(f"{path} is not a shard index (format {SHARD_FORMAT!r})")
    shards, names = index.get("shards"), index.get("label_names")
    entries_ok = isinstance(shards, list) and all(
        isinstance(s, dict) and isinstance(s.get("name"), str) and type(s.get("num_samples")) is int
        for s in shards
    )
    if not entries_ok or not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError(
            f"{path}: a damaged shard index (need shards: [{{name, num_samples}}], "
            "label_names: [names])"
        )
    return index


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
    return _load_index(path) if os.path.isfile(path) else None


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
            or holds_parts(path)
        )
    return False


# --------------------------------------------------------------------------------------------
# Reading shards member by member


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


def _read_at(f: IO[bytes], offset: int, size: int) -> bytes:
    f.seek(offset)
    return f.read(size)


def _tarfile_members(tar: tarfile.TarFile) -> Iterator[tuple[str, Callable[[], bytes]]]:
    for info in tar:
        if info.isreg():
            yield info.name, partial(lambda t, i: t.extractfile(i).read(), tar, info)


def _pax_records(data: bytes) -> dict[str, str]:
    """Records of a pax extended header: b"<len> <key>=<value>\\n" ..."""
    records, pos = {}, 0
    while pos < len(data) and data[pos : pos + 1] != b"\0":
        space = data.index(b" ", pos)
        end = pos + int(data[pos:space])
        key, _, value = data[space + 1 : end - 1].partition(b"=")
        records[key.decode()] = value.decode("utf-8", "replace")
        pos = end
    return records


def open_url(url: str) -> IO[bytes]:
    """A URL's byte stream; a `pipe:` command runs in its own session, so that it and every
    child it starts are killed as one process group when the job ends on any path."""
    if not url.startswith("pipe:"):
        return wds.gopen(url)
    # As webdataset's gopen_pipe (141: the command killed by SIGPIPE when we stop reading).
    pipe = Pipe(
        url[5:], mode="rb", shell=True, bufsize=8192, ignore_status=[141], start_new_session=True
    )
    track_pipe(pipe.proc.pid)
    return pipe


def tar_members(url: str) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """(name, read) for each regular file of a tar, in order; `read()` returns its bytes and
    must be called before the next member is requested.

    A local uncompressed tar is read by parsing its ustar/pax headers directly and seeking past
    the data it is not asked for: tarfile spends ~40 us on each header (5 s to list the labels
    of 50k samples), this ~2 us. Anything else (compressed, GNU long names, links, remote URLs)
    goes through tarfile.
    """
    if not os.path.isfile(url):
        with tarfile.open(fileobj=open_url(url), mode="r|*") as tar:
            yield from _tarfile_members(tar)
        return
    with open(url, "rb") as f:
        if f.read(6).startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ")):  # gzip, bzip2, xz
            f.seek(0)
            with tarfile.open(fileobj=f, mode="r:*") as tar:
                yield from _tarfile_members(tar)
            return
        offset, pax = 0, {}
        while True:
            f.seek(offset)
            header = f.read(512)
            if len(header) < 512 or not header.strip(b"\0"):  # end of archive (or truncated)
                return
            kind = header[156:157]
            if header[257:262] != b"ustar" or kind not in (b"0", b"\0", b"5", b"x", b"g"):
                f.seek(offset)  # let tarfile take over from this header on
                with tarfile.open(fileobj=f, mode="r:") as tar:
                    yield from _tarfile_members(tar)
                return
            size = int(header[124:136].strip(b"\0 ") or b"0", 8)
            data_at, next_at = offset + 512, offset + 512 + (size + 511) // 512 * 512
            if kind == b"x":  # pax header: overrides for the next member (path, size, ...)
                pax = _pax_records(_read_at(f, data_at, size))
            elif kind != b"g":  # (global pax headers hold nothing we need)
                name = header[0:100].rstrip(b"\0").decode("utf-8", "replace")
                prefix = header[345:500].rstrip(b"\0").decode("utf-8", "replace")
                name = pax.get("path", f"{prefix}/{name}" if prefix else name)
                size = int(pax.get("size", size))
                next_at = data_at + (size + 511) // 512 * 512
                if kind != b"5":
                    yield name, partial(_read_at, f, data_at, size)
                pax = {}
            offset = next_at
