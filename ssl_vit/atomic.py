"""Writes that a failure or a kill cannot leave half done, and reads that survive one.

- `staged_dir(target)`: a directory (a shard dataset, an export) is built in a hidden sibling
  and renamed into place only when complete (POSIX `rename`, as Git's `index.lock`): a failed or
  SIGKILLed writer leaves the old directory exactly as it was; its leftovers are removed by the
  next writer of the same target.
- `read_jsonl(path)`: an append-only log read back tolerating a torn last line (disk full,
  power loss, a kill mid-write), which is dropped with a warning naming the file; a bad line
  anywhere else is corruption: one error naming file:line.
- `replacing(path)`: THE way to write a file the project promises is atomic. A context
  manager yielding a temporary sibling path to write (any writer: `open`, `torch.save`,
  safetensors' `save_file`); when the block ends normally the file is fsynced and renamed over
  `path` (POSIX `rename`), then the directory is fsynced. An exception inside the block leaves
  the old `path` exactly as it was and no temporary file behind (a SIGKILL leaves one,
  `.NAME.tmp-PID`, which `clean_temporary` removes); a storage failure
  becomes one `WriteError` naming `path`. `write_bytes` / `write_text` / `write_json` are the
  one-call forms; `publish_dir(staging, target)` is the same for a directory that several
  processes fill (a checkpoint), `staged_dir` for one that this process fills.
- `writing(path)`: a failed write (disk full, quota, file too large, read-only) becomes one
  `WriteError` line naming the path instead of a traceback.
- `file_sha256(path)`: what the manifests of checkpoints and labelled copies record of a file
  written, to find it damaged later.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ssl_vit.errors import InputError, WriteError
from ssl_vit.jsonfile import dump_json

__all__ = [
    "WriteError",
    "clean_staging",
    "clean_temporary",
    "file_sha256",
    "read_jsonl",
    "publish_dir",
    "replacing",
    "staged_dir",
    "write_bytes",
    "write_json",
    "write_text",
    "writing",
]

log = logging.getLogger(__name__)

_STAGING, _OLD, _TMP = ".staging-", ".old-", ".tmp-"


# Errors of the storage, not of the program: reported as one line naming the file.
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.EACCES}
_LIBRARY_WRITE_ERROR = re.compile(
    r"I/O error|write failed|No space left|File too large|quota exceeded", re.IGNORECASE
)


@contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Turn a storage failure inside the block into `WriteError("cannot write PATH: ...")`.

    torch.save (a RuntimeError, "file write failed") and safetensors (SafetensorError, "I/O
    error: ...") report a failed write in their own types; those are caught too."""
    try:
        yield
    except WriteError:
        raise
    except OSError as e:
        if e.errno not in _STORAGE_ERRNOS:
            raise
        raise WriteError(e.errno, f"cannot write {path}: {e.strerror or e}") from None
    except Exception as e:
        cause = _storage_cause(e)
        if cause is not None:  # torch.save into a file object: "[enforce fail at ...]"
            raise WriteError(f"cannot write {path}: {cause.strerror}") from None
        if not _LIBRARY_WRITE_ERROR.search(str(e)):
            raise
        raise WriteError(f"cannot write {path}: {str(e).splitlines()[0]}") from None


