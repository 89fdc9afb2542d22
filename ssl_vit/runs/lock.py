"""A run directory belongs to one job at a time: an exclusive `flock` on `<run dir>/.lock`,
held for the job's life. The OS drops it when the process ends in any way (a crash, SIGKILL),
so it is never left held; a second job on the same directory fails at once with one line
naming it and the holder. `on_main` claims on the main process only, and tells every process
whether it could."""

from __future__ import annotations

import fcntl
import os
import socket
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ssl_vit.errors import ConfigError

__all__ = ["LOCK_NAME", "RunLock", "lock_held", "lock_run_dir", "on_main"]

T = TypeVar("T")

LOCK_NAME = ".lock"
_held: weakref.WeakValueDictionary[Path, RunLock] = weakref.WeakValueDictionary()


class RunLock:
    """An open, exclusively locked `.lock` file; closing it (or the process ending) unlocks."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = -1

    def __del__(self) -> None:
        self.release()


def lock_run_dir(run_dir: str | Path, key: str = "output_dir") -> RunLock:
    """Lock `run_dir` (created if missing) for this process; ConfigError if another holds it.

    The same process locking it again gets the lock it holds (jobs run in-process by tests)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = (run_dir / LOCK_NAME).resolve()
    held = _held.get(path)
    if held is not None and held.fd >= 0:
        return held
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"{key}={str(run_dir)!r}: in use by another job ({holder}); wait for it to end or "
            "use another directory"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    lock = RunLock(path, fd)
    _held[path] = lock
    return lock


def lock_held(folder: Path) -> bool:
    """`folder/.lock` is held by a live job (this process included)."""
    path = folder / LOCK_NAME
    if not path.is_file():
        return False
    held = _held.get(path.resolve())
    if held is not None and held.fd >= 0:
        return True
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released by the close below
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def on_main(acc: Any, claim: Callable[[], T]) -> T | None:
    """`claim()` on the main process (None elsewhere); its ConfigError or OSError reaches every
    process as a ConfigError (one broadcast), so no process starts where the main one could not
    claim what the job writes."""
    result, error = None, None
    if acc.is_main_process:
        try:
            result = claim()
        except (ConfigError, OSError) as e:
            error = str(e)
    if acc.num_processes > 1:
        from accelerate.utils import broadcast_object_list  # (torch: only when distributed)

        error = broadcast_object_list([error])[0]
    if error is not None:
        raise ConfigError(error if acc.is_main_process else f"main process: {error}")
    return result
