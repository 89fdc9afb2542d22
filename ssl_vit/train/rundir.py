"""A run directory belongs to one job at a time and holds one run.

- `lock_run_dir`: an exclusive `flock` on `<run dir>/.lock`, held for the job's life. The OS
  drops it when the process ends in any way (a crash, SIGKILL), so it is never left held; a
  second job on the same directory fails at once with one line naming it.
- `claim_run_dir`: starting over a directory that holds a run needs `--resume` (continue it)
  or `--overwrite` (its run files are removed first); two runs are never mixed in one directory.
  With `--resume`, a config that changes the model's shape is refused (one line naming the
  keys) and every other changed key is logged as a warning.
- `config.yaml` is written only once all of this passed, so a refused or failed start never
  changes what a later `--resume` reads.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import weakref
from pathlib import Path
from typing import Any

import yaml

from ssl_vit.atomic import write_text
from ssl_vit.config import ConfigError, to_dict

__all__ = ["LOCK_NAME", "RunLock", "claim_run_dir", "lock_run_dir", "run_files"]

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
# What the jobs write into a run directory (pipelines, metrics trackers); --overwrite removes
# these and nothing else, so a mistyped output_dir never loses unrelated files.
RUN_FILES = (
    *("config.yaml", "metrics.jsonl", "results.json", "checkpoints"),
    *("model.safetensors", "labels.json", "keys_rank*.txt", "events.out.tfevents.*"),
    *("mlruns", "wandb"),
)
# Keys whose change on --resume would load a checkpoint into another architecture.
SHAPE_KEYS = ("model.", "objective.target")

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


def run_files(run_dir: Path) -> list[Path]:
    """The files of a run that `run_dir` holds (empty `checkpoints/` excluded)."""
    found = sorted({p for pattern in RUN_FILES for p in run_dir.glob(pattern)})
    return [p for p in found if not (p.is_dir() and not any(p.iterdir()))]


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _check_resumed_config(run_dir: Path, cfg: Any) -> None:
    """Refuse a changed shape on --resume; log every other changed key."""
    saved_file = run_dir / "config.yaml"
    if not saved_file.is_file():
        return
    try:
        saved = _flat(yaml.safe_load(saved_file.read_text()) or {})
    except yaml.YAMLError as e:
        raise ConfigError(f"{saved_file}: unreadable ({str(e).splitlines()[0]})") from None
    new = _flat(to_dict(cfg))
    # Keys only one side has (a config written by another version) cannot be compared.
    changed = [k for k in sorted(set(saved) & set(new)) if saved[k] != new[k]]
    changed = [k for k in changed if k != "output_dir"]
    shape = [k for k in changed if k.startswith(SHAPE_KEYS)]
    if shape:
        diffs = ", ".join(f"{k} {saved[k]!r} -> {new[k]!r}" for k in shape)
        raise ConfigError(
            f"--resume: the run in {run_dir} has another model shape ({diffs}); resume with its "
            f"config, or start a new run in another output_dir"
        )
    for k in changed:
        log.warning("--resume with a changed %s: %r -> %r", k, saved[k], new[k])


def claim_run_dir(
    run_dir: str | Path, cfg: Any, *, resume: bool = False, overwrite: bool = False
) -> RunLock:
    """Lock `run_dir`, apply the resume / overwrite rule, then write `config.yaml` (main
    process only). Raises ConfigError (one line) when the directory may not be used."""
    run_dir = Path(run_dir)
    if not str(cfg.output_dir).strip():
        raise ConfigError("output_dir: empty; name the run directory")
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite: pick one (continue the run, or replace it)")
    lock = lock_run_dir(run_dir)
    try:
        _apply_policy(run_dir, cfg, resume, overwrite)
        write_text(run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
    except BaseException:
        lock.release()  # refused: the directory is free again at once
        raise
    return lock


def _apply_policy(run_dir: Path, cfg: Any, resume: bool, overwrite: bool) -> None:
    existing = run_files(run_dir)
    if existing and overwrite:
        log.warning("--overwrite: removing the earlier run's files in %s", run_dir)
        for p in existing:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    elif existing and not resume:
        names = ", ".join(p.name for p in existing[:4]) + (", ..." if len(existing) > 4 else "")
        raise ConfigError(
            f"output_dir={str(run_dir)!r}: holds a run ({names}); pass --resume to continue "
            "it or --overwrite to replace it"
        )
    elif resume:
        _check_resumed_config(run_dir, cfg)
