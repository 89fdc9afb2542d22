"""Reading tar shards: the one tar reader (`tar_members`), its samples (`tar_groups`) and the
opener of a shard URL.

Every reader of shards goes through `tar_groups`: the training and evaluation streams
(`ssl_vit.data.stages.shard_samples`) and `ShardSource` (by index, and listing the labels of a
whole dataset without reading its images, which is why the reader is our own: see
`tar_members`). Samples are grouped as WebDataset groups them (`base_plus_ext`), so a key means
the same sample to every reader.
"""

from __future__ import annotations

import os
import re
import tarfile
from collections.abc import Callable, Iterator
from functools import partial
from typing import IO, Any

import webdataset as wds
from webdataset.gopen import Pipe
from webdataset.tariterators import base_plus_ext

from ssl_vit.watchdog import track_pipe

__all__ = ["open_url", "tar_groups", "tar_members"]

# Members WebDataset skips as metadata (`__key__`-like names), skipped alike.
_META = re.compile(r"__[^/]*__($|/)")


def _read_at(f: IO[bytes], offset: int, size: int) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:  # a truncated tar: as tarfile reports it
        raise tarfile.ReadError("unexpected end of data")
    return data


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
    goes through tarfile. Errors are tarfile's: an empty file, or a member cut short, raises
    `tarfile.ReadError`; a tar cut at a header ends there.
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
            if offset == 0 and len(header) < 512:  # as tarfile: not a tar at all
                raise tarfile.ReadError("empty file")
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


def tar_groups(
    url: str,
    wanted: set[int] | None = None,
    suffixes: tuple[str, ...] | None = None,
    on_error: Callable[[Exception], Any] | None = None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(i, {"__key__": key, suffix: bytes, ...}) for the i-th sample (key group) of a tar.

    Only samples in `wanted` (all if None) are yielded, and only `suffixes` (lower case; all if
    None) are read: listing the labels of a shard reads its `.cls` members alone. A second
    member of one suffix in a sample is skipped (reported to `on_error`). With `on_error`, an
    error reading the tar (a missing, unreadable or truncated shard) is passed to it with the
    URL and ends the tar, after the sample read so far; without, it is raised.
    """
    group: dict[str, Any] | None = None
    i = -1
    last = max(wanted, default=-1) if wanted is not None else None
    try:
        for name, read in tar_members(url):
            key, suffix = base_plus_ext(name)
            if key is None or _META.match(name):
                continue
            if group is None or key != group["__key__"]:
                if group is not None and (wanted is None or i in wanted):
                    yield i, group
                if last is not None and i >= last:
                    return
                group, i = {"__key__": key}, i + 1
            suffix = suffix.lower()
            if suffix in group:
                if on_error is not None:
                    on_error(ValueError(f"{name}: duplicate file name in tar file {url}"))
                continue
            if (suffixes is None or suffix in suffixes) and (wanted is None or i in wanted):
                group[suffix] = read()
    except Exception as exn:
        if on_error is None:
            raise
        exn.args = (*exn.args, url)
        on_error(exn)
    if group is not None and (wanted is None or i in wanted):
        yield i, group