def _storage_cause(e: BaseException) -> OSError | None:
    """The storage OSError (disk full, file too large...) that `e` was raised in handling of:
    torch's zip writer reports a failed write of its file object as a RuntimeError."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
            return e
        e = e.__cause__ or e.__context__
    return None


def _fsync(path: Path) -> None:
    """Flush `path` (a file or a directory: a rename is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write; on normal exit it is fsynced and renamed
    over `path`. On an exception `path` is left as it was and the temporary file is removed;
    a storage failure (disk full, read-only...) is one `WriteError` naming `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{_TMP}{os.getpid()}")
    try:
        with writing(path):
            yield tmp
            _fsync(tmp)
            os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def clean_temporary(
    folder: str | os.PathLike, names: Iterable[str] = ("*",), pid: int | None = None
) -> list[Path]:
    """Remove the temporary files of `replacing` (`.NAME.tmp-PID`) that a killed writer left in
    `folder`: those of the files `names` (glob patterns), of process `pid` only (this process's
    own, after a stop) or, with None, of any process: the caller owns the folder (a run
    directory it has locked), so none is being written. -> the files removed."""
    removed = []
    for name in names:
        for p in Path(folder).glob(f".{name}{_TMP}*"):
            owner = p.name.rpartition(_TMP)[2]
            if owner.isdigit() and pid in (None, int(owner)) and not p.is_dir():
                p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace the file `path` by `data` atomically (`replacing`)."""
    with replacing(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Replace the file `path` by `text` atomically (`replacing`)."""
    write_bytes(path, text.encode())


def write_json(path: str | os.PathLike, value: Any, indent: int | None = 1) -> None:
    """Replace the file `path` by `value` as strict JSON and a newline, atomically
    (`replacing`); a non-finite float is a JsonFileError naming it (`jsonfile.dump_json`)."""
    write_text(path, dump_json(value, str(path), indent) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[Any]:
    """The JSON values of an append-only log, one per line (blank lines ignored).

    A last line that does not parse (a torn write) is dropped with a warning naming the file;
    a bad line before it raises ValueError naming `file:line`."""
    path = Path(path)
    lines = path.read_text(errors="replace").split("\n")
    rows: list[Any] = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except (json.JSONDecodeError, RecursionError) as e:  # a line nested 10^5 deep: corrupt
            why = getattr(e, "msg", "nested too deeply")
            if i == last:
                log.warning("%s: dropping its torn last line %d (%s)", path, i + 1, why)
                continue
            raise InputError(f"{path}:{i + 1}: corrupt line ({why})") from None
    return rows


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_staging(target: str | os.PathLike) -> None:
    """Remove what a killed writer of `target` left beside it: a half-built staging directory
    (its process gone), and restore an old directory set aside if the swap was cut short."""
    target = Path(target)
    if not target.parent.is_dir():
        return
    for p in target.parent.glob(f".{target.name}.*"):
        kind, _, pid = p.name[len(target.name) + 2 :].partition("-")
        if not pid.isdigit() or _pid_alive(int(pid)) and int(pid) != os.getpid():
            continue
        if f".{kind}-" == _OLD and not target.exists():
            log.warning("restoring %s from an interrupted replacement", target)
            os.rename(p, target)
        elif f".{kind}-" in (_STAGING, _OLD):
            log.info("removing %s, left by a killed writer", p)
            shutil.rmtree(p, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False if the
    system cannot."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def publish_dir(staging: str | os.PathLike, target: str | os.PathLike) -> None:
    """Put the complete directory `staging` (a hidden sibling) at `target`, replacing what is
    there, and make the rename durable. The caller has fsynced the files in `staging`."""
    staging, target = Path(staging), Path(target)
    with writing(target):
        _swap_in(staging, target)
        _fsync(target.parent)


def _swap_in(staging: Path, target: Path) -> None:
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    if not target.exists():
        os.rename(staging, target)
        return
    if _exchange(staging, target):
        shutil.rmtree(staging)  # now the old contents
        return
    # Two renames; a kill between them is undone by `clean_staging` (the old one comes back).
    old = target.parent / f".{target.name}{_OLD}{os.getpid()}"
    os.rename(target, old)
    os.rename(staging, target)
    shutil.rmtree(old)


@contextmanager
def staged_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty hidden sibling of `target` to fill; when the block ends normally it
    replaces `target` (created if missing), on an exception it is removed and `target` is left
    as it was. The caller decides beforehand whether replacing `target` is allowed."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target}: exists and is not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_staging(target)  # this process's own earlier staging directory included
    staging = target.parent / f".{target.name}{_STAGING}{os.getpid()}"
    try:  # (made inside: a stop signal right after the mkdir still removes it)
        staging.mkdir()
        yield staging
        publish_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
